"""Rebuild the packaged Fashion-MNIST sample from the full official files (SOURCE.md).

    python -m posbench.data.images.build_sample /usr/share/datasets/fashion-mnist [out.npz]

Takes ``TRAIN_PER_CLASS`` images of each class from the official train split and
``TEST_PER_CLASS`` from the official test split (:func:`balanced_indices`, seed ``SEED``) and
writes them, with their indices in the official files, as a compressed ``.npz``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from posbench.core.io import atomic_path
from posbench.data.images.fashion import SAMPLE_FILE, balanced_indices, load_images

TRAIN_PER_CLASS, TEST_PER_CLASS, SEED = 500, 100, 0


def build_sample(folder: str | Path, out: str | Path = SAMPLE_FILE, train_per_class: int = TRAIN_PER_CLASS,
                 test_per_class: int = TEST_PER_CLASS, seed: int = SEED) -> dict[str, np.ndarray]:
    """Write the class-balanced subset of the full set in ``folder`` to ``out``; return its arrays."""
    arrays: dict[str, np.ndarray] = {}
    for split, per_class in (("train", train_per_class), ("test", test_per_class)):
        full = load_images(folder, split)
        index = balanced_indices(full.labels.numpy(), per_class, seed)
        arrays[f"x_{split}"] = full.images.numpy()[index]  # (n, 28, 28) uint8
        arrays[f"y_{split}"] = full.labels.numpy()[index].astype(np.uint8)
        arrays[f"index_{split}"] = index.astype(np.int32)  # position in the official file
    with atomic_path(out) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)
    return arrays


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    build_sample(*sys.argv[1:])
