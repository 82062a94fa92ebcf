"""The ``posbench`` command: one Hydra app per subcommand.

    posbench <command> [hydra overrides] [-m] [--cfg job] [--help]

The table below is the single place subcommands are declared. Each subcommand composes its own
primary config (``configs/<command>.yaml``), so Hydra's own parsing handles overrides,
multirun, ``--cfg`` and ``--help``; nothing parses arguments in front of it except the name of
the subcommand.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import warnings
from typing import Any, Callable

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from posbench.config import check_command_line, check_top_level_keys, config_dir
from posbench.core.errors import PosbenchError
from posbench.core.io import check_output_dir

logger = logging.getLogger("posbench")
CONFIG_PATH = str(config_dir())


def _train(cfg: DictConfig) -> Any:
    from pathlib import Path

    from posbench.runs.runlog import HydraRecord
    from posbench.train.trainer import train

    return train(cfg, Path(HydraConfig.get().runtime.output_dir), hydra_record=HydraRecord.from_hydra())


def _eval(cfg: DictConfig) -> Any:
    from posbench.commands.eval import evaluate_saved_run

    return evaluate_saved_run(cfg)


def _plot(cfg: DictConfig) -> Any:
    from posbench.report.plot import plot_runs

    runs = cfg.runs if not isinstance(cfg.runs, str) else [cfg.runs]
    if not runs:
        raise PosbenchError("posbench plot needs runs=<run or sweep dir, or glob>[,...]")
    check_output_dir(cfg.out, "out", writable=True)
    return plot_runs([str(r) for r in runs], cfg.out, formats=tuple(cfg.formats), log=logger.info,
                     variant=cfg.get("variant"), methods=cfg.get("methods"))


def _prepare(cfg: DictConfig) -> Any:
    import time

    from posbench.data import prepare_data
    from posbench.runs.spec import data_config

    start = time.perf_counter()
    prepared = prepare_data(data_config(cfg.data).check_path_is_read(), log=logger.info)
    counts = ", ".join(f"{split} {prepared.num_tokens(split):,} tokens"
                       for split in ("train", "validation", "test") if prepared.has_split(split))
    logger.info("prepared %s in %.1f s: %s (vocab %d)", prepared.dir, time.perf_counter() - start, counts,
                prepared.vocab_size)
    return prepared


def _export(cfg: DictConfig) -> Any:
    from posbench.commands.export import export_run

    return export_run(cfg)


def _runs(cfg: DictConfig) -> Any:
    from posbench.runs.inventory import list_runs

    listing = list_runs(cfg.dir)
    print(listing.text(), end="")
    return listing


def _viz(cfg: DictConfig) -> Any:
    from posbench.viz.command import run_viz

    if cfg.get("out"):
        check_output_dir(cfg.out, "out", writable=True)
    return run_viz(cfg, log=logger.info)


def _bench(cfg: DictConfig) -> Any:
    from posbench.bench.command import run_bench

    if cfg.get("out"):
        check_output_dir(cfg.out, "out", writable=True)
    return run_bench(cfg)


# name -> (task, one-line description). The single subcommand table.
COMMANDS: dict[str, tuple[Callable[[DictConfig], Any], str]] = {
    "prepare": (_prepare, "tokenize a dataset into the token cache (train does this on demand)"),
    "train": (_train, "train one method (or a sweep with -m), then evaluate and plot it"),
    "eval": (_eval, "re-evaluate a finished run: run=<dir> [eval.lengths=[512,1024]] [data.path=...]"),
    "plot": (_plot, "comparison figures and tables from saved runs: runs=<dirs/globs> out=<dir>"),
    "bench": (_bench, "measure training/eval speed per method (tokens/s, MFU, memory)"),
    "export": (_export, "a finished rope or nope run as a transformers model: run=<dir> out=<new folder>"),
    "runs": (_runs, "the runs and sweeps under a folder and their state: posbench runs <folder>"),
    "viz": (_viz, "pictures of a method (method=<name>, no training) or a trained run/sweep (run=<dir>)"),
}
EVALUATES = ("train", "eval")
"""The commands whose config holds the eval section (with a section per registered probe)."""


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {desc}" for name, (_, desc) in COMMANDS.items())
    return (
        "usage: posbench <command> [key=value ...] [-m] [--cfg job] [--help]\n\n"
        f"commands:\n{rows}\n\n"
        "Every command is a Hydra app: `posbench <command> --help` lists its config groups,\n"
        "`posbench train --cfg job` prints the composed config, `-m` runs a sweep.\n"
        "Examples:\n"
        "  posbench train method=rope\n"
        "  posbench train -m method=nope,learned,sinusoidal,rope,alibi,t5,relative seed=0,1,2\n"
        "  posbench eval run=outputs/default/<date>/<time>_rope-s0 eval.lengths=[512,1024,2048]\n"
        "  posbench plot runs=outputs/default/sweeps/<date>_<time> out=figures\n"
        "  posbench runs outputs   |   posbench train method=alibi --dry-run\n"
        "  posbench viz method=sinusoidal   |   posbench viz run=<run or sweep dir>\n"
        "Shell completion: eval \"$(posbench --shell-completion install=bash)\"\n"
    )


def _is_multirun() -> bool:
    try:
        return HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:
        return False


def _debug(cfg: DictConfig) -> bool:
    return cfg.get("debug", False) is True or os.environ.get("POSBENCH_DEBUG", "") not in ("", "0")


def _task(command: str) -> Callable[[DictConfig], Any]:
    run, _ = COMMANDS[command]

    def task(cfg: DictConfig) -> Any:
        from posbench.train.trainer import TrainingInterrupted

        try:
            if command != "train":  # train checks in build_spec, so that the run's status.json records it
                check_top_level_keys(cfg, command)
            return run(cfg)
        except TrainingInterrupted as err:
            print(f"posbench {command}: {err}", file=sys.stderr)
            raise SystemExit(err.exit_code) from None
        except PosbenchError as err:
            if _debug(cfg):
                raise
            if _is_multirun():
                # One bad job must not end the sweep; its status.json records the failure.
                logger.error("job failed: %s", err)
                return None
            print(f"posbench {command}: error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        except Exception:
            if _is_multirun() and not _debug(cfg):
                logger.exception("job failed (the sweep goes on)")
                return None
            raise

    task.__name__ = f"posbench_{command}"
    return task


DRY_RUN = "--dry-run"


def _dry_run(args: list[str]) -> None:
    """``posbench train ... --dry-run``: the config composed and checked as Hydra's app would
    (no app is started, so nothing is written), then :func:`posbench.train.dry_run.dry_run`."""
    args = hydra_arguments("train", args)
    if "-m" in args or "--multirun" in args:
        print(f"posbench train: error: {DRY_RUN} shows one run; leave out -m (and give one value per key)",
              file=sys.stderr)
        raise SystemExit(2)
    from posbench.train.dry_run import dry_run

    try:
        _, (cfg,) = check_command_line("train", args)
        dry_run(cfg)
    except PosbenchError as err:
        if "debug=true" in args or os.environ.get("POSBENCH_DEBUG", "") not in ("", "0"):
            raise
        print(f"posbench train: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def hydra_arguments(command: str, args: list[str]) -> list[str]:
    """The arguments of ``posbench <command>`` as Hydra reads them: ``train``'s ``--dry-run`` taken
    out (the CLI handles it), ``runs``'s bare folder given as ``dir=<folder>`` (Hydra reads only
    key=value)."""
    if command == "train":
        return [a for a in args if a != DRY_RUN]
    if command == "runs":
        return [f"dir={a}" if "=" not in a and not a.startswith("-") else a for a in args]
    return args


def _checked_command_line(command: str, args: list[str]) -> list[str]:
    """The overrides checked before Hydra composes them (:func:`posbench.config.check_command_line`):
    a bad one is one line and exit 2, with nothing written; the arguments to hand to Hydra."""
    try:
        args, configs = check_command_line(command, args)
        for cfg in configs:
            _check_data_path(command, cfg)
    except PosbenchError as err:
        if "debug=true" in args or os.environ.get("POSBENCH_DEBUG", "") not in ("", "0"):
            raise
        print(f"posbench {command}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return args


def _check_data_path(command: str, cfg: DictConfig) -> None:
    """The text files a new run would read exist (checked again where they are read; here so
    that a wrong data.path leaves no run directory)."""
    if command not in ("train", "prepare") or cfg.get("task") is not None or "data" not in cfg:
        return
    from posbench.data.sources import resolve_source
    from posbench.runs.spec import data_config

    data = data_config(cfg.data).check_path_is_read()
    if data.source == "local" and data.path_list():
        resolve_source(data)


def shell_completion(argv: list[str]) -> None:
    """``posbench --shell-completion install=bash`` and the queries the installed script makes.

    Hydra completes one app; posbench has one app per subcommand, so the query is routed to the
    subcommand named on the line being completed (or the subcommand names are offered).
    """
    mode = argv[1] if len(argv) > 1 else ""
    if not mode.startswith("query="):
        sys.argv = ["posbench", *argv]  # Hydra names the completed program after argv[0]
        hydra.main(config_path=CONFIG_PATH, config_name="train", version_base="1.3")(lambda cfg: None)()
        return
    words = os.environ.get("COMP_LINE", "").split()
    if len(words) < 2 or (len(words) == 2 and not os.environ.get("COMP_LINE", "").endswith(" ")):
        prefix = words[1] if len(words) == 2 else ""
        print(" ".join(name for name in COMMANDS if name.startswith(prefix)))
        return
    command = words[1]
    if command not in COMMANDS:
        return
    os.environ["COMP_LINE"] = os.environ["COMP_LINE"].replace(command, "", 1)
    sys.argv = ["posbench", *argv]
    hydra.main(config_path=CONFIG_PATH, config_name=command, version_base="1.3")(lambda cfg: None)()


def run_script(name: str, main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> None:
    """Run a script the docs tell users to run (``scripts/results_table.py`` ...) under the CLI's
    contract: a :class:`PosbenchError` is one line ``<name>: error: ...`` and exit 2 (a traceback
    with ``POSBENCH_DEBUG=1``); otherwise the exit status is ``main``'s."""
    try:
        code = main(list(sys.argv[1:] if argv is None else argv))
    except PosbenchError as err:
        if os.environ.get("POSBENCH_DEBUG", "") not in ("", "0"):
            raise
        print(f"{name}: error: {err}", file=sys.stderr)
        code = 2
    raise SystemExit(code or 0)


