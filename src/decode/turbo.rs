//! A minimal TurboJPEG 3 decompressor over the C API (`turbojpeg-sys`): the FFI edge.
//!
//! The safe `turbojpeg` crate parses a JPEG's headers twice per decode (once to size the output
//! and again inside `decompress` to check it) and cannot decode a region. For 32×32 CIFAR images
//! the header parse (Huffman tables) is a large share of the work, and for RandomResizedCrop on
//! photos most of the image is thrown away. This module parses once (`tj3DecompressHeader`
//! leaves the handle ready, and `tj3Decompress8` then skips re-reading) and decodes only the
//! requested region (`tj3SetCroppingRegion`), at a DCT scaling factor M/8. Outputs whose rows
//! libjpeg-turbo would write with non-temporal stores are decoded into a staging buffer first
//! (see [`STREAMED_ROW_ALIGNMENT`]): the pixels stay in cache for the transform that reads them.
//!
//! Any error *or warning* from libjpeg-turbo is an error here: a truncated file never becomes
//! grey pixels.
//!
//! A handle whose call failed is never used again. libjpeg-turbo does not always clean up after
//! an error: `tj3DecompressHeader` returns from its `setjmp` without aborting the decompressor,
//! which stays half-way through the bad file's markers, and the next file's header is then parsed
//! from that state ("Bogus Huffman table definition" for good files after one corrupt one). So
//! every failed call destroys the handle and the next call makes a fresh one: an error costs one
//! `tj3Init`, and a good file decodes exactly as it would in a fresh process.

use std::ffi::CStr;
use std::ptr::NonNull;

use turbojpeg_sys as sys;

use super::DecodeError;
use super::restart::{Frame, Layout, RestartSegments};

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
    /// Arithmetic-coded (rare): no lower bound on the bits per block.
    pub arithmetic: bool,
    /// Where its restart segments are, when it is a segmented JPEG (`--restart-markers`).
    pub segments: Option<RestartSegments>,
    /// libjpeg-turbo reads it as YCbCr or grayscale (not RGB, CMYK or YCCK).
    pub ycc_or_gray: bool,
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
    /// `None` after a failed call (see the module docs); made again on the next call.
    handle: Option<Handle>,
    /// Where rows are decoded when `out`'s own rows would be streamed (see
    /// [`STREAMED_ROW_ALIGNMENT`]); at most [`MAX_STAGED_BYTES`] plus the alignment.
    staging: Vec<u8>,
    /// The bytes whose header the handle holds, by address and length: `decompress` must be
    /// given the same buffer (libjpeg-turbo keeps a pointer into it between the two calls).
    header_of: Option<(usize, usize)>,
}

/// A TurboJPEG handle (`tj3Init`), destroyed when dropped.
struct Handle(NonNull<std::ffi::c_void>);

impl Handle {
    /// A new handle for `init` (decompressing, transforming).
    fn new(init: sys::TJINIT) -> Result<Handle, DecodeError> {
        // SAFETY: tj3Init has no preconditions; a null result is handled.
        NonNull::new(unsafe { sys::tj3Init(init as libc::c_int) })
            .map(Handle)
            .ok_or_else(|| DecodeError::Jpeg("cannot create a TurboJPEG handle".into()))
    }

    fn as_ptr(&self) -> *mut std::ffi::c_void {
        self.0.as_ptr()
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle came from tj3Init and is destroyed exactly once, here.
        unsafe { sys::tj3Destroy(self.0.as_ptr()) };
    }
}

// SAFETY: a TurboJPEG handle has no thread affinity; it must only not be used from two threads
// at once, which `&mut self` on every call guarantees.
unsafe impl Send for Turbo {}

/// The width a cropping region's left edge must be a multiple of, at full scale: TurboJPEG
/// checks it against its subsampling class (`tjMCUWidth`), while libjpeg aligns the region to
/// the file's real iMCU (8 × the largest horizontal sampling factor), and the two differ for
/// valid files TurboJPEG classes as 4:4:4 or 4:4:0 whose components are all sampled 2x1, say
/// ("Unexplained mismatch between specified and actual cropping region" otherwise). Both are
/// powers of two: the larger satisfies both. `None` (decode whole) when either is unknown.
fn imcu_width(frame: Option<Frame>, subsamp: libc::c_int) -> Option<u32> {
    let turbo = MCU_WIDTH.get(usize::try_from(subsamp).ok()?).copied()?;
    let (file, _) = frame?.mcu_size();
    (turbo.is_power_of_two() && file.is_power_of_two()).then_some(turbo.max(file))
}

