"""The image task (docs/images.md): Fashion-MNIST patches against the images they came from, the
held-out splits, the canvas and zoom geometry, the baselines against a naive re-derivation, bad
input in one line, and a tiny run end to end through the trainer, the evaluation and the plot."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import compose_config, posbench_cli

from posbench.core.errors import PosbenchError
from posbench.data.images import load_images, unpatchify, zoom
from posbench.methods import list_methods
from posbench.tasks import TEST, TRAIN, VALID, make_task
from posbench.tasks.images import held_out

C = 49  # 7 x 7 patches of 4 px


@pytest.fixture(scope="module")
def task():
    return make_task({"name": "fashion", "tests": ["canvas", "zoom"]}, C)


@pytest.fixture(scope="module")
def splits():
    return load_images("sample", "train"), load_images("sample", "test")


def pixels(batch, side: int, patch: int = 4) -> torch.Tensor:
    """A batch's features back to (N, side * patch, side * patch) uint8 images."""
    patches = torch.from_numpy(np.rint(batch.features * 255).astype(np.uint8))
    return unpatchify(patches, (side, side), patch)


def rows_of(images: torch.Tensor, pool: torch.Tensor) -> list[int]:
    """The index in ``pool`` of each image (each must be there)."""
    flat = pool.reshape(len(pool), -1)
    found = []
    for image in images.reshape(len(images), -1):
        (hits,) = torch.nonzero((flat == image).all(dim=1), as_tuple=True)
        assert len(hits) >= 1, "an image that is not in the pool"
        found.append(int(hits[0]))
    return found


def test_training_batches_are_patches_of_training_images(task, splits):
    train, _ = splits
    batch = task.train_batch(run_seed=0, step=3, batch_size=16)
    assert batch.features.shape == (16, 49, 16) and batch.features.dtype == np.float32
    assert batch.answers.shape == (16, 1) and batch.answers.all() and batch.labels.shape == (16, 1)
    assert 0.0 <= batch.features.min() and batch.features.max() <= 1.0
    images = pixels(batch, 7)
    valid = torch.from_numpy(held_out(train.labels.numpy()))
    rows = rows_of(images, train.images)
    assert not valid[rows].any(), "a validation image in a training batch"
    assert [int(train.labels[r]) for r in rows] == batch.labels[:, 0].tolist()
    x, y = batch.inputs_targets()
    assert x.dtype == torch.float32 and x.shape == (16, 49, 16) and y.shape == (16, 1)
    assert (task.train_batch(0, 3, 16).features == batch.features).all()  # a pure function of (seed, step)
    assert not (task.train_batch(1, 3, 16).features == batch.features).all()


@pytest.mark.slow
def test_validation_and_test_images_are_held_out(task, splits):
    train, test = splits
    valid = held_out(train.labels.numpy())
    assert valid.sum() == 500 and np.bincount(train.labels.numpy()[valid]).tolist() == [50] * 10
    val = task.sequences(VALID, C, 500)
    assert sorted(rows_of(pixels(val, 7), train.images)) == sorted(np.flatnonzero(valid).tolist())
    batch = task.sequences(TEST, C, 1000, "canvas")  # the whole official test split, once each
    rows = rows_of(pixels(batch, 7), test.images)
    assert sorted(rows) == list(range(1000))
    assert batch.labels[:, 0].tolist() == [int(test.labels[r]) for r in rows]
    assert np.bincount(batch.labels[:, 0]).tolist() == [100] * 10


def test_both_protocols_are_the_image_itself_at_the_training_size(task):
    canvas, zoomed = (task.sequences(TEST, C, 40, test) for test in ("canvas", "zoom"))
    assert (canvas.features == zoomed.features).all() and (canvas.labels == zoomed.labels).all()


def placed_offsets(small: torch.Tensor, big: torch.Tensor) -> list[tuple[int, int]]:
    """Where each 28 x 28 image lies on its canvas, checking it is there unchanged and alone."""
    offsets = []
    for image, placed in zip(small, big):
        top, left = (int(v) for v in torch.nonzero(placed).min(dim=0).values - torch.nonzero(image).min(dim=0).values)
        assert (placed[top:top + 28, left:left + 28] == image).all(), "the image pasted unchanged"
        assert int(placed.sum()) == int(image.sum()), "and nothing else on the canvas"
        offsets.append((top, left))
    return offsets


