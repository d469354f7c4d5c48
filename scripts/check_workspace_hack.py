#!/usr/bin/env python3
"""Checks that workspace-hack/ asks for no dependency feature the rest of the workspace does not.

workspace-hack is a dev-dependency of the library whose only job is to make the library's
no-default-features test build (make test's `minimal`) ask for the features the workspace's
build already gives its dependencies, so that it reuses those compiled units (TESTING.md §7).
An entry nothing else asks for any more (after a dependency update, say) would turn a feature
on in every test build that no real build has. For each feature the hack asks for, this looks
up with `cargo tree -e features -i` who enables it, and fails unless some package other than
the hack does (directly, or through another feature of the same crate that one enables).

Run by `make lint` and make test's `lint` phase. Exit status 1 names each stale entry.
"""

import json
import re
import subprocess
import sys

HACK = "workspace-hack"
FEATURE = re.compile(r'^(\S+) feature "([^"]+)"')


def cargo(*args: str) -> str:
    return subprocess.run(["cargo", *args], check=True, capture_output=True, text=True).stdout


def matches(version: str, req: str) -> bool:
    """Whether `version` is what a caret requirement like "2" or "0.10" picks."""
    wanted = req.lstrip("^").split(".")
    return version.split(".")[: len(wanted)] == wanted


def requested() -> list[tuple[str, set[str]]]:
    """(package@version, features) for each dependency of the hack, build-dependencies too."""
    meta = json.loads(cargo("metadata", "--format-version", "1"))
    by_id = {p["id"]: p for p in meta["packages"]}
    hack = next(p for p in meta["packages"] if p["name"] == HACK)
    node = next(n for n in meta["resolve"]["nodes"] if n["id"] == hack["id"])
    resolved = [by_id[d["pkg"]] for d in node["deps"]]
    out = []
    for dep in hack["dependencies"]:
        pkg = next(
            p for p in resolved if p["name"] == dep["name"] and matches(p["version"], dep["req"])
        )
        features = set(dep["features"])
        if dep["uses_default_features"]:
            features.add("default")
        out.append((f"{pkg['name']}@{pkg['version']}", features))
    return out


def enablers(spec: str) -> dict[str, list[str]]:
    """Each feature of `spec` in the workspace's build, with what enables it."""
    tree = cargo("tree", "--workspace", "-e", "features", "-i", spec, "--prefix", "depth",
                 "--depth", "2", "--no-dedupe")
    found: dict[str, list[str]] = {}
    current = None
    for line in tree.splitlines():
        depth, text = int(re.match(r"\d+", line).group()), re.sub(r"^\d+", "", line)
        if depth == 1:
            m = FEATURE.match(text)
            current = m.group(2) if m else None
            if current is not None:
                found.setdefault(current, [])
        elif depth == 2 and current is not None:
            found[current].append(text)
    return found


def enabled_elsewhere(crate: str, feature: str, graph: dict[str, list[str]], seen: set[str]) -> bool:
    seen.add(feature)
    for enabler in graph.get(feature, []):
        m = FEATURE.match(enabler)
        if m is None:  # a package asking for the feature
            if enabler.split()[0] != HACK:
                return True
        elif m.group(1) != crate:  # another crate's feature, which the hack asks for none of
            return True
        elif m.group(2) not in seen and enabled_elsewhere(crate, m.group(2), graph, seen):
            return True
    return False


def main() -> int:
    stale = []
    for spec, features in requested():
        graph = enablers(spec)
        crate = spec.split("@")[0]
        for feature in sorted(features):
            if not enabled_elsewhere(crate, feature, graph, set()):
                stale.append(f"{spec}: feature {feature!r}")
    if stale:
        print("workspace-hack/Cargo.toml asks for features nothing else in the workspace enables")
        print("(remove them there):")
        for s in stale:
            print(f"  {s}")
        return 1
    print(f"check_workspace_hack: every feature {HACK} asks for is also enabled elsewhere")
    return 0


if __name__ == "__main__":
    sys.exit(main())
