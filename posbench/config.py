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
