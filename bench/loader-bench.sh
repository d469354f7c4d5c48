#!/usr/bin/env bash
# Loader measurements for bench/RESULTS.md, side by side in one run:
#   bench/loader-bench.sh CIFAR_LMDB IMAGENET_LMDB [LOG]
# (LMDBs made with `pack-dataset imagefolder2lmdb`; see RESULTS.md for how.)
set -euo pipefail
cifar=$1; imagenet=$2; log=${3:-/dev/stdout}
B=${B:-target/release/imagefeed-bench}
{
echo "== $(date -u +%FT%TZ) $(nproc) cores, $(uname -r)"
echo "== CIFAR-10: raw read+decode, 1 and 2 threads (the measured decode scaling)"
"$B" read "$cifar" --decode --threads 1 --epochs 3
"$B" read "$cifar" --decode --threads 2 --epochs 3
echo "== CIFAR-10: loader, 1 and 2 workers, flip + normalize, f32 NCHW, batch 256"
"$B" load "$cifar" --batch-size 256 --workers 1 --epochs 15 --warmup 1 --transform cifar --ceiling-samples 10000
"$B" load "$cifar" --batch-size 256 --workers 2 --epochs 15 --warmup 1 --transform cifar --ceiling-samples 10000
echo "== ImageNet x25: raw read+decode, 1 and 2 threads"
"$B" read "$imagenet" --decode --threads 1 --epochs 1
"$B" read "$imagenet" --decode --threads 2 --epochs 1
echo "== ImageNet x25: loader, 2 workers, RandomResizedCrop 224 + flip + normalize, f32 NCHW, batch 64"
"$B" load "$imagenet" --batch-size 64 --workers 2 --epochs 3 --warmup 1 --transform imagenet --ceiling-samples 1000
echo "== determinism: digests for 1, 2 and 4 workers (must be equal line by line)"
for w in 1 2 4; do
  "$B" load "$cifar" --batch-size 256 --workers "$w" --epochs 2 --transform cifar --digest | grep -o 'epoch [0-9]*:\|sha256 [0-9a-f]*' | paste -sd' '
done
echo "== memory: 10 epochs, CIFAR-10, prefetch 4 (2 workers)"
"$B" load "$cifar" --batch-size 256 --workers 2 --epochs 10 --transform cifar
} 2>&1 | tee "$log"
