#!/usr/bin/env bash
# Builds the fake CUDA driver into DIR (default target/fake-cuda): one library, installed under
# the names CUDA programs look for (libcuda.so[.1], libcublas.so[.12|.13]), so the
# driver and cuBLAS calls share one state. Put DIR first on LD_LIBRARY_PATH of a new process
# (the loader reads it at start) to run CUDA code on it. Needs g++ (C++17).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$root/target/fake-cuda}
mkdir -p "$out"
sources=("$root"/tests/fake_cuda/*.cc)
lib=$out/libimagefeed_fake_cuda.so
# Rebuilt when a source (the kernels' .cu files included) is newer than the library.
if [ -f "$lib" ] && [ -z "$(find "${sources[@]}" "$root"/tests/fake_cuda/*.h \
        "$root"/src/gpu/kernels.cu "$root"/examples/train_cifar_gpu.cu -newer "$lib")" ]; then
    exit 0
fi
# -ffp-contract=off: the kernels' separately rounded multiply and add stay apart, as on a GPU.
# -z nodelete: cudarc opens and closes the library to probe it; its state must survive that.
g++ -std=c++17 -O2 -fPIC -shared -pthread -fvisibility=hidden -ffp-contract=off \
    -Wall -Wextra -Wno-unused-parameter -I"$root" -I"$root/tests/fake_cuda" \
    -Wl,-z,nodelete -Wl,-soname,libcuda.so.1 -o "$lib.tmp" "${sources[@]}"
mv "$lib.tmp" "$lib"
for name in libcuda.so libcuda.so.1 libcublas.so libcublas.so.12 libcublas.so.13; do
    ln -sf libimagefeed_fake_cuda.so "$out/$name"
done
echo "built the fake CUDA driver: $lib"
