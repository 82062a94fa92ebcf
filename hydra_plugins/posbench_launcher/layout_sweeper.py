"""posbench's sweeper (``posbench train -m``): Hydra's basic sweeper, less the jobs whose position
method is not made for the model of the run.

``configs/method/`` holds the sequence methods (the language model's) and the grid methods (the
grid encoder's, docs/grid.md) side by side, so ``'method=glob(*)'`` keeps meaning "every method":
on text or a sequence task it sweeps the sequence methods, on a grid task (``task=life``) the grid
methods, and nope on both. A job whose method and model do not match would only fail at once
(``build_spec`` refuses it in one line); the sweeper leaves it out before launching and logs one
line naming what it left out. A sweep left with no job at all is one line and exit 2.

Every launcher (basic, joblib, submitit, slurm) receives the filtered jobs. The job numbers
(``hydra.job.num``, the run directories' prefix) count the jobs that run.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

# Private Hydra API (hydra-core is capped below 1.4 in pyproject.toml): the sweeper of Hydra's own
# -m, subclassed so that everything but the layout filter stays Hydra's behaviour.
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

log = logging.getLogger(__name__)


def job_layouts(cfg: Any) -> tuple[str, tuple[str, ...]] | None:
    """(the model's layout, the layouts the method is made for) of a composed job config, or None
    when the job names an unknown method or task (it then fails with its own one-line error)."""
    from posbench.methods import _REGISTRY
    from posbench.tasks.base import task_class

    method = _REGISTRY.get(str(cfg.method.get("name", "")))
    task_section = cfg.get("task")
    task = None if task_section is None else task_class(str(task_section.get("name", "")))
    if method is None or (task_section is not None and task is None):
        return None
    return ("sequence" if task is None else task.layout), method.layouts


class LayoutSweeper(BasicSweeper):
    """Hydra's ``BasicSweeper`` whose job list keeps only the jobs whose method runs on the model
    the job builds (see the module docstring)."""

    def split_arguments(self, overrides: list[Any], max_batch_size: int | None) -> list[list[list[str]]]:  # type: ignore[override]
        batches = BasicSweeper.split_arguments(overrides, max_batch_size)
        if self.hydra_context is None or self.config is None:
            return batches
        kept_batches, left_out = [], {}
        for batch in batches:
            kept = []
            for job in batch:
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
                layouts = job_layouts(cfg)
                if layouts is None or layouts[0] in layouts[1]:
                    kept.append(job)
                else:
                    left_out.setdefault(layouts[0], set()).add(str(cfg.method.name))
            if kept:
                kept_batches.append(kept)
        for layout, methods in left_out.items():
            model = "grid encoder (a grid task)" if layout == "grid" else "sequence model (text or a sequence task)"
            log.info(f"leaving out the jobs of {len(methods)} method(s) not made for the {model}: "
                     f"{', '.join(sorted(methods))} (docs/grid.md)")
        if left_out and not kept_batches:  # Hydra would print a raised error with its traceback
            print("posbench train: error: no job of this sweep has a method made for its model: grid methods run on "
                  "grid tasks (task=life), sequence methods on text and sequence tasks (docs/grid.md)", file=sys.stderr)
            raise SystemExit(2)
        return kept_batches


__all__ = ["LayoutSweeper", "job_layouts"]
