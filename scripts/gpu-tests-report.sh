#!/usr/bin/env bash
# Says how many of the GPU tests (tests/gpu.rs) ran on a GPU and how many skipped, and why:
# under `cargo test` a skipped GPU test shows as "ok" among the rest. Run by `make test` after
# the suite (the build is reused). CARGO_PROFILE_ARGS (e.g. --release) picks the build.
set -uo pipefail
cargo=${CARGO:-cargo}
out=$($cargo test ${CARGO_PROFILE_ARGS:-} -p imagefeed --test gpu -- --nocapture --test-threads 1 2>&1)
status=$?
# (With --nocapture a test's "ok" may land on a line of its own: count from the result line.)
passed=$(grep -m1 '^test result:' <<<"$out" | grep -o '[0-9]* passed' | grep -o '[0-9]*')
failed=$(grep -m1 '^test result:' <<<"$out" | grep -o '[0-9]* failed' | grep -o '[0-9]*')
passed=${passed:-0}
failed=${failed:-0}
skipped=$(grep -c 'skipped, no GPU here' <<<"$out")
total=$((passed + failed))
if [ "$status" -ne 0 ]; then
    echo "$out"
    echo "GPU tests: $failed of $total FAILED"
    exit "$status"
fi
if [ "$skipped" -gt 0 ]; then
    reason=$(grep -m1 'skipped, no GPU here' <<<"$out" | sed 's/.*skipped, no GPU here: //')
    echo "GPU tests: $((total - skipped)) of $total ran on a GPU; $skipped skipped: $reason"
else
    echo "GPU tests: all $total ran on a GPU and passed"
fi
