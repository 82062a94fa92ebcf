"""State passing: the loader's contiguous streams, and the state each training window starts from."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import posbench
from posbench.core.errors import PosbenchError
from posbench.data.loader import TrainBatches
from posbench.train.state_passing import StatePassing

TOKENS = np.arange(1000, dtype=np.uint16)  # token = its position in the stream


def test_streams_continue_row_by_row_and_start_over_at_the_lane_end():
    batches = TrainBatches(TOKENS, context=10, batch_size=4, seed=0, streams=True)
    S = batches.steps_per_epoch  # 99 windows -> 4 lanes of 24 windows
    assert S == 24
    for step in range(2 * S - 1):
        x, y = batches.get(step)
        x_next, _ = batches.get(step + 1)
        continues = (step + 1) % S != 0
        assert batches.starts_streams(step + 1) == (not continues)
        # row i of the next step starts where row i of this step ended: the next token
        assert torch.equal(x_next[:, 0] == y[:, -1], torch.full((4,), continues))
        assert torch.equal(y, x + 1)  # the stream is the positions: targets are the next tokens
    assert batches.starts_streams(0)
    starts = batches.get(0)[0][:, 0]
    assert starts.tolist() == [0, 240, 480, 720]  # lane i begins at window i * S


def test_streams_split_rows_over_ranks_as_the_shuffled_order_does():
    whole = TrainBatches(TOKENS, context=10, batch_size=4, seed=0, streams=True).get(5)[0]
    ranks = [TrainBatches(TOKENS, context=10, batch_size=4, seed=0, rank=r, world_size=2, streams=True).get(5)[0]
             for r in range(2)]
    assert torch.equal(whole[0::2], ranks[0]) and torch.equal(whole[1::2], ranks[1])


def test_default_order_is_unchanged_by_the_streams_option():
    plain = TrainBatches(TOKENS, context=10, batch_size=4, seed=3)
    assert not plain.streams and plain.starts_streams(7)
    assert plain.windows(0).tolist() == np.random.default_rng([3, 0]).permutation(99)[:4].tolist()


def test_too_few_windows_for_the_streams_is_one_line():
    with pytest.raises(PosbenchError, match="lower trainer.batch_size"):
        TrainBatches(TOKENS[:100], context=10, batch_size=8, seed=0, streams=True)


def model():
    torch.manual_seed(0)
    return posbench.create_model("nope", flavour="tiny", vocab_size=64, mixer=["gated_deltanet", "attention"])


def test_carry_hands_the_final_state_to_the_next_step_and_resets_at_a_stream_start():
    m = model()
    batches = TrainBatches(TOKENS, context=10, batch_size=4, seed=0, streams=True)
    passing = StatePassing("carry", m, batches, micro=2, seed=0, noise=0.0, device=torch.device("cpu"))
    first = passing.start(1, 0)
    assert set(first) == {0} and all((t == 0).all() for t in first[0])  # the zero state, layer 0 only
    x = torch.randint(0, 64, (2, 10))
    m(x, state=first)
    passing.keep(0, first)
    carried = passing.start(2, 0)
    assert torch.equal(carried[0][1], first[0][1]) and not carried[0][1].requires_grad
    assert (carried[0][1] != 0).any()
    restart = passing.start(batches.steps_per_epoch + 1, 0)  # a lane starts over
    assert all((t == 0).all() for t in restart[0])
    again = StatePassing("carry", m, batches, micro=2, seed=0, noise=0.0, device=torch.device("cpu"))
    again.load_state_dict(passing.state_dict())  # what a checkpoint holds
    assert torch.equal(again.start(2, 0)[0][1], carried[0][1])


def test_noise_is_a_function_of_seed_step_and_micro_batch():
    m = model()
    batches = TrainBatches(TOKENS, context=10, batch_size=4, seed=0)

    def noise(seed, step, i):
        return StatePassing("noise", m, batches, 2, seed, 0.5, torch.device("cpu")).start(step, i)[0]

    conv, rec = noise(0, 3, 1)
    assert (conv == 0).all() and 0.4 < rec.std() < 0.6
    assert torch.equal(rec, noise(0, 3, 1)[1])
    assert not torch.equal(rec, noise(0, 4, 1)[1]) and not torch.equal(rec, noise(1, 3, 1)[1])


def test_carry_in_several_processes_is_one_line():
    with pytest.raises(PosbenchError, match="one process"):
        StatePassing("carry", model(), None, 2, 0, 1.0, torch.device("cpu"), world_size=2)
