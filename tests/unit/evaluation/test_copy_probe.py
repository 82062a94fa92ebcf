"""The copy probe (posbench/evaluation/probes/copy.py): window construction (repeat, control, matched control), the
retrieval gain against hand-built models that cannot and can copy, the receptive-field rule of
window models, untrained models, determinism, held-out text only, entries written before the
matched control existed, and its results.json integration."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import posbench
from posbench.core.errors import PosbenchError
from posbench.evaluation.probes import ProbeRun, configure_probes, get_probe, run_probes
from posbench.evaluation.probes.copy import (
    NO_MATCHED,
    REACH_DEFINITION,
    REACH_MIN_GAIN,
    CopySettings,
    probe_summary,
    reach,
)
from posbench.evaluation.probes.copy import copy_probe as copy_probe_with
from posbench.evaluation.probes.copy_windows import cell_for, make_windows, probe_cells, shares_ngram
from posbench.evaluation.probes.merge import merge_probe_entries

V, W, N_LAYERS, K, C = 64, 16, 2, 4, 32
RECEPTIVE_FIELD = N_LAYERS * (W - 1) + K  # 34: from here on no scored token sees the first copy


def stream(size: int = 20000, seed: int = 1) -> np.ndarray:
    """A held-out stream of ids 1..V-1 (0 plays end-of-text)."""
    return np.random.default_rng(seed).integers(1, V, size=size)


def copy_probe(model, tokens, train_context, *, vocab_size, special_ids, log=print, **kwargs):
    """The copy probe with its settings and run options given as keywords."""
    settings = {k: kwargs.pop(k) for k in list(kwargs) if k in CopySettings.__dataclass_fields__}
    return copy_probe_with(model, tokens, vocab_size, special_ids, CopySettings(**settings),
                           ProbeRun(train_context, log=log, **kwargs))


def probe(model, **kwargs):
    options = dict(vocab_size=V, special_ids=[0], span=K, num_windows=32, kinds=["random", "text"],
                   distances=[8, RECEPTIVE_FIELD, 40, 48], log=lambda _: None)
    options.update(kwargs)
    (entry,) = copy_probe(model, stream(), C, **options)
    return entry


@pytest.fixture(scope="module")
def copying_window_model():
    """A tiny 2-layer window model briefly trained on periodic random streams (x[t] = x[t - d],
    d in 4..12 per row): it learns to copy from inside its window (~15 s on one busy CPU core)."""
    torch.manual_seed(0)
    model = posbench.create_model("rope", flavour="tiny", vocab_size=V, attention_window=W)
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(200):
        x = torch.randint(1, V, (32, 48), generator=g)
        period = torch.randint(K, 13, (32,), generator=g)
        idx = torch.arange(48)
        for i, d in enumerate(period.tolist()):
            x[i, d:] = x[i, idx[d:] % d]
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.slow
def test_window_model_has_zero_gain_beyond_its_receptive_field_and_copies_within_it(copying_window_model) -> None:
    entry = probe(copying_window_model)
    for cell in entry["cells"]:
        if cell["distance"] >= RECEPTIVE_FIELD:  # d >= N (W - 1) + k: no path from the first copy
            assert abs(cell["sensitivity"]) < 1e-5, cell
            assert max(abs(g) for g in cell["window_sensitivities"]) < 1e-5
            assert max(abs(g) for g in cell["window_retrieval_gains"]) < 1e-5
        else:  # d = 8 < W, inside C and past it
            assert cell["sensitivity_interval"][0] > 0.1, cell
            assert cell["retrieval_interval"][0] > 0.1, cell
    assert entry["reach"]["random"] == 8


def test_untrained_window_model_is_exactly_blind_beyond_its_receptive_field() -> None:
    torch.manual_seed(1)
    model = posbench.create_model("rope", flavour="tiny", vocab_size=V, attention_window=W).eval()
    entry = probe(model, distances=[RECEPTIVE_FIELD - 1, RECEPTIVE_FIELD])
    far = [c for c in entry["cells"] if c["distance"] == RECEPTIVE_FIELD]
    assert far and all(max(abs(g) for g in c["window_sensitivities"]) < 1e-5 for c in far)
    # one token closer, the first copy's last token reaches the first scored one: the rule is tight
    near = [c for c in entry["cells"] if c["distance"] == RECEPTIVE_FIELD - 1]
    assert near and all(max(abs(g) for g in c["window_sensitivities"]) > 1e-7 for c in near)


def test_untrained_model_has_no_gain() -> None:
    torch.manual_seed(2)
    model = posbench.create_model("rope", flavour="tiny", vocab_size=V).eval()
    entry = probe(model)
    for cell in entry["cells"]:
        # ~0: a few thousandths of a nat against a loss of ln(64) = 4.16, and no reach at all.
        assert abs(cell["sensitivity"]) < 0.02 and abs(cell["retrieval_gain"]) < 0.02, cell
        assert cell["sensitivity_interval"][0] < 0.02 and cell["count"] == 32
    assert entry["reach"] == {"random": 0, "text": 0}


# A vocabulary whose held-out text uses ids 1..15 only: random spans (ids 1..1023) are out of
# distribution, as random BPE ids are in TinyStories text.
BIG_V, TEXT_IDS = 1024, 16


def narrow_stream(size: int = 20000, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, TEXT_IDS, size=size)


class DisturbedModel(torch.nn.Module):
    """Cannot copy: it expects text ids (logit 6), and rare ids (>= TEXT_IDS) the more, the larger
    the share of rare ids read so far (logit 12 x share), never minding which ids or where."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        share = (ids >= TEXT_IDS).float().cumsum(1) / torch.arange(1, ids.shape[1] + 1)  # (B, T)
        rare = torch.arange(BIG_V) >= TEXT_IDS  # (V,)
        return torch.where(rare, 12.0 * share[..., None], torch.tensor(6.0))


