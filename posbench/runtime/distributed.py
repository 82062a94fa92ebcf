"""Data parallelism with torchrun: the same command runs on 1 or N processes.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; without them everything here is a no-op for a
single process. Only rank 0 writes files and logs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group torchrun set up (gloo on CPU, nccl on CUDA); no-op otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return info


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def mean_across_ranks(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= info.world_size
    return value


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True if ``flag`` is true on any rank (e.g. a preemption signal that reached one rank)."""
    if not info.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def same_on_all_ranks(path: Path, info: DistInfo) -> Path:
    """Rank 0's run directory for every rank: ranks started in different seconds would
    otherwise resolve Hydra's timestamped directory differently."""
    if not info.enabled:
        return path
    box = [str(path)]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])
