//! Packing an ImageFolder tree into a dataset file: the work behind `pack-dataset`.
//!
//! The pipeline: scan the tree ([`ImageFolder`]) → read and check files in parallel (rayon), a
//! chunk at a time → hand each chunk, in source order, to the format's writer, which commits it
//! atomically together with a progress record → mark the output complete and rename it into
//! place.
//!
//! Every file is fully decoded once while packing, so a truncated or corrupt image is *rejected*
//! (its path and reason are listed in the summary and the report) instead of being stored for a
//! training run to trip over. Rejection does not stop the run unless [`PackOptions::strict`].
//!
//! Crash safety comes from two rules: the output is built under `OUT.partial` and only renamed
//! to `OUT` once complete, and each chunk is committed with the count of source files consumed.
//! [`StartMode::resume`] picks up from that count; the plan check makes sure a resumed run uses
//! the same source tree and options. Both are the writers' work ([`format::writer`],
//! [`format::output`]): this module reads and checks, and hands them records.
//!
//! [`format::writer`]: crate::format::writer
//! [`format::output`]: crate::format::output

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::MAX_THREADS;
use crate::dataset::{Dataset, PartInfo, PayloadKind, RecordReader, hex};
use crate::decode::{ChromaSubsampling, DEFAULT_MAX_PIXELS, Decoder, JpegEncoder, RawImage};
use crate::error::{Error, IoContext as _, Result};
use crate::format::folder::ImageFolder;
use crate::format::output::{partial_path, write_file_atomically};
use crate::format::parts::JoinedParts;
use crate::format::writer::{
    DatasetWriter, PackPlan, PackProgress, PackedRecord, WriterOptions, start_writer,
};
use crate::format::{lmdb, records};
use crate::resize::{RgbResizer, short_side_size};

// What pack's own signatures use, where they are defined.
pub use crate::format::writer::{PackFormat, Rejection, StartMode};

/// How to pack.
#[derive(Debug, Clone)]
pub struct PackOptions {
    /// Shrink images whose shorter side is longer than this (torchvision `Resize` rules) and
    /// re-encode them as JPEG at [`quality`](Self::quality). Smaller images are kept as they are.
    pub resize_short_side: Option<u32>,
    /// JPEG quality for re-encoded images (1..=100).
    pub quality: u8,
    /// Store decoded RGB pixels instead of encoded files, so training skips decoding.
    pub raw: bool,
    /// Fail on the first rejected file, leaving nothing behind.
    pub strict: bool,
    /// Continue an interrupted run, replace, or refuse to touch existing output.
    pub mode: StartMode,
    /// Decompression-bomb limit, in pixels.
    pub max_pixels: u64,
    /// Worker threads for reading and checking (`None`: rayon's default, one per core).
    pub threads: Option<usize>,
    /// Source files per committed chunk.
    pub chunk_size: usize,
    /// LMDB map size (address space reserved for the file).
    pub lmdb_map_size: usize,
    /// Records format: close a shard once it holds this many bytes.
    pub shard_bytes: u64,
    /// Records format: store `label + label_base` (ImageNet TFRecords use 1).
    pub label_base: u32,
    /// Pack only part `.0` of `.1` of the source listing (a job array's share); see
    /// [`PartInfo`] and [`join`].
    pub part: Option<(usize, usize)>,
    /// An output in object storage: where its local staging copy goes (`None`: the cache the
    /// environment names).
    pub cache: Option<crate::cache::Cache>,
    /// An output in object storage: client options over the environment's
    /// ([`RemoteUrl::with_options`](crate::remote::RemoteUrl::with_options)).
    pub storage_options: Vec<(String, String)>,
}

impl PackOptions {
    /// The settings the output's writer takes.
    pub fn writer_options(&self) -> WriterOptions {
        WriterOptions {
            mode: self.mode,
            lmdb_map_size: self.lmdb_map_size,
            shard_bytes: self.shard_bytes,
            label_base: self.label_base,
        }
    }

