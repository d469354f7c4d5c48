//! Deterministic synthetic ImageFolder trees, for demos, tests and benchmarks.
//!
//! [`write_image_folder`] writes `root/classNN/imgNNNNN.jpg` images whose content depends only on
//! the [`SyntheticSpec`] (a class-coloured gradient with seeded noise, so JPEG sizes are
//! realistic). With [`SyntheticSpec::edge_cases`] it adds files that a loader must handle:
//! valid-but-unusual images that must decode to RGB, and broken ones that must be rejected by
//! path with a reason. The same spec always produces the same bytes, which is how the committed
//! `fixtures/` tree is made and checked.

use std::fs;
use std::io::Cursor;
use std::path::Path;

use crate::decode::{ChromaSubsampling, EncodeError, JpegEncoder};
use crate::error::{Error, IoContext as _, Result};

/// What to generate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntheticSpec {
    /// Number of class directories.
    pub classes: usize,
    /// Valid images per class.
    pub per_class: usize,
    /// Image width.
    pub width: u32,
    /// Image height.
    pub height: u32,
    /// Seed for the pixel noise.
    pub seed: u64,
    /// JPEG quality.
    pub quality: u8,
    /// Add the [`EdgeCase`] files (needs at least 2 classes).
    pub edge_cases: bool,
}

impl Default for SyntheticSpec {
    fn default() -> Self {
        SyntheticSpec {
            classes: 10,
            per_class: 100,
            width: 64,
            height: 48,
            seed: 0,
            quality: 90,
            edge_cases: false,
        }
    }
}

/// An unusual file added by [`SyntheticSpec::edge_cases`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EdgeCase {
    /// Path relative to the root.
    pub key: String,
    /// Whether a correct loader accepts it (decodes it to RGB) or must reject it.
    pub valid: bool,
    /// What it is.
    pub what: &'static str,
}

/// What was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntheticTree {
    /// Class names, sorted.
    pub classes: Vec<String>,
    /// Number of files with an image extension (valid images plus edge cases).
    pub image_files: usize,
    /// The edge-case files.
    pub edge_cases: Vec<EdgeCase>,
}

/// A SplitMix64 step: a tiny, well-known, portable hash for deterministic noise.
fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The RGB pixels of image `index` of class `class`.
pub fn synthetic_pixels(spec: &SyntheticSpec, class: usize, index: usize) -> Vec<u8> {
    let (w, h) = (spec.width as usize, spec.height as usize);
    let base = splitmix64(spec.seed ^ (class as u64).wrapping_mul(0x1000_0001));
    let tint = [
        (base & 0xFF) as i32,
        ((base >> 8) & 0xFF) as i32,
        ((base >> 16) & 0xFF) as i32,
    ];
    let mut pixels = Vec::with_capacity(w * h * 3);
    let mut state = splitmix64(base ^ (index as u64).wrapping_mul(0x9E37));
    for y in 0..h {
        for x in 0..w {
            state = splitmix64(state);
            for (c, t) in tint.iter().enumerate() {
                let gradient = ((x * 255) / w.max(1) + (y * 255) / h.max(1)) as i32 / 2;
                let noise = ((state >> (c * 8)) & 0x1F) as i32 - 16;
                let value = (t + gradient * (c as i32 + 1) / 3 + noise) % 256;
                pixels.push(value.clamp(0, 255) as u8);
            }
        }
    }
    pixels
}

/// One synthetic JPEG (`width × height`, quality 90, the pixels of class 0, image 0 of the
/// default spec at that size): a known-good image for tests and fuzz references.
pub fn sample_jpeg(width: u32, height: u32) -> Vec<u8> {
    let spec = SyntheticSpec {
        width,
        height,
        ..SyntheticSpec::default()
    };
    let pixels = synthetic_pixels(&spec, 0, 0);
    encode_jpeg(&pixels, width, height, image::ExtendedColorType::Rgb8, 90)
}

