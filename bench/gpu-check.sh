#!/usr/bin/env bash
# The GPU feed's verification, in two halves so that the GPU machine needs no Rust toolchain:
#
#   bench/gpu-check.sh build [DIR]   here: builds the GPU tests, imagefeed-bench and the training
#                                    example in release, and puts them in DIR (default
#                                    gpu-check/) with the shared libraries they link (HDF5 &c.),
#                                    a CIFAR-like dataset packed as LMDB, and this script
#   DIR/gpu-check.sh run [DIR]       on a CUDA machine: runs the GPU tests, the bandwidth and
#                                    prefetch measurements and the training example, and prints
#                                    a summary table
#   bench/gpu-check.sh               both, on a CUDA machine that also has Rust
#
# DATASET=path/to/cifar10 (an ImageFolder tree or packed file) packs that instead of the
# generated tree; the shared CIFAR-10 test set is the intended one.
set -euo pipefail

mode=${1:-all}
dir=${2:-gpu-check}

build() {
    local root
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    cd "$root"
    scripts/install-deps.sh
    mkdir -p "$dir/bin" "$dir/lib"
    echo "== building (release)"
    cargo build --release -p imagefeed-bench -p pack-dataset
    cargo build --release -p imagefeed --example train_cifar_gpu
    # The test executables: the library's unit tests (gpu::tests) and tests/gpu.rs.
    local tests
    tests=$(cargo test --release -p imagefeed --lib --test gpu --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"])')
    while read -r name exe; do
        cp "$exe" "$dir/bin/test-$name"
    done <<<"$tests"
    cp target/release/imagefeed-bench target/release/pack-dataset \
        target/release/examples/train_cifar_gpu "$dir/bin/"
    # Line tables are of no use there; without them the directory is a fraction of the size.
    strip --strip-debug "$dir"/bin/*
    cp bench/gpu-check.sh "$dir/"
    # Shared libraries the binaries need beyond the C library (libcuda comes from the driver).
    for bin in "$dir"/bin/*; do
        ldd "$bin" | awk '/=> \// {print $3}'
    done | sort -u | grep -v -E '/(libc|libm|libdl|libpthread|librt|libresolv|ld-linux[^/]*)\.so' |
        while read -r lib; do cp -L "$lib" "$dir/lib/"; done
    echo "== dataset"
    if [ -n "${DATASET:-}" ]; then
        target/release/pack-dataset convert "$DATASET" "$dir/data.lmdb" --to lmdb --force -q
    else
        target/release/pack-dataset synth "$dir/tree" --classes 10 --per-class 500 --size 32x32
        target/release/pack-dataset imagefolder2lmdb "$dir/tree" "$dir/data.lmdb" --force -q
        rm -rf "$dir/tree"
    fi
    du -sh "$dir"
    echo "built $dir: copy it to the CUDA machine and run $dir/gpu-check.sh run $dir"
}

run() {
    cd "$dir"
    export LD_LIBRARY_PATH="$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    local status=0 log=gpu-check.log
    : >"$log"
    echo "== GPU tests" | tee -a "$log"
    # The library's own GPU unit tests (gpu::tests) and tests/gpu.rs; --nocapture shows a skip.
    bin/test-imagefeed gpu:: --nocapture --test-threads 1 2>&1 | tee -a "$log" || status=1
    bin/test-gpu --nocapture --test-threads 1 2>&1 | tee -a "$log" || status=1
    if grep -q -E "skipped, no GPU|no GPU here" "$log"; then
        echo "error: the GPU tests skipped: no usable device (see above)"; status=1
    fi
    echo "== bandwidth and prefetch depth (CIFAR-size batches, 2 ms steps)" | tee -a "$log"
    bin/imagefeed-bench gpu data.lmdb --transform cifar --depths 1,2,3 --step-us 2000 2>&1 | tee -a "$log" || status=1
    echo "== the same with 20 ms steps" | tee -a "$log"
    bin/imagefeed-bench gpu data.lmdb --transform cifar --depths 1,2 --step-us 20000 2>&1 | tee -a "$log" || status=1
    echo "== training example (softmax regression, cuBLAS), 5 epochs" | tee -a "$log"
    bin/train_cifar_gpu data.lmdb --epochs 5 --batch-size 256 --depth 2 2>&1 | tee -a "$log" || status=1
    echo
    echo "== summary"
    grep -E "test result" "$log" | sed 's/^/tests: /'
    grep -E "host-to-device" "$log"
    grep -E "^\| [0-9]" "$log" | sed 's/^/prefetch: /'
    grep -E "^epoch" "$log"
    echo "full log: $dir/$log"
    return $status
}

case "$mode" in
    build) build ;;
    run) run ;;
    all) build && run ;;
    *) echo "usage: $0 [build|run] [DIR]" >&2; exit 2 ;;
esac
