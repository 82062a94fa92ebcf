"""Image classification on the grid encoder: Fashion-MNIST at new resolutions (docs/images.md).

``task=fashion`` trains a small ViT: each 28 x 28 image is cut into p x p patches (``task.patch``,
4: a 7 x 7 grid, ``trainer.context`` = 49) whose pixels / 255 are the inputs (``Batch.features``,
embedded by the model's patch embedding), and the class is read from the mean of the final hidden
states (the pooled head): one answer per image, ``answers`` and ``labels`` of shape (N, 1).

It is tested on larger grids made by the two protocols of :mod:`posbench.data.images.protocols`
(``task.tests``): ``canvas`` pastes the image unchanged at a seeded place on a blank canvas (the
scale is the training one, the positions are new; by default at a multiple of the patch size, so
its patches are the training patches at other cells), ``zoom`` upsamples it (the object fills the
grid, each patch holds a smaller part of it). At the training size both are the image itself.

    training    <- the official train split less every 10th image of each class, drawn per step
    validation  <- those held-out training images (fixed order, seeded by task.seed)
    test        <- the official test split (fixed order, seeded by task.seed), never trained on

Baselines: ``chance`` (1/10) and two guesses that read no position, fitted on the training images
only: ``ink_histogram``, the nearest class centroid of the normalised histogram of the ink
(non-zero) pixel values, which neither where nor how much ink there is changes, and ``ink_counts``,
the same on the pixel counts per bin, which also reads how much ink there is (at 28 px scale).
"""

from __future__ import annotations

import math
from functools import cached_property

import numpy as np
import torch

from posbench.core.errors import PosbenchError
from posbench.data.images import CLASSES, canvas, load_images, patchify, zoom
from posbench.tasks.base import STANDARD, TEST, TRAIN, VALID, Batch, positive_int, register_task
from posbench.tasks.grid import GridTask

IMAGE_SIDE = 28
"""Fashion-MNIST images are 28 x 28 pixels."""
VALID_EVERY = 10
"""Every 10th training image of each class (in the split's order) is held out for validation."""
INK_BINS = 16
"""Bins of the ink histogram: pixel values 1..255 in 16 equal bins (0 is background, left out)."""


def held_out(labels: np.ndarray, every: int = VALID_EVERY) -> np.ndarray:
    """(N,) bool: every ``every``-th image of each class, in the split's order (class-balanced)."""
    rank = np.zeros(len(labels), dtype=np.int64)
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        rank[members] = np.arange(len(members))
    return rank % every == every - 1


