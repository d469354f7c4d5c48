//! A minimal TurboJPEG 3 decompressor over the C API (`turbojpeg-sys`): the FFI edge.
//!
//! The safe `turbojpeg` crate parses a JPEG's headers twice per decode (once to size the output
//! and again inside `decompress` to check it) and cannot decode a region. For 32×32 CIFAR images
//! the header parse (Huffman tables) is a large share of the work, and for RandomResizedCrop on
//! photos most of the image is thrown away. This module parses once (`tj3DecompressHeader`
//! leaves the handle ready, and `tj3Decompress8` then skips re-reading) and decodes only the
//! requested region (`tj3SetCroppingRegion`), at a DCT scaling factor M/8.
//!
//! Any error *or warning* from libjpeg-turbo is an error here: a truncated file never becomes
//! grey pixels.

use std::ffi::CStr;
use std::ptr::NonNull;

use turbojpeg_sys as sys;

use super::DecodeError;

/// iMCU width in pixels for each `TJSAMP` (444, 422, 420, GRAY, 440, 411, 441): turbojpeg.h's
/// `tjMCUWidth`, a header-only table that is not exported from the library.
const MCU_WIDTH: [u32; 7] = [8, 16, 16, 8, 8, 32, 8];

/// What the header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct JpegHeader {
    pub width: u32,
    pub height: u32,
    /// CMYK or YCCK: libjpeg-turbo decodes those only to CMYK pixels.
    pub cmyk: bool,
    /// iMCU width in pixels at full scale (`None`: unknown subsampling, no region decoding).
    pub imcu_width: Option<u32>,
}

/// A rectangle of the *scaled* image, in pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Region {
    pub x: u32,
    pub y: u32,
    pub width: u32,
    pub height: u32,
}

/// A TurboJPEG decompression handle. `Send`, not `Sync`: one per worker.
pub(crate) struct Turbo {
    handle: NonNull<std::ffi::c_void>,
    /// The bytes whose header the handle holds, by address and length: `decompress` must be
    /// given the same buffer (libjpeg-turbo keeps a pointer into it between the two calls).
    header_of: Option<(usize, usize)>,
}

// SAFETY: a TurboJPEG handle has no thread affinity; it must only not be used from two threads
// at once, which `&mut self` on every call guarantees.
unsafe impl Send for Turbo {}

impl Drop for Turbo {
    fn drop(&mut self) {
        // SAFETY: the handle came from tj3Init and is destroyed exactly once.
        unsafe { sys::tj3Destroy(self.handle.as_ptr()) };
    }
}

/// `TJSCALED(dimension, M/8)`: libjpeg-turbo's rounding up.
pub(crate) fn scaled(dimension: u32, eighths: u32) -> u32 {
    (dimension as u64 * eighths as u64).div_ceil(8) as u32
}

impl Turbo {
    pub(crate) fn new() -> Result<Turbo, DecodeError> {
        // SAFETY: tj3Init has no preconditions; a null result is handled.
        let handle = unsafe { sys::tj3Init(sys::TJINIT_TJINIT_DECOMPRESS as libc::c_int) };
        let handle = NonNull::new(handle)
            .ok_or_else(|| DecodeError::Jpeg("cannot create a TurboJPEG handle".into()))?;
        Ok(Turbo {
            handle,
            header_of: None,
        })
    }

    fn error(&mut self) -> DecodeError {
        // SAFETY: the handle is valid; tj3GetErrorStr returns a NUL-terminated string owned by
        // the handle (or a static one), copied here before any other call.
        let message = unsafe { CStr::from_ptr(sys::tj3GetErrorStr(self.handle.as_ptr())) };
        DecodeError::Jpeg(format!("TurboJPEG error: {}", message.to_string_lossy()))
    }

    fn get(&mut self, param: sys::TJPARAM) -> libc::c_int {
        // SAFETY: the handle is valid and `param` is one of the library's parameter ids.
        unsafe { sys::tj3Get(self.handle.as_ptr(), param as libc::c_int) }
    }

    /// Parses the headers of `data` and leaves the handle ready to decompress it.
    pub(crate) fn read_header(&mut self, data: &[u8]) -> Result<JpegHeader, DecodeError> {
        self.header_of = None;
        // SAFETY: the handle is valid and `data` is a live buffer of `data.len()` bytes.
        let rc = unsafe {
            sys::tj3DecompressHeader(
                self.handle.as_ptr(),
                data.as_ptr(),
                data.len() as sys::size_t,
            )
        };
        if rc != 0 {
            return Err(self.error());
        }
        let width = self.get(sys::TJPARAM_TJPARAM_JPEGWIDTH);
        let height = self.get(sys::TJPARAM_TJPARAM_JPEGHEIGHT);
        let subsamp = self.get(sys::TJPARAM_TJPARAM_SUBSAMP);
        let colorspace = self.get(sys::TJPARAM_TJPARAM_COLORSPACE);
        if width <= 0 || height <= 0 {
            return Err(DecodeError::ZeroSized);
        }
        let imcu_width = usize::try_from(subsamp)
            .ok()
            .and_then(|i| MCU_WIDTH.get(i).copied());
        self.header_of = Some((data.as_ptr() as usize, data.len()));
        Ok(JpegHeader {
            width: width as u32,
            height: height as u32,
            cmyk: colorspace == sys::TJCS_TJCS_CMYK as libc::c_int
                || colorspace == sys::TJCS_TJCS_YCCK as libc::c_int,
            imcu_width,
        })
    }

