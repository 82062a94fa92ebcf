"""Resolution extrapolation on images: the two test protocols, and images <-> patch sequences.

A model trained on an h x w grid of patches of 28 x 28 images is tested on a larger grid
(2h x 2w, 4h x 4w) by one of two protocols:

- :func:`canvas`: the object at the *same scale*, pasted at a seeded random place on a larger
  blank canvas. More patches, the same content per patch; most patches are background.
- :func:`zoom`: the image *upsampled* to the larger size (bilinear by default). More patches,
  each holding a smaller part of the object.

:func:`patchify` turns (N, H, W) images into (N, h*w, p*p) patch sequences in row-major order,
with the (row, col) position of each patch; :func:`unpatchify` is its inverse.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posbench.core.errors import PosbenchError

ZOOM_MODES = ("nearest", "bilinear", "bicubic")


def _size2(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _check_images(images: torch.Tensor) -> None:
    if images.ndim != 3:
        raise PosbenchError(f"images must be (N, H, W), got shape {tuple(images.shape)}")


def canvas(images: torch.Tensor, size: int | tuple[int, int], seed: int,
           step: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image pasted unchanged onto a blank (zero) ``size`` canvas at a seeded uniform offset.

    images: (N, H, W), any dtype. Returns the canvases (N, S_h, S_w), same dtype, and the
    offsets (N, 2) int64 (top row, left column) of each image. The same seed gives the same
    offsets on every machine (a CPU ``torch.Generator``). ``step``: the offsets are multiples of
    it (the patch size: the image's patches are cut exactly as at its own size, at other cells)."""
    _check_images(images)
    n, h, w = images.shape
    size_h, size_w = _size2(size)
    if size_h < h or size_w < w:
        raise PosbenchError(f"canvas size {size_h}x{size_w} is smaller than the images ({h}x{w}); "
                            f"pick a canvas at least as large as the image")
    if step < 1:
        raise PosbenchError(f"canvas step {step} must be a positive number of pixels")
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, (size_h - h) // step + 1, (n,), generator=gen) * step  # (N,)
    cols = torch.randint(0, (size_w - w) // step + 1, (n,), generator=gen) * step  # (N,)
    out = images.new_zeros((n, size_h, size_w))  # (N, S_h, S_w)
    for i, (r, c) in enumerate(zip(rows.tolist(), cols.tolist())):
        out[i, r:r + h, c:c + w] = images[i]
    return out, torch.stack([rows, cols], dim=1)


def zoom(images: torch.Tensor, size: int | tuple[int, int], mode: str = "bilinear") -> torch.Tensor:
    """Each image resized to ``size`` with ``F.interpolate`` (``align_corners=False`` for the
    linear modes). images: (N, H, W); uint8 in, uint8 out (rounded, clipped to 0..255); a float
    input comes back float."""
    _check_images(images)
    if mode not in ZOOM_MODES:
        raise PosbenchError(f"zoom mode {mode!r} is unknown; use one of {', '.join(ZOOM_MODES)}")
    align = None if mode == "nearest" else False
    out = F.interpolate(images[:, None].float(), size=_size2(size), mode=mode, align_corners=align)[:, 0]
    if images.dtype == torch.uint8:
        return out.round().clamp(0, 255).to(torch.uint8)  # (N, S_h, S_w)
    return out.to(images.dtype)


def grid_positions(rows: int, cols: int) -> torch.Tensor:
    """(rows*cols, 2) int64: the (row, col) of every patch of a rows x cols grid, row-major."""
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([r.reshape(-1), c.reshape(-1)], dim=1)


def patchify(images: torch.Tensor, patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, H, W) -> patches (N, h*w, p*p) with h = H/p, w = W/p, row-major, and their (row, col)
    positions (h*w, 2). Each patch is flattened row by row."""
    _check_images(images)
    n, height, width = images.shape
    if patch < 1 or height % patch or width % patch:
        raise PosbenchError(f"patch size {patch} does not divide the {height}x{width} images; "
                            f"pick a patch size that divides both sides (e.g. 4 or 7 for 28x28)")
    h, w = height // patch, width // patch
    x = images.reshape(n, h, patch, w, patch).permute(0, 1, 3, 2, 4)  # (N, h, w, p, p)
    return x.reshape(n, h * w, patch * patch), grid_positions(h, w)


def unpatchify(patches: torch.Tensor, grid: tuple[int, int], patch: int) -> torch.Tensor:
    """The inverse of :func:`patchify`: (N, h*w, p*p) on an h x w grid -> (N, h*p, w*p)."""
    h, w = grid
    n, count, dim = patches.shape
    if count != h * w or dim != patch * patch:
        raise PosbenchError(f"patches of shape {tuple(patches.shape)} do not fit a {h}x{w} grid "
                            f"of {patch}x{patch} patches")
    x = patches.reshape(n, h, w, patch, patch).permute(0, 1, 3, 2, 4)  # (N, h, p, w, p)
    return x.reshape(n, h * patch, w * patch)