@pytest.mark.parametrize("length, side", [(196, 14), (784, 28)])
def test_canvas_and_zoom_geometry(task, length, side):
    small = pixels(task.sequences(TEST, C, 30, "canvas"), 7)  # (30, 28, 28)
    canvas = task.sequences(TEST, length, 30, "canvas")
    zoomed = task.sequences(TEST, length, 30, "zoom")
    assert canvas.features.shape == zoomed.features.shape == (30, length, 16)
    assert (canvas.labels == zoomed.labels).all()  # the same images at every size and protocol (paired)
    offsets = set(placed_offsets(small, pixels(canvas, side)))
    assert len(offsets) > 10  # seeded places, not one
    assert all(top % 4 == 0 and left % 4 == 0 for top, left in offsets)  # on the patch grid: the training patches
    assert (pixels(zoomed, side) == zoom(small, 4 * side)).all()
    again = task.sequences(TEST, length, 30, "canvas")
    assert (again.features == canvas.features).all()  # the offsets are seeded


def test_pixel_canvas_offsets_cut_the_image_into_other_patches():
    pixel = make_task({"name": "fashion", "canvas_offsets": "pixel"}, C)
    small = pixels(pixel.sequences(TEST, C, 30, "canvas"), 7)
    offsets = placed_offsets(small, pixels(pixel.sequences(TEST, 196, 30, "canvas"), 14))
    assert sum(top % 4 != 0 or left % 4 != 0 for top, left in offsets) > 15
    assert (pixel.sequences(TEST, C, 30, "canvas").features == make_task({"name": "fashion"}, C).sequences(
        TEST, C, 30, "canvas").features).all()  # at 28 px the same images


def naive_ink_guess(images: np.ndarray, train_images: np.ndarray, train_labels: np.ndarray, normalise: bool):
    """Nearest class centroid of 16-bin histograms of the non-zero pixel values, one image at a time."""
    def histogram(image):
        values = image[image > 0].astype(int)
        h = np.array([np.sum((values - 1) * 16 // 255 == k) for k in range(16)], dtype=float)
        return h / max(h.sum(), 1) if normalise else h

    centroids = [np.mean([histogram(im) for im in train_images[train_labels == c]], axis=0) for c in range(10)]
    return np.array([np.argmin([np.sum((histogram(im) - m) ** 2) for m in centroids]) for im in images])


@pytest.mark.slow
def test_baselines_are_chance_and_a_position_free_nearest_centroid(task, splits):
    train, _ = splits
    keep = ~held_out(train.labels.numpy())
    batch = task.sequences(TEST, C, 200, "canvas")
    guesses = task.baselines(batch)
    assert set(guesses) == {"chance", "ink_histogram", "ink_counts"} and (guesses["chance"] == 0.1).all()
    images = pixels(batch, 7).numpy()
    for name, normalise in (("ink_histogram", True), ("ink_counts", False)):
        expected = naive_ink_guess(images, train.images.numpy()[keep], train.labels.numpy()[keep], normalise)
        assert (guesses[name][:, 0] == (expected == batch.labels[:, 0])).all(), name
    accuracy = task.baseline_accuracy(batch)
    assert 0.15 < accuracy["ink_histogram"] < 0.4 and accuracy["chance"] == pytest.approx(0.1)
    # a blank canvas adds only background: the guesses, which read no position, do not move
    big = task.baselines(task.sequences(TEST, 784, 200, "canvas"))
    assert all((big[k] == guesses[k]).all() for k in guesses)


def test_the_one_answer_is_past_the_training_grid_on_a_larger_grid(task):
    assert task.beyond_context(C).tolist() == [False] and task.beyond_context(196).tolist() == [True]
    assert task.position_bands(196) == {} and task.answer_axes(task.sequences(TEST, 196, 2, "zoom")) == {}
    assert task.layout == "grid" and task.head == "pooled" and task.patch_dim == 16 and task.vocab_size == 10
    assert task.length_note(196, {"patch": 4}) == " (56 px)"


def test_the_learnt_at_c_gate_reads_canvas_at_28_px(task):
    """fashion has no standard test: the gate reads its reference test, canvas (the first of TESTS)."""
    from posbench.evaluation.tasks import learnt_at_c, task_entry

    entries = []
    for test, right in (("canvas", 14), ("zoom", 19)):  # of 20 images
        batch = task.sequences(TEST, C, 20, test)
        correct = (np.arange(20) < right)[:, None]  # (N, 1): one answer per image
        entries.append(task_entry(task, batch, correct, np.zeros((20, 1)), length=C, train_context=C, test=test))
    assert entries[0]["answers"] == 20 and entries[0]["accuracy"]["mean"] == pytest.approx(0.7)
    verdict = learnt_at_c({"name": "fashion", "options": {}, "entries": entries}, C)
    assert verdict["test_set"] == "canvas" and verdict["value"] == pytest.approx(0.7)
    assert verdict["threshold"] == 0.75 and not verdict["learnt"]


@pytest.mark.parametrize("section, context, message", [
    ({"name": "fashion", "patch": 5}, C, "task.patch=5 does not divide the 28 x 28 images; pick one of 1, 2, 4, 7, 14, 28"),
    ({"name": "fashion"}, 64, "trainer.context=64 is a 8 x 8 grid, but 28 x 28 images in patches of 4 make a 7 x 7 "
                              "grid; set trainer.context=49"),
    ({"name": "fashion", "patch": 7}, C, "set trainer.context=16"),
    ({"name": "fashion", "tests": ["canvas", "shifted"]}, C, "choose distinct test sets among canvas, zoom"),
    ({"name": "fashion", "source": "/nonexistent/fm"}, C, "is not a file or folder"),
    ({"name": "fashion", "canvas_offsets": "cell"}, C, "task.canvas_offsets='cell': choose patch (offsets on the patch "
                                                       "grid) or pixel (any offset) (task=fashion)"),
])
def test_bad_task_options_are_one_line(section, context, message):
    with pytest.raises(PosbenchError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        make_task(section, context)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["eval.lengths=[49,200]"], r"eval.lengths: 200 is not a square grid of at least 7 x 7 patches; s x s patches "
                                r"of 4 px are an image of 4s px, e.g. 49 \(28 px\), 196 \(56 px\), 784 \(112 px\)"),
    (["eval.lengths=[16,49,196]"], r"has a length below trainer.context=49; .* e.g. eval.lengths=\[49,196\]$"),
    (["eval.num_sequences=1001"], r"eval.num_sequences=1001 but task.source=sample has 1000 test images \(each is "
                                  r"used once\); set eval.num_sequences <= 1000"),
    (["trainer.val_extrapolation_sequences=501"], "trainer.val_extrapolation_sequences=501 but task.source=sample has "
                                                  "500 validation images"),
    (["task.patch=3"], "task.patch=3 does not divide"),
    (["method=rope"], "method=rope is a sequence method and task=fashion runs on the grid encoder"),
])
def test_bad_run_settings_are_refused_before_any_work(overrides, message):
    from posbench.runs.spec import build_spec

    with pytest.raises(PosbenchError, match=message) as err:
        build_spec(compose_config("train", ["task=fashion", "method=axial_rope", *overrides]))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [["trainer.context=64"], ["trainer.context=64", "eval.lengths=[64,256]"]])