    /// `Err(Error::Options)` for settings no pack can run with.
    pub fn validate(&self) -> Result<()> {
        let invalid = |m: String| Err(Error::Options(m));
        if let Some(threads) = self.threads
            && !(1..=MAX_THREADS).contains(&threads)
        {
            return invalid(format!("--threads {threads}: must be 1..={MAX_THREADS}"));
        }
        if self.resize_short_side == Some(0) {
            return invalid("--resize 0: the shorter side must be at least 1 pixel".into());
        }
        if !(1..=100).contains(&self.quality) {
            return invalid(format!("--quality {}: must be 1..=100", self.quality));
        }
        if self.max_pixels == 0 {
            return invalid("--max-pixels 0 would reject every image".into());
        }
        if self.shard_bytes == 0 {
            return invalid("--shard-size 0: a shard must hold at least a byte".into());
        }
        Ok(())
    }
}

impl Default for PackOptions {
    fn default() -> Self {
        PackOptions {
            resize_short_side: None,
            quality: 90,
            raw: false,
            strict: false,
            mode: StartMode::default(),
            max_pixels: DEFAULT_MAX_PIXELS,
            threads: None,
            chunk_size: 256,
            lmdb_map_size: lmdb::DEFAULT_MAP_SIZE,
            shard_bytes: records::DEFAULT_SHARD_BYTES,
            label_base: 0,
            part: None,
            cache: None,
            storage_options: Vec::new(),
        }
    }
}

/// Receives progress while packing (the binary draws a progress bar with it).
pub trait PackObserver: Sync {
    /// Called once, with the number of source files and how many a resumed run already did.
    fn started(&self, _total: usize, _already_done: usize) {}
    /// Called after each committed chunk.
    fn advanced(&self, _done: usize, _payload_bytes: u64) {}
    /// Called for each rejected file.
    fn rejected(&self, _rejection: &Rejection) {}
    /// Asked after each committed chunk: `true` stops the pack there with
    /// [`Error::Interrupted`], leaving the partial output for a `resume` run (a user pressed
    /// Ctrl-C). The default never stops.
    fn should_stop(&self) -> bool {
        false
    }
}

/// An observer that ignores everything.
pub struct NoProgress;
impl PackObserver for NoProgress {}

/// The outcome of a pack, also written as JSON to [`report_path`]`(out)`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PackSummary {
    /// Source root.
    #[serde(serialize_with = "crate::file::serialize_lossy")]
    pub source: PathBuf,
    /// Output path.
    #[serde(serialize_with = "crate::file::serialize_lossy")]
    pub output: PathBuf,
    /// Output format name.
    pub format: String,
    /// Samples written.
    pub samples: usize,
    /// Number of classes.
    pub classes: usize,
    /// Payload bytes written.
    pub payload_bytes: u64,
    /// Size of the output file.
    pub file_bytes: u64,
    /// Files rejected, with reasons.
    pub rejected: Vec<Rejection>,
    /// Files skipped for not having an image extension.
    pub skipped_non_images: usize,
    /// Records of a dataset source (`convert` from a packed dataset or shards, `join`) left out
    /// of the output, unreadable or not images: the output holds fewer records than its source
    /// declares, and `pack-dataset` exits 1 saying so. Always 0 for an ImageFolder tree, whose
    /// files that are not images were never records.
    #[serde(default)]
    pub dropped_records: usize,
    /// Source files a resumed run found already done.
    pub resumed_from: usize,
    /// What opening the source reported (e.g. an index built for a TFRecord shard).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notices: Vec<String>,
    /// Wall time of this run.
    pub seconds: f64,
    /// Source files processed per second in this run.
    pub images_per_sec: f64,
}

/// `OUT.report.json`: the machine-readable pack report.
pub fn report_path(out: &Path) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(".report.json");
    PathBuf::from(name)
}

