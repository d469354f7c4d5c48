#!/usr/bin/env bash
# Warm, reopened and cold epochs of packed datasets side by side, rounds alternating.
#   bench/cold_warm.sh BENCH ROUNDS DATASET...
# For each round and dataset: `BENCH load DATASET --transform cifar --workers 2 --epochs 8
# --warmup 1` as it is (warm: one loader, the page cache full), with --reopen (the dataset
# opened and a new loader started inside each epoch's clock) and with --cold (the same, the
# dataset's files evicted first). Prints one line per measurement: round, dataset, mode, the
# median epoch in ms. Cold against warm is what a first epoch from a cold page cache costs;
# cold against reopen, what the page cache alone costs.
set -uo pipefail
bench=$1; rounds=$2; shift 2
echo "== $(date -u +%FT%TZ) $(nproc) cores; $bench"
for round in $(seq "$rounds"); do
  for dataset in "$@"; do
    for mode in warm --reopen --cold; do
      flag=$mode; [ "$mode" = warm ] && flag=
      ms=$("$bench" load "$dataset" --transform cifar --workers 2 --epochs 8 --warmup 1 $flag \
        --json 2>/dev/null | python3 -c '
import json, statistics, sys
epochs = [json.loads(l) for l in sys.stdin if l.startswith("{")]
print("%.1f" % statistics.median(e["seconds"] * 1e3 for e in epochs if e.get("event") == "epoch"))')
      echo "$round $(basename "$dataset") ${mode#--} $ms"
    done
  done
done
