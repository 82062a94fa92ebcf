"""The `posbench` command end to end, as users run it: subprocesses, real Hydra, real sweeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ENV, QUICK_TRAIN, posbench_cli, results_of, run_train

import posbench


def test_help_lists_every_subcommand():
    out = posbench_cli("--help").stdout
    for command in ("prepare", "train", "eval", "plot", "bench", "export", "runs"):
        assert f"  {command} " in out


@pytest.mark.slow
def test_hydra_features_work_per_subcommand():
    composed = posbench_cli("train", "--cfg", "job", "method=alibi", "model=tiny").stdout
    assert "name: alibi" in composed and "d_model: 64" in composed
    help_text = posbench_cli("train", "--help").stdout
    assert "method: " + ", ".join(sorted(posbench.list_methods(None))) in help_text  # every config file, grid methods too


def test_unknown_command_fails_with_the_list_of_commands():
    proc = posbench_cli("fit", check=False)
    assert proc.returncode == 2 and "prepare, train, eval, plot, bench" in proc.stderr


@pytest.mark.slow
def test_unknown_method_fails_before_any_work(tmp_path):
    proc = posbench_cli("train", "method=yarn", f"hydra.run.dir={tmp_path / 'run'}", check=False)
    assert proc.returncode == 2
    assert "unknown method 'yarn'" in proc.stderr and "rope" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "method=ropee"], "unknown method 'ropee'; did you mean method=rope?"),
        (["train", "method=alibi", "method.base=500"],
         "method=alibi has no option 'base'; its options: name; method.base is an option of method="),
        (["train", "task=copy", "task.num_symbol=8"], "did you mean task.num_symbols?"),
        (["train", "task.num_symbols=8"], "no task is chosen; add task=<name> (the options with task.num_symbols: copy, lookup)"),
        (["train", "trainer.lrr=1"], "trainer has no key 'lrr'; did you mean trainer.lr?"),
        (["train", "seed=0,1"], "seed=0,1 lists several values, which only a sweep runs; add -m"),
        (["train", "-m", "task=flipflop,copy", "task.num_symbols=8"],
         "task=flipflop has no option 'num_symbols'"),
        (["train", *QUICK_TRAIN, "data=local", "data.path=/no/such/dir"], "data.path /no/such/dir does not exist"),
        (["eval", "run=outputs/x", "task=flipflop"],
         "posbench eval takes the run's own task (from its config.yaml), and a text run has none"),
        (["viz", "task=copy"], "posbench viz does not read task= (it reads method, model)"),
        (["train", "eval.lengths=[1,2"], "Error parsing override 'eval.lengths=[1,2'"),
    ],
)
def test_config_errors_are_one_posbench_line_with_the_fix(tmp_path, args, message):
    """Hydra's own block (exit 1, a `+key` hint that fails again) becomes posbench's one line,
    exit 2, with a close match where there is one; nothing is written (not even a run folder
    for a data.path that does not exist)."""
    command, *rest = args
    proc = posbench_cli(command, *rest, f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                        check=False, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # exactly one line
    assert proc.stderr.startswith(f"posbench {command}: error: ") and message in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_plain_key_of_a_swept_group_works_in_a_sweep(tmp_path):
    """`-m task=flipflop,copy task.seed=3`: Hydra composes the sweep's own config without the
    swept task, so the plain key failed there (and its `+task.seed` hint failed again); every job
    has the key, so it is handed to Hydra as ++task.seed=3 and each job gets it."""
    from posbench.config import check_command_line

    args, jobs = check_command_line("train", ["-m", "task=flipflop,copy", "task.seed=3", "seed=0,1"])
    assert args == ["-m", "task=flipflop,copy", "++task.seed=3", "seed=0,1"]
    assert [(job.task.name, job.task.seed) for job in jobs] == [("flipflop", 3), ("copy", 3)]
    assert check_command_line("train", ["-m", "task=copy", "task.seed=3", "seed=0,1"])[0][2] == "task.seed=3"
    posbench_cli("train", "-m", "task=flipflop,copy", "task.seed=3", "model=tiny", "logger=none",
                 "trainer.max_steps=1", "trainer.val_every=0", "eval.lengths=[64,128]", "eval.num_sequences=4",
                 f"hydra.sweep.dir={tmp_path}", "hydra/launcher=basic")
    configs = sorted(tmp_path.glob("*/config.yaml"))
    assert len(configs) == 2 and all("seed: 3" in c.read_text().split("task:")[1] for c in configs)


@pytest.mark.slow
def test_a_plain_key_of_a_group_that_the_experiment_sweeps_works():
    """`-m experiment=grid task.learnt_at_c=0`: the task is swept by the experiment's
    hydra.sweeper.params, not the command line, and the plain key was refused ("no task is
    chosen"); each task the experiment sweeps is checked and the key is handed on as ++."""
    from posbench.config import check_command_line
    from posbench.core.errors import PosbenchError

    args, jobs = check_command_line("train", ["-m", "experiment=grid", "task.learnt_at_c=0"])
    assert args == ["-m", "experiment=grid", "++task.learnt_at_c=0"]
    assert [(job.task.name, job.task.learnt_at_c) for job in jobs] == [("life", 0), ("lookup", 0), ("same_line", 0)]
    args, jobs = check_command_line("train", ["-m", "experiment=grid", "task=lookup", "task.learnt_at_c=0"])
    assert args[3] == "task.learnt_at_c=0" and [job.task.name for job in jobs] == ["lookup"]  # the command line wins
    with pytest.raises(PosbenchError, match="num_symbolz"):
        check_command_line("train", ["-m", "experiment=grid", "task.num_symbolz=3"])
    args, jobs = check_command_line("train", ["-m", "experiment=images", "task.learnt_at_c=0"])  # task: fashion, one value
    assert args[2] == "++task.learnt_at_c=0" and [(j.task.name, j.task.learnt_at_c) for j in jobs] == [("fashion", 0)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.n_layers=abc"], "model.n_layers must be an integer, got 'abc'"),
        (["trainer.lr=-0.1"], "trainer.lr must be positive"),
        (["model.attention=flex"], "model.attention=flex cannot train on the CPU (FlexAttention has no CPU backward); use model.attention=sdpa"),
    ],
)
def test_user_errors_are_one_line_without_traceback(tmp_path, overrides, message):
    """(A data.path that does not exist: test_config_errors_are_one_posbench_line_with_the_fix runs
    that same command and checks more: exactly one line, nothing written.)"""
    proc = posbench_cli("train", *QUICK_TRAIN, *overrides, f"hydra.run.dir={tmp_path / 'run'}", check=False)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("posbench train: error")]
    assert len(error_lines) == 1
    assert not (tmp_path / "run" / "results.json").exists()


