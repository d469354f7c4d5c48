#!/usr/bin/env bash
# `make test`: every test and check of the repository, scheduled for a 2-core machine.
#
# The work is the same as running these one after another (TESTING.md §7 has the figures):
#   build     every test binary of the workspace, linted by clippy as it compiles
#   wheel     the Python package built from that same build, installed into .venv
#   rust      the Rust tests (cargo-nextest: a process per test, both cores kept busy;
#             plain `cargo test` where nextest is not installed)
#   gpu-fake  the GPU tests and the CUDA example on the fake CUDA driver, ptxas on the PTX
#   minimal   the library without default features: it and its integration-test targets
#             built and linted, the integration suite run
#   python    the Python package's tests (pytest)
#   lint      the module layers, workspace-hack's features, mypy, ruff, rustfmt
# Compiling and testing overlap where one leaves a core idle: the wheel, and the build of
# `minimal` at low priority, run beside the Rust tests; pytest runs beside them too. Each phase's output is printed whole when the script waits for it (logs
# in target/make-test/), then a table of phases, the time each took and its result. Exit status
# 1 if any failed.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cargo=${CARGO:-cargo}
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
logs=$root/target/make-test
venv=.venv
rm -rf "$logs"
mkdir -p "$logs"
export IMAGEFEED_PYTHON=$root/$venv/bin/python
started=$(date +%s)
summary=()
failed=()

