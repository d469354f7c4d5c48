//! The last two steps of libjpeg-turbo's decode, for images whose Y, Cb and Cr planes it
//! decoded as part of a stack ([`super::stack`]): the "fancy" 4:2:0 chroma upsampling (a
//! triangle filter; jdsample.c's `h2v2_fancy_upsample`) and the JFIF YCbCr-to-RGB conversion
//! (jdcolor.c's `ycc_rgb_convert`), in libjpeg's own integer arithmetic, so the pixels are
//! bit-identical to a decode of the file on its own (libjpeg-turbo's SIMD versions of both are
//! bit-exact with its C; the tests compare against the library's output).
//!
//! Each image's first and last chroma rows are their own upsampler's context (libjpeg
//! replicates an image's edge rows), which is why a stack is decoded to planes and not to RGB:
//! decoded as one tall image, each image's top and bottom rows would blend with its
//! neighbours' chroma.
//!
//! The code is written for the compiler to vectorise, and compiled twice on x86-64: once for
//! any CPU and once with AVX2, picked at run time. Same integer operations either way.

/// How a stackable JPEG's components are sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sampling {
    /// One component: R = G = B = Y.
    Gray,
    /// Y, Cb, Cr at full resolution.
    Ycc444,
    /// Cb and Cr at half the width and height (Y sampled 2×2, chroma 1×1).
    Ycc420,
}

impl Sampling {
    /// Chroma plane size for an image of `width × height` pixels.
    pub(crate) fn chroma_size(self, width: usize, height: usize) -> (usize, usize) {
        match self {
            Sampling::Gray => (0, 0),
            Sampling::Ycc444 => (width, height),
            Sampling::Ycc420 => (width.div_ceil(2), height.div_ceil(2)),
        }
    }
}

/// The widest image converted here (the row scratch lives on the stack).
pub(crate) const MAX_WIDTH: usize = 512;

/// One image's planes: `height` rows of `y_stride` bytes, and for colour images the chroma
/// rows ([`Sampling::chroma_size`]) of `c_stride` bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Planes<'a> {
    pub y: &'a [u8],
    pub y_stride: usize,
    pub cb: &'a [u8],
    pub cr: &'a [u8],
    pub c_stride: usize,
}

/// Writes the `width × height` image in `planes` into `out` as HWC RGB.
///
/// # Panics
/// When `width` exceeds [`MAX_WIDTH`], a plane is shorter than its rows, or `out` is not
/// `width × height × 3` bytes (caller bugs).
pub(crate) fn to_rgb(
    sampling: Sampling,
    planes: Planes<'_>,
    width: usize,
    height: usize,
    out: &mut [u8],
) {
    assert!(width <= MAX_WIDTH && width > 0, "width {width}");
    assert_eq!(out.len(), width * height * 3, "output size");
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { to_rgb_avx2(sampling, planes, width, height, out) };
        return;
    }
    to_rgb_any::<false>(sampling, planes, width, height, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn to_rgb_avx2(
    sampling: Sampling,
    planes: Planes<'_>,
    width: usize,
    height: usize,
    out: &mut [u8],
) {
    to_rgb_any::<true>(sampling, planes, width, height, out);
}

/// [`to_rgb`]; `AVX2` (true only inside [`to_rgb_avx2`], so only on a CPU that has it) picks
/// the AVX2 kernels for the rows.
#[inline(always)]
fn to_rgb_any<const AVX2: bool>(
    sampling: Sampling,
    p: Planes<'_>,
    width: usize,
    height: usize,
    out: &mut [u8],
) {
    let (cw, ch) = sampling.chroma_size(width, height);
    let mut cb_row = [0u8; MAX_WIDTH + 1];
    let mut cr_row = [0u8; MAX_WIDTH + 1];
    for (row, rgb) in out.chunks_exact_mut(width * 3).enumerate() {
        let y = &p.y[row * p.y_stride..][..width];
        match sampling {
            Sampling::Gray => {
                for (o, &v) in rgb.chunks_exact_mut(3).zip(y) {
                    o.copy_from_slice(&[v, v, v]);
                }
            }
            Sampling::Ycc444 => {
                let cb = &p.cb[row * p.c_stride..][..width];
                let cr = &p.cr[row * p.c_stride..][..width];
                convert_row::<AVX2>(y, cb, cr, rgb);
            }
            Sampling::Ycc420 => {
                // Output row 2k blends chroma row k with the row above it, row 2k+1 with the
                // row below; an image's edge rows are their own neighbours.
                let near = row / 2;
                let far = if row % 2 == 1 {
                    (near + 1).min(ch - 1)
                } else {
                    near.saturating_sub(1)
                };
                let (near, far) = (near * p.c_stride, far * p.c_stride);
                let up = 2 * cw;
                upsample_row::<AVX2>(&p.cb[near..][..cw], &p.cb[far..][..cw], &mut cb_row[..up]);
                upsample_row::<AVX2>(&p.cr[near..][..cw], &p.cr[far..][..cw], &mut cr_row[..up]);
                convert_row::<AVX2>(y, &cb_row[..width], &cr_row[..width], rgb);
            }
        }
    }
}

/// One output row of 4:2:0 fancy upsampling: `near` is the chroma row the output row lies in,
/// `far` the adjacent one on the output row's side; `out` gets `2 × near.len()` samples.
/// libjpeg: column sums `3·near + far`, then `(3·this + left + 8) >> 4` and
/// `(3·this + right + 7) >> 4`, the edge columns their own neighbours.
#[inline(always)]
fn upsample_row<const AVX2: bool>(near: &[u8], far: &[u8], out: &mut [u8]) {
    let cw = near.len();
    debug_assert!(
        cw >= 2,
        "libjpeg upsamples narrower chroma without the filter"
    );
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: AVX2 is true only on a CPU that has it (`to_rgb_any`).
        done = unsafe { upsample_avx2(near, far, out) };
    }
    let sum = |j: usize| 3 * near[j] as u16 + far[j] as u16;
    for (i, o) in (done..cw).zip(out[2 * done..].chunks_exact_mut(2)) {
        let this = 3 * sum(i);
        o[0] = ((this + sum(i.saturating_sub(1)) + 8) >> 4) as u8;
        o[1] = ((this + sum((i + 1).min(cw - 1)) + 7) >> 4) as u8;
    }
}