class InductionOracle(torch.nn.Module):
    """Copies: at each position, a logit of 10 on the id that followed the latest earlier
    occurrence of the current id (all logits 0 when it has none)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        B, T = ids.shape
        same = ids[:, :, None] == ids[:, None, :]  # (B, T, T): query i, key j
        earlier = torch.ones(T, T, dtype=torch.bool).tril(-1)  # j < i
        j = torch.where(same & earlier, torch.arange(T), -1).amax(-1)  # (B, T): -1 when none
        follower = ids.gather(1, (j + 1).clamp(max=T - 1))  # (B, T): j + 1 <= i
        logits = torch.zeros(B, T, BIG_V).scatter_(2, follower[..., None], 10.0)
        return logits * (j >= 0)[..., None]


def oracle_probe(model: torch.nn.Module) -> dict:
    (entry,) = copy_probe(model, narrow_stream(), C, vocab_size=BIG_V, special_ids=[0], span=K, num_windows=64,
                          kinds=["random"], distances=[8, 24, 40], log=lambda _: None)
    return entry


def test_a_model_that_only_notices_out_of_place_ids_has_no_retrieval_gain() -> None:
    """The confound the matched control removes: putting k random ids at p lowers this model's
    loss on the random repeat (sensitivity > 0, what the probe called copy gain before), but it
    cannot copy, and the matched control (other random ids at p) says so: retrieval gain 0."""
    entry = oracle_probe(DisturbedModel())
    assert len(entry["cells"]) == 5  # inside d=8, 24; past d=8, 24, 40 (d=40 does not fit inside C=32)
    for cell in entry["cells"]:
        assert cell["sensitivity_interval"][0] > 0.05, cell  # sensitive to what sits at distance d
        assert cell["retrieval_interval"][0] <= 0.0 <= cell["retrieval_interval"][1], cell
        assert abs(cell["retrieval_gain"]) <= 3 * cell["retrieval_se"] + 1e-12, cell
        assert abs(cell["retrieval_gain"]) < cell["sensitivity"] / 10
    assert entry["reach"] == {"random": 0}


def test_an_induction_oracle_has_a_large_retrieval_gain_at_every_distance() -> None:
    entry = oracle_probe(InductionOracle())
    for cell in entry["cells"]:
        # ln 1024 = 6.93 nats without the copy, 0.05 with it (more where a span id also occurs in the filler)
        assert cell["retrieval_interval"][0] > 6.0 and cell["retrieval_gain"] > 20 * cell["retrieval_se"], cell
        assert cell["loss_matched"] > 6.0 and cell["loss_repeat"] < 0.5, cell
    assert entry["reach"] == {"random": 40}  # retrieves at every distance of the grid, past C too


def test_repeat_control_and_matched_control_differ_only_in_the_first_span() -> None:
    windows = make_windows(stream(), 8, 60, K, V, [0], seed=3)
    for cell in probe_cells([8, 20, 40], C, K):
        for kind in ("random", "text"):
            repeat, control, matched = windows.build(cell, kind)
            assert repeat.shape == control.shape == matched.shape == (8, cell.length) and cell.length == cell.t + K
            first = set(range(cell.p, cell.p + K))
            for other in (control, matched):
                differ = (repeat != other).any(dim=0).nonzero().flatten().tolist()
                assert set(differ) <= first and differ  # the first copy only
            outside = torch.ones(cell.length, dtype=torch.bool)
            outside[cell.p : cell.p + K] = False
            assert torch.equal(matched[:, outside], repeat[:, outside])  # bit for bit outside the first span
            span, other_span = (torch.from_numpy(w[kind]) for w in (windows.spans, windows.matched))
            assert torch.equal(repeat[:, cell.p : cell.p + K], span)
            assert torch.equal(matched[:, cell.p : cell.p + K], other_span)
            assert (other_span != span).any(dim=1).all()  # another span in every window, not S
            for window in (repeat, control, matched):
                assert torch.equal(window[:, cell.t :], span)  # the same scored repeat in all three
            filler = torch.from_numpy(windows.filler[:, : cell.length])
            keep = torch.ones(cell.length, dtype=torch.bool)
            keep[cell.t :] = False
            assert torch.equal(control[:, keep], filler[:, keep])  # the control is filler + the repeat


def test_matched_spans_are_drawn_like_the_repeated_ones_and_never_copy_it() -> None:
    tokens = stream()
    windows = make_windows(tokens, 16, 60, K, V, [0], seed=4)
    assert not np.isin(windows.matched["random"], [0]).any()  # the same vocabulary filter
    for i in range(16):
        for kind in ("random", "text"):
            # no k/2 consecutive tokens of S in D: the matched control holds no copy of the answer
            assert not shares_ngram(windows.matched[kind][i], windows.spans[kind][i], K // 2)
        # text D passes the same check against its filler as text S does
        assert not shares_ngram(windows.filler[i], windows.matched["text"][i], K // 2)
    assert np.array_equal(windows.matched["text"], np.stack([tokens[o : o + K] for o in windows.matched_offsets]))
    # adding the matched control left the old windows alone: fillers and spans of this seed, as
    # drawn before it existed (the same generator calls, in the same order)
    rng = np.random.default_rng(4)
    slots = len(tokens) // 60
    order = rng.permutation(slots)
    assert np.array_equal(windows.filler_offsets, np.sort(order[:16]) * 60)
    allowed = np.arange(1, V)
    assert np.array_equal(windows.spans["random"], allowed[rng.integers(0, allowed.size, size=(16, K))])


def test_spans_and_fillers_never_overlap_and_never_leak() -> None:
    tokens = stream()
    windows = make_windows(tokens, 16, 60, K, V, [0], seed=4)
    used = np.zeros(len(tokens), dtype=int)
    for o in windows.filler_offsets:
        used[o : o + 60] += 1
    for o in [*windows.text_offsets, *windows.matched_offsets]:
        used[o : o + K] += 1
    assert used.max() == 1  # no token of the stream serves twice (the matched text spans included)
    assert not np.isin(windows.spans["random"], [0]).any()  # no special token in random spans
    for cell in probe_cells([8, 40], C, K):
        for kind in ("random", "text"):
            _, control, _ = windows.build(cell, kind)
            for row, span in zip(control.numpy(), windows.spans[kind]):
                # nothing before the repeat in the control holds half of the span: no answer to copy
                assert not shares_ngram(row[: cell.t], span, K // 2)
    # the first copy ends before the repeat starts, and the repeat ends the window
    assert all(c.p + K <= c.t and c.length == c.t + K for c in probe_cells([4, 8, 40], C, K))


def test_a_text_span_repeating_its_filler_is_replaced() -> None:
    # The stream repeats a 60-token block: every text piece shares k/2 tokens with every filler.
    block = np.arange(1, 61)
    with pytest.raises(PosbenchError, match="do not repeat their filler"):
        make_windows(np.tile(block, 40), 4, 60, K, V, [0], seed=0)
    # Only the slots of the first half repeat the block: spans are taken from fresh text.
    tokens = np.concatenate([np.tile(block, 20), stream(1200, seed=9)])
    windows = make_windows(tokens, 4, 60, K, V, [0], seed=0)
    for filler, span in zip(windows.filler, windows.spans["text"]):
        assert not shares_ngram(filler, span, K // 2)


@pytest.mark.slow
def test_windows_are_deterministic_and_never_depend_on_the_model() -> None:
    a = make_windows(stream(), 8, 60, K, V, [0], seed=5)
    b = make_windows(stream(), 8, 60, K, V, [0], seed=5)
    c = make_windows(stream(), 8, 60, K, V, [0], seed=6)
    assert a.sha256() == b.sha256() != c.sha256()
    torch.manual_seed(0)
    one = probe(posbench.create_model("rope", flavour="tiny", vocab_size=V).eval())
    torch.manual_seed(1)
    other = probe(posbench.create_model("alibi", flavour="tiny", vocab_size=V).eval())
    assert one["windows_sha256"] == other["windows_sha256"]
    again = probe(posbench.create_model("rope", flavour="tiny", vocab_size=V).eval().requires_grad_(False))
    assert again["windows_sha256"] == one["windows_sha256"]


@pytest.mark.slow
def test_cells_past_learned_positions_are_left_out_on_the_same_windows() -> None:
    torch.manual_seed(0)
    short = posbench.create_model("learned", flavour="tiny", vocab_size=V, method_options={"max_positions": 48}).eval()
    lines: list[str] = []
    entry = probe(short, log=lines.append)
    kept = {(c["distance"], c["region"]) for c in entry["cells"]}
    # the model reads L - 1 = t + k - 1 tokens: 31, 35, 41, 47 and, for d = 48 past C, 55 > 48
    assert kept == {(8, "inside"), (8, "past"), (RECEPTIVE_FIELD, "past"), (40, "past")}
    assert any("leaving out 1 cells" in line and "d=48 past" in line for line in lines)
    full = probe(posbench.create_model("learned", flavour="tiny", vocab_size=V).eval())
    assert entry["windows_sha256"] == full["windows_sha256"]  # sized by the whole grid, not by the model


def test_tables_recompute_the_reach_from_the_cells() -> None:
    from posbench.report.probes import mean_reach

    cells = [{"kind": "random", "region": "inside", "distance": 32, "sensitivity": 3.0, "retrieval_gain": 0.2},
             {"kind": "random", "region": "past", "distance": 32, "sensitivity": 3.0, "retrieval_gain": 0.2}]
    stale = {"probe": "copy", "span": 16, "distances": [32], "reach": {"random": 32}, "cells": cells}  # a 0.1 floor
    assert mean_reach([stale], "random") == 0.0  # retrieval 0.2 < REACH_MIN_GAIN: barely copies (whatever the sensitivity)
    assert mean_reach([stale], "text") is None


def test_probe_summary_for_the_tracker() -> None:
    from posbench.evaluation.probes.copy import probe_summary

    cells = [{"kind": "random", "region": "inside", "distance": 32, "sensitivity": 2.0, "retrieval_gain": 1.6},
             {"kind": "random", "region": "past", "distance": 64, "sensitivity": 1.5, "retrieval_gain": 1.0}]
    entry = {"probe": "copy", "extension": "none", "kinds": ["random"], "span": 16, "distances": [32, 64],
             "reach": {"random": 64},
             "cells": cells}
    summary = probe_summary([entry, {**entry, "extension": "yarn"}])
    assert summary == {
        "probe/copy/reach_random": 64, "probe/copy/random/inside/retrieval_gain_d32": 1.6,
        "probe/copy/random/inside/sensitivity_d32": 2.0, "probe/copy/random/past/retrieval_gain_d64": 1.0,
        "probe/copy/random/past/sensitivity_d64": 1.5,
        "probe/copy/yarn/reach_random": 64, "probe/copy/yarn/random/inside/retrieval_gain_d32": 1.6,
        "probe/copy/yarn/random/inside/sensitivity_d32": 2.0, "probe/copy/yarn/random/past/retrieval_gain_d64": 1.0,
        "probe/copy/yarn/random/past/sensitivity_d64": 1.5}


def test_cells_with_the_same_repeat_position_share_one_control_pass(monkeypatch) -> None:
    import posbench.evaluation.probes.copy as probes

    calls: list[int] = []
    real = probes.cell_losses

    def counted(model, windows, cell, *args):
        calls.append(cell.t)
        return real(model, windows, cell, *args)

    monkeypatch.setattr(probes, "cell_losses", counted)
    torch.manual_seed(0)
    entry = probe(posbench.create_model("rope", flavour="tiny", vocab_size=V).eval(), distances=[8, 12, 16, 40],
                  kinds=["random"])
    # cells: inside d=8,12,16 (t=28), past d=8,12,16 (t=32), past d=40 (t=44): 7 repeats, 7 matched
    # controls (they depend on p) + 3 controls
    assert len(entry["cells"]) == 7 and len(calls) == 7 + 7 + 3
    inside = {c["loss_control"] for c in entry["cells"] if c["region"] == "inside"}
    assert len(inside) == 1


def test_cell_rule() -> None:
    # inside C: the repeat ends at C - 1; past C: it starts at max(C, d + k)
    assert cell_for(8, "inside", 256, 32) is None  # d < k: the copies would overlap
    inside = cell_for(192, "inside", 256, 32)
    assert (inside.p, inside.t, inside.length) == (32, 224, 256)
    assert cell_for(256, "inside", 256, 32) is None  # no room inside C
    near, far = cell_for(32, "past", 256, 32), cell_for(768, "past", 256, 32)
    assert (near.p, near.t, near.length) == (224, 256, 288) and (far.p, far.t, far.length) == (32, 800, 832)
    cells = probe_cells([32, 64, 128, 192, 256, 320, 384, 512, 768], 256, 32)
    assert [c.distance for c in cells if c.region == "inside"] == [32, 64, 128, 192]
    assert len([c for c in cells if c.region == "past"]) == 9


def test_reach() -> None:
    gains = {(32, "inside"): 4.5, (64, "inside"): 4.0, (32, "past"): 3.9, (64, "past"): 2.5, (128, "past"): 1.0,
             (256, "past"): 3.0}
    assert reach(gains, [32, 64, 128, 256], span=32) == 64  # stops at the first distance below half of 4.0
    assert reach({**gains, (64, "inside"): REACH_MIN_GAIN / 2}, [32, 64], span=32) == 0  # barely copies at all
    assert reach({(32, "inside"): 4.0, (64, "inside"): 4.0, (32, "past"): 1.0}, [32, 64], span=32) == 0
    assert reach({(32, "inside"): 4.0, (32, "past"): 4.0}, [32], span=32) is None  # only the adjacent copy inside C


def test_the_reach_of_a_model_that_copies_past_c_is_not_set_by_the_adjacent_copy() -> None:
    """A model that copies at every distance, past C too, but the adjacent repeat (d = k: S S)
    best, as a continuation: the old reference (the smallest distance, d = k) set the bar at
    half of 9 nats, above every other cell, and gave reach 0; the reference at d >= 2k gives the
    whole grid."""
    from posbench.evaluation.probes.copy import entry_reach, reference_distance

    k, distances = 32, [32, 64, 128, 192, 256, 320, 384, 512, 768]
    gains = {(d, r): (9.0 if d == k else 4.0) for r in ("inside", "past") for d in distances
             if r == "past" or d <= 256 - k}
    gains[(k, "past")] = 4.2  # past C the adjacent copy no longer stands out
    assert reference_distance(gains, k) == 64
    assert reach(gains, distances, span=k) == 768
    # what the old reference (the one cell at d = k) made of the same model
    assert not all(gains[(d, "past")] >= gains[(k, "inside")] / 2 for d in distances)
    cells = [{"kind": "random", "region": r, "distance": d, "p": 0, "t": 256, "length": 256 + k, "sensitivity": g,
              "retrieval_gain": g} for (d, r), g in gains.items()]
    entry = {"probe": "copy", "span": k, "distances": distances, "cells": cells}
    assert entry_reach(entry, "random") == 768
    assert entry_reach({**entry, "span": None}, "random") == 768  # the span read from a cell: length - t
    assert "never the adjacent copy" in REACH_DEFINITION


def test_the_probe_reads_held_out_text_only() -> None:
    class Prepared:
        vocab_size, eot_id = V, 0
        asked: list[str] = []

        def tokens(self, split):
            self.asked.append(split)
            return stream()

    from posbench.evaluation.settings import eval_settings

    evaluation = eval_settings({"probes": ["copy"], "copy": {"distances": [8, 40], "span": K, "num_windows": 4}})
    prepared = Prepared()
    model = posbench.create_model("rope", flavour="tiny", vocab_size=V).eval()
    configure_probes(evaluation, C)
    (entry,) = run_probes(model, prepared, evaluation, ProbeRun.of(evaluation, C, log=lambda _: None))["probes"]
    assert prepared.asked == ["validation"] and entry["split"] == "validation"
    with pytest.raises(PosbenchError, match="held-out"):
        copy_probe(model, stream(), C, vocab_size=V, special_ids=[0], span=K, distances=[8], split="train")
    with pytest.raises(PosbenchError, match="eval.copy.split"):
        configure_probes(eval_settings({"copy": {"split": "train"}}), C)
    nothing = eval_settings({})
    configure_probes(nothing, C)
    assert run_probes(model, prepared, nothing, ProbeRun.of(nothing, C)) == {}


@pytest.mark.parametrize("copy, message", [({"span": 1}, "eval.copy.span"), ({"distances": [16]}, "eval.copy.distances"),
                                           ({"kinds": ["words"]}, "eval.copy.kinds"),
                                           ({"num_windows": 1}, "eval.copy.num_windows"),
                                           ({"bogus": 1}, "eval.copy.bogus")])
def test_bad_copy_settings_are_refused(copy, message) -> None:
    from posbench.evaluation.settings import eval_settings

    with pytest.raises(PosbenchError, match=message):
        configure_probes(eval_settings({"copy": copy}), C)
    with pytest.raises(PosbenchError, match="unknown eval.probes entry 'nonsense'; choose from copy, passkey"):
        configure_probes(eval_settings({"probes": ["nonsense"]}), C)


def test_merge_keeps_other_probe_entries() -> None:
    old = [{"probe": "copy", "split": "validation", "extension": "none", "v": 1},
           {"probe": "copy", "split": "validation", "extension": "yarn", "v": 1}]
    new = [{"probe": "copy", "split": "validation", "extension": "none", "v": 2}]
    assert merge_probe_entries(old, new) == [old[1], new[0]]


@pytest.mark.slow
def test_training_and_posbench_eval_write_probe_entries(tmp_path) -> None:
    from helpers import compose_config, run_train

    from posbench.commands.eval import evaluate_saved_run
    from posbench.runs.results import read_results

    probe_options = ["eval.probes=[copy]", "eval.copy.distances=[8,40]", "eval.copy.span=4",
                     "eval.copy.num_windows=4", "eval.copy.kinds=[random]"]
    run, other = tmp_path / "probed", tmp_path / "plain"
    run_train(run, *probe_options)
    results = read_results(run)
    (entry,) = results["probes"]
    assert entry["probe"] == "copy" and entry["extension"] == "none" and entry["kinds"] == ["random"]
    assert {(c["distance"], c["region"]) for c in entry["cells"]} == {(8, "inside"), (8, "past"), (40, "past")}
    assert all(c["count"] == 4 and len(c["window_sensitivities"]) == 4 for c in entry["cells"])
    # posbench eval with an extension adds its entry beside the plain one, replacing the plain one.
    cfg = compose_config("eval", [f"run={run}", "eval.lengths=[64]", "eval.num_sequences=2", *probe_options,
                                  "eval.extension=[window]"])
    evaluate_saved_run(cfg, log=lambda _: None)
    again = read_results(run)
    assert [e["extension"] for e in again["probes"]] == ["none", "window"]
    assert again["probes"][0]["windows_sha256"] == entry["windows_sha256"]
    assert again["probes"][0]["checkpoint_step"] == 6
    # training without eval.probes writes no probe entries (the default)
    # (another seed: a second run of one seed would be shown apart as a copy, not pooled)
    run_train(other, "seed=1")
    assert "probes" not in read_results(other)
    # posbench plot: the figure and the table, the extension as its own row; the run without probes is left out
    from posbench.report.plot import plot_runs

    out = tmp_path / "comparison"
    written = plot_runs([str(run), str(other)], out, log=lambda _: None)["files"]
    assert {str(out / f) for f in ("copy_retrieval_random.png", "copy_sensitivity_random.png", "copy.md",
                                   "copy.csv")} <= set(written)
    table = (out / "copy.md").read_text()
    assert "| rope | 1 |" in table and "| rope+window | 1 |" in table and "inside d=8" in table
    rows = (out / "copy.csv").read_text().splitlines()
    assert rows[0].startswith("group,kind,region,distance,retrieval_gain,retrieval_gain_low,retrieval_gain_high")
    assert len(rows) == 1 + 2 * 3


# ------------------------------------------------------------------- faults found by a review


def fake_probe_entry(gain: float, windows: str = "w64", num_windows: int = 64, matched: bool = True, **extra) -> dict:
    """A copy probe entry of two cells (random spans, d=8 inside, d=300 past) with retrieval gain
    and sensitivity ``gain``; ``matched=False``: as written before the matched control existed."""
    cells = [{"kind": "random", "distance": d, "region": region, "p": 0, "t": 0, "length": 320,
              "loss_repeat": 1.0, "loss_control": 1.0 + gain, "sensitivity": gain, "sensitivity_interval": [gain - 0.1, gain + 0.1],
              "count": num_windows, "window_sensitivities": [gain] * num_windows} for d, region in ((8, "inside"), (300, "past"))]
    entry = {"probe": "copy", "split": "validation", "extension": "none", "seed": 0, "span": 4,
             "num_windows": num_windows, "distances": [8, 300], "kinds": ["random"], "train_context": 256,
             "windows_sha256": windows, "reach": {"random": 300}, "cells": cells, **extra}
    if matched:
        entry["matched_sha256"] = "m" + windows
        for c in cells:
            c.update(loss_matched=1.0 + gain, retrieval_gain=gain, retrieval_interval=[gain - 0.1, gain + 0.1],
                     window_retrieval_gains=[gain] * num_windows)
    return entry


@pytest.mark.slow
def test_the_gain_figure_keeps_its_legend_off_both_panels() -> None:
    """24 groups (a full sweep and the window baseline): the legend sits right of the panels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from posbench.report.probes import _gain_figure

    groups = {f"method{i}": [fake_probe_entry(0.1 * i)] for i in range(24)}
    fig = _gain_figure(groups, "random")
    FigureCanvasAgg(fig).draw()  # lays the figure out as savefig does
    legend = fig.axes[1].get_legend()
    assert len(legend.get_texts()) == 24
    box = legend.get_window_extent()
    assert box.x1 <= fig.bbox.x1 + 1 and not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes)


