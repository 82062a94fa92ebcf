"""Text sources: the Hugging Face hub, local files, or synthetic stories -> train/validation texts.

Every source is resolved in two steps. :func:`resolve_source` only looks at names, sizes and
mtimes (no reading), which is enough for the cache key, so a cached dataset is reused even
offline. :func:`load_texts` then reads the stories into ``datasets.Dataset`` objects with one
``text`` column per split.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

from posbench.core.errors import PosbenchError
from posbench.core.io import file_sha256
from posbench.data.config import DataConfig, absolute_path
from posbench.data.synthetic import generate_stories

SYNTHETIC_VERSION = 1  # bump when the generator's output changes, to invalidate caches
SUPPORTED = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".parquet")
SEPARATOR = "<|endoftext|>"
HOLDOUT_SEED = 0
SAMPLE_DIR = Path(__file__).with_name("sample")  # the TinyStories sample shipped with posbench
OFFLINE_HINT = ("data=sample (the TinyStories sample shipped with posbench) or "
                "data=local data.path=<dir with train.txt.gz/valid.txt.gz>")
# Whole name parts (a file name split at anything that is not a letter) -> split. Substrings
# are not enough: "pretrain_valid.txt" is validation text, "restrained_valid.txt" too.
SPLIT_NAME_PARTS = {"train": "train", "valid": "validation", "validation": "validation",
                    "val": "validation", "dev": "validation", "test": "test"}


@dataclass
class SourceSpec:
    """A resolved source: what the cache key needs, without any text read yet."""

    kind: str
    identity: dict[str, Any]
    description: str
    train_files: list[Path] = field(default_factory=list)
    valid_files: list[Path] = field(default_factory=list)
    test_files: list[Path] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    """One line per file that was left out, saying why (logged by ``prepare_data``)."""


@dataclass
class TextSplits:
    """Training, validation and (local files only) test stories, each a ``datasets.Dataset``
    with a ``text`` column; ``test`` is None when there is no test text."""

    train: Any
    validation: Any
    test: Any = None

    def __getitem__(self, split: str) -> Any:
        return {"train": self.train, "validation": self.validation, "test": self.test}[split]


def resolve_source(cfg: DataConfig) -> SourceSpec:
    """Resolve ``cfg`` into a :class:`SourceSpec` (local files are listed and stat-ed only)."""
    if cfg.source == "hub":
        ident = {"kind": "hub", "name": cfg.hub_name, "config": cfg.hub_config,
                 "train_split": cfg.train_split, "valid_split": cfg.valid_split}
        return SourceSpec("hub", ident, f"hub {cfg.hub_name}" + (f" ({cfg.hub_config})" if cfg.hub_config else ""))
    if cfg.source == "synthetic":
        ident = {"kind": "synthetic", "version": SYNTHETIC_VERSION, "seed": cfg.synthetic_seed,
                 "train": cfg.synthetic_train_stories, "valid": cfg.synthetic_valid_stories}
        return SourceSpec("synthetic", ident, f"synthetic stories (seed {cfg.synthetic_seed})")
    if cfg.source not in ("local", "sample"):
        cfg.validate()  # raises the unknown-source error
    files = _expand([str(SAMPLE_DIR)] if cfg.source == "sample" else cfg.path_list())
    splits, ignored = classify(files)
    train, valid, test = splits["train"], splits["validation"], splits["test"]
    # The packaged sample is known by its content (4 MB, hashed in ~10 ms), so every checkout and
    # install of posbench shares one cache; local files by path, size and mtime (no reading).
    identify = _content if cfg.source == "sample" else _stat
    ident: dict[str, Any] = {
        "kind": cfg.source,
        "train": [identify(p) for p in train],
        "valid": [identify(p) for p in valid],
    }
    if test:  # only when present, so caches made before test files were recognised stay valid
        ident["test"] = [identify(p) for p in test]
    if not valid:
        ident["valid_fraction"] = float(cfg.valid_fraction)
        ident["holdout_seed"] = HOLDOUT_SEED
    names = ", ".join(p.name for p in train + valid + test)
    what = "the packaged TinyStories sample" if cfg.source == "sample" else "local files"
    return SourceSpec("local", ident, f"{what} {names}", train, valid, test, ignored)


def load_texts(spec: SourceSpec, cfg: DataConfig, log: Callable[[str], Any] = print) -> TextSplits:
    """Read the stories of ``spec`` (capped by ``max_*_stories``) into datasets."""
    import datasets

    test = None
    if spec.kind == "hub":
        train, valid = _load_hub(cfg)
    else:
        if spec.kind == "synthetic":
            train_texts = generate_stories(cfg.synthetic_train_stories, cfg.synthetic_seed, "train")
            valid_texts = generate_stories(cfg.synthetic_valid_stories, cfg.synthetic_seed, "validation")
        else:
            train_texts = [s for p in spec.train_files for s in read_stories(p)]
            valid_texts = [s for p in spec.valid_files for s in read_stories(p)]
            test_texts = [s for p in spec.test_files for s in read_stories(p)]
            test = datasets.Dataset.from_dict({"text": test_texts}) if test_texts else None
            if not spec.train_files and not spec.valid_files:
                valid_texts = test_texts  # only test text (evaluation-only use): it is the held-out text too
            elif not spec.valid_files:
                if len(train_texts) < 2:  # typically a .txt file without separators: one "story"
                    names = ", ".join(p.name for p in spec.train_files)
                    raise PosbenchError(
                        f"{names} holds a single story, too few to hold out validation text; in .txt files "
                        f"separate stories with a line {SEPARATOR}, or add a *valid* file to data.path"
                    )
                train_texts, valid_texts = holdout(train_texts, cfg.valid_fraction)
                log(f"no validation file: held out {len(valid_texts)} of "
                    f"{len(train_texts) + len(valid_texts)} stories (data.valid_fraction={cfg.valid_fraction})")
        train = datasets.Dataset.from_dict({"text": train_texts})
        valid = datasets.Dataset.from_dict({"text": valid_texts})
    if cfg.max_train_stories is not None and len(train) > cfg.max_train_stories:
        train = train.select(range(cfg.max_train_stories))
    if cfg.max_valid_stories is not None and len(valid) > cfg.max_valid_stories:
        valid = valid.select(range(cfg.max_valid_stories))
    return TextSplits(train, valid, test)


def classify(files: list[Path]) -> tuple[dict[str, list[Path]], list[str]]:
    """Sort files into ``{"train", "validation", "test"}`` by the whole parts of their names
    (see ``DataConfig.path``); also return one line per ignored file saying why."""
    splits: dict[str, list[Path]] = {"train": [], "validation": [], "test": []}
    unnamed: list[Path] = []
    for p in files:
        parts = re.split(r"[^a-z]+", p.name.lower())
        found = sorted({SPLIT_NAME_PARTS[w] for w in parts if w in SPLIT_NAME_PARTS})
        if len(found) > 1:
            raise PosbenchError(
                f"{p.name} names several splits ({', '.join(found)}); rename it so that its name "
                "has only one of train, valid, test"
            )
        if found:
            splits[found[0]].append(p)
        else:
            unnamed.append(p)
    if not splits["train"] and not splits["validation"]:
        splits["train"] = unnamed  # nothing names train or validation: the rest is training text
        return splits, []
    ignored = [
        f"ignored {p}: its name has no part train, valid/validation/val/dev or test, so its split "
        "is unknown; rename it (e.g. extra_train.txt) to use it"
        for p in unnamed
    ]
    return splits, ignored


def holdout(stories: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """Hold out a fixed, seeded ``fraction`` of stories (at least one) as validation."""
    import numpy as np

    if not stories:
        return [], []
    n_valid = min(len(stories), max(1, round(len(stories) * fraction)))
    picked = np.zeros(len(stories), dtype=bool)
    picked[np.random.default_rng(HOLDOUT_SEED).permutation(len(stories))[:n_valid]] = True
    train = [s for s, p in zip(stories, picked) if not p]
    valid = [s for s, p in zip(stories, picked) if p]
    return train, valid


def read_stories(path: Path) -> list[str]:
    """Stories of one local file (stripped, empty ones dropped); errors name the file."""
    suffix = _suffix(path)
    try:
        if suffix == ".parquet":
            stories = _read_parquet(path)
        else:
            opener = gzip.open if suffix.endswith(".gz") else open
            with opener(path, "rt", encoding="utf-8") as f:
                stories = _read_jsonl(f, path) if suffix.startswith(".jsonl") else _split_txt(f)
    except UnicodeDecodeError as exc:
        raise PosbenchError(f"{path} is not UTF-8 text ({exc.reason}); convert it to UTF-8") from exc
    except (OSError, EOFError) as exc:  # includes gzip.BadGzipFile
        raise PosbenchError(f"cannot read {path} ({exc}); check the file or fix data.path") from exc
    if not stories:
        raise PosbenchError(f"{path} contains no stories; remove it or fix data.path")
    return stories


def hub_unreachable_reason(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face hub cannot be reached, or None when it can (or may).

    Without this check ``datasets.load_dataset`` retries with exponential backoff for ~25 s
    on a machine without network before failing; a TCP connect with a short timeout answers
    the same question at once. Offline mode and proxies are left to the libraries.
    """
    import datasets
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE:
        return None  # the libraries answer from their local cache, without network
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return f"cannot connect to {host}: {exc.strerror or exc}"
    return None


