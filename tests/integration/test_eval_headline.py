"""`posbench eval` never changes a run's headline behind the user's
back; in-training validation reads a spread subset; a checkpoint from other model code and ignored
or bad settings are refused in one line. Tiny models, CPU, a few steps."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import QUICK_TRAIN, QUIET, compose_config, results_of, run_eval, run_train

from posbench.core.errors import PosbenchError
from posbench.evaluation.loss import headline
from posbench.runs.spec import build_spec


@pytest.fixture
def rope_run(trained_run) -> Path:
    """A finished tiny rope run of its own for each test (a copy: training once is enough)."""
    run_dir = trained_run("method=rope")
    assert results_of(run_dir)["eval"][0]["num_sequences"] == 4  # the run's own windows
    return run_dir


# ------------------------------------------------------ eval never moves the headline


@pytest.mark.slow
def test_the_readme_extension_example_keeps_the_headline_bitwise(rope_run, tmp_path):
    """The README's worked example (`posbench eval run=R 'eval.extension=[none,ntk,yarn]'
    eval.num_sequences=...`) on other windows than the run's: the run's entries and headline
    stay bitwise as they were; the new entries are kept beside them, labelled by what differs."""
    before = results_of(rope_run)
    lines: list[str] = []
    run_eval(rope_run, "eval.extension=[none,ntk,yarn]", "eval.num_sequences=2", log=lines.append)
    after = results_of(rope_run)
    assert headline(after, "32-64") == headline(before, "32-64")  # == on floats read back: bitwise
    assert after["eval"] == before["eval"]
    variants = {(v["length"], v["extension"], v["variant"]): v for v in after["eval_variants"]}
    assert set(variants) == {(64, ext, "num_sequences=2") for ext in ("none", "ntk", "yarn")}
    assert all(v["num_sequences"] == 2 for v in variants.values())
    assert variants[(64, "none", "num_sequences=2")]["bands"]["32-64"] != headline(before, "32-64")
    assert any("eval_variants" in line and "num_sequences=2" in line for line in lines)

    # The same example on the run's own windows (the default): ntk and yarn join the run's entries,
    # paired with its plain one; the plain one and the headline stay as they were.
    run_eval(rope_run, "eval.extension=[none,ntk,yarn]")
    again = results_of(rope_run)
    assert headline(again, "32-64") == headline(before, "32-64")
    assert [(e["length"], e["extension"]) for e in again["eval"]] == [(64, "none"), (64, "ntk"), (64, "yarn")]
    assert again["eval"][0] == before["eval"][0]
    assert {e["sequences_sha256"] for e in again["eval"]} == {before["eval"][0]["sequences_sha256"]}
    assert again["eval_variants"] == after["eval_variants"]

    # Every reader of results.json still reads the training-time entry: the method comparison table.
    from posbench.report.plot import plot_runs

    plot_runs([str(rope_run)], str(tmp_path / "figs"), formats=("png",), log=QUIET)
    row = next(line for line in (tmp_path / "figs" / "bands.md").read_text().splitlines() if line.startswith("| rope |"))
    assert f"| {before['eval'][0]['bands']['32-64']:.4f} ± " in row


@pytest.mark.slow
def test_eval_takes_the_runs_own_settings_by_default(rope_run):
    """No eval.* given: the run's own lengths, count and windows (not the global defaults of
    512-2048 and 256 windows); the same measurement is not written twice."""
    before = results_of(rope_run)
    lines: list[str] = []
    run_eval(rope_run, log=lines.append)
    after = results_of(rope_run)
    assert after["eval"] == before["eval"] and "eval_variants" not in after
    assert any("validation length 64: the run's plain entry is reused (the same 4 windows" in line for line in lines)


@pytest.mark.slow
def test_an_extension_reuses_the_runs_plain_entry_and_is_drawn(rope_run, monkeypatch):
    """`posbench eval run=R eval.extension=[ntk]` on the run's own windows measures only ntk: the
    plain pass and the windowed pass are not run again, the extension's windowed curve and cost come
    from the run's plain entry (equal to a fresh measurement to rounding), and the run's figures
    show the extension curves."""
    import posbench.evaluation.loss as loss

    before = results_of(rope_run)
    passes = {"full": 0, "windowed": 0}

    def counting(name: str, key: str):
        real = getattr(loss, name)

        def counted(*args, **kwargs):
            passes[key] += 1
            return real(*args, **kwargs)
        return counted

    for name, key in (("per_sequence_loss", "full"), ("windowed_loss", "windowed")):
        monkeypatch.setattr(loss, name, counting(name, key))
    run_eval(rope_run, "eval.extension=[none,ntk]")
    assert passes == {"full": 1, "windowed": 0}  # ntk only: no plain pass, no windowed pass
    reused = results_of(rope_run)
    assert reused["eval"][0] == before["eval"][0]
    ntk = reused["eval"][1]
    assert ntk["extension"] == "ntk" and ntk["windowed"] == before["eval"][0]["windowed"]
    assert (rope_run / "figures" / "extension_curves.png").is_file()

    run_eval(rope_run, "eval.extension=[none,ntk]", "eval.replace=true")  # measured again, from scratch
    assert passes == {"full": 3, "windowed": 1}
    fresh = next(e for e in results_of(rope_run)["eval"] if e["extension"] == "ntk")
    assert fresh["bands"] == ntk["bands"]
    for band, value in fresh["cost"]["bands"].items():
        assert ntk["cost"]["bands"][band] == pytest.approx(value, abs=1e-6)
        np.testing.assert_allclose(ntk["cost"]["sequence_bands"][band], fresh["cost"]["sequence_bands"][band],
                                   atol=1e-6)
    np.testing.assert_allclose(ntk["cost"]["loss_by_position"], fresh["cost"]["loss_by_position"], atol=1e-5)
    assert ntk["effective_length"] == fresh["effective_length"]


@pytest.mark.slow
def test_a_new_length_never_becomes_the_headline(tmp_path):
    """A run evaluated at 128 only has its 32-64 headline there; adding length 64 later (whose
    entry also holds 32-64, and sorts first) leaves the headline at the training-time entry."""
    run_dir = tmp_path / "run"
    run_train(run_dir, "method=rope", "eval.lengths=[128]")
    before = results_of(run_dir)
    run_eval(run_dir, "eval.lengths=[64]")
    after = results_of(run_dir)
    assert [e["length"] for e in after["eval"]] == [64, 128] and after["eval"][0]["added"] is True
    assert headline(after, "32-64") == headline(before, "32-64") == before["eval"][0]["bands"]["32-64"]
    from posbench.runs.entries import headline_entries
    from posbench.runs.run_record import RunRecord

    assert headline_entries(after["eval"]) == [after["eval"][1]]  # what headline() and the sweep summary read
    assert RunRecord(run_dir, after).plain().results["eval"] == after["eval"]  # plots still show both lengths


@pytest.mark.slow
def test_eval_replace_true_replaces_and_keeps_the_old_entry(rope_run):
    before = results_of(rope_run)
    run_eval(rope_run, "eval.num_sequences=2", "eval.replace=true")
    after = results_of(rope_run)
    assert after["eval"][0]["num_sequences"] == 2
    assert headline(after, "32-64") == after["eval"][0]["bands"]["32-64"] != headline(before, "32-64")
    (old,) = after["eval_variants"]
    assert old["variant"] == "replaced" and {k: v for k, v in old.items() if k != "variant"} == before["eval"][0]


@pytest.mark.slow
def test_other_precision_is_a_variant_not_a_duplicate(rope_run):
    """The run trained in fp32; an eval in bf16 on the same windows is another measurement."""
    before = results_of(rope_run)
    run_eval(rope_run, "precision=bf16")
    after = results_of(rope_run)
    assert after["eval"] == before["eval"]
    assert [v["variant"] for v in after["eval_variants"]] == ["precision=bf16"]


def test_results_without_variants_or_marks_read_as_before():
    """A results.json written before eval_variants / added existed: every plain entry counts."""
    from posbench.runs.entries import headline_entries
    from posbench.runs.results import validate_results

    entry = {"split": "validation", "length": 4, "num_sequences": 1, "loss_by_position": [1.0] * 4,
             "bands": {"0-2": 1.0, "2-4": 2.0}}
    old = {"schema_version": 1, "method": "m", "seed": 0, "train_context": 2, "eval": [entry],
           "train": {k: 0 for k in ("tokens", "steps", "final_loss", "tokens_per_second", "wall_seconds", "device")}}
    assert validate_results(old) is old and headline(old, "2-4") == 2.0
    assert headline_entries([{**entry, "added": True}]) == [{**entry, "added": True}]  # only added ones: read them
    with pytest.raises(ValueError, match="eval_variants"):
        validate_results({**old, "eval_variants": [{**entry, "loss_by_position": [1.0]}]})


# --------------------------------------------------- validation reads a spread subset


@pytest.mark.slow
def test_validation_subset_is_spread_seeded_and_the_same_for_every_method(tmp_path):
    import torch

    from posbench.data import prepare_data
    from posbench.data.loader import eval_sequences, spread_sequences
    from posbench.evaluation.loss import validation_sets
    from posbench.model.transformer import build_model

    tokens = np.arange(10_000, dtype=np.uint16)
    every = eval_sequences(tokens, 64, 10_000)  # (153, 65)
    subset = spread_sequences(tokens, 64, 8)
    starts = (subset[:, 0] // 65).tolist()
    assert starts == sorted(starts) and len(set(starts)) == 8
    assert starts != list(range(8)) and starts[-1] >= every.shape[0] * 7 // 8  # reaches the end of the text
    assert torch.equal(subset, every[starts]) and torch.equal(subset, spread_sequences(tokens, 64, 8))
    assert torch.equal(spread_sequences(tokens, 64, 500), every)  # more than fit: all of them

    spec = build_spec(compose_config("train", [*QUICK_TRAIN, "method=rope", "trainer.val_sequences=8"]))
    prepared = prepare_data(spec.data, log=QUIET)
    spec = replace(spec, model=replace(spec.model, vocab_size=prepared.vocab_size))
    sets = [validation_sets(prepared, build_model(spec.model, method, {}), spec.trainer, QUIET)
            for method in ("rope", "alibi", "nope")]
    for other in sets[1:]:
        assert other.keys() == sets[0].keys() and all(torch.equal(other[k], sets[0][k]) for k in other)
    assert not torch.equal(sets[0]["val_loss"], eval_sequences(prepared.valid_tokens(), 32, 8))


@pytest.mark.slow
def test_validation_subset_mean_estimates_the_full_band_on_the_sample():
    """On the packaged TinyStories sample at C = 256 (experiment=cpu_quick's data and windows):
    the per-window mean surprisal of the C-2C targets under the training text's unigram
    distribution (a cheap stand-in for a model's loss, which varies by text as it does) over the
    8-window validation subset lies within 3 standard errors of its mean over all 366 windows;
    the first 8 windows, the old subset, do not."""
    from posbench.data import DataConfig, prepare_data
    from posbench.data.loader import eval_sequences, spread_sequences

    prepared = prepare_data(DataConfig(source="sample").validate(), log=QUIET)  # the tests' shared token cache
    counts = np.bincount(prepared.train_tokens(), minlength=prepared.vocab_size) + 1.0
    surprisal = -np.log(counts / counts.sum())
    valid = prepared.valid_tokens()

    def band(rows) -> np.ndarray:  # (N,) mean surprisal of the targets at positions 256..511
        return surprisal[rows[:, 1:].numpy()][:, 256:512].mean(axis=1)

    full = band(eval_sequences(valid, 512, 10**6))
    assert len(full) == 366
    subset, first = band(spread_sequences(valid, 512, 8)), band(eval_sequences(valid, 512, 8))
    tolerance = 3 * full.std(ddof=1) / np.sqrt(8)
    assert abs(subset.mean() - full.mean()) < tolerance, (subset.mean(), full.mean(), tolerance)
    # Measured: all 6.010 (sd 0.243 per window), subset 6.006, first 8 windows 5.710 (3.5 standard errors off).
    assert abs(first.mean() - full.mean()) > tolerance


def test_validation_windows_are_recorded_and_named_in_the_training_figure(rope_run):
    results = results_of(rope_run)
    assert results["train"]["validation_windows"] == {"val_loss": 4, "val_loss_32_64": 8}
    from posbench.report.plot import validation_subset
    from posbench.runs.run_record import RunRecord

    assert validation_subset([RunRecord(rope_run, results)], "val_loss_32_64") == "subset of 8 held-out windows"


# ------------------------------------------------- a checkpoint from other model code


def rewrite_checkpoint_weights(run_dir: Path) -> None:
    """The newest checkpoint as if the method's code had changed: one parameter gone, one new."""
    from posbench.runs.checkpoint import list_checkpoints, read_checkpoint, save_checkpoint

    path = list_checkpoints(run_dir)[-1]
    state = read_checkpoint(path)
    state.pop("format_version")
    state["model"].pop("position.bias.weight")
    state["model"]["position.old_table"] = state["model"]["embed.weight"][:2].clone()
    save_checkpoint(run_dir, state, keep=10)


def expect_one_line(err: PosbenchError) -> str:
    message = str(err)
    assert "\n" not in message
    assert "missing position.bias.weight" in message and "unexpected position.old_table" in message
    assert "re-train the run" in message
    return message


@pytest.mark.slow
def test_a_checkpoint_from_other_method_code_is_refused_by_eval_and_resume(tmp_path):
    run_dir = tmp_path / "run"
    run_train(run_dir, "method=t5", "eval.lengths=[64]")
    from posbench.runs.checkpoint import list_checkpoints, read_checkpoint

    keys = set(read_checkpoint(list_checkpoints(run_dir)[-1])["model"])
    assert "position.bias.weight" in keys and "embed.weight" in keys
    rewrite_checkpoint_weights(run_dir)
    with pytest.raises(PosbenchError) as eval_err:
        run_eval(run_dir)
    expect_one_line(eval_err.value)
    with pytest.raises(PosbenchError) as resume_err:
        run_train(run_dir, "method=t5", "trainer.max_steps=8")
    expect_one_line(resume_err.value)


# ------------------------------------------------------------- ignored or bad settings


def test_a_data_path_the_source_does_not_read_is_refused():
    with pytest.raises(PosbenchError, match=r"data.path=/no/such/folder is read only with data.source=local.*data=local"):
        build_spec(compose_config("train", ["experiment=cpu_quick", "data.path=/no/such/folder"]))
    build_spec(compose_config("train", ["experiment=cpu_quick"]))  # the sample alone is fine
    build_spec(compose_config("train", ["experiment=cpu_quick", "data=local", "data.path=/some/dir"]))


@pytest.mark.parametrize("base", ["-1", "0", "1", "nan"])
def test_a_bad_rope_base_names_method_base(base):
    with pytest.raises(PosbenchError, match=r"method=rope .*method.base=.* must be a number > 1") as err:
        build_spec(compose_config("train", [*QUICK_TRAIN, "method=rope", f"method.base={base}"]))
    assert "lr" not in str(err.value)


@pytest.mark.slow
def test_plot_and_extension_table_read_a_variant_when_asked(rope_run, tmp_path):
    """The README's worked example evaluates extensions on 2 windows (a variant) and a new length:
    `plot variant=num_sequences=2` and scripts/extension_table.py draw those, paired per length."""
    import runpy

    from posbench.report.plot import plot_runs

    run_eval(rope_run, "eval.extension=[none,ntk,yarn]", "eval.num_sequences=2", "eval.lengths=[64,128]")
    out = tmp_path / "figs"
    plot_runs([str(rope_run)], str(out), formats=("png",), log=QUIET, variant="num_sequences=2")
    table = (out / "extensions.md").read_text()
    assert "| rope | yarn | 1 |" in table and "| rope | ntk | 1 |" in table
    view = json.loads(json.dumps(results_of(rope_run)))
    from posbench.runs.run_record import RunRecord

    entries = RunRecord(rope_run, view).variant("num_sequences=2").results["eval"]
    assert [(e["length"], e["extension"], e["num_sequences"]) for e in entries] == [
        (length, ext, 2) for length in (64, 128) for ext in ("none", "ntk", "yarn")]
    main = runpy.run_path(str(Path(__file__).parents[2] / "scripts" / "extension_table.py"))["main"]
    assert "| yarn |" in main(str(rope_run), "num_sequences=2")
    with pytest.raises(PosbenchError, match="no eval_variants entries labelled 'num_sequences=3'"):
        plot_runs([str(rope_run)], str(out), formats=("png",), log=QUIET, variant="num_sequences=3")