def test_a_probe_measured_otherwise_is_kept_beside_the_runs_entry() -> None:
    """``posbench eval eval.copy.num_windows=8`` never silently replaces the training-time
    64-window entry (and its reach): it is stored beside it as a variant; eval.replace=true
    makes it the run's entry and keeps the old one as ``replaced``."""
    own = fake_probe_entry(1.0)
    fewer = fake_probe_entry(0.5, windows="w8", num_windows=8, checkpoint_step=6)
    merged = merge_probe_entries([own], [fewer])
    assert merged == [own, {**fewer, "variant": "num_windows=8"}]
    again = merge_probe_entries(merged, [fake_probe_entry(0.7, windows="w8", num_windows=8)])
    assert [(e.get("variant"), e["cells"][0]["sensitivity"]) for e in again] == [(None, 1.0), ("num_windows=8", 0.7)]
    lines: list[str] = []
    replaced = merge_probe_entries([own], [fewer], replace=True, log=lines.append)
    assert replaced == [{**own, "variant": "replaced"}, fewer] and "eval.replace=true" in lines[0]
    # the same measurement again (same windows and settings) takes the run's entry's place
    assert merge_probe_entries([own], [fake_probe_entry(1.0, checkpoint_step=6)]) == [fake_probe_entry(1.0, checkpoint_step=6)]
    # another precision than the run's own (recorded) is a variant too
    assert merge_probe_entries([own], [fake_probe_entry(1.0, precision="fp32")],
                               recorded={"precision": "bf16"})[1]["variant"] == "precision=fp32"
    # a variant is no summary scalar of the run
    assert probe_summary(merged) == probe_summary([own])


