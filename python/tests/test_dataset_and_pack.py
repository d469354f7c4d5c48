"""imagefeed.Dataset (map-style, across processes) and pack / inspect / verify from Python."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import pickle

import numpy as np
import pytest
from conftest import FIXTURE_TREE, default_sigint, replicated_tree

import imagefeed


def read_item(args):
    dataset, index = args
    sample, label = dataset[index]
    return os.getpid(), bytes(sample), label


def test_dataset_reads_bytes_labels_and_classes(lmdb_path, tree):
    ds = imagefeed.Dataset(lmdb_path, decode="bytes")
    assert len(ds) == 240 and ds.format == "lmdb"
    assert ds.classes == sorted(p.name for p in tree.iterdir())
    payload, label = ds[0]
    key = ds.key(0)
    assert payload == (tree / key).read_bytes(), "the stored bytes are the source file's"
    assert ds.classes[label] == key.split("/")[0]
    assert ds[-1] == ds[239]
    with pytest.raises(IndexError):
        ds[240]
    with pytest.raises(TypeError):
        ds["0"]


def test_decoded_samples_and_transforms(lmdb_path):
    ds = imagefeed.Dataset(lmdb_path, decode="numpy", transform=lambda a: a[:, ::-1], target_transform=str)
    image, label = ds[5]
    assert image.shape == (24, 32, 3) and image.dtype == np.uint8
    plain, _ = imagefeed.Dataset(lmdb_path, decode="numpy")[5]
    np.testing.assert_array_equal(image, plain[:, ::-1])
    assert isinstance(label, str)
    with pytest.raises(imagefeed.ConfigError):
        imagefeed.Dataset(lmdb_path, decode="cv2")


def test_imagefolder_habits_pil_by_default_positional_transform_and_listings(lmdb_path, tree):
    pytest.importorskip("PIL", reason="Pillow is not installed")
    ds = imagefeed.Dataset(lmdb_path, lambda im: im.size, lambda label: -label)
    size, target = ds[7]
    assert size == (32, 24) and target == -ds.targets[7]
    image, _ = imagefeed.Dataset(lmdb_path)[7]
    assert image.mode == "RGB", "a PIL RGB image by default, as ImageFolder"
    # Bytes on request (None as before).
    for decode in ("bytes", None):
        payload, _ = imagefeed.Dataset(lmdb_path, decode=decode)[7]
        assert isinstance(payload, bytes)
    # The listings: keys for a packed file, paths for a folder, ImageFolder's class map.
    folder = imagefeed.Dataset(tree)
    assert [os.path.relpath(p, tree) for p, _ in folder.samples] == [k for k, _ in ds.samples]
    assert folder.targets == ds.targets == [label for _, label in ds.imgs]
    assert ds.class_to_idx == {c: i for i, c in enumerate(ds.classes)}
    assert ds.samples[7][0] == ds.key(7) and folder.samples[7][0] == str(tree / ds.key(7))
    assert folder.find_classes(tree) == (folder.classes, folder.class_to_idx)
    with pytest.raises(FileNotFoundError):
        folder.find_classes(tree / ds.classes[0])
    # Pickled (to a DataLoader worker), the listing is not carried but found again.
    copy = pickle.loads(pickle.dumps(folder))
    assert copy.samples == folder.samples


def test_pil_decoding_matches_when_pillow_is_installed(lmdb_path):
    pytest.importorskip("PIL", reason="Pillow is not installed")
    image, _ = imagefeed.Dataset(lmdb_path, decode="pil")[3]
    assert image.mode == "RGB" and image.size == (32, 24)


def test_a_corrupt_record_raises_naming_the_key():
    ds = imagefeed.Dataset(FIXTURE_TREE, decode="numpy")
    keys = [ds.key(i) for i in range(len(ds))]
    bad = keys.index("class01/bad-truncated.jpg")
    with pytest.raises(imagefeed.BadSampleError) as e:
        ds[bad]
    assert "bad-truncated.jpg" in str(e.value)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_pickled_dataset_opens_its_own_handle_in_each_worker_process(lmdb_path, method):
    ds = imagefeed.Dataset(lmdb_path, decode="bytes")
    ds[0]  # the parent has an open handle: workers must not use it
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._native is None and len(clone) == 240
    expected = [(bytes(ds[i][0]), ds[i][1]) for i in range(0, 240, 20)]
    with multiprocessing.get_context(method).Pool(2) as pool:
        got = pool.map(read_item, [(ds, i) for i in range(0, 240, 20)])
    assert [(s, l) for _, s, l in got] == expected
    assert all(pid != os.getpid() for pid, _, _ in got)


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "records"])
def test_a_worker_that_finds_another_dataset_at_the_path_refuses_it(tree, tmp_path, fmt):
    out = tmp_path / f"data.{fmt}"
    imagefeed.pack(tree, out, fmt, progress=False)
    ds = imagefeed.Dataset(out, decode="bytes")
    same = pickle.loads(pickle.dumps(ds))
    assert bytes(same[7][0]) == bytes(ds[7][0]), "the unchanged dataset reads in a new process"
    # What a DataLoader hands its worker processes; the handles here are closed (a worker
    # opens its own, in another process).
    saved = pickle.dumps(ds)
    del ds, same
    gc.collect()
    # Packed again, the same files resized: the same count and classes, other records. A
    # worker process started now must not read them as the first dataset's.
    imagefeed.pack(tree, out, fmt, resize=16, force=True, progress=False)
    with pytest.raises(imagefeed.DatasetChangedError) as e:
        pickle.loads(saved)[0]
    assert e.value.path == str(out) and "probed" in e.value.reason
    assert isinstance(e.value, imagefeed.DataError)
    with multiprocessing.get_context("fork").Pool(1) as pool:
        with pytest.raises(imagefeed.DatasetChangedError):
            pool.map(read_item, [(pickle.loads(saved), 0)])
    # Another count is named as such.
    smaller = tmp_path / "smaller"
    imagefeed.synthesize(smaller, classes=6, per_class=10, size=(32, 24), seed=3)
    imagefeed.pack(smaller, out, fmt, force=True, progress=False)
    with pytest.raises(imagefeed.DatasetChangedError) as e:
        pickle.loads(saved)[0]
    assert "240 -> 60 samples" in e.value.reason


def test_pack_inspect_verify_round_trip(tree, tmp_path, capfd):
    for fmt in ("lmdb", "hdf5", "records"):
        out = tmp_path / f"data.{fmt}"
        summary = imagefeed.pack(tree, out, fmt, progress=False)
        assert summary["samples"] == 240 and summary["rejected"] == []
        info = imagefeed.inspect(out)
        assert info["num_samples"] == 240 and info["complete"] is True
        report = imagefeed.verify(out, against=tree)
        assert report["ok"] and report["checked"] == 240
    assert capfd.readouterr().err == "", "progress=False draws nothing"
    with pytest.raises(imagefeed.OutputExistsError) as e:
        imagefeed.pack(tree, tmp_path / "data.lmdb", "lmdb", progress=False)
    assert isinstance(e.value, FileExistsError)
    # Named as the Python call takes it, not as the command line's --force; a path holding
    # "--force" is left as it is.
    assert "force=True" in str(e.value) and "--force" not in str(e.value) + e.value.reason
    for odd in (tmp_path / "a--force" / "b--resume.lmdb", tmp_path / "src --force x" / "c --raw.lmdb"):
        imagefeed.pack(tree, odd, "lmdb", progress=False)
        with pytest.raises(imagefeed.OutputExistsError) as e:
            imagefeed.pack(tree, odd, "lmdb", progress=False)
        assert str(e.value) == f"{odd}: already exists (use force=True to replace it)"
    with pytest.raises(imagefeed.ConfigError) as e:
        imagefeed.pack(tree, tmp_path / "parts.lmdb", part=(3, 2), progress=False)
    assert e.value.reason == "part 3 of 2: a part's index must be below the number of parts"
    again = imagefeed.pack(tree, tmp_path / "data.lmdb", "lmdb", force=True, progress=False)
    assert again["samples"] == 240


def test_restart_markers_keep_the_pixels_and_the_loaders_batches(tmp_path):
    src = tmp_path / "src"
    imagefeed.synthesize(src, classes=2, per_class=5, size=(200, 150), seed=4)
    plain, segmented = tmp_path / "plain.lmdb", tmp_path / "segmented.lmdb"
    imagefeed.pack(src, plain, progress=False)
    imagefeed.pack(src, segmented, restart_markers=True, progress=False)
    assert imagefeed.inspect(segmented)["restart_markers"] is True
    assert imagefeed.inspect(plain)["restart_markers"] is False
    assert imagefeed.verify(segmented, against=src)["ok"]
    raw_plain = imagefeed.Dataset(plain, decode="bytes")
    raw_segmented = imagefeed.Dataset(segmented, decode="bytes")
    assert all(raw_plain[i][0] != raw_segmented[i][0] for i in range(len(raw_plain)))

    def batches(path):
        loader = imagefeed.Loader(path, batch_size=4, workers=2, seed=1, rank=0, world_size=1,
                                  transform=imagefeed.transforms.imagenet_train(64), output="numpy")
        return [np.array(images).copy() for images, _ in loader]

    assert all(np.array_equal(a, b) for a, b in zip(batches(plain), batches(segmented), strict=True))


def test_shared_headers_hand_back_the_files_from_a_smaller_lmdb(tmp_path):
    src = tmp_path / "src"
    imagefeed.synthesize(src, classes=2, per_class=20, size=(32, 32), seed=2)
    plain, shared = tmp_path / "plain.lmdb", tmp_path / "shared.lmdb"
    imagefeed.pack(src, plain, progress=False)
    imagefeed.pack(src, shared, shared_headers=True, progress=False)
    assert shared.stat().st_size < plain.stat().st_size
    assert imagefeed.verify(shared, against=src)["ok"]
    headers = imagefeed.inspect(shared)["shared_headers"]
    assert headers["headers"] >= 1 and headers["bytes"] > 100 and headers["damaged"] == 0
    assert "shared_headers" not in imagefeed.inspect(plain)
    ds = imagefeed.Dataset(shared, decode="bytes")
    assert all(ds[i][0] == (src / ds.key(i)).read_bytes() for i in range(len(ds)))
    with pytest.raises(imagefeed.ConfigError):
        imagefeed.pack(src, tmp_path / "x.records", "records", shared_headers=True, progress=False)
    with pytest.raises(imagefeed.ConfigError):
        imagefeed.pack(src, tmp_path / "x.lmdb", raw=True, shared_headers=True, progress=False)


def test_pack_rejects_broken_files_or_stops_in_strict_mode(tmp_path):
    summary = imagefeed.pack(FIXTURE_TREE, tmp_path / "f.lmdb", progress=False)
    assert {r["key"] for r in summary["rejected"]} == {
        "class01/bad-truncated.jpg", "class01/bad-bomb.jpg", "class01/bad-empty.jpg", "class01/bad-text.jpg"}
    with pytest.raises(imagefeed.errors.RejectedFileError):
        imagefeed.pack(FIXTURE_TREE, tmp_path / "strict.lmdb", strict=True, progress=False)
    assert not (tmp_path / "strict.lmdb").exists(), "nothing left behind"
    with pytest.raises(imagefeed.ConfigError):
        imagefeed.pack(FIXTURE_TREE, tmp_path / "x.lmdb", "zip", progress=False)
    with pytest.raises(imagefeed.ConfigError):
        imagefeed.pack(FIXTURE_TREE, tmp_path / "x.lmdb", quality=0, progress=False)


def test_verify_reports_a_damaged_dataset(tree, tmp_path):
    out = tmp_path / "d.lmdb"
    imagefeed.pack(tree, out, "lmdb", progress=False)
    payload, _ = imagefeed.Dataset(out, decode="bytes")[100]
    key = imagefeed.Dataset(out, decode="bytes").key(100)
    damaged = bytearray(payload)
    for i in range(len(damaged) // 2, len(damaged) - 2):
        damaged[i] ^= 0x5A
    data = out.read_bytes()
    assert payload in data
    # Every copy of the record's bytes (LMDB may keep a stale one in a free page).
    out.write_bytes(data.replace(payload, bytes(damaged)))
    report = imagefeed.verify(out, against=tree)
    assert not report["ok"] and report["problems"]
    # The damaged record is named, and its checksum makes it unreadable rather than a mismatch
    # (its source file then counts as missing from the dataset: a mismatch).
    kinds = {(p["index"], p["kind"]) for p in report["problems"] if key in str(p)}
    assert kinds == {(100, "unreadable"), (None, "mismatch")}, report["problems"]


PACK_SCRIPT = """
import sys, imagefeed
imagefeed.pack(sys.argv[1], sys.argv[2], threads=1, resize=48, progress=False)
"""


def test_ctrl_c_stops_a_pack_keeping_its_progress_and_resume_finishes_it(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    src, out = tmp_path / "src", tmp_path / "out.lmdb"
    replicated_tree(src, classes=4, per_class=130, size=(256, 192), distinct=10)
    partial = tmp_path / "out.lmdb.partial"
    proc = subprocess.Popen([sys.executable, "-c", PACK_SCRIPT, str(src), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 30
        while not partial.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        # The pack is under way: 520 files, one thread. A stop is seen after each chunk of 256
        # is committed, so the signal has until file 512 to land (the 8 after it, a third chunk).
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in err, err
    assert partial.exists() and not out.exists(), "what was committed is kept, nothing looks complete"
    with pytest.raises(imagefeed.IncompleteDatasetError):
        imagefeed.Dataset(out, decode="bytes")
    # Other options are refused, named as this call takes them (not --resize, --force).
    with pytest.raises(imagefeed.ConfigError) as e:
        imagefeed.pack(src, out, threads=1, resize=64, resume=True, progress=False)
    assert "resize" in str(e.value) and "force=True" in str(e.value) and "--" not in str(e.value)
    summary = imagefeed.pack(src, out, threads=1, resize=48, resume=True, progress=False)
    assert summary["samples"] == 520 and summary["resumed_from"] < 520
    assert imagefeed.verify(out)["ok"]


def test_a_split_pack_joins_into_the_unsplit_dataset(tree, tmp_path):
    whole = tmp_path / "whole.lmdb"
    imagefeed.pack(tree, whole, progress=False)
    parts = [tmp_path / f"part{i}.lmdb" for i in range(3)]
    for i, part in enumerate(parts):
        imagefeed.pack(tree, part, part=(i, 3), progress=False)
    joined = tmp_path / "joined.lmdb"
    summary = imagefeed.join(reversed(parts), joined, progress=False)
    assert summary["samples"] == 240
    a, b = imagefeed.Dataset(whole, decode="bytes"), imagefeed.Dataset(joined, decode="bytes")
    assert [a.key(i) for i in range(240)] == [b.key(i) for i in range(240)]
    assert all(a[i] == b[i] for i in range(240))
    assert imagefeed.verify(joined, against=tree)["ok"]
    with pytest.raises(imagefeed.Error):
        imagefeed.join(parts[:2], tmp_path / "short.lmdb", progress=False)
    # One path for the list (a hostile try's `join("parts")` opened "/" as an image folder).
    for one in (str(parts[0]), parts[0]):
        with pytest.raises(imagefeed.ConfigError, match="list of parts"):
            imagefeed.join(one, tmp_path / "one.lmdb", progress=False)  # type: ignore[arg-type]
    assert not (tmp_path / "one.lmdb").exists()
    # Parts packed with shared headers join into a dataset with shared headers: the same files.
    for i, part in enumerate(parts):
        imagefeed.pack(tree, part, part=(i, 3), shared_headers=True, force=True, progress=False)
    shared = tmp_path / "shared.lmdb"
    imagefeed.join(parts, shared, shared_headers=True, progress=False)
    c = imagefeed.Dataset(shared, decode="bytes")
    assert all(a[i] == c[i] for i in range(240))
    assert shared.stat().st_size < joined.stat().st_size


def test_joined_record_parts_keep_the_label_base(tree, tmp_path):
    import filecmp

    whole = tmp_path / "whole.records"
    imagefeed.pack(tree, whole, "records", label_base=1, progress=False)
    parts = [tmp_path / f"p{i}.records" for i in range(2)]
    for i, part in enumerate(parts):
        imagefeed.pack(tree, part, "records", part=(i, 2), label_base=1, progress=False)
    joined = tmp_path / "joined.records"
    imagefeed.join(parts, joined, "records", label_base=1, progress=False)
    shards = sorted(p.name for p in whole.glob("*.tfrecord"))
    assert shards and shards == sorted(p.name for p in joined.glob("*.tfrecord"))
    assert all(filecmp.cmp(whole / s, joined / s, shallow=False) for s in shards)


def _console_script() -> str:
    """Where the wheel installed its `pack-dataset` console script: beside the interpreter in a
    virtual environment, or on PATH for a `pip install --target` (as the GPU check installs)."""
    import shutil
    import sys

    beside = os.path.join(os.path.dirname(sys.executable), "pack-dataset")
    script = beside if os.access(beside, os.X_OK) else shutil.which("pack-dataset")
    assert script, f"the wheel installs {beside} (or a pack-dataset on PATH)"
    return script


def _pack_dataset(*args, **kw):
    """The wheel's `pack-dataset` console script."""
    import subprocess

    return subprocess.run([_console_script(), *map(str, args)], capture_output=True, text=True,
                          timeout=120, **kw)


