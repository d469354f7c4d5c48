#!/usr/bin/env bash
# Runs the GPU tests (tests/gpu.rs) on whatever CUDA driver this process finds (a GPU's, or the
# fake of tests/fake_cuda when LD_LIBRARY_PATH puts it first) and says where they ran and which
# skipped, and why: under `cargo test` a skipped GPU test shows as "ok" among the rest.
# CARGO_PROFILE_ARGS (e.g. --release) picks the build. REQUIRE_FAKE=1: fail unless every test
# ran on the fake driver.
# `--workspace`: the features every member asks of the library (cli, remote, fuzzing), as
# `cargo test --workspace` just built it; `-p imagefeed` alone would build the library and a
# dozen dependencies again with the library's own (~100 s of `make test` on 2 cores).
set -uo pipefail
cargo=${CARGO:-cargo}
out=$($cargo test ${CARGO_PROFILE_ARGS:-} --workspace --test gpu -- --nocapture --test-threads 1 2>&1)
status=$?
# (With --nocapture a test's "ok" may land on a line of its own: count from the result line.)
passed=$(grep -m1 '^test result:' <<<"$out" | grep -o '[0-9]* passed' | grep -o '[0-9]*')
failed=$(grep -m1 '^test result:' <<<"$out" | grep -o '[0-9]* failed' | grep -o '[0-9]*')
passed=${passed:-0}
failed=${failed:-0}
total=$((passed + failed))
on_fake=$(grep -c ': on the fake CUDA driver$' <<<"$out")
no_driver=$(grep -c 'skipped, no GPU here' <<<"$out")
fake_only=$(grep -c 'skipped, needs the fake CUDA driver' <<<"$out")
if [ "$status" -ne 0 ]; then
    echo "$out"
    echo "GPU tests: $failed of $total FAILED"
    exit "$status"
fi
if [ "$no_driver" -gt 0 ]; then
    reason=$(grep -m1 'skipped, no GPU here' <<<"$out" | sed 's/.*skipped, no GPU here: //')
    echo "GPU tests: 0 of $total ran: $reason"
elif [ "$on_fake" -gt 0 ]; then
    echo "GPU tests: $on_fake of $total ran on the fake CUDA driver, 0 on a GPU"
else
    echo "GPU tests: $((total - fake_only)) of $total ran on a GPU; $fake_only need the fake driver and skipped"
fi
if [ "${REQUIRE_FAKE:-0}" = 1 ] && { [ "$total" -eq 0 ] || [ "$on_fake" -ne "$total" ]; }; then
    echo "$out" | grep -E 'skipped|on the fake' | head -20
    echo "error: not every GPU test ran on the fake CUDA driver"
    exit 1
fi