def test_probe_lines_pool_one_entry_per_run_of_one_measurement(tmp_path: Path) -> None:
    """A run with a validation and a test entry counts once per line (no t-interval across its
    own two entries); entries on other windows are their own line, never pooled."""
    from posbench.report.probes import cell_intervals, copy_markdown, probe_groups
    from posbench.runs.results import write_results
    from posbench.runs.run_record import discover_runs
    from unit.report.test_compare import make_run

    for seed, probes in ((0, [fake_probe_entry(1.0), fake_probe_entry(2.0, split="test")]),
                         (1, [fake_probe_entry(1.2), fake_probe_entry(0.2, windows="w8", num_windows=8,
                                                                       variant="num_windows=8")]),
                         (2, [fake_probe_entry(0.1, windows="other", span=8)])):
        results = make_run(tmp_path / "s" / f"rope-{seed}", "rope", seed)
        write_results(tmp_path / "s" / f"rope-{seed}", {**results, "probes": probes})
    groups = probe_groups(discover_runs([tmp_path / "s"])[0])
    assert {label: [e["cells"][0]["sensitivity"] for e in entries] for label, entries in groups.items()} == {
        "rope (validation, windows=w64)": [1.0, 1.2], "rope (test)": [2.0],
        "rope (validation, num_windows=8)": [0.2], "rope (validation, windows=other)": [0.1]}
    assert cell_intervals(groups["rope (test)"])[("random", "inside", 8)].kind == "bootstrap"
    table = copy_markdown(groups)
    assert "| group | runs | k | windows per cell | reach (random) |" in table
    assert "| rope (validation, windows=other) | 1 | 8 | 64 |" in table and "k - 1 tokens" in table
    assert "of the grid. The reference is the retrieval gain" in table  # the definition keeps its capitals


