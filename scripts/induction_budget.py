"""How many steps does a model need before it copies a repeated span (forms an induction head)?

    python scripts/induction_budget.py --method rope [--model mini] [--n-layers L] [--d-model D]
        [--context 256] [--vocab 8192] [--pool P] [--span K | --span-frac F] [--distance uniform|N]
        [--curriculum STEPS:SPAN] [--batch-size 16] [--lr 2e-3] [--warmup 40] [--seed 0]
        [--steps 2000] [--every 50] [--stop-after-formed R] [--threads T] [--out log.jsonl] [--device cpu]

Every training window is ``C + 1`` ids drawn uniformly from a pool of ``--pool`` ids, with one span
of ``--span`` ids (or ``--span-frac`` x C) written again at a distance d (the second copy starts
after the first ends):

    window:  r r r [S at p] r r r r r r [S at p + d] r r      r: a random id of the pool

``--distance uniform`` (the default) draws d uniformly over the distances that fit, so the only
way to predict the second copy is to find the earlier occurrence of the current id and read what
followed it (an induction head). ``--distance N`` fixes d = N: then "attend N tokens back" also
solves it, a positional shortcut that needs no content match (the map reports both, and only
uniform distances count as copying).

Nothing but the span can be predicted, so the loss splits cleanly:

- ``copy``: the loss on the 2nd .. k-th ids of the second copy, which a model that copies
  predicts exactly. A model that does not copy scores ln(pool) there; one that copies, about 0.
- ``rest``: every other target, ln(pool) at best.

``--windows periodic`` repeats a random block of d ids to the window's end instead, d uniform over
``--periods`` (8 .. C/2): most targets are copies and no one distance solves them (the
repeated-sequence task of induction-head studies).

``--curriculum STEPS:SPAN`` trains the first STEPS steps with spans of SPAN ids (``STEPS:periodic``:
with periodic windows), then with ``--span`` (dense repeats first, the target share after).

This is the copy probe's task (``eval.copy``, random spans) and ``data.retrieval``'s
``repeat_random`` kind with every window chosen and no text around it: the easiest setting in
which reading far back pays. It prints the two losses every ``--every`` steps and, at the end,
the first step at which the copy loss fell below half of ln(pool) (``formed``), or that it did not,
then the final model's copy loss on held-out windows (a generator of their own) with spans of
``--probe-span`` ids (8) at distances in four equal bands of all that fit (``by_distance``). A span
of C/2 leaves d almost no room (C/2 .. C/2 + 1 at the training span), so only this test tells
an induction head, which copies a short span from anywhere, from "attend C/2 back". ``--stop-after-formed R`` ends the run R reports after it formed.
The model, its initialisation and the optimiser are the trainer's (``posbench.create_model``,
the trainer's AdamW, betas, weight decay and clipping); the learning rate is warmed up and
then held constant, so a longer run is a continuation of a shorter one. docs/retrieval.md has the
measurements, and scripts/formation_map.py runs this over a grid of settings.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import posbench
from posbench.core.errors import PosbenchError
from posbench.train.optim import make_optimizer
from posbench.train.settings import TrainerConfig


def windows(gen: torch.Generator, pool: torch.Tensor, batch: int, context: int, span: int,
            distances: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch`` windows of ``context + 1`` pool ids, each with one span repeated at a distance d
    uniform over ``distances`` (inclusive; default every d that fits: ``span .. context + 1 - span``),
    the mask of the targets a copying model predicts (the 2nd .. k-th ids of the second copy) and
    each row's d: (B, C + 1) ids, (B, C) bool aligned with the targets ``ids[:, 1:]``, (B,) long."""
    n = context + 1
    lo, hi = distances if distances is not None else (span, n - span)
    ids = pool[torch.randint(0, pool.numel(), (batch, n), generator=gen)]  # (B, C + 1)
    copy = torch.zeros(batch, context, dtype=torch.bool)  # (B, C)
    ds = torch.randint(lo, hi + 1, (batch,), generator=gen)  # (B,) the second copy starts after the first ends
    for row in range(batch):
        d = int(ds[row])
        p = int(torch.randint(0, n - span - d + 1, (1,), generator=gen))
        ids[row, p + d : p + d + span] = ids[row, p : p + span]
        copy[row, p + d : p + d + span - 1] = True  # target t is ids[t + 1]: ids p+d+1 .. p+d+k-1
    return ids, copy, ds


