"""Every config key the docs' config reference lists can be set as documented (a fault it guards
against: ``model.attention_window=64`` was refused by Hydra because no model preset carried the key).

The keys are read from the reference itself (README.md and docs/*.md): each ``**`group`**``
heading followed by a ``| key | default | meaning |`` table, and the method table's options. A
key added to the reference is therefore checked without touching this file.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
from helpers import compose_config, slow_beyond
from omegaconf import OmegaConf

from posbench.config import config_names

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
GROUP_HEADING = re.compile(r"^\*\*`([a-z_]+)`\*\*")
NAME = re.compile(r"`([A-Za-z_][A-Za-z0-9_.]*)`")
OPTION = re.compile(r"`([A-Za-z_][A-Za-z0-9_.]*)`(?= \(|, `| and `| as )")  # `base` (10000.0), `base`, `interleaved` as rope
DEFAULT = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)` \((\[[^]]*\]|[^):;,= ]+)")  # `base` (10000.0): ..., `pattern` ([rope, nope])


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def documented_keys() -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str, str]]]:
    """([(group, key)] of the key tables, [(method, option path)] of the method tables, [(method,
    option, default as written)] of the options the method tables give a default)."""
    group_keys, method_keys, method_defaults = [], [], []
    for doc in DOCS:
        group, header = None, None
        for line in doc.read_text().splitlines():
            if match := GROUP_HEADING.match(line):
                group, header = match.group(1), None
            elif line.startswith("**"):  # another heading (a command's own keys, `hydra/launcher`)
                group, header = None, None
            elif not line.startswith("|"):
                header = None if line.strip() == "" else header
                group = group if line.strip() == "" or header is None else None
            elif header is None:
                header = cells(line)[0]
            elif set(line) <= set("|-: ") or group is None:
                continue
            elif group == "method" and header == "method":
                first, options = cells(line)[:2]
                methods = NAME.findall(first) or ["rope"]  # "any": top-level keys, any method
                method_keys += [(m, o if "." in o else f"method.{o}") for m in methods for o in OPTION.findall(options)]
                method_defaults += [(m, o, d) for m in methods if NAME.findall(first) for o, d in DEFAULT.findall(options)]
            elif header == "key":
                group_keys += [(group, key) for key in NAME.findall(cells(line)[0])]
    return sorted(set(group_keys)), sorted(set(method_keys)), sorted(set(method_defaults))


GROUP_KEYS, METHOD_KEYS, METHOD_DEFAULTS = documented_keys()


def test_the_reference_is_found():
    groups = {g for g, _ in GROUP_KEYS}
    assert {"model", "data", "trainer", "eval"} <= groups, groups
    assert ("model", "attention_window") in GROUP_KEYS and ("rope", "method.base") in METHOD_KEYS
    assert len(GROUP_KEYS) > 40 and len(METHOD_KEYS) > 20


@functools.cache
def composed(*overrides: str):
    return compose_config("train", list(overrides))


def override_text(value) -> str:
    """A composed value as a command-line override value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if OmegaConf.is_config(value):
        return "[" + ",".join(map(str, value)) + "]"  # the reference's config lists hold scalars
    return str(value)


def set_to_itself(base: tuple[str, ...], keys: list[str]) -> None:
    """Hydra accepts ``key=<its composed value>`` for every key at once on top of ``base``
    (a key no preset carries fails with "Key '...' is not in struct"), and the values stay."""
    current = {key: OmegaConf.select(composed(*base), key) for key in keys}
    cfg = compose_config("train", [*base, *(f"{key}={override_text(value)}" for key, value in current.items())])
    assert {key: OmegaConf.select(cfg, key) for key in keys} == current


@pytest.mark.parametrize("group, preset", [(g, p) for g in sorted({g for g, _ in GROUP_KEYS})
                                           for p in (config_names(g) if g in ("model", "data") else [None])])
def test_every_documented_key_is_settable_in_every_preset_of_its_group(group, preset):
    set_to_itself((f"{group}={preset}",) if preset else (), [f"{group}.{k}" for g, k in GROUP_KEYS if g == group])


# The fast lane sets the options of a sequence method, a score-term method and a grid method.
@pytest.mark.parametrize("method", slow_beyond(sorted({m for m, _ in METHOD_KEYS}), fast={"rope", "kerple", "relative_2d"}))
def test_every_documented_method_option_is_settable(method):
    set_to_itself((f"method={method}",), [k for m, k in METHOD_KEYS if m == method])


def test_every_method_option_is_documented_with_its_config_default():
    """configs/method/<name>.yaml owns each option and its default; the method tables (docs/configuration.md,
    docs/grid.md) restate the default beside the meaning, so a changed default that the table does
    not follow (or an option the tables leave out) fails here."""
    assert len(METHOD_DEFAULTS) > 40
    for name in config_names("method"):
        options = set(OmegaConf.load(ROOT / "configs" / "method" / f"{name}.yaml")) - {"name"}
        assert options <= {key.removeprefix("method.") for m, key in METHOD_KEYS if m == name}, name
    for name, option, written in METHOD_DEFAULTS:
        if (ROOT / "configs" / "method" / f"{name}.yaml").is_file() and option != "positions.randomize_max":
            config = OmegaConf.load(ROOT / "configs" / "method" / f"{name}.yaml")
            expected = OmegaConf.create(f"v: {written}").v  # as YAML reads it
            actual = config[option]
            assert (OmegaConf.to_container(actual) if OmegaConf.is_config(actual) else actual) == (
                OmegaConf.to_container(expected) if OmegaConf.is_config(expected) else expected), (name, option)


@pytest.mark.parametrize("preset", config_names("model"))
def test_the_window_baseline_is_settable_as_the_readme_writes_it(preset):
    from posbench.runs.spec import build_spec

    spec = build_spec(compose_config("train", [f"model={preset}", "model.attention_window=64"]))
    assert spec.model.attention_window == 64


@pytest.mark.slow
def test_bench_help_lists_only_the_groups_bench_reads():
    """Hydra's default --help lists every group of configs/ (data, trainer, method, ...), which
    bench never reads; bench composes only ``model``."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "posbench.commands.cli", "bench", "--help"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0].split()
    assert groups == ["model:", *[f"{name}," for name in config_names("model")[:-1]], config_names("model")[-1]]
    config = OmegaConf.create(proc.stdout.split("Override anything in the config (foo.bar=value)")[1]
                              .split("Use --hydra-help")[0])
    from dataclasses import fields

    from posbench.bench.settings import BenchSettings

    bench_yaml = OmegaConf.load(ROOT / "configs" / "bench.yaml")  # its own keys and BenchSettings' defaults
    assert set(config) == (set(bench_yaml) - {"defaults", "hydra"}) | {f.name for f in fields(BenchSettings)} | {"model"}
