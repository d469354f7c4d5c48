//! Compressed shards: TFRecord shards written with `TFRecordOptions(compression_type="GZIP")`
//! or `"ZLIB"` (the whole file one gzip or zlib stream of ordinary TFRecord frames), and
//! gzipped WebDataset tars (`.tar.gz`, `.tgz`).
//!
//! A shard is recognised as compressed by its content, not its name: a file that does not start
//! the way an uncompressed shard of its format does (a TFRecord frame header with a good CRC, a
//! tar header) but with a gzip member header (`1f 8b`) or a zlib header (CMF/FLG with deflate
//! and a valid check). Neither can start an uncompressed shard by accident: a frame header's
//! length CRC fails for them, and a tar header starts with a file name.
//!
//! A deflate stream cannot be entered in the middle, so random access needs the records
//! decompressed somewhere. They are decompressed once, at open, into the local cache directory
//! ([`crate::cache`]: `IMAGEFEED_CACHE_DIR`, `IMAGEFEED_CACHE_LIMIT`) as a plain shard that is
//! then memory-mapped and read like any other, with the same pixels and labels. The entry's
//! name carries the compressed file's path, inode, size and modification time, so a later open
//! of the same file (another worker process, the next run) maps it without decompressing, and a
//! changed file gets a new one. Decompression runs at about the speed the deflate backend
//! reaches (measured in bench/RESULTS.md); the copy takes the shard's uncompressed size on disk.
//!
//! A stream that is damaged (a bad checksum, cut short, bytes after its end) is decompressed as
//! far as it goes and is never cached: the records it yielded are read, and the rest of the
//! shard is one damaged record that says what went wrong.

use std::fs;
use std::path::Path;

use crate::cache::{Cache, CachedFile};
use crate::error::{Error, IoContext as _, Result};

/// How a shard's bytes are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// One or more gzip members (`compression_type="GZIP"`).
    Gzip,
    /// A zlib stream (`compression_type="ZLIB"`).
    Zlib,
    /// Zstandard frames (Mosaic MDS shards written with `compression="zstd"`; named by the
    /// dataset's index, never sniffed).
    Zstd,
}

impl Compression {
    /// TensorFlow's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Compression::Gzip => "GZIP",
            Compression::Zlib => "ZLIB",
            Compression::Zstd => "zstd",
        }
    }
}

/// How much of a shard's start [`sniff`] is given: enough compressed bytes to inflate a frame
/// header or a tar header from.
pub const SNIFF_BYTES: usize = 4096;

/// The compression of a shard that starts with `head`, or `None` for an uncompressed one or for
/// bytes that are neither (the format's own scan reports those). `starts_plain` tells whether
/// bytes start an uncompressed shard of the format, which takes `plain_len` bytes to tell.
///
/// A gzip or zlib header is not enough: the length field of a plain TFRecord shard's damaged
/// first frame can spell one (376 reads as zlib's `78 01`). So the header must also inflate,
/// and what it inflates to must start the format's shard when there is enough of it to tell.
pub fn sniff(
    head: &[u8],
    starts_plain: impl Fn(&[u8]) -> bool,
    plain_len: usize,
) -> Option<Compression> {
    if starts_plain(head) {
        return None;
    }
    let compression = match head {
        [0x1f, 0x8b, 8, ..] => Compression::Gzip,
        // CMF: deflate (8) with a window of at most 32 KiB; FLG makes CMF·256+FLG a multiple of
        // 31; no preset dictionary (TensorFlow never sets one).
        [cmf, flg, ..]
            if cmf & 0x0f == 8
                && cmf >> 4 <= 7
                && (u16::from(*cmf) << 8 | u16::from(*flg)) % 31 == 0
                && flg & 0x20 == 0 =>
        {
            Compression::Zlib
        }
        _ => return None,
    };
    let mut decoder: Box<dyn std::io::Read + '_> = match compression {
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(head)),
        Compression::Zlib => Box::new(flate2::bufread::ZlibDecoder::new(head)),
        Compression::Zstd => return None,
    };
    let mut out = vec![0u8; plain_len];
    let mut produced = 0;
    let mut failed = false;
    while produced < plain_len {
        match decoder.read(&mut out[produced..]) {
            Ok(0) => break,
            Ok(n) => produced += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // The head ends mid-stream, or the stream is broken (judged below).
            Err(e) => {
                failed = e.kind() != std::io::ErrorKind::UnexpectedEof;
                break;
            }
        }
    }
    let out = &out[..produced];
    if starts_plain(out) {
        return Some(compression);
    }
    // Too little came out to tell by (a short head, an empty shard): compressed unless the
    // stream broke already.
    (!failed && produced < plain_len).then_some(compression)
}