@pytest.mark.slow
def test_probes_only_adds_the_probe_and_leaves_the_loss_entries_alone(trained_run, monkeypatch) -> None:
    """``posbench eval probes_only=true``: the copy probe on a finished run without re-running its
    loss curves; the run's eval entries (its headline) stay byte for byte; without a probe named
    it is one clear line."""
    from helpers import compose_config

    from posbench.commands.eval import evaluate_saved_run
    from posbench.runs.results import read_results

    run = trained_run("method=rope")
    before = read_results(run)
    assert "probes" not in before
    probe_options = ["eval.probes=[copy]", "eval.copy.distances=[8]", "eval.copy.span=4",
                     "eval.copy.num_windows=4", "eval.copy.kinds=[random]"]
    def no_loss_curves(*args, **kwargs):
        raise AssertionError("probes_only=true must not evaluate the loss curves")

    monkeypatch.setattr("posbench.commands.eval.evaluate_model", no_loss_curves)
    evaluate_saved_run(compose_config("eval", [f"run={run}", "probes_only=true", *probe_options]), log=lambda _: None)
    after = read_results(run)
    assert after["eval"] == before["eval"] and "eval_variants" not in after
    (entry,) = after["probes"]
    assert entry["probe"] == "copy" and entry["checkpoint_step"] == before["train"]["steps"]
    with pytest.raises(PosbenchError, match=r"probes_only=true runs only the probes; name them"):
        evaluate_saved_run(compose_config("eval", [f"run={run}", "probes_only=true"]), log=lambda _: None)
    with pytest.raises(PosbenchError, match="probes_only must be true or false"):
        evaluate_saved_run(compose_config("eval", [f"run={run}", "probes_only=3", *probe_options]), log=lambda _: None)


