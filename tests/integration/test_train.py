"""Training end to end on generated data: run directory contents, resume, preemption, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import QUICK_TRAIN, compose_config, interrupted, results_of, run_train

from posbench.core.errors import PosbenchError
from posbench.runs.checkpoint import list_checkpoints, read_checkpoint
from posbench.runs.spec import build_spec
from posbench.train.optim import lr_lambda
from posbench.train.trainer import TrainingInterrupted, train


def test_eval_figures_false_leaves_the_figures_out_and_posbench_eval_draws_them(trained_run):
    """eval.figures=false (the quick runs' setting): the run finishes without figures/; posbench eval,
    whose eval.figures is true whatever the run's, draws them from the saved results."""
    from posbench.commands.eval import evaluate_saved_run

    run_dir = trained_run()
    assert results_of(run_dir)["train"]["steps"] == 6 and not (run_dir / "figures").exists()
    before = results_of(run_dir)["eval"]
    evaluate_saved_run(compose_config("eval", [f"run={run_dir}"]), log=lambda _: None)
    assert (run_dir / "figures" / "loss_by_position.png").is_file() and results_of(run_dir)["eval"] == before


@pytest.mark.slow
def test_train_writes_a_complete_run_directory(tmp_path):
    results = run_train(tmp_path, "method=rope", "trainer.val_every=3", figures=True)
    for name in ("config.yaml", "metrics.jsonl", "results.json", "status.json"):
        assert (tmp_path / name).is_file(), name
    assert list_checkpoints(tmp_path), "final checkpoint missing"
    assert (tmp_path / "figures" / "loss_by_position.png").is_file()
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(results))
    assert on_disk["schema_version"] == 1 and on_disk["method"] == "rope" and on_disk["seed"] == 0
    assert on_disk["train_context"] == 32
    assert on_disk["train"]["steps"] == 6 and on_disk["train"]["tokens"] == 6 * 4 * 32
    (entry,) = on_disk["eval"]
    assert entry["split"] == "validation" and entry["length"] == 64
    assert len(entry["loss_by_position"]) == 64
    assert set(entry["bands"]) == {"0-32", "32-64"}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [2, 4, 6]
    assert {"step", "tokens", "loss", "lr", "tokens_per_second"} <= set(train_rows[0])
    assert any("val_loss" in r for r in rows)
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "completed"


@pytest.mark.slow
def test_loss_decreases_on_real_structure(tmp_path):
    run_train(tmp_path, "method=alibi", "trainer.max_steps=40", "trainer.lr=3e-3")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resumed_run_reproduces_the_uninterrupted_run(tmp_path, precision):
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = ["method=t5", "trainer.max_steps=8", f"trainer.precision={precision}"]
    full = run_train(straight, *common)
    with pytest.raises(TrainingInterrupted) as stopped:
        run_train(split, *common, "trainer.stop_after_steps=4")
    assert stopped.value.exit_code != 0
    assert json.loads((split / "status.json").read_text())["status"] == "interrupted"
    assert [p.name for p in list_checkpoints(split)] == ["step_00000004.pt"]
    resumed = run_train(split, *common)
    assert resumed["train"]["resumed_from_step"] == 4
    assert resumed["train"]["final_loss"] == full["train"]["final_loss"]
    a = read_checkpoint(list_checkpoints(straight)[-1])["model"]
    b = read_checkpoint(list_checkpoints(split)[-1])["model"]
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    def losses(d):
        return [json.loads(l).get("loss") for l in (d / "metrics.jsonl").read_text().splitlines()]
    assert losses(straight) == losses(split)


@pytest.mark.slow
def test_corrupt_checkpoint_falls_back_to_the_previous_one(tmp_path):
    interrupted(tmp_path, "method=nope", "trainer.checkpoint_every_steps=2", at=4)
    newest = list_checkpoints(tmp_path)[-1]
    newest.write_bytes(newest.read_bytes()[:100])  # truncated by a crash
    messages: list[str] = []
    cfg = compose_config("train", [*QUICK_TRAIN, "method=nope"])
    results = train(cfg, tmp_path, log=messages.append)
    assert results["train"]["resumed_from_step"] == 2
    assert any("corrupt" in m or "cannot be read" in m for m in messages), messages
    assert newest.with_suffix(".pt.corrupt").exists()


