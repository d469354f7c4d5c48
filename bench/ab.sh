#!/usr/bin/env bash
# Side by side: two imagefeed-bench builds, alternating, same data, same machine, one run.
#   bench/ab.sh OLD_BENCH NEW_BENCH DATA_DIR [ROUNDS] [NEW_DATA_DIR]
# DATA_DIR holds cifar10-test/, imagenet-x25/, cifar.lmdb and imagenet.lmdb (see the top of
# RESULTS.md for how they are made). NEW_DATA_DIR, when given, is where the new arm reads
# instead (the same trees, datasets packed by the new build: for a change of on-disk layout).
# Prints one line per measurement: what, arm, median images/s over its epochs (epoch 0 of a
# folder read, cold, left out).
set -uo pipefail
old=$(realpath "$1"); new=$(realpath "$2"); old_dir=$(realpath "$3"); rounds=${4:-5}; new_dir=$(realpath "${5:-$3}")
med() { sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
rate() { grep -v 'epoch 0' | grep -o '[0-9]* images/s' | awk '{print $1}' | med; }
echo "== $(date -u +%FT%TZ) $(nproc) cores; old $old, new $new"
for round in $(seq "$rounds"); do
  for arm in old new; do
    B=$old; cd "$old_dir"
    [ "$arm" = new ] && { B=$new; cd "$new_dir"; }
    echo "cifar-lmdb-load $arm $("$B" load cifar.lmdb --batch-size 256 --workers 2 --epochs 8 \
      --warmup 1 --transform cifar 2>&1 | rate)"
    echo "cifar-folder-read $arm $("$B" read cifar10-test --decode --threads 2 --epochs 4 2>&1 | rate)"
    echo "imagenet-lmdb-rrc $arm $("$B" load imagenet.lmdb --batch-size 64 --workers 2 --epochs 3 \
      --warmup 1 --transform imagenet 2>&1 | rate)"
    echo "imagenet-folder-read $arm $("$B" read imagenet-x25 --decode --threads 2 --epochs 2 2>&1 | rate)"
  done
done
