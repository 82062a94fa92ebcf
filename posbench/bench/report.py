"""``bench.md``: the Markdown table of a ``bench.json`` report (one row per method), the peer
line and the notes on FLOPs, peak and memory. Contended blocks and every ratio built on one
are marked ``*``; a warning line counts them."""

from __future__ import annotations

from typing import Any

from posbench.bench.peer import peer_twin
from posbench.bench.timing import CONTENDED_SPREAD, overloaded


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
