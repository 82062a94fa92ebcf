"""Device and precision: which device a run uses and the dtype its autocast runs in."""

from __future__ import annotations

import errno
import random
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from posbench.core.errors import PosbenchError, one_line
from posbench.runtime import hardware
from posbench.runtime.distributed import DistInfo


def sweep_job_number() -> int:
    """This job's number in a Hydra multirun (0 outside one)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return int(HydraConfig.get().job.num or 0)
    except (ValueError, ImportError, TypeError):
        return 0


def resolve_device(name: str, dist_info: DistInfo | None = None) -> torch.device:
    """``auto`` -> cuda when available. With several GPUs, torchrun ranks use their local rank,
    and the jobs of a local sweep (joblib launcher) spread over the GPUs by job number."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
        if name == "cuda" and torch.cuda.device_count() > 1 and not (dist_info and dist_info.enabled):
            return torch.device("cuda", sweep_job_number() % torch.cuda.device_count())
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise PosbenchError(f"trainer.device={name} but CUDA is not available; use trainer.device=cpu")
        if dist_info is not None and dist_info.enabled:
            return torch.device("cuda", dist_info.local_rank)
    return torch.device(name)


def setup_device(name: str, precision: str, dist_info: DistInfo | None = None) -> torch.device:
    """The device a run computes on (:func:`resolve_device`), set up as ``posbench train`` and
    ``posbench bench`` both use it: on CUDA the device with its index made current, and TF32
    matmuls on unless ``precision`` is ``fp32`` (fp32 means fp32)."""
    device = resolve_device(name, dist_info)
    if device.type == "cuda":
        if device.index is None:  # torch.cuda.set_device refuses a device without an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        if precision != "fp32":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
    return device


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``trainer.precision`` on ``device`` (None: plain fp32).

    ``auto`` is bf16 on CUDA and on CPUs with native bf16 arithmetic (x86 AVX512-BF16 or AMX,
    Arm BF16), where bf16 autocast trains ~1.6x faster; fp32 on other CPUs, which would only
    emulate bf16. Master weights, the eval head and the loss stay fp32 either way.
    """
    if precision == "bf16":
        return torch.bfloat16
    if precision == "auto" and (device.type == "cuda" or (device.type == "cpu" and hardware.cpu_has_native_bf16())):
        return torch.bfloat16
    return None


def precision_name(dtype: torch.dtype | None) -> str:
    """The name results record for an autocast dtype (None: ``fp32``), as ``environment.precision``."""
    return hardware.PRECISION_NAMES.get(dtype, str(dtype))


def autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    """The autocast context of a forward pass (a no-op context for plain fp32)."""
    return torch.autocast(device.type, dtype=dtype) if dtype else nullcontext()


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def as_posbench_error(err: BaseException) -> BaseException:
    """Out-of-memory and full-disk errors as one line naming the fix; others unchanged."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return PosbenchError(
            f"out of memory ({one_line(err)[:160]}); lower trainer.micro_batch_size (gradient accumulation "
            "keeps the batch), eval.batch_size, trainer.context or the model size"
        )
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return PosbenchError(
            f"no space left on the device writing {err.filename or 'the run'}; free some space, or point "
            "hydra.run.dir / POSBENCH_CACHE at a disk with room, then rerun the same command to resume"
        )
    if isinstance(err, RuntimeError) and any(words in str(err) for words in TORCH_SAVE_SHORT_WRITE):
        return PosbenchError(  # torch.save on a full disk: its zip writer reports a short write, not ENOSPC
            f"no space left on the device writing a checkpoint (torch.save: {one_line(err)[:120]}); free some "
            "space, or point hydra.run.dir at a disk with room, then rerun the same command to resume"
        )
    return err


TORCH_SAVE_SHORT_WRITE = ("file write failed", "unexpected pos")
"""How torch.save's zip writer words a write cut short by a full disk (``inline_container.cc``)."""


__all__ = ["as_posbench_error", "autocast", "autocast_dtype", "precision_name", "seed_everything", "resolve_device",
           "setup_device", "sweep_job_number"]
