//! Entry points for coverage-guided fuzzing (feature `fuzzing`; see `fuzz/` and TESTING.md).
//!
//! One function per parser that reads untrusted bytes. Each takes arbitrary bytes, runs the
//! parser the way the library does, and checks what the result promises: it returns normally
//! for every input whose result is `Ok` or a typed `Err`, and panics when an invariant breaks
//! (a range outside the input, a scan that skips bytes, a decoder that decodes a good image
//! differently after a bad one). A panic, an abort from the fuzz harness's allocation bound, or
//! a hang is a finding. [`TARGETS`] lists them by name for the fuzz binary and the corpus replay
//! test.
//!
//! Decoding here uses [`FUZZ_MAX_PIXELS`], so that no input can legitimately need more than a few
//! tens of MiB; the harness aborts on larger allocations.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::decode::{CropPlan, Decoder, RawImage};
use crate::format::shared_headers::{
    HeaderDictionary, SharedHeaders, encode_header, join, stored_value_checksum,
};
use crate::format::{example, hdf5 as h5fmt, lmdb, pickle, tfrecord, webdataset};
use crate::geometry::Rect;
use crate::rng::SampleRng;
use crate::transform::{SampleTransformer, Transform};
use image::ImageEncoder as _;

use crate::Dataset;

/// The decoders' pixel limit under fuzzing: 4 MP, a 12 MiB RGB image.
pub const FUZZ_MAX_PIXELS: u64 = 1 << 22;

/// A fuzz target: arbitrary bytes in, a panic on a broken promise.
pub type Target = fn(&[u8]);

/// Every target, by name.
pub const TARGETS: &[(&str, Target)] = &[
    ("pickle", pickle_value),
    ("tf_example", tf_example),
    ("tfrecord_shard", tfrecord_shard),
    ("records_index", records_index),
    ("records_dataset", records_dataset),
    ("lmdb_file", lmdb_file),
    ("webdataset_shard", webdataset_shard),
    ("mds_dataset", mds_dataset),
    ("lmdb_value", lmdb_value),
    ("lmdb_meta", lmdb_meta),
    ("shared_headers", shared_headers),
    #[cfg(feature = "hdf5")]
    ("hdf5_dataset", hdf5_dataset),
    #[cfg(feature = "hdf5")]
    ("hdf5_staged_index", hdf5_staged_index),
    #[cfg(feature = "hdf5")]
    ("hdf5_global_heap", hdf5_global_heap),
    ("raw_payload", raw_payload),
    ("decode", decode),
    ("stack", stack),
    ("transform", transform),
];

/// The target called `name`.
pub fn target(name: &str) -> Option<Target> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}

/// Reads fuzz input as a sequence of fields; missing bytes read as zero / empty.
struct Fields<'a> {
    rest: &'a [u8],
}

impl<'a> Fields<'a> {
    #[cfg_attr(not(feature = "hdf5"), allow(dead_code))]
    fn u8(&mut self) -> u8 {
        self.bytes(1).first().copied().unwrap_or(0)
    }

    fn u16(&mut self) -> u16 {
        let b = self.bytes(2);
        let mut a = [0u8; 2];
        a[..b.len()].copy_from_slice(b);
        u16::from_le_bytes(a)
    }

    fn u64(&mut self) -> u64 {
        let b = self.bytes(8);
        let mut a = [0u8; 8];
        a[..b.len()].copy_from_slice(b);
        u64::from_le_bytes(a)
    }

    /// Up to `n` bytes.
    fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (head, tail) = self.rest.split_at(n.min(self.rest.len()));
        self.rest = tail;
        head
    }

    /// A field of up to 65535 bytes, prefixed by its length.
    fn field(&mut self) -> &'a [u8] {
        let n = self.u16() as usize;
        self.bytes(n)
    }
}

/// The pickle reader (Python `folder2lmdb` values).
pub fn pickle_value(data: &[u8]) {
    let _ = pickle::parse(data);
    match pickle::image_and_label(data) {
        Ok((pickle::Image::Stored(image), _label)) => {
            assert!(image.start <= image.end && image.end <= data.len());
        }
        // A decoded image is never larger than the text it was decoded from.
        Ok((pickle::Image::Decoded(image), _label)) => assert!(image.len() <= data.len()),
        Err(_) => {}
    }
}

/// The `tf.train.Example` parser and the feature lookups the TFRecord reader makes.
pub fn tf_example(data: &[u8]) {
    if let Ok(features) = example::parse(data) {
        if let Ok(bytes) = example::bytes(&features, "image/encoded") {
            assert!(inside(data, bytes));
        }
        let _ = example::int64(&features, "image/class/label");
    }
}

