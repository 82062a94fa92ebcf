"""The checks of ``posbench viz``'s settings that need the extension menu and the figure formats,
run before any figure: every user error of the command is one line from here."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from posbench.config.settings import from_section
from posbench.core.errors import PosbenchError
from posbench.model.extension import EXTENSIONS
from posbench.report.figures import check_formats
from posbench.viz.settings import VizSettings

KEYS = ("context", "span", "formats", "attention", "decay")
"""The keys of the viz config that are settings (the others: run, out, method, model, device, wandb, ...)."""


def settings_from_config(cfg: DictConfig | dict[str, Any]) -> VizSettings:
    """The ``posbench viz`` config -> validated settings; a key it lacks keeps the
    :class:`VizSettings` default (the defaults configs/viz.yaml composes)."""
    values = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    settings = from_section(VizSettings, "", {key: values[key] for key in KEYS if key in values})
    settings.formats = check_formats(settings.formats)
    for rule in settings.decay.rules:
        if rule not in EXTENSIONS:
            raise PosbenchError(f"unknown decay rule {rule!r}; choose from the extensions "
                                f"{', '.join(EXTENSIONS)} (decay.rules=[...])")
    return settings


__all__ = ["KEYS", "settings_from_config"]