/// A compressed shard made readable: its decompressed copy, and what went wrong when the
/// stream could not be read to its end.
pub struct Decompressed {
    /// The copy, open and held (a cache entry, or an unnamed file for a damaged stream).
    pub file: fs::File,
    /// Where the copy lives, for messages (`None` for the unnamed copy of a damaged stream).
    pub cached_at: Option<std::path::PathBuf>,
    /// Whether this call decompressed the shard (else it found the copy an earlier open made).
    pub fresh: bool,
    /// Why decompression stopped early, with how far it got; `None` when the stream was whole.
    pub damage: Option<Damage>,
}

/// A compressed stream that did not decompress whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage {
    /// Why, with how far decompression got (what a notice says).
    pub reason: String,
    /// How many of the decompressed bytes are as their writer wrote them, as far as the stream
    /// can tell: all that came out of a stream cut short (decoded, only its end missing) or
    /// followed by other bytes; none where its own check failed or its data is corrupt (gzip's
    /// checksum is only checked at the end, and a flipped byte anywhere before it changes what
    /// comes out without another sign: a hostile try's tar read a label changed so as sound).
    pub sound: u64,
}

impl Damage {
    /// Whether bytes up to `end` of the decompressed copy reach past what the stream vouches
    /// for: a record there is not to be read as sound.
    pub fn spoils(&self, end: u64) -> bool {
        end > self.sound
    }
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

/// Why a stream stopped before its end: the decoder's error (its kind tells a stream cut short
/// from a corrupt one), or bytes after a whole stream.
enum Stop {
    Failed(std::io::Error),
    TrailingBytes,
}

/// The cache section decompressed copies go into.
const SECTION: &str = "decompressed";

/// Decompresses the shard `file` (at `path`, compressed as `compression`) into the cache, or
/// finds the copy an earlier open left there.
pub fn decompress(
    path: &Path,
    file: &fs::File,
    compression: Compression,
    cache: &Cache,
) -> Result<Decompressed> {
    decompress_at_most(path, file, compression, cache, None)
}

/// [`decompress`] for a shard whose decompressed size is known (a Mosaic MDS index says it):
/// a stream that yields more than `expected` bytes stops there and is damaged, so a small
/// file that inflates to gigabytes (a decompression bomb) never fills the cache directory.
pub fn decompress_at_most(
    path: &Path,
    file: &fs::File,
    compression: Compression,
    cache: &Cache,
    expected: Option<u64>,
) -> Result<Decompressed> {
    let meta = file.metadata().at(path)?;
    let key = crate::cache::source_key(path, &meta);
    let hint = match expected {
        Some(expected) => Some(expected),
        None => size_hint(file, compression, meta.len()),
    };
    let mut damaged = None;
    let mut fresh = false;
    let cached = cache.get_or_fill(SECTION, &key, hint, |out| {
        fresh = true;
        let out_path = out.path().to_path_buf();
        if let Some(damage) = inflate(path, file, compression, out, &out_path, expected)? {
            // A damaged stream is never cached (the next open must see the damage too), but
            // what it yielded is read: kept in an unnamed file.
            let reason = damage.reason.clone();
            damaged = Some((out.detach()?, damage));
            return Err(Error::NotADataset {
                path: path.to_path_buf(),
                reason,
            });
        }
        Ok(())
    });
    match (cached, damaged) {
        (Ok(CachedFile { path: at, file }), _) => Ok(Decompressed {
            file,
            cached_at: Some(at),
            fresh,
            damage: None,
        }),
        (Err(_), Some((copy, damage))) => Ok(Decompressed {
            file: copy,
            cached_at: None,
            fresh: true,
            damage: Some(damage),
        }),
        (Err(e), None) => Err(e),
    }
}

/// Deflate's greatest expansion: a compressed byte never stands for more than this many.
const MAX_RATIO: u64 = 1032;

/// What the shard will take decompressed, reserved before decompressing: gzip's trailer holds
/// the size modulo 2³² of its last member (exact for the one-member files TensorFlow writes
/// below 4 GiB); otherwise, or when the trailer claims more than deflate can expand to (a
/// damaged trailer), the compressed size. Only a first reservation: the fill reserves more as
/// it writes, and the limit holds whatever the hint said.
fn size_hint(file: &fs::File, compression: Compression, len: u64) -> Option<u64> {
    use std::os::unix::fs::FileExt as _;
    if compression == Compression::Gzip && len >= 18 {
        let mut trailer = [0u8; 4];
        if file.read_exact_at(&mut trailer, len - 4).is_ok() {
            let size = u64::from(u32::from_le_bytes(trailer));
            if size <= len.saturating_mul(MAX_RATIO) {
                return Some(size.max(len));
            }
        }
    }
    Some(len)
}

/// Writes the decompressed stream of `file` into `out`; returns why it stopped early, if it
/// did (the bytes before that point are written). Errors are only those of writing `out`.
fn inflate(
    path: &Path,
    file: &fs::File,
    compression: Compression,
    out: &mut impl std::io::Write,
    out_path: &Path,
    expected: Option<u64>,
) -> Result<Option<Damage>> {
    // A clone shares the file's offset: start from the first byte whatever read it before.
    let mut source = file.try_clone().at(path)?;
    std::io::Seek::seek(&mut source, std::io::SeekFrom::Start(0)).at(path)?;
    let input = std::io::BufReader::with_capacity(1 << 20, source);
    let mut written = 0u64;
    let mut buffer = vec![0u8; 1 << 20];
    // Past the expected size the stream stops (as an error out of `pump`, turned back into
    // damage below): a bomb is not decompressed to its end.
    let too_long = std::cell::Cell::new(false);
    let mut write = |bytes: &[u8]| -> Result<()> {
        if let Some(expected) = expected
            && written + bytes.len() as u64 > expected
        {
            too_long.set(true);
            return Err(Error::not_a_dataset(out_path, "past its expected size"));
        }
        out.write_all(bytes).at(out_path)?;
        written += bytes.len() as u64;
        Ok(())
    };
    let problem = match compression {
        Compression::Gzip => gunzip_members(input, &mut buffer, &mut write),
        Compression::Zlib => {
            let mut decoder = flate2::bufread::ZlibDecoder::new(input);
            match pump(&mut decoder, &mut buffer, &mut write) {
                Ok(None) => {
                    // The zlib stream ended (its checksum checked): anything after it is not
                    // part of it.
                    use std::io::BufRead as _;
                    let mut rest = decoder.into_inner();
                    Ok(match rest.fill_buf() {
                        Ok([]) => None,
                        Ok(_) => Some(Stop::TrailingBytes),
                        Err(e) => Some(Stop::Failed(e)),
                    })
                }
                other => other,
            }
        }
        Compression::Zstd => match zstd::stream::read::Decoder::with_buffer(input) {
            Ok(mut decoder) => pump(&mut decoder, &mut buffer, &mut write),
            Err(e) => Ok(Some(Stop::Failed(e))),
        },
    };
    let name = compression.name();
    let damage = match (problem, expected) {
        (Err(_), Some(expected)) if too_long.get() => Damage {
            reason: format!(
                "the {name} stream decompresses to more than the {expected} bytes its index \
                 says (stopped there): none of it can be trusted"
            ),
            sound: 0,
        },
        (problem, _) => match problem? {
            None => return Ok(None),
            Some(Stop::TrailingBytes) => Damage {
                reason: format!(
                    "bytes follow the end of the {name} stream ({written} decompressed bytes): \
                     left out"
                ),
                sound: written,
            },
            // Cut short: what came out is sound, the rest is missing.
            Some(Stop::Failed(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => Damage {
                reason: format!(
                    "the {name} stream is cut short after {written} decompressed bytes ({e}): \
                     the records after that point cannot be read"
                ),
                sound: written,
            },
            Some(Stop::Failed(e)) => Damage {
                reason: format!(
                    "the {name} stream is damaged ({e}, after {written} decompressed bytes): \
                     any of its bytes may be wrong, so none of its records can be trusted"
                ),
                sound: 0,
            },
        },
    };
    Ok(Some(damage))
}

/// The compression whose magic number `head` starts with, among those no shard is read in
/// (bzip2, xz, zstd, LZ4, 7-Zip, ZIP): for a message that names it rather than call the
/// bytes damage. (Gzip and zlib are [`sniff`]'s.)
pub fn unread_compression(head: &[u8]) -> Option<&'static str> {
    const MAGIC: &[(&[u8], &str)] = &[
        (b"BZh", "bzip2"),
        (b"\xFD7zXZ\x00", "xz"),
        (b"\x28\xB5\x2F\xFD", "zstd"),
        (b"\x04\x22\x4D\x18", "LZ4"),
        (b"7z\xBC\xAF\x27\x1C", "7-Zip"),
        (b"PK\x03\x04", "ZIP"),
    ];
    MAGIC
        .iter()
        .find(|(magic, _)| head.starts_with(magic))
        .map(|(_, name)| *name)
}

/// [`Error::Unsupported`] naming the compression when `head`, the start of the file at
/// `path`, is compressed in a way no shard is read in ([`unread_compression`]); `reads` says
/// what is read instead ("WebDataset shards as tar files, plain or gzipped").
pub fn refuse_unread(path: &Path, head: &[u8], reads: &str) -> Result<()> {
    match unread_compression(head) {
        Some(compression) => Err(Error::Unsupported {
            path: path.to_path_buf(),
            what: format!("its {compression}-compressed data"),
            remedy: format!("imagefeed reads {reads}: decompress it first"),
        }),
        None => Ok(()),
    }
}

/// Every gzip member of `input` in turn through `write`, as gzip and Python's `gzip` read a
/// file: concatenated members are one stream, and zero bytes after a member (a tape's or a
/// writer's block padding) are padding, not a damaged next member (a hostile try's padded shard
/// was reported damaged, though every record read). Returns why the stream stopped early.
fn gunzip_members<R: std::io::BufRead>(
    mut input: R,
    buffer: &mut [u8],
    write: &mut dyn FnMut(&[u8]) -> Result<()>,
) -> Result<Option<Stop>> {
    loop {
        let mut member = flate2::bufread::GzDecoder::new(input);
        if let Some(problem) = pump(&mut member, buffer, write)? {
            return Ok(Some(problem));
        }
        input = member.into_inner();
        loop {
            let rest = match input.fill_buf() {
                Ok(rest) => rest,
                Err(e) => return Ok(Some(Stop::Failed(e))),
            };
            if rest.is_empty() {
                return Ok(None);
            }
            let zeros = rest.iter().take_while(|&&b| b == 0).count();
            if zeros == 0 {
                break; // another member
            }
            input.consume(zeros);
        }
    }
}

/// Copies `reader` through `write` until it ends; a read error is returned as the reason the
/// stream stopped (not an error of this function), a write error as an error.
fn pump(
    reader: &mut dyn std::io::Read,
    buffer: &mut [u8],
    write: &mut dyn FnMut(&[u8]) -> Result<()>,
) -> Result<Option<Stop>> {
    loop {
        match reader.read(buffer) {
            Ok(0) => return Ok(None),
            Ok(n) => write(&buffer[..n])?,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Ok(Some(Stop::Failed(e))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read as _;
    use std::io::Write as _;

    fn shard() -> Vec<u8> {
        let mut bytes = Vec::new();
        for data in [&b"first"[..], b"second record", b"third"] {
            crate::format::tfrecord::frame(&mut bytes, data);
        }
        bytes
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(bytes).unwrap();
        e.finish().unwrap()
    }

    fn zlib(bytes: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
        e.write_all(bytes).unwrap();
        e.finish().unwrap()
    }

    /// As the TFRecord reader asks.
    fn sniff_tfrecord(head: &[u8]) -> Option<Compression> {
        sniff(head, crate::format::tfrecord::starts_with_frame, 12)
    }

    #[test]
    fn compression_is_told_by_content() {
        let plain = shard();
        assert_eq!(sniff_tfrecord(&plain), None);
        assert_eq!(sniff_tfrecord(&gzip(&plain)), Some(Compression::Gzip));
        assert_eq!(sniff_tfrecord(&zlib(&plain)), Some(Compression::Zlib));
        let fast = {
            let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(&plain).unwrap();
            e.finish().unwrap()
        };
        assert_eq!(sniff_tfrecord(&fast), Some(Compression::Zlib));
        assert_eq!(sniff_tfrecord(b""), None);
        assert_eq!(sniff_tfrecord(b"\x1f"), None);
        assert_eq!(sniff_tfrecord(b"hello, world, not a shard"), None);
        // Compressions no shard is read in are named, not taken for damage.
        assert_eq!(unread_compression(b"BZh91AY&SY"), Some("bzip2"));
        assert_eq!(unread_compression(b"\xFD7zXZ\x00\x00"), Some("xz"));
        assert_eq!(unread_compression(&gzip(&plain)), None);
        assert_eq!(unread_compression(&plain), None);
    }

    fn decompressed(compressed: &[u8]) -> (Vec<u8>, Decompressed, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.tfrecord.gz");
        fs::write(&path, compressed).unwrap();
        let cache = Cache::at(dir.path().join("cache"), None);
        let file = fs::File::open(&path).unwrap();
        let kind = sniff_tfrecord(compressed).unwrap();
        let d = decompress(&path, &file, kind, &cache).unwrap();
        let mut bytes = Vec::new();
        let mut file = &d.file;
        std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(0)).unwrap();
        file.read_to_end(&mut bytes).unwrap();
        (bytes, d, dir)
    }

    #[test]
    fn whole_streams_decompress_into_the_cache_once() {
        let plain = shard();
        for compressed in [gzip(&plain), zlib(&plain)] {
            let (bytes, d, dir) = decompressed(&compressed);
            assert_eq!(bytes, plain);
            assert_eq!(d.damage, None);
            let at = d.cached_at.clone().unwrap();
            assert!(at.starts_with(dir.path().join("cache").join(SECTION)));
            // A second open finds the copy.
            let path = dir.path().join("x.tfrecord.gz");
            let cache = Cache::at(dir.path().join("cache"), None);
            let file = fs::File::open(&path).unwrap();
            let kind = sniff_tfrecord(&compressed).unwrap();
            let again = decompress(&path, &file, kind, &cache).unwrap();
            assert_eq!(again.cached_at, Some(at));
            assert!(d.fresh && !again.fresh);
        }
        // Two gzip members read as one stream (concatenated .gz files).
        let mut two = gzip(&plain[..21]);
        two.extend(gzip(&plain[21..]));
        assert_eq!(decompressed(&two).0, plain);
        // Zero padding after a member, between two members too, is no damage (gzip and
        // Python's gzip skip it); anything else after the padding is.
        let mut padded = gzip(&plain[..21]);
        padded.extend([0u8; 700]);
        padded.extend(gzip(&plain[21..]));
        padded.extend([0u8; 1024]);
        let (bytes, d, _dir) = decompressed(&padded);
        assert_eq!((bytes, d.damage), (plain.clone(), None));
        padded.extend_from_slice(b"junk");
        let (bytes, d, _dir) = decompressed(&padded);
        assert_eq!(bytes, plain);
        assert!(d.damage.is_some());
    }

    #[test]
    fn a_damaged_stream_keeps_what_it_yielded_and_says_why() {
        let plain = shard();
        let whole = gzip(&plain);
        let cut = &whole[..whole.len() - 6];
        let (bytes, d, dir) = decompressed(cut);
        assert!(plain.starts_with(&bytes));
        let damage = d.damage.expect("damage reported");
        assert!(
            damage.reason.contains("GZIP stream is cut short"),
            "{damage}"
        );
        // Cut short: what came out is sound.
        assert_eq!(damage.sound, bytes.len() as u64);
        assert_eq!(d.cached_at, None);
        // Nothing of it was cached.
        let left: Vec<_> = fs::read_dir(dir.path().join("cache").join(SECTION))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .filter(|n| !n.to_string_lossy().ends_with(".lock"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
        // A flipped byte in the middle: the CRC check (or the inflater) refuses it.
        let mut flipped = whole.clone();
        let middle = flipped.len() / 2;
        flipped[middle] ^= 0x55;
        let (_, d, _dir) = decompressed(&flipped);
        assert_eq!(d.damage.map(|d| d.sound), Some(0), "nothing of it is sound");
        // The data whole and its checksum wrong: every byte came out, none is vouched for.
        let mut checksum = whole.clone();
        let at = checksum.len() - 8;
        checksum[at] ^= 0xFF;
        let (bytes, d, _dir) = decompressed(&checksum);
        assert_eq!(bytes, plain);
        let damage = d.damage.expect("damage reported");
        assert_eq!(damage.sound, 0);
        assert!(
            damage.reason.contains("none of its records can be trusted"),
            "{damage}"
        );
        // Bytes after a zlib stream.
        let mut trailing = zlib(&plain);
        trailing.extend_from_slice(b"junk");
        let (bytes, d, _dir) = decompressed(&trailing);
        assert_eq!(bytes, plain);
        let damage = d.damage.unwrap();
        assert!(
            damage.reason.contains("follow the end of the ZLIB stream"),
            "{damage}"
        );
        // Its checksum checked, the stream is sound; only the bytes after it are left out.
        assert_eq!(damage.sound, plain.len() as u64);
    }

    /// Decompresses `compressed` into a cache of `limit` bytes.
    fn decompress_limited(
        compressed: &[u8],
        limit: u64,
    ) -> (Result<Decompressed>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.tfrecord.gz");
        fs::write(&path, compressed).unwrap();
        let cache = Cache::at(dir.path().join("cache"), Some(limit));
        let file = fs::File::open(&path).unwrap();
        let kind = sniff_tfrecord(compressed).unwrap();
        (decompress(&path, &file, kind, &cache), dir)
    }

    /// Bytes of every file the cache holds (partial files included).
    fn cached_bytes(dir: &Path) -> u64 {
        fs::read_dir(dir.join("cache").join(SECTION))
            .map(|d| d.flatten().map(|e| e.metadata().unwrap().len()).sum())
            .unwrap_or(0)
    }

    #[test]
    fn the_cache_limit_holds_whatever_the_size_hint_says() {
        // Found by a hostile review: the limit was checked against gzip's trailer only (the
        // size of the last member), so a small last member let 200 MiB into a 10 MiB cache.
        let mut big = Vec::new();
        crate::format::tfrecord::frame(&mut big, &vec![0u8; 4 << 20]);
        let mut understated = gzip(&big);
        understated.extend(gzip(b"tiny"));
        let (result, dir) = decompress_limited(&understated, 1 << 20);
        assert!(
            matches!(result, Err(Error::CacheFull { .. })),
            "{:?}",
            result.err()
        );
        assert_eq!(cached_bytes(dir.path()), 0);
        // A zlib stream (hinted by its compressed size), and a damaged one (kept unnamed).
        let (result, dir) = decompress_limited(&zlib(&big), 1 << 20);
        assert!(matches!(result, Err(Error::CacheFull { .. })));
        assert_eq!(cached_bytes(dir.path()), 0);
        let mut damaged = zlib(&big);
        damaged.extend_from_slice(b"junk");
        let (result, _dir) = decompress_limited(&damaged, 1 << 20);
        assert!(matches!(result, Err(Error::CacheFull { .. })));
        // Under the limit, the same streams read.
        let (result, _dir) = decompress_limited(&understated, 8 << 20);
        let len = result.unwrap().file.metadata().unwrap().len();
        assert_eq!(len, big.len() as u64 + 4);
    }

    #[test]
    fn a_trailer_claiming_more_than_deflate_can_make_is_no_reason_to_refuse() {
        // Found by a hostile review: a flipped trailer claiming 4 GiB failed the open with
        // "no room in the cache" instead of reading the records and reporting the checksum.
        let plain = shard();
        let mut flipped = gzip(&plain);
        let n = flipped.len();
        flipped[n - 4..].copy_from_slice(&[0xf0, 0xff, 0xff, 0xff]);
        let (result, _dir) = decompress_limited(&flipped, 1 << 20);
        let d = result.unwrap();
        assert!(d.damage.is_some());
        let mut bytes = Vec::new();
        let mut file = &d.file;
        std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(0)).unwrap();
        file.read_to_end(&mut bytes).unwrap();
        assert_eq!(bytes, plain);
    }

    #[test]
    fn a_damaged_plain_shard_whose_length_spells_a_header_is_not_compressed() {
        // Found by a hostile review: a plain shard whose first frame's CRC is damaged and whose
        // first record is 376 bytes long (`78 01`: a zlib header) was read as one broken zlib
        // stream instead of skipping the bad frame. 559903 spells gzip's `1f 8b 08`.
        for len in [376usize, 24184, 559_903] {
            let mut bytes = Vec::new();
            crate::format::tfrecord::frame(&mut bytes, &vec![9u8; len]);
            crate::format::tfrecord::frame(&mut bytes, b"second");
            bytes[8] ^= 0xff; // the length's CRC
            assert_eq!(
                sniff_tfrecord(&bytes[..4096.min(bytes.len())]),
                None,
                "{len}"
            );
        }
        // Compressed shards, even empty ones, are still told.
        let plain = shard();
        assert_eq!(sniff_tfrecord(&gzip(&plain)), Some(Compression::Gzip));
        assert_eq!(sniff_tfrecord(&gzip(b"")), Some(Compression::Gzip));
        assert_eq!(sniff_tfrecord(&zlib(b"")), Some(Compression::Zlib));
    }
}