/// `Err(NotReplaceable)` when `OUT.report.json` exists and is not a pack report (a regular file
/// holding one): the report written at the end replaces only an earlier report, never a file of
/// someone else's, and never through a symlink.
fn refuse_foreign_report(out: &Path) -> Result<()> {
    let report = report_path(out);
    let Some(meta) = crate::file::entry_metadata(&report)? else {
        return Ok(());
    };
    let is_report = meta.is_file()
        && meta.len() <= 1 << 30
        && fs::read(&report)
            .ok()
            .is_some_and(|bytes| serde_json::from_slice::<PackSummary>(&bytes).is_ok());
    if is_report {
        return Ok(());
    }
    Err(Error::NotReplaceable {
        path: report,
        reason: "the pack report goes there, and it is not an earlier pack report; move it away \
                 or write the output somewhere else"
            .into(),
    })
}

/// Refuses an output that would replace or delete a source: `out` (or `OUT.partial`) is one of
/// `sources`, or a directory that holds one.
pub(crate) fn refuse_source_as_output(out: &Path, sources: &[&Path]) -> Result<()> {
    let canonical = |p: &Path| fs::canonicalize(p).ok();
    for target in [out.to_path_buf(), partial_path(out)] {
        let Some(target) = canonical(&target) else {
            continue; // does not exist yet: it cannot hold anything
        };
        for source in sources {
            if let Some(source) = canonical(source)
                && source.starts_with(&target)
            {
                return Err(Error::NotReplaceable {
                    path: target.clone(),
                    reason: if source == target {
                        "it is the source being packed; write the output elsewhere".into()
                    } else {
                        format!(
                            "it holds the source being packed ({}); write the output elsewhere",
                            source.display()
                        )
                    },
                });
            }
        }
    }
    Ok(())
}

/// Bytes a dataset takes: a file's length, or the total of the files in a directory (record
/// shards, indexes and manifest).
pub fn disk_bytes(path: &Path) -> u64 {
    match fs::metadata(path) {
        Ok(meta) if meta.is_dir() => fs::read_dir(path)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok()?.metadata().ok())
                    .filter(|m| m.is_file())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0),
        Ok(meta) => meta.len(),
        Err(_) => 0,
    }
}

/// SHA-256 of the listing (key, label, size of each file): changes when the tree does.
pub fn source_fingerprint(folder: &ImageFolder) -> Result<String> {
    let mut hasher = Sha256::new();
    for (index, entry) in folder.entries().iter().enumerate() {
        let path = folder.file_path(index);
        // A file that vanished hashes as size u64::MAX; reading it will reject it with the reason.
        let size = fs::metadata(&path).map(|m| m.len()).unwrap_or(u64::MAX);
        hasher.update(entry.key.as_bytes());
        hasher.update([0]);
        hasher.update(entry.label.to_le_bytes());
        hasher.update(size.to_le_bytes());
    }
    Ok(hex(&hasher.finalize()))
}

