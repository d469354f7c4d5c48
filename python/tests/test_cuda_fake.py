"""The Python package's page-locked path on the fake CUDA driver (tests/fake_cuda, built by
`make test-gpu-fake`), with no GPU and no torch: the native loader behind ``device="cuda"``
allocates its page-locked batch buffers through the driver before the first batch, never
during the epoch, and its batches are the ordinary loader's, byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO

FAKE = REPO / "target" / "fake-cuda"

CHILD = textwrap.dedent(
    """
    import hashlib, json, sys
    import numpy as np
    from imagefeed import _native
    from imagefeed.transforms import cifar_train

    def make(pinned):
        return _native.NativeLoader(
            [sys.argv[1]], batch_size=32, workers=2, seed=0, prefetch=4, shuffle=True,
            drop_last=False, rank=0, world_size=1, uneven="pad",
            transform={k: v for k, v in cifar_train().spec().items() if k not in ("mean", "std")},
            dtype="uint8", layout="NHWC", bad_samples="replace", pinned_device=pinned,
        )

    def digest(loader):
        h = hashlib.sha256()
        loader.begin(0)
        while (parts := loader.next_batch()) is not None:
            images, labels = np.from_dlpack(parts[0]), np.from_dlpack(parts[1])
            h.update(images.tobytes())
            h.update(labels.tobytes())
        return h.hexdigest()

    pinned = make(0)
    before = pinned.pinned_buffers
    print(json.dumps({
        "before": before,
        "pinned": digest(pinned),
        "after": pinned.pinned_buffers,
        "plain": digest(make(None)),
    }))
    """
)


@pytest.mark.skipif(
    not (FAKE / "libcuda.so.1").exists(),
    reason="the fake CUDA driver is not built (make test-gpu-fake builds it)",
)
def test_page_locked_batches_are_allocated_up_front_and_equal_the_plain_ones(lmdb_path):
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{FAKE}:{env.get('LD_LIBRARY_PATH', '')}"
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(lmdb_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    # prefetch 4, plus the Python loop's own: one handed over, one in use, two being copied.
    assert result["before"] == [8, 0], result
    assert result["after"] == result["before"], "no page-locked allocation during the epoch"
    assert result["pinned"] == result["plain"]
