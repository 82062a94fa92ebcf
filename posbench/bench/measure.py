"""The measurements of one position method: the trainer's training step and posbench's
evaluation, on random token batches (no data needed).

- **training**: the trainer's own step, :class:`posbench.train.optim.TrainStep`: bf16 autocast
  (``precision=auto`` on CUDA), forward, float32 cross-entropy, backward, global grad-norm clip,
  fused AdamW (:func:`posbench.train.optim.make_optimizer`) and the warmup+cosine ``LambdaLR``
  step, on the model compiled as the trainer compiles it (:func:`posbench.train.optim.compile_model`)
  when compile is on (``auto``: CUDA only). ``warmup_steps`` untimed steps (compilation, allocator
  warm-up, AdamW state creation), then ``steps`` timed steps (:func:`posbench.bench.timing.time_steps`),
  reported as median, p10/p90, min/max and mean, with the peak memory and the contention of the block.
- **evaluation**: posbench's own evaluation path, :func:`posbench.evaluation.loss.per_position_loss`
  (``torch.inference_mode``, autocast over the transformer body, ``hidden_states`` then the
  float32 LM head and cross-entropy in position chunks), on the uncompiled model as
  ``posbench train``/``posbench eval`` run it, one ``[eval_batch_size, L]`` batch per call, at
  every length in ``eval_lengths``. ``max(1, warmup_steps)`` untimed calls, then ``eval_steps``
  timed calls (synchronised; the call itself ends with a device-to-host copy). A length that
  runs out of CUDA memory is recorded as ``"oom"``; a length a method cannot represent (learned
  embeddings past ``max_positions``) as ``"unsupported: ..."``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from posbench.bench.checks import method_config
from posbench.bench.flops import matmul_parameters, mfu, train_flops_per_token
from posbench.bench.settings import BenchSettings
from posbench.bench.timing import (
    contention,
    free_memory,
    is_oom,
    load_average,
    peak_memory,
    reset_peak_memory,
    spread,
    synchronize,
    time_steps,
)
from posbench.evaluation.loss import per_position_loss
from posbench.model.transformer import ModelConfig, attention_backends, build_model
from posbench.runtime.device import autocast
from posbench.train.optim import TrainStep, compile_model
from posbench.train.settings import TrainerConfig

logger = logging.getLogger("posbench")


@dataclass
class Env:
    """What every measurement shares."""

    settings: BenchSettings
    model_cfg: ModelConfig
    trainer: TrainerConfig  # optimizer, schedule, clip and compile settings (the trainer's defaults)
    device: torch.device
    amp_dtype: torch.dtype | None
    use_compile: bool
    peak_tflops: float | None

    def autocast(self):
        return autocast(self.device, self.amp_dtype)

    def compiled(self, model: nn.Module) -> nn.Module:
        """``model`` as the trainer runs it: compiled in ``trainer.compile_mode`` when compile is on."""
        return compile_model(model, self.trainer.compile_mode, self.trainer.compile_cache) if self.use_compile else model


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
    tflops, utilisation = mfu(flops_per_token, stats["tokens_per_second_median"], env.peak_tflops)
    stats.update(
        tokens_per_step=tokens_per_step,
        flops_per_token=flops_per_token,
        tflops=tflops,
        mfu=utilisation,
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
        runner = env.compiled(model)
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
