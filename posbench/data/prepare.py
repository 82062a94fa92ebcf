"""Tokenize a source into cached flat token files: ``<cache_dir>/data/<key>/``.

A cache directory holds ``train.bin``, ``valid.bin`` and, when the source has test files,
``test.bin`` (every story's tokens followed by the
end-of-text id, as one flat uint16 array, uint32 for vocabularies over 65536), the tokenizer
(``tokenizer.json``) and ``meta.json``. The key hashes everything that changes the tokens, so
equal settings reuse the cache and different ones never collide.

Crash and concurrency safety: a cache is built in a ``.tmp-<key>-*`` directory and renamed into
place only when complete, so a killed prepare never leaves a directory that looks valid; a
file lock per key makes concurrent preparers of the same key build it once.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from posbench.core.errors import PosbenchError
from posbench.core.io import check_output_dir, file_sha256, write_json_atomic
from posbench.data.config import DataConfig
from posbench.data.sources import SourceSpec, TextSplits, load_texts, resolve_source
from posbench.data.tokenizer import (
    TOKENIZER_FILE,
    describe,
    eot_id_of,
    load_pretrained,
    tokenizer_identity,
    train_bpe,
)

FORMAT_VERSION = 1  # bump on any change to the cache layout or token stream contents
SPLIT_FILES = {"train": "train.bin", "validation": "valid.bin", "test": "test.bin"}
REQUIRED_SPLITS = ("train", "validation")  # test exists only for local sources with test files
SPLIT_ALIASES = {"train": "train", "validation": "validation", "valid": "validation", "val": "validation",
                 "test": "test"}
PARALLEL_MIN_STORIES = 20_000  # below this, worker start-up costs more than it saves
Log = Callable[[str], Any]


@dataclass
class PreparedData:
    """A validated cache directory of tokenized train/validation streams."""

    dir: Path
    meta: dict[str, Any]
    _tokenizer: Any = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def open(cls, dir: str | os.PathLike, verify: bool = False) -> PreparedData:
        """Open and check a cache dir (meta parses, file sizes match token counts; with
        ``verify`` also the sha256 of each file). A bad cache raises :class:`PosbenchError`."""
        d = Path(dir)

        def corrupt(why: str) -> PosbenchError:
            return PosbenchError(
                f"data cache {d} is corrupt ({why}); delete {d} or run posbench prepare data.rebuild=true"
            )

        if not d.is_dir():
            what = "is not a directory" if d.exists() else "does not exist"
            raise PosbenchError(f"data cache {d} {what}; run posbench prepare with the same data settings")
        try:
            meta = json.loads((d / "meta.json").read_text())
        except FileNotFoundError:
            raise corrupt("meta.json missing") from None
        except (OSError, ValueError) as exc:
            raise corrupt(f"meta.json unreadable: {exc}") from None
        if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
            raise PosbenchError(
                f"data cache {d} has format {meta.get('format_version') if isinstance(meta, dict) else '?'}, "
                f"this posbench reads format {FORMAT_VERSION}; delete {d} or run posbench prepare data.rebuild=true"
            )
        try:
            itemsize = np.dtype(meta["dtype"]).itemsize
            present = [s for s in SPLIT_FILES if s in REQUIRED_SPLITS or s in meta["splits"]]
            for _split, info in ((s, meta["splits"][s]) for s in present):
                path = d / info["file"]
                if not path.is_file():
                    raise corrupt(f"{info['file']} missing")
                size, expected = path.stat().st_size, int(info["tokens"]) * itemsize
                if size != expected:
                    raise corrupt(f"{info['file']} has {size} bytes, meta.json says {expected}")
                if verify and file_sha256(path) != info["sha256"]:
                    raise corrupt(f"{info['file']} sha256 mismatch")
                # Flipped bytes would otherwise surface as an IndexError deep inside training.
                top = largest_token_id(path, np.dtype(meta["dtype"]), int(info["tokens"]))
                if top >= int(meta["vocab_size"]):
                    raise corrupt(f"{info['file']} holds token id {top}, past the vocabulary of {meta['vocab_size']}")
            int(meta["vocab_size"]), int(meta["eot_id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise corrupt(f"meta.json lacks or mangles {exc}") from None
        if not (d / TOKENIZER_FILE).is_file():
            raise corrupt(f"{TOKENIZER_FILE} missing")
        return cls(d, meta)

    @property
    def vocab_size(self) -> int:
        """Number of token ids (model embedding rows needed)."""
        return int(self.meta["vocab_size"])

    @property
    def eot_id(self) -> int:
        """End-of-text id, present after every story."""
        return int(self.meta["eot_id"])

    @property
    def dtype(self) -> np.dtype:
        """Storage dtype of the token files (uint16 or uint32)."""
        return np.dtype(self.meta["dtype"])

    def has_split(self, split: str) -> bool:
        """Whether this cache holds ``split`` (train and validation always; test only when the
        source had test files)."""
        return _split(split) in self.meta["splits"]

    def num_tokens(self, split: str) -> int:
        """Token count of ``split`` (``train``, ``validation`` or ``test``)."""
        if not self.has_split(split):
            raise PosbenchError(
                f"the data in {self.dir} has no {split} split; add a file whose name has the part "
                f"'{split}' (e.g. {split}.txt) to data.path, or use eval.split=validation"
            )
        return int(self.meta["splits"][_split(split)]["tokens"])

    def tokens(self, split: str) -> np.ndarray:
        """Read-only memmap of the token stream of ``split`` (``train``, ``validation``, ``test``)."""
        split = _split(split)
        if self.num_tokens(split) == 0:  # np.memmap cannot map an empty file
            empty = np.zeros(0, dtype=self.dtype)
            empty.flags.writeable = False
            return empty
        return np.memmap(self.dir / SPLIT_FILES[split], dtype=self.dtype, mode="r")

    def train_tokens(self) -> np.ndarray:
        """Read-only memmap of the training stream."""
        return self.tokens("train")

    def valid_tokens(self) -> np.ndarray:
        """Read-only memmap of the validation stream."""
        return self.tokens("validation")

    def tokenizer_sha256(self) -> str:
        """sha256 of this cache's ``tokenizer.json`` as it is on disk now (hashed, not read from
        meta.json, so that it can verify a checksum recorded elsewhere)."""
        return file_sha256(self.dir / TOKENIZER_FILE)

    def load_tokenizer(self):
        """The ``tokenizers.Tokenizer`` that produced these tokens (a fresh object per call)."""
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.dir / TOKENIZER_FILE))

    def encode(self, texts: Iterable[str]) -> list[list[int]]:
        """Token ids of each text (no end-of-text appended), with this cache's tokenizer."""
        return [e.ids for e in self._cached_tokenizer().encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (end-of-text tokens appear as ``<|endoftext|>``)."""
        return self._cached_tokenizer().decode([int(i) for i in ids], skip_special_tokens=False)

    def _cached_tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self.load_tokenizer()
        return self._tokenizer


def largest_token_id(path: Path, dtype: np.dtype, count: int, chunk: int = 1 << 24) -> int:
    """Largest id in a token file (-1 when empty), read in chunks (about 1 s per GB)."""
    if count == 0:
        return -1
    tokens = np.memmap(path, dtype=dtype, mode="r")
    return max(int(tokens[i:i + chunk].max()) for i in range(0, count, chunk))


def prepare_data(cfg: DataConfig, log: Log = print) -> PreparedData:
    """Build (or reuse) the token cache for ``cfg``: source -> tokenizer -> train/valid streams."""
    cfg.validate()
    spec = resolve_source(cfg)
    ident = tokenizer_identity(cfg)

    def make_tokenizer(texts: TextSplits):
        if cfg.tokenizer != "bpe":
            return load_pretrained(cfg.tokenizer), ident
        train = texts.train
        if cfg.bpe_train_stories is not None and len(train) > cfg.bpe_train_stories:
            train = train.select(range(cfg.bpe_train_stories))
        log(f"training byte-level BPE (vocab {cfg.bpe_vocab_size}) on {len(train)} training stories")
        # training split only: a vocabulary fitted on validation text would leak it
        return train_bpe(_texts(train), cfg.bpe_vocab_size, length=len(train)), ident

    return _prepare(cfg, spec, ident, make_tokenizer, log, allow_empty_train=False)


def cache_dir_of(cfg: DataConfig) -> Path:
    """The cache directory :func:`prepare_data` would use for ``cfg`` (nothing is read or built)."""
    cfg.validate()
    return cfg.cache_root() / "data" / cache_key(_cache_settings(cfg, resolve_source(cfg), tokenizer_identity(cfg)))


def tokenize_with(prepared: PreparedData, cfg: DataConfig, log: Log = print) -> PreparedData:
    """Tokenize the source of ``cfg`` with the tokenizer of ``prepared`` (``cfg.tokenizer`` is
    ignored), e.g. to evaluate a trained run on other text. Cached like :func:`prepare_data`."""
    cfg.validate()
    spec = resolve_source(cfg)
    ident = {"kind": "from_prepared", "sha256": file_sha256(prepared.dir / TOKENIZER_FILE)}
    desc = {**ident, "from": str(prepared.dir), "origin": prepared.meta.get("tokenizer")}
    return _prepare(cfg, spec, ident, lambda texts: (prepared.load_tokenizer(), desc), log,
                    allow_empty_train=True)


def cache_key(settings: dict[str, Any]) -> str:
    """Readable, collision-safe directory name for ``settings``: ``<source>-<tokenizer>-<hash>``."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    tok = settings["tokenizer"]
    if tok["kind"] == "bpe":
        tag = f"bpe{tok['vocab_size']}"
    elif tok["kind"] == "pretrained":
        tag = re.sub(r"[^A-Za-z0-9_.]+", "_", Path(tok["name"]).name or "tok")[:32]
    else:
        tag = "tok" + tok["sha256"][:6]
    return f"{settings['source']['kind']}-{tag}-{digest}"


def tokenize_split(ds: Any, tokenizer: Any, eot_id: int, dtype: np.dtype, out: Path,
                   work_dir: Path, num_proc: int | None, name: str) -> dict[str, Any]:
    """Tokenize the ``text`` column of ``ds`` into the flat token file ``out``.

    Each story (stripped; empty ones dropped) becomes its ids followed by ``eot_id``. Batches
    go through ``datasets.map``: large inputs in ``num_proc`` worker processes, small ones
    in-process (where the tokenizer still uses all cores through Rust threads).
    """
    import datasets

    work_dir.mkdir(parents=True, exist_ok=True)
    if len(ds) == 0:
        out.write_bytes(b"")
        return {"file": out.name, "tokens": 0, "stories": 0, "sha256": hashlib.sha256().hexdigest()}
    procs = _workers(num_proc) if len(ds) > PARALLEL_MIN_STORIES else None
    features = datasets.Features({"ids": datasets.List(datasets.Value(np.dtype(dtype).name))})
    with _rust_threads(procs is None):
        mapped = ds.map(
            _Encoder(tokenizer, eot_id), batched=True, batch_size=1000, num_proc=procs,
            remove_columns=ds.column_names, features=features,
            cache_file_name=str(work_dir / f"{name}.arrow"),
            new_fingerprint=hashlib.sha256(f"{out}-{time.time_ns()}".encode()).hexdigest()[:16],
            desc=f"tokenizing {name}",
        )
    digest, total = hashlib.sha256(), 0
    with open(out, "wb") as f:
        for chunk in mapped.data.column("ids").chunks:
            ids = chunk.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)
            digest.update(ids.data)
            f.write(ids.data)
            total += ids.size
        f.flush()
        os.fsync(f.fileno())
    return {"file": out.name, "tokens": total, "stories": len(mapped), "sha256": digest.hexdigest()}


