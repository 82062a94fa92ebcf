"""Training speed of posbench's variants side by side, in one process, on the same random batches.

A variant is (method, compile mode, options). Options, joined with ``+``:

- ``base``: as ``posbench train`` runs the method today;
- ``fast``: ``method.fast=true`` (fire, sandwich, t5, relative, fox; docs/benchmarks.md);
- ``chunk=N``: ``trainer.loss_chunk=N`` (the fused chunked LM head + cross-entropy);
- ``inline_masks``: flex's BlockMask built inside the compiled graph on every forward (the old
  way) instead of prebuilt outside it.

Every variant runs the trainer's own step (:class:`posbench.train.optim.TrainStep`, bf16 autocast on
CUDA, clip, AdamW, schedule) on a model compiled by :func:`posbench.train.optim.compile_model`. All
variants are built and warmed up first (compilation), then timed in ``--rounds`` interleaved rounds
of ``--steps`` steps (variant 1, 2, ..., 1, 2, ...), so drift in clocks and load spreads over all
of them; each step is timed as ``posbench bench`` times it (CUDA events, no sync inside the loop).
``--profile METHOD:MODE:OPTIONS`` adds a ``torch.profiler`` trace of a few steps of one variant:
device-busy ms (the sum of its kernels) against the step's wall ms, and kernels per step. With
``--peer`` the ``transformers`` Llama of the same shape runs in each compile mode (as ``posbench
bench`` builds it). ``--budget-s`` bounds the whole run: a variant whose warm-up or timing would not
fit is skipped and listed with the reason, and the JSON is rewritten after every stage.

    python scripts/speed.py --methods rope,fire,fox --modes default,reduce-overhead \\
        --options base,fast,fast+chunk=4096 --profile fire:default:fast --peer --out speed.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from posbench.bench.flops import matmul_parameters, resolve_peak_tflops, train_flops_per_token
from posbench.bench.peer import build_peer
from posbench.bench.timing import time_steps
from posbench.commands.cli import run_script
from posbench.config import load_group_option
from posbench.core.errors import PosbenchError
from posbench.methods import method_class
from posbench.model.transformer import ModelConfig, build_model
from posbench.runtime.device import autocast_dtype
from posbench.train.optim import TrainStep, check_compile_mode, compile_model
from posbench.train.settings import COMPILE_MODES, TrainerConfig

PEER = "llama_peer"


@dataclass
class Variant:
    method: str
    mode: str
    options: str
    result: dict[str, Any] = field(default_factory=dict)
    step: Callable[[int], torch.Tensor] | None = None

    @property
    def name(self) -> str:
        return f"{self.method}:{self.mode}:{self.options}"


def parse_options(text: str) -> dict[str, Any]:
    """``fast+chunk=4096`` -> {"fast": True, "chunk": 4096}; ``base`` -> {}."""
    out: dict[str, Any] = {}
    for part in text.split("+"):
        if part == "base":
            continue
        if part in ("fast", "inline_masks"):
            out[part] = True
        elif part.startswith("chunk=") and part[6:].isdigit() and int(part[6:]) > 0:
            out["chunk"] = int(part[6:])
        else:
            raise PosbenchError(f"unknown speed option {part!r}; use base, fast, chunk=N, inline_masks joined by +")
    return out


def variants_of(args: argparse.Namespace) -> tuple[list[Variant], list[dict[str, str]]]:
    """Every (method, mode, options) asked for; a combination that does not apply is listed."""
    variants, skipped = [], []
    for method in args.methods:
        fast_ok = "fast" in method_options_of(method)
        for mode in args.modes:
            for options in args.options:
                if parse_options(options).get("fast") and not fast_ok:
                    skipped.append({"variant": f"{method}:{mode}:{options}", "reason": f"{method} has no fast option"})
                    continue
                variants.append(Variant(method, mode, options))
    if args.peer:
        variants += [Variant(PEER, mode, "base") for mode in args.modes]
    return variants, skipped


def method_options_of(method: str) -> dict[str, Any]:
    import inspect

    return dict(inspect.signature(method_class(method).__init__).parameters)


def random_batches(vocab: int, batch: int, context: int, count: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (inputs, targets) pairs (batch, context) from one seed: every variant trains on these."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (batch, context + 1), generator=g).to(device) for _ in range(count)]
    return [(s[:, :-1], s[:, 1:]) for s in seqs]


def build_variant(v: Variant, args: argparse.Namespace, model_cfg: ModelConfig, device: torch.device,
                  amp: torch.dtype | None, batches: list) -> None:
    """The variant's model, compiled, and its step function ``step(i)`` on batch ``i``."""
    options = parse_options(v.options)
    trainer = TrainerConfig(compile="true" if args.compile else "false", compile_mode=v.mode)
    check_compile_mode(trainer, device)
    torch.manual_seed(0)
    if v.method == PEER:
        peer_env = SimpleNamespace(model_cfg=model_cfg, device=device,
                                   settings=SimpleNamespace(context=args.context, eval_lengths=[args.context]))
        model = build_peer(peer_env)
        runner = compile_model(model, v.mode, args.compile_cache) if args.compile else model

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(runner(input_ids=x).logits.float().flatten(0, 1), y.flatten())
    else:
        method_opts = {"fast": True} if options.get("fast") else {}
        model = build_model(model_cfg, v.method, {**load_method_options(v.method), **method_opts}).to(device)
        model.loss_chunk = options.get("chunk")
        model.prebuilt_masks = not options.get("inline_masks", False)
        runner = compile_model(model, v.mode, args.compile_cache) if args.compile else model

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return runner(x, targets=y)
    steps = TrainStep(model, trainer, device, 10**6, amp)
    model.train()

    def step(i: int) -> torch.Tensor:
        x, y = batches[i % len(batches)]
        return steps(lambda _: loss_of(x, y))

    v.step = step
    n = matmul_parameters(model)
    v.result["flops_per_token"] = train_flops_per_token(n, model_cfg.n_layers, args.context, model_cfg.d_model)


