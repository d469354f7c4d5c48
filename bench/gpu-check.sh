#!/usr/bin/env bash
# The GPU feed's verification, in two halves so that the GPU machine needs no Rust toolchain:
#
#   bench/gpu-check.sh build [DIR]   here: builds the GPU tests, imagefeed-bench, pack-dataset
#                                    and the training example in release, stripped, and packs
#                                    them into DIR (default gpu-check/) with the shared
#                                    libraries they link beyond the C library, the benchmark
#                                    data and this script; DIR and the repository together stay
#                                    under the device tool's 64 MiB (as many ImageNet photos as
#                                    fit)
#   DIR/gpu-check.sh run [DIR]       on a CUDA machine: checks glibc, finds cuBLAS, runs every
#                                    step below, going on after a failure, and prints a summary
#   bench/gpu-check.sh find-cublas OUT [ROOT...]
#                                    links libcublas.so / libcublasLt.so in OUT to the newest
#                                    CUDA 13 or 12 cuBLAS under ROOTs (default: the Python
#                                    packages' nvidia/ folders, the CUDA toolkit, ldconfig)
#
# DATA=path/to/folder-with-cifar10-test.tar.gz-and-imagenet-sample-200.tar (default
# ../shared/data) supplies the real images; without them a synthetic tree stands in.
# On the GPU machine, TORCH_PYTHON=python-with-torch (default: python3) runs the PyTorch
# comparisons; they are skipped, saying so, when torch cannot be imported. PART=gpu runs the
# GPU steps and the Python package (tests, loops) alone, PART=load the loading comparisons
# alone (each fits a 10-minute call on a 16-core machine); LOAD_WORKERS (default
# "1 2 4 8 16") the worker counts those compare.
set -uo pipefail

mode=${1:-}
dir=${2:-gpu-check}
LIMIT_BYTES=$((64 << 20))
# Room kept for what else travels with DIR (headers, rounding).
MARGIN_BYTES=$((2 << 20))

