//! What a pack is asked ([`PackOptions`]) and what it tells ([`PackSummary`], the report beside
//! the output, the checks that keep a pack from overwriting what is not its own).

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::MAX_THREADS;
use crate::dataset::hex;
use crate::decode::DEFAULT_MAX_PIXELS;
use crate::error::{Error, Result};
use crate::format::folder::ImageFolder;
use crate::format::staging::partial_path;
use crate::format::writer::WriterOptions;
use crate::format::{lmdb, tfrecord};

use crate::format::writer::{Rejection, StartMode};

/// One share of a split pack: part `index` of `count` (`pack-dataset --part-index INDEX
/// --num-parts COUNT`, a job array's task), joined back with [`join`](super::join).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// This part's number, `0..count`.
    pub index: usize,
    /// How many parts the source listing is split into.
    pub count: usize,
}

/// How to pack: `PackOptions::default()` and the `with_*` builders below.
///
/// ```
/// use imagefeed::pack::{PackOptions, StartMode};
/// let options = PackOptions::default()
///     .with_threads(Some(4))
///     .with_mode(StartMode { resume: true, force: false });
/// assert_eq!(options.threads, Some(4));
/// ```
///
/// The fields are public to read (and to set one at a time); new fields may be added in any
/// release, so the struct cannot be written as a literal outside this crate.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PackOptions {
    /// Shrink images whose shorter side is longer than this (torchvision `Resize` rules) and
    /// re-encode them as JPEG at [`quality`](Self::quality). Smaller images are kept as they are.
    pub resize_short_side: Option<u32>,
    /// JPEG quality for re-encoded images (1..=100).
    pub quality: u8,
    /// Store decoded RGB pixels instead of encoded files, so training skips decoding.
    pub raw: bool,
    /// Rewrite every JPEG losslessly (same pixels) with restart markers that cut its rows into
    /// segments ([`add_restart_markers`](crate::decode::add_restart_markers)), so a crop
    /// decodes only the segments around it: RandomResizedCrop decodes faster, whole-image
    /// decodes ~7% slower, files grow ~2.5%. See docs/formats.md.
    pub restart_markers: bool,
    /// Store the bytes before each JPEG's entropy-coded data (tables, frame and scan headers)
    /// once per dataset, where images share them: CIFAR-size datasets pack to about a third of
    /// the size, and readers hand out the original files byte for byte. LMDB output only; its
    /// values are then not plain files to other LMDB readers. See docs/formats.md.
    pub shared_headers: bool,
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
    /// Pack only one share of the source listing (a job array's); see
    /// [`PartInfo`](crate::dataset::PartInfo) and [`join`](super::join).
    pub part: Option<Part>,
    /// An output in object storage: where its local staging copy goes (`None`: the cache the
    /// environment names).
    pub cache: Option<crate::cache::Cache>,
    /// An output in object storage: client options over the environment's
    /// ([`RemoteUrl::with_options`](crate::remote::RemoteUrl::with_options)).
    pub storage_options: Vec<(String, String)>,
}

impl PackOptions {
    /// With [`resize_short_side`](Self::resize_short_side).
    pub fn with_resize_short_side(mut self, short: Option<u32>) -> Self {
        self.resize_short_side = short;
        self
    }

    /// With [`restart_markers`](Self::restart_markers).
    pub fn with_restart_markers(mut self, restart_markers: bool) -> Self {
        self.restart_markers = restart_markers;
        self
    }

    /// With [`shared_headers`](Self::shared_headers).
    pub fn with_shared_headers(mut self, shared_headers: bool) -> Self {
        self.shared_headers = shared_headers;
        self
    }

    /// With [`quality`](Self::quality).
    pub fn with_quality(mut self, quality: u8) -> Self {
        self.quality = quality;
        self
    }

    /// With [`raw`](Self::raw).
    pub fn with_raw(mut self, raw: bool) -> Self {
        self.raw = raw;
        self
    }

    /// With [`strict`](Self::strict).
    pub fn with_strict(mut self, strict: bool) -> Self {
        self.strict = strict;
        self
    }

    /// With [`mode`](Self::mode).
    pub fn with_mode(mut self, mode: StartMode) -> Self {
        self.mode = mode;
        self
    }

    /// With [`max_pixels`](Self::max_pixels).
    pub fn with_max_pixels(mut self, max_pixels: u64) -> Self {
        self.max_pixels = max_pixels;
        self
    }

