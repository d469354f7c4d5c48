#!/usr/bin/env bash
# Installs the system packages imagefeed needs to build and test, if any are missing.
#   cmake, nasm     build the vendored libjpeg-turbo 3 (turbojpeg crate, SIMD on)
#   pkg-config, libhdf5-dev   HDF5 format support
#   gcc/g++, make   C toolchain for the -sys crates and the fake CUDA driver (tests/fake_cuda)
#   python3-venv    a virtual environment for the cross-tool tests (py-lmdb)
#   libfontconfig1-dev, libfreetype-dev, fonts-dejavu-core
#                   text in the benchmark charts (plotters' ttf backend finds a font via fontconfig)
# As root it runs apt-get; otherwise it prints the exact command to run and fails.
set -euo pipefail

packages=(cmake nasm pkg-config libhdf5-dev gcc g++ make python3-venv
          libfontconfig1-dev libfreetype-dev fonts-dejavu-core)
missing=()
for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if ! command -v cargo >/dev/null 2>&1; then
    echo "error: cargo (Rust toolchain) not found; install Rust 1.88 or newer from https://rustup.rs" >&2
    exit 1
fi

if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "error: missing system packages: ${missing[*]} (and no apt-get here; install their equivalents)" >&2
    exit 1
fi

if [ "$(id -u)" -eq 0 ]; then
    echo "installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
    echo "error: missing system packages: ${missing[*]}" >&2
    echo "run:   sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
    exit 1
fi
