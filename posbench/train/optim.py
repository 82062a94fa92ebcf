"""The optimizer, its schedule and THE training step, shared by the trainer and ``posbench bench``.

    loss per micro-batch (autocast) -> backward -> global grad-norm clip -> AdamW -> LambdaLR step

:class:`TrainStep` is the only implementation of that step: ``posbench train`` calls it once per
optimizer step and ``posbench bench`` times it, so the benchmark measures exactly what trains.

:func:`compile_model` compiles the model in ``trainer.compile_mode``; under a CUDA-graph mode the
step marks each micro-batch's forward as a new replay (``torch.compiler.cudagraph_mark_step_begin``)
and keeps nothing a replay overwrites (the loss is added into a tensor of its own at once), and
methods' in-place parameter projections (kerple's) run before the step, outside any graph
(:meth:`posbench.methods.PositionMethod.before_step`).
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
from torch import Tensor

from posbench.core.errors import PosbenchError
from posbench.methods import PositionMethod
from posbench.runtime.device import autocast
from posbench.train.settings import CUDA_GRAPH_MODES, TrainerConfig


def compiles(t: TrainerConfig, device: torch.device) -> bool:
    """Whether the model is compiled: ``trainer.compile`` true, or auto on CUDA."""
    return str(t.compile).lower() == "true" or (str(t.compile).lower() == "auto" and device.type == "cuda")


def check_compile_mode(t: TrainerConfig, device: torch.device) -> None:
    """A CUDA-graph ``trainer.compile_mode`` off CUDA is one line, whether ``trainer.compile`` is
    true or left at auto (which compiles nothing there, so the mode would be recorded but unused)."""
    if t.compile_mode in CUDA_GRAPH_MODES and device.type != "cuda" and str(t.compile).lower() != "false":
        unused = "" if compiles(t, device) else f" (trainer.compile={t.compile} compiles only on CUDA)"
        raise PosbenchError(
            f"trainer.compile_mode={t.compile_mode} captures CUDA graphs and needs a CUDA device, not {device.type}"
            f"{unused}; use trainer.compile_mode=default (or max-autotune-no-cudagraphs with trainer.compile=true)"
        )


def compile_model(model: torch.nn.Module, mode: str, cache_dir: str | None = None) -> torch.nn.Module:
    """``torch.compile(model)`` in ``mode`` (``default``: exactly ``torch.compile(model)``).
    ``cache_dir``: Inductor's and Triton's caches go there (``trainer.compile_cache``)."""
    if cache_dir:
        use_compile_cache(cache_dir)
    return torch.compile(model) if mode == "default" else torch.compile(model, mode=mode)


def use_compile_cache(cache_dir: str) -> Path:
    """Point Inductor's (``TORCHINDUCTOR_CACHE_DIR``: FX graphs, AOT autograd, kernels) and Triton's
    (``TRITON_CACHE_DIR``) caches at ``cache_dir``, before the first compilation reads them."""
    path = Path(cache_dir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    return path


def lr_lambda(total_steps: int, warmup_steps: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup then cosine decay to ``min_ratio`` of the peak, as a multiplier of lr."""
    warmup = min(warmup_steps, max(1, total_steps // 10))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def make_optimizer(model: torch.nn.Module, t: TrainerConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight matrices decay, norms and position-method tables do not.

    Position tables are excluded so that rows training never reaches (learned positions past the
    training context) stay exactly at their initialisation, as the method's definition says;
    decoupled decay would otherwise shrink them every step.
    """
    position = {id(p) for p in getattr(model, "position", torch.nn.Module()).parameters()}
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    decay = [p for p in params if p.dim() >= 2 and id(p) not in position]
    no_decay = [p for p in params if p.dim() < 2 or id(p) in position]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=device.type == "cuda")


class TrainStep:
    """One optimizer step of ``model``: AdamW (:func:`make_optimizer`) on the warmup + cosine
    schedule (:func:`lr_lambda`) over ``total_steps``, with ``trainer.grad_clip``.

    ``optimizer`` and ``scheduler`` are attributes so that checkpoints save and restore them.
    """

    def __init__(self, model: torch.nn.Module, t: TrainerConfig, device: torch.device, total_steps: int,
                 amp_dtype: torch.dtype | None = None) -> None:
        self.model, self.device, self.grad_clip, self.amp_dtype = model, device, t.grad_clip, amp_dtype
        self.optimizer = make_optimizer(model, t, device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(total_steps, t.warmup_steps, t.min_lr_ratio)
        )
        self.lr_used = float("nan")  # the learning rate of the last step
        check_compile_mode(t, device)
        self.cuda_graphs = compiles(t, device) and t.compile_mode in CUDA_GRAPH_MODES

    def __call__(self, micro_loss: Callable[[int], Tensor], accum: int = 1,
                 no_sync: Callable[[int], ContextManager[Any]] | None = None) -> Tensor:
        """Forward + backward of ``accum`` micro-batches (``micro_loss(i)``: the mean loss of
        micro-batch i under autocast, averaged over them), clip, AdamW, schedule. Returns the
        summed loss as a device tensor (no host sync). ``no_sync(i)``: the DDP context of
        micro-batch i (gradients are all-reduced once, on the last one)."""
        loss_sum = torch.zeros((), device=self.device)
        for module in self.model.modules():  # outside any compiled graph (kerple's projection)
            if isinstance(module, PositionMethod):
                module.before_step()
        for i in range(accum):
            if self.cuda_graphs:  # a new replay: the previous micro-batch's graph outputs are done with
                torch.compiler.cudagraph_mark_step_begin()
            with (no_sync(i) if no_sync is not None else nullcontext()), autocast(self.device, self.amp_dtype):
                loss = micro_loss(i) / accum
            loss.backward()
            loss_sum += loss.detach()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_used = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return loss_sum


def micro_batching(t: TrainerConfig, world_size: int) -> tuple[int, int]:
    """(micro-batch size, accumulation steps) of each process."""
    per_process = t.batch_size // world_size
    if per_process * world_size != t.batch_size:
        raise PosbenchError(f"trainer.batch_size={t.batch_size} is not divisible by the {world_size} processes")
    micro = t.micro_batch_size or per_process
    if per_process % micro:
        raise PosbenchError(f"trainer.micro_batch_size={micro} must divide the per-process batch {per_process}")
    return micro, per_process // micro


def total_steps(t: TrainerConfig, tokens_per_step: int, steps_per_epoch: int) -> int:
    """trainer.max_steps, else max_tokens, else epochs, as a number of optimizer steps."""
    if t.max_steps is not None:
        return t.max_steps
    if t.max_tokens is not None:
        return max(1, math.ceil(t.max_tokens / tokens_per_step))
    return max(1, round(t.epochs * steps_per_epoch))


__all__ = ["TrainStep", "check_compile_mode", "compile_model", "compiles", "use_compile_cache", "lr_lambda", "make_optimizer",
           "micro_batching", "total_steps"]
