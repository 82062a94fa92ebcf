"""Fashion-MNIST for the grid track: the packaged sample, the loader's sources (IDX folder, .npz,
the hub through a stand-in ``datasets.load_dataset``), and the canvas / zoom / patch protocols."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
import torch.nn.functional as F

from posbench.core.errors import PosbenchError
from posbench.core.io import file_sha256
from posbench.data.images import CLASSES, HUB_ID, canvas, grid_positions, load_images, patchify, unpatchify, zoom
from posbench.data.images.build_sample import build_sample
from posbench.data.images.fashion import SAMPLE_FILE, balanced_indices

ROOT = Path(__file__).resolve().parents[3]


def write_idx(path: Path, array: np.ndarray, compress: bool = True) -> None:
    """An IDX file of unsigned bytes: magic 0x08 0x<ndim>, big-endian dims, the bytes."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)


def fake_split(n_per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.repeat(np.arange(10), n_per_class)).astype(np.uint8)
    return rng.integers(0, 256, (len(labels), 28, 28), dtype=np.uint8), labels


@pytest.fixture
def idx_folder(tmp_path):
    """A folder with the four official file names holding small random splits."""
    splits = {"train": fake_split(6, 1), "test": fake_split(3, 2)}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", splits[split][0])
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", splits[split][1])
    return tmp_path, splits


# ---------------------------------------------------------------- the packaged sample


@pytest.mark.parametrize("split,per_class", [("train", 500), ("test", 100)])
def test_sample_is_class_balanced_uint8_28x28(split, per_class):
    data = load_images("sample", split)
    assert data.images.dtype == torch.uint8 and data.images.shape == (10 * per_class, 28, 28)
    assert data.labels.dtype == torch.int64 and len(data) == 10 * per_class
    assert data.labels.bincount().tolist() == [per_class] * 10
    assert 60 < data.images.float().mean() < 85  # Fashion-MNIST's mean pixel is about 73
    assert data.images.is_contiguous() and data.images.numpy().flags.writeable


def test_sample_indices_point_into_the_official_files_and_match_source_md():
    with np.load(SAMPLE_FILE) as archive:
        train, test = archive["index_train"], archive["index_test"]
    assert (np.diff(train) > 0).all() and 0 <= train[0] and train[-1] < 60_000
    assert (np.diff(test) > 0).all() and 0 <= test[0] and test[-1] < 10_000
    source = (SAMPLE_FILE.parent / "SOURCE.md").read_text(encoding="utf-8")
    assert file_sha256(SAMPLE_FILE) in source and f"{SAMPLE_FILE.stat().st_size:,}" in source
    assert (SAMPLE_FILE.parent / "NOTICE.md").read_text(encoding="utf-8").count("Zalando SE") >= 1
    assert len(CLASSES) == 10


def test_pyproject_ships_the_sample_and_its_notices():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setup["package-data"]["posbench.data.images"]
    shipped = {p.name for pattern in patterns for p in SAMPLE_FILE.parent.glob(pattern)}
    assert {"fashion_mnist_sample.npz", "SOURCE.md", "NOTICE.md"} <= shipped
    assert "posbench.data.images" in setup["packages"]


# ---------------------------------------------------------------- local files


@pytest.mark.parametrize("split", ["train", "test"])
def test_idx_folder_round_trip(idx_folder, split):
    folder, splits = idx_folder
    data = load_images(folder, split)
    assert torch.equal(data.images, torch.from_numpy(splits[split][0]))
    assert torch.equal(data.labels, torch.from_numpy(splits[split][1].astype(np.int64)))
    assert str(folder) in data.source


def test_idx_folder_reads_uncompressed_files(tmp_path):
    images, labels = fake_split(2, 3)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", images, compress=False)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels, compress=False)
    assert torch.equal(load_images(str(tmp_path), "test").images, torch.from_numpy(images))


def test_idx_folder_errors_name_the_fix(idx_folder):
    folder, _ = idx_folder
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(PosbenchError, match="no t10k-labels-idx1-ubyte.gz"):
        load_images(folder, "test")
    raw = gzip.decompress((folder / "train-images-idx3-ubyte.gz").read_bytes())
    (folder / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(raw[:-5]))
    with pytest.raises(PosbenchError, match="truncated"):
        load_images(folder, "train")
    (folder / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"\x00\x00\x08\x01" + raw[4:]))
    with pytest.raises(PosbenchError, match="not an IDX file of 3-d"):
        load_images(folder, "train")
    (folder / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip")
    with pytest.raises(PosbenchError, match="cannot be read"):
        load_images(folder, "train")


def test_mismatched_label_file_is_refused(tmp_path):
    images, labels = fake_split(2, 4)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", images)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", labels[:-1])
    with pytest.raises(PosbenchError, match="labels for 20 images"):
        load_images(tmp_path, "train")


