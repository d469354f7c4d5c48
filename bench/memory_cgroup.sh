#!/usr/bin/env bash
# Loader epochs over a dataset from a cold page cache inside a memory cgroup, so that the
# dataset is larger (or smaller) than the memory the loader may use, binaries alternating.
#   bench/memory_cgroup.sh LIMIT_MIB DATASET TRANSFORM BATCH EPOCHS ROUNDS BENCH...
# Needs root and the cgroup-v1 memory controller (/sys/fs/cgroup/memory). Each round and
# binary: evict DATASET's pages, then `BENCH load DATASET --transform TRANSFORM --batch-size
# BATCH --workers 2 --epochs EPOCHS --warmup 0`; prints the seconds of each epoch (the first
# starts cold). A run is cut off after 300 s (then no figure).
set -uo pipefail
limit=$1 dataset=$2 transform=$3 batch=$4 epochs=$5 rounds=$6; shift 6
group=/sys/fs/cgroup/memory/imagefeed-bench
if ! mkdir -p "$group" 2>/dev/null || [ ! -w "$group/memory.limit_in_bytes" ]; then
    echo "needs root and the cgroup-v1 memory controller at /sys/fs/cgroup/memory" >&2
    exit 2
fi
echo $((limit << 20)) > "$group/memory.limit_in_bytes"
echo $$ > "$group/cgroup.procs"
echo "== $(date -u +%FT%TZ) $(nproc) cores; $dataset in ${limit} MiB"
for round in $(seq "$rounds"); do
    for bench in "$@"; do
        python3 -c "import os, sys
for root, _, files in os.walk(sys.argv[1]) if os.path.isdir(sys.argv[1]) else [('', [], [sys.argv[1]])]:
    for f in files:
        fd = os.open(os.path.join(root, f), os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)" "$dataset"
        secs=$(timeout 300 "$bench" load "$dataset" --transform "$transform" --batch-size "$batch" \
            --workers 2 --epochs "$epochs" --warmup 0 2>/dev/null | awk '/^epoch/ {print $6}' | tr '\n' ' ')
        echo "$round $bench ${secs:-none within 300 s}"
    done
done
