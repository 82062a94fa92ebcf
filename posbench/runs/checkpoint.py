"""Checkpoints: atomic saves, keep-last-K, and a loader that never trusts a damaged file.

A checkpoint is ``<run>/checkpoints/step_<step>.pt`` holding everything needed to continue the
run bit for bit: model, optimizer, scheduler, RNG states, step (the data position: batches are a
pure function of seed and step) and the config. Files are written to a temporary name and renamed,
so a kill mid-save leaves the previous checkpoint intact. A checkpoint that fails to load is
renamed ``*.corrupt`` (kept for inspection, never loaded or pruned again) and the previous one is
used instead. Each checkpoint has a ``.sha256`` sidecar, written before the checkpoint is moved
into place and verified on load, so bytes changed later (disk, copy, a stray write) are caught
even where the file still unpickles.
"""

from __future__ import annotations

import pickle
import random
import re
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from posbench.core.errors import PosbenchError
from posbench.core.io import atomic_path, file_sha256, write_text_atomic

FORMAT_VERSION = 1
REQUIRED_KEYS = ("format_version", "step", "model", "optimizer", "scheduler", "config")
_NAME = re.compile(r"^step_(\d+)\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Step checkpoints of a run, oldest first."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(run_dir: Path, state: dict[str, Any], keep: int) -> Path:
    """Atomically write ``state`` as the checkpoint of ``state['step']``; keep the newest ``keep``."""
    path = checkpoint_dir(run_dir) / f"step_{state['step']:08d}.pt"
    with atomic_path(path) as tmp:
        torch.save({"format_version": FORMAT_VERSION, **state}, tmp)
        write_text_atomic(checksum_path(path), f"{file_sha256(tmp)}  {path.name}\n")
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
        checksum_path(old).unlink(missing_ok=True)
    return path


def checksum_path(path: Path) -> Path:
    """The sha256 sidecar of a checkpoint (``step_N.pt.sha256``)."""
    return path.with_name(path.name + ".sha256")


def verify_checksum(path: Path) -> None:
    """Raise ValueError when the checkpoint's bytes differ from those it was written with
    (checkpoints from before sidecars have none and are not checked)."""
    try:
        expected = checksum_path(path).read_text().split()[0]
    except FileNotFoundError:
        return
    except (OSError, IndexError):
        raise ValueError("has an unreadable .sha256 sidecar") from None
    if file_sha256(path) != expected:
        raise ValueError("fails its sha256 check (its bytes changed after it was written)")


def read_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load one checkpoint and check it is intact and complete; raises ValueError when not."""
    verify_checksum(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=False)
    except OSError:
        raise  # an I/O problem says nothing about the file's content: never quarantine for it
    except (RuntimeError, EOFError, ValueError, KeyError, AttributeError, pickle.UnpicklingError,
            zipfile.BadZipFile) as err:  # truncated zip, bad pickle, ...
        raise ValueError(f"cannot be read ({type(err).__name__}: {str(err).splitlines()[0][:120]})") from None
    if not isinstance(state, dict):
        raise ValueError("is not a posbench checkpoint")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise ValueError(f"is missing {', '.join(missing)}")
    return state


def load_latest_checkpoint(
    run_dir: Path, log: Callable[[str], None] = print, map_location: str | torch.device = "cpu",
    quarantine: bool = True,
) -> dict[str, Any] | None:
    """Newest loadable checkpoint of a run (None when there is none), skipping damaged ones.

    ``quarantine``: rename damaged files to ``*.corrupt`` (only one process of a distributed
    run should, the others just skip them).
    """
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return read_checkpoint(path, map_location) | {"path": str(path)}
        except ValueError as err:
            if quarantine and path.exists():
                quarantined = path.with_suffix(".pt.corrupt")
                path.rename(quarantined)
                checksum_path(path).unlink(missing_ok=True)
                log(f"checkpoint {path} {err}; moved it to {quarantined.name} and trying the previous one")
            else:
                log(f"checkpoint {path} {err}; trying the previous one")
    return None


def load_model_weights(model: torch.nn.Module, state: dict[str, Any], run_dir: Path) -> None:
    """Load a checkpoint's weights into ``model``, refusing in one line (a PosbenchError naming
    the missing, unexpected and reshaped parameters) a checkpoint from other model code: the
    method's code changed since the run was trained."""
    saved, ours = state["model"], model.state_dict()
    missing = sorted(set(ours) - set(saved))
    unexpected = sorted(set(saved) - set(ours))
    reshaped = sorted(k for k in set(ours) & set(saved) if tuple(ours[k].shape) != tuple(saved[k].shape))
    if missing or unexpected or reshaped:
        def shown(keys: list[str]) -> str:
            return ", ".join(keys[:6]) + (f" (+{len(keys) - 6} more)" if len(keys) > 6 else "")

        parts = [f"{label} {shown(keys)}" for label, keys in
                 (("missing", missing), ("unexpected", unexpected), ("with another shape", reshaped)) if keys]
        raise PosbenchError(
            f"the checkpoint {state.get('path', checkpoint_dir(run_dir))} does not fit the {state.get('method')} model "
            f"of this posbench ({'; '.join(parts)}): the method's code changed since the run was trained; "
            f"re-train the run, or use the posbench version it was trained with (its results.json 'versions')"
        )
    model.load_state_dict(saved)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
