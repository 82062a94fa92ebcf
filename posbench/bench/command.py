"""``posbench bench``: training and evaluation speed of every position method, plus a peer.

For each method (default: all of :func:`posbench.list_methods`) on one model shape, random token
batches (no data needed) go through

- **training**: the trainer's own step, :class:`posbench.train.optim.TrainStep`: bf16 autocast
  (``precision=auto`` on CUDA), forward, float32 cross-entropy, backward, global grad-norm clip,
  fused AdamW (:func:`posbench.train.optim.make_optimizer`) and the warmup+cosine ``LambdaLR`` step, on the
  ``torch.compile``-d model when compile is on (``auto``: CUDA only). ``warmup_steps`` untimed
  steps (compilation, allocator warm-up, AdamW state creation), then ``steps`` timed steps,
  reported as median, p10/p90, min/max and mean. On CUDA every step is bracketed by
  ``torch.cuda.Event``s recorded on the stream (no host sync inside the loop, so steps pipeline
  as in real training; the events measure GPU time between step boundaries, idle gaps
  included) and read after one synchronize; on the CPU ``time.perf_counter`` per step.
- **peak memory**: ``torch.cuda.max_memory_allocated`` over the timed steps, after
  ``reset_peak_memory_stats`` at the end of warm-up (steady state: weights, gradients, AdamW
  state and activations). Reported in GiB (2**30 bytes) as ``peak_memory_gb``. On the CPU it is
  not measured and reported as ``null`` (a process RSS high-water mark cannot be attributed to
  one method in a process that benchmarks several).
- **evaluation**: posbench's own evaluation path, :func:`posbench.evaluation.loss.per_position_loss`
  (``torch.inference_mode``, autocast over the transformer body, ``hidden_states`` then the
  float32 LM head and cross-entropy in position chunks), on the uncompiled model as
  ``posbench train``/``posbench eval`` run it, one ``[eval_batch_size, L]`` batch per call, at
  every length in ``eval_lengths``. ``max(1, warmup_steps)`` untimed calls, then ``eval_steps``
  timed calls (synchronised; the call itself ends with a device-to-host copy). A length that
  runs out of CUDA memory is recorded as ``"oom"``; a length a method cannot represent (learned
  embeddings past ``max_positions``) as ``"unsupported: ..."``.
- **peer**: ``transformers.LlamaForCausalLM`` of the same shape (vocab, width, layers, heads,
  SwiGLU width, no biases, RMSNorm eps, tying), SDPA attention, same batch, context, precision,
  optimizer, schedule, clip and compile setting, timed right after its twin (the registered method
  declaring ``llama_equivalent``; or last when the twin is not benchmarked). ``peer_ratio`` =
  posbench twin training tokens/s / peer tokens/s
  (medians). A peer that cannot be built or run is skipped with the reason recorded.

FLOPs and MFU (the PaLM paper's appendix B convention, also nanoGPT's ``estimate_mfu``)::

    training FLOPs per token = 6 * N + 12 * L * T * d

- ``N``: parameters of every ``nn.Linear`` in the model, i.e. the weights actually multiplied per
  token: q/k/v/out projections, SwiGLU gate/up/down and the LM head. The token embedding (a
  lookup, no multiply) and position-method tables are excluded. Forward costs 2 FLOPs per
  weight per token and backward twice that: 6 * N.
- ``12 * L * T * d``: attention scores ``Q K^T`` and the weighted sum ``A V``, each
  ``2 * T * d`` FLOPs per token per layer forward (``d = n_heads * head_dim``), times 3 for
  forward + backward, with ``T`` the training context. Causal masking is *not* halved (PaLM's
  convention), so the number is the dense-attention model cost.
- Position-method FLOPs (rotations, score terms, Shaw's ``q . r``) are not counted: every method
  gets the same model FLOPs, so its MFU differs from the twin's only through speed. The peer's
  ``N`` is counted the same way from its own ``nn.Linear`` modules (it comes out identical).
- ``MFU = FLOPs per token * median tokens/s / peak``, with ``peak_tflops`` the device's dense
  bf16 peak (``auto``: H200 / H100 SXM 989.4, H100 PCIe 756.5, A100 312, L4 121 TFLOP/s; other
  GPUs get ``null`` and no MFU). On CUDA, MFU is always relative to the bf16 peak, also when
  ``precision=fp32``. A CPU publishes no single peak, so ``auto`` measures one: the best
  TFLOP/s of 1024 x 1024 matmuls over half a second, in the run's precision (bf16 under bf16
  autocast, else fp32) with torch's thread count (:func:`posbench.runtime.hardware.cpu_matmul_peak_tflops`).

Contention. A speed measured while other work shares the machine is not the method's speed.
Every timed block (a method's or the peer's training steps, each eval length) records the
1-minute load average before and after it (``os.getloadavg``), the machine's core count, the
p10/p50/p90 of its step times and their spread p90/p10, and is flagged ``contended`` (with the
reason) when the spread exceeds :data:`CONTENDED_SPREAD` or the load average exceeds the core
count. The CPU's measured peak (MFU) records its load average the same way. ``bench.md`` marks
contended rows and ratios instead of printing them as clean numbers.

Outputs in the output folder (``out=`` or the Hydra run dir ``outputs/bench/<date>_<time>``):
``bench.json`` (every number and the config; rewritten after each method, so an interrupted run
keeps what it measured) and ``bench.md`` (the table, also printed to stdout).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import platform
import re
import shlex
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

import posbench
from posbench.config.settings import from_section
from posbench.core.errors import PosbenchError, one_line
from posbench.core.io import write_json_atomic, write_text_atomic
from posbench.evaluation.loss import per_position_loss
from posbench.methods import PositionMethod, list_methods, method_class
from posbench.model.transformer import ModelConfig, Transformer, attention_backends, build_model
from posbench.runs.spec import MethodSpec
from posbench.runtime.device import autocast, autocast_dtype, resolve_device
from posbench.runtime.hardware import cpu_matmul_peak_tflops
from posbench.train.optim import TrainStep
from posbench.train.settings import TrainerConfig

logger = logging.getLogger("posbench")

SCHEMA_VERSION = 1

# Dense (non-sparse) bf16 tensor-core peaks in TFLOP/s, matched against the CUDA device name in
# order (first match wins, so "H100 PCIe" is tried before "H100").
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bH200\b", 989.4),
    (r"\bH100\b.*\bPCIe\b", 756.5),
    (r"\bH100\b", 989.4),
    (r"\bA100\b", 312.0),
    (r"\bL4\b", 121.0),
)

FLOP_FORMULA = (
    "training FLOPs/token = 6*N + 12*L*T*d (PaLM appendix B / nanoGPT): N = weights of all "
    "nn.Linear layers incl. the LM head (token embedding and position-method tables excluded), "
    "L = layers, T = training context, d = d_model; attention QK^T and AV not halved for "
    "causality; position-method FLOPs not counted"
)

# A timed block whose step times spread wider than this (p90 / p10) is flagged contended: on a
# machine to itself, steps of one shape repeat within a few percent (CUDA) or ~10-20 % (CPU).
CONTENDED_SPREAD = 1.5

_KNOWN_KEYS = {
    "methods", "batch_size", "context", "warmup_steps", "steps", "eval_lengths", "eval_batch_size",
    "eval_steps", "compile", "precision", "device", "peer", "vocab_size", "peak_tflops", "out",
    "debug", "model",
}


# ----------------------------------------------------------------------------- settings


@dataclass
class BenchSettings:
    """The validated ``configs/bench.yaml`` (see that file for each field's meaning)."""

    methods: list[str]
    batch_size: int
    context: int
    warmup_steps: int
    steps: int
    eval_lengths: list[int]
    eval_batch_size: int
    eval_steps: int
    compile: str
    precision: str
    device: str
    peer: bool
    vocab_size: int
    peak_tflops: float | str | None
    out: str | None
    debug: bool


def _int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise PosbenchError(f"{name} must be {kind}, got {value!r}; e.g. {name}={max(minimum, 1) * 8}")
    return value


def resolve_methods(value: Any) -> list[str]:
    """``all`` / a name / a list of names -> registered method names (order kept, deduplicated)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "all"):
        return list_methods()
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names:
        raise PosbenchError(f"methods must be all or a non-empty list like [rope,alibi], got {value!r}")
    out: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise PosbenchError(f"methods must list method names, got {name!r}; e.g. methods=[rope,alibi]")
        method_class(name)  # unknown -> PosbenchError naming the valid ones
        if name not in out:
            out.append(name)
    return out


def settings_from_config(cfg: DictConfig | dict[str, Any]) -> tuple[BenchSettings, Any]:
    """Validate the composed bench config -> (settings, ModelConfig); every user error here."""
    values = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    values.pop("hydra", None)
    unknown = sorted(set(values) - _KNOWN_KEYS)
    if unknown:
        raise PosbenchError(f"unknown bench option(s) {', '.join(unknown)}; known: {', '.join(sorted(_KNOWN_KEYS))}")

    lengths = values.get("eval_lengths", [512, 1024, 2048])
    if lengths is None:
        lengths = []
    if isinstance(lengths, int) and not isinstance(lengths, bool):
        lengths = [lengths]
    if not isinstance(lengths, (list, tuple)):
        raise PosbenchError(f"eval_lengths must be a list like [512,1024], got {lengths!r}")
    lengths = sorted({_int("eval_lengths entries", n) for n in lengths})

    compile_ = str(values.get("compile", "auto")).lower()
    if compile_ not in ("auto", "true", "false"):
        raise PosbenchError(f"compile must be auto, true or false, got {values.get('compile')!r}")
    precision = str(values.get("precision", "auto"))
    if precision not in ("auto", "fp32", "bf16"):
        raise PosbenchError(f"precision must be auto, fp32 or bf16, got {precision!r}")
    device = values.get("device", "auto")
    if not isinstance(device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise PosbenchError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    peer = values.get("peer", True)
    if not isinstance(peer, bool):
        raise PosbenchError(f"peer must be true or false, got {peer!r}")
    peak = values.get("peak_tflops", "auto")
    if isinstance(peak, str) and peak.lower() in ("auto", "null", "none"):
        peak = "auto" if peak.lower() == "auto" else None
    elif peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float)) or not peak > 0):
        raise PosbenchError(f"peak_tflops must be auto, null or a positive number (TFLOP/s), got {peak!r}")
    elif peak is not None:
        peak = float(peak)
    out = values.get("out")
    if out is not None and not isinstance(out, str):
        out = str(out)

    settings = BenchSettings(
        methods=resolve_methods(values.get("methods", "all")),
        batch_size=_int("batch_size", values.get("batch_size", 64)),
        context=_int("context", values.get("context", 256)),
        warmup_steps=_int("warmup_steps", values.get("warmup_steps", 5), minimum=0),
        steps=_int("steps", values.get("steps", 30)),
        eval_lengths=lengths,
        eval_batch_size=_int("eval_batch_size", values.get("eval_batch_size", 8)),
        eval_steps=_int("eval_steps", values.get("eval_steps", 10)),
        compile=compile_,
        precision=precision,
        device=device,
        peer=peer,
        vocab_size=_int("vocab_size", values.get("vocab_size", 8192)),
        peak_tflops=peak,
        out=out,
        debug=bool(values.get("debug", False)),
    )
    model_values = dict(values.get("model") or {})
    model_values["vocab_size"] = settings.vocab_size
    model_cfg = from_section(ModelConfig, "model", model_values)
    for name in settings.methods:
        _check_method(name, model_cfg, settings)
    return settings, model_cfg


def method_config(name: str) -> dict[str, Any]:
    """The method's options from ``configs/method/<name>.yaml`` (constructor defaults if none)."""
    return MethodSpec.defaults(name).options


def peer_twin() -> str | None:
    """The registered method whose model is the peer's twin (``llama_equivalent``), if any."""
    return next((name for name in list_methods() if method_class(name).llama_equivalent), None)


def _check_method(name: str, model_cfg: Any, settings: BenchSettings) -> None:
    """Build the method on the meta device: shape problems surface before any timing."""
    try:
        probe = MethodSpec.defaults(name).probe(model_cfg.dims)
    except PosbenchError as err:
        raise PosbenchError(f"{err}; pick another model= or methods=") from None
    if probe.max_positions is not None and settings.context > probe.max_positions:
        raise PosbenchError(
            f"method {name} supports positions up to {probe.max_positions} but context={settings.context}; "
            f"lower context or leave {name} out of methods"
        )


# ----------------------------------------------------------------------------- FLOPs and peaks


def matmul_parameters(model: nn.Module) -> int:
    """Weights multiplied per token: every ``nn.Linear`` (a weight shared by two layers counts twice)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def train_flops_per_token(matmul_params: int, n_layers: int, context: int, d_model: int) -> float:
    """``6 * N + 12 * L * T * d`` (see the module docstring)."""
    return 6.0 * matmul_params + 12.0 * n_layers * context * d_model


def resolve_peak_tflops(setting: float | str | None, device: torch.device,
                        amp_dtype: torch.dtype | None = None) -> tuple[float | None, str]:
    """(peak dense TFLOP/s or None, where it came from). CUDA: the bf16 peak from the table.
    CPU: measured by a short matmul probe in the run's precision (``amp_dtype``, else fp32)."""
    if setting is None:
        return None, "peak_tflops=null"
    if setting != "auto":
        return float(setting), "peak_tflops (config)"
    if device.type == "cpu":
        dtype = amp_dtype or torch.float32
        peak = cpu_matmul_peak_tflops(dtype)
        name = str(dtype).replace("torch.", "")
        return peak, f"measured CPU peak: best {name} 1024x1024 matmul, {torch.get_num_threads()} threads"
    if device.type != "cuda":
        return None, f"no peak for {device.type}"
    name = torch.cuda.get_device_name(device)
    for pattern, peak in PEAK_BF16_TFLOPS:
        if re.search(pattern, name):
            return peak, f"bf16 dense peak of {name}"
    return None, f"{name} not in the peak table; set peak_tflops=<TFLOP/s>"


# ----------------------------------------------------------------------------- timing helpers


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


# ----------------------------------------------------------------------------- the measurements


@dataclass
class Env:
    """What every measurement shares."""

    settings: BenchSettings
    model_cfg: Any
    trainer: Any  # TrainerConfig: optimizer, schedule and clip settings (the trainer's defaults)
    device: torch.device
    amp_dtype: torch.dtype | None
    use_compile: bool
    peak_tflops: float | None

    def autocast(self):
        return autocast(self.device, self.amp_dtype)


def random_batches(env: Env, count: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """``count`` random (inputs, targets) pairs of shape (batch, context), already on the device."""
    g = torch.Generator().manual_seed(seed)
    s = env.settings
    out = []
    for _ in range(count):
        seq = torch.randint(0, s.vocab_size, (s.batch_size, s.context + 1), generator=g).to(env.device)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def time_training(env: Env, model: nn.Module, loss_of: Callable[[Tensor, Tensor], Tensor],
                  flops_per_token: float) -> dict[str, Any]:
    """The trainer's step (:class:`posbench.train.optim.TrainStep`) on random batches: warm-up, then
    timed steps -> statistics."""
    s = env.settings
    total_steps = s.warmup_steps + s.steps
    train_step = TrainStep(model, env.trainer, env.device, total_steps, env.amp_dtype)
    batches = random_batches(env, min(4, total_steps))
    model.train()

    def step(i: int) -> Tensor:
        x, y = batches[i % len(batches)]  # (B, T) each
        return train_step(lambda _: loss_of(x, y))  # the model's own training loss, fp32 softmax

    warm_start = time.perf_counter()
    for i in range(s.warmup_steps):
        step(i)
    synchronize(env.device)
    warmup_seconds = time.perf_counter() - warm_start
    reset_peak_memory(env.device)
    load_before = load_average()
    step_ms, wall, last_loss = time_steps(step, s.steps, env.device, offset=s.warmup_steps)
    load = contention(step_ms, load_before, load_average())
    memory = peak_memory(env.device)
    final_loss = float(last_loss)
    if not math.isfinite(final_loss):
        raise RuntimeError(f"training loss became {final_loss} during the benchmark")

    tokens_per_step = s.batch_size * s.context
    tps = [tokens_per_step / (ms / 1e3) for ms in step_ms]
    stats: dict[str, Any] = {**spread(step_ms, "step_ms"), **spread(tps, "tokens_per_second")}
    stats["tokens_per_second_overall"] = tokens_per_step * s.steps / wall
    tflops = flops_per_token * stats["tokens_per_second_median"] / 1e12
    stats.update(
        tokens_per_step=tokens_per_step,
        flops_per_token=flops_per_token,
        tflops=tflops,
        mfu=tflops / env.peak_tflops if env.peak_tflops else None,
        **memory,
        compiled=env.use_compile,
        autocast=str(env.amp_dtype).replace("torch.", "") if env.amp_dtype else None,
        warmup_steps=s.warmup_steps,
        steps=s.steps,
        warmup_seconds=warmup_seconds,
        final_loss=final_loss,
        step_ms_all=step_ms,
        load=load,
    )
    return stats


def time_eval_length(env: Env, model: nn.Module, length: int) -> dict[str, Any]:
    """posbench's evaluation of one ``[eval_batch_size, length]`` batch, timed per call."""
    s = env.settings
    g = torch.Generator().manual_seed(length)
    seqs = torch.randint(0, s.vocab_size, (s.eval_batch_size, length + 1), generator=g).to(env.device)

    def call(_: int) -> Tensor:
        return per_position_loss(model, seqs, s.eval_batch_size, env.device, autocast_dtype=env.amp_dtype)

    warmup = max(1, s.warmup_steps)
    free_memory(env.device)
    reset_peak_memory(env.device)
    for i in range(warmup):
        call(i)
    ms: list[float] = []
    load_before = load_average()
    for i in range(s.eval_steps):
        synchronize(env.device)
        t0 = time.perf_counter()
        losses = call(i)  # ends with a device-to-host copy of the result: synchronised
        ms.append((time.perf_counter() - t0) * 1e3)
    load = contention(ms, load_before, load_average())
    if not bool(torch.isfinite(losses).all()):
        raise RuntimeError(f"evaluation loss at length {length} is not finite")
    tokens = s.eval_batch_size * length
    return {
        **spread([tokens / (m / 1e3) for m in ms], "tokens_per_second"),
        **spread(ms, "batch_ms"),
        "tokens_per_batch": tokens,
        **peak_memory(env.device),
        "mean_loss": float(losses.mean()),
        "load": load,
    }


def bench_eval(env: Env, model: nn.Module, max_positions: int | None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for length in env.settings.eval_lengths:
        if max_positions is not None and length > max_positions:
            results[str(length)] = f"unsupported: positions up to {max_positions}"
            continue
        oom = False
        try:
            results[str(length)] = time_eval_length(env, model, length)
        except Exception as err:
            if not is_oom(err):
                raise
            oom = True
        if oom:  # outside the except block, so the traceback's tensors are gone
            free_memory(env.device)
            results[str(length)] = "oom"
            logger.warning("  eval length %d: out of memory", length)
        else:
            r = results[str(length)]
            logger.info("  eval length %d: %s tok/s (median of %d)", length,
                        f"{r['tokens_per_second_median']:,.0f}", env.settings.eval_steps)
    return results


def bench_method(env: Env, name: str) -> dict[str, Any]:
    """Train-step and eval timings of one method; the model is freed when this returns."""
    torch.manual_seed(0)
    model = build_model(env.model_cfg, name, method_config(name)).to(env.device)
    backend = attention_backends(env.model_cfg, model.position, env.device)
    n_matmul = matmul_parameters(model)
    flops = train_flops_per_token(n_matmul, env.model_cfg.n_layers, env.settings.context, env.model_cfg.d_model)
    result: dict[str, Any] = {"parameters": model.num_parameters(), "matmul_parameters": n_matmul}

    logger.info("bench %s: %d+%d training steps, attention %s%s", name, env.settings.warmup_steps,
                env.settings.steps, backend, ", compiled" if env.use_compile else "")
    train: dict[str, Any]
    oom = False
    try:
        runner = torch.compile(model) if env.use_compile else model
        train = time_training(env, model, lambda x, y: runner(x, targets=y), flops)
    except Exception as err:
        if not is_oom(err):
            raise
        oom = True
    runner = None  # drop the compiled wrapper before evaluation
    if oom:
        for p in model.parameters():
            p.grad = None
        free_memory(env.device)
        train = {"error": "oom"}
        logger.warning("  training: out of memory at batch_size=%d; lower batch_size", env.settings.batch_size)
    else:
        logger.info("  training: %.2f ms/step, %s tok/s%s", train["step_ms_median"],
                    f"{train['tokens_per_second_median']:,.0f}",
                    f", MFU {train['mfu']:.1%}" if train.get("mfu") is not None else "")
    train["attention_backend"] = backend
    result["train"] = train
    for p in model.parameters():
        p.grad = None
    free_memory(env.device)
    result["eval"] = bench_eval(env, model, model.position.max_positions)
    result["eval_attention_backend"] = backend
    return result


def build_peer(env: Env) -> nn.Module:
    """``transformers.LlamaForCausalLM`` with posbench's shape (the :func:`peer_twin`'s twin)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m, s = env.model_cfg, env.settings
    config = LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=m.hidden_size,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_heads,
        max_position_embeddings=max([s.context, *s.eval_lengths]),
        rms_norm_eps=m.norm_eps,
        initializer_range=m.init_std,
        tie_word_embeddings=m.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(env.device)


def bench_peer(env: Env) -> dict[str, Any]:
    """Time the peer's training step; never raises (a failure is recorded as ``skipped``)."""
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - transformers is a dependency
        return {"skipped": f"transformers is not importable: {one_line(err)}"}
    info: dict[str, Any] = {"model": "transformers.LlamaForCausalLM", "transformers": transformers.__version__}
    logger.info("bench peer: transformers LlamaForCausalLM (sdpa)%s", ", compiled" if env.use_compile else "")
    try:
        peer = build_peer(env)
        info["attention"] = getattr(peer.config, "_attn_implementation", "sdpa")
        n_matmul = matmul_parameters(peer)
        info["parameters"] = sum(p.numel() for p in {id(p): p for p in peer.parameters()}.values())
        info["matmul_parameters"] = n_matmul
        flops = train_flops_per_token(n_matmul, env.model_cfg.n_layers, env.settings.context, env.model_cfg.d_model)
        runner = torch.compile(peer) if env.use_compile else peer

        def loss_of(x: Tensor, y: Tensor) -> Tensor:  # what the trainer did before lm_loss: full logits
            return F.cross_entropy(runner(input_ids=x).logits.float().flatten(0, 1), y.flatten())

        info["train"] = time_training(env, peer, loss_of, flops)
        logger.info("  training: %.2f ms/step, %s tok/s", info["train"]["step_ms_median"],
                    f"{info['train']['tokens_per_second_median']:,.0f}")
    except Exception as err:
        if env.settings.debug:
            raise
        logger.warning("peer skipped: %s\n%s", one_line(err), traceback.format_exc())
        info = {"skipped": "oom" if is_oom(err) else one_line(err), **{k: info[k] for k in ("model", "transformers")}}
    return info


# ----------------------------------------------------------------------------- report


def _fmt_int(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _cell_eval(entry: Any) -> str:
    if isinstance(entry, dict):
        return _fmt_int(entry["tokens_per_second_median"])
    return str(entry).split(":")[0] if entry is not None else "-"


def _contended(entry: Any) -> bool:
    """A timed block (training or one eval length) flagged contended."""
    return isinstance(entry, dict) and bool((entry.get("load") or {}).get("contended"))


def _contention_cell(train: dict[str, Any]) -> str:
    load = train.get("load") or {}
    if not load.get("contended"):
        return "-" if load else "not recorded"
    parts = []
    if load["spread_p90_p10"] > CONTENDED_SPREAD:
        parts.append(f"spread {load['spread_p90_p10']:.2f}")
    busiest = overloaded([load["load_average_before"], load["load_average_after"]], load["cpu_cores"])
    if busiest is not None:
        parts.append(f"load {busiest:.1f}")
    return ", ".join(parts)


def _load_lines(report: dict[str, Any], blocks: list[Any]) -> list[str]:
    """The machine's load average and, when any timed block was contended, the warning."""
    load = report.get("load_average")
    if not load:
        return []
    shown = [f"{x:.1f}" if x is not None else "?" for x in (load["start"], load["end"])]
    lines = [f"load average {shown[0]} at the start, {shown[1]} at the end, on {load['cpu_cores']} cores", ""]
    contended = sum(_contended(b) for b in blocks)
    if contended:
        warning = (f"**contended: {contended} of {len(blocks)} timed blocks ran on a busy machine (step-time "
                   f"spread p90/p10 > {load['contended_spread']}, or load average > {load['cpu_cores']} cores); "
                   "their times, MFU and ratios (marked `*`) are not clean measurements: rerun them on an idle "
                   "machine**")
        lines += [warning, ""]
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """bench.json -> the Markdown table (one row per method) with the peer line and notes."""
    cfg, model = report["config"], report["model"]
    lengths = cfg["eval_lengths"]
    twin = peer_twin() or "-"
    twin_tps = report["methods"].get(twin, {}).get("train", {}).get("tokens_per_second_median")
    lines = [
        "# posbench bench",
        "",
        f"{report['device']} ({report['device_type']}), torch {report['torch']}, posbench {report['posbench']}, "
        f"{report['date']}",
        "",
        f"model `{model['flavour']}`: d_model {model['d_model']}, {model['n_layers']} layers, "
        f"{model['n_heads']} heads, SwiGLU {model['hidden_size']}, vocab {model['vocab_size']}; "
        f"batch {cfg['batch_size']} x context {cfg['context']} = {cfg['batch_size'] * cfg['context']:,} tokens/step; "
        f"{report['autocast'] or 'fp32'}, {'compiled' if report['compiled'] else 'not compiled'}; "
        f"{cfg['warmup_steps']} warm-up + {cfg['steps']} timed steps (median, p10-p90)",
        "",
    ]
    if not report.get("complete", True):
        lines += ["**incomplete: the run is still going or was interrupted**", ""]
    peer_train = (report.get("peer") or {}).get("train")
    blocks = [b for entry in report["methods"].values()
              for b in [entry.get("train", {}), *entry.get("eval", {}).values()] if isinstance(b, dict) and "load" in b]
    lines += _load_lines(report, blocks + ([peer_train] if peer_train else []))
    twin_contended = _contended(report["methods"].get(twin, {}).get("train"))
    header = ["method", "attention", "step ms (p10-p90)", "train tok/s", f"% of {twin}", "MFU", "peak mem GiB",
              "contention"]
    header += [f"eval tok/s @{n}" for n in lengths]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---", "---"] + ["---:"] * (len(header) - 2)) + "|")
    for name, entry in report["methods"].items():
        train = entry.get("train", {})
        backend = train.get("attention_backend", "-")
        if "error" in train:
            cells = [name, backend, train["error"].split(":")[0], "-", "-", "-", "-", "-"]
        else:
            tps = train["tokens_per_second_median"]
            star = "*" if _contended(train) else ""
            cells = [
                name, backend,
                f"{train['step_ms_median']:.2f} ({train['step_ms_p10']:.2f}-{train['step_ms_p90']:.2f}){star}",
                _fmt_int(tps) + star,
                f"{100 * tps / twin_tps:.0f}%" + ("*" if star or twin_contended else "") if twin_tps else "-",
                f"{100 * train['mfu']:.1f}%{star}" if train.get("mfu") is not None else "-",
                f"{train['peak_memory_gb']:.2f}" if train.get("peak_memory_gb") is not None else "-",
                _contention_cell(train),
            ]
        evals = entry.get("eval", {})
        cells += [_cell_eval(evals.get(str(n))) + ("*" if _contended(evals.get(str(n))) else "") for n in lengths]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    peer = report.get("peer")
    if peer is None:
        lines.append("peer: not measured (peer=false)" if not cfg["peer"] else "peer: not measured yet")
    elif "skipped" in peer:
        lines.append(f"peer: transformers LlamaForCausalLM skipped ({peer['skipped']})")
    else:
        pt = peer["train"]
        ratio = report.get("peer_ratio")
        mfu = f", MFU {100 * pt['mfu']:.1f}%" if pt.get("mfu") is not None else ""
        lines.append(
            f"peer: transformers {peer['transformers']} LlamaForCausalLM ({peer.get('attention', 'sdpa')}, "
            f"{report['autocast'] or 'fp32'}, {'compiled' if report['compiled'] else 'not compiled'}): "
            f"{pt['step_ms_median']:.2f} ms/step, {_fmt_int(pt['tokens_per_second_median'])} tok/s{mfu}; "
            + (f"posbench {twin} / peer tokens/s = {ratio:.2f}" if ratio is not None
               else f"no ratio ({twin} not benchmarked)")
            + (" (* contended: not a clean measurement)" if ratio is not None and (_contended(pt) or twin_contended)
               else "")
        )
    flops = report["flops"]
    peak = flops["peak_tflops"]
    lines += [
        "",
        f"FLOPs: {flops['formula']}. Here N = {flops['matmul_parameters']:,}, "
        f"so {flops['train_flops_per_token'] / 1e6:,.1f} MFLOP per training token. "
        f"MFU = FLOPs/token x median tok/s / peak ("
        + (f"{peak:.4g} TFLOP/s, {flops['peak_source']})." if peak else f"none: {flops['peak_source']}; MFU omitted).")
        + (" The peak was measured under load average "
           f"{max(x for x in flops['peak_load_average'] if x is not None):.1f} on {report['load_average']['cpu_cores']} "
           "cores, so it and every MFU are not clean measurements." if flops.get("peak_contended") else "")
        + " Peak memory: CUDA max_memory_allocated over the timed steps (not measured on the CPU)."
        f" Eval: posbench's evaluation path (per_position_loss, uncompiled model), batch {cfg['eval_batch_size']},"
        f" median of {cfg['eval_steps']} calls per length.",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- entry point


def output_dir(settings: BenchSettings) -> Path:
    if settings.out:
        return Path(settings.out).expanduser()
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except (ValueError, ImportError):
        return Path("outputs/bench") / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def command_line() -> str:
    try:
        from hydra.core.hydra_config import HydraConfig

        return "posbench bench " + shlex.join(HydraConfig.get().overrides.task)
    except (ValueError, ImportError):
        return " ".join(shlex.quote(a) for a in sys.argv)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or device.type


def run_bench(cfg: DictConfig) -> dict[str, Any]:
    """``posbench bench``: measure every configured method (and the peer); write bench.json/md."""
    settings, model_cfg = settings_from_config(cfg)
    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        raise PosbenchError(f"device={settings.device} but CUDA is not available; use device=cpu (or auto)")
    device = resolve_device(settings.device)
    if device.type == "cuda":
        if device.index is None:  # torch.cuda.set_device refuses a device without an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # as the trainer does
        torch.backends.cudnn.allow_tf32 = True
    trainer = TrainerConfig(context=settings.context, batch_size=settings.batch_size, precision=settings.precision,
                            compile=settings.compile, device=settings.device, progress=False)
    use_compile = settings.compile == "true" or (settings.compile == "auto" and device.type == "cuda")
    amp_dtype = autocast_dtype(settings.precision, device)
    load_start = load_average()
    peak, peak_source = resolve_peak_tflops(settings.peak_tflops, device, amp_dtype)
    peak_load = [load_start, load_average()]  # around the CPU's peak measurement
    env = Env(settings, model_cfg, trainer, device, amp_dtype, use_compile, peak)
    out = output_dir(settings)
    out.mkdir(parents=True, exist_ok=True)

    with torch.device("meta"):  # the body alone: a method without position information
        n_matmul = matmul_parameters(Transformer(model_cfg, PositionMethod(model_cfg.dims)))
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "posbench": posbench.__version__,
        "python": platform.python_version(),
        "command": command_line(),
        "config": {k: v for k, v in asdict(settings).items() if k != "debug"},
        "model": {**model_cfg.to_dict(), "hidden_size": model_cfg.hidden_size},
        "optimizer": {"lr": trainer.lr, "betas": [trainer.beta1, trainer.beta2], "weight_decay": trainer.weight_decay,
                      "grad_clip": trainer.grad_clip, "fused": device.type == "cuda",
                      "schedule_warmup_steps": trainer.warmup_steps},
        "autocast": str(env.amp_dtype).replace("torch.", "") if env.amp_dtype else None,
        "compiled": use_compile,
        "flops": {
            "formula": FLOP_FORMULA,
            "matmul_parameters": n_matmul,
            "train_flops_per_token": train_flops_per_token(n_matmul, model_cfg.n_layers, settings.context,
                                                           model_cfg.d_model),
            "peak_tflops": peak,
            "peak_source": peak_source,
            "peak_load_average": peak_load,
            "peak_contended": peak_source.startswith("measured") and overloaded(peak_load, cpu_cores()) is not None,
        },
        "load_average": {"start": load_start, "end": None, "cpu_cores": cpu_cores(),
                         "contended_spread": CONTENDED_SPREAD},
        "methods": {},
        "peer": None,
        "peer_ratio": None,
        "complete": False,
    }
    logger.info("posbench bench on %s (%s): %s; writing %s", report["device"], device.type,
                ", ".join(settings.methods), out)

    twin = peer_twin()

    def write() -> str:
        twin_tps = report["methods"].get(twin, {}).get("train", {}).get("tokens_per_second_median")
        peer_tps = ((report["peer"] or {}).get("train") or {}).get("tokens_per_second_median")
        report["peer_ratio"] = twin_tps / peer_tps if twin_tps and peer_tps else None
        text = render_markdown(report)
        write_json_atomic(out / "bench.json", report)
        write_text_atomic(out / "bench.md", text)
        return text

    def measure_peer() -> None:
        report["peer"] = bench_peer(env)
        torch.compiler.reset()
        free_memory(device)
        write()

    # The peer runs right after its twin (or last if it is not benchmarked): the two numbers of
    # the ratio are taken back to back, and an interrupted run still has both.
    failures: list[str] = []
    for name in settings.methods:
        try:
            report["methods"][name] = bench_method(env, name)
        except Exception as err:
            if settings.debug:
                raise
            logger.error("bench %s failed: %s\n%s", name, one_line(err), traceback.format_exc())
            probe = MethodSpec.defaults(name).probe(model_cfg.dims)
            backend = attention_backends(model_cfg, probe, device)
            report["methods"][name] = {"train": {"error": one_line(err), "attention_backend": backend}, "eval": {}}
            failures.append(f"{name} ({one_line(err)})")
        finally:
            torch.compiler.reset()  # no compiled graphs (or recompile counts) carry over
            free_memory(device)
        write()
        if settings.peer and name == twin:
            measure_peer()
    if settings.peer and report["peer"] is None:
        measure_peer()
    report["complete"] = True
    report["load_average"]["end"] = load_average()
    text = write()
    print(text, flush=True)
    logger.info("wrote %s and %s", out / "bench.json", out / "bench.md")
    if failures:
        raise PosbenchError(
            f"method(s) {'; '.join(failures)} failed; the other results are in {out / 'bench.json'}; "
            "rerun with debug=true for the traceback"
        )
    return report
