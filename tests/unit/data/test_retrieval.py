"""data.retrieval: passkeys and repeated spans written into training windows (posbench/data/retrieval.py)."""

from __future__ import annotations

import numpy as np
import pytest

from posbench.core.errors import PosbenchError
from posbench.data import DataConfig, TrainBatches, prepare_data
from posbench.data.retrieval import (
    KEY_DIGITS,
    Inserter,
    PasskeyText,
    RetrievalConfig,
    make_inserter,
    placement,
    retrieval_config,
)

CONTEXT = 256


@pytest.fixture(scope="module", params=["synthetic", pytest.param("sample", marks=pytest.mark.slow)])
def prepared(request):
    """The TinyStories sample with its own BPE (the tokenizer of experiment=cpu_quick: preparing it
    takes seconds, so the slow lane's) and the generated text of data=synthetic with its own BPE
    (the fast lane's: the quick training runs prepare it anyway)."""
    return prepare_data(DataConfig(source=request.param).validate(), log=lambda _: None)


def inserter(prepared, seed: int = 0, **settings) -> Inserter:
    return make_inserter(RetrievalConfig(**{"rate": 1.0, **settings}).validate(), CONTEXT, prepared, seed)


def window(prepared, sample: int) -> np.ndarray:
    tokens = prepared.train_tokens()
    return tokens[sample * CONTEXT : sample * CONTEXT + CONTEXT + 1].astype(np.int64)


@pytest.mark.slow
def test_rate_zero_is_bitwise_todays_batches(prepared) -> None:
    """The default (rate 0) adds no hook at all: the workload's batches are the plain sampler's."""
    from types import SimpleNamespace

    import torch

    from posbench.train.workload import TextWorkload

    assert make_inserter(RetrievalConfig(), CONTEXT, prepared, 0) is None
    trainer = SimpleNamespace(context=CONTEXT, batch_size=8, state_passing="off")
    ours = TextWorkload(prepared, DataConfig(source="sample").validate().retrieval).train_batches(
        trainer, 3, 0, 1, torch.device("cpu"))
    plain = TrainBatches(prepared.train_tokens(), CONTEXT, 8, 3)
    assert ours.insert is None
    for step in (0, 1, 97, 1000):
        for a, b in zip(ours.get(step), plain.get(step)):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_a_composed_run_has_it_off_and_the_option_reaches_the_spec() -> None:
    from helpers import compose_config

    from posbench.runs.spec import build_spec

    for preset in ("sample", "synthetic", "local", "tinystories"):
        cfg = compose_config("train", [f"data={preset}"])
        assert cfg.data.retrieval.rate == 0.0 and list(cfg.data.retrieval.kinds) == ["passkey", "repeat_random",
                                                                                      "repeat_text"]
    spec = build_spec(compose_config("train", ["data=synthetic", "data.retrieval.rate=0.25",
                                               "data.retrieval.kinds=[passkey]", "data.retrieval.max_distance=64"]))
    assert spec.data.retrieval == RetrievalConfig(rate=0.25, kinds=["passkey"], max_distance=64)


@pytest.mark.slow
def test_the_passkey_sentences_are_where_they_should_be_and_tokenized_right(prepared) -> None:
    hook = inserter(prepared, kinds=["passkey"])
    seen = set()
    for sample in range(40):
        original = window(prepared, sample)
        row = original.copy()
        ins = hook.insert(row, sample)
        assert ins.kind == "passkey"
        needle, question = row[ins.p : ins.p + len(ins.first)], row[ins.q : ins.q + len(ins.second)]
        key = prepared.decode(needle).split("The pass key is ")[1][:KEY_DIGITS]
        assert key.isdigit() and len(key) == KEY_DIGITS
        seen.add(key)
        assert prepared.decode(needle) == f" The pass key is {key}. Remember it."
        assert prepared.decode(question) == f" What is the pass key? The pass key is {key}."
        # the run's tokenizer, as it encodes the whole sentences
        assert needle.tolist() == prepared.encode([f" The pass key is {key}. Remember it."])[0]
        assert question.tolist() == prepared.encode([f" What is the pass key? The pass key is {key}."])[0]
        key_ids = prepared.encode([f" {key}"])[0]
        at_first, at_second = ins.p + ins.first_offset, ins.q + ins.second_offset
        assert row[at_first : at_first + len(key_ids)].tolist() == key_ids
        assert row[at_second : at_second + len(key_ids)].tolist() == key_ids
        assert ins.distance == at_second - at_first and 1 <= ins.distance <= 256
        assert ins.p + len(ins.first) <= ins.q and ins.q + len(ins.second) <= CONTEXT + 1
        # every other token is the window's own text
        touched = np.zeros(CONTEXT + 1, dtype=bool)
        touched[ins.p : ins.p + len(ins.first)] = touched[ins.q : ins.q + len(ins.second)] = True
        assert np.array_equal(row[~touched], original[~touched])
    assert len(seen) == 40  # a fresh key per window


