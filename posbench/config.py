"""Where the shipped Hydra configs live, and loading single config files from Python."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posbench.errors import PosbenchError


def config_dir() -> Path:
    """Absolute path of the config tree (the top-level ``configs/``, shipped as posbench.configs)."""
    import posbench.configs

    return Path(next(iter(posbench.configs.__path__))).resolve()


def config_names(group: str) -> list[str]:
    """Names of the option files in a config group, e.g. ``config_names("model")``."""
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


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
    group (``+optimizer=adam`` would otherwise be ignored silently), and non-boolean values
    of its boolean keys (``debug=maybe``). Derived from the file, so a key added there is known."""
    from omegaconf import OmegaConf

    primary = OmegaConf.to_container(OmegaConf.load(config_dir() / f"{command}.yaml"))
    known = (set(primary) | set(composed_groups(command))) - {"defaults", "hydra"}
    known = {k for k in known if not k.startswith("override ")}
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

