"""How many steps does a model need before it copies a repeated span (forms an induction head)?

    python scripts/induction_budget.py --method rope [--model mini] [--steps 2000] [--pool 8191]
        [--span 64] [--batch-size 16] [--lr 2e-3] [--warmup 40] [--seed 0] [--every 50] [--out log.jsonl]
        [--device cpu]

Every training window is ``C + 1`` ids drawn uniformly from a pool of ``--pool`` ids, with one span
of ``--span`` ids written again at a distance d uniform over the distances that fit (the second
copy starts after the first ends):

    window:  r r r [S at p] r r r r r r [S at p + d] r r      r: a random id of the pool

Nothing but the span can be predicted, so the loss splits cleanly:

- ``copy``: the loss on the 2nd .. k-th ids of the second copy, which a model that copies (an
  induction head: find the earlier occurrence of the current id, predict what followed it)
  predicts exactly. A model that does not copy scores ln(pool) there; one that copies, about 0.
- ``rest``: every other target, ln(pool) at best.

This is the copy probe's task (``eval.copy``, random spans) and ``data.retrieval``'s
``repeat_random`` kind with every window chosen and no text around it: the easiest setting in
which reading far back pays. It prints the two losses every ``--every`` steps and, at the end,
the first step at which the copy loss fell below half of ln(pool) (``formed``), or that it did not.
The model, its initialisation and the optimiser are the trainer's (``posbench.create_model``,
the trainer's AdamW, betas, weight decay and clipping); the learning rate is warmed up and
then held constant, so a longer run is a continuation of a shorter one. docs/retrieval.md has the
measurements.
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


def windows(gen: torch.Generator, pool: torch.Tensor, batch: int, context: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` windows of ``context + 1`` pool ids, each with one span repeated, and the mask of
    the targets a copying model predicts (the 2nd .. k-th ids of the second copy):
    (B, C + 1) ids, (B, C) bool, aligned with the targets ``ids[:, 1:]``."""
    n = context + 1
    ids = pool[torch.randint(0, pool.numel(), (batch, n), generator=gen)]  # (B, C + 1)
    copy = torch.zeros(batch, context, dtype=torch.bool)  # (B, C)
    for row in range(batch):
        d = int(torch.randint(span, n - span + 1, (1,), generator=gen))  # the second copy starts after the first ends
        p = int(torch.randint(0, n - span - d + 1, (1,), generator=gen))
        ids[row, p + d : p + d + span] = ids[row, p : p + span]
        copy[row, p + d : p + d + span - 1] = True  # target t is ids[t + 1]: ids p+d+1 .. p+d+k-1
    return ids, copy


def split_loss(logits: torch.Tensor, ids: torch.Tensor, copy: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """(mean loss over every target, mean over the copy targets, mean over the rest)."""
    per = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none").view_as(copy)
    return per.mean(), per[copy].mean().item(), per[~copy].mean().item()


def formed_at(history: list[dict], level: float) -> int | None:
    """The first reported step whose copy loss is below ``level``, or None."""
    return next((h["step"] for h in history if h["copy"] < level), None)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="rope")
    parser.add_argument("--model", default="mini", help="model preset of configs/model/ (tiny, mini, small, ...)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192, help="the model's vocabulary (the packaged sample's BPE has 8192)")
    parser.add_argument("--pool", type=int, default=None, help="ids the windows draw from (default: every id but 0)")
    parser.add_argument("--span", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (the windows are drawn on the CPU)")
    parser.add_argument("--out", type=Path, default=None, help="also write one JSON line per report here")
    args = parser.parse_args(argv)
    args.pool = args.vocab - 1 if args.pool is None else args.pool
    if not 2 <= args.pool < args.vocab:
        raise PosbenchError(f"--pool must be in 2 .. {args.vocab - 1} (--vocab minus the id left out), got {args.pool}")
    if not 1 <= args.span <= (args.context + 1) // 2:
        raise PosbenchError(f"--span must be in 1 .. {(args.context + 1) // 2} so two copies fit in {args.context + 1} ids, "
                            f"got {args.span}")
    try:
        torch.device(args.device)
    except RuntimeError:
        raise PosbenchError(f"--device {args.device!r} is not a device; use cpu, cuda or cuda:<index>") from None
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise PosbenchError(f"--device {args.device} but no CUDA device is visible; use --device cpu")
    for name in ("steps", "batch_size", "every"):
        if getattr(args, name) < 1:
            raise PosbenchError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    return args


def say(line: str) -> None:
    print(line, flush=True)  # a log file shows each report as it comes


def run(args: argparse.Namespace, report=say) -> list[dict]:
    """Train and return one record per report: step, copy and rest losses, seconds."""
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = posbench.create_model(args.method, flavour=args.model, vocab_size=args.vocab).to(device)
    t = TrainerConfig(lr=args.lr)
    opt = make_optimizer(model, t, device)
    gen = torch.Generator().manual_seed(args.seed)
    pool = torch.randperm(args.vocab - 1, generator=gen)[: args.pool] + 1  # id 0 left out
    level = math.log(args.pool)
    history, sums, start = [], [0.0, 0.0], time.time()
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, step / args.warmup)
        ids, copy = windows(gen, pool, args.batch_size, args.context, args.span)
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
                      "seconds": round(time.time() - start, 1)}
            history.append(record)
            sums = [0.0, 0.0]
            report(f"step {step}: copy loss {record['copy']:.3f}, rest {record['rest']:.3f} "
                   f"(no copy: ln {args.pool} = {level:.3f}; copying: 0) {record['seconds']:.0f} s")
    return history


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        history = run(args)
    except PosbenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    level = math.log(args.pool)
    step = formed_at(history, level / 2)
    setting = (f"{args.method}, model {args.model}, C {args.context}, span {args.span}, pool {args.pool}, "
               f"batch {args.batch_size}, lr {args.lr}, seed {args.seed}")
    print(f"formed at step {step} ({setting})" if step is not None
          else f"not formed in {args.steps} steps: copy loss {history[-1]['copy']:.3f} against ln {args.pool} = "
               f"{level:.3f} ({setting})")
    if args.out is not None:
        args.out.write_text("".join(json.dumps({**h, "setting": setting}) + "\n" for h in history))
    return 0


if __name__ == "__main__":
    sys.exit(main())