def test_npz_source(tmp_path):
    images, labels = fake_split(1, 5)
    np.savez(tmp_path / "fm.npz", x_train=images, y_train=labels, x_test=images[:3], y_test=labels[:3])
    assert torch.equal(load_images(tmp_path / "fm.npz", "test").images, torch.from_numpy(images[:3]))
    np.savez(tmp_path / "other.npz", images=images)
    with pytest.raises(PosbenchError, match="lacks x_train and y_train"):
        load_images(tmp_path / "other.npz", "train")
    np.savez(tmp_path / "float.npz", x_train=images.astype(np.float32), y_train=labels)
    with pytest.raises(PosbenchError, match="uint8"):
        load_images(tmp_path / "float.npz", "train")
    np.save(tmp_path / "one.npy", images)
    with pytest.raises(PosbenchError, match="one array, not an .npz archive"):
        load_images(tmp_path / "one.npy", "train")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(PosbenchError, match="not an .npz archive"):
        load_images(tmp_path / "notes.txt", "train")


def test_bad_source_and_split_are_one_line_errors(tmp_path):
    with pytest.raises(PosbenchError, match="split 'valid' is unknown; use one of train, test"):
        load_images("sample", "valid")
    with pytest.raises(PosbenchError, match="not a file or folder; pass source=sample") as err:
        load_images(tmp_path / "missing", "train")
    assert "\n" not in str(err.value)
    with pytest.raises(PosbenchError, match="not a file or folder"):
        load_images("someone/fashion_mnist", "train")  # only hub:<name> or the default id goes to the hub


# ---------------------------------------------------------------- the hub, through a stand-in


def test_hub_source_goes_through_datasets_load_dataset(monkeypatch):
    datasets = pytest.importorskip("datasets")
    pil = pytest.importorskip("PIL.Image")
    images, labels = fake_split(1, 6)
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASSES))})
        return datasets.Dataset.from_dict(
            {"image": [pil.fromarray(x) for x in images], "label": labels.tolist()}, features=features)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    for source in ("hub", HUB_ID, f"hub:{HUB_ID}"):
        data = load_images(source, "test")
        assert torch.equal(data.images, torch.from_numpy(images)) and data.images.dtype == torch.uint8
        assert torch.equal(data.labels, torch.from_numpy(labels.astype(np.int64)))
    assert calls == [(HUB_ID, "test")] * 3
    load_images("hub:me/fm", "train")
    assert calls[-1] == ("me/fm", "train")