/// The error of the call that just failed on the live `handle`, as TurboJPEG words it.
fn last_error(handle: *mut std::ffi::c_void) -> DecodeError {
    // SAFETY: `handle` is live; tj3GetErrorStr returns a NUL-terminated string owned by the
    // handle (or a static one), copied here before the handle can be destroyed.
    let message = unsafe { CStr::from_ptr(sys::tj3GetErrorStr(handle)) };
    DecodeError::Jpeg(format!("TurboJPEG error: {}", message.to_string_lossy()))
}

/// `TJSCALED(dimension, M/8)`: libjpeg-turbo's rounding up.
pub(crate) fn scaled(dimension: u32, eighths: u32) -> u32 {
    (dimension as u64 * eighths as u64).div_ceil(8) as u32
}

impl Turbo {
    pub(crate) fn new() -> Result<Turbo, DecodeError> {
        let mut turbo = Turbo {
            handle: None,
            staging: Vec::new(),
            header_of: None,
        };
        turbo.handle()?;
        Ok(turbo)
    }

    /// The live handle, made first if the last one was discarded.
    fn handle(&mut self) -> Result<*mut std::ffi::c_void, DecodeError> {
        if self.handle.is_none() {
            self.handle = Some(Handle::new(sys::TJINIT_TJINIT_DECOMPRESS)?);
        }
        Ok(self.handle.as_ref().expect("made above").as_ptr())
    }

    /// Destroys the handle, if there is one.
    fn discard(&mut self) {
        self.header_of = None;
        self.handle = None;
    }

    /// The error of the call that just failed on `handle`; the handle is then discarded, so
    /// whatever state the failure left it in cannot affect the next image.
    fn fail(&mut self, handle: *mut std::ffi::c_void) -> DecodeError {
        let error = last_error(handle);
        self.discard();
        error
    }

    fn get(handle: *mut std::ffi::c_void, param: sys::TJPARAM) -> libc::c_int {
        // SAFETY: the caller passes the live handle; `param` is one of the library's ids.
        unsafe { sys::tj3Get(handle, param as libc::c_int) }
    }

