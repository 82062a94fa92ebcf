"""Where the shipped Hydra configs live, and loading single config files from Python."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from posbench.core.errors import PosbenchError


def config_dir() -> Path:
    """Absolute path of the config tree (the top-level ``configs/``, shipped as posbench.configs).
    Every composition starts here, so this also gives Hydra the defaults of the settings groups
    (:func:`register_settings`), which their ``default.yaml`` composes."""
    import posbench.configs

    register_settings()
    return Path(next(iter(posbench.configs.__path__))).resolve()


def settings_groups() -> dict[str, type]:
    """The config sections whose settings are a dataclass, which holds their defaults and field
    documentation: name -> class. Hydra's ConfigStore holds each class's defaults as
    ``<name>_settings``, which the YAML composes (``configs/<group>/default.yaml``:
    ``- /<group>_settings@_here_``), and docs/configuration.md's table of each is generated from
    the class (``scripts/config_reference.py``, between ``<!-- config-reference: <name> -->``
    marks). A new section's dataclass is added here, its module in layer 1 or below
    (docs/architecture.md, "Settings")."""
    from posbench.bench.settings import BenchSettings
    from posbench.evaluation.settings import EvalConfig
    from posbench.train.settings import TrainerConfig
    from posbench.viz.settings import VizSettings

    return {"trainer": TrainerConfig, "eval": EvalConfig, "bench": BenchSettings, "viz": VizSettings}


def register_settings() -> None:
    """Store each settings group's defaults in Hydra's ConfigStore as ``<group>_settings``: a plain
    (untyped) node, so posbench's own checks (``from_section``) still report a bad value. The eval
    group's holds a section per registered probe (the probes registered when a config is composed:
    the commands that evaluate import :mod:`posbench.evaluation.probes` first), and
    ``eval_overrides`` is the same with every leaf null (``posbench eval``: null = the run's own)."""
    from posbench.evaluation.settings import PROBE_SETTINGS

    probes = tuple(PROBE_SETTINGS.items())
    if _STORED.get("probes") != probes:  # stored again whenever a probe was registered or removed since
        _store_settings()
        _STORED["probes"] = probes


_STORED: dict[str, Any] = {}
"""The registered probes the ConfigStore's nodes were last stored with."""


def _store_settings() -> None:
    """The nodes of :func:`register_settings`."""
    from dataclasses import asdict

    from hydra.core.config_store import ConfigStore

    from posbench.evaluation.settings import eval_defaults

    store = ConfigStore.instance()
    for group, cls in settings_groups().items():
        store.store(name=f"{group}_settings", node=eval_defaults() if group == "eval" else asdict(cls()))
    store.store(name="eval_overrides", node=eval_defaults(None))


def config_names(group: str) -> list[str]:
    """Names of the option files in a config group, e.g. ``config_names("model")``."""
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


# The order methods are listed and plotted in: these first, any other method after them,
# alphabetically, so a new method needs no edit here.
METHOD_LISTING_ORDER = ("nope", "learned", "sinusoidal", "rope", "alibi", "t5", "relative")


def listing_order(methods: Iterable[str]) -> list[str]:
    """``methods`` in listing order (:data:`METHOD_LISTING_ORDER` first, the rest alphabetically)."""
    names = set(methods)
    return [m for m in METHOD_LISTING_ORDER if m in names] + sorted(names - set(METHOD_LISTING_ORDER))


def method_option_names(name: str) -> set[str] | None:
    """The options ``configs/method/<name>.yaml`` sets (None: no such file)."""
    import yaml

    path = config_dir() / "method" / f"{name}.yaml"
    if not path.is_file():
        return None
    options = yaml.safe_load(path.read_text()) or {}
    return set(options) - {"name"}


def load_group_option(group: str, name: str) -> dict[str, Any]:
    """One config file of a group as a plain dict, e.g. ``("model", "tiny")``."""
    from omegaconf import OmegaConf

    path = config_dir() / group / f"{name}.yaml"
    if not path.is_file():
        raise PosbenchError(
            f"unknown {group} {name!r}; choose one of: {', '.join(config_names(group))}"
        )
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)  # type: ignore[return-value]


