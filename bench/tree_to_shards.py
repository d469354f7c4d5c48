#!/usr/bin/env python3
"""Writes an ImageFolder tree as a WebDataset set and an MDS set of 4 shards each, samples
shuffled (seed 0), for benchmarks of those readers (bench/RESULTS.md):

    bench/tree_to_shards.py TREE WDS_DIR MDS_DIR

WebDataset: shard-00000N.tar, each sample KEY.jpg and KEY.cls. MDS: index.json (version 2)
and shard.0000N.mds with a `jpeg` column x and an `int` label y, laid out as MDSWriter lays
them out. Only the standard library is needed.
"""
import io
import json
import os
import random
import struct
import sys
import tarfile

SHARDS = 4


def main(tree, wds, mds):
    classes = sorted(os.listdir(tree))
    items = [
        (os.path.join(tree, c, f), label)
        for label, c in enumerate(classes)
        for f in sorted(os.listdir(os.path.join(tree, c)))
    ]
    random.Random(0).shuffle(items)
    per = (len(items) + SHARDS - 1) // SHARDS
    os.makedirs(wds, exist_ok=True)
    os.makedirs(mds, exist_ok=True)
    entries = []
    for shard in range(SHARDS):
        part = items[shard * per:(shard + 1) * per]
        images = [open(path, "rb").read() for path, _ in part]
        with tarfile.open(os.path.join(wds, f"shard-{shard:06d}.tar"), "w",
                          format=tarfile.USTAR_FORMAT) as tar:
            for k, (image, (_, label)) in enumerate(zip(images, part)):
                for ext, data in (("jpg", image), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"s{shard}_{k:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        samples = [struct.pack("<I", len(image)) + image + struct.pack("<q", label)
                   for image, (_, label) in zip(images, part)]
        offsets = [4 + 4 * (len(samples) + 1)]
        for sample in samples:
            offsets.append(offsets[-1] + len(sample))
        name = f"shard.{shard:05d}.mds"
        with open(os.path.join(mds, name), "wb") as f:
            f.write(struct.pack("<I", len(samples)))
            f.write(struct.pack(f"<{len(offsets)}I", *offsets))
            for sample in samples:
                f.write(sample)
        entries.append({
            "format": "mds", "version": 2, "column_names": ["x", "y"],
            "column_encodings": ["jpeg", "int"], "column_sizes": [None, 8],
            "compression": None, "hashes": [], "size_limit": 1 << 27,
            "raw_data": {"basename": name, "bytes": offsets[-1], "hashes": {}},
            "samples": len(samples), "zip_data": None,
        })
    with open(os.path.join(mds, "index.json"), "w") as f:
        json.dump({"version": 2, "shards": entries}, f)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
