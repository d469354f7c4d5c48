#!/usr/bin/env bash
# NVIDIA's own tools on the shipped PTX, without a GPU: every PTX file assembles with ptxas
# (PyPI nvidia-cuda-nvcc-cu12: ptxas only) for sm_75, sm_80 and sm_90 with no warning, spills and
# local-memory use counted as warnings; and NVRTC 12.0.76 (PyPI nvidia-cuda-nvrtc-cu12, the
# version the committed PTX was made with) regenerates every file byte for byte from its .cu
# source. Skips, saying why, where the wheels cannot be installed. Run by `make test-gpu-fake`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$root/.venv-cuda-tools
packages=(nvidia-cuda-nvcc-cu12==12.9.86 nvidia-cuda-nvrtc-cu12==12.0.76)
site() { "$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
installed() { # the pinned versions, exactly
    "$venv/bin/python" -m pip freeze 2>/dev/null | grep -qx "${packages[0]}" &&
        "$venv/bin/python" -m pip freeze 2>/dev/null | grep -qx "${packages[1]}"
}
if ! [ -x "$venv/bin/python" ] || ! installed; then
    if ! { python3 -m venv "$venv" && "$venv/bin/pip" install -q "${packages[@]}"; } >/tmp/check-ptx-install.log 2>&1; then
        echo "PTX check skipped: could not install ${packages[*]} ($(tail -1 /tmp/check-ptx-install.log))"
        exit 0
    fi
fi
ptxas=$(site)/nvidia/cuda_nvcc/bin/ptxas
nvrtc=$(site)/nvidia/cuda_nvrtc/lib/libnvrtc.so.12
ptx_files=(src/gpu/kernels.ptx examples/train_cifar_gpu.ptx)
for ptx in "${ptx_files[@]}"; do
    for arch in sm_75 sm_80 sm_90; do
        if ! out=$("$ptxas" --gpu-name "$arch" --warning-as-error --warn-on-spills \
                --warn-on-local-memory-usage -o /dev/null "$root/$ptx" 2>&1); then
            echo "ptxas $arch $ptx failed:"
            echo "$out"
            exit 1
        fi
    done
done
echo "PTX check: ptxas $("$ptxas" --version | grep -o 'V[0-9][0-9.]*' | tail -1) assembled ${ptx_files[*]} for sm_75, sm_80 and sm_90 with no warning"
# Regenerate into a copy of the sources and compare.
copy=$(mktemp -d)
trap 'rm -rf "$copy"' EXIT
(cd "$root" && cp --parents scripts/make_ptx.py src/gpu/kernels.cu examples/train_cifar_gpu.cu "$copy")
(cd "$copy" && python3 scripts/make_ptx.py "$nvrtc" >/dev/null)
for ptx in "${ptx_files[@]}"; do
    if ! cmp -s "$copy/$ptx" "$root/$ptx"; then
        echo "$ptx differs from what NVRTC makes of its source: run scripts/make_ptx.py $nvrtc"
        diff "$copy/$ptx" "$root/$ptx" | head -20
        exit 1
    fi
done
echo "PTX check: NVRTC 12.0.76 regenerated ${ptx_files[*]} byte for byte"