def _load_hub(cfg: DataConfig) -> tuple[Any, Any]:
    import datasets

    def fail(reason: str) -> PosbenchError:
        return PosbenchError(
            f"could not load {cfg.hub_name} from the Hugging Face hub ({reason}); "
            f"to work offline use {OFFLINE_HINT}"
        )

    reason = hub_unreachable_reason()
    if reason is not None:
        raise fail(reason)
    try:
        dsd = datasets.load_dataset(cfg.hub_name, cfg.hub_config)
    except Exception as exc:  # no network, missing dataset, bad config: all user-fixable
        lines = str(exc).strip().splitlines()
        raise fail(f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__) from exc
    for split in (cfg.train_split, cfg.valid_split):
        if split not in dsd:
            raise PosbenchError(
                f"{cfg.hub_name} has no split {split!r} (it has {', '.join(dsd)}); set "
                "data.train_split / data.valid_split"
            )
        if "text" not in dsd[split].column_names:
            raise PosbenchError(
                f"{cfg.hub_name} split {split} has no 'text' column (columns: "
                f"{', '.join(dsd[split].column_names)}); use a dataset with a text column"
            )
    return (dsd[cfg.train_split].select_columns(["text"]),
            dsd[cfg.valid_split].select_columns(["text"]))


def _expand(items: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in items:
        p = Path(absolute_path(item))
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and _suffix(f) in SUPPORTED)
            if not found:
                raise PosbenchError(
                    f"data.path {p} has no {'/'.join(SUPPORTED)} files; point data.path at "
                    "your text files"
                )
            files.extend(found)
        elif p.is_file():
            if _suffix(p) not in SUPPORTED:
                raise PosbenchError(
                    f"unsupported file type {p.name}; data.path takes {', '.join(SUPPORTED)} files"
                )
            files.append(p)
        else:
            raise PosbenchError(f"data.path {p} does not exist; fix data.path")
    return files


