"""The composed config of every command and of ``train`` under its presets is what it was when the
trainer's and the evaluator's defaults were written in YAML (``tests/data/composed_configs.json``).

Their defaults now live once, in the settings dataclasses (posbench/train/settings.py,
posbench/evaluation/settings.py, posbench/bench/settings.py, posbench/viz/settings.py), and reach
Hydra through its ConfigStore; every key, its value, its type (``30`` stays an int) and the order
of the keys must be what the YAML gave. One deliberate change was recorded since: viz's settings
come first in its composed config (they are composed before viz.yaml's own keys), and its
``decay.bases`` read as the floats they are validated into. Later additions, recorded with
``--write``: ``eval.figures`` (true) in train and eval; ``eval.extension_scope`` (all; null in eval, the
run's own); ``kind`` (null) in train; in eval, the eval section composed from the settings (null,
``eval_overrides``) in their field order, each probe's section after ``probes`` (the values unchanged);
``model.mixer`` (attention), ``model.mixer_options`` (null), ``trainer.state_passing`` (off) and
``trainer.state_noise`` (1.0).

    python tests/unit/config/test_composed_configs.py --write   # record the expectation again (after a deliberate change)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

EXPECTED = Path(__file__).resolve().parent / "data" / "composed_configs.json"
COMMANDS = ["train", "eval", "bench", "viz", "plot", "prepare"]
TRAIN_OVERRIDES = [
    ["experiment=cpu_quick"], ["experiment=cpu_x4"], ["task=flipflop"], ["task=copy"], ["task=assoc_recall"],
    ["method=alibi", "model=tiny", "data=local"], ["eval.probes=[copy,passkey]", "eval.extension=all"],
]


def cases() -> dict[str, list[str]]:
    """Case name -> (command, overrides) as a list: every command bare, train under its presets."""
    from posbench.config import config_names

    out = {command: [command] for command in COMMANDS}
    sets = TRAIN_OVERRIDES + [[f"{group}={name}"] for group in ("trainer", "eval") for name in config_names(group)]
    for overrides in sets:
        out["train " + " ".join(overrides)] = ["train", *overrides]
    return out


def composed(command: str, overrides: list[str]) -> str:
    """The composed config as JSON text, keys in order (so a reordered or retyped key shows)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import posbench.evaluation.probes  # noqa: F401  (the probes' eval.<name> sections, as the CLI registers them)
    from posbench.config import config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose(config_name=command, overrides=overrides)
    return json.dumps(OmegaConf.to_container(cfg, resolve=True), indent=1)


@pytest.mark.parametrize("case", list(cases()))
def test_composed_config_is_unchanged(case, monkeypatch):
    monkeypatch.delenv("POSBENCH_CACHE", raising=False)  # data.cache_dir's default, as recorded
    command, *overrides = cases()[case]
    expected = json.loads(EXPECTED.read_text())
    assert case in expected, f"no recorded expectation for {case!r}; record it with --write"
    assert composed(command, overrides) == expected[case]


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    EXPECTED.write_text(json.dumps({case: composed(cmd, ov) for case, (cmd, *ov) in cases().items()}, indent=1) + "\n")
