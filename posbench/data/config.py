"""The ``data`` config group: where text comes from, how it is tokenized, where the cache lives."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from posbench.core.errors import PosbenchError
from posbench.data.retrieval import retrieval_config

SOURCES = ("hub", "local", "sample", "synthetic")
DEFAULT_CACHE = "~/.cache/posbench"


def _default_cache_dir() -> str:
    return os.environ.get("POSBENCH_CACHE") or DEFAULT_CACHE


@dataclass
class DataConfig:
    """Settings of the data pipeline (Hydra group ``data``; see ``configs/data/*.yaml``)."""

    source: str = "hub"
    """Where stories come from: ``hub`` (Hugging Face datasets), ``local`` (files),
    ``sample`` (the TinyStories sample shipped inside posbench, ``posbench/data/sample/``:
    15,797 training and 971 validation stories, CDLA-Sharing-1.0; works offline anywhere) or
    ``synthetic`` (generated story-like text; needs nothing, used by tests)."""

    hub_name: str = "roneneldan/TinyStories"
    """Hugging Face dataset id, for ``source=hub``."""

    hub_config: str | None = None
    """Dataset configuration name passed to ``datasets.load_dataset`` (None: the default one)."""

    train_split: str = "train"
    """Name of the hub split used for training."""

    valid_split: str = "validation"
    """Name of the hub split used for held-out evaluation."""

    path: str | None = None
    """For ``source=local``: a directory, a file, or several comma-separated. Supported files:
    ``.txt``/``.txt.gz`` (stories separated by ``<|endoftext|>`` lines), ``.jsonl``/``.jsonl.gz``
    and ``.parquet`` (a ``text`` field per story). Files are sorted by the whole parts of their
    name (split at anything that is not a letter): ``train`` is training text;
    ``valid``/``validation``/``val``/``dev`` is validation text; ``test`` is test text, only
    ever evaluated (``eval.split=test``), never trained on. Other files are ignored with a log
    line, unless no file is named train or validation: then they are the training text. Relative
    paths are taken from the directory posbench was started in."""

    valid_fraction: float = 0.01
    """Local sources without a validation file: the fraction of stories held out (a fixed
    seeded choice, so always the same stories). 1.0 puts all the text in validation, which is
    what ``posbench eval data.path=...`` wants for text that is only evaluated on."""

    max_train_stories: int | None = None
    """Use only the first N training stories (None: all). For quick runs."""

    max_valid_stories: int | None = None
    """Use only the first N validation stories (None: all)."""

    synthetic_train_stories: int = 2000
    """``source=synthetic``: number of generated training stories."""

    synthetic_valid_stories: int = 200
    """``source=synthetic``: number of generated validation stories."""

    synthetic_seed: int = 0
    """``source=synthetic``: seed of the generator (same seed, same text)."""

    tokenizer: str = "bpe"
    """``bpe``: a byte-level BPE that posbench trains on the training split (never validation).
    Anything else: a Hugging Face tokenizer id, or a local directory holding ``tokenizer.json``
    or GPT-2 style ``vocab.json`` + ``merges.txt`` (e.g. a downloaded copy of ``gpt2``)."""

    bpe_vocab_size: int = 8192
    """Vocabulary of the trained BPE. TinyStories uses a few thousand distinct words, so 8192
    entries hold nearly every word as one token; ids fit uint16, and the LM head (8192 x 384 =
    3.1 M parameters) stays small next to the 6 x 384 transformer body, unlike GPT-2's 50257."""

    bpe_train_stories: int | None = 200_000
    """Train the BPE on at most the first N training stories (None: all). 200k stories are
    plenty for a stable 8192 vocabulary and keep training fast on the full hub dataset."""

    cache_dir: str = field(default_factory=_default_cache_dir)
    """Root of the token cache; prepared data lands in ``<cache_dir>/data/<key>/``.
    Defaults to ``$POSBENCH_CACHE`` when set, else ``~/.cache/posbench``."""

    num_proc: int | None = None
    """Worker processes for tokenizing large inputs (None: min(8, CPU count)). Inputs under
    20k stories are tokenized in-process, where forking costs more than it saves."""

    rebuild: bool = False
    """Ignore an existing cache for these settings and prepare it again."""

    verify: bool = False
    """Check the sha256 of the token files when opening a cache (sizes are always checked)."""

    retrieval: Any = field(default_factory=dict)
    """Retrievable content (repeated spans, passkeys) inserted into training windows
    (``data.retrieval.*``, :class:`posbench.data.retrieval.RetrievalConfig`, docs/retrieval.md);
    a RetrievalConfig once validated. Never part of the token cache: the cache stays plain."""

    @classmethod
    def from_dict(cls, values: dict[str, Any] | Any) -> DataConfig:
        """Build from a dict or DictConfig, rejecting unknown keys with the list of valid ones."""
        if not isinstance(values, dict):
            from omegaconf import OmegaConf

            values = OmegaConf.to_container(values, resolve=True)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise PosbenchError(
                f"unknown data setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field."""
        return asdict(self)

    def path_list(self) -> list[str]:
        """``path`` as a list (it may be a comma-separated string or, from Python, a list)."""
        if self.path is None:
            return []
        items = self.path if isinstance(self.path, (list, tuple)) else str(self.path).split(",")
        return [str(p).strip() for p in items if str(p).strip()]

    def cache_root(self) -> Path:
        """Absolute cache root (``~`` expanded, relative paths from the launch directory)."""
        return Path(absolute_path(self.cache_dir or _default_cache_dir()))

    def validate(self) -> DataConfig:
        """Raise :class:`PosbenchError` naming the fix for any bad value; return self."""
        if self.source not in SOURCES:
            raise PosbenchError(
                f"unknown data.source={self.source!r}; use one of {', '.join(SOURCES)}"
            )
        if self.source == "local" and not self.path_list():
            raise PosbenchError(
                "data.source=local needs data.path=<dir or file(s)>, e.g. "
                "data.path=data/tinystories (or data=sample for the TinyStories sample shipped with posbench)"
            )
        if self.source == "hub" and not self.hub_name:
            raise PosbenchError("data.source=hub needs data.hub_name, e.g. roneneldan/TinyStories")
        if not 0.0 < float(self.valid_fraction) <= 1.0:
            raise PosbenchError(
                f"data.valid_fraction={self.valid_fraction} must be in (0, 1], e.g. 0.01"
            )
        for name in ("max_train_stories", "max_valid_stories", "bpe_train_stories", "num_proc"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise PosbenchError(f"data.{name}={value!r} must be a positive integer or null")
        for name in ("synthetic_train_stories", "synthetic_valid_stories"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PosbenchError(f"data.{name}={value!r} must be a positive integer")
        self.retrieval = retrieval_config(self.retrieval)
        if not self.tokenizer:
            raise PosbenchError("data.tokenizer is empty; use bpe or a tokenizer name/path")
        if self.tokenizer == "bpe" and not 258 <= int(self.bpe_vocab_size) <= 2**32 - 1:
            # 256 byte symbols + the end-of-text token + at least one merge
            raise PosbenchError(
                f"data.bpe_vocab_size={self.bpe_vocab_size} is too small; use at least 258 "
                "(8192 is the default)"
            )
        return self

    def check_path_is_read(self) -> DataConfig:
        """Refuse a ``path`` that this source would ignore (data=sample, as in
        experiment=cpu_quick, would otherwise train on the sample without a word). Checked where
        data is chosen (train, prepare), not when an existing run's recorded config is read back."""
        if self.path_list() and self.source != "local":
            raise PosbenchError(
                f"data.path={self.path} is read only with data.source=local, but data.source={self.source} does "
                f"not read it; to train on those files add data=local (data=local data.path={self.path}), "
                "or drop data.path"
            )
        return self


def absolute_path(path: str) -> str:
    """Expand ``~`` and make ``path`` absolute relative to the directory posbench started in
    (Hydra may change the working directory of a run)."""
    path = os.path.expanduser(str(path))
    try:
        from hydra.utils import to_absolute_path

        return os.path.abspath(to_absolute_path(path))
    except Exception:  # hydra missing or not configured: plain cwd
        return os.path.abspath(path)
