"""Adding a kind of run touches its two halves and its tests, nothing else (docs/architecture.md,
"Plug-in points"): a kind registered with :func:`posbench.runs.kinds.register_run_kind`, with a
training half (a Workload) and a report half (a ReportKind), is chosen by ``kind=<name>``, trains
through the real trainer, is recorded in config.yaml, checkpoints and results.json, is what
``posbench eval`` reads back, and is compared by ``posbench plot`` with its own tables. Runs of
the built-in kinds record theirs; files from before the key are read by the old rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import pytest
import yaml
from helpers import QUICK_TRAIN, compose_config

from posbench.core.errors import PosbenchError
from posbench.core.io import write_text_atomic
from posbench.report.kinds import Compared, ReportKind
from posbench.runs.kinds import RUN_KINDS, config_kind, register_run_kind, results_kind, unregister_run_kind
from posbench.runs.run_record import RunRecord
from posbench.train.workload import TextWorkload

NAME = "test_marked"


class MarkedWorkload(TextWorkload):
    """The training half: a text run whose results.json data record carries a mark."""

    def record(self) -> dict[str, Any]:
        return {**super().record(), "mark": NAME}

    def done_line(self, results: Any, context: int) -> str:
        return f"{NAME}: {len(results['eval'])} entries"


class MarkedReport(ReportKind):
    """The report half: one table of its runs."""

    def compare(self, runs: Sequence[RunRecord], out: Path, formats: Sequence[str], log: Callable[[str], Any],
                problems: Sequence[tuple[str, str]]) -> Compared:
        rows = [f"| {r.name} | {r.results['data']['mark']} |" for r in runs]
        write_text_atomic(out / f"{NAME}.md", "\n".join(["| run | mark |", "|---|---|", *rows]) + "\n")
        return Compared([out / f"{NAME}.md"], list(runs), {}, None, f"{len(runs)} {NAME} runs")


@pytest.fixture
def registered():
    kind = register_run_kind(NAME, workload=MarkedWorkload, report=MarkedReport())
    try:
        yield kind
    finally:
        unregister_run_kind(NAME)
    assert NAME not in RUN_KINDS and {"text", "task"} <= set(RUN_KINDS)


def test_the_kind_comes_from_the_config_and_an_unknown_one_is_refused(registered) -> None:
    from posbench.runs.spec import build_spec

    assert config_kind({"kind": NAME}) == NAME and config_kind({"task": {"name": "copy"}}) == "task"
    assert config_kind({"kind": None}) == config_kind({}) == "text"  # configs from before the key
    assert build_spec(compose_config("train", [*QUICK_TRAIN, f"kind={NAME}"])).kind == NAME
    with pytest.raises(PosbenchError, match=f"unknown kind 'nope'; choose one of: text, task, {NAME}"):
        build_spec(compose_config("train", [*QUICK_TRAIN, "kind=nope"]))
    with pytest.raises(PosbenchError, match="kind=task needs a task"):
        build_spec(compose_config("train", [*QUICK_TRAIN, "kind=task"]))


def test_a_built_in_run_records_its_kind_and_an_old_record_is_read_by_the_old_rule(trained_run) -> None:
    from posbench.runs.results import read_results

    run = trained_run()
    results = read_results(run)
    assert results["kind"] == "text" and list(results)[:2] == ["schema_version", "kind"]
    assert yaml.safe_load((run / "config.yaml").read_text())["kind"] == "text"
    assert results_kind({k: v for k, v in results.items() if k != "kind"}) == "text"
    assert results_kind({"task": {"name": "copy"}}) == "task"


@pytest.mark.slow
def test_a_registered_kind_trains_is_recorded_read_back_and_compared(registered, tmp_path) -> None:
    from posbench.report.plot import plot_runs
    from posbench.runs.load import load_run
    from posbench.runs.results import read_results
    from posbench.train.trainer import train
    from posbench.train.workload import saved_workload

    run_dir = tmp_path / "run"
    lines: list[str] = []
    train(compose_config("train", [*QUICK_TRAIN, f"kind={NAME}", "trainer.checkpoint_every_steps=3"]), run_dir,
          log=lines.append)
    results = read_results(run_dir)
    assert results["kind"] == NAME and results["data"]["mark"] == NAME  # its training half wrote the record
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["kind"] == NAME
    assert any(line.endswith(f"{NAME}: 1 entries") for line in lines)
    saved = load_run(run_dir)  # the checkpoint's config
    assert saved.config.kind == NAME and saved_workload(saved.config) is MarkedWorkload
    out = tmp_path / "comparison"
    written = plot_runs([str(run_dir)], out, log=lambda _: None)
    assert str(out / f"{NAME}.md") in written["files"] and f"| {results['run_name']} | {NAME} |" in (
        out / f"{NAME}.md").read_text()
    assert not (out / "bands.md").exists()  # the text kind's report half did not see it
