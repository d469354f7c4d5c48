// The CUDA builtins our kernel sources use, for compiling them for the host (the fake driver
// runs them there). Kernels run one thread at a time: blockIdx/threadIdx are thread-locals the
// launcher sets before each call, and nothing needs __syncthreads or shared memory.
//
// Compiled with -ffp-contract=off, so __fmul_rn/__fadd_rn round apart as on the GPU.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#define __global__
#define __device__
#define __forceinline__ inline

struct fake_dim3 {
    unsigned int x, y, z;
};
extern thread_local fake_dim3 threadIdx, blockIdx, blockDim, gridDim;

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
// The GPU's __expf is an approximation (ex2.approx); the host's expf is closer. Only the
// training example uses it, and nothing compares its values bit for bit.
inline float __expf(float x) { return expf(x); }
// The threads of one launch run one after another on the stream's thread.
inline float atomicAdd(float *address, float value) {
    float old = *address;
    *address = old + value;
    return old;
}

// IEEE 754 binary32 to binary16, round to nearest, ties to even (what PTX's cvt.rn.f16.f32
// does, and the `half` crate's f16::from_f32 the CPU path uses), as raw bits.
inline unsigned short host_float_to_half_bits(float value) {
    uint32_t x;
    std::memcpy(&x, &value, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t exponent = (x >> 23) & 0xffu;
    uint32_t mantissa = x & 0x7fffffu;
    if (exponent == 0xff)  // infinity, or NaN (kept quiet, top payload bits kept)
        return (unsigned short)(sign | 0x7c00u | (mantissa ? 0x200u | (mantissa >> 13) : 0));
    int e = int(exponent) - 127 + 15;
    if (e >= 0x1f) return (unsigned short)(sign | 0x7c00u);  // too large: infinity
    if (e <= 0) {
        // A subnormal half (or zero): the value in units of 2^-24, rounded.
        if (e < -10) return (unsigned short)sign;
        uint32_t m = mantissa | 0x800000u;
        int shift = 14 - e;
        uint32_t half = m >> shift;
        uint32_t rest = m & ((1u << shift) - 1);
        uint32_t halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (half & 1))) half++;
        return (unsigned short)(sign | half);
    }
    uint32_t half = sign | (uint32_t(e) << 10) | (mantissa >> 13);
    uint32_t rest = mantissa & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1))) half++;  // a carry may make it inf
    return (unsigned short)half;
}
