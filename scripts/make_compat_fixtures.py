#!/usr/bin/env python3
"""Writes fixtures/compat/: datasets made by other tools, for the compatibility tests.

folder2lmdb.lmdb and folder2lmdb-dir/ (directory form, data.mdb) are written the way the Python
folder2lmdb scripts (Efficient-PyTorch tools/folder2lmdb.py and its forks) write them, from
fixtures/imagefolder: torchvision ImageFolder order (classes = sorted sub-directories, files in
sorted(os.walk()) order, image extensions only), every file's raw bytes pickled with its label as
(bytes, int), keys u'{idx}'.encode('ascii'), then __keys__ and __len__; broken files included,
as those scripts do not check images. Needs the `lmdb` package (make compat-fixtures installs it
into a virtual environment).
"""
import os
import pickle
import shutil
import sys

import lmdb

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


def main():
    os.makedirs(OUT, exist_ok=True)
    n = write(os.path.join(OUT, "folder2lmdb.lmdb"), subdir=False)
    write(os.path.join(OUT, "folder2lmdb-dir"), subdir=True)
    print(f"wrote {n} samples in fixtures/compat/ with lmdb {lmdb.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