def ink_histogram(pixels: np.ndarray, normalise: bool) -> np.ndarray:
    """(N, ...) pixel values 0..255 -> (N, INK_BINS) counts of the non-zero pixels per bin, or
    their fractions (``normalise``): a feature that reads no position."""
    flat = np.rint(pixels.reshape(len(pixels), -1)).astype(np.int64)  # (N, P)
    bins = np.minimum((flat - 1) * INK_BINS // 255, INK_BINS - 1)
    counts = np.stack([((bins == k) & (flat > 0)).sum(axis=1) for k in range(INK_BINS)], axis=1).astype(np.float64)
    return counts / np.maximum(counts.sum(axis=1, keepdims=True), 1) if normalise else counts


@register_task
class Fashion(GridTask):
    """Fashion-MNIST classification from patches, one pooled answer per image (module docstring)."""

    name = "fashion"
    vocab = CLASSES
    head = "pooled"
    TESTS = ("canvas", "zoom")
    PAIRED_TESTS = TESTS
    TEST_NOTES = {
        "canvas": "each test image pasted unchanged at a seeded place on a blank canvas of the size (the training "
                  "scale at new positions), one pooled answer per image; the learnt-at-C gate reads this test set. "
                  "Baselines: nearest class centroid (fitted on the training images) of the histogram of the ink "
                  "pixel values, `ink_histogram` normalised, `ink_counts` raw: guesses that read no position",
        "zoom": "each test image upsampled to the size (bilinear: the object fills the grid, each patch a smaller part "
                "of it), one pooled answer per image; baselines as for canvas",
    }
    LEARNT_AT_C = 0.75
    BASELINES = {"ink_histogram": True, "ink_counts": False}
    """Baseline name -> whether its histogram is normalised."""
    CANVAS_OFFSETS = ("patch", "pixel")
    """``task.canvas_offsets``: canvas offsets on the patch grid, or at any pixel."""

    def __init__(self, context: int, *, seed: int = 0, source: str = "sample", patch: int = 4,
                 canvas_offsets: str = "patch", tests=None, learnt_at_c=None) -> None:
        super().__init__(context, seed=seed, tests=tests, learnt_at_c=learnt_at_c)
        self.patch = positive_int(self.name, "patch", patch)
        if IMAGE_SIDE % self.patch:
            fits = ", ".join(str(p) for p in range(1, IMAGE_SIDE + 1) if IMAGE_SIDE % p == 0)
            raise PosbenchError(f"task.patch={patch} does not divide the {IMAGE_SIDE} x {IMAGE_SIDE} images; "
                                f"pick one of {fits} (task=fashion)")
        side = IMAGE_SIDE // self.patch
        if self.side != side:
            raise PosbenchError(f"trainer.context={context} is a {self.side} x {self.side} grid, but 28 x 28 images in "
                                f"patches of {self.patch} make a {side} x {side} grid; set trainer.context={side * side}")
        self.patch_dim = self.patch * self.patch
        if canvas_offsets not in self.CANVAS_OFFSETS:
            raise PosbenchError(f"task.canvas_offsets={canvas_offsets!r}: choose patch (offsets on the patch grid) "
                                "or pixel (any offset) (task=fashion)")
        self.canvas_step = self.patch if canvas_offsets == "patch" else 1
        self.source = str(source)
        train, test = load_images(self.source, "train"), load_images(self.source, "test")
        for split in (train, test):
            if tuple(split.images.shape[1:]) != (IMAGE_SIDE, IMAGE_SIDE):
                raise PosbenchError(f"task.source={self.source!r} holds {tuple(split.images.shape[1:])} images; "
                                    f"task=fashion reads 28 x 28 Fashion-MNIST images")
        valid = held_out(train.labels.numpy())
        self.pools = {TRAIN: (train.images[~valid], train.labels[~valid]),
                      VALID: (train.images[valid], train.labels[valid]), TEST: (test.images, test.labels)}

    def chance(self) -> float:
        return 1.0 / len(self.vocab)

    # ------------------------------------------------------------------ lengths and answer slots

    def check_length(self, length: int) -> None:
        """A square grid of at least the training side: s x s patches are an image of s * patch px."""
        side = math.isqrt(length)
        if side * side != length or side < self.side:
            sizes = ", ".join(f"{(k * self.side) ** 2} ({k * IMAGE_SIDE} px)" for k in (1, 2, 4))
            raise PosbenchError(f"eval.lengths: {length} is not a square grid of at least {self.side} x {self.side} "
                                f"patches; s x s patches of {self.patch} px are an image of {self.patch}s px, e.g. {sizes}")

    def check_sizes(self, sizes: dict[str, int]) -> None:
        """As many test (``eval.*``) and validation images as asked must exist (each is used once)."""
        for key, wanted in sizes.items():
            stream, split = (TEST, "test") if key.startswith("eval.") else (VALID, "validation")
            have = len(self.pools[stream][1])
            if wanted > have:
                raise PosbenchError(f"{key}={wanted} but task.source={self.source} has {have} {split} images "
                                    f"(each is used once); set {key} <= {have}")

    def beyond_context(self, length: int) -> np.ndarray:
        """The one answer reads the whole image: past the training grid when the grid is larger."""
        return np.full(1, length > self.context)

    def answer_axes(self, batch: Batch) -> dict[str, np.ndarray]:
        return {}  # one answer per image: no ring of its own

    def position_bands(self, length: int) -> dict[str, np.ndarray]:
        return {}

    @classmethod
    def length_note(cls, length: int, options: dict) -> str:
        """`` (56 px)``: the image size of a grid of ``length`` patches."""
        return f" ({math.isqrt(length) * int(options.get('patch', 4))} px)"

    # ------------------------------------------------------------------ images

    def render(self, images: torch.Tensor, labels: torch.Tensor, length: int, test: str,
               rng: np.random.Generator) -> Batch:
        """(N, 28, 28) uint8 images -> the batch of their s x s patch grids (s^2 = ``length``) by
        protocol ``test``; canvas offsets from ``rng``."""
        size = math.isqrt(length) * self.patch
        if test == "zoom":
            big = zoom(images, size)
        else:
            big, _ = canvas(images, size, seed=int(rng.integers(0, 2**62)), step=self.canvas_step)
        patches, _ = patchify(big, self.patch)  # (N, L, p*p) uint8
        n = patches.shape[0]
        features = patches.numpy().astype(np.float32) / 255.0  # (N, L, F)
        tokens = np.zeros((n, length + 1), dtype=np.int64)  # placeholders: the inputs are the features
        return Batch(tokens, np.ones((n, 1), dtype=bool), labels.numpy().reshape(n, 1).astype(np.int64), features)

    def generate(self, rng: np.random.Generator, n: int, length: int, split: str) -> Batch:
        """``n`` training images drawn with replacement (the training streams)."""
        images, labels = self.pools[TRAIN]
        rows = torch.from_numpy(rng.integers(0, len(labels), size=n))
        return self.render(images[rows], labels[rows], length, self.TESTS[0], rng)

    def sequences(self, stream: int, length: int, n: int, test: str = STANDARD) -> Batch:
        """The first ``n`` images of the stream's held-out pool (validation or test) in a fixed
        order seeded by ``task.seed``, the same at every length and in every test set (paired),
        by protocol ``test`` (the standard one: the reference, canvas)."""
        if stream == TRAIN:
            return super().sequences(stream, length, n, test)
        test = self.TESTS[0] if test == STANDARD else test
        images, labels = self.pools[stream]
        order = torch.from_numpy(np.random.default_rng([self.seed, stream]).permutation(len(labels))[:n])
        rng = np.random.default_rng([self.seed, stream, length, self.TESTS.index(test)])
        return self.render(images[order], labels[order], length, test, rng)

    # ------------------------------------------------------------------ baselines

    @cached_property
    def centroids(self) -> dict[bool, np.ndarray]:
        """Normalised or not -> (10, INK_BINS) class centroids of the training images' histograms."""
        images, labels = self.pools[TRAIN]
        y = labels.numpy()
        out = {}
        for normalise in (True, False):
            h = ink_histogram(images.numpy(), normalise)
            out[normalise] = np.stack([h[y == c].mean(axis=0) for c in range(len(self.vocab))])
        return out

    def baselines(self, batch: Batch) -> dict[str, np.ndarray]:
        """``chance`` and the nearest-centroid guesses on the ink histogram (module docstring)."""
        pixels = batch.features * 255.0
        out = super().baselines(batch)
        for name, normalise in self.BASELINES.items():
            h = ink_histogram(pixels, normalise)  # (N, INK_BINS)
            guess = ((h[:, None, :] - self.centroids[normalise][None]) ** 2).sum(axis=-1).argmin(axis=1)  # (N,)
            out[name] = (guess[:, None] == batch.labels).astype(np.float64)  # (N, 1)
        return out


__all__ = ["Fashion", "held_out", "ink_histogram"]
