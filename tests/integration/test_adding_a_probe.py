"""Adding a probe touches its module, its config and its tests, nothing else (docs/adding-a-probe.md):
a probe defined here and registered through the public registry is run by ``eval.probes`` at the
end of training and by ``posbench eval``, its entries are merged, summarised for the tracker and
drawn by its figure hook, and its settings are the section ``eval.<name>`` of the eval config
(``eval.<name>.<key>=`` on the command line of ``posbench train`` and ``posbench eval``), with no
other edit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest
import torch
from helpers import QUICK_TRAIN, compose_config

from posbench.core.errors import PosbenchError
from posbench.evaluation.loss import per_position_loss
from posbench.evaluation.probes import (
    PROBES,
    Probe,
    ProbeRun,
    configure_probes,
    list_probes,
    probe_settings,
    probe_summaries,
    register_probe,
    unregister_probe,
)
from posbench.model.extension import evaluation_order, extended
from posbench.report.figures import new_figure, save

NAME = "test_mean_loss"


@dataclass
class MeanLossSettings:
    """The throwaway probe's settings (``eval.test_mean_loss.*``)."""

    length: int = 48
    """Tokens per window."""
    num_windows: int = 3
    """Held-out windows scored."""

    def validate(self) -> None:
        if not self.num_windows >= 1:
            raise PosbenchError(f"eval.{NAME}.num_windows must be at least 1, got {self.num_windows}")


class MeanLoss(Probe):
    """A throwaway probe: the mean loss of the first windows of the validation text."""

    name = NAME
    settings = MeanLossSettings
    results_key = NAME
    report = __name__  # this module's run_figures draws its figure

    def check(self, settings: MeanLossSettings, train_context: int) -> None:
        if settings.length < train_context:
            raise PosbenchError(f"eval.{NAME}.length must be at least the training context {train_context}")

    def run(self, model: torch.nn.Module, data: Any, settings: MeanLossSettings, run: ProbeRun) -> list[dict[str, Any]]:
        n, length = settings.num_windows, settings.length
        windows = torch.from_numpy(np.asarray(data.tokens("validation")[: n * length], dtype=np.int64)).view(n, length)
        entries = []
        for extension in evaluation_order(run.extensions):
            with extended(model, extension, run.train_context, length, run.extension_factor, run.extension_settings):
                losses = per_position_loss(model, windows, run.batch_size, run.device, autocast_dtype=run.autocast_dtype)
            entries.append({"probe": NAME, "split": "validation", "extension": extension, "num_windows": n,
                            "length": length, "mean_loss": float(losses.mean())})
        run.log(f"{NAME}: {entries[0]['mean_loss']:.3f}")
        return entries

    def summary(self, entries: Sequence[dict[str, Any]]) -> dict[str, float]:
        return {f"{NAME}/{e['extension']}": e["mean_loss"] for e in entries if "variant" not in e}


def run_figures(results: dict[str, Any] | None, out_dir: Path, formats: Sequence[str], title: str = "") -> list[Path]:
    """The probe's figure hook: one bar per entry of the run."""
    entries = (results or {}).get(NAME) or []
    if not entries:
        return []
    fig = new_figure()
    ax = fig.add_subplot()
    ax.bar([e["extension"] for e in entries], [e["mean_loss"] for e in entries])
    ax.set_title(f"{title}{NAME}")
    return save(fig, out_dir, NAME, formats)


@pytest.fixture
def registered():
    register_probe(MeanLoss)
    try:
        yield PROBES[NAME]
    finally:
        unregister_probe(NAME)
    assert NAME not in list_probes()
    assert NAME not in compose_config("train", []).eval  # its section leaves the eval config with it


def test_a_registered_probe_is_listed_and_refused_names_list_it(registered) -> None:
    from posbench.config.settings import from_section
    from posbench.evaluation.settings import EvalConfig

    assert list_probes()[-1] == NAME and {"copy", "passkey"} <= set(list_probes())
    evaluation = from_section(EvalConfig, "eval", {"probes": [NAME]})
    configure_probes(evaluation, 32)
    assert probe_settings(evaluation, NAME) == MeanLossSettings()  # no eval.test_mean_loss field: the defaults
    with pytest.raises(PosbenchError, match=f"unknown eval.probes entry 'nope'; choose from copy, passkey, {NAME}$"):
        configure_probes(from_section(EvalConfig, "eval", {"probes": ["nope"]}), 32)
    with pytest.raises(PosbenchError, match="at least the training context 64"):
        configure_probes(from_section(EvalConfig, "eval", {"probes": [NAME]}), 64)  # the probe's own check


def test_a_registered_probe_s_settings_are_a_section_of_the_eval_config(registered) -> None:
    """``eval.<name>.<key>=`` composes, is validated with the eval section and reaches the probe;
    ``posbench eval`` composes the section null (the run's own), with no line of configs/eval.yaml."""
    from posbench.evaluation.settings import eval_settings
    from posbench.runs.spec import build_spec

    spec = build_spec(compose_config("train", [*QUICK_TRAIN, f"eval.probes=[{NAME}]", f"eval.{NAME}.num_windows=2"]))
    assert probe_settings(spec.eval, NAME) == MeanLossSettings(num_windows=2)
    again = compose_config("eval", ["run=x", f"eval.{NAME}.length=64"]).eval[NAME]
    assert dict(again) == {"length": 64, "num_windows": None}
    with pytest.raises(PosbenchError, match=f"eval.{NAME}.num_windows must be at least 1, got 0"):
        eval_settings({NAME: {"num_windows": 0}})
    with pytest.raises(PosbenchError, match=f"unknown option\\(s\\) eval.{NAME}.depth"):
        eval_settings({NAME: {"depth": 1}})


@pytest.mark.slow
def test_a_registered_probe_runs_in_training_and_posbench_eval(registered, tmp_path) -> None:
    from posbench.commands.eval import evaluate_saved_run
    from posbench.runs.results import read_results
    from posbench.train.trainer import train

    run_dir = tmp_path / "run"
    lines: list[str] = []
    train(compose_config("train", [*QUICK_TRAIN, f"eval.probes=[{NAME}]", "eval.figures=true",
                                   f"eval.{NAME}.num_windows=2"]), run_dir, log=lines.append)
    results = read_results(run_dir)
    (entry,) = results[NAME]
    assert entry["extension"] == "none" and entry["num_windows"] == 2 and np.isfinite(entry["mean_loss"])
    assert any(line.startswith(f"{NAME}: ") for line in lines)
    assert probe_summaries(results) == {f"{NAME}/none": entry["mean_loss"]}
    assert (run_dir / "figures" / f"{NAME}.png").is_file()  # the figure hook, in the run's own figures
    # posbench eval: the same measurement replaces the run's entry; an extension adds its own.
    evaluate_saved_run(compose_config("eval", [f"run={run_dir}", "probes_only=true", f"eval.probes=[{NAME}]",
                                                "eval.extension=[none,window]"]), log=lambda _: None)
    again = read_results(run_dir)[NAME]
    assert [e["extension"] for e in again] == ["none", "window"]
    assert again[0]["mean_loss"] == entry["mean_loss"] and again[0]["checkpoint_step"] == 6
    assert again[0]["num_windows"] == 2  # null in posbench eval: the run's own setting
    # eval.<name>.<key>= in posbench eval: a measurement at other settings, beside the run's own.
    evaluate_saved_run(compose_config("eval", [f"run={run_dir}", "probes_only=true", f"eval.probes=[{NAME}]",
                                                f"eval.{NAME}.length=64"]), log=lambda _: None)
    assert 64 in [e["length"] for e in read_results(run_dir)[NAME]]
