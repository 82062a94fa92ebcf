"""Every shipped config file composes, and composes into a valid run spec."""

from __future__ import annotations

import pytest
from helpers import compose_config, slow_beyond
from omegaconf import OmegaConf

from posbench.config import config_dir, config_names
from posbench.methods import list_methods, method_class, method_options
from posbench.runs.spec import build_spec
from posbench.tasks.base import task_class

PRIMARY = ["train", "prepare", "eval", "plot", "bench", "viz", "runs", "export"]
TRAIN_GROUPS = ["method", "recipe", "model", "data", "trainer", "eval", "logger", "experiment", "task"]


def test_every_yaml_file_is_covered_by_these_tests():
    shipped = {p.relative_to(config_dir()).as_posix() for p in config_dir().rglob("*.yaml")}
    covered = {f"{name}.yaml" for name in PRIMARY}
    covered |= {f"{g}/{n}.yaml" for g in TRAIN_GROUPS for n in config_names(g)}
    covered |= {f"hydra/launcher/{n}.yaml" for n in config_names("hydra/launcher")}
    covered |= {f"hydra/sweeper/{n}.yaml" for n in config_names("hydra/sweeper")}  # tests/integration/test_layout_sweeper.py
    assert shipped == covered


@pytest.mark.parametrize("name", PRIMARY)
def test_primary_configs_compose(name):
    cfg = compose_config(name, [])
    assert OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize("name", PRIMARY)
def test_every_composed_key_is_known_to_its_command(name):
    """viz's settings, composed from its settings class, were refused as unknown keys by the
    command's own check, so `posbench viz` failed on every call."""
    from posbench.config import check_top_level_keys

    check_top_level_keys(compose_config(name, []), name)


# Every option of every group; a method's YAML is also checked against its class by
# test_method_configs_match_the_methods_options, so the fast lane composes one sequence and one grid method.
@pytest.mark.parametrize("group, option", slow_beyond(
    [(g, n) for g in TRAIN_GROUPS for n in config_names(g)],
    fast={(g, n) for g in TRAIN_GROUPS for n in config_names(g) if g != "method"} | {("method", "rope"), ("method", "axial_rope")}))
def test_every_group_option_composes_into_a_valid_spec(group, option):
    overrides = [f"{group}={option}"]
    if group == "data" and option == "local":
        overrides.append("data.path=some/dir")  # local data needs a path; existence is checked later
    if group == "method" and "sequence" not in method_class(option).layouts:
        overrides.append("task=life")  # a grid method runs on a grid task
    if group == "task" and task_class(option).layout == "grid":
        overrides.append("method=axial_rope")
    cfg = compose_config("train", overrides)
    spec = build_spec(cfg)
    assert spec.method in list_methods(spec.model.layout)


def test_method_configs_match_the_methods_options():
    assert sorted(config_names("method")) == sorted(list_methods(None))
    for name in list_methods(None):
        values = OmegaConf.to_container(OmegaConf.load(config_dir() / "method" / f"{name}.yaml"))
        assert values.pop("name") == name
        assert values == method_options(name), name


def test_experiment_presets_set_what_they_promise():
    seed = compose_config("train", ["experiment=seed003"])
    assert (seed.model.d_model, seed.model.n_layers, seed.model.n_heads) == (384, 6, 6)
    assert seed.trainer.context == 256 and seed.data.source == "hub" and seed.eval.lengths == [512, 1024, 2048]
    quick = compose_config("train", ["experiment=cpu_quick"])
    assert quick.data.source == "sample" and quick.trainer.device == "cpu" and quick.logger.name == "none"
    # the packaged sample needs no path, so the preset runs from any directory
    from posbench.data import DataConfig
    from posbench.data.sources import resolve_source

    spec = resolve_source(DataConfig.from_dict(quick.data))
    assert [p.name for p in spec.train_files + spec.valid_files] == ["train.txt.gz", "valid.txt.gz"]


@pytest.mark.parametrize("launcher", ["basic", "joblib", "submitit_local", "slurm"])
def test_launchers_compose(launcher):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    target = cfg.hydra.launcher._target_
    assert launcher.split("_")[0] in target.lower() or (launcher == "slurm" and "Slurm" in target)
    if launcher == "slurm":
        assert cfg.hydra.launcher.gpus_per_node == 1