def test_entries_written_before_the_matched_control_load_without_a_retrieval_gain(tmp_path: Path) -> None:
    """A results.json entry without the matched control (its ``gain`` is the sensitivity) loads
    everywhere, and is shown as lacking the retrieval gain and the reach, never as having them."""
    from posbench.evaluation.probes.copy import entry_reach, format_gains, has_matched
    from posbench.report.probes import cell_intervals, copy_csv, copy_markdown, mean_reach
    from posbench.report.probes import probe_groups as groups_of
    from posbench.runs.results import write_results
    from posbench.runs.run_record import discover_runs
    from unit.report.test_compare import make_run

    old = fake_probe_entry(1.0, matched=False)
    assert not has_matched(old) and entry_reach(old, "random") is None and mean_reach([old], "random") is None
    assert probe_summary([old]) == {"probe/copy/random/inside/sensitivity_d8": 1.0,
                                    "probe/copy/random/past/sensitivity_d300": 1.0}  # no reach, no retrieval
    assert format_gains(old).startswith("sensitivity only") and "/" not in format_gains(old)
    text = {**fake_probe_entry(0.5), "kinds": ["text"]}
    for c in text["cells"]:
        c["kind"] = "text"
    assert format_gains(text) == ("retrieval gain/sensitivity: text inside 8:+0.50/+0.50 | "
                                  "text past 300:+0.50/+0.50")  # every kind of the entry, not only random
    assert cell_intervals([old], "retrieval") == {} and cell_intervals([old], "sensitivity")
    # a run re-measured on the same windows: the new entry takes the old one's place, and says so
    lines: list[str] = []
    new = fake_probe_entry(0.0, checkpoint_step=6)
    merged = get_probe("copy").merge([old], [new], False, lines.append, None)
    assert merged == [new] and "adds the matched control" in lines[0]
    # two runs of one method, one of each: separate lines, the old one marked and without retrieval gain
    for seed, entry in ((0, old), (1, fake_probe_entry(0.25))):
        write_results(tmp_path / f"rope-{seed}", {**make_run(tmp_path / f"rope-{seed}", "rope", seed), "probes": [entry]})
    groups = groups_of(discover_runs([tmp_path])[0])
    assert sorted(groups) == ["rope", "rope (no matched control)"]
    table = copy_markdown(groups)
    retrieval = table.split("## Retrieval gain, random spans")[1].split("##")[0]
    assert f"| rope (no matched control) | {NO_MATCHED} |" in retrieval and "+1.000" not in retrieval
    assert "| rope | +0.250 ± 0.000 | +0.250 ± 0.000 |" in retrieval  # (every window gains 0.25 here)
    assert "| rope (no matched control) | +1.000 ± 0.000 |" in table.split("## Sensitivity, random spans")[1]
    rows = {(r.split(",")[0], r.split(",")[3]): r.split(",") for r in copy_csv(groups).splitlines()[1:]}
    assert rows[("rope (no matched control)", "8")][4:9] == ["", "", "", "", "0"]  # no retrieval gain, 0 runs
    assert rows[("rope (no matched control)", "8")][9] == "1.000000" and rows[("rope", "8")][4] == "0.250000"