    /// Decompresses `data`, whose header was just read by [`read_header`](Self::read_header),
    /// at scale `eighths`/8, optionally only `region` (of the scaled image; its left edge must be
    /// a multiple of the scaled iMCU width: see [`aligned_region`]). Writes RGB (or CMYK when
    /// `header.cmyk`) rows of `pitch` bytes into `out`.
    ///
    /// # Panics
    /// When `data` is not the buffer whose header was read, or `out` is too small (caller bugs).
    pub(crate) fn decompress(
        &mut self,
        data: &[u8],
        header: &JpegHeader,
        eighths: u32,
        region: Option<Region>,
        out: &mut [u8],
    ) -> Result<(), DecodeError> {
        assert_eq!(
            self.header_of.take(),
            Some((data.as_ptr() as usize, data.len())),
            "decompress must follow read_header on the same buffer"
        );
        assert!((1..=8).contains(&eighths), "scale {eighths}/8");
        let (w, h) = match region {
            Some(r) => (r.width, r.height),
            None => (
                scaled(header.width, eighths),
                scaled(header.height, eighths),
            ),
        };
        let channels = if header.cmyk { 4 } else { 3 };
        let pitch = w as usize * channels;
        assert!(out.len() >= pitch * h as usize, "output buffer too small");
        // libjpeg-turbo matches factors in lowest terms (1/1, 1/2, 3/4, ...).
        let gcd = [8, 4, 2, 1]
            .into_iter()
            .find(|d| eighths.is_multiple_of(*d))
            .unwrap_or(1);
        let factor = sys::tjscalingfactor {
            num: (eighths / gcd) as libc::c_int,
            denom: (8 / gcd) as libc::c_int,
        };
        // SAFETY: valid handle; a scaling factor of M/8 is one libjpeg-turbo supports.
        if unsafe { sys::tj3SetScalingFactor(self.handle.as_ptr(), factor) } != 0 {
            return Err(self.error());
        }
        let crop = match region {
            Some(r) => sys::tjregion {
                x: r.x as libc::c_int,
                y: r.y as libc::c_int,
                w: r.width as libc::c_int,
                h: r.height as libc::c_int,
            },
            None => sys::tjregion {
                x: 0,
                y: 0,
                w: 0,
                h: 0,
            }, // TJUNCROPPED
        };
        // SAFETY: valid handle whose header has been read (required for a cropping region).
        if unsafe { sys::tj3SetCroppingRegion(self.handle.as_ptr(), crop) } != 0 {
            return Err(self.error());
        }
        let format = if header.cmyk {
            sys::TJPF_TJPF_CMYK
        } else {
            sys::TJPF_TJPF_RGB
        };
        // SAFETY: `data` is the live buffer whose header the handle holds (asserted above);
        // `out` holds at least `pitch × h` bytes, the size of the (cropped, scaled) output.
        let rc = unsafe {
            sys::tj3Decompress8(
                self.handle.as_ptr(),
                data.as_ptr(),
                data.len() as sys::size_t,
                out.as_mut_ptr(),
                pitch as libc::c_int,
                format,
            )
        };
        if rc != 0 {
            return Err(self.error());
        }
        Ok(())
    }
}

/// The region to decode so that the scaled-image rectangle `(x, y, width, height)` is covered:
/// the left edge moved down to a multiple of the scaled iMCU width, as TurboJPEG requires.
/// Returns the region and the rectangle's offset inside it. `None` when the subsampling is
/// unknown (decode everything then).
pub(crate) fn aligned_region(
    header: &JpegHeader,
    eighths: u32,
    x: u32,
    y: u32,
    width: u32,
    height: u32,
) -> Option<(Region, u32)> {
    let step = scaled(header.imcu_width?, eighths).max(1);
    let left = x / step * step;
    let (sw, sh) = (
        scaled(header.width, eighths),
        scaled(header.height, eighths),
    );
    let right = (x + width).min(sw);
    let bottom = (y + height).min(sh);
    Some((
        Region {
            x: left,
            y: y.min(sh - 1),
            width: right.saturating_sub(left).max(1),
            height: bottom.saturating_sub(y).max(1),
        },
        x - left,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_align_left_to_the_scaled_imcu() {
        let header = JpegHeader {
            width: 500,
            height: 375,
            cmyk: false,
            imcu_width: Some(16),
        };
        // Full scale: step 16. x = 37 -> 32, offset 5.
        let (r, dx) = aligned_region(&header, 8, 37, 10, 100, 50).unwrap();
        assert_eq!((r.x, r.y, r.width, r.height, dx), (32, 10, 105, 50, 5));
        // Scale 4/8: step 8, image 250x188; a rectangle past the edge is clipped.
        let (r, dx) = aligned_region(&header, 4, 245, 180, 20, 20).unwrap();
        assert_eq!((r.x, r.width, r.height, dx), (240, 10, 8, 5));
        let unknown = JpegHeader {
            imcu_width: None,
            ..header
        };
        assert!(aligned_region(&unknown, 8, 0, 0, 10, 10).is_none());
    }
}
