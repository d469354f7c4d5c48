"""Datasets in object storage from Python, against moto's S3 server on loopback: packing to an
``s3://`` URL, training from it with one URL change, and ``imagefeed.Dataset`` in worker
processes started by fork and by spawn (each builds its own client; a runtime inherited
through a fork is never used)."""

from __future__ import annotations

import multiprocessing
import re
import subprocess
import sys
import time

import pytest
from conftest import FLIP_NORMALIZE

import imagefeed

boto3 = pytest.importorskip("boto3", reason="boto3 and moto are not installed (make test installs them)")
pytest.importorskip("moto", reason="moto is not installed (make test installs it)")


@pytest.fixture(scope="module")
def endpoint():
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.time() + 30
    url = None
    while time.time() < deadline and url is None:
        line = server.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:\d+", line or "")
        url = found.group(0) if found else None
    if url is None:
        server.kill()
        pytest.skip("moto_server did not start")
    yield url
    server.kill()


@pytest.fixture
def storage(endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEFEED_CACHE_DIR", str(tmp_path / "cache"))
    options = {"aws_endpoint": endpoint, "aws_access_key_id": "test",
               "aws_secret_access_key": "test", "aws_region": "us-east-1"}
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test",
                      aws_secret_access_key="test", region_name="us-east-1")
    bucket = f"py-{tmp_path.name.lower().replace('_', '-')[-40:]}"
    s3.create_bucket(Bucket=bucket)
    return bucket, options


def test_pack_to_s3_then_train_from_it_with_one_url_change(storage, tree, lmdb_path):
    bucket, options = storage
    url = f"s3://{bucket}/train.records"
    summary = imagefeed.pack(tree, url, "records", progress=False, storage_options=options,
                             shard_bytes=64 << 10)
    assert summary["output"] == url
    with pytest.raises(imagefeed.OutputExistsError):
        imagefeed.pack(tree, url, "records", progress=False, storage_options=options)
    kw = dict(batch_size=32, workers=2, seed=3, output="numpy", transform=FLIP_NORMALIZE,
              rank=0, world_size=1)
    remote = [y.tolist() for _, y in imagefeed.Loader(url, storage_options=options, shard_window=2, **kw)]
    local = [y.tolist() for _, y in imagefeed.Loader(lmdb_path, **kw)]
    assert sum(map(len, remote)) == sum(map(len, local)) == 240
    report = imagefeed.inspect(url, storage_options=options)
    assert report["whole"] and report["num_samples"] == 240


def _read_all(dataset):
    return [dataset[i][1] for i in range(len(dataset))]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_dataset_reads_s3_in_worker_processes(storage, tree, method):
    bucket, options = storage
    url = f"s3://{bucket}/w.records"
    imagefeed.pack(tree, url, "records", progress=False, storage_options=options)
    dataset = imagefeed.Dataset(url, storage_options=options, decode="bytes")
    expected = _read_all(dataset)  # the parent reads first: its runtime and connections exist
    with multiprocessing.get_context(method).Pool(2) as pool:
        results = pool.map_async(_read_all, [dataset, dataset]).get(timeout=120)
    assert results == [expected, expected]


def test_wrong_credentials_and_urls_are_clear_errors(storage):
    bucket, options = storage
    with pytest.raises(imagefeed.DataError) as e:
        imagefeed.Dataset(f"s3://{bucket}/nothing-here", storage_options=options, decode="bytes")
    assert "no object under this prefix" in str(e.value)
    with pytest.raises(imagefeed.DataError) as e:
        imagefeed.Dataset("s5://bucket/x", decode="bytes")
    assert "unknown scheme" in str(e.value)
    with pytest.raises(imagefeed.ConfigError):
        imagefeed.Dataset(f"s3://{bucket}/x", storage_options={"aws_endpoint": 3}, decode="bytes")


def test_ranged_reads_read_each_record_alone(storage, tree, tmp_path):
    bucket, options = storage
    url = f"s3://{bucket}/ranged.records"
    imagefeed.pack(tree, url, "records", progress=False, storage_options=options,
                   shard_bytes=64 << 10)
    whole = imagefeed.Dataset(url, storage_options=options, decode="bytes")
    ranged = imagefeed.Dataset(url, storage_options=options, ranged_reads=True, decode="bytes")
    assert [ranged[i] for i in range(0, len(ranged), 7)] == [whole[i] for i in range(0, len(whole), 7)]
    kw = dict(batch_size=32, workers=4, seed=3, output="numpy", transform=FLIP_NORMALIZE,
              rank=0, world_size=1)
    a = [(x.tobytes(), y.tolist()) for x, y in imagefeed.Loader(url, storage_options=options, **kw)]
    b = [(x.tobytes(), y.tolist()) for x, y in
         imagefeed.Loader(url, storage_options=options, ranged_reads=True, **kw)]
    assert a == b
    with pytest.raises(imagefeed.ConfigError):
        imagefeed.Dataset(url, storage_options=options, ranged_reads="yes", decode="bytes")
