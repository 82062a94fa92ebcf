"""Fault cases around the run directory: an output folder that is a file, a read-only cache, a
full disk, a start refused by the lock and a config typo that must leave no run directory. Tiny
models on the CPU; the CLI runs in a subprocess."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import QUICK_TRAIN, posbench_cli, snapshot


def one_error_line(proc: subprocess.CompletedProcess, command: str) -> str:
    """The single error line of a refused command (and no traceback)."""
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"posbench {command}: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    return errors[0]


# ---------------------------------------------------- an output folder that is a file


@pytest.mark.parametrize("command, args, key", [
    ("train", [*QUICK_TRAIN, "hydra.run.dir={file}"], "hydra.run.dir"),
    ("train", ["-m", *QUICK_TRAIN, "hydra.sweep.dir={file}"], "hydra.sweep.dir"),
    ("train", [*QUICK_TRAIN, "hydra.run.dir={file}/run"], "hydra.run.dir"),
    ("viz", ["method=rope", "model=tiny", "out={file}"], "out"),
    ("plot", ["runs=[{folder}]", "out={file}"], "out"),
])
@pytest.mark.slow
def test_an_output_folder_naming_an_existing_file_is_one_line(tmp_path, command, args, key):
    file = tmp_path / "a_file"
    file.write_text("keep me\n")
    args = [a.format(file=file, folder=tmp_path) for a in args]
    line = one_error_line(posbench_cli(command, *args, cwd=tmp_path, check=False), command)
    assert f"{key}={file}" in line and "file, not a folder" in line and f"choose another {key}" in line
    assert file.read_text() == "keep me\n"


# --------------------------------------------------------------- a read-only output folder

READ_ONLY = """
import errno, os, sys
read_only = os.environ["READ_ONLY_ROOT"]
real_access, real_mkdir = os.access, os.mkdir
def access(path, mode, *args, **kwargs):  # what a read-only mount answers, even to root
    if str(path).startswith(read_only) and mode & os.W_OK:
        return False
    return real_access(path, mode, *args, **kwargs)
def mkdir(path, *args, **kwargs):
    if str(path).startswith(read_only):
        raise OSError(errno.EROFS, "Read-only file system", str(path))
    return real_mkdir(path, *args, **kwargs)