class _Encoder:
    """Picklable batch function for ``datasets.map`` (worker processes get a copy)."""

    def __init__(self, tokenizer: Any, eot_id: int):
        self.tokenizer, self.eot_id = tokenizer, eot_id

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        texts = [t.strip() for t in batch["text"] if t and t.strip()]
        encs = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return {"ids": [e.ids + [self.eot_id] for e in encs]}


def _prepare(cfg: DataConfig, spec: SourceSpec, tok_ident: dict[str, Any],
             make_tokenizer: Callable[[TextSplits], tuple[Any, dict[str, Any]]], log: Log,
             allow_empty_train: bool) -> PreparedData:
    with writable_cache(cfg.cache_root()):
        return _prepare_cache(cfg, spec, tok_ident, make_tokenizer, log, allow_empty_train)


@contextlib.contextmanager
def writable_cache(root: Path) -> Iterator[None]:
    """One line naming the fix when the cache root is not a folder or cannot be written (a
    read-only disk or mount, no permission): the cache is built there on first use."""
    check_output_dir(root, "data.cache_dir (or $POSBENCH_CACHE)")
    try:
        yield
    except OSError as err:
        refused = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST)
        where = os.path.abspath(err.filename) if isinstance(err.filename, str) else ""
        if err.errno not in refused or not where or not (where.startswith(str(root)) or str(root).startswith(where)):
            raise  # not the cache's folder: e.g. an unreadable data.path
        raise PosbenchError(
            f"cannot write the token cache in {root} ({err.strerror}: {err.filename}); point POSBENCH_CACHE "
            "or data.cache_dir at a writable folder (the cache is built there on first use)"
        ) from None


