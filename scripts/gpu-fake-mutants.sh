#!/usr/bin/env bash
# Shows that the GPU tests on the fake CUDA driver catch the three ordering mistakes a GPU feed
# can make: for each, a copy of the tree with that mistake put back (the host batch handed back
# to the pool before its copy ran, the compute stream's wait for the copy removed, the copy
# stream's wait for the slot's release removed) must fail tests/gpu.rs, with the fake's message.
# Run by `make gpu-fake-mutants` (a few minutes: each mutant rebuilds the library).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cargo=${CARGO:-cargo}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$root/tests/fake_cuda/build.sh" "$root/target/fake-cuda"

mutate() { # name, then python that edits src/gpu/prefetch.rs (s) and must change it
    local name=$1 edit=$2 tree=$work/$1
    mkdir -p "$tree"
    (cd "$root" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$tree")
    python3 - "$tree/src/gpu/prefetch.rs" "$name" <<EOF
import sys
path, name = sys.argv[1], sys.argv[2]
s = open(path).read()
before = s
$edit
if s == before:
    sys.exit(f"mutant {name}: the code it changes is gone; update this script")
open(path, "w").write(s)
EOF
    local log=$work/$name.log
    if (cd "$tree" && CARGO_TARGET_DIR="$root/target/mutants" LD_LIBRARY_PATH="$root/target/fake-cuda" \
            $cargo test -q -p imagefeed --test gpu -- --test-threads 1 >"$log" 2>&1); then
        echo "mutant $name: NOT caught (the GPU tests passed)"
        return 1
    fi
    if ! grep -q "imagefeed fake CUDA: " "$log"; then
        echo "mutant $name: the tests failed, but not on a check of the fake driver:"
        tail -20 "$log"
        return 1
    fi
    echo "mutant $name: caught: $(grep -m1 -o 'imagefeed fake CUDA: .\{0,220\}' "$log")"
}

status=0
mutate host-batch-released-before-its-copy '
s = s.replace("let host = slot.host.insert(batch);", "let host = &batch;")
s = s.replace("        self.stats.bytes_copied += (total + 4 * n) as u64;",
              "        self.stats.bytes_copied += (total + 4 * n) as u64;\n        drop(batch);", 1)
' || status=1
mutate compute-stream-does-not-wait-for-the-copy '
s = s.replace("""        self.compute
            .wait(&self.slots[slot].ready)
            .map_err(cuda("waiting for a copy"))?;""", "")
' || status=1
mutate copy-stream-does-not-wait-for-the-release '
s = s.replace("""                self.copy
                    .wait(&slot.released)
                    .map_err(cuda("waiting for a release"))?;""", "")
' || status=1
exit $status
