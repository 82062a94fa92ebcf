"""Timers, contention and memory of ``posbench bench``'s timed blocks.

Timing. On CUDA every step is bracketed by ``torch.cuda.Event``s recorded on the stream (no host
sync inside the loop, so steps pipeline as in real training; the events measure GPU time between
step boundaries, idle gaps included) and read after one synchronize; on the CPU
``time.perf_counter`` per step.

Contention. A speed measured while other work shares the machine is not the method's speed.
Every timed block (a method's or the peer's training steps, each eval length) records the
1-minute load average before and after it (``os.getloadavg``), the machine's core count, the
p10/p50/p90 of its step times and their spread p90/p10, and is flagged ``contended`` (with the
reason) when the spread exceeds :data:`CONTENDED_SPREAD` or the load average exceeds the core
count. The CPU's measured peak (MFU) records its load average the same way.

Memory. ``torch.cuda.max_memory_allocated`` over the timed steps, after
``reset_peak_memory_stats`` at the end of warm-up (steady state: weights, gradients, AdamW
state and activations), in GiB (2**30 bytes). On the CPU it is not measured and reported as
``null`` (a process RSS high-water mark cannot be attributed to one method in a process that
benchmarks several).
"""

from __future__ import annotations

import gc
import math
import os
import time
from typing import Any, Callable

import numpy as np
import torch

# A timed block whose step times spread wider than this (p90 / p10) is flagged contended: on a
# machine to itself, steps of one shape repeat within a few percent (CUDA) or ~10-20 % (CPU).
CONTENDED_SPREAD = 1.5


def spread(values: list[float], prefix: str) -> dict[str, float]:
    """Median, p10, p90, min, max and mean of ``values`` as ``{prefix}_median`` ... ."""
    a = np.asarray(values, dtype=np.float64)
    return {
        f"{prefix}_median": float(np.median(a)),
        f"{prefix}_p10": float(np.percentile(a, 10)),
        f"{prefix}_p90": float(np.percentile(a, 90)),
        f"{prefix}_min": float(a.min()),
        f"{prefix}_max": float(a.max()),
        f"{prefix}_mean": float(a.mean()),
    }


def load_average() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return None


def cpu_cores() -> int:
    return os.cpu_count() or 1


def overloaded(loads: list[float | None], cores: int) -> float | None:
    """The highest of ``loads`` when it exceeds ``cores``, else None."""
    known = [x for x in loads if x is not None]
    return max(known) if known and max(known) > cores else None


def contention(step_ms: list[float], load_before: float | None, load_after: float | None,
               cores: int | None = None) -> dict[str, Any]:
    """Load average around a timed block, the p10/p50/p90 of its step times, and whether it was
    contended (spread p90/p10 above :data:`CONTENDED_SPREAD`, or load above the core count)."""
    cores = cores or cpu_cores()
    p10, p50, p90 = (float(v) for v in np.percentile(np.asarray(step_ms, dtype=np.float64), [10, 50, 90]))
    ratio = p90 / p10 if p10 > 0 else math.inf
    reasons = []
    if ratio > CONTENDED_SPREAD:
        reasons.append(f"step-time spread p90/p10 {ratio:.2f} > {CONTENDED_SPREAD}")
    load = overloaded([load_before, load_after], cores)
    if load is not None:
        reasons.append(f"load average {load:.1f} > {cores} cores")
    return {"load_average_before": load_before, "load_average_after": load_after, "cpu_cores": cores,
            "ms_p10": p10, "ms_p50": p50, "ms_p90": p90, "spread_p90_p10": ratio,
            "contended": bool(reasons), "contention": "; ".join(reasons) or None}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[int], Any], count: int, device: torch.device, offset: int = 0) -> tuple[list[float], float, Any]:
    """Run ``step(offset + i)`` ``count`` times -> (per-step ms, wall seconds, last return value).

    CUDA: an event is recorded before the first step and after every step, all read after a
    single synchronize at the end, so the loop never waits for the GPU. CPU: perf_counter.
    """
    last = None
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
        torch.cuda.synchronize(device)
        wall_start = time.perf_counter()
        events[0].record()
        for i in range(count):
            last = step(offset + i)
            events[i + 1].record()
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - wall_start
        ms = [events[i].elapsed_time(events[i + 1]) for i in range(count)]
        return ms, wall, last
    ms = []
    wall_start = time.perf_counter()
    for i in range(count):
        t0 = time.perf_counter()
        last = step(offset + i)
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms, time.perf_counter() - wall_start, last


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"peak_memory_gb": None, "peak_memory_bytes": None}
    allocated = torch.cuda.max_memory_allocated(device)
    return {"peak_memory_gb": allocated / 2**30, "peak_memory_bytes": int(allocated),
            "peak_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30}


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError)