/// The same pixels as [`sample_jpeg`] as a progressive and as a CMYK JPEG (fuzz seeds).
#[cfg(feature = "fuzzing")]
pub(crate) fn sample_jpeg_variants(width: u32, height: u32) -> [Vec<u8>; 2] {
    let spec = SyntheticSpec {
        width,
        height,
        ..SyntheticSpec::default()
    };
    let pixels = synthetic_pixels(&spec, 0, 0);
    [
        turbo_jpeg(&pixels, width, height, 90, true).expect("in-memory JPEG"),
        cmyk_jpeg(&pixels, width, height, 90).expect("in-memory JPEG"),
    ]
}

/// The plain images' encoder: the `image` crate's, not [`JpegEncoder`], because these bytes
/// define the committed fixtures and the demo's digests.
pub(crate) fn encode_jpeg(
    pixels: &[u8],
    width: u32,
    height: u32,
    color: image::ExtendedColorType,
    quality: u8,
) -> Vec<u8> {
    let mut out = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut Cursor::new(&mut out), quality)
        .encode(pixels, width, height, color)
        .expect("in-memory JPEG encoding of a valid buffer");
    out
}

/// The largest width or height [`write_image_folder`] makes: 8192 (a 192 MiB RGB buffer while
/// encoding). Larger sizes are refused before anything is allocated or written.
pub const MAX_SIDE: u32 = 8192;

/// Writes `bytes` as `root/key`: into a new temporary file beside it, then renamed over it. So a
/// link already at that name is replaced, never written through, and a file is never seen half
/// written. A class directory that is a link is refused: what it points at is not ours to fill.
fn write(root: &Path, key: &str, bytes: &[u8]) -> Result<()> {
    let path = root.join(key);
    let parent = path.parent().expect("a key names a file below root");
    match fs::symlink_metadata(parent) {
        Ok(meta) if !meta.is_dir() => return Err(not_a_class_dir(parent)),
        Ok(_) => {}
        Err(_) => fs::create_dir_all(parent).at(parent)?,
    }
    let name = path.file_name().expect("a key names a file");
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    // Not synced: a synthetic tree is regenerated, not recovered, after a crash.
    crate::file::replace_via(&parent.join(tmp_name), &path, bytes, false)
}

fn not_a_class_dir(path: &Path) -> Error {
    Error::BadImageFolder {
        path: path.to_path_buf(),
        reason: "a class directory is needed here, and this is a link or a file; the synthetic \
                 tree is written only into directories of its own"
            .into(),
    }
}

/// The most classes a synthetic tree holds: as many as a dataset may have (the loader's
/// `dataset::MAX_CLASSES`, a module of the same layer; a test checks they agree).
pub const MAX_CLASSES: usize = 1 << 20;

/// The most images a synthetic tree holds (a billion files is already past what a file system
/// lists in a reasonable time).
pub const MAX_IMAGES: usize = 1 << 32;