def _prepare_cache(cfg: DataConfig, spec: SourceSpec, tok_ident: dict[str, Any],
                   make_tokenizer: Callable[[TextSplits], tuple[Any, dict[str, Any]]], log: Log,
                   allow_empty_train: bool) -> PreparedData:
    from filelock import FileLock, Timeout

    settings = _cache_settings(cfg, spec, tok_ident)
    key = cache_key(settings)
    for line in spec.ignored:
        log(line)
    root = cfg.cache_root() / "data"
    root.mkdir(parents=True, exist_ok=True)
    final = root / key
    if final.exists() and not cfg.rebuild:
        prepared = PreparedData.open(final, verify=cfg.verify)
        log(f"reusing cache {final}")
        return prepared
    lock = FileLock(str(root / f"{key}.lock"))
    waited = False
    try:
        lock.acquire(timeout=0)
    except Timeout:
        waited = True
        log(f"waiting for another posbench process preparing {final}")
        lock.acquire()
    try:
        if final.exists() and (waited or not cfg.rebuild):
            prepared = PreparedData.open(final, verify=cfg.verify)  # built while we waited
            log(f"reusing cache {final}")
            return prepared
        _remove_leftovers(root, key)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
        try:
            _build(tmp, key, settings, cfg, spec, make_tokenizer, log, allow_empty_train)
            if final.exists():  # rebuild: move the old cache out of the way, then delete it
                old = Path(tempfile.mkdtemp(prefix=f".old-{key}-", dir=root))
                os.rename(final, old / "cache")
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, final)
            _fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        lock.release()
    prepared = PreparedData.open(final)
    log(f"wrote {final}")
    return prepared


