"""``posbench bench``: training and evaluation speed of every position method, plus a peer.

For each method (default: all of :func:`posbench.list_methods`) on one model shape, random token
batches go through the trainer's training step and posbench's evaluation
(:mod:`posbench.bench.measure`), timed with their contention and peak memory
(:mod:`posbench.bench.timing`); FLOPs per token and MFU come from :mod:`posbench.bench.flops`,
and ``transformers.LlamaForCausalLM`` of the same shape is timed beside its twin
(:mod:`posbench.bench.peer`). The settings are :class:`posbench.bench.settings.BenchSettings`.
The device is set up as the trainer sets it up (:func:`posbench.runtime.device.setup_device`:
no TF32 under ``precision=fp32``) and a compiled model is compiled as the trainer compiles it.

Outputs in the output folder (``out=`` or the Hydra run dir ``outputs/bench/<date>_<time>``):
``bench.json`` (every number and the config; rewritten after each method, so an interrupted run
keeps what it measured) and ``bench.md`` (the table of :mod:`posbench.bench.report`, also
printed to stdout).
"""

from __future__ import annotations

import logging
import platform
import shlex
import sys
import traceback
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

import posbench
from posbench.bench.checks import settings_from_config
from posbench.bench.flops import FLOP_FORMULA, matmul_parameters, resolve_peak_tflops, train_flops_per_token
from posbench.bench.measure import Env, bench_method
from posbench.bench.peer import bench_peer, peer_twin
from posbench.bench.report import render_markdown
from posbench.bench.settings import BenchSettings
from posbench.bench.timing import CONTENDED_SPREAD, cpu_cores, free_memory, load_average, overloaded
from posbench.core.errors import PosbenchError, one_line
from posbench.core.io import write_json_atomic, write_text_atomic
from posbench.methods import PositionMethod
from posbench.model.transformer import ModelConfig, Transformer, attention_backends
from posbench.runs.spec import MethodSpec
from posbench.runtime.device import autocast_dtype, setup_device
from posbench.train.optim import compiles
from posbench.train.settings import TrainerConfig

logger = logging.getLogger("posbench")

SCHEMA_VERSION = 1


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


def bench_device(settings: BenchSettings) -> torch.device:
    """The device, set up exactly as the trainer sets up its own (TF32 only when not fp32)."""
    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        raise PosbenchError(f"device={settings.device} but CUDA is not available; use device=cpu (or auto)")
    return setup_device(settings.device, settings.precision)


def make_env(settings: BenchSettings, model_cfg: ModelConfig, device: torch.device) -> Env:
    """What the measurements share; optimizer, schedule, clip and compile mode are the trainer's
    defaults. The peak is not known yet."""
    trainer = TrainerConfig(context=settings.context, batch_size=settings.batch_size, precision=settings.precision,
                            compile=settings.compile, device=settings.device, progress=False)
    return Env(settings, model_cfg, trainer, device, autocast_dtype(settings.precision, device),
               compiles(trainer, device), peak_tflops=None)


def new_report(env: Env, peak_source: str, peak_load: list[float | None]) -> dict[str, Any]:
    """The head of bench.json (machine, config, FLOPs, peak) with no measurement yet."""
    settings, model_cfg, trainer, device = env.settings, env.model_cfg, env.trainer, env.device
    with torch.device("meta"):  # the body alone: a method without position information
        n_matmul = matmul_parameters(Transformer(model_cfg, PositionMethod(model_cfg.dims)))
    return {
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
        "compiled": env.use_compile,
        "flops": {
            "formula": FLOP_FORMULA,
            "matmul_parameters": n_matmul,
            "train_flops_per_token": train_flops_per_token(n_matmul, model_cfg.n_layers, settings.context,
                                                           model_cfg.d_model),
            "peak_tflops": env.peak_tflops,
            "peak_source": peak_source,
            "peak_load_average": peak_load,
            "peak_contended": peak_source.startswith("measured") and overloaded(peak_load, cpu_cores()) is not None,
        },
        "load_average": {"start": peak_load[0], "end": None, "cpu_cores": cpu_cores(),
                         "contended_spread": CONTENDED_SPREAD},
        "methods": {},
        "peer": None,
        "peer_ratio": None,
        "complete": False,
    }


def failed_method(env: Env, name: str, err: Exception) -> dict[str, Any]:
    """The entry of a method whose measurement raised: the error and the attention backend."""
    logger.error("bench %s failed: %s\n%s", name, one_line(err), traceback.format_exc())
    probe = MethodSpec.defaults(name).probe(env.model_cfg.dims)
    backend = attention_backends(env.model_cfg, probe, env.device)
    return {"train": {"error": one_line(err), "attention_backend": backend}, "eval": {}}


def run_bench(cfg: DictConfig) -> dict[str, Any]:
    """``posbench bench``: measure every configured method (and the peer); write bench.json/md."""
    settings, model_cfg = settings_from_config(cfg)
    env = make_env(settings, model_cfg, bench_device(settings))
    device = env.device
    load_start = load_average()
    env.peak_tflops, peak_source = resolve_peak_tflops(settings.peak_tflops, device, env.amp_dtype)
    report = new_report(env, peak_source, [load_start, load_average()])  # the load around the CPU's peak
    out = output_dir(settings)
    out.mkdir(parents=True, exist_ok=True)
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
            report["methods"][name] = failed_method(env, name, err)
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