/// Writes the tree described by `spec` under `root` (created if needed). A file already at one
/// of the names written is replaced (a link there is replaced by the file, never followed);
/// nothing else in `root` is touched. Refuses, before writing anything, an empty spec, more
/// than [`MAX_CLASSES`] classes or [`MAX_IMAGES`] images, a side
/// longer than [`MAX_SIDE`], and a class directory that exists as a link or a file.
pub fn write_image_folder(root: impl AsRef<Path>, spec: &SyntheticSpec) -> Result<SyntheticTree> {
    let root = root.as_ref();
    if spec.classes == 0 || spec.per_class == 0 || spec.width == 0 || spec.height == 0 {
        return Err(Error::BadImageFolder {
            path: root.to_path_buf(),
            reason:
                "synthetic spec needs at least one class, one image per class and a non-zero size"
                    .into(),
        });
    }
    // Checked before the class names are made: a hostile try asked for 10^9 classes and the
    // list of names alone (24 GB) aborted the process.
    if spec.classes > MAX_CLASSES {
        return Err(Error::BadImageFolder {
            path: root.to_path_buf(),
            reason: format!(
                "at most {MAX_CLASSES} classes (what a dataset may have); asked for {}",
                spec.classes
            ),
        });
    }
    if spec
        .classes
        .checked_mul(spec.per_class)
        .is_none_or(|n| n > MAX_IMAGES)
    {
        return Err(Error::BadImageFolder {
            path: root.to_path_buf(),
            reason: format!(
                "at most {MAX_IMAGES} images; asked for {} classes of {}",
                spec.classes, spec.per_class
            ),
        });
    }
    if spec.width > MAX_SIDE || spec.height > MAX_SIDE {
        return Err(Error::BadImageFolder {
            path: root.to_path_buf(),
            reason: format!(
                "synthetic images are at most {MAX_SIDE}x{MAX_SIDE}; asked for {}x{}",
                spec.width, spec.height
            ),
        });
    }
    if spec.edge_cases && spec.classes < 2 {
        return Err(Error::BadImageFolder {
            path: root.to_path_buf(),
            reason: "edge cases need at least 2 classes".into(),
        });
    }
    let classes: Vec<String> = (0..spec.classes).map(|c| format!("class{c:02}")).collect();
    for class in &classes {
        let dir = root.join(class);
        if fs::symlink_metadata(&dir).is_ok_and(|meta| !meta.is_dir()) {
            return Err(not_a_class_dir(&dir));
        }
    }
    for (c, class) in classes.iter().enumerate() {
        for i in 0..spec.per_class {
            let pixels = synthetic_pixels(spec, c, i);
            let jpeg = encode_jpeg(
                &pixels,
                spec.width,
                spec.height,
                image::ExtendedColorType::Rgb8,
                spec.quality,
            );
            write(root, &format!("{class}/img{i:05}.jpg"), &jpeg)?;
        }
    }
    let edge_cases = if spec.edge_cases {
        write_edge_cases(root, spec, &classes[0], &classes[1])?
    } else {
        Vec::new()
    };
    Ok(SyntheticTree {
        image_files: spec.classes * spec.per_class + edge_cases.len(),
        classes,
        edge_cases,
    })
}

fn write_edge_cases(
    root: &Path,
    spec: &SyntheticSpec,
    good: &str,
    bad: &str,
) -> Result<Vec<EdgeCase>> {
    let (w, h) = (spec.width, spec.height);
    let rgb = synthetic_pixels(spec, 0, 1_000_000);
    let normal = encode_jpeg(&rgb, w, h, image::ExtendedColorType::Rgb8, spec.quality);
    let mut cases = Vec::new();
    let mut add = |key: String, bytes: &[u8], valid: bool, what: &'static str| -> Result<()> {
        write(root, &key, bytes)?;
        cases.push(EdgeCase { key, valid, what });
        Ok(())
    };

    // Valid files in unusual encodings: each must come out as w×h RGB.
    let gray: Vec<u8> = rgb
        .chunks(3)
        .map(|p| ((p[0] as u32 + p[1] as u32 + p[2] as u32) / 3) as u8)
        .collect();
    add(
        format!("{good}/edge-grayscale.jpg"),
        &encode_jpeg(&gray, w, h, image::ExtendedColorType::L8, spec.quality),
        true,
        "grayscale JPEG",
    )?;
    add(
        format!("{good}/edge-cmyk.jpg"),
        &cmyk_jpeg(&rgb, w, h, spec.quality)?,
        true,
        "CMYK JPEG (Adobe)",
    )?;
    add(
        format!("{good}/edge-progressive.JPEG"),
        &turbo_jpeg(&rgb, w, h, spec.quality, true)?,
        true,
        "progressive JPEG, upper-case extension",
    )?;
    let rgba: Vec<u8> = rgb
        .chunks(3)
        .flat_map(|p| [p[0], p[1], p[2], 128])
        .collect();
    let mut png = Vec::new();
    image::write_buffer_with_format(
        &mut Cursor::new(&mut png),
        &rgba,
        w,
        h,
        image::ExtendedColorType::Rgba8,
        image::ImageFormat::Png,
    )
    .expect("in-memory PNG encoding of a valid buffer");
    add(
        format!("{good}/edge-alpha.png"),
        &png,
        true,
        "PNG with alpha channel",
    )?;

    // Broken files: each must be rejected with its path and a reason.
    add(
        format!("{bad}/bad-truncated.jpg"),
        &normal[..normal.len() / 2],
        false,
        "truncated JPEG",
    )?;
    add(format!("{bad}/bad-empty.jpg"), b"", false, "zero-byte file")?;
    add(
        format!("{bad}/bad-text.jpg"),
        b"this is a text file with a .jpg name\n",
        false,
        "text file named .jpg",
    )?;
    add(
        format!("{bad}/bad-bomb.jpg"),
        &claim_size(&normal, 60000, 60000),
        false,
        "JPEG header claiming 60000x60000",
    )?;
    // Not an image extension: skipped by the scan, not rejected.
    write(
        root,
        &format!("{bad}/notes.txt"),
        b"not an image; ImageFolder skips this file\n",
    )?;
    Ok(cases)
}

