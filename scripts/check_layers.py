#!/usr/bin/env python3
"""Checks that the library's modules depend only downward (ARCHITECTURE.md, "Layers").

Every top-level module of src/ has a layer in LAYERS below. A module may use (`crate::m`,
`crate::{m, ..}` over any number of lines, or `super::` chains that climb out of it) only
modules of a lower layer; inside one top-level module (format::lmdb using format::staging)
anything goes. Comments, string and char literals, and the `#[cfg(test)] mod tests` at the end
of a file are not dependencies and are skipped. A module missing from the table is an error
too, so a new module gets a layer when it is added.

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
    ["decode", "resize", "rng", "pool", "units"],
    # Errors (DecodeError is a source).
    ["error"],
    # Files, the page cache, reads through file maps.
    ["file", "pagecache", "mapguard"],
    # The sample model, batch membership, test data, the local cache directory.
    ["dataset", "sampler", "synthetic", "cache"],
    # Object storage: URLs, clients, fetching into the cache.
    ["remote"],
    # On-disk formats: readers, writers, their output lifecycle.
    ["format"],
    # Per-sample transforms.
    ["transform"],
    # Batches (buffers + layout).
    ["batch"],
    # The loader; packing and verifying (siblings: neither uses the other).
    ["loader", "pack", "verify"],
    # What sits on the loader or on packing.
    ["gpu", "inspect", "progress", "cli"],
    # Fuzzing entry points reach into everything.
    ["fuzzing"],
]

PATH_START = re.compile(r"\b(crate|super)::")


def strip_comments_and_strings(text):
    """The code of `text` with comments, string literals and char literals blanked out
    (newlines kept, so line numbers still match)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    out.append("\n" if text[i] == "\n" else " ")
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i:]) and not (i and (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = len(re.match(r'r(#*)"', text[i:]).group(1))
            end = text.find('"' + "#" * hashes, i + 2 + hashes)
            end = n if end < 0 else end + 1 + hashes
            out.append("".join("\n" if ch == "\n" else " " for ch in text[i:end]))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append("".join("\n" if ch == "\n" else " " for ch in text[i : j + 1]))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:]):
            m = re.match(r"'(\\.|[^\\'])'", text[i:])
            out.append(" " * len(m.group(0)))
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def group_items(text, start):
    """The top-level items of the brace group opening at `text[start]`, and where it ends."""
    depth, items, current, i = 0, [], [], start
    while i < len(text):
        c = text[i]
        if c == "{":
            depth += 1
            if depth == 1:
                i += 1
                continue
        elif c == "}":
            depth -= 1
            if depth == 0:
                items.append("".join(current))
                return [x.strip() for x in items if x.strip()], i
        elif c == "," and depth == 1:
            items.append("".join(current))
            current = []
            i += 1
            continue
        current.append(c)
        i += 1
    return [x.strip() for x in items if x.strip()], i


def used_modules(code, module_path):
    """(line, top-level module) for each path into the crate in `code`: `crate::x`,
    `crate::{x, y::{..}}` (over several lines too), and `super::` chains that climb out of
    `module_path` (the file's module, e.g. ["format", "lmdb"])."""
    for match in PATH_START.finditer(code):
        line = code.count("\n", 0, match.start()) + 1
        i = match.start()
        supers = 0
        if match.group(1) == "super":
            while code.startswith("super::", i):
                supers += 1
                i += len("super::")
            if supers < len(module_path):
                continue  # stays inside the file's own top-level module
        else:
            i = match.end()
        rest = code[i:].lstrip()
        if rest.startswith("{"):
            offset = i + (len(code[i:]) - len(rest))
            items, _ = group_items(code, offset)
            for item in items:
                name = re.match(r"[A-Za-z_][A-Za-z_0-9]*", item)
                if name and name.group(0) != "self":
                    yield line, name.group(0)
        else:
            name = re.match(r"[A-Za-z_][A-Za-z_0-9]*", rest)
            if name:
                yield line, name.group(0)


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


def module_path_of(src, path):
    rel = path.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "mod":
        parts.pop()
    return parts


def main():
    src = pathlib.Path(__file__).resolve().parent.parent / "src"
    table = layer_of()
    problems = []
    # The library's modules, and the one whose file lives outside src/ (`#[path]` in lib.rs).
    outside = {src.parent / "fuzz" / "targets.rs": "fuzzing"}
    for path in sorted(src.rglob("*.rs")) + sorted(outside):
        module = outside.get(path) or top_module(src, path)
        if module is None:
            continue
        if module not in table:
            problems.append(f"{path}: module `{module}` has no layer in scripts/check_layers.py")
            continue
        if path.name == "tests.rs":
            continue  # a module's unit tests in a file of their own (`#[cfg(test)] mod tests;`)
        text = path.read_text()
        # The unit tests at the end of a file are not a dependency of the library.
        tests = re.search(r"^#\[cfg\(test\)\]\s*\nmod tests\b", text, re.M)
        if tests:
            text = text[: tests.start()]
        code = strip_comments_and_strings(text)
        module_path = [module] if path in outside else module_path_of(src, path)
        for number, used in used_modules(code, module_path):
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