def test_a_stored_entry_of_the_previous_format_loads() -> None:
    """A copy probe entry as earlier versions wrote it into results.json (a cpu_quick run in docs/):
    its sensitivity, stored as ``gain``, reads back as ``sensitivity``."""
    import json

    from posbench.evaluation.probes.copy import entry_reach, has_matched
    from posbench.report.probes import copy_markdown
    from posbench.runs.results import read_results

    stored = Path(__file__).resolve().parents[3] / "docs" / "cpu_quick" / "runs" / "rope-s0" / "results.json"
    (raw,) = [e for e in json.loads(stored.read_text())["probes"] if e.get("extension", "none") == "none"]
    (entry,) = [e for e in read_results(stored)["probes"] if e.get("extension", "none") == "none"]
    assert "gain" in raw["cells"][0] and "sensitivity" not in raw["cells"][0]  # the file keeps the old name
    assert [c["sensitivity"] for c in entry["cells"]] == [c["gain"] for c in raw["cells"]]
    assert not any("gain" in c or "window_gains" in c for c in entry["cells"])
    assert not has_matched(entry) and entry["reach"]["random"] == 0  # its stored reach followed the old definition
    assert entry_reach(entry, "random") is None and "retrieval" not in " ".join(probe_summary([entry]))
    assert NO_MATCHED in copy_markdown({"rope": [entry]})