def periodic_windows(gen: torch.Generator, pool: torch.Tensor, batch: int, context: int,
                     periods: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch`` windows that repeat a random block of d pool ids to their end, d uniform over
    ``periods`` (inclusive): every id from the second block's second on is a copy of the id d
    earlier, so most targets are copies and no single distance solves them (the classic
    repeated-sequence task of induction-head studies). Returns what :func:`windows` returns."""
    n = context + 1
    ids = pool[torch.randint(0, pool.numel(), (batch, n), generator=gen)]  # (B, C + 1)
    copy = torch.zeros(batch, context, dtype=torch.bool)  # (B, C)
    ds = torch.randint(periods[0], periods[1] + 1, (batch,), generator=gen)  # (B,)
    for row in range(batch):
        d = int(ds[row])
        for start in range(d, n, d):
            ids[row, start : start + d] = ids[row, : min(d, n - start)]
        copy[row, d:] = True  # target t is ids[t + 1]; ids d+1 .. C follow an id seen d earlier
    return ids, copy, ds


def split_loss(logits: torch.Tensor, ids: torch.Tensor, copy: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """(mean loss over every target, mean over the copy targets, mean over the rest)."""
    per = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none").view_as(copy)
    return per.mean(), per[copy].mean().item(), per[~copy].mean().item()


def formed_at(history: list[dict], level: float) -> int | None:
    """The first reported step whose copy loss is below ``level``, or None."""
    return next((h["step"] for h in history if h["copy"] < level), None)


def distance_bands(span: int, context: int, bands: int = 4) -> list[tuple[int, int]]:
    """The distances that fit (``span .. context + 1 - span``) cut into ``bands`` equal, inclusive ranges."""
    lo, hi = span, context + 1 - span
    edges = [lo + round(i * (hi - lo + 1) / bands) for i in range(bands + 1)]
    return [(edges[i], edges[i + 1] - 1) for i in range(bands) if edges[i + 1] > edges[i]]


@torch.no_grad()
def copy_by_distance(model: torch.nn.Module, pool: torch.Tensor, args: argparse.Namespace, device: torch.device,
                     windows_per_band: int = 128) -> list[dict]:
    """The model's copy loss on held-out windows (a generator of their own), one entry per distance band."""
    gen = torch.Generator().manual_seed(10_000 + args.seed)
    model.eval()
    out = []
    for lo, hi in distance_bands(args.probe_span, args.context):
        ids, copy, _ = windows(gen, pool, windows_per_band, args.context, args.probe_span, (lo, hi))
        _, copy_loss, _ = split_loss(model(ids[:, :-1].to(device)).cpu(), ids, copy)
        out.append({"d_min": lo, "d_max": hi, "copy": round(copy_loss, 4)})
    model.train()
    return out


def parse_curriculum(text: str | None, context: int) -> tuple[int, int | str] | None:
    """``STEPS:SPAN`` or ``STEPS:periodic`` -> (steps, span or "periodic"), refused in one line unless both fit."""
    if text is None:
        return None
    try:
        steps, span = text.split(":")
        steps, span = int(steps), (span if span == "periodic" else int(span))
    except ValueError:
        raise PosbenchError(f"--curriculum takes STEPS:SPAN or STEPS:periodic, e.g. 500:{context // 2}; "
                            f"got {text!r}") from None
    if span == "periodic":
        if steps < 1:
            raise PosbenchError(f"--curriculum {text}: STEPS must be >= 1")
        return steps, span
    if steps < 1 or not 1 <= span <= (context + 1) // 2:
        raise PosbenchError(f"--curriculum {text}: STEPS must be >= 1 and SPAN in 1 .. {(context + 1) // 2}")
    return steps, span


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="rope")
    parser.add_argument("--model", default="mini", help="model preset of configs/model/ (tiny, mini, small, ...)")
    parser.add_argument("--n-layers", type=int, default=None, help="override the preset's layers")
    parser.add_argument("--d-model", type=int, default=None, help="override the preset's width")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192, help="the model's vocabulary (the packaged sample's BPE has 8192)")
    parser.add_argument("--pool", type=int, default=None, help="ids the windows draw from (default: every id but 0)")
    parser.add_argument("--span", type=int, default=None, help="ids in the repeated span (default 64)")
    parser.add_argument("--span-frac", type=float, default=None, help="the span as a fraction of C, e.g. 0.5")
    parser.add_argument("--distance", default="uniform", help="uniform (every d that fits) or a fixed d")
    parser.add_argument("--windows", choices=["span", "periodic"], default="span",
                        help="span: one repeated span a window; periodic: a random block repeated to the end")
    parser.add_argument("--periods", default=None, metavar="LO:HI",
                        help="periodic windows: the block's length d, uniform over LO .. HI (default 8 .. C/2; at most C - 1, "
                             "the block then repeated in part)")
    parser.add_argument("--curriculum", default=None, metavar="STEPS:SPAN",
                        help="first STEPS steps with spans of SPAN ids (or periodic windows: STEPS:periodic)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=40, help="warm-up steps (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--probe-span", type=int, default=8,
                        help="span of the held-out windows that test copying at every distance (default 8)")
    parser.add_argument("--stop-after-formed", type=int, default=None, metavar="R",
                        help="stop R reports after copying formed (default: run every step)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (the windows are drawn on the CPU)")
    parser.add_argument("--out", type=Path, default=None, help="also write one JSON line per report here")
    args = parser.parse_args(argv)
    check(args)
    return args


def check(args: argparse.Namespace) -> None:
    """Every refusal before any work, in one line naming the fix; fills in the derived settings."""
    args.pool = args.vocab - 1 if args.pool is None else args.pool
    if not 2 <= args.pool < args.vocab:
        raise PosbenchError(f"--pool must be in 2 .. {args.vocab - 1} (--vocab minus the id left out), got {args.pool}")
    largest = (args.context + 1) // 2
    if args.span is not None and args.span_frac is not None:
        raise PosbenchError("give --span or --span-frac, not both")
    if args.span_frac is not None:
        if not 0 < args.span_frac <= 0.5:
            raise PosbenchError(f"--span-frac must be in (0, 0.5] so two copies fit, got {args.span_frac}")
        args.span = max(1, round(args.span_frac * args.context))
    if args.span is None:  # periodic windows have no span of their own: the log names the probe's
        args.span = min(args.probe_span, largest) if args.windows == "periodic" else 64
    if not 1 <= args.span <= largest:
        raise PosbenchError(f"--span must be in 1 .. {largest} so two copies fit in {args.context + 1} ids, "
                            f"got {args.span}")
    if not 1 <= args.probe_span <= largest:
        raise PosbenchError(f"--probe-span must be in 1 .. {largest}, got {args.probe_span}")
    if args.distance == "uniform":
        args.distances = None
    else:
        lo, hi = args.span, args.context + 1 - args.span
        try:
            d = int(args.distance)
        except ValueError:
            raise PosbenchError(f"--distance takes uniform or a whole number, got {args.distance!r}") from None
        if not lo <= d <= hi:
            raise PosbenchError(f"--distance {d} does not fit: with --span {args.span} at --context {args.context} "
                                f"it must be in {lo} .. {hi}")
        args.distances = (d, d)
    args.curriculum_span = parse_curriculum(args.curriculum, args.context)
    largest_period = (args.context + 1) // 2
    try:
        lo, hi = (int(x) for x in args.periods.split(":")) if args.periods else (min(8, largest_period), largest_period)
    except ValueError:
        raise PosbenchError(f"--periods takes LO:HI, e.g. 8:{largest_period}; got {args.periods!r}") from None
    if not 2 <= lo <= hi <= args.context - 1:
        raise PosbenchError(f"--periods {lo}:{hi}: need 2 <= LO <= HI <= {args.context - 1} so a copied id follows "
                            "the first block")
    args.period_range = (lo, hi)
    if not args.lr > 0:
        raise PosbenchError(f"--lr must be a positive number, got {args.lr}")
    if args.warmup < 0:
        raise PosbenchError(f"--warmup must be 0 (none) or a positive number of steps, got {args.warmup}")
    for name in ("steps", "batch_size", "every", "threads", "stop_after_formed", "n_layers", "d_model"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise PosbenchError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.out is not None and not args.out.parent.is_dir():
        raise PosbenchError(f"--out {args.out}: the folder {args.out.parent} does not exist; create it or pick another")
    try:
        torch.device(args.device)
    except RuntimeError:
        raise PosbenchError(f"--device {args.device!r} is not a device; use cpu, cuda or cuda:<index>") from None
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise PosbenchError(f"--device {args.device} but no CUDA device is visible; use --device cpu")


def say(line: str) -> None:
    print(line, flush=True)  # a log file shows each report as it comes


def setting(args: argparse.Namespace) -> str:
    shape = "".join(f", {k} {v}" for k, v in (("layers", args.n_layers), ("d_model", args.d_model)) if v is not None)
    extra = "".join(f", {k} {v}" for k, v in (("distance", args.distance), ("curriculum", args.curriculum))
                    if v not in (None, "uniform"))
    if args.windows == "periodic":
        extra += f", periodic windows d {args.period_range[0]}..{args.period_range[1]}"
    return (f"{args.method}, model {args.model}{shape}, C {args.context}, span {args.span}, pool {args.pool}, "
            f"batch {args.batch_size}, lr {args.lr}, seed {args.seed}{extra}")


def run(args: argparse.Namespace, report=say) -> dict:
    """Train; return the run's record: its reports (step, copy and rest losses, seconds), when it
    formed, and the final model's copy loss by distance band."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    shape = {k: v for k, v in (("n_layers", args.n_layers), ("d_model", args.d_model)) if v is not None}
    model = posbench.create_model(args.method, flavour=args.model, vocab_size=args.vocab, **shape).to(device)
    t = TrainerConfig(lr=args.lr)
    opt = make_optimizer(model, t, device)
    gen = torch.Generator().manual_seed(args.seed)
    pool = torch.randperm(args.vocab - 1, generator=gen)[: args.pool] + 1  # id 0 left out
    level = math.log(args.pool)
    history, sums, start, formed = [], [0.0, 0.0], time.time(), None
    first = args.curriculum_span
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, step / args.warmup) if args.warmup else args.lr
        span, distances = (first[1], None) if first and step <= first[0] else (args.span, args.distances)
        if span == "periodic" or (args.windows == "periodic" and not (first and step <= first[0])):
            span = "periodic"
            ids, copy, _ = periodic_windows(gen, pool, args.batch_size, args.context, args.period_range)
        else:
            ids, copy, _ = windows(gen, pool, args.batch_size, args.context, span, distances)
        ids, copy = ids.to(device), copy.to(device)
        loss, copy_loss, rest_loss = split_loss(model(ids[:, :-1]), ids, copy)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        sums[0] += copy_loss
        sums[1] += rest_loss
        if step % args.every == 0 or step == args.steps:
            count = step - (history[-1]["step"] if history else 0)
            record = {"step": step, "copy": sums[0] / count, "rest": sums[1] / count, "no_copy": level,
                      "span": span, "seconds": round(time.time() - start, 1)}
            history.append(record)
            sums = [0.0, 0.0]
            report(f"step {step}: copy loss {record['copy']:.3f}, rest {record['rest']:.3f} "
                   f"(no copy: ln {args.pool} = {level:.3f}; copying: 0) {record['seconds']:.0f} s")
            after_curriculum = [h for h in history if not first or h["step"] > first[0]]
            formed = formed_at(after_curriculum, level / 2)
            if formed is not None and args.stop_after_formed is not None and \
                    sum(h["step"] > formed for h in history) >= args.stop_after_formed:
                break
    formed_seconds = next((h["seconds"] for h in history if h["step"] == formed), None)
    return {"history": history, "formed": formed, "formed_seconds": formed_seconds,
            "by_distance": copy_by_distance(model, pool, args, device), "no_copy": level,
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        result = run(args)
    except PosbenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    history, step = result["history"], result["formed"]
    level = result["no_copy"]
    print(f"formed at step {step} ({setting(args)})" if step is not None
          else f"not formed in {history[-1]['step']} steps: copy loss {history[-1]['copy']:.3f} against ln {args.pool} = "
               f"{level:.3f} ({setting(args)})")
    print("held-out copy loss by distance: " + ", ".join(
        f"d {b['d_min']}-{b['d_max']}: {b['copy']:.3f}" for b in result["by_distance"]))
    if args.out is not None:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text("".join(json.dumps({**h, "setting": setting(args)}) + "\n" for h in history))
        tmp.replace(args.out)  # never a half-written log
    return 0


if __name__ == "__main__":
    sys.exit(main())