def test_hub_failure_is_one_line_naming_the_offline_sources(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(name, split):
        raise ConnectionError("Couldn't reach the hub\nsecond line")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(PosbenchError, match="could not load .* pass source=sample") as err:
        load_images("hub", "train")
    assert "\n" not in str(err.value) and "ConnectionError" in str(err.value)


# ---------------------------------------------------------------- the subset rule


def test_balanced_indices_are_seeded_and_balanced():
    labels = np.random.default_rng(0).integers(0, 10, 2_000)
    a = balanced_indices(labels, 20, seed=0)
    assert np.array_equal(a, balanced_indices(labels, 20, seed=0))
    assert not np.array_equal(a, balanced_indices(labels, 20, seed=1))
    assert (np.diff(a) > 0).all() and np.bincount(labels[a]).tolist() == [20] * 10
    with pytest.raises(PosbenchError, match="fewer than 1000"):
        balanced_indices(labels, 1_000, seed=0)


def test_build_sample_keeps_pixels_and_indices(idx_folder, tmp_path):
    folder, splits = idx_folder
    out = tmp_path / "sample.npz"
    arrays = build_sample(folder, out, train_per_class=4, test_per_class=2, seed=0)
    loaded = load_images(out, "train")
    assert loaded.labels.bincount().tolist() == [4] * 10
    index = arrays["index_train"]
    assert np.array_equal(loaded.images.numpy(), splits["train"][0][index])
    assert np.array_equal(load_images(out, "test").labels.numpy(), splits["test"][1][arrays["index_test"]])
    first = out.read_bytes()
    build_sample(folder, out, train_per_class=4, test_per_class=2, seed=0)
    assert out.read_bytes() == first  # the same bytes again


# ---------------------------------------------------------------- canvas and zoom


def test_canvas_places_unchanged_pixels_at_seeded_offsets():
    images = load_images("sample", "test").images[:50]
    out, offsets = canvas(images, 56, seed=3)
    assert out.shape == (50, 56, 56) and out.dtype == torch.uint8 and offsets.shape == (50, 2)
    assert offsets.min() >= 0 and offsets.max() <= 56 - 28
    for i, (r, c) in enumerate(offsets.tolist()):
        assert torch.equal(out[i, r:r + 28, c:c + 28], images[i])
        rest = out[i].clone()
        rest[r:r + 28, c:c + 28] = 0
        assert rest.eq(0).all()  # blank everywhere else
    again, offsets_again = canvas(images, 56, seed=3)
    assert torch.equal(again, out) and torch.equal(offsets_again, offsets)
    assert not torch.equal(canvas(images, 56, seed=4)[1], offsets)
    assert len({tuple(o) for o in offsets.tolist()}) > 25  # spread over the canvas


def test_canvas_rectangular_and_same_size():
    images = torch.arange(2 * 28 * 28, dtype=torch.float32).reshape(2, 28, 28)
    out, offsets = canvas(images, (28, 112), seed=0)
    assert out.shape == (2, 28, 112) and out.dtype == torch.float32 and offsets[:, 0].eq(0).all()
    same, zero = canvas(images, 28, seed=0)
    assert torch.equal(same, images) and zero.eq(0).all()
    with pytest.raises(PosbenchError, match="smaller than the images"):
        canvas(images, 27, seed=0)


def test_canvas_offsets_on_a_step_grid():
    """step=p puts each image on the patch grid: its patches are cut as at its own size."""
    images = load_images("sample", "test").images[:60]
    out, offsets = canvas(images, 112, seed=5, step=4)
    assert offsets.remainder(4).eq(0).all() and offsets.max() <= 112 - 28
    assert len({tuple(o) for o in offsets.tolist()}) > 40  # still spread over the 22 x 22 places
    for i, (r, c) in enumerate(offsets.tolist()):
        assert torch.equal(out[i, r:r + 28, c:c + 28], images[i])
    assert torch.equal(canvas(images, 112, seed=5, step=1)[1], canvas(images, 112, seed=5)[1])  # step 1: as before
    assert not canvas(images, 112, seed=5)[1].remainder(4).eq(0).all()
    with pytest.raises(PosbenchError, match="canvas step 0 must be a positive number of pixels"):
        canvas(images, 56, seed=0, step=0)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic", "nearest"])
def test_zoom_equals_interpolate(mode):
    images = load_images("sample", "test").images[:8]
    out = zoom(images, 112, mode=mode)
    align = None if mode == "nearest" else False
    want = F.interpolate(images[:, None].float(), size=(112, 112), mode=mode, align_corners=align)[:, 0]
    assert out.shape == (8, 112, 112) and out.dtype == torch.uint8
    assert torch.equal(out, want.round().clamp(0, 255).to(torch.uint8))
    floats = images.float()
    assert torch.equal(zoom(floats, (56, 84), mode=mode),
                       F.interpolate(floats[:, None], size=(56, 84), mode=mode, align_corners=align)[:, 0])


def test_zoom_nearest_doubles_each_pixel_and_rejects_unknown_modes():
    images = load_images("sample", "test").images[:4]
    twice = images.repeat_interleave(2, dim=1).repeat_interleave(2, dim=2)
    assert torch.equal(zoom(images, 56, mode="nearest"), twice)
    with pytest.raises(PosbenchError, match="zoom mode 'area' is unknown"):
        zoom(images, 56, mode="area")
    with pytest.raises(PosbenchError, match=re.escape("(N, H, W)")):
        zoom(images[0], 56)


# ---------------------------------------------------------------- patches


def test_patchify_shapes_positions_and_content():
    images = load_images("sample", "train").images[:6]
    patches, positions = patchify(images, 4)
    assert patches.shape == (6, 49, 16) and patches.dtype == torch.uint8
    assert positions.shape == (49, 2) and positions.dtype == torch.int64
    assert torch.equal(positions, grid_positions(7, 7))
    for k, (r, c) in enumerate(positions.tolist()):
        assert torch.equal(patches[:, k], images[:, 4 * r:4 * r + 4, 4 * c:4 * c + 4].reshape(6, 16))
    assert positions[:8].tolist() == [[0, c] for c in range(7)] + [[1, 0]]  # row-major


@pytest.mark.parametrize("size,patch,grid", [(28, 7, (4, 4)), (56, 4, (14, 14)), ((56, 112), 7, (8, 16))])
def test_patchify_unpatchify_round_trip(size, patch, grid):
    images, _ = canvas(load_images("sample", "test").images[:3], size, seed=0)
    patches, positions = patchify(images, patch)
    assert patches.shape == (3, grid[0] * grid[1], patch * patch)
    assert positions[-1].tolist() == [grid[0] - 1, grid[1] - 1]
    assert torch.equal(unpatchify(patches, grid, patch), images)


def test_patch_sizes_that_do_not_fit_are_refused():
    images = torch.zeros(2, 28, 28)
    with pytest.raises(PosbenchError, match="patch size 5 does not divide the 28x28"):
        patchify(images, 5)
    with pytest.raises(PosbenchError, match="do not fit a 4x4 grid"):
        unpatchify(torch.zeros(2, 49, 16), (4, 4), 4)