# What `posbench train` loads before it trains: a refused start reports the error and leaves.
STARTUP = """
import sys
from posbench.commands.cli import main
try:
    main(sys.argv[1:])
except SystemExit as done:
    print(done.code, "torch._dynamo" in sys.modules, "matplotlib" in sys.modules)
"""


@pytest.mark.slow
def test_a_refused_start_loads_neither_torch_compile_nor_matplotlib(tmp_path):
    """torch._dynamo (loaded by a module-level torch.compiler.disable) and matplotlib (loaded by the
    sweep callback and the final stage) made every start, a refused one too, about 2.5 s slower;
    they load when a run compiles or draws."""
    proc = subprocess.run([sys.executable, "-c", STARTUP, "train", *QUICK_TRAIN, "model.n_layers=abc",
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, env=ENV)
    assert proc.stdout.split() == ["2", "False", "False"], proc.stderr[-2000:]
    assert "model.n_layers must be an integer" in proc.stderr


@pytest.mark.slow
def test_debug_flag_shows_the_traceback(tmp_path):
    proc = posbench_cli("train", *QUICK_TRAIN, "model.n_layers=abc", "debug=true",
                        f"hydra.run.dir={tmp_path / 'run'}", check=False)
    assert proc.returncode != 0 and "Traceback" in proc.stderr + proc.stdout


@pytest.mark.slow
def test_train_eval_plot_round_trip(tmp_path):
    run = tmp_path / "run"
    posbench_cli("train", *QUICK_TRAIN, "method=alibi", f"hydra.run.dir={run}")
    first = results_of(run)
    assert [e["length"] for e in first["eval"]] == [64]

    # the run trained in fp32 (QUICK_TRAIN); eval's precision=auto would be bf16 on a native-bf16 CPU
    posbench_cli("eval", f"run={run}", "eval.lengths=[64,128]", "eval.num_sequences=4", "eval.batch_size=2",
                 "precision=fp32")
    again = results_of(run)
    assert [e["length"] for e in again["eval"]] == [64, 128]
    assert again["eval"][0]["loss_by_position"] == pytest.approx(first["eval"][0]["loss_by_position"])
    assert set(again["eval"][1]["bands"]) == {"0-32", "32-64", "64-128"}
    assert again["train"] == first["train"]

    other = tmp_path / "other.txt"
    other.write_text("\n<|endoftext|>\n".join(["Once upon a time a cat sat on a big red mat. " * 12] * 6) + "\n")
    posbench_cli("eval", f"run={run}", f"data.path={other}", "eval.lengths=[64]", "eval.num_sequences=2")
    elsewhere = json.loads((run / "eval_other.txt.json").read_text())
    assert elsewhere["eval"][0]["data"] == str(other)
    assert results_of(run) == again  # other text never rewrites the run's own results

    out = tmp_path / "figs"
    posbench_cli("plot", f"runs=[{run}]", f"out={out}", "formats=[png,svg]")
    for name in ("train_loss.png", "loss_by_position.png", "band_32_64.png", "bands.md", "bands.csv",
                 "loss_by_position.svg"):
        assert (out / name).stat().st_size > 0, name


@pytest.mark.slow
def test_eval_and_plot_refuse_a_directory_without_runs(tmp_path):
    proc = posbench_cli("eval", f"run={tmp_path}", check=False)
    assert proc.returncode == 2 and "no checkpoints" in proc.stderr
    proc = posbench_cli("plot", f"runs=[{tmp_path}]", f"out={tmp_path / 'out'}", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_multirun_over_all_methods_writes_comparison(tmp_path):
    sweep = tmp_path / "sweep"
    # viz's pictures of the sweep: test_viz_runs.py::test_sweep_callback_adds_the_viz_pictures
    proc = posbench_cli("train", "-m", *QUICK_TRAIN, "method=glob(*)", f"hydra.sweep.dir={sweep}",
                        "hydra.callbacks.compare_plots.viz=false")
    jobs = sorted(p for p in sweep.iterdir() if (p / "results.json").exists())
    assert {results_of(j)["method"] for j in jobs} == set(posbench.list_methods())
    assert all(j.name.split("_", 1)[1] == f"{results_of(j)['method']}-s0" for j in jobs)
    table = (sweep / "comparison" / "bands.md").read_text()
    for method in posbench.list_methods():
        assert f"| {method} " in table
    assert (sweep / "comparison" / "loss_by_position.png").stat().st_size > 0
    assert "7" in (sweep / "summary.md").read_text()
    # The same figures can be rebuilt later from the saved results alone.
    rebuilt = tmp_path / "rebuilt"
    posbench_cli("plot", f"runs=[{sweep}]", f"out={rebuilt}")
    assert (rebuilt / "bands.csv").read_text() == (sweep / "comparison" / "bands.csv").read_text()
    assert proc.returncode == 0


@pytest.mark.slow
def test_joblib_launcher_runs_jobs_in_parallel_processes(tmp_path):
    sweep = tmp_path / "sweep"
    posbench_cli("train", "-m", *QUICK_TRAIN, "method=rope,alibi", "seed=0,1", "hydra/launcher=joblib",
                 "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep}")
    runs = [results_of(p) for p in sweep.iterdir() if (p / "results.json").exists()]
    assert sorted((r["method"], r["seed"]) for r in runs) == [("alibi", 0), ("alibi", 1), ("rope", 0), ("rope", 1)]
    assert "| alibi | 2 |" in (sweep / "comparison" / "bands.md").read_text()


@pytest.mark.slow
def test_a_failing_job_does_not_stop_the_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    proc = posbench_cli("train", "-m", *QUICK_TRAIN, "method=rope", "trainer.grad_clip=0",
                        "trainer.warmup_steps=0", "trainer.max_steps=30", "trainer.lr=1e-3,1e6",
                        f"hydra.sweep.dir={sweep}", check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    statuses = {p.name: json.loads((p / "status.json").read_text()) for p in sweep.iterdir() if (p / "status.json").exists()}
    assert sorted(s["status"] for s in statuses.values()) == ["completed", "failed"]
    failed = next(s for s in statuses.values() if s["status"] == "failed")
    assert "loss became" in failed["error"]
    summary = (sweep / "summary.md").read_text()
    assert "loss became" in summary
    assert (sweep / "comparison" / "bands.md").exists()


@pytest.mark.slow
def test_submitit_local_launcher_runs_a_tiny_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    posbench_cli("train", "-m", *QUICK_TRAIN, "method=nope,t5", "hydra/launcher=submitit_local",
                 "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={sweep}")
    methods = sorted(results_of(p)["method"] for p in sweep.iterdir() if (p / "results.json").exists())
    assert methods == ["nope", "t5"]


@pytest.mark.slow
def test_torchrun_two_processes_match_one_process(tmp_path):
    """DDP on 2 CPU processes (gloo) with the same global batch follows the 1-process loss curve."""
    overrides = ["method=rope", "trainer.max_steps=6", "trainer.log_every=1"]
    single, double = tmp_path / "single", tmp_path / "ddp"
    run_train(single, *overrides)  # the 1-process reference, in process (test_train_eval_plot_round_trip runs the CLI)
    proc = subprocess.run(
        # --standalone: a free local port per run, so parallel or leftover runs never collide.
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "posbench.commands.cli", "train", *QUICK_TRAIN, *overrides, f"hydra.run.dir={double}"],
        capture_output=True, text=True, env=ENV, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    def losses(d):
        return [json.loads(l)["loss"] for l in (d / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    assert len(losses(double)) == 6
    assert losses(double) == pytest.approx(losses(single), rel=1e-4, abs=1e-5)
    assert results_of(double)["train"]["world_size"] == 2


@pytest.mark.slow
def test_packaged_sample_train_and_eval(tmp_path):
    run = tmp_path / "run"
    posbench_cli("train", *QUICK_TRAIN, "data=sample",
                 "data.max_train_stories=2000", "eval.lengths=[512]", "trainer.context=256", "trainer.max_steps=4",
                 "method=sinusoidal", f"hydra.run.dir={run}")
    results = results_of(run)
    entry = results["eval"][0]
    assert entry["length"] == 512 and len(entry["loss_by_position"]) == 512
    assert set(entry["bands"]) == {"0-256", "256-512"}
    assert results["data"]["meta"]["source"]


@pytest.mark.parametrize(
    "line, expected",
    [("posbench tr", "train"), ("posbench train method=r", "method=relative method=relative_2d method=rope"),
     ("posbench eval eval.spl", "eval.split=")],
)
def test_shell_completion_routes_to_the_subcommand(line, expected):
    proc = subprocess.run([sys.executable, "-m", "posbench.commands.cli", "-sc", "query=bash"], capture_output=True,
                          text=True, env={**ENV, "COMP_LINE": line}, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == expected, proc.stderr


def test_posbench_subprocesses_use_the_tests_token_cache():
    """helpers.ENV, the environment of `posbench` subprocesses, is made when helpers is imported,
    before the test run's temporary cache exists: the subprocesses prepared data in the user's cache."""
    assert ENV["POSBENCH_CACHE"] == os.environ["POSBENCH_CACHE"]
    assert ENV["POSBENCH_CACHE"] != os.path.expanduser("~/.cache/posbench")


def test_results_files_are_readable_by_others(tmp_path):
    from posbench.core.io import write_json_atomic

    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "r.json", {"a": 1})
    finally:
        os.umask(old)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o644


@pytest.mark.slow
def test_prepare_reports_token_counts_and_reuses_the_cache():
    first = posbench_cli("prepare", "data=synthetic")
    assert "train " in first.stdout + first.stderr and " tokens, validation " in first.stdout + first.stderr
    again = posbench_cli("prepare", "data=synthetic")
    assert "reusing cache" in again.stdout + again.stderr