/// [`upsample_row`] sixteen columns at a time, in 16-bit lanes (every value fits), the column
/// sums kept in registers: each chunk's left and right neighbours are the chunk shifted by one
/// lane, carrying in the previous and the next chunk's edge (or the row's edge repeated).
/// The even output in the low byte of a lane and the odd one in the high byte is the pair in
/// memory order. Returns how many columns it did (a multiple of 16; the caller does the rest).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn upsample_avx2(near: &[u8], far: &[u8], out: &mut [u8]) -> usize {
    use std::arch::x86_64::*;
    let cw = near.len().min(far.len()).min(out.len() / 2);
    if cw < 16 {
        return 0;
    }
    let sums_at = |i: usize| {
        // SAFETY: callers pass i + 16 <= cw: sixteen readable bytes in both rows.
        let (n, f) = unsafe {
            (
                _mm256_cvtepu8_epi16(_mm_loadu_si128(near.as_ptr().add(i).cast())),
                _mm256_cvtepu8_epi16(_mm_loadu_si128(far.as_ptr().add(i).cast())),
            )
        };
        _mm256_add_epi16(_mm256_add_epi16(n, _mm256_add_epi16(n, n)), f)
    };
    let sum = |j: usize| _mm256_set1_epi16((3 * near[j] as u16 + far[j] as u16) as i16);
    let (eight, seven) = (_mm256_set1_epi16(8), _mm256_set1_epi16(7));
    let mut previous = sum(0);
    let mut this = sums_at(0);
    let mut i = 0;
    while i + 16 <= cw {
        let next = if i + 32 <= cw {
            sums_at(i + 16)
        } else {
            sum((i + 16).min(cw - 1))
        };
        // [previous[15], this[0..15]] and [this[1..16], next[0]].
        let left =
            _mm256_alignr_epi8::<14>(this, _mm256_permute2x128_si256::<0x21>(previous, this));
        let right = _mm256_alignr_epi8::<2>(_mm256_permute2x128_si256::<0x21>(this, next), this);
        let this3 = _mm256_add_epi16(this, _mm256_add_epi16(this, this));
        let even = _mm256_srli_epi16::<4>(_mm256_add_epi16(_mm256_add_epi16(this3, left), eight));
        let odd = _mm256_srli_epi16::<4>(_mm256_add_epi16(_mm256_add_epi16(this3, right), seven));
        let pairs = _mm256_or_si256(even, _mm256_slli_epi16::<8>(odd));
        // SAFETY: 2i + 32 <= 2cw <= out.len().
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().add(2 * i).cast(), pairs) };
        previous = this;
        this = next;
        i += 16;
    }
    i
}

