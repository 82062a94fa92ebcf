"""Tokenizers: a byte-level BPE trained by posbench, or a pretrained one (hub id or local dir).

Internally every tokenizer is a ``tokenizers.Tokenizer``: fast (Rust, multi-threaded), picklable
for worker processes, and saved as one ``tokenizer.json`` in the cache so a run can later
tokenize other text with exactly the same vocabulary.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Iterator

from posbench.core.errors import PosbenchError
from posbench.data.config import DataConfig, absolute_path
from posbench.data.sources import hub_unreachable_reason

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"


def tokenizer_identity(cfg: DataConfig) -> dict[str, Any]:
    """What determines the tokenizer, for the cache key (cheap: never loads it)."""
    if cfg.tokenizer == "bpe":
        return {"kind": "bpe", "vocab_size": int(cfg.bpe_vocab_size),
                "train_stories": cfg.bpe_train_stories}
    local = _local_dir(cfg.tokenizer)
    if local is None:
        return {"kind": "pretrained", "name": cfg.tokenizer}
    files = sorted(p for p in local.iterdir() if p.is_file() and p.suffix in (".json", ".txt", ".model"))
    return {"kind": "pretrained", "name": str(local),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def describe(tokenizer: Any, identity: dict[str, Any]) -> dict[str, Any]:
    """Human-readable record of a tokenizer for meta.json."""
    return {**identity, "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True)}


def train_bpe(texts: Iterable[str], vocab_size: int, length: int | None = None):
    """Train a byte-level BPE (GPT-2 style pre-tokenization) with ``<|endoftext|>`` as id 0.

    The caller passes training stories only: a tokenizer fitted on validation text would leak
    it into the vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=int(vocab_size),
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def load_pretrained(name: str):
    """Load ``name``: a local dir (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``), a
    ``tokenizer.json`` file, or a Hugging Face hub id (via ``transformers.AutoTokenizer``)."""
    from tokenizers import Tokenizer

    local = _local_dir(name)
    if local is not None:
        if (local / TOKENIZER_FILE).is_file():
            return Tokenizer.from_file(str(local / TOKENIZER_FILE))
        if (local / "vocab.json").is_file() and (local / "merges.txt").is_file():
            return _from_vocab_merges(local / "vocab.json", local / "merges.txt")
        raise PosbenchError(
            f"tokenizer dir {local} has neither tokenizer.json nor vocab.json + merges.txt; "
            "point data.tokenizer at a dir that has them, or use data.tokenizer=bpe"
        )
    expanded = Path(absolute_path(name))
    if expanded.is_file() and expanded.suffix == ".json":
        return Tokenizer.from_file(str(expanded))
    if _looks_like_path(name):
        raise PosbenchError(
            f"tokenizer path {expanded} does not exist; fix data.tokenizer (a dir with "
            "tokenizer.json or vocab.json + merges.txt) or use data.tokenizer=bpe"
        )
    return _from_hub(name)


def eot_id_of(tokenizer: Any, name: str = "tokenizer") -> int:
    """Id of the end-of-text token appended after every story."""
    for token in (EOT, "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>"):
        tid = tokenizer.token_to_id(token)
        if tid is not None:
            return int(tid)
    raise PosbenchError(
        f"{name} has no end-of-text token ({EOT} or </s>); use data.tokenizer=bpe or a "
        "tokenizer that defines one"
    )


def batched(texts: Iterable[str], size: int = 1000) -> Iterator[list[str]]:
    """Group an iterable of texts into lists (what ``train_from_iterator`` digests fastest)."""
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _from_vocab_merges(vocab: Path, merges: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # BPE.from_file skips a "#version" header when there is one and keeps the first merge when
    # there is none (GPT-2's own merges.txt has a header, some copies of it do not).
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if tok.token_to_id(EOT) is not None:
        tok.add_special_tokens([EOT])  # so a literal <|endoftext|> maps to its id, not bytes
    return tok


def _from_hub(name: str):
    reason = hub_unreachable_reason()
    if reason is None:
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(name)
        except Exception as exc:  # network, missing repo, missing files: all user-fixable
            reason = _short(exc)
        else:
            backend = getattr(hf, "backend_tokenizer", None)
            if backend is None:
                raise PosbenchError(
                    f"tokenizer {name} has no fast (tokenizers) version; use data.tokenizer=bpe "
                    "or a dir with tokenizer.json"
                )
            if hf.eos_token and backend.token_to_id(hf.eos_token) is None:
                backend.add_special_tokens([hf.eos_token])
            return backend
    raise PosbenchError(
        f"could not load tokenizer {name!r} ({reason}); use data.tokenizer=bpe or a local dir "
        "with tokenizer.json or vocab.json + merges.txt (e.g. data.tokenizer=tokenizers/gpt2)"
    )


def _local_dir(name: str) -> Path | None:
    path = Path(absolute_path(name))
    return path if path.is_dir() else None


def _looks_like_path(name: str) -> bool:
    # hub ids are "org/name" or "name"; anything else path-shaped is a missing local path
    return (name.startswith((".", "/", "~")) or os.sep in name.strip("/").replace("/", "", 1)
            or name.endswith(".json"))


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first[:200]}" if first else type(exc).__name__
