"""Fault cases of issue 21 around the run directory: an output folder that is a file (item 6),
a read-only cache (7), a full disk (9), a start refused by the lock (10) and a config typo that
must leave no run directory (12). Tiny models on the CPU; the CLI runs in a subprocess."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import QUICK_TRAIN

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}


def posbench_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posbench.cli", *args], capture_output=True, text=True,
                          env=ENV, timeout=600, cwd=cwd)


def one_error_line(proc: subprocess.CompletedProcess, command: str) -> str:
    """The single error line of a refused command (and no traceback)."""
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"posbench {command}: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    return errors[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- item 6


@pytest.mark.parametrize("command, args, key", [
    ("train", [*QUICK_TRAIN, "hydra.run.dir={file}"], "hydra.run.dir"),
    ("train", ["-m", *QUICK_TRAIN, "hydra.sweep.dir={file}"], "hydra.sweep.dir"),
    ("train", [*QUICK_TRAIN, "hydra.run.dir={file}/run"], "hydra.run.dir"),
    ("viz", ["method=rope", "model=tiny", "out={file}"], "out"),
    ("plot", ["runs=[{folder}]", "out={file}"], "out"),
])
def test_an_output_folder_naming_an_existing_file_is_one_line(tmp_path, command, args, key):
    file = tmp_path / "a_file"
    file.write_text("keep me\n")
    args = [a.format(file=file, folder=tmp_path) for a in args]
    line = one_error_line(posbench_cli(command, *args, cwd=tmp_path), command)
    assert f"{key}={file}" in line and "file, not a folder" in line and f"choose another {key}" in line
    assert file.read_text() == "keep me\n"


# ----------------------------------------------------------------------------- items 10 and 12


def test_a_start_refused_by_the_lock_leaves_nothing_in_the_run(tmp_path):
    """Hydra used to write .hydra/ (and append to train.log) before posbench took the lock."""
    from posbench.train import RunLock

    run_dir = tmp_path / "run"
    done = posbench_cli("train", *QUICK_TRAIN, "method=alibi", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    # The process that runs still gets Hydra's record and its log file.
    assert "- method=alibi" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    hydra_yaml = (run_dir / ".hydra" / "hydra.yaml").read_text()
    assert "output_subdir: .hydra" in hydra_yaml and "job:\n    name: train" in hydra_yaml
    assert "name: alibi" in (run_dir / ".hydra" / "config.yaml").read_text()
    assert "training alibi-s0" in (run_dir / "train.log").read_text()
    before = snapshot(run_dir)
    with RunLock(run_dir):  # another process holds the run
        refused = posbench_cli("train", *QUICK_TRAIN, "method=rope", f"hydra.run.dir={run_dir}", cwd=tmp_path)
        held = snapshot(run_dir)
    assert "is in use by another posbench process" in one_error_line(refused, "train")
    assert held.keys() - before.keys() <= {".posbench.pid"}  # the holder's own PID file
    assert {k: v for k, v in held.items() if k != ".posbench.pid"} == before


def test_a_config_typo_leaves_no_run_directory(tmp_path):
    line = one_error_line(posbench_cli("train", *QUICK_TRAIN, "trainer.lr=abc", cwd=tmp_path), "train")
    assert "trainer.lr must be a number, got 'abc'" in line
    assert not (tmp_path / "outputs").exists()
    deep = tmp_path / "new" / "deeper" / "run"
    one_error_line(posbench_cli("train", *QUICK_TRAIN, "+optimizer=adam", f"hydra.run.dir={deep}"), "train")
    assert not (tmp_path / "new").exists()


def test_a_config_typo_in_an_existing_folder_is_recorded_there(tmp_path):
    """A folder that was there before the start is not removed: the failure is recorded in it."""
    one_error_line(posbench_cli("train", *QUICK_TRAIN, "trainer.lr=abc", f"hydra.run.dir={tmp_path}"), "train")
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "failed" and "trainer.lr must be a number" in status["error"]


# ----------------------------------------------------------------------------- item 7


@pytest.mark.parametrize("error", [errno.EROFS, errno.EACCES])
def test_a_read_only_empty_cache_is_one_line(tmp_path, monkeypatch, error):
    """Root ignores file modes, so the read-only folder is simulated where the OS would refuse:
    at every folder or file created inside the cache."""
    from posbench.data import DataConfig, prepare_data
    from posbench.errors import PosbenchError

    cache = tmp_path / "cache"
    cache.mkdir()
    real_mkdir, real_open = os.mkdir, os.open

    def refuse(path):
        if str(path).startswith(str(cache)):
            raise OSError(error, os.strerror(error), str(path))

    monkeypatch.setattr(os, "mkdir", lambda path, *a, **k: refuse(path) or real_mkdir(path, *a, **k))
    monkeypatch.setattr(os, "open", lambda path, *a, **k: refuse(path) or real_open(path, *a, **k))
    with pytest.raises(PosbenchError) as refused:
        prepare_data(DataConfig(source="synthetic", cache_dir=str(cache)), log=lambda _: None)
    message = str(refused.value)
    assert "\n" not in message and f"cannot write the token cache in {cache}" in message
    assert "point POSBENCH_CACHE or data.cache_dir at a writable folder" in message
    assert os.listdir(cache) == []


def test_a_cache_path_naming_a_file_is_one_line(tmp_path):
    from posbench.data import DataConfig, prepare_data
    from posbench.errors import PosbenchError

    (tmp_path / "file").write_text("")
    for cache in (tmp_path / "file", tmp_path / "file" / "cache"):
        with pytest.raises(PosbenchError, match="which is a file, not a folder|names an existing file"):
            prepare_data(DataConfig(source="synthetic", cache_dir=str(cache)), log=lambda _: None)