/// JFIF YCbCr to RGB as libjpeg computes it: `FIX(x)` is `x·65536` rounded, `R = Y +
/// (FIX(1.402)·Cr + ½) >> 16`, `G = Y + (−FIX(0.34414)·Cb − FIX(0.71414)·Cr + ½) >> 16`,
/// `B = Y + (FIX(1.772)·Cb + ½) >> 16`, with Cb and Cr centred on 128, clamped to 0..=255.
#[inline(always)]
fn convert_row<const AVX2: bool>(y: &[u8], cb: &[u8], cr: &[u8], out: &mut [u8]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: AVX2 is true only on a CPU that has it (`to_rgb_any`).
        done = unsafe { convert_row_avx2(y, cb, cr, out) };
    }
    for (((o, &y), &cb), &cr) in out[3 * done..]
        .chunks_exact_mut(3)
        .zip(&y[done..])
        .zip(&cb[done..])
        .zip(&cr[done..])
    {
        let (y, cb, cr) = (y as i32, cb as i32 - 128, cr as i32 - 128);
        o[0] = (y + ((91_881 * cr + 32_768) >> 16)).clamp(0, 255) as u8;
        o[1] = (y + ((-22_554 * cb - 46_802 * cr + 32_768) >> 16)).clamp(0, 255) as u8;
        o[2] = (y + ((116_130 * cb + 32_768) >> 16)).clamp(0, 255) as u8;
    }
}

/// [`convert_row`] eight pixels at a time in 32-bit lanes, the same operations (the packs
/// saturate as the clamp does); returns how many pixels it wrote (a multiple of 8; the caller
/// does the rest).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn convert_row_avx2(y: &[u8], cb: &[u8], cr: &[u8], out: &mut [u8]) -> usize {
    use std::arch::x86_64::*;
    let w = y.len().min(cb.len()).min(cr.len()).min(out.len() / 3);
    // Per 128-bit lane, bytes r0..r3 g0..g3 b0..b3 (then zeros) to r0 g0 b0 r1 g1 b1 ...
    let order = _mm256_setr_epi8(
        0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11, -1, -1, -1, -1, //
        0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11, -1, -1, -1, -1,
    );
    let centre = _mm256_set1_epi32(128);
    let half = _mm256_set1_epi32(32_768);
    let (r_cr, g_cb, g_cr, b_cb) = (
        _mm256_set1_epi32(91_881),
        _mm256_set1_epi32(-22_554),
        _mm256_set1_epi32(-46_802),
        _mm256_set1_epi32(116_130),
    );
    let load = |s: &[u8], x: usize| {
        // SAFETY: x + 8 <= w <= s.len(): eight readable bytes.
        unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(s.as_ptr().add(x).cast())) }
    };
    let mut x = 0;
    while x + 8 <= w {
        let l = load(y, x);
        let u = _mm256_sub_epi32(load(cb, x), centre);
        let v = _mm256_sub_epi32(load(cr, x), centre);
        let r = _mm256_add_epi32(
            l,
            _mm256_srai_epi32::<16>(_mm256_add_epi32(_mm256_mullo_epi32(v, r_cr), half)),
        );
        let g = _mm256_add_epi32(
            l,
            _mm256_srai_epi32::<16>(_mm256_add_epi32(
                _mm256_add_epi32(_mm256_mullo_epi32(u, g_cb), _mm256_mullo_epi32(v, g_cr)),
                half,
            )),
        );
        let b = _mm256_add_epi32(
            l,
            _mm256_srai_epi32::<16>(_mm256_add_epi32(_mm256_mullo_epi32(u, b_cb), half)),
        );
        // Lane k (pixels 4k..4k+3): r, g as i16, then b and zeros; then bytes, clamped.
        let rg = _mm256_packs_epi32(r, g);
        let bz = _mm256_packs_epi32(b, _mm256_setzero_si256());
        let bytes = _mm256_shuffle_epi8(_mm256_packus_epi16(rg, bz), order);
        let mut twelve = [[0u8; 16]; 2];
        // SAFETY: two 16-byte stores into a 32-byte array.
        unsafe { _mm256_storeu_si256(twelve.as_mut_ptr().cast(), bytes) };
        out[3 * x..3 * x + 12].copy_from_slice(&twelve[0][..12]);
        out[3 * x + 12..3 * x + 24].copy_from_slice(&twelve[1][..12]);
        x += 8;
    }
    x
}