def test_a_context_the_images_cannot_make_is_refused_first_with_the_context_that_works(overrides):
    """At trainer.context=64 the lengths were refused first, with a hint (eval.lengths=[64,256])
    that was then refused with "set trainer.context=49"."""
    from posbench.runs.spec import build_spec

    with pytest.raises(PosbenchError, match=r"patches of 4 make a 7 x 7 grid; set trainer.context=49$"):
        build_spec(compose_config("train", ["task=fashion", "method=axial_rope", *overrides]))
    spec = build_spec(compose_config("train", ["task=fashion", "method=axial_rope", "trainer.context=49"]))
    assert spec.trainer.context == 49


def test_the_run_spec_builds_the_patch_model_from_the_task():
    from posbench.runs.spec import build_spec

    spec = build_spec(compose_config("train", ["task=fashion", "method=nope"]))
    assert (spec.model.layout, spec.model.patch_dim, spec.model.head) == ("grid", 16, "pooled")
    assert spec.trainer.context == 49 and spec.eval.lengths == [49, 196, 784] and spec.task.tests == ("canvas", "zoom")
    assert spec.model.to_dict()["patch_dim"] == 16
    life = build_spec(compose_config("train", ["task=life", "method=nope"])).model
    assert (life.patch_dim, life.head) == (None, "tokens") and "head" not in life.to_dict()


# ----------------------------------------------------------------------------- end to end

QUICK_IMAGES = ["logger=none", "trainer.max_steps=4", "trainer.batch_size=8", "trainer.log_every=2",
                "trainer.val_every=2", "trainer.val_sequences=8", "trainer.val_extrapolation_sequences=4",
                "trainer.warmup_steps=1", "trainer.precision=fp32", "eval.lengths=[49,196]", "eval.num_sequences=8",
                "eval.batch_size=8", "task.learnt_at_c=0"]