def _suffix(path: Path) -> str:
    name = path.name.lower()
    for s in sorted(SUPPORTED, key=len, reverse=True):
        if name.endswith(s):
            return s
    return path.suffix.lower()


def _stat(path: Path) -> list[Any]:
    st = path.stat()
    return [str(path), st.st_size, st.st_mtime_ns]


def _content(path: Path) -> list[Any]:
    return [path.name, path.stat().st_size, file_sha256(path)]


def _split_txt(f: io.TextIOBase) -> list[str]:
    # The separator normally sits on a line of its own; splitting on the token anywhere also
    # accepts "...end.<|endoftext|>Once..." and never cuts a real story (the token is not text).
    return [s.strip() for s in f.read().split(SEPARATOR) if s.strip()]


def _read_jsonl(f: io.TextIOBase, path: Path) -> list[str]:
    stories = []
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PosbenchError(f"{path}:{lineno} is not valid JSON ({exc.msg}); fix the file") from exc
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise PosbenchError(
                f"{path}:{lineno} has no string 'text' field; each line must be "
                '{"text": "<story>", ...}'
            )
        if record["text"].strip():
            stories.append(record["text"].strip())
    return stories


def _read_parquet(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as exc:
        raise PosbenchError(f"cannot read parquet file {path} ({exc}); check the file") from exc
    if "text" not in schema.names:
        raise PosbenchError(
            f"{path} has no 'text' column (columns: {', '.join(schema.names)}); rename the story column to text"
        )
    texts = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    return [t.strip() for t in texts if isinstance(t, str) and t.strip()]