def load_method_options(method: str) -> dict[str, Any]:
    try:
        options = load_group_option("method", method)
    except PosbenchError:
        return {}
    options.pop("name", None)
    return options


def profile_variant(v: Variant, device: torch.device, steps: int) -> dict[str, Any]:
    """torch.profiler over ``steps`` steps: wall ms and device-busy ms per step, kernels per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for i in range(steps):
            v.step(i)
        sync()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    events = prof.events()
    kernels = [e for e in events if str(e.device_type).endswith("CUDA")]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    top_level_ops = [e for e in events if e.cpu_parent is None and e.name.startswith("aten::")]
    return {"variant": v.name, "steps": steps, "step_ms": wall_ms,
            "device_busy_ms": busy_us / 1e3 / steps if kernels else None,
            "kernels_per_step": len(kernels) / steps if kernels else None,
            "host_ops_per_step": len(top_level_ops) / steps}


def summary(ms: list[float], tokens_per_step: int, flops: float, peak: float | None) -> dict[str, Any]:
    median = statistics.median(ms)
    tps = tokens_per_step / (median / 1e3)
    return {"step_ms_median": median, "step_ms_min": min(ms), "step_ms_max": max(ms), "steps_timed": len(ms),
            "tokens_per_second": tps, "mfu": flops * tps / 1e12 / peak if peak else None}


def render(report: dict[str, Any]) -> str:
    lines = ["| variant | step ms (median) | tok/s | MFU | warm-up s |", "|---|---:|---:|---:|---:|"]
    for name, r in report["variants"].items():
        if "step_ms_median" in r:
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
            lines.append(f"| {name} | {r['step_ms_median']:.2f} | {r['tokens_per_second']:,.0f} | {mfu} | "
                         f"{r.get('warmup_seconds', 0):.1f} |")
    for s in report["skipped"]:
        lines.append(f"| {s['variant']} | skipped: {s['reason']} | | | |")
    if report.get("profile"):
        p = report["profile"]
        busy = "-" if p["device_busy_ms"] is None else f"{p['device_busy_ms']:.2f}"
        lines.append(f"\nprofile {p['variant']}: {p['step_ms']:.2f} ms/step wall, {busy} ms device-busy, "
                     f"{p['kernels_per_step'] or '-'} kernels/step, {p['host_ops_per_step']:.0f} host ops/step")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="rope", help="comma-separated methods")
    p.add_argument("--modes", default="default", help=f"comma-separated compile modes: {', '.join(COMPILE_MODES)}")
    p.add_argument("--options", default="base", help="comma-separated option sets (base, fast, chunk=N, inline_masks, joined by +)")
    p.add_argument("--model", default="small", help="configs/model/<name>.yaml")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per variant (compilation)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", default=None, help="METHOD:MODE:OPTIONS of the variant to profile")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--peer", action="store_true", help="also the transformers Llama peer in each mode")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="run every variant eagerly")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the whole run")
    p.add_argument("--compile-cache", default=None, help="folder kept across runs for compiled graphs and kernels")
    p.add_argument("--out", default="speed.json")
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    args.modes = [m for m in args.modes.split(",") if m]
    args.options = [o for o in args.options.split(",") if o]
    for mode in args.modes:
        if mode not in COMPILE_MODES:
            raise PosbenchError(f"--modes: {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    for options in args.options:
        parse_options(options)
    for method in args.methods:
        method_class(method)  # unknown names fail with the list of valid ones
    check_numbers(args)
    args.device = check_device(args.device)
    check_out(args.out)
    return args


def check_numbers(args: argparse.Namespace) -> None:
    """Sizes and counts that must be positive (a batch of 0 timed 0 tok/s; 0 steps crashed after
    every warm-up), before any model is built."""
    for flag in ("batch_size", "context", "vocab_size", "steps", "rounds", "profile_steps"):
        if getattr(args, flag) < 1:
            raise PosbenchError(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    if args.warmup < 0:
        raise PosbenchError(f"--warmup must be >= 0, got {args.warmup}")
    if not args.budget_s >= 0:  # 0: nothing fits, every method is listed as skipped
        raise PosbenchError(f"--budget-s must be >= 0, got {args.budget_s}")


def check_device(name: str) -> torch.device:
    """``--device``: auto, cpu, cuda or cuda:N, and one that is there."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise PosbenchError(f"--device {name} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise PosbenchError(f"--device {name}: speed.py times cpu or cuda; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PosbenchError(f"--device {name} but CUDA is not available; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise PosbenchError(f"--device {name} but there are {torch.cuda.device_count()} CUDA devices")
    return device


def check_out(out: str) -> None:
    """``--out``: a file in a folder that exists and can be written (it is written after every stage)."""
    path = Path(out).expanduser().absolute()
    if path.is_dir():
        raise PosbenchError(f"--out {out} is a folder; name a file, e.g. --out {Path(out) / 'speed.json'}")
    if not path.parent.is_dir():
        raise PosbenchError(f"--out {out}: the folder {path.parent} does not exist; create it or choose another --out")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise PosbenchError(f"--out {out}: the folder {path.parent} cannot be written; choose another --out")


def run(args: argparse.Namespace) -> dict[str, Any]:
    start = time.monotonic()
    device = args.device  # checked by parse_args
    amp = autocast_dtype(args.precision, device)
    model_values = {**load_group_option("model", args.model), "vocab_size": args.vocab_size}
    model_cfg = ModelConfig.from_dict(model_values)
    peak, peak_source = resolve_peak_tflops("auto", device, amp)
    variants, skipped = variants_of(args)
    batches = random_batches(args.vocab_size, args.batch_size, args.context, 4, device)
    tokens = args.batch_size * args.context
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "model": args.model, "batch_size": args.batch_size,
                              "context": args.context, "precision": str(amp).replace("torch.", "") if amp else "fp32",
                              "compiled": args.compile, "peak_tflops": peak, "peak_source": peak_source,
                              "budget_s": args.budget_s, "variants": {}, "skipped": skipped, "profile": None}
    out = Path(args.out)

    def write() -> None:
        report["elapsed_s"] = time.monotonic() - start
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")

    def left() -> float:
        return args.budget_s - (time.monotonic() - start)

    warm_estimate = 0.0  # the slowest warm-up so far: what the next is assumed to cost
    ready: list[Variant] = []
    for v in variants:
        if ready and left() < 1.5 * warm_estimate:
            skipped.append({"variant": v.name, "reason": f"budget: {left():.0f}s left, a warm-up took {warm_estimate:.0f}s"})
            continue
        t0 = time.perf_counter()
        try:
            build_variant(v, args, model_cfg, device, amp, batches)
            for i in range(args.warmup):
                v.step(i)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as err:  # one variant failing (OOM, a lowering error) must not end the run
            skipped.append({"variant": v.name, "reason": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"})
            v.step = None
            continue
        v.result["warmup_seconds"] = time.perf_counter() - t0
        warm_estimate = max(warm_estimate, v.result["warmup_seconds"])
        ready.append(v)
        report["variants"][v.name] = v.result
        write()

    times: dict[str, list[float]] = {v.name: [] for v in ready}
    for round_ in range(args.rounds):
        for v in ready:
            spent = sum(times[v.name]) / 1e3 / max(1, round_)  # one round of this variant, seconds
            if round_ and left() < spent * 1.5 + 1:
                v.result["note"] = f"timed {round_} of {args.rounds} rounds (budget)"
                continue
            ms, _, loss = time_steps(v.step, args.steps, device, offset=args.warmup + round_ * args.steps)
            times[v.name] += ms
            v.result["final_loss"] = float(loss)
            v.result.update(summary(times[v.name], tokens, v.result["flops_per_token"], peak))
        write()
    if args.profile:
        target = next((v for v in ready if v.name == args.profile), None)
        if target is None:
            skipped.append({"variant": args.profile, "reason": "profile: no such ready variant"})
        elif left() < 10:
            skipped.append({"variant": args.profile, "reason": "profile: budget"})
        else:
            report["profile"] = profile_variant(target, device, args.profile_steps)
    write()
    return report


def main(argv: list[str] | None = None) -> int:
    """Bad arguments are one line ``speed: error: ...`` and exit 2 (:func:`run_script`), before any work."""
    args = parse_args(argv)
    report = run(args)
    print(render(report))
    missing = [name for name, r in report["variants"].items() if not math.isfinite(r.get("final_loss", math.nan))]
    if missing:
        print(f"no finite loss: {', '.join(missing)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_script("speed", main)