@pytest.mark.parametrize("group, option, cls_path, own", [
    ("model", "small", "posbench.model.transformer.ModelConfig", ()),  # the dataclass defaults are the small flavour
    *(("data", n, "posbench.data.DataConfig", ("source",)) for n in config_names("data")),
])
def test_group_defaults_live_once(group, option, cls_path, own, monkeypatch):
    """A group's default file and its dataclass agree on every field the file sets (only the
    option's own choice, e.g. a data source, differs), and the file sets no unknown field."""
    import importlib
    from dataclasses import fields

    module, name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    monkeypatch.delenv("POSBENCH_CACHE", raising=False)  # the files' cache_dir default, unresolved by env
    values = OmegaConf.to_container(OmegaConf.load(config_dir() / group / f"{option}.yaml"), resolve=True)
    from dataclasses import asdict, is_dataclass

    from posbench.config.settings import from_section
    from posbench.core.errors import PosbenchError

    try:
        default = from_section(cls, group, {})  # validated: nested settings become their dataclass
    except PosbenchError:  # a default that needs the file's own choice (a data source's path)
        default = cls()
    if group == "eval":  # each probe's section becomes its settings dataclass in the probe registry
        from posbench.evaluation.probes import configure_probes

        configure_probes(default, 256)
    defaults = {f.name: getattr(default, f.name) for f in fields(cls)}
    defaults = {k: asdict(v) if is_dataclass(v) else v for k, v in defaults.items()}
    assert set(values) <= set(defaults), f"{group}/{option}.yaml sets unknown fields"
    differ = {k: (v, defaults[k]) for k, v in values.items() if k not in own and v != defaults[k]}
    assert not differ, f"{group}/{option}.yaml and {name} disagree: {differ}"


@pytest.mark.parametrize("group", ["trainer", "eval"])
def test_settings_group_defaults_are_written_once(group):
    """A settings group's defaults are its dataclass's: its YAML options set no key the
    dataclass already defaults to the same value, and ``train`` composes exactly the dataclass's
    defaults (every field, in field order)."""
    from dataclasses import asdict

    from posbench.config import settings_groups
    from posbench.evaluation.settings import eval_defaults

    cls = settings_groups()[group]
    defaults = eval_defaults() if group == "eval" else asdict(cls())  # eval: with a section per probe
    for option in config_names(group):
        own = OmegaConf.to_container(OmegaConf.load(config_dir() / group / f"{option}.yaml"))
        own.pop("defaults", None)
        assert not {k: v for k, v in own.items() if defaults.get(k) == v}, f"{group}/{option}.yaml repeats defaults"
    section = OmegaConf.to_container(compose_config("train", [])[group])
    assert list(section) == list(defaults) and section == defaults


@pytest.mark.parametrize("command", ["bench", "viz"])
def test_command_defaults_live_once(command):
    """The settings a command falls back to without its YAML are the YAML's."""
    from posbench.bench.checks import settings_from_config as bench_settings
    from posbench.viz.checks import settings_from_config as viz_settings

    if command == "bench":
        from_yaml, _ = bench_settings(compose_config("bench", []))
        values = {"model": OmegaConf.to_container(compose_config("bench", []).model)}
        from_code, _ = bench_settings(values)
    else:
        from_yaml = viz_settings(compose_config("viz", []))
        from_code = viz_settings(OmegaConf.create({}))
        from posbench.viz.settings import VizSettings

        assert from_code == VizSettings()
    assert from_yaml == from_code


# The model every task run was composed with when each task had its own preset (task_<name>.yaml).
TASK_MODEL = {"vocab_size": 8192, "d_model": 64, "n_layers": 2, "n_heads": 4, "mlp_hidden": None, "mlp_multiple_of": 64,
              "tie_embeddings": False, "norm_eps": 1e-05, "init_std": 0.02, "attention": "auto", "attention_window": None,
              "mixer": "attention", "mixer_options": None}


@pytest.mark.parametrize("task", config_names("task"))
def test_tasks_share_one_model_preset_and_compose_as_before(task):
    """Every task=<name> composes the shared task preset (configs/model/task.yaml), recorded under
    its old flavour name, and a model chosen on the command line still replaces it whole."""
    cfg = compose_config("train", [f"task={task}"])
    assert OmegaConf.to_container(cfg.model, resolve=True) == {"flavour": f"task_{task}", **TASK_MODEL}
    assert OmegaConf.to_container(compose_config("train", [f"task={task}", "model=tiny"]).model,
                                  resolve=True)["flavour"] == "tiny"
    assert not (config_dir() / "model" / f"task_{task}.yaml").exists()