def _register_launcher() -> None:
    """Make posbench's joblib launcher and sweeper known to Hydra. Hydra finds plugins by walking
    the ``hydra_plugins`` folders on disk, which misses them in an editable install; registering
    the classes by hand works for every kind of install."""
    from hydra.core.plugins import Plugins

    plugins = Plugins.instance()  # first: its scan re-executes Hydra's core plugin modules (BasicSweeper)
    from hydra_plugins.posbench_launcher.isolated_joblib_launcher import IsolatedJoblibLauncher
    from hydra_plugins.posbench_launcher.layout_sweeper import LayoutSweeper

    plugins.register(IsolatedJoblibLauncher)
    plugins.register(LayoutSweeper)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-sc", "--shell-completion"):
        return shell_completion(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    command = argv[0]
    if command not in COMMANDS:
        print(f"posbench: error: unknown command {command!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        raise SystemExit(2)
    _register_launcher()
    if command in EVALUATES:  # their eval config holds a section per probe: the probes register them
        importlib.import_module("posbench.evaluation.probes")
    from omegaconf import OmegaConf

    from posbench.config import groups_help

    OmegaConf.register_new_resolver("posbench_groups", groups_help, replace=True)  # for --help templates
    from posbench.runtime.hardware import tune_cpu_allocator

    tune_cpu_allocator()
    # configs/hydra/launcher/joblib.yaml shadows the joblib plugin's schema on purpose (posbench's
    # launcher, same keys); Hydra would warn about that on every joblib sweep.
    warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/joblib' is validated against ConfigStore schema")
    if command == "train" and DRY_RUN in argv[1:]:
        return _dry_run(argv[1:])
    args = _checked_command_line(command, hydra_arguments(command, argv[1:]))
    # Hydra reads sys.argv; hide the subcommand from it and name the app after it.
    sys.argv = [f"posbench {command}", *args]
    app = hydra.main(config_path=CONFIG_PATH, config_name=command, version_base="1.3")(_task(command))
    app()
    from posbench.commands.sweep import empty_globs_of_last_sweep, failed_jobs_of_last_sweep

    empty = empty_globs_of_last_sweep()
    if empty:
        print(f"posbench {command}: error: {', '.join(empty)} matches no option, so the sweep ran no job; "
              f"posbench {command} --help lists the options of each group", file=sys.stderr)
        raise SystemExit(2)
    failures = failed_jobs_of_last_sweep()
    if failures:
        print(f"posbench {command}: {failures} sweep job(s) failed; see the sweep's summary.md", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
