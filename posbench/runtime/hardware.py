"""What the CPU can do: native bf16 (for ``precision=auto``), its measured matmul peak (for MFU),
and the allocator setting that keeps CPU training out of page faults."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import time
from pathlib import Path

import torch

# "bf16" is the Arm feature flag (Graviton3, Neoverse V1/N2, Apple M2+ under Linux).
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic in hardware (the kernels torch's oneDNN uses for
    bf16 autocast); without it bf16 is emulated and slower than fp32."""
    probes = getattr(torch._C, "_cpu", None)
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        if probes is not None and hasattr(probes, name) and getattr(probes, name)():
            return True
    try:  # other architectures, or a torch without the probes
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(NATIVE_BF16_FLAGS & flags)


def cpu_matmul_peak_tflops(dtype: torch.dtype, size: int = 1024, seconds: float = 0.5) -> float:
    """Measured CPU peak: the best TFLOP/s of square ``size`` matmuls in ``dtype`` over about
    ``seconds``, with torch's current thread count. CPUs publish no single peak (it depends on
    cores, clocks and the vector units in use), so MFU on a CPU is relative to this probe."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up: thread pool and kernel selection
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


# glibc's mallopt parameters (malloc.h) and the environment variables glibc reads for them at
# start-up; the largest mmap threshold glibc accepts on 64-bit systems is 32 MiB.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": 32 * 2**20, "MALLOC_TRIM_THRESHOLD_": 256 * 2**20}


def tune_cpu_allocator(environ: dict[str, str] | None = None) -> bool:
    """Keep glibc from handing freed tensor memory back to the kernel on every training step.

    By default glibc serves blocks above a (dynamic) threshold with a fresh ``mmap`` and trims the
    heap top whenever 128 KiB+ are free, so every step's activations fault their pages in again:
    on a 2-core CPU a cpu_quick step spent ~10 % of its time in the kernel. A fixed 32 MiB mmap
    threshold and a 256 MiB trim threshold let the heap reuse those pages (about +15 % training
    tokens/s there; memory held back is at most the trim threshold). The same effect as the
    usual advice of preloading jemalloc or tcmalloc, without a dependency.

    Applied to this process with ``mallopt`` and, through the environment, to the processes it
    starts (sweep workers). Does nothing when the user chose: any of the variables already set,
    or another allocator in ``LD_PRELOAD``; and nothing outside glibc. Returns whether it tuned.
    """
    env = os.environ if environ is None else environ
    if any(name in env for name in ALLOCATOR_ENV) or "malloc" in env.get("LD_PRELOAD", ""):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    tuned = (mallopt(_M_MMAP_THRESHOLD, ALLOCATOR_ENV["MALLOC_MMAP_THRESHOLD_"]) == 1
             and mallopt(_M_TRIM_THRESHOLD, ALLOCATOR_ENV["MALLOC_TRIM_THRESHOLD_"]) == 1)
    if tuned:
        env.update({name: str(value) for name, value in ALLOCATOR_ENV.items()})
    return tuned


@functools.lru_cache(maxsize=1)
def cpu_model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``; ``platform.processor()``
    elsewhere), or ``unknown``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_name(device: torch.device) -> str:
    """What ``device`` is, in words: the GPU's name, or the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model_name()


PRECISION_NAMES = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # autocast dtype -> precision


def run_environment(precision: str, amp_dtype: torch.dtype | None, device: torch.device) -> dict[str, object]:
    """What a run computed with (results.json ``environment``, the W&B config, train.log).

    ``precision`` is the resolved one (``bf16`` or ``fp32``; ``trainer.precision=auto`` depends
    on the machine: see :func:`cpu_has_native_bf16`), ``configured_precision`` what the config
    said; ``autocast_dtype`` is None for plain fp32.
    """
    return {
        "precision": PRECISION_NAMES.get(amp_dtype, str(amp_dtype)),
        "configured_precision": precision,
        "autocast_dtype": None if amp_dtype is None else str(amp_dtype).removeprefix("torch."),
        "device": device.type,
        "device_name": device_name(device),
        "cpu_native_bf16": cpu_has_native_bf16(),
        "torch": torch.__version__,
    }


def environment_line(environment: dict[str, object]) -> str:
    """One line for train.log: ``precision bf16 (trainer.precision=auto; autocast bfloat16) on ...``."""
    autocast = environment.get("autocast_dtype")
    return (f"precision {environment['precision']} (trainer.precision={environment['configured_precision']}; "
            f"{'autocast ' + str(autocast) if autocast else 'no autocast'}) on {environment['device']} "
            f"({environment['device_name']}), torch {environment['torch']}")