def check_top_level_keys(cfg: Any, command: str) -> None:
    """Refuse top-level keys that ``configs/<command>.yaml`` neither sets nor composes from a
    group or from the command's settings class (``+optimizer=adam`` would otherwise be ignored
    silently), and non-boolean values of its boolean keys (``debug=maybe``). Derived from the file
    and the class, so a key added there is known."""
    from omegaconf import OmegaConf

    primary = OmegaConf.to_container(OmegaConf.load(config_dir() / f"{command}.yaml"))
    known = (set(primary) | set(composed_groups(command))) - {"defaults", "hydra"}
    known = {k for k in known if not k.startswith("override ")}
    settings = settings_groups().get(command)  # a command whose own keys are a settings class (bench, viz)
    if settings is not None:
        from dataclasses import fields

        known |= {f.name for f in fields(settings)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise PosbenchError(
            f"unknown key(s) {', '.join(unknown)} for posbench {command}; known: {', '.join(sorted(known))}"
        )
    for key, default in primary.items():
        value = cfg.get(key)
        if isinstance(default, bool) and not isinstance(value, bool):
            raise PosbenchError(f"{key} must be true or false, got {value!r}")


def composed_groups(command: str) -> list[str]:
    """The config groups ``configs/<command>.yaml`` composes (its defaults list; Hydra's own and
    ``override`` entries aside)."""
    from omegaconf import OmegaConf

    primary = OmegaConf.to_container(OmegaConf.load(config_dir() / f"{command}.yaml"))
    groups = [next(iter(entry)) for entry in primary.get("defaults", []) if isinstance(entry, dict)]
    return [g for g in groups if not g.startswith("override ")]


def groups_help(command: str) -> str:
    """``group: option, ...`` per group ``posbench <command>`` reads: its ``--help`` lists these
    (Hydra's default help lists every group of the config tree, most of them train's)."""
    return "\n".join(f"{g}: {', '.join(config_names(g))}" for g in composed_groups(command)) or "(none)"



# ----------------------------------------------------------------------------- the command line
# Hydra's own reports of a bad override are a block of text with exit 1 and, for a key of
# another option or group, a hint (``+method.base=500``) that fails again. posbench composes the
# config itself first, as Hydra will, and refuses a bad override in one line with a suggestion.


def check_command_line(command: str, argv: list[str]) -> tuple[list[str], list[Any]]:
    """Check the overrides of ``posbench <command> <argv>`` before Hydra reads them.

    Returns the arguments to hand to Hydra and the configs its jobs will compose (one in a single
    run; in a sweep one per option of each swept group, the other sweeps at their first value).
    In a sweep, a plain key of a swept group (``-m task=copy,assoc_recall task.num_symbols=8``)
    is handed to Hydra as ``++task.num_symbols=8`` once every job is known to have the key: Hydra
    composes the sweep's own config without the swept groups, where the key is missing. Raises
    :class:`PosbenchError` naming the fix for an override no job could use.
    """
    # Private Hydra API (hydra-core is capped below 1.4 in pyproject.toml): the very parser Hydra's
    # own main reads the command line with, so the checks here see the arguments as Hydra will.
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion or args.config_path \
            or args.config_name or args.config_dir or args.experimental_rerun:
        return argv, []
    texts = [_parsable(text) for text in args.overrides]
    overrides = [_parse(text) for text in texts]
    if not args.multirun:
        for override in overrides:
            _check_override(command, override)
        return _rebuilt(argv, args.overrides, texts), [_compose(command, texts)]
    plain = [o for o in overrides if not o.is_sweep_override()]
    sweeps = [o for o in overrides if o.is_sweep_override()]
    for override in overrides:
        _check_override(command, override)
    params = _config_params(command, overrides)  # what the config's own sweeper sets per job
    sweeps += [o for o in params if o.is_sweep_override()]
    fixed = [o.input_line for o in params if not o.is_sweep_override()]
    first = {id(o): _sweep_values(o)[:1] for o in sweeps}
    keyed = {o.key_or_group.split(".")[0] for o in plain if _is_plain_key(o)}
    jobs = []  # every option of a swept group that a plain key sets; the first of the others
    for swept in [o for o in sweeps if o.key_or_group in keyed] or [None]:
        for value in _sweep_values(swept) if swept is not None else [None]:
            chosen = [_element(o, value if o is swept else first[id(o)][0]) for o in sweeps if first[id(o)]]
            jobs.append(_compose(command, [o.input_line for o in plain] + fixed + chosen))
    sweep_cfg = _compose(command, [o.input_line for o in plain if not _missing(command, o)])
    handed = []
    for text, override in zip(texts, overrides):
        if _is_plain_key(override) and _path_missing(sweep_cfg, override.key_or_group):
            text = "++" + text  # every job has the key (checked in _compose); the sweep's config has not
        handed.append(text)
    return _rebuilt(argv, args.overrides, handed), jobs


def _config_params(command: str, overrides: list[Any]) -> list[Any]:
    """What a config sets in ``hydra.sweeper.params`` (``experiment=grid``: seed, task, method)
    and the command line does not replace, as overrides: the jobs they make need the same checks
    as a command-line sweep's (``task.learnt_at_c=0`` with ``experiment=grid``)."""
    import warnings

    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    choices = [o.input_line for o in overrides if not _is_plain_key(o) and not o.is_sweep_override()]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Hydra's notes on launcher schemas: Hydra prints them itself
        try:
            cfg = compose(config_name=command, overrides=choices, return_hydra_config=True)
        except HydraException:
            return []  # _compose reports it
    params = cfg.hydra.get("sweeper", {}).get("params") or {}
    given = {o.key_or_group for o in overrides}
    return [_parse(f"{key}={value}") for key, value in params.items() if key not in given]


def _rebuilt(argv: list[str], given: list[str], handed: list[str]) -> list[str]:
    """``argv`` with its overrides replaced by ``handed`` (flags such as -m, --cfg kept)."""
    replace = dict(zip(given, handed))
    return [replace.get(arg, arg) for arg in argv]


def _parsable(text: str) -> str:
    """``key=a=b`` (a value holding ``=``, as in ``variant=num_sequences=64``) as Hydra's
    grammar takes it, quoted: ``key='a=b'``. Anything else unchanged."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    key, sep, value = text.partition("=")
    if not sep or "=" not in value or value[:1] in "'\"[{":
        return text
    parser = OverridesParser.create()
    try:
        parser.parse_override(text)
        return text
    except HydraException:
        pass
    quoted = f"{key}='{value}'"
    try:
        parser.parse_override(quoted)
    except HydraException:
        return text
    return quoted


def _parse(text: str) -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_override(text)
    except HydraException as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else "not key=value"
        raise PosbenchError(
            f"Error parsing override '{text}' ({reason}); write key=value with no spaces around '=', "
            "and quote a value holding spaces or brackets: key='a value'"
        ) from None


def _is_plain_key(override: Any) -> bool:
    """``a.b=value``: neither a group choice nor ``+``/``++``/``~``, nor Hydra's own."""
    return (not override.is_add() and not override.is_force_add() and not override.is_delete()
            and not override.key_or_group.split(".")[0].startswith("hydra")
            and not (config_dir() / override.key_or_group).is_dir())


def _sweep_values(override: Any) -> list[str]:
    """The values a sweep override runs, as strings (a glob against its group's options)."""
    from hydra.core.override_parser.types import Glob

    if override is None or not override.is_sweep_override():
        return []
    if isinstance(override.value(), Glob):
        return list(override.value().filter(config_names(override.key_or_group)))
    return list(override.sweep_string_iterator())


def _element(override: Any, value: str) -> str:
    return f"{override.get_key_element()}={value}"


def _check_override(command: str, override: Any) -> None:
    """A group choice names an option of a group the command reads (with a close match)."""
    group = override.key_or_group
    if override.is_delete() or override.is_add() or group.startswith("hydra") or not (config_dir() / group).is_dir():
        return
    if group not in composed_groups(command):
        raise PosbenchError(_group_not_read(command, group, override.input_line))
    values = _sweep_values(override) if override.is_sweep_override() else [override.value()]
    for value in values:
        if isinstance(value, str) and value not in config_names(group):
            raise PosbenchError(_unknown(group, value, config_names(group), f"{group}="))


def _group_not_read(command: str, group: str, text: str) -> str:
    if command == "eval" and group == "task":
        return (f"{text}: posbench eval takes the run's own task (from its config.yaml), and a text run has "
                f"none; drop {group}=, or train a task run: posbench train task=<name>")
    reads = ", ".join(composed_groups(command)) or "no config group"
    return f"posbench {command} does not read {group}= (it reads {reads}); drop {text}"


def _unknown(what: str, name: str, known: list[str], prefix: str) -> str:
    """``unknown <what> 'name'; did you mean <prefix><close>? choose one of: ...``"""
    return f"unknown {what} {name!r}; {_close(name, known, prefix)}choose one of: {', '.join(known)}"


def _close(name: str, known: list[str], prefix: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, known, n=1)
    return f"did you mean {prefix}{close[0]}? " if close else ""


def _missing(command: str, override: Any) -> bool:
    """A plain key under a group that a sweep chooses, absent from the sweep's own config."""
    return _is_plain_key(override) and override.key_or_group.split(".")[0] in composed_groups(command)


def _path_missing(cfg: Any, key: str) -> bool:
    return _missing_part(cfg, key) is not None


def _missing_part(cfg: Any, key: str) -> tuple[Any, list[str], str] | None:
    """(node, path to it, first missing name) when ``key`` (dotted) is absent from ``cfg``."""
    from omegaconf import DictConfig

    node, path = cfg, []
    for part in key.split("."):
        if not isinstance(node, DictConfig):
            return None  # a list index or a value: Hydra reports what is wrong with it
        if part not in node:
            return node, path, part
        node, path = node.get(part), [*path, part]
    return None


def _check_keys(command: str, cfg: Any, overrides: list[Any]) -> None:
    """Every plain ``a.b=value`` names a key the composed ``cfg`` has (else Hydra's
    "Could not override" with a ``+`` hint that fails again)."""
    for override in overrides:
        if not _is_plain_key(override):
            continue
        found = _missing_part(cfg, override.key_or_group)
        if found is not None:
            raise PosbenchError(_missing_key_message(command, cfg, override, *found))


def _missing_key_message(command: str, cfg: Any, override: Any, node: Any, path: list[str], name: str) -> str:
    key, top = override.key_or_group, override.key_or_group.split(".")[0]
    if not path and top in composed_groups(command):  # a group left at null (task, viz's method)
        having = _options_with(top, key.split(".")[1:])
        return (f"{key} sets an option of {top}=, but no {top} is chosen; add {top}=<name>"
                + (f" (the options with {key}: {', '.join(having)})" if having else ""))
    if not path and (config_dir() / top).is_dir():
        return _group_not_read(command, top, override.input_line)
    known = [str(k) for k in node]
    if not path:
        return f"posbench {command} has no key {name!r}; {_close(name, known, '')}its keys: {', '.join(known)}"
    where = ".".join(path)
    if len(path) == 1 and path[0] in composed_groups(command) and cfg[path[0]].get("name"):
        choice = cfg[path[0]].name
        having = [o for o in _options_with(path[0], key.split(".")[1:]) if o != choice]
        also = f"; {key} is an option of {path[0]}={','.join(having)}" if having else ""
        return (f"{path[0]}={choice} has no option {name!r}; {_close(name, known, where + '.')}"
                f"its options: {', '.join(known)}{also}")
    return f"{where} has no key {name!r}; {_close(name, known, where + '.')}its keys: {', '.join(known)}"


def _options_with(group: str, parts: list[str]) -> list[str]:
    """The options of ``group`` whose own file sets ``<group>.<parts...>`` (or ``<parts...>`` in
    a package-group file)."""
    from omegaconf import OmegaConf

    having = []
    for option in config_names(group):
        node: Any = OmegaConf.load(config_dir() / group / f"{option}.yaml")
        node = node.get(group, node) if group in node else node
        for part in parts:
            node = node.get(part) if hasattr(node, "get") and part in node else None
            if node is None:
                break
        else:
            having.append(option)
    return having


def _compose(command: str, texts: list[str]) -> Any:
    """``configs/<command>.yaml`` composed with ``texts`` as Hydra will; one line for a failure."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    overrides = [_parse(text) for text in texts]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        try:
            return compose(config_name=command, overrides=texts)
        except HydraException as err:
            failure = err
        try:  # which key was missing: compose without the plain keys, then look for each
            cfg = compose(config_name=command, overrides=[o.input_line for o in overrides if not _is_plain_key(o)])
        except HydraException as err:
            raise PosbenchError(_hydra_message(err)) from None
    _check_keys(command, cfg, overrides)
    raise PosbenchError(_hydra_message(failure))


def _hydra_message(err: Exception) -> str:
    text = " ".join(str(err).split())
    if text.startswith("Ambiguous value for argument"):
        arg = text.split("'")[1]
        return f"{arg} lists several values, which only a sweep runs; add -m to sweep them, or quote the value"
    return text.split(". ")[0] if len(text) > 300 else text
