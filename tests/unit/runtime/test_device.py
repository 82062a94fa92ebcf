"""The device setup ``posbench train`` and ``posbench bench`` share
(:func:`posbench.runtime.device.setup_device`), on a faked CUDA device: no GPU needed.

``precision=fp32`` means fp32 on CUDA: no TF32 matmuls. The trainer kept to that while bench
turned TF32 on under every precision, so bench's fp32 numbers were not the trainer's.
"""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from posbench.bench import command
from posbench.config import config_dir
from posbench.runtime.device import setup_device


def tf32() -> tuple[bool, bool]:
    """(TF32 matmuls, TF32 cuDNN)."""
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def set_tf32(matmul: bool, cudnn: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'available' with device 0 current; the TF32 switches off (restored afterwards).
    Returns the devices ``torch.cuda.set_device`` was called with."""
    made_current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    before = tf32()
    set_tf32(False, False)
    yield made_current
    set_tf32(*before)


@pytest.mark.parametrize("precision, expected", [("fp32", (False, False)), ("bf16", (True, True)),
                                                 ("auto", (True, True))])
def test_tf32_only_when_the_precision_is_not_fp32(fake_cuda, precision, expected):
    device = setup_device("cuda", precision)
    assert device == torch.device("cuda", 0) and fake_cuda == [device]  # an index: set_device needs one
    assert tf32() == expected


def test_an_explicit_index_is_kept_and_the_cpu_is_left_alone(fake_cuda):
    assert setup_device("cuda:1", "fp32") == torch.device("cuda", 1) and fake_cuda == [torch.device("cuda", 1)]
    assert setup_device("cpu", "bf16") == torch.device("cpu")
    assert fake_cuda == [torch.device("cuda", 1)] and tf32() == (False, False)


class Stop(Exception):
    """Raised where bench's device setup is over, before any model is built."""


@pytest.mark.parametrize("precision, expected", [("fp32", (False, False)), ("bf16", (True, True))])
def test_bench_sets_up_cuda_as_the_trainer(fake_cuda, monkeypatch, precision, expected):
    """bench with precision=fp32 leaves TF32 off (it turned it on, unlike the trainer)."""

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(command, "resolve_peak_tflops", stop)  # the first thing after the device setup
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("bench", overrides=["model=tiny", "methods=[rope]", "device=cuda", f"precision={precision}"])
    with pytest.raises(Stop):
        command.run_bench(cfg)
    assert fake_cuda == [torch.device("cuda", 0)]
    assert tf32() == expected
