//! The slot writer's AVX2 kernel (x86-64): 16 pixels at a time, the layout change and the flip
//! done by byte shuffles (`pshufb`), then widened to 32-bit and converted, scaled and offset in
//! eight lanes, and stored as `u8`, `f32` or `f16` (F16C).
//!
//! The arithmetic is the scalar writer's, operation for operation: `pixel as f32 · scale + bias`
//! as a multiply then an add (no fused multiply-add), each correctly rounded, and the `f16`
//! conversion rounds to nearest-even as `half::f16::from_f32` does. So the bytes written are
//! identical to the scalar path's, on any CPU; the tests check this bit for bit.

use std::arch::x86_64::*;

use super::slot::{DType, Layout};

/// Whether this CPU can run the kernel (checked once by the standard library, then cached).
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")
}

/// Pixels per block.
pub(super) const BLOCK: usize = 16;

/// Shuffle masks for one block, `[output register k][source register r]`: lane `i` of output
/// register `k` is output element `16k + i` of the block (in the layout's order), taken from
/// byte `mask[k][r][i]` of source register `r` when that source register holds it, else zero
/// (a negative mask byte); OR-ing the three shuffles gives the register.
type Masks = [[[i8; 16]; 3]; 3];

const fn masks(layout: Layout, flip: bool) -> Masks {
    let mut masks = [[[-1i8; 16]; 3]; 3];
    let mut k = 0;
    while k < 3 {
        let mut i = 0;
        while i < BLOCK {
            // Output pixel and channel of this lane.
            let (pixel, channel) = match layout {
                // Register k holds channel k of the block's 16 pixels.
                Layout::Nchw => (i, k),
                // Registers hold the block's 48 interleaved bytes in order.
                Layout::Nhwc => ((16 * k + i) / 3, (16 * k + i) % 3),
            };
            let source = if flip { BLOCK - 1 - pixel } else { pixel };
            let byte = 3 * source + channel;
            masks[k][byte / 16][i] = (byte % 16) as i8;
            i += 1;
        }
        k += 1;
    }
    masks
}

/// `[layout][flip]`.
static MASKS: [[Masks; 2]; 2] = [
    [masks(Layout::Nchw, false), masks(Layout::Nchw, true)],
    [masks(Layout::Nhwc, false), masks(Layout::Nhwc, true)],
];

/// Writes `image` (HWC RGB `u8`, `w × h`) into `slot` as the scalar writer does:
/// `dtype`, `layout`, mirrored when `flip`, floats as `pixel · scale[c] + bias[c]`.
///
/// # Safety
/// [`available`] must have returned true. `image` must hold `w × h × 3` bytes and `slot`
/// `w × h × 3` elements of `dtype` (checked by the caller); `slot` need not be aligned.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn write(
    image: &[u8],
    w: usize,
    h: usize,
    flip: bool,
    dtype: DType,
    layout: Layout,
    scale: [f32; 3],
    bias: [f32; 3],
    slot: &mut [u8],
) {
    // One kernel per layout and type, so that neither is decided inside the loop and the NCHW
    // kernels keep their six constant registers (no spills).
    const U8: u8 = 0;
    const F32: u8 = 1;
    const F16: u8 = 2;
    type Kernel = unsafe fn(&[u8], usize, usize, bool, [f32; 3], [f32; 3], &mut [u8]);
    let kernel: Kernel = match (layout, dtype) {
        (Layout::Nchw, DType::U8) => kernel::<false, U8>,
        (Layout::Nchw, DType::F32) => kernel::<false, F32>,
        (Layout::Nchw, DType::F16) => kernel::<false, F16>,
        (Layout::Nhwc, DType::U8) => kernel::<true, U8>,
        (Layout::Nhwc, DType::F32) => kernel::<true, F32>,
        (Layout::Nhwc, DType::F16) => kernel::<true, F16>,
        // The caller writes bfloat16 with the portable writer.
        (_, DType::Bf16) => unreachable!("no SIMD kernel for bfloat16"),
    };
    // SAFETY: the caller's contract, passed on unchanged.
    unsafe { kernel(image, w, h, flip, scale, bias, slot) }
}

