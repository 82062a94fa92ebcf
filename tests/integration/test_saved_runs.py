"""Saved runs read back as they were recorded (faults found by a review): options added after a run
was recorded, the precision of posbench eval's entries, refused starts leaving an earlier run's
Hydra record and log alone, and finishing a run whose recorded data.path its source ignores.
Tiny models, CPU, a few steps."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers import results_of, run_eval, run_train

from posbench.core.errors import PosbenchError
from posbench.core.io import file_sha256
from posbench.runs.checkpoint import checksum_path, list_checkpoints


def rewrite_records(run_dir: Path, change) -> None:
    """Apply ``change`` to the config (a dict) and method options the run recorded everywhere:
    each checkpoint (its sha256 sidecar rewritten), config.yaml and results.json."""
    for path in list_checkpoints(run_dir):
        state = torch.load(path, map_location="cpu", weights_only=False)
        change(state["config"], state["method_options"])
        torch.save(state, path)
        checksum_path(path).write_text(f"{file_sha256(path)}  {path.name}\n")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    results = results_of(run_dir)
    change(config, results["method_options"])
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "results.json").write_text(json.dumps(results))


# --------------------------------------------- options added after a run was recorded


@pytest.fixture(scope="module")
def old_t5_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A t5 run as posbench recorded it before bias_scale existed: the unscaled bias, no bias_scale key."""
    run_dir = tmp_path_factory.mktemp("t5") / "run"
    run_train(run_dir, "method=t5", "method.bias_scale=1.0")

    def forget_bias_scale(config: dict, options: dict) -> None:
        del config["method"]["bias_scale"], options["bias_scale"]

    rewrite_records(run_dir, forget_bias_scale)
    return run_dir


@pytest.fixture
def old_t5_run(old_t5_once: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(old_t5_once, tmp_path / "run"))


@pytest.mark.slow
def test_a_t5_run_from_before_bias_scale_is_rebuilt_with_the_unscaled_bias(old_t5_run):
    from posbench.runs.load import load_run

    assert load_run(old_t5_run).model.position.bias_scale == 1.0  # not today's sqrt(head_dim)
    before = results_of(old_t5_run)
    run_eval(old_t5_run, "eval.replace=true")  # the run's own windows, measured again
    assert results_of(old_t5_run)["eval"][0]["bands"] == before["eval"][0]["bands"]  # the same function, bitwise


@pytest.mark.slow
def test_posbench_eval_finishes_an_old_t5_run_as_it_trained(old_t5_run):
    bands = results_of(old_t5_run)["eval"][0]["bands"]
    (old_t5_run / "results.json").unlink()  # stopped during its final evaluation
    results = run_eval(old_t5_run)  # its resume check is not refused
    assert results["method_options"]["bias_scale"] == 1.0  # recorded explicitly from now on
    assert results["eval"][0]["bands"] == bands


def test_resuming_an_old_t5_run_names_its_bias_scale(old_t5_run):
    with pytest.raises(PosbenchError, match=r"method.bias_scale=1.0, not method.bias_scale=None"):
        run_train(old_t5_run, "method=t5")  # today's default would train another function
    assert run_train(old_t5_run, "method=t5", "method.bias_scale=1.0")["train"]["steps"] == 6  # complete: accepted


def test_new_runs_record_the_options_whose_default_changed():
    from posbench.runs.spec import MethodSpec

    assert MethodSpec.from_config("t5").recorded().options == {"bias_scale": None, "fast": False}
    assert MethodSpec.from_saved("t5").options == {"bias_scale": 1.0, "fast": False}
    assert MethodSpec.from_saved({"name": "t5", "bias_scale": None}).options == {"bias_scale": None, "fast": False}


# ---------------------------------------------------- the precision of eval's entries