os.access, os.mkdir = access, mkdir
from posbench.commands.cli import main
main(sys.argv[1:])
"""


@pytest.mark.slow
@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir"])
def test_a_read_only_output_folder_is_one_line(tmp_path, key):
    """A read-only disk under hydra.run.dir ended in Hydra's OSError traceback, exit 1 (the tests
    run as root, for whom permissions do not stop a write, so the read-only mount is emulated)."""
    import sys

    from helpers import ENV

    read_only = tmp_path / "read_only"
    read_only.mkdir()
    args = [*QUICK_TRAIN, f"{key}={read_only}/run"]
    proc = subprocess.run([sys.executable, "-c", READ_ONLY, "train", *(["-m"] if "sweep" in key else []), *args],
                          env={**ENV, "READ_ONLY_ROOT": str(read_only)}, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    line = one_error_line(proc, "train")
    assert f"{key}={read_only}/run cannot be written ({read_only} is the folder it would be made in)" in line
    assert f"choose another {key}" in line
    assert list(read_only.iterdir()) == []


def test_check_output_dir_refuses_a_folder_it_cannot_write(tmp_path, monkeypatch):
    import posbench.core.io
    from posbench.core.errors import PosbenchError
    from posbench.core.io import check_output_dir

    monkeypatch.setattr(posbench.core.io.os, "access", lambda path, mode: False)
    assert check_output_dir(tmp_path / "new", "out") == tmp_path / "new"  # a data cache may be read-only
    with pytest.raises(PosbenchError, match=r"out=.*/new cannot be written \(.* is the folder it would be made in\)"):
        check_output_dir(tmp_path / "new", "out", writable=True)


# -------------------------------------------------- a start refused by the lock, a config typo


@pytest.mark.slow
def test_a_start_refused_by_the_lock_leaves_nothing_in_the_run(tmp_path):
    """Hydra used to write .hydra/ (and append to train.log) before posbench took the lock."""
    from posbench.runs.rundir import RunLock

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
        refused = posbench_cli("train", *QUICK_TRAIN, "method=rope", f"hydra.run.dir={run_dir}", cwd=tmp_path,
                               check=False)
        held = snapshot(run_dir)
    assert "is in use by another posbench process" in one_error_line(refused, "train")
    assert held.keys() - before.keys() <= {".posbench.pid"}  # the holder's own PID file
    assert {k: v for k, v in held.items() if k != ".posbench.pid"} == before


@pytest.mark.slow
def test_a_config_typo_leaves_no_run_directory(tmp_path):
    line = one_error_line(posbench_cli("train", *QUICK_TRAIN, "trainer.lr=abc", cwd=tmp_path, check=False), "train")
    assert "trainer.lr must be a number, got 'abc'" in line
    assert not (tmp_path / "outputs").exists()
    deep = tmp_path / "new" / "deeper" / "run"
    one_error_line(posbench_cli("train", *QUICK_TRAIN, "+optimizer=adam", f"hydra.run.dir={deep}", check=False), "train")
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_a_config_typo_in_an_existing_folder_is_recorded_there(tmp_path):
    """A folder that was there before the start is not removed: the failure is recorded in it."""
    one_error_line(posbench_cli("train", *QUICK_TRAIN, "trainer.lr=abc", f"hydra.run.dir={tmp_path}", check=False), "train")
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "failed" and "trainer.lr must be a number" in status["error"]


# ------------------------------------------------------------------ a read-only cache


@pytest.mark.parametrize("error", [errno.EROFS, errno.EACCES])
def test_a_read_only_empty_cache_is_one_line(tmp_path, monkeypatch, error):
    """Root ignores file modes, so the read-only folder is simulated where the OS would refuse:
    at every folder or file created inside the cache."""
    from posbench.core.errors import PosbenchError
    from posbench.data import DataConfig, prepare_data

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
    from posbench.core.errors import PosbenchError
    from posbench.data import DataConfig, prepare_data

    (tmp_path / "file").write_text("")
    for cache in (tmp_path / "file", tmp_path / "file" / "cache"):
        with pytest.raises(PosbenchError, match="which is a file, not a folder|names an existing file"):
            prepare_data(DataConfig(source="synthetic", cache_dir=str(cache)), log=lambda _: None)


# ------------------------------------------------------------------------ a full disk


FULL_DISK_ERRORS = {
    "oserror": lambda path: OSError(errno.ENOSPC, "No space left on device", str(path)),
    # torch.save's zip writer on a full disk: a short write, in one of two wordings
    "unexpected pos": lambda path: RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 19328 vs 19222"),
    "file write failed": lambda path: RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter "
                                                   "failed writing file data/3: file write failed"),
}


@pytest.mark.parametrize("stays_full, error", [(False, "oserror"), (True, "oserror"), (False, "unexpected pos"),
                                               (False, "file write failed")])
def test_a_full_disk_during_training_fails_the_run_in_one_line_and_keeps_its_checkpoint(
        tmp_path, monkeypatch, stays_full, error):
    """The disk fills up while the second checkpoint is written (half of it is on disk). With
    ``stays_full`` no new file can be made afterwards either, so the failure must still reach
    status.json, which already exists. torch.save may report the full disk as a RuntimeError
    (``unexpected pos``), which gave a traceback."""
    import tempfile

    from helpers import compose_config

    import posbench.core.io
    import posbench.runs.checkpoint
    from posbench.core.errors import PosbenchError
    from posbench.runs.checkpoint import list_checkpoints, read_checkpoint
    from posbench.runs.runlog import HydraRecord
    from posbench.train.trainer import train

    real_save, real_mkstemp, saves = posbench.runs.checkpoint.torch.save, tempfile.mkstemp, []

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", kwargs.get("dir") or args[-1])

    def save(obj, path, *args, **kwargs):
        saves.append(path)
        if len(saves) < 2:
            return real_save(obj, path, *args, **kwargs)
        Path(path).write_bytes(b"PK\x03\x04 half a checkpoint")
        if stays_full:
            monkeypatch.setattr(posbench.core.io.tempfile, "mkstemp", full_disk)
        raise FULL_DISK_ERRORS[error](path)

    monkeypatch.setattr(posbench.runs.checkpoint.torch, "save", save)
    cfg = compose_config("train", [*QUICK_TRAIN, "method=rope", "trainer.checkpoint_every_steps=2"])
    # The CLI's Hydra record (.hydra/) is written on the way out too: on the full disk as well.
    record = HydraRecord(tmp_path, {"overrides.yaml": "- method=rope\n"}, multirun=False, created=[])
    with pytest.raises(PosbenchError) as failed:
        train(cfg, tmp_path, log=lambda _: None, hydra_record=record)
    monkeypatch.setattr(posbench.core.io.tempfile, "mkstemp", real_mkstemp)
    message = str(failed.value)
    assert "\n" not in message and message.startswith("no space left on the device")
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "failed" and "no space left on the device" in status["error"]
    (kept,) = list_checkpoints(tmp_path)
    assert kept.name == "step_00000002.pt" and read_checkpoint(kept)["step"] == 2
    assert not [p for p in tmp_path.rglob(".tmp-*")]  # the half-written file is gone


def test_a_full_disk_under_the_log_file_is_one_warning_line(tmp_path, monkeypatch, capsys):
    """logging prints a traceback for every record a handler fails to write."""
    import logging

    from posbench.runs.runlog import DeferredFileHandler

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(logging, "raiseExceptions", True)  # logging's default: report every failure
    handler = DeferredFileHandler(str(tmp_path / "train.log"))
    monkeypatch.setattr(handler, "_open", lambda: FullDisk())
    handler.write_kept()
    for i in range(3):
        handler.handle(logging.LogRecord("posbench", logging.INFO, __file__, 1, f"step {i}", None, None))
    handler.close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "Logging error" not in err
    assert err.startswith(f"posbench: warning: cannot write the log file {tmp_path / 'train.log'}")


def test_the_log_file_keeps_lines_until_the_run_is_held_and_never_writes_dropped_ones(tmp_path):
    import logging

    from posbench.runs.runlog import DeferredFileHandler

    def record(text):
        return logging.LogRecord("posbench", logging.INFO, __file__, 1, text, None, None)

    held = DeferredFileHandler(str(tmp_path / "held.log"))
    held.handle(record("before the lock"))
    assert not (tmp_path / "held.log").exists()
    held.write_kept()
    held.handle(record("after the lock"))
    held.close()
    assert (tmp_path / "held.log").read_text().splitlines() == ["before the lock", "after the lock"]
    refused = DeferredFileHandler(str(tmp_path / "refused.log"))
    refused.handle(record("refused"))
    refused.drop()
    refused.handle(record("still refused"))
    refused.close()
    assert not (tmp_path / "refused.log").exists()


@pytest.mark.slow
def test_a_config_error_next_to_a_run_another_process_holds_writes_nothing_there(tmp_path):
    from helpers import compose_config

    from posbench.core.errors import PosbenchError
    from posbench.runs.rundir import RunLock
    from posbench.runs.status import write_status
    from posbench.train.trainer import train

    write_status(tmp_path, "running", method="alibi", seed=0)
    before = snapshot(tmp_path)
    with RunLock(tmp_path):
        with pytest.raises(PosbenchError, match="trainer.lr must be a number"):
            train(compose_config("train", [*QUICK_TRAIN, "trainer.lr=abc"]), tmp_path, log=lambda _: None)
        after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k not in (".posbench.pid", ".posbench.lock")} == {
        k: v for k, v in before.items() if k != ".posbench.lock"}
