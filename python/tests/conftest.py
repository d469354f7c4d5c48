"""Shared test data: a packed synthetic dataset, and the repository's fixture tree (with broken
files). Nothing here needs ../shared, torch or a GPU."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil

import pytest

import imagefeed
from imagefeed import transforms as T

# Flip and CIFAR-10 normalization at native size (what T.cifar_train() was before it gained
# RandomCrop(32, padding=4)): the suite's images are 32x24 and keep their shape.
FLIP_NORMALIZE = T.Compose([T.RandomHorizontalFlip(0.5), T.Normalize(T.CIFAR10_MEAN, T.CIFAR10_STD)])

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURE_TREE = REPO / "fixtures" / "imagefolder"


@pytest.fixture(scope="session")
def tree(tmp_path_factory) -> pathlib.Path:
    """A clean ImageFolder tree: 6 classes x 40 JPEGs of 32x24."""
    root = tmp_path_factory.mktemp("tree") / "imagefolder"
    imagefeed.synthesize(root, classes=6, per_class=40, size=(32, 24), seed=3)
    return root


@pytest.fixture(scope="session")
def lmdb_path(tree, tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("packed") / "train.lmdb"
    imagefeed.pack(tree, out, "lmdb", progress=False)
    return out


def replicated_tree(root: pathlib.Path, classes: int, per_class: int, size, distinct: int = 4):
    """An ImageFolder tree of `classes` x `per_class` JPEGs of `size`, made of `distinct` images
    per class copied over: for tests that need slow work (large or many files) rather than
    distinct pixels. Synthesizing every file costs most of a minute in a debug build."""
    imagefeed.synthesize(root, classes=classes, per_class=distinct, size=size)
    for class_dir in sorted(root.iterdir()):
        made = sorted(class_dir.iterdir())
        for i in range(distinct, per_class):
            shutil.copyfile(made[i % distinct], class_dir / f"copy{i:05}.jpg")
    return root


@pytest.fixture(scope="session")
def big_tree(tmp_path_factory) -> pathlib.Path:
    """2 classes x 48 photo-size JPEGs (1600x1200): one batch of 48 takes a worker long enough
    that the main thread is seen waiting in Rust. One image per class copied (synthesizing each
    takes seconds in a debug build; decoding costs the same whatever the pixels)."""
    return replicated_tree(tmp_path_factory.mktemp("big") / "big", 2, 48, (1600, 1200), distinct=1)


@pytest.fixture(scope="session")
def bench() -> str:
    """The imagefeed-bench binary (IMAGEFEED_BENCH, else the workspace's target directory)."""
    candidates = [os.environ.get("IMAGEFEED_BENCH", "")]
    candidates += [str(REPO / "target" / kind / "imagefeed-bench") for kind in ("release", "debug")]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    pytest.skip("imagefeed-bench not built (cargo build -p imagefeed-bench, or set IMAGEFEED_BENCH)")


def epoch_digest(batches) -> str:
    """SHA-256 over (image bytes, labels as u32 LE) of each batch in order: what
    `imagefeed-bench load --digest` prints."""
    import numpy as np

    h = hashlib.sha256()
    for images, labels in batches:
        h.update(np.ascontiguousarray(images).tobytes())
        h.update(np.asarray(labels).astype("<u4").tobytes())
    return h.hexdigest()


@pytest.fixture
def copy_tree(tmp_path):
    def copy(src: pathlib.Path) -> pathlib.Path:
        dst = tmp_path / src.name
        shutil.copytree(src, dst)
        return dst

    return copy


def default_sigint():
    """Restores SIGINT's default in a child: a shell's background job (`make test &`, some CI
    runners) starts with SIGINT ignored, and Python then never raises KeyboardInterrupt."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