def test_non_finite_loss_stops_the_run_with_a_clear_error(tmp_path):
    with pytest.raises(PosbenchError, match="loss became"):
        run_train(tmp_path, "method=rope", "trainer.lr=1e6", "trainer.grad_clip=0", "trainer.max_steps=30",
                  "trainer.warmup_steps=0")
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "failed"


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.n_layers=abc", "model.n_layers must be"),
        ("trainer.lr=-1", "trainer.lr must be positive"),
        ("model.d_model=65", "not divisible"),
        ("model.n_heads=3", "not divisible"),
        ("eval.lengths=[16]", "below trainer.context"),
        ("trainer.precision=fp8", "trainer.precision"),
        ("+trainer.bogus=1", "unknown option"),
    ],
)
def test_invalid_config_is_refused_before_any_work(override, message):
    with pytest.raises(PosbenchError, match=message):
        build_spec(compose_config("train", [*QUICK_TRAIN, override]))


def test_rope_needs_an_even_head_dim():
    with pytest.raises(PosbenchError, match="even head dimension"):
        build_spec(compose_config("train", [*QUICK_TRAIN, "method=rope", "model.d_model=12", "model.n_heads=4"]))


def test_learned_positions_beyond_their_maximum_are_refused():
    with pytest.raises(PosbenchError, match="method.max_positions"):
        build_spec(compose_config("train", [*QUICK_TRAIN, "method=learned", "method.max_positions=48"]))


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    f = lr_lambda(total_steps=100, warmup_steps=10, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    values = [f(s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert f(100) == pytest.approx(0.1)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_next_start_resumes(tmp_path):
    """A real signal to a real training process (what SLURM does before preemption)."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "posbench.commands.cli", "train", *QUICK_TRAIN, "method=alibi",
            "trainer.max_steps=100000", "trainer.log_every=1", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    metrics = run_dir / "metrics.jsonl"
    for _line in proc.stdout:  # wait until training really runs
        if metrics.exists() and metrics.read_text().count("\n") >= 3:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "checkpoint saved" in out
    step = read_checkpoint(list_checkpoints(run_dir)[-1])["step"]
    assert step >= 3
    assert json.loads((run_dir / "status.json").read_text())["status"] == "interrupted"
    cfg = compose_config("train", [*QUICK_TRAIN, "method=alibi", f"trainer.max_steps={step + 2}"])
    results = train(cfg, run_dir, log=lambda _: None)
    assert results["train"]["resumed_from_step"] == step


@pytest.mark.slow
def test_resume_from_an_explicit_run_directory(tmp_path):
    original, elsewhere = tmp_path / "original", tmp_path / "new-invocation"
    interrupted(original, "method=sinusoidal", at=3)
    elsewhere.mkdir()
    results = run_train(elsewhere, "method=sinusoidal", f"trainer.resume={original}", "trainer.compile=false")
    assert results["train"]["resumed_from_step"] == 3
    assert (original / "results.json").exists() and not (elsewhere / "results.json").exists()


@pytest.mark.slow
def test_resume_false_refuses_to_overwrite_a_run(trained_run):
    run_dir = trained_run("method=nope")
    with pytest.raises(PosbenchError, match="already has checkpoints"):
        run_train(run_dir, "method=nope", "trainer.resume=false")


def test_resuming_another_methods_run_is_refused(tmp_path):
    interrupted(tmp_path, "method=rope")
    with pytest.raises(PosbenchError, match="method=rope, not method=alibi"):
        run_train(tmp_path, "method=alibi")


@pytest.mark.slow
def test_relaunching_a_finished_run_leaves_its_results_alone(trained_run):
    run_dir = trained_run("method=alibi")
    first = results_of(run_dir)
    before = (run_dir / "results.json").read_text()
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    again = run_train(run_dir, "method=alibi")
    assert again == first
    assert (run_dir / "results.json").read_text() == before
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before


@pytest.mark.slow
def test_learned_rows_past_the_training_context_stay_at_their_initialisation(tmp_path):
    import posbench

    results = run_train(tmp_path, "method=learned", "method.max_positions=128", "trainer.weight_decay=0.5",
                        "trainer.lr=1e-2")
    trained = read_checkpoint(list_checkpoints(tmp_path)[-1])["model"]["position.table.weight"]
    torch.manual_seed(0)  # the trainer seeds before building the model: rebuild the same init
    fresh = posbench.create_model("learned", flavour="tiny", vocab_size=results["model"]["vocab_size"],
                                  method_options={"max_positions": 128})
    initial = fresh.position.table.weight.detach()
    context = results["train_context"]
    assert torch.equal(trained[context:], initial[context:])
    assert not torch.equal(trained[:context], initial[:context])


@pytest.mark.slow
def test_resuming_with_a_different_seed_or_batch_is_refused(tmp_path):
    interrupted(tmp_path, "method=rope")
    with pytest.raises(PosbenchError, match="seed=0, not seed=1"):
        run_train(tmp_path, "method=rope", "seed=1")
    with pytest.raises(PosbenchError, match="trainer.batch_size=4, not trainer.batch_size=8"):
        run_train(tmp_path, "method=rope", "trainer.batch_size=8")


@pytest.mark.slow
def test_eval_split_train_reproduces_the_seed_measurement(tmp_path):
    results = run_train(tmp_path, "method=rope", "eval.split=train")
    assert results["eval"][0]["split"] == "train"


@pytest.mark.slow
def test_results_record_the_software_versions(trained_run):
    results = results_of(trained_run("method=nope"))
    assert results["versions"]["torch"] == torch.__version__ and results["versions"]["posbench"]


@pytest.mark.slow
@pytest.mark.parametrize("native", [True, False])
def test_runs_record_the_precision_they_resolved(tmp_path, monkeypatch, native):
    """trainer.precision=auto is recorded as what it resolved to, with the
    autocast dtype, the device name and torch, in results.json, the W&B config and the log."""
    import posbench.runtime.hardware as hardware
    import posbench.train.loggers as loggers

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    configs, lines = [], []
    make_logger = loggers.make_logger
    monkeypatch.setattr(loggers, "make_logger", lambda *a, **k: configs.append(k["config"]) or make_logger(*a, **k))
    results = train(compose_config("train", [*QUICK_TRAIN, "method=nope", "trainer.precision=auto"]), tmp_path,
                    log=lines.append)
    env = json.loads((tmp_path / "results.json").read_text())["environment"]
    assert env == results["environment"] == configs[0]["environment"]
    assert env["precision"] == ("bf16" if native else "fp32") and env["configured_precision"] == "auto"
    assert env["autocast_dtype"] == ("bfloat16" if native else None)
    assert env["device"] == "cpu" and env["device_name"] == hardware.cpu_model_name() != ""
    assert env["torch"] == torch.__version__
    assert any(line.startswith(f"precision {env['precision']} (trainer.precision=auto") and env["device_name"] in line
               for line in lines), lines


def test_precision_auto_is_bf16_where_the_cpu_has_native_bf16(monkeypatch):
    import posbench.runtime.hardware as hardware
    from posbench.runtime.device import autocast_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    assert autocast_dtype("auto", cpu) is torch.bfloat16 and autocast_dtype("fp32", cpu) is None
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    assert autocast_dtype("auto", cpu) is None and autocast_dtype("bf16", cpu) is torch.bfloat16
    assert autocast_dtype("auto", cuda) is torch.bfloat16 and autocast_dtype("fp32", cuda) is None


def test_native_bf16_detection_agrees_with_cpuinfo():
    from posbench.runtime.hardware import NATIVE_BF16_FLAGS, cpu_has_native_bf16

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo")
    assert cpu_has_native_bf16() == bool(NATIVE_BF16_FLAGS & set(cpuinfo.read_text().split()))


def test_cpu_allocator_tuning_leaves_a_users_allocator_choice_alone():
    from posbench.runtime.hardware import tune_cpu_allocator

    chosen = {"MALLOC_TRIM_THRESHOLD_": "0"}
    assert tune_cpu_allocator(chosen) is False and chosen == {"MALLOC_TRIM_THRESHOLD_": "0"}
    preloaded = {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}
    assert tune_cpu_allocator(preloaded) is False and "MALLOC_MMAP_THRESHOLD_" not in preloaded


@pytest.mark.slow
def test_cpu_allocator_tuning_applies_here_and_to_child_processes():
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt tuning is glibc-only")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    code = ("import os, subprocess, sys; from posbench.runtime.hardware import tune_cpu_allocator; "
            "print(tune_cpu_allocator()); sys.stdout.flush(); "
            "subprocess.run([sys.executable, '-c', 'import os; print(os.environ[\"MALLOC_MMAP_THRESHOLD_\"], "
            "os.environ[\"MALLOC_TRIM_THRESHOLD_\"])'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", str(32 * 2**20), str(256 * 2**20)]


@pytest.mark.slow
def test_a_run_resumed_at_its_final_step_logs_one_final_validation_row(tmp_path):
    run_train(tmp_path, "method=rope", "trainer.val_every=3")
    (tmp_path / "results.json").unlink()  # killed during the final evaluation, after its validation
    run_train(tmp_path, "method=rope", "trainer.val_every=3")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert (tmp_path / "results.json").is_file()