    /// With [`threads`](Self::threads).
    pub fn with_threads(mut self, threads: Option<usize>) -> Self {
        self.threads = threads;
        self
    }

    /// With [`chunk_size`](Self::chunk_size).
    pub fn with_chunk_size(mut self, chunk_size: usize) -> Self {
        self.chunk_size = chunk_size;
        self
    }

    /// With [`lmdb_map_size`](Self::lmdb_map_size).
    pub fn with_lmdb_map_size(mut self, bytes: usize) -> Self {
        self.lmdb_map_size = bytes;
        self
    }

    /// With [`shard_bytes`](Self::shard_bytes).
    pub fn with_shard_bytes(mut self, bytes: u64) -> Self {
        self.shard_bytes = bytes;
        self
    }

    /// With [`label_base`](Self::label_base).
    pub fn with_label_base(mut self, base: u32) -> Self {
        self.label_base = base;
        self
    }

    /// With [`part`](Self::part).
    pub fn with_part(mut self, part: Option<Part>) -> Self {
        self.part = part;
        self
    }

    /// With [`cache`](Self::cache).
    pub fn with_cache(mut self, cache: Option<crate::cache::Cache>) -> Self {
        self.cache = cache;
        self
    }

    /// With [`storage_options`](Self::storage_options).
    pub fn with_storage_options(mut self, options: Vec<(String, String)>) -> Self {
        self.storage_options = options;
        self
    }

    /// The settings the output's writer takes.
    pub fn writer_options(&self) -> WriterOptions {
        WriterOptions {
            mode: self.mode,
            lmdb_map_size: self.lmdb_map_size,
            shard_bytes: self.shard_bytes,
            label_base: self.label_base,
        }
    }

    /// `Err(Error::Config)` for settings no pack can run with.
    pub fn validate(&self) -> Result<()> {
        let invalid = |m: String| Err(Error::Config(m));
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
        if self.raw && self.restart_markers {
            return invalid(
                "--raw with --restart-markers: raw payloads hold pixels, not JPEGs to rewrite"
                    .into(),
            );
        }
        if self.raw && self.shared_headers {
            return invalid(
                "--raw with --shared-headers: raw payloads hold pixels, no JPEG headers to share"
                    .into(),
            );
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
            restart_markers: false,
            shared_headers: false,
            strict: false,
            mode: StartMode::default(),
            max_pixels: DEFAULT_MAX_PIXELS,
            threads: None,
            chunk_size: 256,
            lmdb_map_size: lmdb::DEFAULT_MAP_SIZE,
            shard_bytes: tfrecord::DEFAULT_SHARD_BYTES,
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
    name.push(crate::format::shards::REPORT_SUFFIX);
    PathBuf::from(name)
}

/// `Err(NotReplaceable)` when `OUT.report.json` exists and is not a pack report (a regular file
/// holding one): the report written at the end replaces only an earlier report, never a file of
/// someone else's, and never through a symlink.
pub(super) fn refuse_foreign_report(out: &Path) -> Result<()> {
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

/// [`refuse_source_as_output`] for an output in object storage: a source at the URL `out`, or
/// under it, is refused whatever the mode (a hostile try converted `s3://b/x` onto itself with
/// `--force`, replacing the full-size images with a 16-pixel copy, and joined parts into one
/// of themselves).
pub(crate) fn refuse_remote_source_as_output(
    out: &crate::remote::RemoteUrl,
    sources: &[&Path],
) -> Result<()> {
    let prefix = out.key().trim_end_matches('/');
    for source in sources {
        let Some(url) = source
            .to_str()
            .filter(|text| crate::remote::is_url(text))
            .and_then(|text| crate::remote::RemoteUrl::parse(text).ok())
        else {
            continue;
        };
        let key = url.key().trim_end_matches('/');
        let within = prefix.is_empty()
            || key == prefix
            || key
                .strip_prefix(prefix)
                .is_some_and(|rest| rest.starts_with('/'));
        if url.scheme() == out.scheme() && url.bucket() == out.bucket() && within {
            return Err(Error::NotReplaceable {
                path: PathBuf::from(out.to_string()),
                reason: if key == prefix {
                    "it is the source being packed; write the output elsewhere".into()
                } else {
                    format!("it holds the source being packed ({url}); write the output elsewhere")
                },
            });
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
