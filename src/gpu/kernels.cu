// imagefeed's GPU kernels. Compiled to PTX by scripts/make_ptx.py (NVRTC, compute_70) and
// shipped as src/gpu/kernels.ptx, so no CUDA compiler is needed at build or run time; the driver
// JIT-compiles the PTX for the GPU it runs on. Only builtins: no headers. The fake CUDA driver
// the tests run on (tests/fake_cuda) compiles this file for the host as well.

extern "C" {

// Float to IEEE half, round to nearest even, as raw bits. (Compiled for the host, for the
// fake driver the tests run on, the same rounding comes from host_shim.h.)
__device__ __forceinline__ unsigned short to_half_bits(float x) {
#ifdef __CUDA_ARCH__
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#else
    return host_float_to_half_bits(x);
#endif
}

// Index of output element `i` in a u8 NHWC input, for an NCHW (nchw != 0) or NHWC output.
__device__ __forceinline__ long long source_index(long long i, int h, int w, int nchw, int *c) {
    if (nchw) {
        long long plane = (long long)h * w;
        long long b = i / (3 * plane);
        long long r = i - b * 3 * plane;
        *c = (int)(r / plane);
        long long yx = r - (long long)(*c) * plane;
        return (b * plane + yx) * 3 + *c;
    }
    *c = (int)(i % 3);
    return i;
}

// Output element `i`: its source pixel times scale[c] plus bias[c], rounded after the multiply
// and after the add (__fmul_rn/__fadd_rn are never fused into an FMA), as the CPU's slot writer
// computes it: the GPU's batches are bit-identical to the CPU transform's.
__device__ __forceinline__ float converted(const unsigned char *in, long long i, int h, int w,
                                           int nchw, float s0, float s1, float s2, float b0,
                                           float b1, float b2) {
    int c;
    long long src = source_index(i, h, w, nchw, &c);
    float scale = c == 0 ? s0 : (c == 1 ? s1 : s2);
    float bias = c == 0 ? b0 : (c == 1 ? b1 : b2);
    return __fadd_rn(__fmul_rn((float)in[src], scale), bias);
}

// out = pixel * scale[c] + bias[c], with scale = 1 / (255 std) and bias = -mean / std: the
// normalization of torchvision's ToTensor + Normalize. `total` = n * h * w * 3.
__global__ void u8_nhwc_to_f32(const unsigned char *in, float *out, long long total, int h,
                               int w, int nchw, float s0, float s1, float s2, float b0, float b1,
                               float b2) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)blockDim.x * gridDim.x) {
        out[i] = converted(in, i, h, w, nchw, s0, s1, s2, b0, b1, b2);
    }
}

// As u8_nhwc_to_f32, writing IEEE half floats.
__global__ void u8_nhwc_to_f16(const unsigned char *in, unsigned short *out, long long total,
                               int h, int w, int nchw, float s0, float s1, float s2, float b0,
                               float b1, float b2) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)blockDim.x * gridDim.x) {
        out[i] = to_half_bits(converted(in, i, h, w, nchw, s0, s1, s2, b0, b1, b2));
    }
}

}  // extern "C"