/// Re-encodes `rgb` through libjpeg-turbo (4:4:4, optionally progressive).
fn turbo_jpeg(rgb: &[u8], w: u32, h: u32, quality: u8, progressive: bool) -> Result<Vec<u8>> {
    let mut encoder = JpegEncoder::new(quality, ChromaSubsampling::Full).map_err(jpeg_err)?;
    encoder.set_progressive(progressive).map_err(jpeg_err)?;
    encoder.encode_rgb(rgb, w, h).map_err(jpeg_err)
}

/// A CMYK JPEG whose Adobe-inverted values convert back to (about) `rgb`: K = max(r, g, b) and
/// C = r·255/K, so that `c·k/255 ≈ r`, which is how PIL (and our decoder) read them.
fn cmyk_jpeg(rgb: &[u8], w: u32, h: u32, quality: u8) -> Result<Vec<u8>> {
    let cmyk: Vec<u8> = rgb
        .chunks(3)
        .flat_map(|p| {
            let k = p.iter().copied().max().unwrap_or(0).max(1) as u32;
            let c = |v: u8| ((v as u32 * 255 + k / 2) / k).min(255) as u8;
            [c(p[0]), c(p[1]), c(p[2]), k as u8]
        })
        .collect();
    JpegEncoder::new(quality, ChromaSubsampling::Full)
        .and_then(|mut encoder| encoder.encode_cmyk(&cmyk, w, h))
        .map_err(jpeg_err)
}

fn jpeg_err(e: EncodeError) -> Error {
    Error::io("<synthetic JPEG>", std::io::Error::other(e.to_string()))
}

/// Rewrites the frame header (SOF0/SOF2) of `jpeg` to declare `width × height`.
fn claim_size(jpeg: &[u8], width: u16, height: u16) -> Vec<u8> {
    let mut out = jpeg.to_vec();
    let sof = out
        .windows(2)
        .position(|m| m[0] == 0xFF && (m[1] == 0xC0 || m[1] == 0xC2))
        .expect("an encoded JPEG has a frame header");
    // FFCx | length (2) | precision (1) | height (2) | width (2)
    out[sof + 5..sof + 7].copy_from_slice(&height.to_be_bytes());
    out[sof + 7..sof + 9].copy_from_slice(&width.to_be_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pixels_depend_only_on_the_spec() {
        let spec = SyntheticSpec::default();
        assert_eq!(synthetic_pixels(&spec, 3, 7), synthetic_pixels(&spec, 3, 7));
        assert_ne!(synthetic_pixels(&spec, 3, 7), synthetic_pixels(&spec, 3, 8));
        assert_ne!(synthetic_pixels(&spec, 3, 7), synthetic_pixels(&spec, 4, 7));
        let other = SyntheticSpec {
            seed: 1,
            ..spec.clone()
        };
        assert_ne!(
            synthetic_pixels(&spec, 3, 7),
            synthetic_pixels(&other, 3, 7)
        );
    }

    #[test]
    fn claimed_size_is_what_the_header_says() {
        let spec = SyntheticSpec::default();
        let jpeg = encode_jpeg(
            &synthetic_pixels(&spec, 0, 0),
            64,
            48,
            image::ExtendedColorType::Rgb8,
            90,
        );
        let header = turbojpeg::read_header(&claim_size(&jpeg, 60000, 50000)).unwrap();
        assert_eq!((header.width, header.height), (60000, 50000));
    }
}