@pytest.mark.slow
def test_repeated_spans_copy_the_window_or_random_ids(prepared) -> None:
    hook = inserter(prepared, kinds=["repeat_text", "repeat_random"], span=8, min_distance=20, max_distance=100)
    kinds = set()
    for sample in range(60):
        original = window(prepared, sample)
        row = original.copy()
        ins = hook.insert(row, sample)
        kinds.add(ins.kind)
        assert 20 <= ins.distance <= 100 and ins.q == ins.p + ins.distance
        assert np.array_equal(row[ins.p : ins.p + 8], row[ins.q : ins.q + 8])
        if ins.kind == "repeat_text":  # the window's own text at p, unchanged there
            assert np.array_equal(row[ins.p : ins.p + 8], original[ins.p : ins.p + 8])
        else:
            assert prepared.eot_id not in row[ins.p : ins.p + 8] and row.max() < prepared.vocab_size
        rest = np.ones(CONTEXT + 1, dtype=bool)
        rest[ins.p : ins.p + 8] = rest[ins.q : ins.q + 8] = False
        assert np.array_equal(row[rest], original[rest])
    assert kinds == {"repeat_text", "repeat_random"}


def test_insertions_are_a_function_of_seed_and_sample_and_follow_the_rate(prepared) -> None:
    a, b, other = inserter(prepared, rate=0.3), inserter(prepared, rate=0.3), inserter(prepared, seed=1, rate=0.3)
    plans = [a.plan(s) for s in range(2000)]
    assert [repr(p) for p in plans[:50]] == [repr(b.plan(s)) for s in range(50)]
    assert [repr(p) for p in plans[:50]] != [repr(other.plan(s)) for s in range(50)]
    chosen = sum(p is not None for p in plans)
    assert 0.26 < chosen / 2000 < 0.34
    assert {p.kind for p in plans if p} == {"passkey", "repeat_random", "repeat_text"}


def test_ranks_together_see_the_single_process_batch(prepared) -> None:
    import torch

    hook = inserter(prepared, rate=0.5)
    whole = TrainBatches(prepared.train_tokens(), CONTEXT, 8, 0, insert=hook).get(5)[0]
    parts = [TrainBatches(prepared.train_tokens(), CONTEXT, 8, 0, rank=r, world_size=2, insert=hook).get(5)[0]
             for r in range(2)]
    assert torch.equal(whole[0::2], parts[0]) and torch.equal(whole[1::2], parts[1])
    plain = TrainBatches(prepared.train_tokens(), CONTEXT, 8, 0).get(5)[0]
    assert not torch.equal(whole, plain)  # rate 0.5 of 8 rows: some row changed


def test_placement_covers_the_distance_range() -> None:
    rng = np.random.default_rng(0)
    found = [placement(257, 10, 4, 12, 9, 1, 256, rng) for _ in range(3000)]
    distances = [(q + 9) - (p + 4) for p, q in found]
    assert min(distances) == 10 - 4 + 9 and max(distances) == 257 - 12 - 4 + 9
    assert all(p >= 0 and q >= p + 10 and q + 12 <= 257 for p, q in found)
    assert placement(30, 20, 0, 20, 0, 1, 256, rng) is None


