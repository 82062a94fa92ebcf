"""Fashion-MNIST images -> uint8 tensors: the packaged sample, local IDX/.npz files, or the hub.

    from posbench.data.images import load_images
    train = load_images("sample", "train")        # 5,000 images shipped with posbench
    test = load_images("/usr/share/datasets/fashion-mnist", "test")   # the full official split
    train.images  # (N, 28, 28) uint8;  train.labels  # (N,) int64, 0..9

``source`` is one of: ``sample`` (the class-balanced subset in this folder, SOURCE.md),
a folder with the official IDX files (``train-images-idx3-ubyte.gz`` ...; plain or gzipped),
an ``.npz`` with ``x_train``/``y_train``/``x_test``/``y_test``, or the hub dataset
``hub`` / ``hub:<name>`` / ``zalando-datasets/fashion_mnist`` (read with ``datasets.load_dataset``).
"""

from __future__ import annotations

import gzip
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posbench.core.errors import PosbenchError, one_line

HUB_ID = "zalando-datasets/fashion_mnist"
SAMPLE_FILE = Path(__file__).with_name("fashion_mnist_sample.npz")
SPLITS = ("train", "test")
IDX_PREFIX = {"train": "train", "test": "t10k"}  # the official file names: train-*, t10k-*
IMAGES_MAGIC, LABELS_MAGIC = 0x0803, 0x0801  # IDX: unsigned bytes, 3 dims / 1 dim
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
SOURCE_HINT = (f"source=sample, a folder with the Fashion-MNIST IDX files, an .npz with "
               f"x_train/y_train/x_test/y_test, or hub:{HUB_ID}")


@dataclass(frozen=True)
class ImageSet:
    """One split of an image dataset."""

    images: torch.Tensor  # (N, H, W) uint8, 0 = background
    labels: torch.Tensor  # (N,) int64 class ids
    source: str  # where it was read from, for logs

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def load_images(source: str | Path, split: str) -> ImageSet:
    """Read ``split`` (``train`` or ``test``) of Fashion-MNIST from ``source`` (module docstring)."""
    if split not in SPLITS:
        raise PosbenchError(f"image split {split!r} is unknown; use one of {', '.join(SPLITS)}")
    text = str(source)
    if text == "sample":
        images, labels = _read_npz(SAMPLE_FILE, split)
        return _image_set(images, labels, f"Fashion-MNIST sample ({split})")
    path = Path(text).expanduser()
    if path.exists():
        images, labels = _read_npz(path, split) if path.is_file() else _read_idx_dir(path, split)
        return _image_set(images, labels, f"{path} ({split})")
    hub = _hub_name(text)
    if hub is not None:
        images, labels = _read_hub(hub, split)
        return _image_set(images, labels, f"hub {hub} ({split})")
    raise PosbenchError(f"image source {text!r} is not a file or folder; pass {SOURCE_HINT}")


def _hub_name(text: str) -> str | None:
    """``hub`` -> the default id, ``hub:<name>`` -> name, the default id itself; else None."""
    if text == "hub":
        return HUB_ID
    if text.startswith("hub:") and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", text[4:]):
        return text[4:]
    return HUB_ID if text == HUB_ID else None


def _image_set(images: np.ndarray, labels: np.ndarray, where: str) -> ImageSet:
    if images.ndim != 3 or images.dtype != np.uint8:
        raise PosbenchError(f"{where}: images must be (N, H, W) uint8, got {images.shape} "
                            f"{images.dtype}; pass {SOURCE_HINT}")
    if labels.shape != (images.shape[0],):
        raise PosbenchError(f"{where}: {labels.shape} labels for {images.shape[0]} images; "
                            f"check that the label file belongs to the image file")
    return ImageSet(torch.from_numpy(np.array(images, order="C")),  # a writable copy
                    torch.from_numpy(labels.astype(np.int64)), where)


def _read_npz(path: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    keys = (f"x_{split}", f"y_{split}")
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:  # neither a zip nor an .npy file
        raise PosbenchError(f"{path} is not an .npz archive ({one_line(err)}); pass {SOURCE_HINT}") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):  # a single .npy array
        raise PosbenchError(f"{path} is one array, not an .npz archive; pass {SOURCE_HINT}")
    with archive:
        if not set(keys) <= set(archive.files):
            raise PosbenchError(f"{path} lacks {' and '.join(keys)} (it has {', '.join(archive.files)}); "
                                f"pass an .npz with x_train/y_train/x_test/y_test or {SOURCE_HINT}")
        return archive[keys[0]], archive[keys[1]]


def idx_path(folder: Path, split: str, kind: str) -> Path:
    """The official file of ``kind`` (``images``/``labels``) for ``split``, gzipped or not."""
    name = f"{IDX_PREFIX[split]}-{kind}-idx{3 if kind == 'images' else 1}-ubyte"
    for candidate in (folder / f"{name}.gz", folder / name):
        if candidate.is_file():
            return candidate
    raise PosbenchError(f"{folder} has no {name}.gz (nor {name}); pass a folder with the official "
                        f"Fashion-MNIST files (train-*/t10k-* images and labels) or {SOURCE_HINT}")


def _read_idx_dir(folder: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    return (read_idx(idx_path(folder, split, "images"), IMAGES_MAGIC),
            read_idx(idx_path(folder, split, "labels"), LABELS_MAGIC))


def read_idx(path: Path, magic: int) -> np.ndarray:
    """An IDX file of unsigned bytes (big-endian header: magic, then one uint32 per dim)."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError) as err:
        raise PosbenchError(f"{path} cannot be read ({one_line(err)}); download it again") from None
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header or int.from_bytes(raw[:4], "big") != magic:
        raise PosbenchError(f"{path} is not an IDX file of {ndim}-d unsigned bytes "
                            f"(magic {raw[:4].hex()}); check the file name and download it again")
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    if len(raw) - header != int(np.prod(shape)):
        raise PosbenchError(f"{path} holds {len(raw) - header} bytes for shape {shape}; "
                            f"the file is truncated: download it again")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _read_hub(name: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """``datasets.load_dataset(name, split=split)``: an ``image`` (PIL) and a ``label`` column."""
    try:
        import datasets
    except ImportError:
        raise PosbenchError(f"reading {name} from the hub needs `pip install datasets`; "
                            f"or pass source=sample or a local folder") from None
    try:
        table: Any = datasets.load_dataset(name, split=split)
    except Exception as err:  # offline, unknown name, no such split: the user fixes the source
        raise PosbenchError(f"could not load {name} ({split}) from the hub: {one_line(err)}; "
                            f"offline, pass source=sample or a local folder with the IDX files") from None
    images = np.stack([np.asarray(image, dtype=np.uint8) for image in table["image"]])  # (N, H, W)
    return images, np.asarray(table["label"])


def balanced_indices(labels: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """``per_class`` indices of every class, ascending: the first ones of each class in a seeded
    permutation of all indices (``np.random.default_rng(seed).permutation(len(labels))``)."""
    order = np.random.default_rng(seed).permutation(len(labels))
    chosen = []
    for cls in np.unique(labels):
        of_class = order[labels[order] == cls]
        if len(of_class) < per_class:
            raise PosbenchError(f"class {cls} has {len(of_class)} images, fewer than {per_class}; "
                                f"ask for fewer per class")
        chosen.append(of_class[:per_class])
    return np.sort(np.concatenate(chosen))
