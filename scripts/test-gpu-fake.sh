#!/usr/bin/env bash
# The GPU path on a machine without a GPU (`make test-gpu-fake`, part of `make test`):
#  1. builds the fake CUDA driver (tests/fake_cuda) and runs every GPU test on it;
#  2. trains the CUDA example on a small synthetic dataset on it, checking the loss falls;
#  3. NVIDIA's assembler and compiler on the shipped PTX (scripts/check-ptx.sh).
# What this proves and what it cannot (bandwidth, overlap, a real device) is in docs/gpu.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cargo=${CARGO:-cargo}
fake=$root/target/fake-cuda
tests/fake_cuda/build.sh "$fake"
export LD_LIBRARY_PATH="$fake${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

REQUIRE_FAKE=1 CARGO=$cargo scripts/gpu-tests-report.sh

# With the workspace's features and an example (so its dev-dependencies' features too) this is
# what `cargo test --workspace` built: nothing compiles again in `make test`.
$cargo build -q --workspace --example train_cifar_gpu --bin pack-dataset
data=$root/target/gpu-fake-data
if ! [ -d "$data" ]; then
    target/debug/pack-dataset synth "$data.tmp" --classes 10 --per-class 40 --size 32x32 >/dev/null
    mv "$data.tmp" "$data"
fi
out=$(target/debug/examples/train_cifar_gpu "$data" --epochs 4 --batch-size 50 --depth 2 2>&1) || {
    echo "$out"
    echo "error: the training example failed on the fake CUDA driver"
    exit 1
}
echo "training example on the fake CUDA driver:"
sed 's/^/  /' <<<"$out"
losses=$(grep -o 'mean loss [0-9.]*' <<<"$out" | awk '{print $3}')
first=$(head -1 <<<"$losses")
last=$(tail -1 <<<"$losses")
if ! awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }'; then
    echo "error: the example's loss did not fall ($first -> $last)"
    exit 1
fi

scripts/check-ptx.sh