/// [`write`] for one layout (`NHWC`, else NCHW) and type (`DTYPE`: 0 `u8`, 1 `f32`, 2 `f16`).
///
/// # Safety
/// As [`write`].
#[target_feature(enable = "avx2,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel<const NHWC: bool, const DTYPE: u8>(
    image: &[u8],
    w: usize,
    h: usize,
    flip: bool,
    scale: [f32; 3],
    bias: [f32; 3],
    slot: &mut [u8],
) {
    let dtype = [DType::U8, DType::F32, DType::F16][DTYPE as usize];
    debug_assert_eq!(image.len(), w * h * 3);
    debug_assert_eq!(slot.len(), w * h * 3 * dtype.size());
    let masks = &MASKS[NHWC as usize][flip as usize];
    // SAFETY: (for the whole block) the CPU has AVX2 and F16C (caller's contract). Every pointer below
    // stays inside `image` or `slot`: a block's loads read bytes 3·src .. 3·src + 48 of a row
    // with src + 16 <= w, and its stores write elements of the output row's first
    // 16·blocks pixels (or of each plane's row), all inside the slot of w × h × 3 elements.
    unsafe {
        let load_mask = |k: usize, r: usize| _mm_loadu_si128(masks[k][r].as_ptr().cast());
        let mask: [[__m128i; 3]; 3] =
            std::array::from_fn(|k| std::array::from_fn(|r| load_mask(k, r)));
        // Scale or bias for the 8 lanes of half `j` of output register `k`: one channel's value
        // in every lane for NCHW (the same register for both halves), the channels' repeating
        // pattern for NHWC.
        let lanes = |values: [f32; 3], k: usize, j: usize| -> __m256 {
            if NHWC {
                let pattern: [f32; 8] =
                    std::array::from_fn(|lane| values[(16 * k + 8 * j + lane) % 3]);
                _mm256_loadu_ps(pattern.as_ptr())
            } else {
                _mm256_set1_ps(values[k])
            }
        };
        let scale_v: [[__m256; 2]; 3] =
            std::array::from_fn(|k| std::array::from_fn(|j| lanes(scale, k, j)));
        let bias_v: [[__m256; 2]; 3] =
            std::array::from_fn(|k| std::array::from_fn(|j| lanes(bias, k, j)));
        let blocks = w / BLOCK;
        let element = dtype.size();
        // Elements between the output registers of consecutive blocks.
        let step = if NHWC { 3 * BLOCK } else { BLOCK };
        let out = slot.as_mut_ptr();
        for y in 0..h {
            let row = image.as_ptr().add(y * w * 3);
            // First element of output register k of the row's first block.
            let first: [usize; 3] = std::array::from_fn(|k| {
                if NHWC {
                    y * w * 3 + 16 * k
                } else {
                    k * w * h + y * w
                }
            });
            for b in 0..blocks {
                let src = if flip { w - BLOCK * (b + 1) } else { BLOCK * b };
                let p = row.add(3 * src).cast::<__m128i>();
                let v = [
                    _mm_loadu_si128(p),
                    _mm_loadu_si128(p.add(1)),
                    _mm_loadu_si128(p.add(2)),
                ];
                for k in 0..3 {
                    let bytes = _mm_or_si128(
                        _mm_or_si128(
                            _mm_shuffle_epi8(v[0], mask[k][0]),
                            _mm_shuffle_epi8(v[1], mask[k][1]),
                        ),
                        _mm_shuffle_epi8(v[2], mask[k][2]),
                    );
                    let dst = out.add((first[k] + step * b) * element);
                    if dtype == DType::U8 {
                        _mm_storeu_si128(dst.cast(), bytes);
                        continue;
                    }
                    for j in 0..2 {
                        let half = if j == 0 {
                            bytes
                        } else {
                            _mm_srli_si128(bytes, 8)
                        };
                        let value = _mm256_add_ps(
                            _mm256_mul_ps(
                                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(half)),
                                scale_v[k][j],
                            ),
                            bias_v[k][j],
                        );
                        if dtype == DType::F32 {
                            _mm256_storeu_ps(dst.add(32 * j).cast(), value);
                        } else {
                            let halves = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(value);
                            _mm_storeu_si128(dst.add(16 * j).cast(), halves);
                        }
                    }
                }
            }
        }
    }
}