/// What a pack reads: the files of an ImageFolder tree, or the records of any dataset.
enum Source<'a> {
    Folder(&'a ImageFolder),
    Records(&'a dyn Dataset),
    /// The parts of a split conversion, in part order; their payloads were checked when the
    /// parts were packed and are copied as they are.
    Joined(&'a JoinedParts),
}

impl Source<'_> {
    /// The records of a dataset-backed source.
    fn dataset(&self) -> Option<&dyn Dataset> {
        match self {
            Source::Folder(_) => None,
            Source::Records(d) => Some(*d),
            Source::Joined(j) => Some(*j),
        }
    }

    fn len(&self) -> usize {
        match (self, self.dataset()) {
            (Source::Folder(f), _) => f.len(),
            (_, Some(d)) => d.len(),
            _ => unreachable!("a non-folder source has a dataset"),
        }
    }

    fn classes(&self) -> &[String] {
        match (self, self.dataset()) {
            (Source::Folder(f), _) => f.classes(),
            (_, Some(d)) => d.classes(),
            _ => unreachable!("a non-folder source has a dataset"),
        }
    }

    fn payload(&self) -> PayloadKind {
        self.dataset()
            .map_or(PayloadKind::Encoded, |d| d.info().payload)
    }

    fn resized_short_side(&self) -> Option<u32> {
        self.dataset().and_then(|d| d.info().resized_short_side)
    }

    /// What changes when the source does: the listing for a tree; path, size, modification
    /// time and sample count for a dataset file.
    fn fingerprint(&self) -> Result<String> {
        match self {
            Source::Folder(f) => source_fingerprint(f),
            Source::Joined(j) => {
                let mut hasher = Sha256::new();
                for part in j.parts() {
                    hasher.update(Source::Records(part.as_ref()).fingerprint()?.as_bytes());
                }
                Ok(hex(&hasher.finalize()))
            }
            Source::Records(d) => {
                let mut hasher = Sha256::new();
                // A source named by a pattern or a URL is no one file: its name, size and
                // classes stand for it.
                let text = d.path().to_string_lossy();
                if crate::remote::is_url(&text) || crate::format::shards::is_pattern(d.path()) {
                    hasher.update(text.as_bytes());
                    hasher.update((d.len() as u64).to_le_bytes());
                    for class in &d.info().classes {
                        hasher.update(class.as_bytes());
                        hasher.update([0]);
                    }
                    return Ok(hex(&hasher.finalize()));
                }
                let meta = fs::metadata(d.path()).at(d.path())?;
                hasher.update(
                    fs::canonicalize(d.path())
                        .at(d.path())?
                        .as_os_str()
                        .as_encoded_bytes(),
                );
                hasher.update(meta.len().to_le_bytes());
                let mtime = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
                hasher.update(mtime.map_or(0, |d| d.as_nanos()).to_le_bytes());
                hasher.update((d.len() as u64).to_le_bytes());
                Ok(hex(&hasher.finalize()))
            }
        }
    }

    /// The files or directories the items are read from.
    fn paths(&self) -> Vec<&Path> {
        match self {
            Source::Folder(f) => vec![f.path()],
            Source::Records(d) => vec![d.path()],
            Source::Joined(j) => j.parts().iter().map(|p| p.path()).collect(),
        }
    }

    /// Where a rejected item lives, for strict mode's error.
    fn locate(&self, index: usize, key: &str) -> PathBuf {
        match (self, self.dataset()) {
            (Source::Folder(f), _) => f.file_path(index),
            (_, Some(d)) => {
                PathBuf::from(format!("{}: record {index} ({key})", d.path().display()))
            }
            _ => unreachable!("a non-folder source has a dataset"),
        }
    }
}

/// One fetched item: (key, label, payload to store), or (key, rejection reason).
type Fetched = std::result::Result<(String, u32, Vec<u8>), (String, String)>;

/// Per-thread state for checking and transforming files.
struct PackWorker {
    reader: Option<Box<dyn RecordReader>>,
    decoder: Decoder,
    rgb: Vec<u8>,
    resized: Vec<u8>,
    resizer: Option<RgbResizer>,
    encoder: Option<JpegEncoder>,
}

impl PackWorker {
    fn new(max_pixels: u64) -> Self {
        PackWorker {
            reader: None,
            decoder: Decoder::new().with_max_pixels(max_pixels),
            rgb: Vec::new(),
            resized: Vec::new(),
            resizer: None,
            encoder: None,
        }
    }

    /// Fetches source item `index`: its key, label and bytes, or (key, reason) when it cannot
    /// be read.
    fn fetch(&mut self, source: &Source<'_>, index: usize) -> Fetched {
        match source {
            Source::Folder(folder) => {
                let entry = &folder.entries()[index];
                let mut bytes = Vec::new();
                match folder.read_file(index, &mut bytes) {
                    Ok(()) => Ok((entry.key.clone(), entry.label, bytes)),
                    Err(Error::RefusedFile { reason, .. }) => Err((entry.key.clone(), reason)),
                    Err(e) => Err((entry.key.clone(), format!("cannot read: {e}"))),
                }
            }
            Source::Records(_) | Source::Joined(_) => {
                let dataset = source.dataset().expect("a dataset-backed source");
                let reader = match &mut self.reader {
                    Some(reader) => reader,
                    slot @ None => match dataset.open_reader() {
                        Ok(reader) => slot.insert(reader),
                        Err(e) => {
                            return Err((index.to_string(), format!("cannot open a reader: {e}")));
                        }
                    },
                };
                match reader.read(index) {
                    Ok(r) => Ok((r.key.to_string(), r.label, r.payload.to_vec())),
                    Err(e) => Err((index.to_string(), e.to_string())),
                }
            }
        }
    }

    /// Fetches and checks one item; returns what to store, or the rejection.
    fn prepare(&mut self, source: &Source<'_>, index: usize, options: &PackOptions) -> Fetched {
        let (key, label, bytes) = self.fetch(source, index)?;
        if key.contains('\0') {
            // A key is a path relative to the source root, which cannot hold a NUL; HDF5's
            // strings cannot store one either.
            return Err((key.replace('\0', "\\0"), "its key holds a NUL byte".into()));
        }
        if let Source::Joined(_) = source {
            return Ok((key, label, bytes));
        }
        match self.prepare_bytes(bytes, options) {
            Ok(payload) => Ok((key, label, payload)),
            Err(reason) => Err((key, reason)),
        }
    }

    /// Checks (and with --raw/--resize, transforms) one image's bytes.
    fn prepare_bytes(
        &mut self,
        bytes: Vec<u8>,
        options: &PackOptions,
    ) -> std::result::Result<Vec<u8>, String> {
        if !options.raw && options.resize_short_side.is_none() {
            // Stored as is: only check that it decodes (the cheap way).
            self.decoder.validate(&bytes).map_err(|e| e.to_string())?;
            return Ok(bytes);
        }
        let header = self
            .decoder
            .decode_rgb(&bytes, &mut self.rgb)
            .map_err(|e| e.to_string())?;
        let (w, h) = (header.width, header.height);
        let target = options
            .resize_short_side
            .filter(|&s| w.min(h) > s)
            .map(|s| short_side_size(w, h, s));
        let (pixels, pw, ph) = match target {
            Some((tw, th)) => {
                self.resized.resize(tw as usize * th as usize * 3, 0);
                self.resizer.get_or_insert_with(RgbResizer::new).resize(
                    &self.rgb,
                    w,
                    h,
                    &mut self.resized,
                    tw,
                    th,
                );
                (&self.resized, tw, th)
            }
            None if !options.raw => return Ok(bytes),
            None => (&self.rgb, w, h),
        };
        if options.raw {
            return Ok(RawImage::encode(pw, ph, pixels));
        }
        let encoder = match &mut self.encoder {
            Some(encoder) => encoder,
            slot @ None => slot.insert(
                JpegEncoder::new(options.quality, ChromaSubsampling::Half)
                    .map_err(|e| e.to_string())?,
            ),
        };
        encoder
            .encode_rgb(pixels, pw, ph)
            .map_err(|e| e.to_string())
    }
}

/// Packs the ImageFolder tree at `source` into `out`.
///
/// Returns the summary (also written to [`report_path`]`(out)`). Rejected files are listed there;
/// with `options.strict` the first one is an [`Error::Rejected`] and no output remains.
pub fn pack_image_folder(
    source: &Path,
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    format.require(out)?;
    let folder = ImageFolder::open(source)?;
    pack_source(
        &Source::Folder(&folder),
        source,
        out,
        format,
        options,
        observer,
    )
}

/// Rewrites any dataset this library reads (an imagefeed LMDB, a Python folder2lmdb LMDB, an
/// ImageFolder tree) into `out`, with the same checks, options, crash safety and report as
/// [`pack_image_folder`]. Records keep their keys, labels and order; classes are the source's.
pub fn convert(
    source: &Path,
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    convert_with(
        source,
        out,
        format,
        options,
        &crate::format::OpenOptions::default(),
        observer,
    )
}

/// [`convert`], with options for reading a source other tools wrote (h5py dataset names,
/// TFRecord label base).
pub fn convert_with(
    source: &Path,
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
    input: &crate::format::OpenOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    format.require(out)?;
    if source.is_dir()
        && !source.join("data.mdb").is_file()
        && !crate::format::records::looks_like_records(source)
        && !crate::format::webdataset::looks_like_webdataset(source)
    {
        return pack_image_folder(source, out, format, options, observer);
    }
    let dataset = crate::format::open_with(source, input)?;
    pack_source(
        &Source::Records(dataset.as_ref()),
        source,
        out,
        format,
        options,
        observer,
    )
}

/// The pack pipeline, in its steps: check the options and the share of the source this run
/// packs ([`part_range`]), make the plan the writer records ([`plan_for`]), start the writer
/// (which resumes where an interrupted run stopped), check and commit the items chunk by chunk
/// ([`write_chunks`]), seal and publish the output, and write the report ([`report`]).
fn pack_source(
    items: &Source<'_>,
    source: &Path,
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    if let Some(text) = out.to_str()
        && crate::remote::is_url(text)
    {
        return pack_to_url(items, source, text, format, options, observer);
    }
    let started = Instant::now();
    options.validate()?;
    let (part, range) = part_range(items, options)?;
    refuse_source_as_output(out, &items.paths())?;
    if let Some(class) = items.classes().iter().find(|c| c.contains('\0')) {
        return Err(Error::not_a_dataset(
            source,
            format!("class name {class:?} holds a NUL byte, which no output can store"),
        ));
    }
    let plan = plan_for(items, options, part, range.len())?;
    refuse_foreign_report(&std::path::absolute(out).at(out)?)?;
    let (mut writer, mut progress) = start_writer(format, out, &plan, &options.writer_options())?;
    let resumed_from = progress.sources_done;
    observer.started(range.len(), resumed_from);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(options.threads.unwrap_or(0))
        .thread_name(|i| format!("pack-{i}"))
        .build()
        .map_err(|e| Error::io(source, std::io::Error::other(e)))?;
    let todo: Vec<usize> = (range.start + resumed_from..range.end).collect();
    let outcome = write_chunks(
        items,
        &pool,
        &todo,
        range.len(),
        out,
        options,
        observer,
        &mut progress,
        writer.as_mut(),
    );
    if let Err(err) = outcome {
        if options.strict {
            writer.abandon();
        }
        return Err(err);
    }
    if progress.samples_written == 0 {
        writer.abandon();
        return Err(Error::BadImageFolder {
            path: source.to_path_buf(),
            reason: format!("all {} files were rejected; nothing to pack", range.len()),
        });
    }
    let mut info = plan.dataset_info(format.kind(), progress.samples_written);
    // A joined dataset counts what its parts rejected too.
    let earlier = match items {
        Source::Joined(j) => j.info().rejected_at_pack.unwrap_or(0),
        Source::Folder(_) | Source::Records(_) => 0,
    };
    info.rejected_at_pack = Some(progress.rejected.len() + earlier);
    writer.finish(&info, &progress)?;
    report(
        items,
        source,
        out,
        format,
        &plan,
        progress,
        resumed_from,
        started,
    )
}

/// [`pack_source`] into object storage: packed into a local staging copy (crash-safe and
/// resumable as any pack), then uploaded ([`crate::format::upload`]).
fn pack_to_url(
    items: &Source<'_>,
    source: &Path,
    url: &str,
    format: PackFormat,
    options: &PackOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    let url = crate::remote::RemoteUrl::parse(url)?.with_options(&options.storage_options);
    #[cfg(feature = "remote")]
    {
        options.validate()?;
        crate::format::upload::check_target(&url, options.mode)?;
        let cache = match &options.cache {
            Some(cache) => cache.clone(),
            None => crate::cache::Cache::from_env()?,
        };
        let staging = crate::format::upload::staging_for(&url, &cache);
        if let Some(parent) = staging.parent() {
            std::fs::create_dir_all(parent).at(parent)?;
        }
        // The staging copy is ours to replace whatever the remote mode says: a fresh pack
        // starts it again, a resumed one continues it.
        let local = PackOptions {
            mode: StartMode {
                resume: options.mode.resume,
                force: true,
            },
            ..options.clone()
        };
        // A resumed run whose local pack had finished (the upload was cut short) only uploads.
        let finished = (options.mode.resume && staging.exists())
            .then(|| std::fs::read(report_path(&staging)).ok())
            .flatten()
            .and_then(|text| serde_json::from_slice::<PackSummary>(&text).ok());
        let mut summary = match finished {
            Some(summary) => summary,
            None => pack_source(items, source, &staging, format, &local, observer)?,
        };
        crate::format::upload::publish(&staging, &url, options.mode)?;
        let report = report_path(&staging);
        let _ = crate::remote::store::upload(
            &report,
            &url.with_key(&format!("{}.report.json", url.key().trim_end_matches('/'))),
            false,
        );
        let _ = std::fs::remove_file(&report);
        summary.output = PathBuf::from(url.to_string());
        Ok(summary)
    }
    #[cfg(not(feature = "remote"))]
    {
        let _ = (items, source, format, options, observer);
        Err(Error::FeatureDisabled {
            path: PathBuf::from(url.to_string()),
            what: "writing to object storage",
            feature: "remote",
        })
    }
}

/// The part of the source listing this run packs (`--num-parts`/`--part-index`), checked,
/// and the range of items it covers (all of them without a part).
fn part_range(
    items: &Source<'_>,
    options: &PackOptions,
) -> Result<(Option<PartInfo>, std::ops::Range<usize>)> {
    let Some((index, count)) = options.part else {
        return Ok((None, 0..items.len()));
    };
    if count == 0 || index >= count {
        return Err(Error::Options(format!(
            "--part-index {index} must be below --num-parts {count}"
        )));
    }
    let range = PartInfo::range(items.len(), index, count);
    if range.is_empty() {
        return Err(Error::Options(format!(
            "--part-index {index} of --num-parts {count} holds none of the {} source files; \
             split into at most {} parts",
            items.len(),
            items.len().max(1)
        )));
    }
    let part = PartInfo {
        index,
        count,
        source_fingerprint: items.fingerprint()?,
        source_items: items.len(),
    };
    Ok((Some(part), range))
}

/// What the writer is asked to produce from `num_sources` items of `items`: recorded in the
/// staging output, so that a resumed run can check it packs the same thing.
fn plan_for(
    items: &Source<'_>,
    options: &PackOptions,
    part: Option<PartInfo>,
    num_sources: usize,
) -> Result<PackPlan> {
    let source_raw = items.payload() == PayloadKind::RawRgb8;
    Ok(PackPlan {
        source_fingerprint: items.fingerprint()?,
        num_sources,
        classes: items.classes().to_vec(),
        payload: if options.raw || (source_raw && options.resize_short_side.is_none()) {
            PayloadKind::RawRgb8
        } else {
            PayloadKind::Encoded
        },
        resize_short_side: items.resized_short_side().or(options.resize_short_side),
        quality: options.quality,
        part,
    })
}

/// Checks the items `todo` on a thread pool a chunk at a time, and commits each chunk, in
/// source order, through `writer` with the progress so far. A producer thread checks chunk
/// k+1 while this thread commits chunk k. Stops at the first rejection when strict, or when
/// the observer asks (after a commit, so the work done is kept for `--resume`).
#[allow(clippy::too_many_arguments)]
fn write_chunks(
    items: &Source<'_>,
    pool: &rayon::ThreadPool,
    todo: &[usize],
    total: usize,
    out: &Path,
    options: &PackOptions,
    observer: &dyn PackObserver,
    progress: &mut PackProgress,
    writer: &mut dyn DatasetWriter,
) -> Result<()> {
    let chunk_size = options.chunk_size.max(1);
    let (sender, receiver) = crossbeam_channel::bounded::<Vec<Fetched>>(1);
    std::thread::scope(|scope| -> Result<()> {
        scope.spawn(move || {
            for chunk in todo.chunks(chunk_size) {
                let results: Vec<_> = pool.install(|| {
                    chunk
                        .par_iter()
                        .map_init(
                            || PackWorker::new(options.max_pixels),
                            |worker, &index| worker.prepare(items, index, options),
                        )
                        .collect()
                });
                if sender.send(results).is_err() {
                    break; // the committing side stopped (error or strict rejection)
                }
            }
        });
        let result = (|| {
            for (chunk, results) in todo.chunks(chunk_size).zip(receiver.iter()) {
                let records = accept_chunk(items, chunk, &results, options, observer, progress)?;
                writer.write_chunk(&records, progress)?;
                observer.advanced(progress.sources_done, progress.payload_bytes);
                if observer.should_stop() && progress.sources_done < total {
                    return Err(Error::Interrupted {
                        path: out.to_path_buf(),
                        reason: format!(
                            "stopped after {} of {total} files; the part done is kept in {}: \
                             rerun with --resume to finish",
                            progress.sources_done,
                            partial_path(out).display()
                        ),
                    });
                }
            }
            Ok(())
        })();
        drop(receiver); // unblocks the producer if we stopped early
        result
    })
}

/// Turns one checked chunk into the records to write, counting them and the rejections into
/// `progress`; the first rejection is an error when strict.
fn accept_chunk<'r>(
    items: &Source<'_>,
    chunk: &[usize],
    results: &'r [Fetched],
    options: &PackOptions,
    observer: &dyn PackObserver,
    progress: &mut PackProgress,
) -> Result<Vec<PackedRecord<'r>>> {
    let mut records = Vec::with_capacity(chunk.len());
    for (&index, result) in chunk.iter().zip(results) {
        match result {
            Ok((key, label, payload)) => {
                records.push(PackedRecord {
                    label: *label,
                    key,
                    payload,
                });
                progress.payload_bytes += payload.len() as u64;
            }
            Err((key, reason)) => {
                if options.strict {
                    return Err(Error::Rejected {
                        path: items.locate(index, key),
                        reason: reason.clone(),
                    });
                }
                let rejection = Rejection {
                    key: key.clone(),
                    reason: reason.clone(),
                };
                observer.rejected(&rejection);
                progress.rejected.push(rejection);
            }
        }
    }
    progress.samples_written += records.len();
    progress.sources_done += chunk.len();
    Ok(records)
}

