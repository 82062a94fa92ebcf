"""posbench.train.workload: the trainer's one view of its data, text or a synthetic task."""

from __future__ import annotations

import inspect

import torch
from helpers import QUICK_TRAIN, compose_config

from posbench.runs.spec import build_spec
from posbench.tasks import IGNORE
from posbench.train.task_workload import TaskWorkload
from posbench.train.workload import TextWorkload, Workload, make_workload


def protocol_members() -> set[str]:
    return {name for name in vars(Workload) if not name.startswith("_")} | set(Workload.__annotations__)


def test_both_workloads_define_the_protocol_methods_with_its_signatures():
    for cls in (TextWorkload, TaskWorkload):
        for name in protocol_members():
            wanted = getattr(Workload, name, None)
            if inspect.isfunction(wanted):
                got = getattr(cls, name)
                assert list(inspect.signature(got).parameters) == list(inspect.signature(wanted).parameters), (cls, name)


def test_make_workload_picks_the_task_generator_or_the_prepared_text():
    task_spec = build_spec(compose_config("train", ["task=flipflop"]))
    workload = make_workload(task_spec, print)
    assert isinstance(workload, TaskWorkload)
    assert all(hasattr(workload, name) for name in protocol_members())
    assert workload.text is None and workload.data_dir is None  # no token cache, no text probes
    assert workload.vocab_size == task_spec.task.vocab_size
    # the resume identity holds the options that set the data, not the evaluation's (tests, learnt_at_c)
    data_options = {k: v for k, v in task_spec.task_options.items() if k not in ("tests", "learnt_at_c")}
    assert workload.identity() == {"task": f"flipflop:{sorted(data_options.items())}"}
    assert workload.record()["meta"]["vocab"] == list(task_spec.task.vocab)

    # data=synthetic, which the quick runs prepare anyway (the packaged sample took seconds to prepare)
    text_spec = build_spec(compose_config("train", QUICK_TRAIN))
    workload = make_workload(text_spec, print)
    assert isinstance(workload, TextWorkload)
    assert all(hasattr(workload, name) for name in protocol_members())
    assert workload.data_dir == str(workload.text.dir)
    assert workload.vocab_size == workload.text.vocab_size
    assert set(workload.identity()) >= {"tokenizer_sha256", "train_sha256", "validation_sha256"}
    assert workload.record() == {"dir": str(workload.text.dir), "meta": workload.text.meta}


def test_a_task_weights_micro_batches_by_their_answers_and_text_does_not():
    whole = torch.full((4, 6), IGNORE)
    whole[0, :3] = 1  # 3 answers in the first micro-batch (rows 0-1), 1 in the second (rows 2-3)
    whole[3, 5] = 1
    loss = torch.tensor(2.0)
    task = TaskWorkload(task=None)  # micro_loss reads only the targets
    assert task.micro_loss(loss, whole[:2], whole, accum=2).item() == 2.0 * 2 * 3 / 4
    assert task.micro_loss(loss, whole[2:], whole, accum=2).item() == 2.0 * 2 * 1 / 4
    assert task.micro_loss(loss, whole, whole, accum=1) is loss  # one micro-batch: the loss as it is
    text = TextWorkload.__new__(TextWorkload)
    assert text.micro_loss(loss, whole[:2], whole, accum=2) is loss