    /// Parses the headers of `data` and leaves the handle ready to decompress it.
    pub(crate) fn read_header(&mut self, data: &[u8]) -> Result<JpegHeader, DecodeError> {
        self.header_of = None;
        // Tables the file uses but does not define would come from the images this handle
        // decoded before (see `tables`): such a file gets a fresh handle.
        if !super::tables::defines_its_tables(data) {
            self.discard();
        }
        let handle = self.handle()?;
        // SAFETY: the handle is live and `data` is a live buffer of `data.len()` bytes.
        let rc =
            unsafe { sys::tj3DecompressHeader(handle, data.as_ptr(), data.len() as sys::size_t) };
        if rc != 0 {
            return Err(self.fail(handle));
        }
        let width = Self::get(handle, sys::TJPARAM_TJPARAM_JPEGWIDTH);
        let height = Self::get(handle, sys::TJPARAM_TJPARAM_JPEGHEIGHT);
        let subsamp = Self::get(handle, sys::TJPARAM_TJPARAM_SUBSAMP);
        let colorspace = Self::get(handle, sys::TJPARAM_TJPARAM_COLORSPACE);
        let arithmetic = Self::get(handle, sys::TJPARAM_TJPARAM_ARITHMETIC) == 1;
        if width <= 0 || height <= 0 {
            return Err(DecodeError::ZeroSized);
        }
        // One walk over the header segments for both.
        let layout = Layout::of(data);
        self.header_of = Some((data.as_ptr() as usize, data.len()));
        Ok(JpegHeader {
            width: width as u32,
            height: height as u32,
            cmyk: colorspace == sys::TJCS_TJCS_CMYK as libc::c_int
                || colorspace == sys::TJCS_TJCS_YCCK as libc::c_int,
            imcu_width: imcu_width(layout.frame, subsamp),
            arithmetic,
            segments: layout.segments,
            ycc_or_gray: colorspace == sys::TJCS_TJCS_YCbCr as libc::c_int
                || colorspace == sys::TJCS_TJCS_GRAY as libc::c_int,
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
        let handle = self.handle()?;
        // SAFETY: live handle; a scaling factor of M/8 is one libjpeg-turbo supports.
        if unsafe { sys::tj3SetScalingFactor(handle, factor) } != 0 {
            return Err(self.fail(handle));
        }
        // SAFETY: live handle; TJPARAM_MAXMEMORY takes any non-negative number of megabytes.
        if unsafe {
            sys::tj3Set(
                handle,
                sys::TJPARAM_TJPARAM_MAXMEMORY as libc::c_int,
                buffer_memory_limit_mb(data.len()),
            )
        } != 0
        {
            return Err(self.fail(handle));
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
        // SAFETY: live handle whose header has been read (required for a cropping region).
        if unsafe { sys::tj3SetCroppingRegion(handle, crop) } != 0 {
            return Err(self.fail(handle));
        }
        let format = if header.cmyk {
            sys::TJPF_TJPF_CMYK
        } else {
            sys::TJPF_TJPF_RGB
        };
        // CMYK output is converted by plain C code, which streams nothing.
        let staged = !header.cmyk
            && mostly_streamed(out.as_ptr() as usize, pitch, h as usize)
            && pitch * h as usize <= MAX_STAGED_BYTES;
        if !staged {
            // SAFETY: `out` holds at least `pitch × h` bytes (asserted above).
            return unsafe { self.decompress_to(data, out.as_mut_ptr(), pitch, format) };
        }
        // Rows of a multiple of the alignment, starting half-way between two boundaries: no row
        // is streamed. Then packed into `out`.
        let staged_pitch = pitch.next_multiple_of(STREAMED_ROW_ALIGNMENT);
        let half = STREAMED_ROW_ALIGNMENT / 2;
        self.staging
            .resize(staged_pitch * h as usize + STREAMED_ROW_ALIGNMENT, 0);
        let offset = (half + STREAMED_ROW_ALIGNMENT
            - self.staging.as_ptr() as usize % STREAMED_ROW_ALIGNMENT)
            % STREAMED_ROW_ALIGNMENT;
        let staging = self.staging[offset..].as_mut_ptr();
        // SAFETY: the staging buffer holds `offset + staged_pitch × h` bytes or more.
        unsafe { self.decompress_to(data, staging, staged_pitch, format)? };
        let staging = &self.staging[offset..offset + staged_pitch * h as usize];
        if staged_pitch == pitch {
            out[..pitch * h as usize].copy_from_slice(staging);
        } else {
            for (row, staged) in out
                .chunks_exact_mut(pitch)
                .zip(staging.chunks_exact(staged_pitch))
            {
                row.copy_from_slice(&staged[..pitch]);
            }
        }
        Ok(())
    }

    /// Decompresses `data`, whose header was just read by [`read_header`](Self::read_header),
    /// at full size to its Y, Cb and Cr planes (only Y for grayscale): entropy decoding and
    /// inverse DCT, no upsampling or colour conversion. Plane `i` starts at `lens[..i]`'s sum
    /// in `out`, `lens[i]` bytes of rows `strides[i]` apart.
    ///
    /// # Panics
    /// When `data` is not the buffer whose header was read, or `out` is shorter than the planes
    /// (caller bugs).
    pub(crate) fn decompress_planes(
        &mut self,
        data: &[u8],
        out: &mut [u8],
        strides: [usize; 3],
        lens: [usize; 3],
    ) -> Result<(), DecodeError> {
        assert_eq!(
            self.header_of.take(),
            Some((data.as_ptr() as usize, data.len())),
            "decompress_planes must follow read_header on the same buffer"
        );
        assert!(out.len() >= lens.iter().sum::<usize>(), "planes too small");
        let handle = self.handle()?;
        let full = sys::tjscalingfactor { num: 1, denom: 1 };
        let uncropped = sys::tjregion {
            x: 0,
            y: 0,
            w: 0,
            h: 0,
        };
        // SAFETY: live handle whose header has been read; 1/1 and no region are always valid,
        // as is any non-negative memory limit.
        let set = unsafe {
            sys::tj3SetScalingFactor(handle, full) == 0
                && sys::tj3SetCroppingRegion(handle, uncropped) == 0
                && sys::tj3Set(
                    handle,
                    sys::TJPARAM_TJPARAM_MAXMEMORY as libc::c_int,
                    buffer_memory_limit_mb(data.len()),
                ) == 0
        };
        if !set {
            return Err(self.fail(handle));
        }
        // Each plane's width and height as TurboJPEG writes it, checked against the caller's.
        let subsamp = Self::get(handle, sys::TJPARAM_TJPARAM_SUBSAMP);
        let (width, height) = (
            Self::get(handle, sys::TJPARAM_TJPARAM_JPEGWIDTH),
            Self::get(handle, sys::TJPARAM_TJPARAM_JPEGHEIGHT),
        );
        let gray = subsamp == sys::TJSAMP_TJSAMP_GRAY as libc::c_int;
        let mut planes = [std::ptr::null_mut(); 3];
        let mut pitches = [0 as libc::c_int; 3];
        let base = out.as_mut_ptr();
        let mut at = 0;
        for i in 0..if gray { 1 } else { 3 } {
            // SAFETY: pure functions of their arguments.
            let (pw, ph) = unsafe {
                (
                    sys::tj3YUVPlaneWidth(i as libc::c_int, width, subsamp),
                    sys::tj3YUVPlaneHeight(i as libc::c_int, height, subsamp),
                )
            };
            let fits = pw > 0
                && ph > 0
                && pw as usize <= strides[i]
                && strides[i] * (ph as usize - 1) + pw as usize <= lens[i];
            if !fits {
                return Err(DecodeError::Jpeg(format!(
                    "plane {i} is {pw}×{ph}, more than its {} bytes",
                    lens[i]
                )));
            }
            // SAFETY: at + lens[i] <= out.len() (the planes fit, asserted above).
            planes[i] = unsafe { base.add(at) };
            pitches[i] = strides[i] as libc::c_int;
            at += lens[i];
        }
        // SAFETY: `data` is the live buffer whose header the handle holds (checked above);
        // each plane pointer is valid for the plane's rows (checked against `lens` above).
        let rc = unsafe {
            sys::tj3DecompressToYUVPlanes8(
                handle,
                data.as_ptr(),
                data.len() as sys::size_t,
                planes.as_mut_ptr(),
                pitches.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return Err(self.fail(handle));
        }
        Ok(())
    }

    /// `tj3Decompress8` into `rows` with `pitch` bytes per row.
    ///
    /// # Safety
    /// `rows` must be valid for writes of `pitch ×` (output height) bytes, and the handle must
    /// hold the header of `data` with scale and region set.
    unsafe fn decompress_to(
        &mut self,
        data: &[u8],
        rows: *mut u8,
        pitch: usize,
        format: sys::TJPF,
    ) -> Result<(), DecodeError> {
        let handle = self.handle()?;
        // SAFETY: `data` is the live buffer whose header the handle holds (checked by
        // `decompress`); `rows` is valid for the output's `pitch × height` bytes (the caller's
        // contract).
        let rc = unsafe {
            sys::tj3Decompress8(
                handle,
                data.as_ptr(),
                data.len() as sys::size_t,
                rows,
                pitch as libc::c_int,
                format,
            )
        };
        if rc != 0 {
            return Err(self.fail(handle));
        }
        Ok(())
    }
}

/// The width of the segments [`add_restart_markers`] aims for: narrower ones let a crop skip
/// more, and cost more markers (two bytes and up to seven bits of padding each) and decoder
/// restarts. Measured on ImageNet photos (bench/RESULTS.md): RandomResizedCrop 224 ran at
/// 3,115 images/s with 32-pixel segments, 2,960 with 64, 2,750 with 128 (plain files 2,400);
/// files grew 2.6%, 1.0%, 0.5%; 16 pixels was no faster than 32 and grew them 6.6%.
const SEGMENT_PIXELS: u32 = 32;

/// The restart interval, in MCUs, for an image `mcus` MCUs wide whose MCUs are `mcu_width`
/// pixels: the divisor of `mcus` nearest [`SEGMENT_PIXELS`] wide and no narrower than half
/// of it, so every row splits into equal segments; the whole row when no divisor fits.
pub(crate) fn restart_interval(mcus: u32, mcu_width: u32) -> u32 {
    let target = (SEGMENT_PIXELS / mcu_width).max(1);
    (1..=mcus)
        .filter(|d| mcus.is_multiple_of(*d) && 2 * d * mcu_width >= SEGMENT_PIXELS)
        .min_by_key(|d| d.abs_diff(target))
        .unwrap_or(mcus)
        .max(1)
}

/// Rewrites the JPEG `data` losslessly (its DCT coefficients unchanged, so its pixels too) with
/// restart markers that cut every MCU row into equal segments ([`restart_interval`]) and
/// optimized Huffman tables: libjpeg-turbo's lossless transform (`tj3Transform`, what
/// `jpegtran -restart NB -optimize` does). A progressive or arithmetic-coded file comes out
/// baseline and Huffman-coded. Markers (EXIF, ICC) are kept.
pub(crate) fn add_restart_markers(data: &[u8]) -> Result<Vec<u8>, DecodeError> {
    // Destroyed when this returns, after the last use of `h`.
    let handle = Handle::new(sys::TJINIT_TJINIT_TRANSFORM)?;
    let h = handle.as_ptr();
    // SAFETY: live handle; `data` is a live buffer of its length. tj3Transform then reuses the
    // header read here.
    if unsafe { sys::tj3DecompressHeader(h, data.as_ptr(), data.len() as sys::size_t) } != 0 {
        return Err(last_error(h));
    }
    let subsamp = Turbo::get(h, sys::TJPARAM_TJPARAM_SUBSAMP);
    let frame = Layout::of(data).frame;
    // A subsampling TurboJPEG cannot class is one it will not crop: markers would not help.
    let (Some(frame), Some(_)) = (frame, imcu_width(frame, subsamp)) else {
        return Err(DecodeError::Jpeg(
            "its chroma subsampling is one TurboJPEG decodes only whole: restart markers \
             would not speed up its crops"
                .into(),
        ));
    };
    let (mcu_width, _) = frame.mcu_size();
    let interval = restart_interval(frame.width.max(1).div_ceil(mcu_width), mcu_width);
    for (param, value) in [
        (sys::TJPARAM_TJPARAM_RESTARTBLOCKS, interval as libc::c_int),
        (
            sys::TJPARAM_TJPARAM_MAXMEMORY,
            buffer_memory_limit_mb(data.len()),
        ),
        // Reading the header copied the source's coding into the handle: the output is
        // baseline and Huffman-coded whatever the source was (a progressive scan's restart
        // interval would count single blocks, and crops read only sequential scans).
        (sys::TJPARAM_TJPARAM_PROGRESSIVE, 0),
        (sys::TJPARAM_TJPARAM_ARITHMETIC, 0),
    ] {
        // SAFETY: live handle; each parameter applies to transforms and takes its value.
        if unsafe { sys::tj3Set(h, param as libc::c_int, value) } != 0 {
            return Err(last_error(h));
        }
    }
    let transform = sys::tjtransform {
        r: sys::tjregion {
            x: 0,
            y: 0,
            w: 0,
            h: 0,
        },
        op: sys::TJXOP_TJXOP_NONE as libc::c_int,
        options: sys::TJXOPT_OPTIMIZE as libc::c_int,
        data: std::ptr::null_mut(),
        customFilter: None,
    };
    let mut out: *mut libc::c_uchar = std::ptr::null_mut();
    let mut len: sys::size_t = 0;
    // SAFETY: live handle; `data` is a live buffer of its length; one transform, whose output
    // buffer TurboJPEG allocates (`out` null) and which is freed below with tj3Free.
    let rc = unsafe {
        sys::tj3Transform(
            h,
            data.as_ptr(),
            data.len() as sys::size_t,
            1,
            &mut out,
            &mut len,
            &transform,
        )
    };
    let result = if rc == 0 && !out.is_null() {
        // SAFETY: on success TurboJPEG wrote `len` bytes at `out`.
        Ok(unsafe { std::slice::from_raw_parts(out, len as usize) }.to_vec())
    } else {
        Err(last_error(h))
    };
    if !out.is_null() {
        // SAFETY: `out` was allocated by TurboJPEG (tj3Alloc) in the call above.
        unsafe { sys::tj3Free(out.cast()) };
    }
    result
}

/// The most memory, in megabytes, libjpeg-turbo may take for the whole-image buffers of a
/// progressive, multi-scan or arithmetic-coded JPEG of `len` bytes (`TJPARAM_MAXMEMORY`):
/// 4096 bytes of buffer per byte of file, and never less than 64 MB.
///
/// A Huffman-coded file spends at least one bit per 8×8 block, and a block takes 128 bytes of
/// coefficients, so a complete file with up to three components never needs more than about
/// 3072 bytes of buffer per byte of file; [`Decoder`](super::Decoder) refuses files that claim
/// more blocks than their bytes can code before anything is decoded. The limit is the backstop
/// for arithmetic-coded files, which have no such bound: a 7 KB file claiming 13000×13000 pixels
/// would otherwise take ~1 GB before its missing data is noticed.
pub(crate) fn buffer_memory_limit_mb(len: usize) -> libc::c_int {
    let mb = (len as u64).saturating_mul(4096).div_ceil(1 << 20).max(64);
    mb.min(libc::c_int::MAX as u64) as libc::c_int
}

/// libjpeg-turbo's SIMD colour converters (YCbCr to RGB, SSE2 and AVX2) write an output row
/// with non-temporal stores (`movntdq`) whenever the row starts on a 32-byte boundary. Those
/// bypass the caches: the pixels go to memory and are read back from there by whatever uses
/// them next (the transform, microseconds later), and a row that is not a whole number of cache
/// lines (96 bytes for a 32-pixel row) is flushed in partial lines, which stalls the decoder.
/// Measured on the CIFAR-10 test set (32×32): a decoder whose output buffer happened to be
/// 32-byte aligned was 10–30% slower than one whose buffer was not, so two runs of the same
/// program could differ by that much depending on where the allocator put one buffer.
pub(crate) const STREAMED_ROW_ALIGNMENT: usize = 32;

/// Outputs up to this size are staged when their rows would be streamed; larger ones (far
/// bigger than the caches, where streaming stores are what they are meant for) are decoded in
/// place.
const MAX_STAGED_BYTES: usize = 4 << 20;

/// Whether at least a quarter of the rows of an output at address `base` with `pitch` bytes per
/// row start on a [`STREAMED_ROW_ALIGNMENT`] boundary. Row starts repeat modulo the alignment
/// with a period of at most 32 rows, so the first 32 rows tell.
pub(crate) fn mostly_streamed(base: usize, pitch: usize, rows: usize) -> bool {
    let period = rows.min(STREAMED_ROW_ALIGNMENT);
    let streamed = (0..period)
        .filter(|&y| (base + y * pitch).is_multiple_of(STREAMED_ROW_ALIGNMENT))
        .count();
    period > 0 && 4 * streamed >= period
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
            arithmetic: false,
            segments: None,
            ycc_or_gray: true,
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

    #[test]
    fn rows_that_would_be_streamed_are_recognised() {
        // 32-pixel RGB rows (96 bytes, a multiple of 32): every row starts as the first does.
        assert!(mostly_streamed(0x1000, 96, 32));
        assert!(!mostly_streamed(0x1010, 96, 32));
        // 16-pixel rows (48 bytes): every other row starts aligned.
        assert!(mostly_streamed(0x1000, 48, 16));
        assert!(!mostly_streamed(0x1008, 48, 16));
        // 500-pixel rows (1500 bytes): one row in eight; decoded in place.
        assert!(!mostly_streamed(0x1000, 1500, 375));
        assert!(!mostly_streamed(0x1000, 96, 0));
    }
}
