#!/usr/bin/env python3
"""Compiles the CUDA kernels (src/gpu/kernels.cu, examples/train_cifar_gpu.cu) to the PTX files
shipped beside them, with NVRTC (no GPU needed).

    python3 scripts/make_ptx.py /path/to/libnvrtc.so.12

NVRTC comes with every CUDA toolkit, and on PyPI as nvidia-cuda-nvrtc-cu12 (the committed PTX
was made with 12.0.76, whose PTX ISA 8.0 every driver from 525 on loads). The target is
compute_70 (Volta and newer); the driver JIT-compiles it for the GPU it finds.
"""

import ctypes
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# (source, output): the library's kernels, and the training example's own.
PROGRAMS = [
    ("src/gpu/kernels.cu", "src/gpu/kernels.ptx"),
    ("examples/train_cifar_gpu.cu", "examples/train_cifar_gpu.ptx"),
]
OPTIONS = [b"--gpu-architecture=compute_70", b"--fmad=true"]


def check(nvrtc, rc, what, program=None):
    if rc == 0:
        return
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    message = nvrtc.nvrtcGetErrorString(rc).decode()
    log = ""
    if program is not None:
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        buffer = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, buffer)
        log = buffer.value.decode()
    sys.exit(f"error: {what}: {message}\n{log}")


def compile_program(nvrtc, version, source_path, output_path):
    program = ctypes.c_void_p()
    source = (ROOT / source_path).read_bytes()
    name = pathlib.Path(source_path).name.encode()
    check(
        nvrtc,
        nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, name, 0, None, None),
        "nvrtcCreateProgram",
    )
    options = (ctypes.c_char_p * len(OPTIONS))(*OPTIONS)
    check(nvrtc, nvrtc.nvrtcCompileProgram(program, len(OPTIONS), options), "compiling", program)
    size = ctypes.c_size_t()
    check(nvrtc, nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size)), "nvrtcGetPTXSize")
    ptx = ctypes.create_string_buffer(size.value)
    check(nvrtc, nvrtc.nvrtcGetPTX(program, ptx), "nvrtcGetPTX")
    header = (
        f"// Generated from {source_path} by scripts/make_ptx.py "
        f"(NVRTC {version}, {OPTIONS[0].decode()}). Do not edit.\n"
    )
    (ROOT / output_path).write_text(header + ptx.value.decode())
    print(f"wrote {output_path} (NVRTC {version})")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    nvrtc = ctypes.CDLL(sys.argv[1])
    major, minor = ctypes.c_int(), ctypes.c_int()
    check(nvrtc, nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    for source_path, output_path in PROGRAMS:
        compile_program(nvrtc, f"{major.value}.{minor.value}", source_path, output_path)


if __name__ == "__main__":
    main()
