"""``hydra/launcher=joblib`` in posbench: parallel local jobs that survive one job being killed.

Hydra's joblib launcher runs jobs in one loky process pool. When the kernel's OOM killer (or a
``kill -9``) ends one worker, loky marks the whole pool broken: it kills the other running jobs
(their status.json stays "running"), never starts the pending ones, and the sweep ends in
``TerminatedWorkerError`` before the summary is written.

This launcher keeps joblib's ``n_jobs`` semantics but gives every job a process of its own,
started by one of ``n_jobs`` watcher threads. A job process that dies without reporting back is
recorded as failed in its run's status.json, with the signal that ended it, and the other jobs
go on; the sweep summary then lists it and ``posbench train`` exits 1.

``hydra/launcher=joblib`` selects it: ``configs/hydra/launcher/joblib.yaml`` shadows the joblib
plugin's entry of the same name (same keys, another ``_target_``). Hydra instantiates launchers
only from the ``hydra_plugins`` namespace, hence this module's place.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher
from omegaconf import OmegaConf, open_dict

log = logging.getLogger(__name__)


class IsolatedJoblibLauncher(JoblibLauncher):
    """``n_jobs`` jobs at a time, each in its own process; a killed job fails alone."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import cloudpickle
        from joblib import effective_n_jobs

        assert self.config is not None and self.task_function is not None and self.hydra_context is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        n_jobs = max(1, min(effective_n_jobs(int(self.joblib.get("n_jobs", -1))), len(job_overrides) or 1))
        log.info(f"launching {len(job_overrides)} jobs, {n_jobs} at a time, each in its own process; "
                 f"sweep output dir: {sweep_dir}")
        for idx, overrides in enumerate(job_overrides):
            log.info(f"\t#{initial_job_idx + idx} : {' '.join(filter_overrides(overrides))}")
        singleton_state = Singleton.get_state()

        def one_job(idx: int, overrides: Sequence[str]) -> JobReturn:
            payload = cloudpickle.dumps((idx, list(overrides), self.hydra_context, self.config,
                                         self.task_function, singleton_state))
            return _run_in_own_process(payload, list(overrides))

        with ThreadPoolExecutor(max_workers=n_jobs) as pool:
            futures = [pool.submit(one_job, initial_job_idx + i, o) for i, o in enumerate(job_overrides)]
            return [f.result() for f in futures]


def _run_in_own_process(payload: bytes, overrides: list[str]) -> JobReturn:
    """Start one job process and wait for it; a job that dies without a result is recorded."""
    import cloudpickle

    # spawn, not fork: the parent runs watcher threads, and forking a threaded process can
    # leave a lock held forever in the child.
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_job_process, args=(payload, send), daemon=False)
    process.start()
    send.close()  # only the child holds the sending end now: its death gives us EOFError
    job_dir, result = None, None
    try:
        while True:
            kind, value = receive.recv()
            if kind == "dir":
                job_dir = Path(value)
            else:
                result = value
    except EOFError:
        pass
    process.join()
    if result is not None:
        return cloudpickle.loads(result)
    return _record_dead_job(job_dir, overrides, process.exitcode)


def _job_process(payload: bytes, send: Any) -> None:
    """Body of a job process: what Hydra's joblib ``execute_job`` does, reporting the job's
    directory to the parent first so that a killed job can still be recorded there."""
    import cloudpickle

    idx, overrides, hydra_context, config, task_function, singleton_state = cloudpickle.loads(payload)
    setup_globals()
    Singleton.set_state(singleton_state)
    sweep_config = hydra_context.config_loader.load_sweep_config(config, overrides)
    with open_dict(sweep_config):
        sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{idx}"
        sweep_config.hydra.job.num = idx
    HydraConfig.instance().set_config(sweep_config)
    job_dir = Path(str(OmegaConf.select(sweep_config, "hydra.sweep.dir"))) / str(
        OmegaConf.select(sweep_config, "hydra.sweep.subdir"))
    send.send(("dir", str(job_dir)))
    result = run_job(hydra_context=hydra_context, config=sweep_config, task_function=task_function,
                     job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
    try:
        send.send(("result", cloudpickle.dumps(result)))
    except Exception as err:  # an unpicklable return value must not lose the job
        log.warning("job %d returned a value that cannot be sent back (%s)", idx, err)
        result.return_value = RuntimeError(f"unpicklable job result: {err}") if result.status == JobStatus.FAILED else None
        send.send(("result", cloudpickle.dumps(result)))
    send.close()


def _record_dead_job(job_dir: Path | None, overrides: list[str], exitcode: int | None) -> JobReturn:
    """Mark a job whose process died as failed (unless it recorded its own end) and return a
    JobReturn that lets the sweep go on."""
    from posbench.runs.status import read_status, write_status

    if exitcode is not None and exitcode < 0:
        how = f"killed by {signal.Signals(-exitcode).name}"
        hint = " (out of memory?)" if -exitcode == signal.SIGKILL else ""
    else:
        how, hint = f"exited with code {exitcode} without reporting", ""
    reason = (f"the job's process was {how}{hint}; rerun the sweep with the same overrides and "
              "hydra.sweep.dir=<this sweep> to continue it from its last checkpoint")
    where = job_dir if job_dir is not None else "(job directory unknown)"
    log.error("job %s %s: %s", " ".join(filter_overrides(overrides)), where, reason)
    if job_dir is not None:
        job_dir.mkdir(parents=True, exist_ok=True)
        status = read_status(job_dir) or {}
        # A trainer stopped by SIGTERM records "interrupted" itself; only a silent death (status
        # still "running", or none at all) is ours to record.
        if status.get("status") in (None, "running"):
            extra = {k: v for k, v in status.items() if k not in ("status", "error", "updated")}
            write_status(job_dir, "failed", error=reason, **extra)
    # COMPLETED with no value, as posbench's own failed jobs return: a FAILED JobReturn would make
    # Hydra's sweeper raise after the batch and skip the sweep summary.
    ret = JobReturn(overrides=overrides, working_dir=str(where), task_name="train")
    ret.status = JobStatus.COMPLETED
    ret.return_value = None
    return ret