@pytest.fixture
def bf16_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run trained with precision=auto on a CPU with native bf16 (it resolved to bf16)."""
    import posbench.runtime.hardware as hardware

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    run_dir = tmp_path / "run"
    run_train(run_dir, "method=nope", "trainer.precision=auto")
    assert results_of(run_dir)["environment"]["precision"] == "bf16"
    return run_dir


@pytest.mark.slow
def test_eval_records_the_precision_it_resolved_and_compares_with_the_runs(bf16_run, monkeypatch):
    import posbench.runtime.hardware as hardware

    before = results_of(bf16_run)
    run_eval(bf16_run, "precision=bf16")  # what the run measured in: the same measurement
    assert results_of(bf16_run) == before
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    run_eval(bf16_run)  # auto resolves to fp32 on this machine: another measurement
    after = results_of(bf16_run)
    assert after["eval"] == before["eval"]
    (variant,) = after["eval_variants"]
    assert variant["variant"] == "precision=fp32" and variant["precision"] == "fp32"


@pytest.mark.slow
def test_an_auto_run_of_unknown_precision_is_never_the_same(bf16_run):
    results = results_of(bf16_run)
    del results["environment"]  # results.json from before posbench recorded what auto resolved to
    (bf16_run / "results.json").write_text(json.dumps(results))
    run_eval(bf16_run, "precision=bf16")
    assert [v["variant"] for v in results_of(bf16_run)["eval_variants"]] == ["precision=bf16"]


# ---------------------------------------- refused starts keep an earlier run's record


@pytest.mark.parametrize("overrides, message", [
    (["method=alibi"], "method=rope, not method=alibi"),  # refused by the resume check
    (["method=rope", "trainer.lr=abc"], "trainer.lr"),  # refused before the lock
])
@pytest.mark.slow
def test_a_refused_start_leaves_the_runs_hydra_record_and_log(trained_run, overrides, message):
    from posbench.runs.runlog import DeferredFileHandler, HydraRecord

    run_dir = trained_run("method=rope")
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "overrides.yaml").write_text("- method=rope\n")
    (run_dir / "train.log").write_text("the run's own log\n")
    kept = {p: p.read_bytes() for p in (run_dir / ".hydra" / "overrides.yaml", run_dir / "train.log")}

    handler = DeferredFileHandler(str(run_dir / "train.log"))
    root = logging.getLogger()
    root.addHandler(handler)
    record = HydraRecord(run_dir, {"overrides.yaml": yaml.safe_dump(overrides)}, multirun=False, created=[])
    try:
        with pytest.raises(PosbenchError, match=message):
            run_train(run_dir, *overrides, log=logging.getLogger("posbench").warning, hydra_record=record)
    finally:
        root.removeHandler(handler)
        handler.close()
    assert {p: p.read_bytes() for p in kept} == kept
    assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == ["overrides.yaml"]


def test_a_failed_start_in_a_fresh_directory_keeps_its_hydra_record(tmp_path):
    from posbench.runs.runlog import HydraRecord

    record = HydraRecord(tmp_path, {"overrides.yaml": "- trainer.lr=abc\n"}, multirun=False, created=[])
    with pytest.raises(PosbenchError, match="trainer.lr"):
        run_train(tmp_path, "method=rope", "trainer.lr=abc", hydra_record=record)
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "failed"
    assert (tmp_path / ".hydra" / "overrides.yaml").read_text() == "- trainer.lr=abc\n"


# ------------------------------------------------------ a data.path its source ignores


@pytest.mark.slow
def test_posbench_eval_finishes_a_run_recorded_with_a_data_path_its_source_ignores(trained_run, tmp_path):
    run_dir = trained_run("method=nope")
    bands = results_of(run_dir)["eval"][0]["bands"]

    def add_ignored_path(config: dict, options: dict) -> None:
        config["data"]["path"] = "/no/such/folder"  # as data=sample plus a data.path recorded it

    rewrite_records(run_dir, add_ignored_path)
    (run_dir / "results.json").unlink()  # stopped during its final evaluation
    assert run_eval(run_dir)["eval"][0]["bands"] == bands
    with pytest.raises(PosbenchError, match="data.path=/no/such/folder is read only with data.source=local"):
        run_train(tmp_path / "new", "method=nope", "data.path=/no/such/folder")  # new runs: still refused