def test_the_wheel_ships_pack_dataset_as_a_console_script_and_a_module(tmp_path):
    """#32 item 8: a pip user has the packer: `pack-dataset` and `python -m imagefeed`."""
    import subprocess
    import sys

    src, out = tmp_path / "src", tmp_path / "out.lmdb"
    done = _pack_dataset("synth", src, "--classes", "3", "--per-class", "4", "--size", "24x16")
    assert done.returncode == 0, done.stderr
    done = _pack_dataset("imagefolder2lmdb", src, out)
    assert done.returncode == 0 and out.exists(), done.stderr
    assert len(imagefeed.Dataset(out, decode="bytes")) == 12
    inspect = _pack_dataset("inspect", out, "--json")
    assert inspect.returncode == 0 and json.loads(inspect.stdout)["num_samples"] == 12
    for module in ("imagefeed", "imagefeed.pack_dataset"):
        verify = subprocess.run([sys.executable, "-m", module, "verify", str(out), "--against", str(src)],
                                capture_output=True, text=True, timeout=120)
        assert verify.returncode == 0, verify.stderr
    # Usage errors and a missing dataset: clap's exit code 2, and the path named.
    assert _pack_dataset("no-such-command").returncode == 2
    missing = _pack_dataset("inspect", tmp_path / "nothing.lmdb")
    assert missing.returncode == 2 and "nothing.lmdb" in missing.stderr
    assert _pack_dataset("--version").stdout.startswith("pack-dataset ")
    # `| head` ends it quietly, as the binary (SIGPIPE's default action is restored).
    shell = subprocess.run(f"'{_console_script()}' --help | head -1",
                           shell=True, capture_output=True, text=True, timeout=60)
    assert shell.returncode == 0 and "Traceback" not in shell.stderr and "panicked" not in shell.stderr


def test_ctrl_c_stops_the_console_scripts_pack_saying_how_to_finish(tmp_path):
    import signal
    import subprocess
    import time

    src, out = tmp_path / "src", tmp_path / "out.lmdb"
    replicated_tree(src, classes=4, per_class=130, size=(256, 192), distinct=10)
    partial = tmp_path / "out.lmdb.partial"
    script = _console_script()
    proc = subprocess.Popen([script, "imagefolder2lmdb", str(src), str(out), "--threads", "1",
                             "--resize", "48", "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 30
        while not partial.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "to finish: pack-dataset imagefolder2lmdb" in err and "--resume" in err, err
    assert "Traceback" not in err and partial.exists() and not out.exists()
    finish = _pack_dataset("imagefolder2lmdb", src, out, "--threads", "1", "--resize", "48", "-q", "--resume")
    assert finish.returncode == 0, finish.stderr
    assert imagefeed.verify(out)["ok"]