build() {
    set -e
    local root
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    cd "$root"
    scripts/install-deps.sh
    rm -rf "$dir"
    mkdir -p "$dir/payload/bin" "$dir/payload/lib" "$dir/data"
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
        cp "$exe" "$dir/payload/bin/test-$name"
    done <<<"$tests"
    cp target/release/imagefeed-bench target/release/pack-dataset \
        target/release/examples/train_cifar_gpu "$dir/payload/bin/"
    strip "$dir"/payload/bin/*
    # Shared libraries beyond the C library (libcuda comes from the driver). The run uses one
    # only where the machine lacks it, so its own libssl, libcurl &c. are never shadowed.
    for bin in "$dir"/payload/bin/*; do
        ldd "$bin" | awk '/=> \// {print $3}'
    done | sort -u | grep -v -E '/(libc|libm|libdl|libpthread|librt|libresolv|libgcc_s|ld-linux[^/]*)\.so' |
        while read -r lib; do cp -L "$lib" "$dir/payload/lib/"; done
    ldd --version | head -1 | awk '{print $NF}' >"$dir/payload/glibc-built-with"
    cp bench/torch_baseline.py bench/cold_warm.sh "$dir/payload/"
    echo "== the Python package: the wheel, its tests and pytest's wheels (the GPU machine has no network)"
    make python
    mkdir -p "$dir/payload/wheels" "$dir/payload/python" "$dir/payload/fixtures" "$dir/payload/examples"
    cp target/wheels/imagefeed-*.whl "$dir/payload/wheels/"
    .venv/bin/pip download -q -d "$dir/payload/wheels" pytest==9.2.0
    cp -r python/tests "$dir/payload/python/"
    cp -r fixtures/imagefolder fixtures/compat "$dir/payload/fixtures/"
    cp examples/train_pytorch.py examples/imagenet_ddp.py "$dir/payload/examples/"
    cp bench/python_loader.py "$dir/payload/"
    # xz: a quarter smaller than gzip on these binaries, room for ImageNet photos.
    tar -C "$dir" -cf - payload | xz -T0 -6 >"$dir/payload.tar.xz"
    rm -rf "$dir/payload"
    cp bench/gpu-check.sh "$dir/"
    echo "== data"
    local data=${DATA:-$root/../shared/data}
    # The device tool sends the repository's files with DIR and counts them as a tar of them
    # would (7,800 small files: 15 MB, twice their bytes).
    local repo_bytes
    repo_bytes=$(git ls-files -z | tar --null -cf - -T - | wc -c)
    if [ -f "$data/cifar10-test.tar.gz" ] && [ -f "$data/imagenet-sample-200.tar" ]; then
        cp "$data/cifar10-test.tar.gz" "$dir/data/"
        local room
        room=$((LIMIT_BYTES - MARGIN_BYTES - repo_bytes - $(tar -cf - "$dir" | wc -c)))
        python3 - "$data/imagenet-sample-200.tar" "$dir/data/imagenet-sample-200.tar" "$room" <<'PY'
import sys, tarfile
source, target, room = sys.argv[1], sys.argv[2], int(sys.argv[3])
with tarfile.open(source) as src, tarfile.open(target, "w") as out:
    photos = sorted((m for m in src.getmembers() if m.isfile()), key=lambda m: m.name)
    kept, used = 0, 1024  # the end-of-archive blocks
    for m in photos:
        size = 512 + (m.size + 511) // 512 * 512
        if used + size > room:
            break
        out.addfile(m, src.extractfile(m))
        kept, used = kept + 1, used + size
print(f"ImageNet photos: {kept} of {len(photos)} fit beside the payload")
PY
    else
        echo "no real images in $data: a synthetic CIFAR-like tree stands in"
        target/release/pack-dataset synth "$dir/data/cifar10-test" --classes 10 --per-class 500 --size 32x32
        tar -C "$dir/data" -czf "$dir/data/cifar10-test.tar.gz" cifar10-test
        rm -rf "$dir/data/cifar10-test"
    fi
    local size
    size=$(tar -cf - "$dir" | wc -c)
    echo "$dir: $((size >> 20)) MiB, with the repository $(((size + repo_bytes) >> 20)) MiB (the limit is 64 MiB)"
    if [ "$((size + repo_bytes))" -gt "$LIMIT_BYTES" ]; then
        echo "error: $dir and the repository are over 64 MiB together" >&2
        exit 1
    fi
    echo "built $dir; on the CUDA machine, from the folder holding it: $dir/gpu-check.sh run $dir"
}

# find-cublas OUT [ROOT...]: links OUT/libcublas.so and OUT/libcublasLt.so to the newest CUDA
# 13 (else 12) cuBLAS found, and prints the folder it is in. cudarc looks for libcublas.so,
# .so.12, .so.11...: never .so.13, so CUDA 13's is reached through the unversioned link.
find_cublas() {
    local out=$1
    shift
    local roots=("$@")
    if [ ${#roots[@]} -eq 0 ]; then
        local py
        for py in ${TORCH_PYTHON:-python3} python3; do
            while read -r site; do
                [ -d "$site/nvidia" ] && roots+=("$site/nvidia")
            done < <("$py" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null)
        done
        roots+=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu)
    fi
    local major found=""
    for major in 13 12; do
        found=$(find "${roots[@]}" -name "libcublas.so.$major*" \( -type f -o -type l \) 2>/dev/null | sort | head -1)
        [ -n "$found" ] && break
    done
    if [ -z "$found" ]; then
        echo "no libcublas.so.13 or .so.12 under: ${roots[*]}" >&2
        return 1
    fi
    local folder
    folder=$(dirname "$found")
    local lt
    lt=$(find "$folder" -maxdepth 1 -name "libcublasLt.so.$major*" 2>/dev/null | sort | head -1)
    mkdir -p "$out"
    ln -sfn "$found" "$out/libcublas.so"
    [ -n "$lt" ] && ln -sfn "$lt" "$out/libcublasLt.so"
    echo "$folder"
}

# One step of the run: logs its output, reports its status, never stops the run.
failures=()
step() {
    local name=$1
    shift
    echo "== $name" | tee -a "$log"
    "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "!! step failed (exit $rc): $name" | tee -a "$log"
        failures+=("$name (exit $rc)")
    fi
}

# Lines of the log matching a pattern, or a note that there were none (never fails).
summary() {
    local label=$1 pattern=$2
    local lines
    lines=$(grep -E -- "$pattern" "$log" || true)
    if [ -n "$lines" ]; then
        sed "s/^/$label: /" <<<"$lines"
    else
        echo "$label: (no output: see the log)"
    fi
}

# install_wheels PYTHON DIR WHEEL...: the wheels (pure Python or abi3, no scripts) into DIR, with
# pip where PYTHON has it, else unpacked as they are (a venv made without pip).
install_wheels() {
    local py=$1 target=$2
    shift 2
    if "$py" -m pip --version >/dev/null 2>&1; then
        "$py" -m pip install -q --no-index --no-deps --target "$target" "$@"
    else
        echo "no pip for $py: unpacking the wheels into $target"
        local wheel
        for wheel in "$@"; do "$py" -m zipfile -e "$wheel" "$target" || return; done
    fi
}

run() {
    cd "$dir" || { echo "no directory $dir" >&2; exit 2; }
    log=$PWD/gpu-check.log
    : >"$log"
    rm -rf payload work
    tar -xf payload.tar.xz
    mkdir -p work
    local built have
    built=$(cat payload/glibc-built-with)
    have=$(ldd --version | head -1 | awk '{print $NF}')
    echo "glibc: built with $built, this machine has $have" | tee -a "$log"
    if [ "$(printf '%s\n%s\n' "$built" "$have" | sort -V | head -1)" != "$built" ]; then
        echo "error: this machine's glibc $have is older than $built: rebuild on an older system" | tee -a "$log"
        exit 2
    fi
    # Only the libraries this machine lacks come from the payload.
    mkdir -p payload/needed
    local bin lib
    for bin in payload/bin/*; do
        ldd "$bin" | awk '/not found/ {print $1}'
    done | sort -u | while read -r lib; do
        if [ -f "payload/lib/$lib" ]; then ln -sfn "../lib/$lib" "payload/needed/$lib"; fi
    done
    export LD_LIBRARY_PATH="$PWD/payload/needed${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    local cublas_dir
    if cublas_dir=$(find_cublas "$PWD/payload/cublas"); then
        export LD_LIBRARY_PATH="$PWD/payload/cublas:$cublas_dir:$LD_LIBRARY_PATH"
        # The example and the benchmark load it by this name (imagefeed::gpu::blas).
        export IMAGEFEED_CUBLAS
        IMAGEFEED_CUBLAS=$(readlink "$PWD/payload/cublas/libcublas.so")
        echo "cuBLAS: $IMAGEFEED_CUBLAS" | tee -a "$log"
    else
        echo "cuBLAS: not found; the overlap measurement and the training example will fail" | tee -a "$log"
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$log"
    echo "cores: $(nproc)" | tee -a "$log"
    local torch_py=${TORCH_PYTHON:-python3}
    # torch and numpy: the Python package's tests and loops, the torch bandwidth; torchvision
    # too: the PyTorch DataLoader baseline.
    local torch=1 torchvision=1
    if ! "$torch_py" -c 'import torch, numpy' 2>/dev/null; then
        torch=0 torchvision=0
        echo "torch or numpy not importable with $torch_py: the Python package and the PyTorch comparisons are skipped" | tee -a "$log"
    elif ! "$torch_py" -c 'import torchvision' 2>/dev/null; then
        torchvision=0
        echo "torchvision not importable with $torch_py: the PyTorch DataLoader comparisons are skipped" | tee -a "$log"
    fi

    tar -C work -xzf data/cifar10-test.tar.gz
    [ -f data/imagenet-sample-200.tar ] && tar -C work -xf data/imagenet-sample-200.tar
    local B=payload/bin
    local copies=0 photos=0
    local part=${PART:-all}
    case "$part" in
        all | gpu | load) ;;
        *) echo "error: PART is all, gpu or load, not $part" | tee -a "$log"; exit 2 ;;
    esac
    echo "part: $part" | tee -a "$log"
    step "pack CIFAR-10 test set as LMDB" "$B/pack-dataset" imagefolder2lmdb work/cifar10-test work/cifar.lmdb --force -q --threads "$(nproc)"
    if [ -d work/imagenet-sample-200 ]; then
        # Hard-linked copies, 25 or more: an epoch of at least 5,000 images, long enough to
        # time, however many photos fitted in the 64 MiB.
        local i
        photos=$(find work/imagenet-sample-200 -type f | wc -l)
        copies=$(((5000 + photos - 1) / photos))
        [ "$copies" -lt 25 ] && copies=25
        for i in $(seq -w 1 "$copies"); do
            (cd work/imagenet-sample-200 && find . -type f) | while read -r f; do
                mkdir -p "work/imagenet-copies/$(dirname "$f")"
                ln -f "work/imagenet-sample-200/$f" "work/imagenet-copies/${f%.*}-$i.${f##*.}"
            done
        done
        step "pack ImageNet ${photos}x$copies as LMDB" "$B/pack-dataset" imagefolder2lmdb work/imagenet-copies work/imagenet.lmdb --force -q --threads "$(nproc)"
    fi

    if [ "$part" != load ]; then
        step "GPU unit tests" "$B/test-imagefeed" gpu:: --nocapture --test-threads 1
        step "GPU tests (tests/gpu.rs)" "$B/test-gpu" --nocapture --test-threads 1
        if grep -q -E "skipped, no GPU|no GPU here" "$log"; then
            echo "!! the GPU tests skipped: no usable device (see above)" | tee -a "$log"
            failures+=("GPU tests skipped")
        fi
        step "bandwidth and overlap, batch 128, 2 ms steps" "$B/imagefeed-bench" gpu --batch 128 --step-ms 2
        step "overlap, batch 256, 5 ms steps" "$B/imagefeed-bench" gpu --batch 256 --step-ms 5 --copy-mib 64
        if [ "$torch" = 1 ]; then
            step "torch host-to-device bandwidth" "$torch_py" - <<'EOF'
import torch
for mib in (1, 8, 64):
    n = mib << 20
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    for pinned in (True, False):
        src = torch.ones(n, dtype=torch.uint8)
        if pinned:
            src = src.pin_memory()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        rates = []
        for _ in range(21):
            start.record()
            dev.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            rates.append(n / (start.elapsed_time(end) * 1e-3) / 1e9)
        rates = sorted(rates[1:])
        kind = "page-locked" if pinned else "pageable"
        print(f"torch host-to-device {mib} MiB, median of 20: {kind} {rates[len(rates) // 2]:.2f} GB/s")
EOF
        fi
        step "training example: softmax regression on CIFAR-10, 5 epochs" "$B/train_cifar_gpu" work/cifar.lmdb --epochs 5 --batch-size 256 --depth 2 --workers 4
        if [ "$torch" = 1 ]; then
            # The Python package against this machine's torch and GPU: its whole test suite (the
            # CUDA tests included), then the Python loop beside the Rust one, CPU and CUDA batches.
            step "install the Python package into work/pylib" install_wheels "$torch_py" work/pylib payload/wheels/*.whl
            step "Python tests (torch, CUDA)" env PYTHONPATH="$PWD/work/pylib" PATH="$PWD/work/pylib/bin:$PATH" IMAGEFEED_BENCH="$PWD/$B/imagefeed-bench" "$torch_py" -m pytest -q -rs -p no:cacheprovider payload/python/tests
            local device
            for device in cpu cuda; do
                step "Python loop vs Rust loop, CIFAR-10 LMDB, 8 workers, $device batches" env PYTHONPATH="$PWD/work/pylib" "$torch_py" payload/python_loader.py work/cifar.lmdb --bench "$B/imagefeed-bench" --transform cifar --batch-size 256 --workers 8 --epochs 5 --rounds 3 --device "$device"
                [ -f work/imagenet.lmdb ] && step "Python loop vs Rust loop, ImageNet ${photos}x$copies LMDB, 8 workers, $device batches" env PYTHONPATH="$PWD/work/pylib" "$torch_py" payload/python_loader.py work/imagenet.lmdb --bench "$B/imagefeed-bench" --transform imagenet --batch-size 64 --workers 8 --epochs 2 --rounds 3 --device "$device"
            done
        fi
    fi
    if [ "$part" != gpu ]; then
        # Issue 34's cold target on this machine's disk: warm, reopened and cold epochs of the
        # CIFAR-10 test set, 2 workers, plain and with shared JPEG headers.
        step "pack CIFAR-10 test set as LMDB with shared headers" "$B/pack-dataset" imagefolder2lmdb work/cifar10-test work/cifar-shared.lmdb --shared-headers --force -q --threads "$(nproc)"
        step "cold against warm, CIFAR-10 LMDB, 2 workers" bash payload/cold_warm.sh "$B/imagefeed-bench" 3 work/cifar.lmdb work/cifar-shared.lmdb
    fi
    local w
    [ "$part" = gpu ] && LOAD_WORKERS=""
    for w in ${LOAD_WORKERS-1 2 4 8 16}; do
        step "load CIFAR-10 LMDB, $w workers" "$B/imagefeed-bench" load work/cifar.lmdb --batch-size 256 --workers "$w" --epochs 5 --warmup 1 --transform cifar
        [ "$torchvision" = 1 ] && step "torch DataLoader CIFAR-10, $w workers" "$torch_py" payload/torch_baseline.py work/cifar10-test --transform cifar --batch-size 256 --workers "$w" --epochs 3 --pin-memory
        if [ -f work/imagenet.lmdb ]; then
            step "load ImageNet ${photos}x$copies LMDB, $w workers" "$B/imagefeed-bench" load work/imagenet.lmdb --batch-size 64 --workers "$w" --epochs 2 --warmup 1 --transform imagenet
            [ "$torchvision" = 1 ] && step "torch DataLoader ImageNet ${photos}x$copies, $w workers" "$torch_py" payload/torch_baseline.py work/imagenet-copies --transform imagenet --batch-size 64 --workers "$w" --epochs 2 --pin-memory
        fi
    done

    echo
    echo "== summary"
    summary tests "test result"
    summary bandwidth "host-to-device"
    summary overlap "^\| [0-9]|^step:"
    summary training "^epoch [0-9]+: mean loss"
    # pytest -q ends with "N passed, M skipped in T s" at the start of a line (cargo's own
    # counts follow "test result:"), and python_loader.py prints a table of loops.
    summary python "^[0-9]+ (passed|failed|skipped|error)|^(FAILED|ERROR) |^\\| (Python|Rust|PyTorch)"
    summary cold "^[0-9]+ cifar(-shared)?\\.lmdb (warm|reopen|cold) "
    summary load "^== (load|torch DataLoader)|^epoch [0-9]+: [0-9]+ images in|\"event\": \"epoch\""
    if [ ${#failures[@]} -gt 0 ]; then
        printf 'failed: %s\n' "${failures[@]}"
    else
        echo "every step passed"
    fi
    echo "full log: $log"
    [ ${#failures[@]} -eq 0 ]
}

case "$mode" in
    build) build ;;
    run) run ;;
    find-cublas) shift; find_cublas "$@" ;;
    *) echo "usage: $0 build|run [DIR] | find-cublas OUT [ROOT...]" >&2; exit 2 ;;
esac
