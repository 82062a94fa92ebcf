"""Synthetic tasks with a right answer (docs/tasks.md): the task interface and batches
(:mod:`posbench.tasks.base`), the built-in tasks (:mod:`posbench.tasks.generators`), their
evaluation (:mod:`posbench.evaluation.tasks`), a task run's workload for the trainer
(:mod:`posbench.train.task_workload`) and comparison tables and figures
(:mod:`posbench.report.tasks`). A new task is one module here (docs/adding-a-task.md): every
module of this package is imported, alphabetically, and so its tasks registered."""

import importlib
import pkgutil

from posbench.tasks.base import (
    IGNORE,
    TEST,
    TRAIN,
    VALID,
    Batch,
    Task,
    TaskBatches,
    answer_share,
    list_tasks,
    make_task,
    register_task,
    unregister_task,
)

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"):
    importlib.import_module(f"{__name__}.{_module}")  # generators, then grid, grid_lookup, grid_same_line

__all__ = ["Batch", "IGNORE", "TEST", "TRAIN", "Task", "TaskBatches", "VALID", "answer_share", "list_tasks",
           "make_task", "register_task", "unregister_task"]
