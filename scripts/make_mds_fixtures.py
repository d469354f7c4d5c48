#!/usr/bin/env python3
"""Writes fixtures/compat/mds*/: Mosaic MDS datasets written by MosaicML Streaming's own
MDSWriter (mosaicml-streaming 0.13.0), from fixtures/imagefolder, for tests/integration/compat.rs.

mds/: columns {'i': 'int', 'x': 'jpeg', 'y': 'int'} as Streaming's ImageNet converter writes
them, the tree's JPEG files (their bytes unchanged: the jpeg encoding stores a JPEG file's own
bytes), small shards so there are several.
mds-zstd/: columns {'image': 'bytes', 'label': 'int64', 'meta': 'json', 'path': 'str'}, every image
file's raw bytes (broken ones included), compression='zstd'.
mds-pil/: columns {'x': 'pil', 'y': 'int'} as Streaming's CIFAR converter writes them: raw
pixels of 5x4 images in modes RGB and L, pixel values a fixed formula.
Labels are the class's index in torchvision ImageFolder order.

MDSWriter is imported without the rest of the streaming package (whose __init__ imports torch):
make mds-fixtures installs it with --no-deps into its own virtual environment.
"""
import os
import shutil
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "fixtures", "imagefolder")
OUT = os.path.join(ROOT, "fixtures", "compat")
EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def import_writer():
    site = next(p for p in sys.path if p.endswith("site-packages"))
    root = os.path.join(site, "streaming")
    for name, path in [
        ("streaming", root),
        ("streaming.base", os.path.join(root, "base")),
        ("streaming.base.format", os.path.join(root, "base", "format")),
    ]:
        module = types.ModuleType(name)
        module.__path__ = [path]
        sys.modules[name] = module

    class Absent(types.ModuleType):
        def __getattr__(self, key):
            if key.startswith("__"):
                raise AttributeError(key)
            return Absent(self.__name__ + "." + key)

    for name in ["torch", "torch.distributed", "torch.utils", "torch.utils.data"]:
        sys.modules[name] = Absent(name)
    from streaming.base.format.mds.writer import MDSWriter

    return MDSWriter


def imagefolder(root):
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    samples = []
    for label, name in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(os.path.join(root, name))):
            for f in sorted(files):
                if f.lower().endswith(EXTENSIONS):
                    samples.append((os.path.join(dirpath, f), label))
    return samples


def fresh(name):
    path = os.path.join(OUT, name)
    if os.path.isdir(path):
        shutil.rmtree(path)
    return path


def main():
    from PIL import Image, JpegImagePlugin

    MDSWriter = import_writer()
    samples = imagefolder(SRC)

    with MDSWriter(out=fresh("mds"), columns={"i": "int", "x": "jpeg", "y": "int"}, size_limit=8000) as out:
        i = 0
        for path, label in samples:
            try:
                image = Image.open(path)
            except Exception:
                continue  # broken files: the jpeg encoding needs an image PIL opens
            if not isinstance(image, JpegImagePlugin.JpegImageFile):
                continue
            out.write({"i": i, "x": image, "y": label})
            i += 1

    columns = {"image": "bytes", "label": "int64", "meta": "json", "path": "str"}
    with MDSWriter(out=fresh("mds-zstd"), columns=columns, compression="zstd", size_limit=4000) as out:
        import numpy as np

        for path, label in samples:
            with open(path, "rb") as f:
                data = f.read()
            rel = os.path.relpath(path, SRC)
            out.write({"image": data, "label": np.int64(label), "meta": {"source": rel}, "path": rel})

    with MDSWriter(out=fresh("mds-pil"), columns={"x": "pil", "y": "int"}) as out:
        for index in range(6):
            mode = "RGB" if index % 2 == 0 else "L"
            channels = 3 if mode == "RGB" else 1
            pixels = bytes(
                (index * 7 + y * 3 + x * 5 + c) % 256
                for y in range(4)
                for x in range(5)
                for c in range(channels)
            )
            out.write({"x": Image.frombytes(mode, (5, 4), pixels), "y": index % 3})


if __name__ == "__main__":
    main()
