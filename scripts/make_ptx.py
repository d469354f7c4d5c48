#!/usr/bin/env python3
"""Compiles src/gpu/kernels.cu to src/gpu/kernels.ptx with NVRTC (no GPU needed).

    python3 scripts/make_ptx.py /path/to/libnvrtc.so.12

NVRTC comes with every CUDA toolkit, and on PyPI as nvidia-cuda-nvrtc-cu12 (the committed PTX
was made with 12.0.76, whose PTX ISA 8.0 every driver from 525 on loads). The target is
compute_70 (Volta and newer); the driver JIT-compiles it for the GPU it finds.
"""

import ctypes
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "src/gpu/kernels.cu"
OUTPUT = ROOT / "src/gpu/kernels.ptx"
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


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    nvrtc = ctypes.CDLL(sys.argv[1])
    major, minor = ctypes.c_int(), ctypes.c_int()
    check(nvrtc, nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    program = ctypes.c_void_p()
    source = SOURCE.read_bytes()
    check(
        nvrtc,
        nvrtc.nvrtcCreateProgram(
            ctypes.byref(program), source, b"kernels.cu", 0, None, None
        ),
        "nvrtcCreateProgram",
    )
    options = (ctypes.c_char_p * len(OPTIONS))(*OPTIONS)
    check(nvrtc, nvrtc.nvrtcCompileProgram(program, len(OPTIONS), options), "compiling", program)
    size = ctypes.c_size_t()
    check(nvrtc, nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size)), "nvrtcGetPTXSize")
    ptx = ctypes.create_string_buffer(size.value)
    check(nvrtc, nvrtc.nvrtcGetPTX(program, ptx), "nvrtcGetPTX")
    header = (
        f"// Generated from src/gpu/kernels.cu by scripts/make_ptx.py "
        f"(NVRTC {major.value}.{minor.value}, {OPTIONS[0].decode()}). Do not edit.\n"
    )
    OUTPUT.write_text(header + ptx.value.decode())
    print(f"wrote {OUTPUT.relative_to(ROOT)} (NVRTC {major.value}.{minor.value})")


if __name__ == "__main__":
    main()
