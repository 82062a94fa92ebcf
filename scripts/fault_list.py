"""Re-run the fault list (kills, clashes and bad input on tiny models) and print a markdown table.

    .venv/bin/python scripts/fault_list.py > docs/faults.md

Every case runs the real `posbench` command on a tiny CPU model in a temporary directory and is
judged by what a user would see: "refused cleanly" (non-zero exit, one error line, no traceback),
"recorded failure" (the sweep goes on, the failure is in status.json and summary.md), "handled"
(the right thing happened), or "crash" / "lost data" / "wrong" when it did not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))
from helpers import QUICK_TRAIN  # noqa: E402

from posbench.core.paths import recorded_location  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "MPLBACKEND": "Agg",
       "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}  # this checkout's posbench, the tests' callbacks


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posbench.commands.cli", *args], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=600)


def refused(proc: subprocess.CompletedProcess, message: str, prefix: str = "posbench ") -> tuple[str, str]:
    """One error line containing ``message``, non-zero exit, no traceback."""
    if "Traceback" in proc.stderr + proc.stdout:
        return "crash", proc.stderr.strip().splitlines()[-1]
    lines = [line for line in proc.stderr.splitlines() if message in line]
    if proc.returncode != 0 and len(lines) == 1 and lines[0].startswith(prefix):
        return "refused cleanly", lines[0]
    return "wrong", f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1]}"


def train_run(directory: Path, *overrides: str) -> Path:
    proc = cli("train", *QUICK_TRAIN, *overrides, f"hydra.run.dir={directory}")
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return directory


def lengths(run: Path) -> list[int]:
    return [e["length"] for e in json.loads((run / "results.json").read_text())["eval"]]


# ----------------------------------------------------------------------------- the cases


def killed_joblib_job(tmp: Path) -> tuple[str, str]:
    sweep = tmp / "sweep"
    proc = cli("train", "-m", *QUICK_TRAIN, "method=rope", "seed=0,1,2", "hydra/launcher=joblib",
               "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep}",
               "+hydra.callbacks.killer._target_=fault_callbacks.KillJobMidTraining", "+hydra.callbacks.killer.seed=1")
    statuses = sorted(json.loads((p / "status.json").read_text())["status"]
                      for p in sweep.iterdir() if (p / "status.json").exists()) if sweep.exists() else []
    if "TerminatedWorkerError" in proc.stderr or not (sweep / "summary.md").exists():
        return "crash", "sweep aborted"
    if statuses != ["completed", "completed", "failed"]:
        return "lost data", f"statuses {statuses}"
    return "recorded failure", f"exit {proc.returncode}; 2 completed, the killed job 'failed' in status.json and summary.md"


def concurrent_evals(tmp: Path) -> tuple[str, str]:
    run = train_run(tmp / "run", "method=alibi")
    procs = [subprocess.Popen([sys.executable, "-m", "posbench.commands.cli", "eval", f"run={run}", f"eval.lengths=[{n}]",
                               "eval.num_sequences=2", "eval.batch_size=2"], env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for n in (96, 128)]
    codes = [p.wait(timeout=600) for p in procs]
    found = lengths(run)
    if codes != [0, 0]:
        return "crash", f"exit codes {codes}"
    return ("handled", f"both kept: lengths {found}") if found == [64, 96, 128] else ("lost data", f"lengths {found}")


def text_changed_eval(tmp: Path) -> tuple[str, str]:
    from test_faults import write_corpus

    text, cache = tmp / "text", tmp / "cache"
    text.mkdir()
    write_corpus(text)
    run = train_run(tmp / "run", "method=rope", "data=local", f"data.path={text}", f"data.cache_dir={cache}",
                    "data.bpe_vocab_size=300", "eval.num_sequences=2")
    before = json.loads((run / "results.json").read_text())["eval"][0]["bands"]
    write_corpus(text, extra="\n<|endoftext|>\nA new story about a dragon.")
    caches = len(list((cache / "data").iterdir()))
    proc = cli("eval", f"run={run}", "eval.lengths=[64]", "eval.num_sequences=2")
    after = json.loads((run / "results.json").read_text())["eval"][0]["bands"]
    if proc.returncode != 0:
        return "crash", proc.stderr.strip().splitlines()[-1]
    if len(list((cache / "data").iterdir())) != caches or after != before:
        return "wrong", "a new tokenizer was trained"
    shutil.rmtree(recorded_location(json.loads((run / "results.json").read_text())["data"]["dir"]))
    gone = cli("eval", f"run={run}", "eval.lengths=[64]", "eval.num_sequences=2")
    outcome, line = refused(gone, "is gone and cannot be rebuilt")
    return ("handled" if outcome == "refused cleanly" else outcome,
            f"same numbers from the run's own cache; with the cache deleted too: {outcome}")


def train_refusal(message: str, *overrides: str) -> Callable[[Path], tuple[str, str]]:
    return lambda tmp: refused(cli("train", *QUICK_TRAIN, *overrides, f"hydra.run.dir={tmp / 'run'}"), message)


def no_separator_file(tmp: Path) -> tuple[str, str]:
    story = tmp / "stories.txt"
    story.write_text("\n\n".join(f"Paragraph {i} of a text with no separators." for i in range(50)))
    return refused(cli("prepare", "data=local", f"data.path={story}", f"data.cache_dir={tmp / 'cache'}"),
                   "separate stories with a line")


def empty_glob(tmp: Path) -> tuple[str, str]:
    return refused(cli("train", "-m", *QUICK_TRAIN, "method=glob(xyz*)", f"hydra.sweep.dir={tmp / 'sweep'}"),
                   "matches no option")


def eval_below_context(tmp: Path) -> tuple[str, str]:
    run = train_run(tmp / "run", "method=rope")
    outcome, line = refused(cli("eval", f"run={run}", "eval.lengths=[16]"), "below trainer.context")
    return (outcome, line) if lengths(run) == [64] else ("lost data", "results.json changed")


def plot_skips_running(tmp: Path) -> tuple[str, str]:
    from posbench.runs.status import write_status

    good, stale = train_run(tmp / "good", "method=rope"), train_run(tmp / "stale", "method=alibi")
    write_status(stale, "running")
    proc = cli("plot", f"runs=[{good},{stale}]", f"out={tmp / 'figs'}")
    table = (tmp / "figs" / "bands.md").read_text() if proc.returncode == 0 else ""
    if "| rope " in table and "| alibi " not in table:
        return "handled", "the running run is listed as skipped, not averaged in"
    return "wrong", f"exit {proc.returncode}"


def path_with_spaces(tmp: Path) -> tuple[str, str]:
    spaced = tmp / "my runs"
    proc = cli("eval", *f"run={spaced}/x".split(" "))
    if "Traceback" in proc.stderr:
        return "crash", "traceback"
    hydra_error = next((line for line in proc.stderr.splitlines() if "Error parsing override" in line), "")
    quoted = refused(cli("eval", f"run={spaced}/x"), "does not exist")
    return ("refused cleanly" if proc.returncode and hydra_error and quoted[0] == "refused cleanly" else "wrong",
            f"Hydra: {hydra_error} (README troubleshooting row: quote it); quoted: {quoted[1]}")


CASES: list[tuple[str, str, Callable[[Path], tuple[str, str]]]] = [
    ("kill", "one joblib job SIGKILLed mid-training (3 jobs, n_jobs=2)", killed_joblib_job),
    ("clash", "two `posbench eval` of one run at once (lengths 96 and 128)", concurrent_evals),
    ("stale data", "`posbench eval` after the training text changed; then with the cache deleted", text_changed_eval),
    ("bad input", "`method.base=abc`", train_refusal("method.base must be a number", "method=rope", "method.base=abc")),
    ("bad input", "`method.num_buckets=abc`", train_refusal("method.num_buckets must be an integer", "method=t5",
                                                     "method.num_buckets=abc")),
    ("bad input", "`method.interleaved=maybe`", train_refusal("must be true or false", "method=rope", "method.interleaved=maybe")),
    ("bad input", "`+optimizer=adam`", train_refusal("unknown key(s) optimizer", "+optimizer=adam")),
    ("bad input", "`debug=maybe`", train_refusal("debug must be true or false", "debug=maybe")),
    ("bad input", "a .txt file without `<|endoftext|>` separators", no_separator_file),
    ("bad input", "`method=glob(xyz*)` matching no method", empty_glob),
    ("bad input", "`posbench eval eval.lengths=[16]` below the training context (32)", eval_below_context),
    ("bad input", "`posbench train eval.lengths=[48]` at context 32 (no headline band)",
     train_refusal("no length >= 2 x trainer.context", "eval.lengths=[48]")),
    ("bad input", "`posbench plot` over a run with status running and an old results.json", plot_skips_running),
    ("bad input", "unquoted path with spaces, `run=/tmp/.../my runs/x`", path_with_spaces),
    ("bad input", "`trainer.compile_mode=reduce-overhead` on a CPU, `trainer.compile` left at auto",
     train_refusal("captures CUDA graphs", "trainer.device=cpu", "trainer.compile_mode=reduce-overhead")),
    ("bad input", "`data.retrieval.min_distance=100 max_distance=1000` at `trainer.context=64`",
     train_refusal("lower data.retrieval.min_distance to at most", "data.retrieval.rate=0.5", "trainer.context=64",
                   "eval.lengths=[128]", "data.retrieval.min_distance=100", "data.retrieval.max_distance=1000")),
    ("bad input", "`task=fashion trainer.context=64` (its default eval.lengths)",
     train_refusal("set trainer.context=49", "task=fashion", "method=axial_rope", "trainer.context=64",
                   "eval.lengths=[49,196,784]")),
    ("bad input", "`eval.probes=[passkey]` on `method=learned`, every passkey length past its positions",
     train_refusal("lies past the model's 64 learned positions", "method=learned", "method.max_positions=64",
                   "eval.probes=[passkey]", "eval.passkey.lengths=[128]")),
]


def main() -> None:
    rows, counts = [], {}
    for item, case, check in CASES:
        with tempfile.TemporaryDirectory(prefix="posbench-fault-") as tmp:
            start = time.perf_counter()
            try:
                outcome, detail = check(Path(tmp))
            except Exception as err:  # a broken case is a finding, not the end
                outcome, detail = "crash", f"{type(err).__name__}: {str(err).strip().splitlines()[-1:]}"
            seconds = time.perf_counter() - start
        counts[outcome] = counts.get(outcome, 0) + 1
        detail = detail.replace("|", "\\|").replace(tmp, "<tmp>")
        rows.append(f"| {item} | {case} | **{outcome}** | {detail} | {seconds:.0f} |")
        print(f"{outcome:16s} {case}", file=sys.stderr)
    print("# Fault list re-run\n")
    print("Made by `.venv/bin/python scripts/fault_list.py > docs/faults.md`: every case runs the real "
          "`posbench` command on a tiny CPU model. Each case also has a regression test in "
          "`tests/integration/test_fault_list.py`.\n")
    print("| kind | case | outcome | what the user gets | s |\n|---|---|---|---|---:|")
    print("\n".join(rows))
    print("\n" + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) + f" ({len(rows)} cases).")


if __name__ == "__main__":
    main()
