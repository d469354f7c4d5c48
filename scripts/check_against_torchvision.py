#!/usr/bin/env python3
"""Checks an imagefeed LMDB against torchvision's own ImageFolder logic.

Runs torchvision's `find_classes` and `make_dataset` (taken from an installed torchvision, or
from a `folder.py` given with --folder-py, e.g. unzipped from the torchvision wheel, so torch
itself is not needed) on SRC_DIR, reads DATASET with py-lmdb exactly as docs/formats.md documents,
and requires the same classes, and the same (relative path, label) list minus the files
packing rejected (listed in DATASET.report.json).

usage: check_against_torchvision.py DATASET.lmdb SRC_DIR [--folder-py PATH]
"""
import argparse
import ast
import json
import os
import struct
import sys


def torchvision_functions(folder_py):
    """Loads IMG_EXTENSIONS, has_file_allowed_extension, find_classes, make_dataset from
    torchvision/datasets/folder.py without importing torch or PIL."""
    if folder_py is None:
        import torchvision.datasets.folder as folder  # noqa: the real package, if installed
        folder_py = folder.__file__
    source = open(folder_py, encoding="utf-8").read()
    wanted = {"IMG_EXTENSIONS", "has_file_allowed_extension", "find_classes", "make_dataset"}
    keep = []
    for node in ast.parse(source).body:
        names = {node.name} if isinstance(node, ast.FunctionDef) else {
            t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)}
        if names & wanted:
            keep.append(ast.get_source_segment(source, node))
    namespace = {}
    exec("import os\nfrom pathlib import Path\nfrom typing import *\n" + "\n\n".join(keep), namespace)
    return namespace, folder_py


def read_lmdb(path):
    import lmdb
    env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_dbs=2)
    meta = env.open_db(b"meta")
    samples = env.open_db(b"samples")
    with env.begin() as txn:
        info = json.loads(txn.get(b"info", db=meta))
        rows = []
        for i in range(info["num_samples"]):
            v = txn.get(i.to_bytes(8, "big"), db=samples)
            label, k = struct.unpack_from("<II", v)
            rows.append((v[8:8 + k].decode(), label))
    return info, rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dataset")
    parser.add_argument("src_dir")
    parser.add_argument("--folder-py")
    args = parser.parse_args()

    tv, folder_py = torchvision_functions(args.folder_py)
    classes, class_to_idx = tv["find_classes"](args.src_dir)
    expected = [(os.path.relpath(p, args.src_dir).replace(os.sep, "/"), label)
                for p, label in tv["make_dataset"](args.src_dir, class_to_idx, tv["IMG_EXTENSIONS"])]
    report_path = args.dataset + ".report.json"
    rejected = set()
    if os.path.exists(report_path):
        rejected = {r["key"] for r in json.load(open(report_path))["rejected"]}
    expected = [e for e in expected if e[0] not in rejected]

    info, rows = read_lmdb(args.dataset)
    problems = []
    if info["classes"] != classes:
        problems.append(f"classes differ: {info['classes'][:5]}... vs torchvision {classes[:5]}...")
    if rows != expected:
        diff = next((i for i, (a, b) in enumerate(zip(rows, expected)) if a != b), min(len(rows), len(expected)))
        problems.append(f"{len(rows)} records vs {len(expected)} expected; first difference at {diff}: "
                        f"{rows[diff] if diff < len(rows) else None} vs {expected[diff] if diff < len(expected) else None}")
    print(f"torchvision logic from {folder_py}")
    print(f"{args.dataset}: {len(rows)} records, {len(classes)} classes, {len(rejected)} rejected at pack time")
    for p in problems:
        print("MISMATCH", p)
    print("OK: keys, order and labels equal torchvision's ImageFolder" if not problems else "FAILED")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
