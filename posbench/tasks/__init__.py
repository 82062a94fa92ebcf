"""Synthetic tasks with a right answer (docs/tasks.md): the task interface and batches
(:mod:`posbench.tasks.base`), the built-in tasks (:mod:`posbench.tasks.generators`), their
evaluation (:mod:`posbench.evaluation.tasks`), a task run's workload for the trainer
(:mod:`posbench.train.task_workload`) and comparison tables and figures
(:mod:`posbench.report.tasks`)."""

from posbench.tasks import generators  # noqa: F401  (registers the built-in tasks)
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
)

__all__ = ["Batch", "IGNORE", "TEST", "TRAIN", "Task", "TaskBatches", "VALID", "answer_share", "list_tasks",
           "make_task", "register_task"]