def test_an_old_record_with_gain_reads_and_reports_as_sensitivity(tmp_path: Path) -> None:
    """results.json written before the rename (the sensitivity under ``gain``, ``interval``,
    ``gain_se``, ``window_gains``) loads through the one read path, and its numbers reach the
    tables and the tracker summary unchanged; a record in the new names is left as it is."""
    from posbench.report.probes import cell_intervals, probe_groups
    from posbench.runs.results import OLD_COPY_CELL_KEYS, read_results, upgrade_results, write_results
    from posbench.runs.run_record import discover_runs
    from unit.report.test_compare import make_run

    old = fake_probe_entry(1.5)
    for c in old["cells"]:
        for new_key, old_key in {v: k for k, v in OLD_COPY_CELL_KEYS.items()}.items():
            if new_key in c:
                c[old_key] = c.pop(new_key)
        c["gain_se"] = 0.05
    assert "gain" in old["cells"][0] and "sensitivity" not in old["cells"][0]
    results = make_run(tmp_path / "s" / "rope-0", "rope", 0)
    passkey = [{"probe": "passkey", "cells": [{"gain": 2.0}]}]
    write_results(tmp_path / "s" / "rope-0", {**results, "probes": [old], "passkey": passkey})
    read = read_results(tmp_path / "s" / "rope-0")
    cell = read["probes"][0]["cells"][0]
    assert (cell["sensitivity"], cell["sensitivity_interval"], cell["sensitivity_se"]) == (1.5, [1.4, 1.6], 0.05)
    assert cell["window_sensitivities"] == [1.5] * 64 and not {"gain", "interval", "gain_se", "window_gains"} & set(cell)
    assert read["passkey"] == passkey  # the passkey probe's gain is a gain: untouched
    assert probe_summary(read["probes"])["probe/copy/random/past/sensitivity_d300"] == 1.5
    (entries,) = probe_groups(discover_runs([tmp_path / "s"])[0]).values()
    assert cell_intervals(entries, "sensitivity")[("random", "inside", 8)].mean == 1.5
    new = {"probes": [fake_probe_entry(0.5)]}
    assert upgrade_results(json.loads(json.dumps(new))) == new