def _cache_settings(cfg: DataConfig, spec: SourceSpec, tok_ident: dict[str, Any]) -> dict[str, Any]:
    """Everything that changes the tokens: what the cache key hashes."""
    return {"format": FORMAT_VERSION, "source": spec.identity, "tokenizer": tok_ident,
            "max_train_stories": cfg.max_train_stories, "max_valid_stories": cfg.max_valid_stories}


def _build(tmp: Path, key: str, settings: dict[str, Any], cfg: DataConfig, spec: SourceSpec,
           make_tokenizer: Callable, log: Log, allow_empty_train: bool) -> None:
    start = time.time()
    texts = load_texts(spec, cfg, log)
    n_train, n_valid = len(texts.train), len(texts.validation)
    if n_valid == 0:
        raise PosbenchError(f"{spec.description} has no validation stories; add a *valid* file or "
                            "raise data.valid_fraction / data.max_valid_stories")
    if n_train == 0 and not allow_empty_train:
        raise PosbenchError(f"{spec.description} has no training stories; add a *train* file to data.path "
                            "or lower data.valid_fraction below 1")
    n_test = f" / {len(texts.test)} test" if texts.test is not None else ""
    log(f"preparing {spec.description}: {n_train} train / {n_valid} validation{n_test} stories -> {tmp.parent / key}")
    tokenizer, tok_desc = make_tokenizer(texts)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eot_id = eot_id_of(tokenizer, str(tok_desc.get("name", "the tokenizer")))
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    tokenizer.save(str(tmp / TOKENIZER_FILE))
    splits = {}
    for split, fname in SPLIT_FILES.items():
        if texts[split] is None:
            continue  # no test text
        t0 = time.time()
        splits[split] = tokenize_split(texts[split], tokenizer, eot_id, dtype, tmp / fname,
                                       tmp / "_map", cfg.num_proc, split)
        log(f"tokenized {split}: {splits[split]['stories']} stories, {splits[split]['tokens']:,} tokens "
            f"({time.time() - t0:.1f}s)")
    shutil.rmtree(tmp / "_map", ignore_errors=True)
    from posbench import __version__

    meta = {
        "format_version": FORMAT_VERSION,
        "key": key,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "posbench_version": __version__,
        "source": {"description": spec.description, **spec.identity},
        # the checksum lets a run verify later that it is evaluated with its own tokenizer
        "tokenizer": {**describe(tokenizer, tok_desc), "sha256": file_sha256(tmp / TOKENIZER_FILE)},
        "vocab_size": vocab_size,
        "eot_id": eot_id,
        "dtype": dtype.name,
        "splits": splits,
        "settings": settings,
        "prepare_seconds": round(time.time() - start, 2),
    }
    write_json_atomic(tmp / "meta.json", meta)
    # mkdtemp/mkstemp create owner-only entries; a cache should be as readable as any download
    os.chmod(tmp / "meta.json", 0o644)
    os.chmod(tmp, 0o755)
    _fsync_dir(tmp)


def _texts(ds: Any) -> Iterator[list[str]]:
    for batch in ds.iter(batch_size=1000):
        yield [t.strip() for t in batch["text"] if t and t.strip()]


def _split(split: str) -> str:
    try:
        return SPLIT_ALIASES[split]
    except KeyError:
        raise PosbenchError(f"unknown split {split!r}; use train, validation or test") from None


def _workers(num_proc: int | None) -> int | None:
    n = num_proc or min(8, os.cpu_count() or 1)
    return n if n > 1 else None


@contextlib.contextmanager
def _rust_threads(enabled: bool) -> Iterator[None]:
    # Worker processes each running a full Rust thread pool oversubscribe the CPU (and
    # tokenizers warns after fork); give each worker one thread instead.
    if enabled or "TOKENIZERS_PARALLELISM" in os.environ:
        yield
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)


def _remove_leftovers(root: Path, key: str) -> None:
    # Called under the key's lock: any .tmp/.old dir of this key belongs to a killed process.
    for d in list(root.glob(f".tmp-{key}-*")) + list(root.glob(f".old-{key}-*")):
        shutil.rmtree(d, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
