"""Writes an ImageFolder tree of same-sized images as h5py pixel arrays, the way h5py users
store them: N x H x W x 3 uint8 with gzip and with lzf in h5py's own chunk shape, and gzip with
one sample per chunk. For bench/RESULTS.md ("h5py's chunked pixel arrays").

    python bench/h5py_pixels.py cifar10-test OUT_DIR
    imagefeed-bench read OUT_DIR/cifar-gzip.h5 --threads 2 --epochs 3
"""

import os
import sys
from typing import Any

import h5py
import numpy as np
from PIL import Image


def main() -> None:
    root, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    images, labels = [], []
    for label, name in enumerate(classes):
        folder = os.path.join(root, name)
        for file in sorted(os.listdir(folder)):
            with Image.open(os.path.join(folder, file)) as image:
                images.append(np.asarray(image.convert("RGB")))
            labels.append(label)
    pixels, targets = np.stack(images), np.array(labels)
    variants: dict[str, dict[str, Any]] = {
        "gzip": {"compression": "gzip"},
        "lzf": {"compression": "lzf"},
        "gzip-chunk1": {"compression": "gzip", "chunks": (1, *pixels.shape[1:])},
    }
    for name, options in variants.items():
        path = os.path.join(out, f"cifar-{name}.h5")
        with h5py.File(path, "w") as f:
            f.create_dataset("images", data=pixels, **options)
            f.create_dataset("labels", data=targets)
            print(path, f["images"].chunks, os.path.getsize(path))


if __name__ == "__main__":
    main()