/// True when `part` lies within `whole` (a zero-copy parser returned a view of its input).
fn inside(whole: &[u8], part: &[u8]) -> bool {
    let (start, end) = (
        whole.as_ptr() as usize,
        whole.as_ptr() as usize + whole.len(),
    );
    let p = part.as_ptr() as usize;
    part.is_empty() || (p >= start && p + part.len() <= end)
}

/// TFRecord framing: the shard scan that builds a missing index, and unframing one record.
pub fn tfrecord_shard(data: &[u8]) {
    let scan = tfrecord::scan_shard(data);
    let mut end = 0u64;
    for (number, &(offset, len)) in scan.records.iter().enumerate() {
        assert_eq!(offset, end, "the scan skipped or repeated bytes");
        assert!(len > 0, "an empty entry");
        end = offset + len;
        let frame = &data[offset as usize..end as usize];
        let damaged = scan.damaged.iter().any(|(n, _)| *n == number);
        if !damaged {
            // A frame whose header checks out is a record, whatever its data: a bad data CRC is
            // that record's error when it is read, not damage to the scan.
            let declared = u64::from_le_bytes(frame[..8].try_into().expect("a header"));
            assert_eq!(
                declared + 16,
                len,
                "a record whose length is not its header's"
            );
            match tfrecord::unframe(frame) {
                Ok(payload) => assert!(inside(frame, payload)),
                Err(e) => assert!(e.contains("data's CRC"), "{e}"),
            }
        }
    }
    assert_eq!(end, data.len() as u64, "the scan does not cover the shard");
    if let Ok(payload) = tfrecord::unframe(data) {
        assert!(inside(data, payload));
    }
}

/// A records index file (`<offset> <length>` lines) and the check that it covers its shard.
pub fn records_index(data: &[u8]) {
    let mut fields = Fields { rest: data };
    let shard_len = fields.u64();
    let path = Path::new("fuzz.index");
    if let Ok(entries) = tfrecord::parse_index(path, fields.rest)
        && let Ok(end) = tfrecord::check_index_covers(path, &entries, shard_len)
    {
        assert!(end >= shard_len);
    }
}

/// A scratch directory for file-level targets, one per process, on a RAM disk when there is one.
/// It is left behind when the process ends (a fuzzer kills its targets): `make fuzz` removes
/// them.
fn scratch_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = Path::new("/dev/shm");
        let base = if base.is_dir() {
            base.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("imagefeed-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating the fuzz scratch directory");
        dir
    })
}

/// Removes this process's scratch directory (the replay test calls it when done).
pub fn remove_scratch_dir() {
    let _ = std::fs::remove_dir_all(scratch_dir());
}