@pytest.mark.slow
def test_the_images_sweep_trains_the_task_and_plots_it_by_protocol_and_size(tmp_path):
    """``experiment=images`` through the command line: the grid methods named (rope, a sequence
    method, is left out by the sweeper) x seeds, then ``posbench plot`` of the runs."""
    sweep = tmp_path / "sweep"
    proc = posbench_cli("train", "-m", "experiment=images", "task=fashion", "method=axial_rope,nope,rope", "seed=0,1",
                        *QUICK_IMAGES, f"hydra.sweep.dir={sweep}")
    assert "leaving out the jobs of 1 method(s) not made for the grid encoder (a grid task): rope" in proc.stdout + proc.stderr
    runs = sorted(p for p in sweep.iterdir() if (p / "results.json").exists())
    assert sorted(json.loads((p / "results.json").read_text())["method"] for p in runs) == [
        "axial_rope", "axial_rope", "nope", "nope"]
    runs.sort(key=lambda p: (json.loads((p / "results.json").read_text())["method"] != "axial_rope", p.name))
    results = json.loads((runs[0] / "results.json").read_text())
    entries = results["task"]["entries"]
    assert [(e["test_set"], e["length"]) for e in entries] == [("canvas", 49), ("canvas", 196), ("zoom", 49),
                                                               ("zoom", 196)]
    assert all(e["answers"] == 8 and e["by_position"] == {} for e in entries)
    assert entries[0]["sequences_sha256"] == entries[2]["sequences_sha256"]  # both protocols: the image itself
    assert set(entries[1]["baselines"]) == {"chance", "ink_histogram", "ink_counts"}
    assert results["task"]["learnt_at_c"]["test_set"] == "canvas"
    metrics = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert any("val_accuracy_49_196" in row for row in metrics)
    out = tmp_path / "cmp"
    posbench_cli("plot", f"runs=[{','.join(map(str, runs))}]", f"out={out}")
    table = (out / "tasks.md").read_text()
    assert "### test set `canvas`" in table and "### test set `zoom`" in table
    assert "| method | seeds | 7x7 (28 px) | 14x14 (56 px) | interval | not learnt at C |" in table
    assert "| *baseline: ink_histogram* |" in table and "ring" not in table
    assert "Training context 7x7 (28 px) = 49 cells" in table
    paired = (out / "tasks_paired.md").read_text()
    for where in ("canvas 7x7 (28 px)", "canvas 14x14 (56 px)", "zoom 7x7 (28 px)", "zoom 14x14 (56 px)"):
        assert re.search(rf"\| {re.escape(where)} \| (nope \| axial_rope|axial_rope \| nope) \| .* \| 0,1 \|", paired), where
    assert (out / "tasks_fashion.png").stat().st_size > 0


@pytest.mark.slow
def test_viz_of_an_image_run_draws_its_attention_on_canvas_images(tmp_path):
    from posbench.train.trainer import train
    from posbench.viz.command import run_viz

    run = tmp_path / "fashion-axial_rope-s0"
    train(compose_config("train", ["task=fashion", "method=axial_rope", *QUICK_IMAGES]), run, log=lambda _: None)
    out = tmp_path / "viz"
    written = run_viz(compose_config("viz", [f"run={run}", f"out={out}", "span=2", "attention.num_sequences=2",
                                             "wandb=false"]), log=lambda _: None)
    assert {p.name for p in written} >= {"grid_attention_distance.png", "grid_attention_layer0.png"}
    numbers = json.loads((out / "grid_attention_distance.json").read_text())
    assert numbers["train_side"] == 7 and numbers["sides"] == [7, 14]


def test_an_npz_source_is_read_and_its_sizes_bound_the_held_out_sets(tmp_path, splits):
    train, test = splits
    path = tmp_path / "small.npz"
    np.savez(path, x_train=train.images[:200].numpy(), y_train=train.labels[:200].numpy(),
             x_test=test.images[:50].numpy(), y_test=test.labels[:50].numpy())
    small = make_task({"name": "fashion", "source": str(path)}, C)
    valid = held_out(train.labels[:200].numpy())
    assert [len(small.pools[s][1]) for s in (TRAIN, VALID, TEST)] == [200 - valid.sum(), valid.sum(), 50]
    assert (pixels(small.sequences(TEST, C, 50, "zoom"), 7).sum(dim=(1, 2)) > 0).all()  # every image has ink
    with pytest.raises(PosbenchError, match=f"eval.num_sequences=51 but task.source={path} has 50 test images"):
        small.check_sizes({"eval.num_sequences": 51})


@pytest.mark.parametrize("method", list_methods("grid"))
def test_every_grid_method_reads_images_at_every_size(task, method):
    """Each method of the images sweep builds from the preset and answers at 28, 56 and 112 px."""
    from posbench.evaluation.tasks import answer_scores
    from posbench.model.transformer import build_model
    from posbench.runs.spec import build_spec

    spec = build_spec(compose_config("train", ["task=fashion", f"method={method}"]))
    torch.manual_seed(0)
    model = build_model(replace(spec.model, vocab_size=task.vocab_size), spec.method, spec.method_options)
    assert model.patch_embed.in_features == 16 and model.lm_head.out_features == 10
    for length in spec.eval.lengths:
        batch = task.sequences(TEST, length, 2, "zoom")
        correct, loss = answer_scores(model, batch, 2, torch.device("cpu"))
        assert correct.shape == loss.shape == (2, 1) and np.isfinite(loss).all(), (method, length)
