"""Faults from the fault list (docs/faults.md): kills, clashes and bad input end in one clear line or
a recorded failure, never in a traceback or a lost record. Tiny models, CPU, a few steps."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import helpers
import pytest
from helpers import ENV, QUICK_TRAIN, QUIET, compose_config, posbench_cli, run_train

from posbench.core.errors import PosbenchError
from posbench.core.paths import recorded_location
from posbench.runs.run_record import discover_runs
from posbench.runs.spec import build_spec
from posbench.runs.status import write_status

TESTS = Path(__file__).resolve().parents[1]


def run_eval(run_dir: Path, *overrides: str) -> dict:
    return helpers.run_eval(run_dir, "eval.num_sequences=2", "eval.batch_size=2", *overrides)


@pytest.fixture
def trained(trained_run) -> Path:
    """A finished tiny alibi run of its own for each test (a copy: training once is enough)."""
    return trained_run("method=alibi")


def lengths_of(run_dir: Path) -> list[int]:
    return [e["length"] for e in json.loads((run_dir / "results.json").read_text())["eval"]]


# ---------------------------------------------------------------------------- a killed joblib job


@pytest.mark.slow
def test_a_killed_joblib_job_fails_alone_and_the_sweep_goes_on(tmp_path):
    """One job SIGKILLed mid-training (as by the OOM killer): the job running beside it and the
    pending one still finish, the dead one is recorded as failed, summary.md is written."""
    sweep = tmp_path / "sweep"
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(TESTS), ENV.get("PYTHONPATH", "")])}
    proc = posbench_cli(
        "train", "-m", *QUICK_TRAIN, "method=rope", "seed=0,1,2", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
        f"hydra.sweep.dir={sweep}", "+hydra.callbacks.killer._target_=fault_callbacks.KillJobMidTraining",
        "+hydra.callbacks.killer.seed=1", env=env, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "TerminatedWorkerError" not in proc.stderr + proc.stdout
    statuses = {p.name: json.loads((p / "status.json").read_text())["status"]
                for p in sweep.iterdir() if (p / "status.json").exists()}
    assert statuses == {"0_rope-s0": "completed", "1_rope-s1": "failed", "2_rope-s2": "completed"}
    assert "killed by SIGKILL" in json.loads((sweep / "1_rope-s1" / "status.json").read_text())["error"]
    summary = (sweep / "summary.md").read_text()
    assert "## Finished (2)" in summary and "`1_rope-s1`: failed: " in summary and "SIGKILL" in summary
    assert "1 sweep job(s) failed" in proc.stderr


# ------------------------------------------------------------------- two evals of one run at once


@pytest.mark.slow
def test_two_evals_of_one_run_at_once_keep_both_entries(trained, monkeypatch):
    """Eval A reads the run, evaluates; meanwhile eval B evaluates and writes; then A writes.
    A must merge into what B wrote, not into what it read before."""
    import posbench.commands.eval

    real = posbench.commands.eval.evaluate_model
    calls = []

    def interleaved(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # A is evaluating: B runs from start to end now
            run_eval(trained, "eval.lengths=[128]")
        return real(*args, **kwargs)

    monkeypatch.setattr(posbench.commands.eval, "evaluate_model", interleaved)
    run_eval(trained, "eval.lengths=[96]")
    assert lengths_of(trained) == [64, 96, 128]


# -------------------------------------------------------- eval after the training text changed


def write_corpus(directory: Path, extra: str = "") -> None:
    names = ["Lily", "Ben", "Tom", "Mia", "Sam", "Max"]
    stories = [f"Once upon a time {n} found a red ball in the park. {n} played with it all day. Story {i}."
               for i, n in enumerate(names * 20)]
    valid = [f"One day {n} saw a big bird near the lake and ran home to tell mom. Tale {i}."
             for i, n in enumerate(names * 6)]
    (directory / "train.txt").write_text("\n<|endoftext|>\n".join(stories) + extra)
    (directory / "valid.txt").write_text("\n<|endoftext|>\n".join(valid))


@pytest.mark.slow
def test_eval_uses_the_runs_own_tokenizer_and_never_trains_a_new_one(tmp_path):
    text, cache, run = tmp_path / "text", tmp_path / "cache", tmp_path / "run"
    text.mkdir()
    write_corpus(text)
    run_train(run, "method=rope", "data=local", f"data.path={text}", f"data.cache_dir={cache}",
              "data.bpe_vocab_size=300", "eval.num_sequences=2")
    results = json.loads((run / "results.json").read_text())
    recorded = recorded_location(results["data"]["dir"])
    first = results["eval"][0]["loss_by_position"]

    # The cache is gone but the text is unchanged: it is rebuilt, with a verified tokenizer.
    shutil.rmtree(recorded)
    again = run_eval(run, "eval.lengths=[64]")
    assert again["eval"][0]["loss_by_position"] == pytest.approx(first)

    # The training text changed: the run's own cache (its very tokens) is used, no new BPE.
    write_corpus(text, extra="\n<|endoftext|>\nA new story about a dragon who liked to bake bread.")
    before = sorted(p.name for p in (cache / "data").iterdir())
    again = run_eval(run, "eval.lengths=[64]")
    assert again["eval"][0]["loss_by_position"] == pytest.approx(first)
    assert sorted(p.name for p in (cache / "data").iterdir()) == before

    # Text changed and the cache gone: refused in one line, results.json untouched.
    shutil.rmtree(recorded)
    kept = (run / "results.json").read_text()
    with pytest.raises(PosbenchError, match=r"is gone and cannot be rebuilt \(the training text changed since\)"):
        run_eval(run, "eval.lengths=[64]")
    assert (run / "results.json").read_text() == kept
    assert not (cache / "data" / recorded.name).exists()
    assert len(results["data"]["meta"]["tokenizer"]["sha256"]) == 64  # the checksum it was verified by


@pytest.mark.slow
def test_eval_refuses_a_cache_whose_tokenizer_is_not_the_runs(trained):
    run = trained
    results = json.loads((run / "results.json").read_text())
    results["data"]["meta"]["tokenizer"]["sha256"] = "0" * 64
    (run / "results.json").write_text(json.dumps(results))
    with pytest.raises(PosbenchError, match="is not the one .* trained with"):
        run_eval(run, "eval.lengths=[64]")


# -------------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["method=rope", "method.base=abc"], "method.base must be a number, got 'abc'"),
        (["method=t5", "method.num_buckets=abc"], "method.num_buckets must be an integer, got 'abc'"),
        (["method=rope", "method.interleaved=maybe"], "method.interleaved must be true or false, got 'maybe'"),
        (["+optimizer=adam"], "unknown key(s) optimizer for posbench train"),
        (["debug=maybe"], "debug must be true or false, got 'maybe'"),
        (["trainer.context=32", "eval.lengths=[48]"], "no length >= 2 x trainer.context = 64"),
        (["task=fashion", "method=axial_rope", "trainer.context=64", "eval.lengths=[49,196,784]"],
         "make a 7 x 7 grid; set trainer.context=49"),  # was a lengths hint that was then refused
    ],
)
def test_bad_values_are_refused_in_one_line(overrides, message):
    with pytest.raises(PosbenchError) as refused:
        build_spec(compose_config("train", [*QUICK_TRAIN, *overrides]))
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.slow
def test_a_method_option_type_error_is_one_line_on_the_command_line(tmp_path):
    proc = posbench_cli("train", *QUICK_TRAIN, "method=t5", "method.num_buckets=abc", f"hydra.run.dir={tmp_path}", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "posbench train: error: method.num_buckets must be an integer, got 'abc'" in proc.stderr


def test_eval_below_the_training_context_is_refused(trained):
    with pytest.raises(PosbenchError, match=r"eval.lengths \[16\] has a length below trainer.context=32"):
        run_eval(trained, "eval.lengths=[16]")
    assert lengths_of(trained) == [64]


def test_a_text_file_without_separators_gets_the_separator_fix(tmp_path):
    from posbench.data import DataConfig, prepare_data

    story = tmp_path / "stories.txt"
    story.write_text("\n\n".join(f"Paragraph {i} of a text with no story separators at all." for i in range(50)))
    with pytest.raises(PosbenchError, match="separate stories with a line <\\|endoftext\\|>"):
        prepare_data(DataConfig(source="local", path=str(story), cache_dir=str(tmp_path / "cache")), log=QUIET)


@pytest.mark.slow
def test_a_glob_matching_no_method_fails_the_sweep(tmp_path):
    proc = posbench_cli("train", "-m", *QUICK_TRAIN, "method=glob(xyz*)", f"hydra.sweep.dir={tmp_path}", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "posbench train: error: method=glob(xyz*) matches no option" in proc.stderr


def test_plot_skips_a_run_whose_status_is_not_completed(trained):
    assert len(discover_runs([trained])[0]) == 1
    for status in ("running", "failed", "interrupted"):
        write_status(trained, status, error="for the test")
        runs, problems = discover_runs([trained])
        assert runs == [] and "results.json is from an earlier finish" in problems[0][1], status
