"""Images for the grid track: Fashion-MNIST (a packaged sample or the full set) and the
resolution-extrapolation protocols (canvas, zoom) over patch grids. docs/images.md.

    from posbench.data.images import load_images, canvas, zoom, patchify
    train = load_images("sample", "train")            # ImageSet: (5000, 28, 28) uint8 + labels
    big, offsets = canvas(train.images, 56, seed=0)   # same scale on a 56x56 blank canvas
    patches, positions = patchify(big, 4)             # (N, 196, 16), (196, 2) (row, col)
"""

from posbench.data.images.fashion import CLASSES, HUB_ID, ImageSet, load_images
from posbench.data.images.protocols import canvas, grid_positions, patchify, unpatchify, zoom

__all__ = ["CLASSES", "HUB_ID", "ImageSet", "load_images", "canvas", "grid_positions", "patchify",
           "unpatchify", "zoom"]
