#!/usr/bin/env bash
# Coverage-guided fuzzing of imagefeed's parsers with AFL++ (cargo-afl: stable Rust).
#
#   scripts/fuzz.sh [TARGET ...]        every target when none is named
#   MINUTES=10   wall-clock minutes per target (each fuzzer keeps one core busy)
#   JOBS=2       targets fuzzed at once
#
# Seeds come from `fuzz-seeds`, plus the committed corpus. Afterwards each target's queue is
# minimized (afl-cmin) into fuzz/corpus/TARGET, crashing or hanging inputs are copied to
# fuzz/regressions/TARGET (cargo test replays both), and one line per target (executions, CPU
# seconds, crashes, hangs) is appended to target/fuzz/summary.tsv.
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${MINUTES:-10}
JOBS=${JOBS:-2}
AFL_VERSION=0.18.2
OUT=target/fuzz
BIN=target/afl/release/fuzz-target

if ! cargo afl --version >/dev/null 2>&1; then
    echo "== installing cargo-afl $AFL_VERSION (builds AFL++)"
    cargo install cargo-afl --locked --version "$AFL_VERSION"
fi
cargo afl config --build >/dev/null 2>&1 || true  # no-op once AFL++ is built for this rustc

echo "== building the instrumented harness"
CARGO_TARGET_DIR=target/afl cargo afl build --release -q -p imagefeed-fuzz --features afl --bin fuzz-target
cargo run --release -q -p imagefeed-fuzz --bin fuzz-seeds -- "$OUT/seeds"

if [ $# -eq 0 ]; then
    set -- $(ls "$OUT/seeds")
fi
mkdir -p "$OUT"
[ -f "$OUT/summary.tsv" ] || printf 'date\ttarget\tminutes\texecs\tcpu_seconds\tcorpus\tcrashes\thangs\n' > "$OUT/summary.tsv"

fuzz_one() {
    local t=$1 in="$OUT/in/$1" out="$OUT/out/$1"
    rm -rf "$in" "$out" && mkdir -p "$in" "$(dirname "$out")"
    cp "$OUT/seeds/$t"/* "$in"/
    [ -d "fuzz/corpus/$t" ] && cp "fuzz/corpus/$t"/* "$in"/ 2>/dev/null || true
    # CPU seconds of the fuzzer and every target process it ran: a cpuacct cgroup per target
    # where one can be made (root; cgroup v1), since AFL++ kills its fork server at the end and
    # the targets' CPU time is then never added to the fuzzer's. Otherwise bash's `time`, which
    # misses that time: a lower bound, marked with '>='.
    local cg="" cpu_note="" TIMEFORMAT='%U %S' times
    if mkdir -p "/sys/fs/cgroup/cpuacct/imagefeed-fuzz-$t" 2>/dev/null \
        && [ -w "/sys/fs/cgroup/cpuacct/imagefeed-fuzz-$t/cgroup.procs" ]; then
        cg="/sys/fs/cgroup/cpuacct/imagefeed-fuzz-$t"
        echo 0 > "$cg/cpuacct.usage" 2>/dev/null || true
    fi
    times=$( { time (
        [ -n "$cg" ] && echo "$BASHPID" > "$cg/cgroup.procs"
        exec env AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 \
            AFL_NO_AFFINITY=1 AFL_QUIET=1 \
            cargo afl fuzz -i "$in" -o "$out" -t 1000 -V $((MINUTES * 60)) -- "$BIN" "$t" \
            > "$OUT/$t.log" 2>&1 ); } 2>&1 ) || { echo "$t: afl-fuzz failed, see $OUT/$t.log"; return 1; }
    local stats="$out/default/fuzzer_stats"
    local execs cpu crashes hangs
    execs=$(awk -F' *: ' '$1=="execs_done"{print $2}' "$stats")
    if [ -n "$cg" ]; then
        cpu=$(( $(cat "$cg/cpuacct.usage") / 1000000000 ))
        rmdir "$cg" 2>/dev/null || true
    else
        cpu=">=$(echo "$times" | awk '{printf "%d", $1 + $2}')"
    fi
    crashes=$(awk -F' *: ' '$1=="saved_crashes"{print $2}' "$stats")
    hangs=$(awk -F' *: ' '$1=="saved_hangs"{print $2}' "$stats")
    # Minimize what it found into the committed corpus.
    rm -rf "$OUT/cmin/$t" && mkdir -p "$OUT/cmin"
    AFL_QUIET=1 cargo afl cmin -i "$out/default/queue" -o "$OUT/cmin/$t" -t 1000 -- "$BIN" "$t" \
        > "$OUT/$t.cmin.log" 2>&1 || cp -r "$out/default/queue" "$OUT/cmin/$t"
    rm -rf "fuzz/corpus/$t" && mkdir -p "fuzz/corpus/$t"
    local i=0
    for f in "$OUT/cmin/$t"/*; do
        [ -f "$f" ] || continue
        cp "$f" "fuzz/corpus/$t/$(sha256sum "$f" | cut -c1-16)"
        i=$((i + 1))
    done
    for kind in crashes hangs; do
        for f in "$out/default/$kind"/id:*; do
            [ -f "$f" ] || continue
            mkdir -p "fuzz/regressions/$t"
            cp "$f" "fuzz/regressions/$t/$kind-$(sha256sum "$f" | cut -c1-16)"
        done
    done
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$(date -u +%F)" "$t" "$MINUTES" "$execs" "$cpu" \
        "$i" "$crashes" "$hangs" >> "$OUT/summary.tsv"
    echo "$t: $execs executions in ${cpu}s, corpus $i, crashes $crashes, hangs $hangs"
}
export -f fuzz_one
export OUT BIN MINUTES
printf '%s\n' "$@" | xargs -P "$JOBS" -I{} bash -c 'fuzz_one {}'
rm -rf /dev/shm/imagefeed-fuzz-* "${TMPDIR:-/tmp}"/imagefeed-fuzz-*
column -t -s $'\t' "$OUT/summary.tsv"