/// The summary of a finished pack, also written to [`report_path`]`(out)` (replaced with a
/// rename: an earlier report's path is never followed or written through).
#[allow(clippy::too_many_arguments)]
fn report(
    items: &Source<'_>,
    source: &Path,
    out: &Path,
    format: PackFormat,
    plan: &PackPlan,
    progress: PackProgress,
    resumed_from: usize,
    started: Instant,
) -> Result<PackSummary> {
    let seconds = started.elapsed().as_secs_f64();
    let processed = plan.num_sources - resumed_from;
    let summary = PackSummary {
        source: source.to_path_buf(),
        output: out.to_path_buf(),
        format: format.kind().name().into(),
        samples: progress.samples_written,
        classes: plan.classes.len(),
        payload_bytes: progress.payload_bytes,
        file_bytes: disk_bytes(out),
        dropped_records: match items {
            Source::Folder(_) => 0,
            Source::Records(_) | Source::Joined(_) => progress.rejected.len(),
        },
        rejected: progress.rejected,
        skipped_non_images: match items {
            Source::Folder(f) => f.skipped_files(),
            Source::Records(_) | Source::Joined(_) => 0,
        },
        resumed_from,
        notices: items
            .dataset()
            .map(|d| d.notices().to_vec())
            .unwrap_or_default(),
        seconds,
        images_per_sec: processed as f64 / seconds.max(1e-9),
    };
    write_file_atomically(
        &report_path(out),
        &serde_json::to_vec_pretty(&summary).expect("summary serializes"),
    )?;
    Ok(summary)
}

/// Joins the parts of a split conversion (`--num-parts N --part-index i` runs, in any order)
/// into one dataset at `out`, identical to what an unsplit conversion would have written.
/// Payloads are copied without being decoded again (each part checked its own when packed);
/// `options` supplies the output side (resume/force, threads, shard size, label base).
pub fn join(
    parts: &[PathBuf],
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    format.require(out)?;
    let joined = JoinedParts::open(parts)?;
    if options.raw || options.resize_short_side.is_some() || options.part.is_some() {
        return Err(Error::Options(
            "join copies the parts as they are: --raw, --resize and --part-index do not apply"
                .into(),
        ));
    }
    pack_source(
        &Source::Joined(&joined),
        joined.path(),
        out,
        format,
        options,
        observer,
    )
}