@pytest.mark.parametrize("values, message", [
    ({"rate": 1.5}, r"rate must be in \[0, 1\]"),
    ({"kinds": ["needle"]}, "kinds must be a non-empty list"),
    ({"kinds": []}, "kinds must be a non-empty list"),
    ({"min_distance": 300, "max_distance": 256}, "min_distance=300 is above max_distance=256"),
    ({"span": 0}, "span must be a positive integer"),
    ({"ratio": 0.5}, "unknown option.*data.retrieval.ratio"),
])
def test_bad_settings_are_one_clear_line(values, message) -> None:
    with pytest.raises(PosbenchError, match=message):
        retrieval_config(values)


def test_a_kind_that_cannot_fit_the_window_is_refused_before_training(prepared) -> None:
    with pytest.raises(PosbenchError, match="does not fit a training window of 257 tokens"):
        inserter(prepared, kinds=["repeat_random"], span=200)
    with pytest.raises(PosbenchError, match="does not fit"):
        inserter(prepared, kinds=["passkey"], max_distance=5)


@pytest.mark.parametrize("context, settings", [
    (64, {"kinds": ["passkey"], "min_distance": 100}),  # was told to raise max_distance: refused again at 1000
    (64, {"kinds": ["passkey"], "min_distance": 100, "max_distance": 1000}),
    (16, {"kinds": ["passkey"]}),  # the needle and question alone overflow the window: a longer context
    (64, {"kinds": ["repeat_random"], "span": 40}),
    (256, {"kinds": ["passkey"], "max_distance": 5}),
    (64, {"kinds": ["repeat_text"], "span": 8, "min_distance": 60}),
])
def test_the_fix_a_refusal_names_makes_the_kind_fit(prepared, context, settings) -> None:
    """Each refusal names one setting and a value; set to that value, the kind fits."""
    import re

    def make(context, **values):
        return make_inserter(RetrievalConfig(**{"rate": 1.0, **values}).validate(), context, prepared, 0)

    with pytest.raises(PosbenchError, match="does not fit a training window") as refused:
        make(context, **settings)
    message = str(refused.value)
    fix = re.search(r"; (?:lower|raise) (data\.retrieval\.\w+|trainer\.context) to (?:at most|at least) (\d+)",
                    message)
    assert fix is not None and "\n" not in message, message
    key, value = fix.group(1), int(fix.group(2))
    if key == "trainer.context":
        make(value, **settings)
    else:
        make(context, **{**settings, key.split(".")[-1]: value})


def test_the_key_and_its_pieces_concatenate_to_the_sentence(prepared) -> None:
    text = PasskeyText(prepared.encode)
    for key in ("00000", "58213", "99999", "10101"):
        needle, offset = text.needle(text.key_ids(key))
        assert needle.tolist() == prepared.encode([f" The pass key is {key}. Remember it."])[0]
        assert prepared.decode(needle[offset : offset + len(text.key_ids(key))]) == f" {key}"


def test_the_resume_check_sees_the_option(prepared) -> None:
    from posbench.train.workload import TextWorkload

    off = TextWorkload(prepared).identity()
    on = TextWorkload(prepared, RetrievalConfig(rate=0.5)).identity()
    assert off["retrieval"] == "off" and on["retrieval"] != "off"
    assert {k: v for k, v in on.items() if k != "retrieval"} == {k: v for k, v in off.items() if k != "retrieval"}
    assert "retrieval" not in TextWorkload(prepared).record()
    assert TextWorkload(prepared, RetrievalConfig(rate=0.5)).record()["retrieval"]["rate"] == 0.5


def test_a_task_run_refuses_the_option() -> None:
    from helpers import compose_config

    from posbench.runs.spec import build_spec

    with pytest.raises(PosbenchError, match="task=flipflop runs have none; drop data.retrieval.rate"):
        build_spec(compose_config("train", ["task=flipflop", "data.retrieval.rate=0.5"]))