# Runs phase NAME (a shell function or command) with its output in NAME.log; records its time
# and result. `run_phase` waits for it; `start_phase` leaves it running (`end_phase` waits).
declare -A phase_pid phase_start
run_phase() {
    local name=$1
    shift
    start_phase "$name" "$@"
    end_phase "$name"
}
start_phase() {
    local name=$1
    shift
    phase_start[$name]=$(date +%s)
    echo "== $name: started at $((phase_start[$name] - started)) s"
    # The phase notes when it ended: it may be waited for later than that.
    (
        "$@"
        status=$?
        date +%s >"$logs/$name.ended"
        exit $status
    ) >"$logs/$name.log" 2>&1 &
    phase_pid[$name]=$!
}
end_phase() {
    local name=$1 status ended
    wait "${phase_pid[$name]}"
    status=$?
    ended=$(cat "$logs/$name.ended" 2>/dev/null || date +%s)
    local took=$((ended - phase_start[$name]))
    echo "== $name ($took s)"
    cat "$logs/$name.log"
    if [ "$status" -eq 0 ]; then
        summary+=("$(printf '%-9s %5d s  ok' "$name" "$took")")
    else
        summary+=("$(printf '%-9s %5d s  FAILED (exit %d; log: %s)' "$name" "$took" "$status" "$logs/$name.log")")
        failed+=("$name")
    fi
    return "$status"
}
finish() {
    echo
    echo "== make test: $(($(date +%s) - started)) s"
    printf '%s\n' "${summary[@]}"
    if [ ${#failed[@]} -gt 0 ]; then
        echo "make test: FAILED: ${failed[*]}"
        exit 1
    fi
    echo "make test: every phase passed"
    exit 0
}

# Clippy lints each workspace crate while it compiles (clippy-driver as the workspace's rustc
# wrapper, as `cargo clippy` sets it, but building instead of only checking), so no second,
# check-mode build of the whole dependency tree: ~150 s less on 2 cores. Same lints, same
# `-D warnings` as `make lint`; dependencies compile with plain rustc.
clippy_driver=
if command -v rustup >/dev/null 2>&1; then
    clippy_driver=$(rustup which clippy-driver 2>/dev/null)
fi
[ -x "$clippy_driver" ] || clippy_driver=$(command -v clippy-driver || true)
if [ -z "$clippy_driver" ]; then
    echo "error: clippy is not installed; run: rustup component add clippy" >&2
    exit 1
fi
export RUSTC_WORKSPACE_WRAPPER=$clippy_driver
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"

nextest=0
if $cargo nextest --version >/dev/null 2>&1; then
    nextest=1
else
    echo "make test: cargo-nextest not found: the Rust tests run one binary at a time" \
        "(cargo install cargo-nextest --locked: a few minutes less)"
fi

# The Python environment (mostly downloads) is set up while the tests compile.
pyenv() { make --no-print-directory pyenv; }
build() {
    $cargo test --workspace --no-run || return
    if [ "$nextest" = 1 ]; then
        # What nextest needs to run these binaries later without invoking cargo (which would
        # wait for the build directory while `minimal` compiles).
        $cargo metadata --format-version 1 >"$logs/cargo-metadata.json" &&
            $cargo nextest list --workspace --list-type binaries-only --message-format json \
                >"$logs/binaries-metadata.json"
    fi
}

# The test wheel: the dev profile, the system's libhdf5 and the features `cargo test --workspace`
# gave every crate, so that it links what the build just compiled (~40 s) instead of compiling
# its own HDF5 from C and a dozen dependencies again (~300 s). The shipped wheel (`make python`,
# `pip install ./python`) builds HDF5 2.x in; `make test-wheel` tests that one.
wheel() {
    local out=target/wheels-test
    rm -f "$out"/imagefeed-*.whl target/debug/deps/lib_native.so target/debug/lib_native.so
    PATH=$root/$venv/bin:$PATH $venv/bin/maturin build --profile dev -q --auditwheel skip \
        --features workspace-features \
        -m python/Cargo.toml -o "$out" -i "$venv/bin/python" &&
        $venv/bin/pip install -q --force-reinstall --no-deps "$out"/imagefeed-*.whl
}

# One S3 server (moto) for every object storage test of the run, named to them in
# IMAGEFEED_TEST_S3_ENDPOINT (each test works in buckets of its own), instead of one started by
# each test process (~1.3 s of CPU apiece). Without moto the tests start their own or skip.
s3_server_pid=
start_s3_server() {
    local moto=$root/$venv/bin/moto_server log=$logs/moto.log endpoint
    [ -x "$moto" ] || return 0
    # `timeout`: a run killed outright leaves no server behind for long.
    timeout 3600 "$moto" -H 127.0.0.1 -p 0 >"$log" 2>&1 &
    s3_server_pid=$!
    for _ in $(seq 300); do
        endpoint=$(grep -o -m1 'http://127\.0\.0\.1:[0-9]*' "$log")
        if [ -n "$endpoint" ]; then
            export IMAGEFEED_TEST_S3_ENDPOINT=$endpoint
            echo "make test: the object storage tests share moto_server at $endpoint"
            return 0
        fi
        kill -0 "$s3_server_pid" 2>/dev/null || break
        sleep 0.1
    done
    echo "make test: moto_server did not start (log: $log): each test starts its own"
    kill "$s3_server_pid" 2>/dev/null
    s3_server_pid=
}

rust() {
    local status
    start_s3_server
    if [ "$nextest" = 1 ] && [ -f "$logs/binaries-metadata.json" ]; then
        $cargo nextest run --cargo-metadata "$logs/cargo-metadata.json" \
            --binaries-metadata "$logs/binaries-metadata.json"
    elif [ "$nextest" = 1 ]; then
        # `make-test.sh rust` alone: no build phase wrote the metadata; nextest builds.
        $cargo nextest run --workspace
    else
        $cargo test --workspace
    fi
    status=$?
    [ -n "$s3_server_pid" ] && kill "$s3_server_pid" 2>/dev/null
    return $status
}

gpu_fake() { CARGO=$cargo scripts/test-gpu-fake.sh; }

minimal() {
    # The library and its integration-test targets (the suite run below among them); not the
    # library's unit-test binary, a second compile of every module that nothing here runs.
    nice -n 15 $cargo test -q -p imagefeed --no-default-features --test '*' --no-run || return
    $cargo test -q -p imagefeed --no-default-features --test integration || return
    local tree
    tree=$($cargo tree -q -p imagefeed --no-default-features -e normal --prefix none) || return
    if grep -E '^(hdf5|hdf5-metno|hdf5-sys|cudarc)' <<<"$tree"; then
        echo "error: the no-default-features build still depends on the crates above"
        return 1
    fi
    echo "minimal: the no-default-features build links neither libhdf5 nor CUDA"
}

python_tests() {
    IMAGEFEED_TEST_WHEEL_HDF5=system IMAGEFEED_BENCH=$root/target/debug/imagefeed-bench \
        $venv/bin/pytest -q -rs python/tests
}

lint() {
    local status=0
    python3 scripts/check_layers.py || status=1
    python3 scripts/check_workspace_hack.py || status=1
    if [ -x "$venv/bin/mypy" ]; then
        (cd python && ../$venv/bin/mypy) || status=1
        (cd python && ../$venv/bin/ruff check .) || status=1
    else
        echo "lint: no mypy or ruff in $venv (no python3?): the Python checks are skipped"
    fi
    $cargo fmt --all -- --check || status=1
    return $status
}

# `scripts/make-test.sh PHASE...` runs only those phases, one after another, up to the first
# that fails (`make test-minimal`, `make test-python`: no pytest on a stale wheel).
if [ $# -gt 0 ]; then
    for name in "$@"; do
        case $name in
        build | wheel | rust | minimal | lint) phase=$name ;;
        gpu-fake) phase=gpu_fake ;;
        python) phase=python_tests ;;
        *)
            echo "unknown phase: $name" >&2
            exit 2
            ;;
        esac
        run_phase "$name" "$phase" || finish
    done
    finish
fi

start_phase pyenv pyenv
if ! run_phase build build; then
    end_phase pyenv
    finish
fi
end_phase pyenv

# The Rust tests run from the build's binaries (no cargo), so the wheel links beside them
# instead of before them. The fake-driver GPU tests use cargo, so they go after the wheel and
# before `minimal` takes the build directory; then `minimal` compiles at low priority beside
# the test runs. pytest (one process, CPU-bound) needs the wheel and the fake driver gpu-fake
# builds; it starts then too, so that the end of the run is the Rust tests, which keep both
# cores busy, rather than pytest alone on one.
start_phase rust rust
start_phase lint lint
python_ok=0
if [ -x "$venv/bin/maturin" ]; then
    run_phase wheel wheel && python_ok=1
else
    echo "make test: no $venv (no python3?): the Python package's tests are skipped"
fi
start_phase gpu-fake gpu_fake
end_phase lint
end_phase gpu-fake
start_phase minimal minimal
if [ "$python_ok" = 1 ]; then
    start_phase python python_tests
fi
end_phase rust
if [ "$python_ok" = 1 ]; then
    end_phase python
fi
end_phase minimal
finish
