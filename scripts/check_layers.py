#!/usr/bin/env python3
"""Checks that the library's modules depend only downward (ARCHITECTURE.md, "Layers").

Every top-level module of src/ has a layer in LAYERS below. A module may use (`crate::m`)
only modules of a lower layer; inside one top-level module (format::lmdb using format::output)
anything goes, since the compiler sees those as one unit. Doc comments, comments and the
`#[cfg(test)]` part at the end of a file are not dependencies and are skipped. A module missing
from the table is an error too, so a new module gets a layer when it is added.

Run by `make lint`. Exit status 1 lists each upward or sideways use with file and line.
"""

import pathlib
import re
import sys

# Bottom to top. A module uses only those on lower lines.
LAYERS = [
    # The rectangle type crops are given in.
    ["geometry"],
    # Codecs and pure helpers.
    ["decode", "resize", "rng", "pool"],
    # Errors (DecodeError is a source).
    ["error"],
    # Files and the page cache.
    ["file", "pagecache"],
    # The sample model, batch membership, test data.
    ["dataset", "sampler", "synthetic"],
    # On-disk formats: readers, writers, their output lifecycle.
    ["format"],
    # Per-sample transforms.
    ["transform"],
    # Batches (buffers + layout).
    ["batch"],
    # The loader; packing and verifying (siblings: neither uses the other).
    ["loader", "pack", "verify"],
    # What sits on the loader or on packing.
    ["gpu", "inspect", "progress"],
    # Fuzzing entry points reach into everything.
    ["fuzzing"],
]

CRATE_USE = re.compile(r"\bcrate::(\{[^}]*\}|[a-z_][a-z_0-9]*)")


def layer_of():
    table = {}
    for level, names in enumerate(LAYERS):
        for name in names:
            table[name] = level
    return table


def top_module(src, path):
    rel = path.relative_to(src)
    if rel.parts == ("lib.rs",):
        return None
    first = rel.parts[0]
    return first[:-3] if first.endswith(".rs") else first


def used_modules(line):
    for match in CRATE_USE.finditer(line):
        target = match.group(1)
        if target.startswith("{"):
            for item in target[1:-1].split(","):
                name = item.strip().split("::")[0]
                if name:
                    yield name
        else:
            yield target


def main():
    src = pathlib.Path(__file__).resolve().parent.parent / "src"
    table = layer_of()
    problems = []
    for path in sorted(src.rglob("*.rs")):
        module = top_module(src, path)
        if module is None:
            continue
        if module not in table:
            problems.append(f"{path}: module `{module}` has no layer in scripts/check_layers.py")
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip() == "#[cfg(test)]":
                break  # the unit tests: not a dependency of the library
            code = line.split("//", 1)[0]
            for used in used_modules(code):
                if used == module or used not in table:
                    continue  # inside one module, or a crate-root item (Error, MAX_THREADS)
                if table[used] >= table[module]:
                    problems.append(
                        f"{path.relative_to(src.parent)}:{number}: `{module}` (layer "
                        f"{table[module]}) uses `{used}` (layer {table[used]}): dependencies "
                        "point down only"
                    )
    for problem in problems:
        print(problem)
    if problems:
        return 1
    print(f"check_layers: {len(table)} modules, every dependency points down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