/// A fresh, empty directory `name` under the scratch directory, one per thread (the replay
/// test runs targets on several).
fn fresh_dir(name: &str) -> PathBuf {
    let thread = format!("{:?}", std::thread::current().id());
    let thread: String = thread.chars().filter(char::is_ascii_digit).collect();
    let dir = scratch_dir().join(format!("{name}-{thread}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creating a fuzz directory");
    dir
}

static RECORDS_DECODED: AtomicUsize = AtomicUsize::new(0);

/// How many records the file-level targets (`records_dataset`, `hdf5_dataset`, `lmdb_file`,
/// `webdataset_shard`, `mds_dataset`) have read and
/// decoded in this process: how the replay test checks that their seeds are real datasets that
/// reach the record path, not inputs refused at the door.
pub fn records_decoded() -> usize {
    RECORDS_DECODED.load(Ordering::Relaxed)
}

/// Reads every record of `dataset` and decodes each, as the loader would: every record is `Ok`
/// or a typed error.
fn read_everything(dataset: &dyn Dataset) {
    let Ok(mut reader) = dataset.open_reader() else {
        return;
    };
    let mut decoder = Decoder::new().with_max_pixels(FUZZ_MAX_PIXELS);
    let mut pixels = Vec::new();
    for index in 0..dataset.len().min(1024) {
        if let Ok(record) = reader.read(index) {
            assert_eq!(record.index, index);
            if decoder.decode_rgb(record.payload, &mut pixels).is_ok() {
                RECORDS_DECODED.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Opens `path` as [`crate::format::open`] finds it and, if it opens, reads it through
/// ([`read_everything`]).
fn open_and_read(path: &Path) {
    if let Ok(dataset) = crate::format::open(path) {
        read_everything(dataset.as_ref());
    }
}

/// A whole records dataset: a manifest, one index and one shard, each taken from the input
/// (`u16 length | manifest JSON | u16 length | index text | shard bytes`), opened and read.
pub fn records_dataset(data: &[u8]) {
    let mut fields = Fields { rest: data };
    let manifest = fields.field();
    let index = fields.field();
    let shard = fields.rest;
    let dir = fresh_dir("records");
    std::fs::write(dir.join(tfrecord::MANIFEST), manifest).expect("writing the manifest");
    std::fs::write(dir.join("s.index"), index).expect("writing the index");
    std::fs::write(dir.join("s.tfrecord"), shard).expect("writing the shard");
    if let Ok(dataset) = tfrecord::Records::open(&dir) {
        read_everything(&dataset);
    }
}

/// A whole LMDB file (ours of either layout, or another tool's such as folder2lmdb), the input
/// byte for byte, opened as `open` finds it and read: the file's structure (meta pages, page
/// headers, the B-trees the open's check walks, the nodes liblmdb then reads) is what is
/// fuzzed. A structure the check lets through must never reach liblmdb as a page it
/// misreads (a SIGSEGV or SIGBUS is a crash, a loop a hang).
pub fn lmdb_file(data: &[u8]) {
    let path = fresh_dir("lmdb").join("d.lmdb");
    std::fs::write(&path, data).expect("writing the LMDB file");
    open_and_read(&path);
}

/// One WebDataset shard (a tar file), the input byte for byte, opened and read: tar headers
/// (sizes, names, checksums, long names, end blocks) and how members group into samples.
pub fn webdataset_shard(data: &[u8]) {
    let path = fresh_dir("webdataset").join("shard-000000.tar");
    std::fs::write(&path, data).expect("writing the shard");
    open_and_read(&path);
}

/// A Mosaic MDS dataset of one shard (`u16 length | index.json | shard.00000.mds bytes`),
/// opened and read: the index's JSON against the shard, and the shard's sample offsets and
/// column sizes.
pub fn mds_dataset(data: &[u8]) {
    let mut fields = Fields { rest: data };
    let index = fields.field();
    let shard = fields.rest;
    let dir = fresh_dir("mds");
    std::fs::write(dir.join("index.json"), index).expect("writing the index");
    std::fs::write(dir.join("shard.00000.mds"), shard).expect("writing the shard");
    open_and_read(&dir);
}

/// A sample value of an imagefeed LMDB (`label | key length | key | payload`).
pub fn lmdb_value(data: &[u8]) {
    if let Ok((_label, key, payload)) = lmdb::decode_value(data) {
        assert!(inside(data, key.as_bytes()) && inside(data, payload));
        assert_eq!(8 + key.len() + payload.len(), data.len());
    }
}

/// Shared JPEG headers (`pack-dataset --shared-headers`): payloads
/// (`u16 length | payload`, repeated) stored through one dictionary come back byte for byte
/// from the headers it stored; the input read as stored headers and payloads
/// (`u8 count | count × (u16 length | header) | stored payload...`) joins or fails, never
/// panics.
pub fn shared_headers(data: &[u8]) {
    let mut fields = Fields { rest: data };
    let mut dictionary = HeaderDictionary::default();
    let (mut stored, mut headers) = (Vec::new(), Vec::new());
    let mut payloads = Vec::new();
    while !fields.rest.is_empty() {
        let payload = fields.field();
        let mut out = Vec::new();
        let encoded = dictionary.encode(payload, &mut out);
        let header = &payload[..encoded.header_len];
        if encoded.added {
            assert_eq!(
                encoded.reference as usize,
                headers.len() + 1,
                "ids are dense"
            );
            let mut entry = Vec::new();
            encode_header(encoded.reference, header, &mut entry);
            headers.push(entry);
        }
        let sum = stored_value_checksum(&out, (encoded.reference != 0).then_some(header));
        stored.push((out, sum));
        payloads.push(payload);
    }
    let reader = SharedHeaders::from_stored(headers.iter().map(Vec::as_slice));
    let mut joined = Vec::new();
    for (payload, (stored, sum)) in payloads.iter().zip(&stored) {
        let (header, rest) = reader.split(stored).expect("a header the pack stored");
        assert_eq!(stored_value_checksum(stored, header), *sum);
        assert_eq!(join(header, rest, &mut joined), *payload);
    }

    let mut fields = Fields { rest: data };
    let count = fields.u8();
    let headers: Vec<&[u8]> = (0..count).map(|_| fields.field()).collect();
    let reader = SharedHeaders::from_stored(headers);
    while !fields.rest.is_empty() {
        let stored = fields.field();
        if let Ok((header, rest)) = reader.split(stored) {
            assert!(inside(stored, rest) && rest.len() + 4 == stored.len());
            let joined = join(header, rest, &mut joined);
            assert!(joined.ends_with(rest));
            assert_eq!(joined.len(), rest.len() + header.map_or(0, <[u8]>::len));
        }
    }
}

/// An LMDB file's meta page (the length check that prevents SIGBUS on a cut file) and the JSON
/// records in the `meta` database: `info`, `pack-progress`, `pack-plan`
/// (`152-byte page | u16 length | info | u16 length | progress | plan`).
pub fn lmdb_meta(data: &[u8]) {
    let mut fields = Fields { rest: data };
    let page = fields.bytes(lmdb::META_PAGE_BYTES);
    if let Some(meta) = lmdb::LmdbMeta::parse(page) {
        let _ = meta.needed_len();
    }
    let path = Path::new("fuzz.lmdb");
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    let info = text(fields.field());
    let progress = text(fields.field());
    let plan = text(fields.rest);
    let _ = lmdb::parse_info(path, &info);
    let _ = lmdb::parse_progress(path, &progress);
    let _ = lmdb::parse_plan(path, &plan);
}

/// An imagefeed HDF5 file whose attribute, offsets, labels, keys and image bytes come from the
/// input; opened and read. The HDF5 library writes a well-formed file: what is fuzzed is our
/// reading of what it holds (the attribute JSON, offsets against the data, labels against the
/// classes, key text).
#[cfg(feature = "hdf5")]
pub fn hdf5_dataset(data: &[u8]) {
    let mut fields = Fields { rest: data };
    let json = fields.field();
    let count = fields.u8() as usize;
    let offsets: Vec<u64> = (0..count).map(|_| fields.u64() % (1 << 20)).collect();
    let labels: Vec<i64> = (0..fields.u8()).map(|_| fields.u64() as i64).collect();
    let keys: Vec<Vec<u8>> = (0..fields.u8())
        .map(|_| {
            let n = fields.u8() as usize;
            fields.bytes(n).to_vec()
        })
        .collect();
    // 0: no checksums (layout version 1); 1: the right ones, so reads get past the check;
    // anything else: checksums taken from the input.
    let checksum_mode = fields.u8();
    let raw_sums: Vec<u32> = (0..keys.len()).map(|_| fields.u64() as u32).collect();
    let images = fields.rest;
    let checksums: Option<Vec<u32>> = match checksum_mode {
        0 => None,
        1 => Some(
            (0..keys.len())
                .map(|i| {
                    let payload = offsets
                        .get(i..i + 2)
                        .and_then(|o| images.get(o[0] as usize..o[1] as usize))
                        .unwrap_or_default();
                    let key = String::from_utf8_lossy(&keys[i]).replace('\0', "\u{FFFD}");
                    let label = labels.get(i).copied().unwrap_or(0) as u32;
                    crate::format::record_checksum(label, &key, payload)
                })
                .collect(),
        ),
        _ => Some(raw_sums),
    };
    let dir = fresh_dir("hdf5");
    let path = dir.join("d.h5");
    let written = h5fmt::write_raw_parts(
        &path,
        json,
        &offsets,
        &labels,
        &keys,
        images,
        checksums.as_deref(),
    );
    if written.is_err() {
        return;
    }
    if let Ok(dataset) = h5fmt::Hdf5::open(&path) {
        read_everything(&dataset);
    }
}

/// The HDF5 writer's staged index (`index.bin`), read back on resume and at the end of a pack.
#[cfg(feature = "hdf5")]
pub fn hdf5_staged_index(data: &[u8]) {
    if let Ok((ends, labels, keys)) = h5fmt::parse_staged_index(data) {
        assert!(ends.len() == labels.len() && labels.len() == keys.len());
    }
}

/// A global heap collection, where h5py's variable-length elements lie, read by the checked
/// reader that replaced libhdf5 for them: a selector for the file's size of lengths, the object
/// index and length a descriptor names, then the collection's bytes (written as a file).
#[cfg(feature = "hdf5")]
pub fn hdf5_global_heap(data: &[u8]) {
    let mut fields = Fields { rest: data };
    let selector = fields.u8();
    let object = u32::from(fields.u16());
    let len = u32::from(fields.u16());
    let path = fresh_dir("heap").join("heap.bin");
    h5fmt::fuzz_global_heap(&path, selector, object, len, fields.rest);
}

/// The raw-RGB payload header, and the file-length bound taken from a file's first bytes.
pub fn raw_payload(data: &[u8]) {
    if let Ok((w, h, pixels)) = RawImage::parse(data) {
        assert_eq!(pixels.len() as u64, u64::from(w) * u64::from(h) * 3);
        assert!(inside(data, pixels));
    }
    if let Ok(bound) = crate::decode::max_file_len(data) {
        assert!(!bound.what.is_empty());
    }
}

/// A good JPEG and its pixels decoded by a fresh decoder: the reference every target's decoder
/// must still reproduce after whatever input it saw.
fn reference() -> &'static (Vec<u8>, Vec<u8>) {
    static REFERENCE: OnceLock<(Vec<u8>, Vec<u8>)> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let jpeg = crate::synthetic::sample_jpeg(40, 32);
        let mut pixels = Vec::new();
        Decoder::new()
            .decode_rgb(&jpeg, &mut pixels)
            .expect("the reference JPEG decodes");
        (jpeg, pixels)
    })
}

/// The decoder entry points, with the pixel limit: header, validate, full decode, a crop
/// decode (crop and output size taken from the input's last bytes), then a good JPEG through
/// the same decoder, which must come out exactly as from a fresh one (no poisoned state).
pub fn decode(data: &[u8]) {
    let mut decoder = Decoder::new().with_max_pixels(FUZZ_MAX_PIXELS);
    let header = decoder.header(data);
    let validated = decoder.validate(data);
    if validated.is_ok() {
        assert!(header.is_ok(), "validate accepted what header refused");
    }
    let mut out = Vec::new();
    if let Ok(h) = decoder.decode_rgb(data, &mut out) {
        assert_eq!(out.len(), h.rgb_len());
        assert!(h.width as u64 * h.height as u64 <= FUZZ_MAX_PIXELS);
    }
    let tail = &data[data.len().saturating_sub(6)..];
    let byte = |i: usize| tail.get(i).copied().unwrap_or(1) as f64;
    let _ = decoder.decode_crop(data, &mut out, |h| {
        let (w, hgt) = (h.width as f64, h.height as f64);
        Some(CropPlan {
            crop: Rect {
                left: w * byte(0) / 255.0 - 8.0,
                top: hgt * byte(1) / 255.0 - 8.0,
                width: (w * byte(2) / 128.0).max(1.0),
                height: (hgt * byte(3) / 128.0).max(1.0),
            },
            out_width: byte(4) as u32 + 1,
            out_height: byte(5) as u32 + 1,
            scaling: match tail.first().map_or(0, |b| b % 3) {
                0 => crate::decode::DctScaling::Antialiased,
                1 => crate::decode::DctScaling::Smallest,
                _ => crate::decode::DctScaling::Off,
            },
        })
    });
    let (jpeg, pixels) = reference();
    decoder
        .decode_rgb(jpeg, &mut out)
        .expect("a good JPEG after the fuzz input");
    assert!(out == *pixels, "the decoder was poisoned by the input");
    // And the other way: the input after a good image decodes as in a fresh decoder (libjpeg
    // keeps tables from image to image).
    let mut fresh = Vec::new();
    let alone = Decoder::new()
        .with_max_pixels(FUZZ_MAX_PIXELS)
        .decode_rgb(data, &mut fresh)
        .is_ok();
    let after = decoder.decode_rgb(data, &mut out).is_ok();
    assert_eq!(
        after, alone,
        "the input decodes differently after another image"
    );
    if alone {
        assert!(
            out == fresh,
            "the input's pixels depend on the image before it"
        );
    }
}

/// Two good 32×32 JPEGs of one encoder (byte-identical headers, other pixels): the input's
/// neighbours in [`stack`].
fn stack_neighbours() -> &'static [Vec<u8>; 2] {
    static NEIGHBOURS: OnceLock<[Vec<u8>; 2]> = OnceLock::new();
    NEIGHBOURS.get_or_init(|| {
        let spec = crate::synthetic::SyntheticSpec {
            width: 32,
            height: 32,
            ..Default::default()
        };
        [(0, 0), (1, 3)].map(|(class, index)| {
            let pixels = crate::synthetic::synthetic_pixels(&spec, class, index);
            crate::synthetic::encode_jpeg(&pixels, 32, 32, image::ExtendedColorType::Rgb8, 90)
        })
    })
}

/// Small JPEGs decoded together (`Decoder::stack_offer`): the input between two good JPEGs
/// with the usual headers, and once more after them, offered to one stack and decoded; each
/// must come out exactly as it decodes alone (its pixels, or an error for each), whatever the
/// input does to the stack.
pub fn stack(data: &[u8]) {
    let [a, b] = stack_neighbours();
    let images = [a.as_slice(), data, b.as_slice(), data];
    let results = Decoder::new()
        .with_max_pixels(FUZZ_MAX_PIXELS)
        .decode_batch_stacked(&images, |_| None);
    for (position, (image, got)) in images.iter().zip(results).enumerate() {
        let mut pixels = Vec::new();
        let alone = Decoder::new()
            .with_max_pixels(FUZZ_MAX_PIXELS)
            .decode_crop(image, &mut pixels, |_| None)
            .map(|c| (c, pixels));
        match (got, alone) {
            (Ok(got), Ok(alone)) => assert!(got == alone, "image {position}: other pixels"),
            (Err(_), Err(_)) => {}
            (got, alone) => panic!(
                "image {position}: stacked ok {}, alone ok {}",
                got.is_ok(),
                alone.is_ok()
            ),
        }
    }
}

/// The loader's per-sample path: decode plus each built-in transform (random resized crop,
/// center crop, flip), seeded from the input.
pub fn transform(data: &[u8]) {
    let mut transformer = SampleTransformer::new(FUZZ_MAX_PIXELS);
    let seed = data.iter().take(8).fold(0u64, |s, &b| s << 8 | b as u64);
    for (i, transform) in [
        Transform::cifar(),
        Transform::imagenet_train(17),
        Transform::imagenet_eval(20, 16),
        Transform::none(),
    ]
    .into_iter()
    .enumerate()
    {
        let mut rng = SampleRng::new(seed, 0, i as u64);
        if let Ok(prepared) = transformer.apply(&transform, data, &mut rng) {
            let (w, h) = (prepared.width as usize, prepared.height as usize);
            assert_eq!(prepared.pixels.len(), w * h * 3);
            if let Some((fw, fh)) = transform.fixed_size() {
                assert_eq!((prepared.width, prepared.height), (fw, fh));
            }
        }
    }
}

/// Starting inputs for target `name`: well-formed examples of what it parses, made with the
/// library's own writers, so that the fuzzer starts from inside each format. Empty for an
/// unknown name.
pub fn seeds(name: &str) -> Vec<Vec<u8>> {
    let jpeg = crate::synthetic::sample_jpeg(24, 16);
    let tiny = crate::synthetic::sample_jpeg(8, 8);
    let raw = RawImage::encode(3, 2, &[7u8; 18]);
    let png = {
        let mut out = Vec::new();
        image::codecs::png::PngEncoder::new(&mut out)
            .write_image(&[9u8; 4 * 3 * 3], 4, 3, image::ExtendedColorType::Rgb8)
            .expect("in-memory PNG");
        out
    };
    let pickled = |image: &[u8], label: i64| {
        let mut out = b"\x80\x04B".to_vec();
        out.extend_from_slice(&(image.len() as u32).to_le_bytes());
        out.extend_from_slice(image);
        out.extend_from_slice(&[0x8a, 8]);
        out.extend_from_slice(&label.to_le_bytes());
        out.extend_from_slice(b"\x86.");
        out
    };
    // (Class "b", label 1 of the `records_dataset` seed's manifest: a records dataset of ours
    // checks each record's class name against its manifest.)
    let example = |image: &[u8], label: i64| {
        let mut out = Vec::new();
        example::encode(
            &mut out,
            &[
                ("image/encoded", example::FeatureValue::Bytes(image)),
                ("image/class/label", example::FeatureValue::Int64(label)),
                ("image/class/synset", example::FeatureValue::Bytes(b"b")),
            ],
        );
        out
    };
    let shard = |payloads: &[&[u8]]| {
        let mut out = Vec::new();
        let mut index = String::new();
        for payload in payloads {
            let start = out.len();
            tfrecord::frame(&mut out, &example(payload, 1));
            index.push_str(&format!("{start} {}\n", out.len() - start));
        }
        (out, index)
    };
    match name {
        "pickle" => vec![
            pickled(&jpeg, 1),
            pickled(b"xy", -5),
            b"\x80\x02]q\x00.".to_vec(),
        ],
        "tf_example" => vec![example(&jpeg, 3), example(b"", 0)],
        "tfrecord_shard" => vec![shard(&[&jpeg, &tiny]).0, shard(&[b"a"]).0],
        "records_index" => {
            let (bytes, index) = shard(&[&jpeg, &tiny]);
            let mut out = (bytes.len() as u64).to_le_bytes().to_vec();
            out.extend_from_slice(index.as_bytes());
            vec![out]
        }
        "records_dataset" => {
            let (bytes, index) = shard(&[&jpeg, &tiny, &raw]);
            let manifest = format!(
                r#"{{"magic":"{}","version":{},"complete":true,"label_base":0,"shards":[{{"file":"s.tfrecord","index":"s.index","records":3,"bytes":{}}}],"format":"records","classes":["a","b"],"num_samples":3,"payload":"encoded"}}"#,
                tfrecord::MAGIC,
                tfrecord::VERSION,
                bytes.len()
            );
            let mut out = Vec::new();
            with_len(&mut out, manifest.as_bytes());
            with_len(&mut out, index.as_bytes());
            out.extend_from_slice(&bytes);
            vec![out]
        }
        "lmdb_file" => lmdb_file_seeds(),
        "webdataset_shard" => {
            let long = format!("{}/n01440764_10026", "deep".repeat(30));
            vec![
                webdataset::tar(&[
                    ("000000.jpg", &jpeg),
                    ("000000.cls", b"1"),
                    ("000001.jpg", &tiny),
                    ("000001.cls", b"0"),
                    ("000001.json", b"{}"),
                ]),
                webdataset::tar(&[
                    (&format!("{long}.png"), &png),
                    (&format!("{long}.cls"), b"2"),
                ]),
                // A second image beside the one read, and a label that is no integer.
                webdataset::tar(&[
                    ("a.seg.png", &png),
                    ("a.jpg", &jpeg),
                    ("a.cls", b"1"),
                    ("b.jpg", &tiny),
                    ("b.cls", b"3.0"),
                ]),
            ]
        }
        "mds_dataset" => vec![mds_seed(), mds_pil_seed()],
        "lmdb_value" => {
            let mut out = Vec::new();
            lmdb::encode_value(&mut out, 1, "class/a.jpg", &jpeg);
            vec![out]
        }
        "lmdb_meta" => vec![lmdb_meta_seed()],
        "shared_headers" => {
            let mut out = Vec::new();
            for payload in [&jpeg[..], &jpeg, &tiny, &tiny, b"no jpeg"] {
                with_len(&mut out, payload);
            }
            vec![out]
        }
        "hdf5_dataset" => hdf5_dataset_seeds(&jpeg, &tiny),
        #[cfg(feature = "hdf5")]
        "hdf5_staged_index" => {
            let mut out = Vec::new();
            for (end, label, key) in [(100u64, 0u32, "a/0.jpg"), (250, 1, "b/1.jpg")] {
                h5fmt::push_staged_entry(&mut out, end, label, key);
            }
            vec![out]
        }
        #[cfg(feature = "hdf5")]
        "hdf5_global_heap" => global_heap_seeds(&jpeg),
        "raw_payload" => vec![raw.clone(), RawImage::encode(1, 1, &[1, 2, 3])],
        "stack" => {
            let [a, b] = stack_neighbours().clone();
            let mut cut = a.clone();
            cut.truncate(a.len() - 40);
            cut.extend_from_slice(&[0xFF, 0xD9]);
            vec![a, b, cut, crate::synthetic::sample_jpeg(32, 32)]
        }
        "decode" | "transform" => {
            let [progressive, cmyk] = crate::synthetic::sample_jpeg_variants(32, 24);
            vec![jpeg, tiny, raw, png, progressive, cmyk]
        }
        _ => Vec::new(),
    }
}

/// Small LMDB files the packer writes, in both layouts (plain, and shared JPEG headers), and a
/// folder2lmdb file Python's `lmdb` package wrote (the compatibility fixture).
fn lmdb_file_seeds() -> Vec<Vec<u8>> {
    use crate::pack::{self, NoProgress, PackFormat, PackOptions};
    let dir = fresh_dir("lmdb-seeds");
    let src = dir.join("src");
    let spec = crate::synthetic::SyntheticSpec {
        classes: 2,
        per_class: 2,
        width: 16,
        height: 8,
        edge_cases: false,
        ..crate::synthetic::SyntheticSpec::default()
    };
    crate::synthetic::write_image_folder(&src, &spec).expect("a synthetic tree");
    let mut seeds: Vec<Vec<u8>> = [false, true]
        .into_iter()
        .map(|shared_headers| {
            let out = dir.join(format!("shared-{shared_headers}.lmdb"));
            let options = PackOptions::default()
                .with_threads(Some(1))
                .with_shared_headers(shared_headers);
            pack::pack_image_folder(&src, &out, PackFormat::Lmdb, &options, &NoProgress)
                .expect("packing the seed");
            std::fs::read(&out).expect("reading the packed seed")
        })
        .collect();
    seeds.push(include_bytes!("../fixtures/compat/folder2lmdb.lmdb").to_vec());
    let _ = std::fs::remove_dir_all(&dir);
    seeds
}

/// A one-shard MDS dataset (`u16 length | index.json | shard`): the first shard of the
/// compatibility fixture (written by Mosaic's `streaming` package: an `int`, a `jpeg` and an
/// `int` column, four samples) with an index naming only it.
fn mds_seed() -> Vec<u8> {
    let shard: &[u8] = include_bytes!("../fixtures/compat/mds/shard.00000.mds");
    let index = format!(
        r#"{{"shards": [{{"column_encodings": ["int", "jpeg", "int"], "column_names": ["i", "x", "y"], "column_sizes": [8, null, 8], "compression": null, "format": "mds", "hashes": [], "raw_data": {{"basename": "shard.00000.mds", "bytes": {}, "hashes": {{}}}}, "samples": 4, "size_limit": 8000, "version": 2, "zip_data": null}}], "version": 2}}"#,
        shard.len()
    );
    let mut out = Vec::new();
    with_len(&mut out, index.as_bytes());
    out.extend_from_slice(shard);
    out
}

/// The `mds-pil` fixture (PIL's raw pixels, RGB and L) in the `mds_dataset` target's layout.
fn mds_pil_seed() -> Vec<u8> {
    let index: &[u8] = include_bytes!("../fixtures/compat/mds-pil/index.json");
    let shard: &[u8] = include_bytes!("../fixtures/compat/mds-pil/shard.00000.mds");
    let mut out = Vec::new();
    with_len(&mut out, index);
    out.extend_from_slice(shard);
    out
}

/// A field with its `u16` length in front (how the composite targets take their parts).
fn with_len(out: &mut Vec<u8>, field: &[u8]) {
    out.extend_from_slice(&(field.len() as u16).to_le_bytes());
    out.extend_from_slice(field);
}

/// A dataset `info.json` of `n` samples in two classes, its magic to be filled in.
fn info(n: usize) -> String {
    format!(
        r#"{{"magic":"MAGIC","version":1,"complete":true,"format":"lmdb","classes":["a","b"],"num_samples":{n},"payload":"encoded"}}"#
    )
}

/// An LMDB meta page, then the info and progress documents the reader checks beside it.
fn lmdb_meta_seed() -> Vec<u8> {
    let mut page = vec![0u8; lmdb::META_PAGE_BYTES];
    page[16..20].copy_from_slice(&0xBEEF_C0DEu32.to_le_bytes());
    page[40..44].copy_from_slice(&4096u32.to_le_bytes());
    page[136..144].copy_from_slice(&3u64.to_le_bytes());
    page[144..152].copy_from_slice(&2u64.to_le_bytes());
    let mut out = page;
    with_len(&mut out, info(2).replace("MAGIC", lmdb::MAGIC).as_bytes());
    with_len(
        &mut out,
        br#"{"files_done":2,"samples_written":2,"rejected":[{"path":"a/x.jpg","reason":"bad"}]}"#,
    );
    out
}

/// Our HDF5 layout's parts (info, offsets, labels, keys, checksums, payloads): layout version 1
/// without checksums, and version 2 with the right ones.
fn hdf5_dataset_seeds(jpeg: &[u8], tiny: &[u8]) -> Vec<Vec<u8>> {
    [(1, 0u8), (2, 1u8)]
        .into_iter()
        .map(|(version, checksum_mode)| {
            let text = info(2)
                .replace("MAGIC", h5fmt::MAGIC)
                .replace("lmdb", "hdf5")
                .replace("\"version\":1", &format!("\"version\":{version}"));
            let mut out = Vec::new();
            with_len(&mut out, text.as_bytes());
            out.push(3);
            for offset in [0u64, jpeg.len() as u64, (jpeg.len() + tiny.len()) as u64] {
                out.extend_from_slice(&offset.to_le_bytes());
            }
            out.push(2);
            out.extend_from_slice(&0u64.to_le_bytes());
            out.extend_from_slice(&1u64.to_le_bytes());
            out.push(2);
            for key in ["a/0.jpg", "b/1.jpg"] {
                out.push(key.len() as u8);
                out.extend_from_slice(key.as_bytes());
            }
            out.push(checksum_mode);
            out.extend_from_slice(&[0; 16]);
            out.extend_from_slice(jpeg);
            out.extend_from_slice(tiny);
            out
        })
        .collect()
}

/// A global heap collection (sizes of lengths 8 or 4) holding the JPEG as object 1 and 3 bytes
/// as object 2, then free space, behind a descriptor naming one of them.
#[cfg(feature = "hdf5")]
fn global_heap_seeds(jpeg: &[u8]) -> Vec<Vec<u8>> {
    let collection = |lengths: usize| {
        let mut c = b"GCOL\x01\0\0\0".to_vec();
        c.extend_from_slice(&4096u64.to_le_bytes()[..lengths]);
        c.resize(c.len().next_multiple_of(8), 0);
        for (index, data) in [(1u16, jpeg), (2, b"abc")] {
            c.extend_from_slice(&index.to_le_bytes());
            c.extend_from_slice(&[1, 0, 0, 0, 0, 0]);
            c.extend_from_slice(&(data.len() as u64).to_le_bytes()[..lengths]);
            c.extend_from_slice(data);
            c.extend(std::iter::repeat_n(
                0,
                data.len().next_multiple_of(8) - data.len(),
            ));
        }
        c.resize(4096, 0);
        c
    };
    let seed = |selector: u8, object: u16, len: usize, lengths: usize| {
        let mut out = vec![selector];
        out.extend_from_slice(&object.to_le_bytes());
        out.extend_from_slice(&(len as u16).to_le_bytes());
        out.extend_from_slice(&collection(lengths));
        out
    };
    vec![
        seed(2, 1, jpeg.len(), 8),
        seed(2, 2, 3, 8),
        seed(1, 2, 3, 4),
    ]
}
