#!/usr/bin/env python3
"""Writes fixtures/compat/: datasets made by other tools, for the compatibility tests.

folder2lmdb.lmdb and folder2lmdb-dir/ (directory form, data.mdb) are written the way the Python
folder2lmdb scripts (Efficient-PyTorch tools/folder2lmdb.py and its forks) write them, from
fixtures/imagefolder: torchvision ImageFolder order (classes = sorted sub-directories, files in
sorted(os.walk()) order, image extensions only), every file's raw bytes pickled with its label as
(bytes, int), keys u'{idx}'.encode('ascii'), then __keys__ and __len__; broken files included,
as those scripts do not check images.

h5py-vlen.h5: the same files' bytes in a variable-length uint8 dataset `images`
(h5py.vlen_dtype(np.uint8)), `labels` int64, and the class names in a root `classes` attribute.
h5py-pixels.h5: a chunked, gzip-compressed N x H x W x 3 uint8 array `pixels` and `targets`
int32 (no class names); h5py-gray.h5: a contiguous N x H x W uint8 array `images` and `labels`
uint8. Their pixel values are a fixed formula (index * 7 + y * 3 + x * 5 + c) % 256.
tfrecord/train-0000{0,1}-of-00002: the files' bytes as tf.train.Example records written by the
`tfrecord` package (image/encoded, image/class/label = label + 1 as in ImageNet TFRecords,
image/filename), split in two shards, with no index files.

Needs lmdb, h5py, numpy and tfrecord (make compat-fixtures installs them into a virtual
environment).
"""
import os
import pickle
import shutil
import sys

import h5py
import lmdb
import numpy as np
import tfrecord

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "fixtures", "imagefolder")
OUT = os.path.join(ROOT, "fixtures", "compat")
EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def imagefolder(root):
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    samples = []
    for label, name in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(os.path.join(root, name), followlinks=True)):
            for f in sorted(files):
                if f.lower().endswith(EXTENSIONS):
                    samples.append((os.path.join(dirpath, f), label))
    return samples


def write(path, subdir):
    if os.path.isdir(path):
        shutil.rmtree(path)
    for p in (path, path + "-lock"):
        if os.path.isfile(p):
            os.remove(p)
    db = lmdb.open(path, subdir=subdir, map_size=1099511627776 * 2, readonly=False, meminit=False, map_async=True)
    samples = imagefolder(SRC)
    with db.begin(write=True) as txn:
        for idx, (file, label) in enumerate(samples):
            with open(file, "rb") as f:
                txn.put("{}".format(idx).encode("ascii"), pickle.dumps((f.read(), label)))
    keys = ["{}".format(k).encode("ascii") for k in range(len(samples))]
    with db.begin(write=True) as txn:
        txn.put(b"__keys__", pickle.dumps(keys))
        txn.put(b"__len__", pickle.dumps(len(keys)))
    db.sync()
    db.close()
    lock = os.path.join(path, "lock.mdb") if subdir else path + "-lock"
    if os.path.exists(lock):
        os.remove(lock)
    return len(samples)


def pixels(n, h, w, c):
    i, y, x, ch = np.meshgrid(np.arange(n), np.arange(h), np.arange(w), np.arange(c), indexing="ij")
    return ((i * 7 + y * 3 + x * 5 + ch) % 256).astype(np.uint8)


def write_h5py():
    samples = imagefolder(SRC)
    classes = sorted(e.name for e in os.scandir(SRC) if e.is_dir())
    with h5py.File(os.path.join(OUT, "h5py-vlen.h5"), "w") as f:
        images = f.create_dataset("images", (len(samples),), dtype=h5py.vlen_dtype(np.uint8))
        for i, (file, _) in enumerate(samples):
            with open(file, "rb") as fh:
                images[i] = np.frombuffer(fh.read(), dtype=np.uint8)
        f.create_dataset("labels", data=np.array([l for _, l in samples], dtype=np.int64))
        f.attrs["classes"] = classes
    with h5py.File(os.path.join(OUT, "h5py-pixels.h5"), "w") as f:
        f.create_dataset("pixels", data=pixels(6, 5, 4, 3), chunks=(2, 5, 4, 3), compression="gzip")
        f.create_dataset("targets", data=np.array([0, 1, 2, 0, 1, 2], dtype=np.int32))
    with h5py.File(os.path.join(OUT, "h5py-gray.h5"), "w") as f:
        f.create_dataset("images", data=pixels(4, 3, 2, 1)[..., 0])
        f.create_dataset("labels", data=np.array([1, 0, 1, 0], dtype=np.uint8))


def write_tfrecord():
    samples = imagefolder(SRC)
    out = os.path.join(OUT, "tfrecord")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    half = (len(samples) + 1) // 2
    for shard, part in enumerate([samples[:half], samples[half:]]):
        writer = tfrecord.TFRecordWriter(os.path.join(out, f"train-{shard:05d}-of-00002"))
        for file, label in part:
            with open(file, "rb") as fh:
                data = fh.read()
            key = os.path.relpath(file, SRC).replace(os.sep, "/")
            writer.write({
                "image/encoded": (data, "byte"),
                "image/class/label": (label + 1, "int"),
                "image/filename": (key.encode(), "byte"),
            })
        writer.close()


def main():
    os.makedirs(OUT, exist_ok=True)
    n = write(os.path.join(OUT, "folder2lmdb.lmdb"), subdir=False)
    write(os.path.join(OUT, "folder2lmdb-dir"), subdir=True)
    write_h5py()
    write_tfrecord()
    print(f"wrote {n} samples in fixtures/compat/ with lmdb {lmdb.__version__}, "
          f"h5py {h5py.__version__}, tfrecord (PyPI)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
