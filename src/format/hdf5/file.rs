//! The HDF5 reader ([`Hdf5`]) and writer ([`Hdf5Writer`]), side by side; they link libhdf5 and
//! are built with the `hdf5` feature. The layout they read and write is described in the parent
//! module.

use std::fs;
use std::io::{BufReader, Read as _};
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hdf5::types::{TypeDescriptor, VarLenArray, VarLenUnicode};
use serde::{Deserialize, Serialize};

use super::gate::{self, Gated};
use super::heap::{self, HeapId, HeapReader, Widths};
use super::{
    Hdf5Names, IMAGES, LABELS, MAGIC, STAGED_HDF5, STAGED_INDEX, STAGED_PAYLOADS, STAGED_PROGRESS,
    VERSION, has_signature,
};
use crate::dataset::{Dataset, DatasetInfo, FormatKind, PayloadKind, Record, RecordReader};
use crate::decode::RawImage;
use crate::error::{Error, IoContext as _, Result};
use crate::format::output;
use crate::format::writer::{DatasetWriter, PackPlan, PackProgress, PackedRecord, WriterOptions};
use crate::format::{FileIdentity, InfoRecord};

/// The first layout version with the `checksums` dataset.
const CHECKSUMS_SINCE: u32 = 2;
const INFO_ATTR: &str = "imagefeed";
const CLASSES_ATTR: &str = "classes";
const OFFSETS: &str = "offsets";
const KEYS: &str = "keys";
const CHECKSUMS: &str = "checksums";

/// Bytes copied per HDF5 write when the staged payloads are moved into the file.
const COPY_BLOCK: usize = 32 << 20;

// ---------------------------------------------------------------------------------------------
// Writer
// ---------------------------------------------------------------------------------------------

/// What `OUT.partial/progress.json` holds: enough to resume, and the staged files' lengths at
/// the last commit (anything past them is a chunk that was in flight and is discarded).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StagedProgress {
    magic: String,
    plan: PackPlan,
    progress: PackProgress,
    payload_bytes: u64,
    index_bytes: u64,
}

/// Writes an HDF5 dataset: stages chunks in `OUT.partial/`, then writes `OUT` in one pass.
pub struct Hdf5Writer {
    partial: PathBuf,
    /// Held while writing: see [`output::lock_staging`].
    _lock: fs::File,
    out: PathBuf,
    plan: PackPlan,
    payloads: fs::File,
    index: fs::File,
    payload_bytes: u64,
    index_bytes: u64,
}

impl Hdf5Writer {
    fn save_progress(&mut self, progress: &PackProgress) -> Result<()> {
        save_staged_progress(
            &self.partial,
            &self.plan,
            progress,
            self.payload_bytes,
            self.index_bytes,
        )
    }

    /// Writes the final HDF5 file from the staged data.
    fn write_hdf5(&self, path: &Path, info: &DatasetInfo) -> Result<()> {
        let h5 = |doing: &str| {
            let doing = doing.to_string();
            move |e: hdf5::Error| gate::error(path, &doing, e)
        };
        // Read the staged index back: (payload end, label, key) per sample.
        let mut index_bytes = Vec::with_capacity(self.index_bytes as usize);
        let index_path = self.partial.join(STAGED_INDEX);
        (&self.index)
            .read_to_end(&mut index_bytes)
            .at(&index_path)?;
        let (ends, labels, keys) =
            parse_staged_index(&index_bytes).map_err(|reason| Error::Incomplete {
                path: index_path.clone(),
                reason,
            })?;
        if keys.len() != info.num_samples {
            return Err(Error::Incomplete {
                path: index_path,
                reason: format!(
                    "{} samples staged but {} were committed",
                    keys.len(),
                    info.num_samples
                ),
            });
        }
        let mut offsets = Vec::with_capacity(ends.len() + 1);
        offsets.push(0u64);
        offsets.extend_from_slice(&ends);

        // Every library call runs inside the HDF5 gate (see `gate`); the payloads are copied
        // one block per entry, so a fork elsewhere in the process waits for one block at most.
        let file = gate::run(|| {
            hdf5::File::with_options()
                .with_fapl(|fapl| fapl.file_locking(false))
                .create(path)
                .map(Gated::new)
                .map_err(h5("creating the file"))
        })?;
        let images = file.with(|file| {
            file.new_dataset::<u8>()
                .no_chunk()
                .shape(self.payload_bytes as usize)
                .create(IMAGES)
                .map(Gated::new)
                .map_err(h5("creating the images dataset"))
        })?;
        let staged_path = self.partial.join(STAGED_PAYLOADS);
        let mut staged = BufReader::with_capacity(1 << 20, &self.payloads);
        use std::io::Seek as _;
        staged.seek(std::io::SeekFrom::Start(0)).at(&staged_path)?;
        let mut block = vec![0u8; COPY_BLOCK];
        let mut done = 0usize;
        let mut checksums = RecordChecksums::new(&offsets, &labels, &keys);
        while (done as u64) < self.payload_bytes {
            let n = COPY_BLOCK.min(self.payload_bytes as usize - done);
            staged.read_exact(&mut block[..n]).at(&staged_path)?;
            checksums.update(done as u64, &block[..n]);
            images.with(|images| {
                images
                    .write_slice(&block[..n], done..done + n)
                    .map_err(h5("writing the images dataset"))
            })?;
            done += n;
        }
        drop(images);
        let checksums = checksums.finish();
        let text = |what: &str, s: &str| -> Result<VarLenUnicode> {
            s.parse().map_err(|_| {
                Error::hdf5(
                    path,
                    &format!("writing {what} {s:?}"),
                    "it holds a NUL byte, which HDF5 cannot store".into(),
                )
            })
        };
        let keys: Vec<VarLenUnicode> =
            keys.iter().map(|k| text("key", k)).collect::<Result<_>>()?;
        let classes: Vec<VarLenUnicode> = info
            .classes
            .iter()
            .map(|c| text("class name", c))
            .collect::<Result<_>>()?;
        let record = InfoRecord::new(MAGIC, VERSION, true, info.clone());
        let json: VarLenUnicode = serde_json::to_string(&record)
            .expect("info serializes")
            .parse()
            .expect("JSON has no NUL");
        file.with(|file| -> Result<()> {
            file.new_dataset_builder()
                .with_data(checksums.as_slice())
                .create(CHECKSUMS)
                .map_err(h5("writing checksums"))?;
            file.new_dataset_builder()
                .with_data(offsets.as_slice())
                .create(OFFSETS)
                .map_err(h5("writing offsets"))?;
            file.new_dataset_builder()
                .with_data(labels.as_slice())
                .create(LABELS)
                .map_err(h5("writing labels"))?;
            file.new_dataset_builder()
                .with_data(keys.as_slice())
                .create(KEYS)
                .map_err(h5("writing keys"))?;
            file.new_attr_builder()
                .with_data(classes.as_slice())
                .create(CLASSES_ATTR)
                .map_err(h5("writing the classes attribute"))?;
            file.new_attr::<VarLenUnicode>()
                .create(INFO_ATTR)
                .and_then(|a| a.write_scalar(&json))
                .map_err(h5("writing the imagefeed attribute"))?;
            Ok(())
        })?;
        file.finish(|file| file.close().map_err(h5("closing the file")))?;
        fs::File::open(path).and_then(|f| f.sync_all()).at(path)
    }
}

/// Writes an HDF5 file in imagefeed's layout from raw parts, none of them checked: the
/// `imagefeed` attribute's bytes, offsets, labels, keys and image bytes. For fuzzing the reader.
#[cfg(feature = "fuzzing")]
pub(crate) fn write_raw_parts(
    path: &Path,
    info_json: &[u8],
    offsets: &[u64],
    labels: &[i64],
    keys: &[Vec<u8>],
    images: &[u8],
    checksums: Option<&[u32]>,
) -> std::result::Result<(), String> {
    // The library's error is read inside the gate (see `gate`).
    gate::run(|| {
        write_raw_parts_in_gate(path, info_json, offsets, labels, keys, images, checksums)
            .map_err(|e| e.to_string())
    })
}

#[cfg(feature = "fuzzing")]
fn write_raw_parts_in_gate(
    path: &Path,
    info_json: &[u8],
    offsets: &[u64],
    labels: &[i64],
    keys: &[Vec<u8>],
    images: &[u8],
    checksums: Option<&[u32]>,
) -> hdf5::Result<()> {
    let file = hdf5::File::with_options()
        .with_fapl(|fapl| fapl.file_locking(false))
        .create(path)?;
    file.new_dataset_builder()
        .with_data(images)
        .create(IMAGES)?;
    file.new_dataset_builder()
        .with_data(offsets)
        .create(OFFSETS)?;
    file.new_dataset_builder()
        .with_data(labels)
        .create(LABELS)?;
    // The bytes as text, with NULs (which HDF5 strings cannot hold) and invalid UTF-8 replaced:
    // a non-UTF-8 key is tested in tests/hostile.rs.
    let text = |bytes: &[u8]| -> VarLenUnicode {
        String::from_utf8_lossy(bytes)
            .replace('\0', "\u{FFFD}")
            .parse()
            .expect("no NUL left")
    };
    let keys: Vec<VarLenUnicode> = keys.iter().map(|k| text(k)).collect();
    file.new_dataset_builder()
        .with_data(keys.as_slice())
        .create(KEYS)?;
    if let Some(checksums) = checksums {
        file.new_dataset_builder()
            .with_data(checksums)
            .create(CHECKSUMS)?;
    }
    file.new_attr::<VarLenUnicode>()
        .create(INFO_ATTR)?
        .write_scalar(&text(info_json))?;
    file.close()
}

/// Computes each record's [`record_checksum`](crate::format::record_checksum) while the
/// payloads stream past in blocks: record `i`'s payload is bytes `offsets[i]..offsets[i + 1]`.
struct RecordChecksums<'a> {
    offsets: &'a [u64],
    labels: &'a [i64],
    keys: &'a [String],
    /// The record being summed, and its CRC so far.
    current: usize,
    crc: u32,
    done: Vec<u32>,
}

impl<'a> RecordChecksums<'a> {
    fn new(offsets: &'a [u64], labels: &'a [i64], keys: &'a [String]) -> Self {
        let mut sums = RecordChecksums {
            offsets,
            labels,
            keys,
            current: 0,
            crc: 0,
            done: Vec::with_capacity(keys.len()),
        };
        sums.start_record();
        sums
    }

    fn start_record(&mut self) {
        if let Some(key) = self.keys.get(self.current) {
            self.crc = crate::format::checksum_start(self.labels[self.current] as u32, key);
        }
    }

    /// Ends every record whose payload ends at or before `position`.
    fn close_up_to(&mut self, position: u64) {
        while self.current < self.keys.len() && self.offsets[self.current + 1] <= position {
            self.done.push(self.crc);
            self.current += 1;
            self.start_record();
        }
    }

    /// Adds `block`, the payload bytes starting at `at`.
    fn update(&mut self, at: u64, block: &[u8]) {
        let end = at + block.len() as u64;
        let mut position = at;
        while position < end {
            self.close_up_to(position);
            let Some(&stop) = self.offsets.get(self.current + 1) else {
                break;
            };
            let stop = stop.min(end);
            let piece = &block[(position - at) as usize..(stop - at) as usize];
            self.crc = crc32c::crc32c_append(self.crc, piece);
            position = stop;
        }
    }

    fn finish(mut self) -> Vec<u32> {
        self.close_up_to(u64::MAX);
        self.done
    }
}

/// The staged index, one entry per sample.
type StagedIndex = (Vec<u64>, Vec<i64>, Vec<String>);

/// Appends one `index.bin` entry (the layout [`parse_staged_index`] reads).
pub(crate) fn push_staged_entry(index: &mut Vec<u8>, payload_end: u64, label: u32, key: &str) {
    index.extend_from_slice(&payload_end.to_le_bytes());
    index.extend_from_slice(&label.to_le_bytes());
    index.extend_from_slice(&(key.len() as u32).to_le_bytes());
    index.extend_from_slice(key.as_bytes());
}

/// Parses `index.bin`: per sample `u64 LE payload end | u32 LE label | u32 LE key length | key`;
/// returns (payload ends, labels, keys).
pub(crate) fn parse_staged_index(bytes: &[u8]) -> std::result::Result<StagedIndex, String> {
    let (mut ends, mut labels, mut keys) = (Vec::new(), Vec::new(), Vec::new());
    let mut rest = bytes;
    while !rest.is_empty() {
        if rest.len() < 16 {
            return Err("index.bin ends inside an entry".into());
        }
        let end = u64::from_le_bytes(rest[0..8].try_into().expect("8 bytes"));
        let label = u32::from_le_bytes(rest[8..12].try_into().expect("4 bytes"));
        let key_len = u32::from_le_bytes(rest[12..16].try_into().expect("4 bytes")) as usize;
        let key = rest
            .get(16..16 + key_len)
            .ok_or("index.bin ends inside a key")?;
        let key = std::str::from_utf8(key).map_err(|_| "a staged key is not UTF-8")?;
        ends.push(end);
        labels.push(i64::from(label));
        keys.push(key.to_string());
        rest = &rest[16 + key_len..];
    }
    Ok((ends, labels, keys))
}

impl DatasetWriter for Hdf5Writer {
    fn start(out: &Path, plan: &PackPlan, options: &WriterOptions) -> Result<(Self, PackProgress)> {
        let mode = options.mode;
        let partial = output::prepare_output(out, mode)?;
        let out = std::path::absolute(out).at(out)?;
        let created = !partial.exists();
        if created {
            fs::create_dir(&partial).at(&partial)?;
        }
        let lock = output::lock_staging(&partial)?;
        // A run killed before its first progress record committed nothing: start afresh.
        if created || output::nothing_committed(&partial, STAGED_PROGRESS) {
            output::clear_uncommitted(&partial)?;
            // The progress record goes in before any other file, so a staging directory is
            // recognised as ours (and never taken for anything else) from its first entry on.
            let progress = PackProgress::default();
            save_staged_progress(&partial, plan, &progress, 0, 0)?;
            let writer = Hdf5Writer {
                _lock: lock,
                payloads: output::open_staged_file(&partial, STAGED_PAYLOADS, true)?,
                index: output::open_staged_file(&partial, STAGED_INDEX, true)?,
                partial,
                out,
                plan: plan.clone(),
                payload_bytes: 0,
                index_bytes: 0,
            };
            return Ok((writer, progress));
        }
        let staged: StagedProgress =
            output::read_staged_progress(&partial, STAGED_PROGRESS, "imagefeed HDF5")?;
        staged.plan.check_resumable(plan, &partial)?;
        let payloads = output::open_staged_file(&partial, STAGED_PAYLOADS, false)?;
        let index = output::open_staged_file(&partial, STAGED_INDEX, false)?;
        output::cut_to_committed(
            &payloads,
            &partial.join(STAGED_PAYLOADS),
            staged.payload_bytes,
        )?;
        output::cut_to_committed(&index, &partial.join(STAGED_INDEX), staged.index_bytes)?;
        let writer = Hdf5Writer {
            _lock: lock,
            partial,
            out,
            plan: staged.plan,
            payloads,
            index,
            payload_bytes: staged.payload_bytes,
            index_bytes: staged.index_bytes,
        };
        Ok((writer, staged.progress))
    }

    fn write_chunk(&mut self, records: &[PackedRecord<'_>], progress: &PackProgress) -> Result<()> {
        let mut index = Vec::with_capacity(records.len() * 48);
        let mut end = self.payload_bytes;
        for record in records {
            self.payloads
                .write_all_at(record.payload, end)
                .at(self.partial.join(STAGED_PAYLOADS))?;
            end += record.payload.len() as u64;
            push_staged_entry(&mut index, end, record.label, record.key);
        }
        self.index
            .write_all_at(&index, self.index_bytes)
            .at(self.partial.join(STAGED_INDEX))?;
        self.payloads
            .sync_data()
            .at(self.partial.join(STAGED_PAYLOADS))?;
        self.index.sync_data().at(self.partial.join(STAGED_INDEX))?;
        self.payload_bytes = end;
        self.index_bytes += index.len() as u64;
        self.save_progress(progress)
    }

    fn finish(mut self: Box<Self>, info: &DatasetInfo, progress: &PackProgress) -> Result<()> {
        self.save_progress(progress)?;
        let staged_h5 = self.partial.join(STAGED_HDF5);
        let _ = fs::remove_file(&staged_h5);
        self.write_hdf5(&staged_h5, info)?;
        output::publish(&staged_h5, &self.out)?;
        // The dataset is in place; the staging directory is only scratch now.
        let _ = fs::remove_dir_all(&self.partial);
        Ok(())
    }

    fn abandon(self: Box<Self>) {
        let _ = fs::remove_dir_all(&self.partial);
    }
}

// ---------------------------------------------------------------------------------------------
// Reader
// ---------------------------------------------------------------------------------------------

/// How samples are laid out in the file, with what reading them needs.
enum Layout {
    /// imagefeed's layout: payload `i` is at `data_offset + offsets[i]..data_offset + offsets[i+1]`.
    Imagefeed {
        data_offset: u64,
        data_len: u64,
        offsets: Vec<u64>,
        keys: Vec<String>,
        /// Each record's checksum (layout version 2 on).
        checksums: Option<Vec<u32>>,
    },
    /// h5py `vlen_dtype(uint8)`: one encoded image per element, element `i` in global heap
    /// object `ids[i]`, read with `pread` and checked (`heap`).
    VarLen {
        images: String,
        widths: Widths,
        ids: Vec<HeapId>,
    },
    /// The same, with the elements' descriptors stored through a filter (compressed): read
    /// through the library, one element at a time.
    VarLenThroughLibrary { images: String },
    /// An `N×H×W×C` `uint8` array; `file_offset` is set when it is contiguous and unfiltered.
    Pixels {
        images: String,
        rank: usize,
        height: usize,
        width: usize,
        channels: usize,
        file_offset: Option<u64>,
    },
}

struct Shared {
    path: PathBuf,
    info: DatasetInfo,
    labels: Vec<i64>,
    layout: Layout,
    /// What opening found that a user should hear about (labels left out of the classes).
    notices: Vec<String>,
    /// The file as opened: `pread` layouts read through this descriptor in every worker, so a
    /// file replaced on disk later (`mv new.h5 train.h5`) is not read by the workers that
    /// start after it; a reader the library opens by path checks `identity` instead.
    opened: Option<Arc<fs::File>>,
    identity: Option<FileIdentity>,
}

/// An HDF5 dataset opened for reading (see the module docs for the layouts).
pub struct Hdf5 {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Hdf5 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hdf5")
            .field("path", &self.shared.path)
            .field("info", &self.shared.info)
            .finish()
    }
}

impl Hdf5 {
    /// Opens an imagefeed HDF5 file, or an h5py file with datasets named `images` and `labels`.
    pub fn open(path: impl AsRef<Path>) -> Result<Hdf5> {
        Self::open_with(path, &Hdf5Names::default())
    }

    /// Opens an HDF5 file; `names` says which datasets hold images and labels when the file is
    /// not in imagefeed's layout.
    pub fn open_with(path: impl AsRef<Path>, names: &Hdf5Names) -> Result<Hdf5> {
        let path = path.as_ref();
        output::refuse_interrupted(path)?;
        let plain = fs::File::open(path).at(path)?;
        let identity = FileIdentity::of(&plain.metadata().at(path)?);
        let file_len = identity.len;
        if !has_signature(path) {
            return Err(Error::not_a_dataset(
                path,
                "not an HDF5 file (bad signature)",
            ));
        }
        // Small files stream into the page cache in one sequential read, as an LMDB's do
        // (see `pagecache`); payloads are then `pread` without a disk seek each.
        crate::pagecache::prefetch_if_it_fits(&plain);
        // Metadata that crashes or loops libhdf5 must cost an error, not the process: the
        // same open runs in a trial child first (see `probe`). The child has no descriptor of
        // the parent's, so it runs the library's part of the open alone.
        super::probe::try_in_child(path, || {
            gate::run(|| {
                if let Ok(file) = open_unlocked(path) {
                    let _ = open_metadata(path, &file, names, None, file_len);
                }
            })
        })?;
        let mut shared = gate::run(|| {
            let file = open_unlocked(path).map_err(|e| gate::error(path, "opening", e))?;
            // The library opened the path again: it must still be the file checked above.
            identity.check(path)?;
            open_metadata(path, &file, names, Some(&plain), file_len)
        })?;
        shared.opened = Some(Arc::new(plain));
        shared.identity = Some(identity);
        Ok(Hdf5 {
            shared: Arc::new(shared),
        })
    }
}

/// What the file's metadata says: imagefeed's layout when it carries our attribute, else one
/// of the layouts others write. Runs inside the HDF5 gate. `plain` is the file as opened, for
/// what is read without the library (h5py's variable-length descriptors); the trial child has
/// none.
fn open_metadata(
    path: &Path,
    file: &hdf5::File,
    names: &Hdf5Names,
    plain: Option<&fs::File>,
    file_len: u64,
) -> Result<Shared> {
    if file
        .attr_names()
        .is_ok_and(|n| n.iter().any(|n| n == INFO_ATTR))
    {
        open_imagefeed(path, file, file_len)
    } else {
        open_foreign(path, file, names, plain, file_len)
    }
}

/// True when `path` is an HDF5 file an imagefeed writer made (its `imagefeed` attribute carries
/// [`MAGIC`]): what `--force` may replace. h5py files of other layouts are not.
pub(crate) fn is_own_file(path: &Path) -> bool {
    if !has_signature(path) {
        return false;
    }
    // Not ours if libhdf5 cannot open it without crashing or looping.
    let trial = super::probe::try_in_child(path, || {
        gate::run(|| {
            let _ = open_unlocked(path).map(|file| file.attr(INFO_ATTR));
        })
    });
    if trial.is_err() {
        return false;
    }
    gate::run(|| {
        let Ok(file) = open_unlocked(path) else {
            return false;
        };
        file.attr(INFO_ATTR)
            .and_then(|a| a.read_scalar::<VarLenUnicode>())
            .ok()
            .and_then(|json| serde_json::from_str::<InfoRecord>(checked_str(json.as_bytes())?).ok())
            .is_some_and(|record| record.magic == MAGIC)
    })
}

/// Replaces the progress record in the staging directory `partial`.
fn save_staged_progress(
    partial: &Path,
    plan: &PackPlan,
    progress: &PackProgress,
    payload_bytes: u64,
    index_bytes: u64,
) -> Result<()> {
    let staged = StagedProgress {
        magic: MAGIC.into(),
        plan: plan.clone(),
        progress: progress.clone(),
        payload_bytes,
        index_bytes,
    };
    output::write_file_atomically(
        &partial.join(STAGED_PROGRESS),
        &serde_json::to_vec(&staged).expect("progress serializes"),
    )
}

/// Opens a file read-only without HDF5's file lock.
///
/// libhdf5 opens files without `O_CLOEXEC` and `flock`s them, so a child process started while
/// a file is open (a DataLoader worker, a `Command`) inherits the lock and keeps it for its
/// lifetime, and another process's open then fails with "unable to lock file". imagefeed never
/// modifies a published file (and writes only a private staging copy), so the lock protects
/// nothing here.
fn open_unlocked(path: &Path) -> hdf5::Result<hdf5::File> {
    hdf5::File::with_options()
        .with_fapl(|fapl| fapl.file_locking(false))
        .open(path)
}

fn open_imagefeed(path: &Path, file: &hdf5::File, file_len: u64) -> Result<Shared> {
    let h5 = |doing: &'static str| move |e: hdf5::Error| gate::error(path, doing, e);
    let json: VarLenUnicode = file
        .attr(INFO_ATTR)
        .and_then(|a| a.read_scalar())
        .map_err(h5("reading the imagefeed attribute"))?;
    let json = checked_str(json.as_bytes())
        .ok_or_else(|| Error::not_a_dataset(path, "the imagefeed attribute is not UTF-8"))?;
    let record: InfoRecord = serde_json::from_str(json)
        .map_err(|e| Error::not_a_dataset(path, format!("malformed imagefeed attribute: {e}")))?;
    crate::format::check_layout(
        path,
        "imagefeed attribute magic",
        &record.magic,
        MAGIC,
        record.version,
        VERSION,
    )?;
    crate::format::require_complete(path, record.complete, "the file")?;
    let mut info = record.info;
    info.format = FormatKind::Hdf5;
    let n = info.num_samples;
    // Each dataset's size is checked against the file before it is read into memory.
    let open = |name: &'static str| -> Result<hdf5::Dataset> {
        let dataset = file.dataset(name).map_err(h5("opening a dataset"))?;
        check_stored(path, &dataset, name, file_len)?;
        Ok(dataset)
    };
    let offsets: Vec<u64> = open(OFFSETS)?.read_raw().map_err(h5("reading offsets"))?;
    let labels: Vec<i64> = open(LABELS)?.read_raw().map_err(h5("reading labels"))?;
    let keys: Vec<VarLenUnicode> = open(KEYS)?.read_raw().map_err(h5("reading keys"))?;
    let mut notices = Vec::new();
    let checksums: Option<Vec<u32>> = if record.version >= CHECKSUMS_SINCE {
        let sums: Vec<u32> = open(CHECKSUMS)?
            .read_raw()
            .map_err(h5("reading checksums"))?;
        if sums.len() != n {
            return Err(Error::not_a_dataset(
                path,
                format!("{n} samples, but {} checksums", sums.len()),
            ));
        }
        Some(sums)
    } else if file.link_exists(CHECKSUMS) {
        // A version-1 file never has the dataset: see the LMDB reader.
        return Err(crate::format::checksums_contradiction(
            path,
            record.version,
            "dataset",
        ));
    } else {
        crate::dataset::notice(&mut notices, crate::format::unchecked_notice(path));
        None
    };
    if Some(offsets.len()) != n.checked_add(1) || labels.len() != n || keys.len() != n {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "{n} samples, but {} offsets (want N+1), {} labels and {} keys",
                offsets.len(),
                labels.len(),
                keys.len()
            ),
        ));
    }
    let images = file.dataset(IMAGES).map_err(h5("opening images"))?;
    let data_len = check_stored(path, &images, IMAGES, file_len)?;
    let data_offset = contiguous_offset(&images, data_len)
        .ok_or_else(|| Error::not_a_dataset(path, "the images dataset is chunked or compressed"))?;
    check_inside_file(path, data_offset, data_len, file_len)?;
    Ok(Shared {
        path: path.to_path_buf(),
        info,
        labels,
        layout: Layout::Imagefeed {
            data_offset,
            data_len,
            offsets,
            keys: utf8_keys(path, &keys)?,
            checksums,
        },
        notices,
        opened: None,
        identity: None,
    })
}

/// How much smaller than its data a filtered (compressed) dataset's storage can be: deflate's
/// limit is about 1032:1.
const MAX_COMPRESSION: u64 = 1100;

/// The filters (compression, checksums) a dataset's chunks pass through, each checked to be one
/// this build can undo: libhdf5's own (deflate, shuffle, fletcher32, scale-offset, n-bit, and
/// szip where the library was built with it), h5py's `lzf` and hdf5plugin's Blosc (registered
/// by the hdf5 crate's features), or a plugin libhdf5 loads from `HDF5_PLUGIN_PATH`. Any other
/// is [`Error::Unsupported`] naming the filter and the remedy, at open: otherwise every record
/// would read as a bad sample and the dataset would look like a short one.
fn readable_filters(
    path: &Path,
    dataset: &hdf5::Dataset,
    name: &str,
) -> Result<Vec<hdf5::filters::Filter>> {
    let filters = dataset
        .dcpl()
        .and_then(|pipeline| pipeline.get_filters())
        .map_err(|e| gate::error(path, &format!("reading the filters of {name:?}"), e))?;
    for filter in &filters {
        if !filter.decode_enabled() {
            let id = filter.id();
            return Err(Error::Unsupported {
                path: path.to_path_buf(),
                what: format!(
                    "dataset {name:?}, stored through the {} filter (HDF5 filter {id}),",
                    filter_name(id)
                ),
                remedy: filter_remedy(id),
            });
        }
    }
    Ok(filters)
}

/// The name people know an HDF5 filter by (the registered ids of libhdf5 and the HDF Group's
/// list of plugins).
fn filter_name(id: i32) -> &'static str {
    match id {
        1 => "deflate (gzip)",
        2 => "shuffle",
        3 => "fletcher32",
        4 => "szip",
        5 => "n-bit",
        6 => "scale-offset",
        32000 => "lzf",
        32001 => "blosc",
        32004 => "lz4",
        32008 => "bitshuffle",
        32013 => "zfp",
        32015 => "zstd",
        32017 => "sz",
        32026 => "blosc2",
        _ => "unknown",
    }
}

/// What to do about a filter this build cannot undo.
fn filter_remedy(id: i32) -> String {
    let rewrite = "or rewrite the file without it (h5py: compression=\"gzip\" or \"lzf\")";
    match id {
        4 => format!(
            "this libhdf5 was built without szip (libaec); use one built with it, {rewrite}"
        ),
        1..=6 => format!("this libhdf5 lacks the filter; {rewrite}"),
        _ => match std::env::var_os("HDF5_PLUGIN_PATH").filter(|p| !p.is_empty()) {
            Some(set) => format!(
                "this build has no decoder for it, and no plugin in HDF5_PLUGIN_PATH ({}) \
                 provides one; point it at a directory that does (hdf5plugin's: python -c \
                 \"import hdf5plugin; print(hdf5plugin.PLUGIN_PATH)\"), {rewrite}",
                set.to_string_lossy()
            ),
            None => format!(
                "this build has no decoder for it; install the plugin (pip install hdf5plugin) \
                 and set HDF5_PLUGIN_PATH to its directory (python -c \"import hdf5plugin; \
                 print(hdf5plugin.PLUGIN_PATH)\"), {rewrite}"
            ),
        },
    }
}

/// Refuses a dataset whose declared shape needs more bytes than the file can hold, before it is
/// read into memory: a hostile file can declare a shape of 10¹² elements with no storage behind
/// it, and reading it would allocate that much. Unfiltered data must fit in the file; filtered
/// data in what its allocated storage can decompress to. Returns the declared size in bytes.
fn check_stored(path: &Path, dataset: &hdf5::Dataset, name: &str, file_len: u64) -> Result<u64> {
    let shape = dataset.shape();
    let element = dataset.dtype().map(|t| t.size()).unwrap_or(1).max(1) as u64;
    let bytes = shape
        .iter()
        .try_fold(element, |n, &d| n.checked_mul(d as u64));
    let filtered = !readable_filters(path, dataset, name)?.is_empty();
    let can_hold = if filtered {
        dataset.storage_size().saturating_mul(MAX_COMPRESSION)
    } else {
        file_len
    };
    match bytes {
        Some(bytes) if bytes <= can_hold => Ok(bytes),
        _ => Err(Error::not_a_dataset(
            path,
            format!(
                "dataset {name:?} declares shape {shape:?} ({} bytes), more than the {} can hold \
                 ({can_hold} bytes)",
                bytes.map_or("over 2^64".to_string(), |b| b.to_string()),
                if filtered {
                    "storage allocated for it"
                } else {
                    "file"
                }
            ),
        )),
    }
}

/// The file offset of a dataset's bytes, when they are one contiguous unfiltered run.
fn contiguous_offset(dataset: &hdf5::Dataset, len: u64) -> Option<u64> {
    if dataset.is_chunked() || !dataset.filters().is_empty() {
        return None;
    }
    if len == 0 {
        return Some(0);
    }
    dataset.offset()
}

fn check_inside_file(path: &Path, offset: u64, len: u64, file_len: u64) -> Result<()> {
    if offset.saturating_add(len) > file_len {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "truncated: the images data needs bytes {offset}..{} but the file has {file_len}",
                offset.saturating_add(len)
            ),
        ));
    }
    Ok(())
}

fn open_foreign(
    path: &Path,
    file: &hdf5::File,
    names: &Hdf5Names,
    plain: Option<&fs::File>,
    file_len: u64,
) -> Result<Shared> {
    let h5 = |doing: String| move |e: hdf5::Error| gate::error(path, &doing, e);
    let members = file.member_names().unwrap_or_default();
    let missing = |name: &str| {
        Error::not_a_dataset(
            path,
            format!(
                "HDF5 file without imagefeed's layout and without a dataset {name:?} (it has {}); \
                 name the images and labels datasets",
                if members.is_empty() {
                    "no datasets".to_string()
                } else {
                    members.join(", ")
                }
            ),
        )
    };
    if !file.link_exists(&names.images) {
        return Err(missing(&names.images));
    }
    if !file.link_exists(&names.labels) {
        return Err(missing(&names.labels));
    }
    let images = file
        .dataset(&names.images)
        .map_err(h5(format!("opening {:?}", names.images)))?;
    let labels_ds = file
        .dataset(&names.labels)
        .map_err(h5(format!("opening {:?}", names.labels)))?;
    let label_type = labels_ds
        .dtype()
        .and_then(|t| t.to_descriptor())
        .map_err(h5(format!("reading the type of {:?}", names.labels)))?;
    if !matches!(
        label_type,
        TypeDescriptor::Integer(_) | TypeDescriptor::Unsigned(_)
    ) {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "{:?} holds {label_type} values; labels must be integers (class indices), and \
                 non-integer ones would be cut silently",
                names.labels
            ),
        ));
    }
    check_stored(path, &labels_ds, &names.labels, file_len)?;
    check_stored(path, &images, &names.images, file_len)?;
    let labels: Vec<i64> = labels_ds
        .read_raw()
        .map_err(h5(format!("reading {:?} as integers", names.labels)))?;
    let shape = images.shape();
    let n = shape.first().copied().unwrap_or(0);
    if labels.len() != n {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "{:?} has {n} images but {:?} has {} labels",
                names.images,
                names.labels,
                labels.len()
            ),
        ));
    }
    let dtype = images
        .dtype()
        .and_then(|t| t.to_descriptor())
        .map_err(h5(format!("reading the type of {:?}", names.images)))?;
    let (layout, payload) = match (&dtype, shape.len()) {
        (TypeDescriptor::VarLenArray(inner), 1)
            if **inner == TypeDescriptor::Unsigned(hdf5::types::IntSize::U1) =>
        {
            (
                var_len_layout(path, &images, &names.images, n, plain, file_len)?,
                PayloadKind::Encoded,
            )
        }
        (TypeDescriptor::Unsigned(hdf5::types::IntSize::U1), 3 | 4) => {
            let (height, width) = (shape[1], shape[2]);
            let channels = shape.get(3).copied().unwrap_or(1);
            if !matches!(channels, 1 | 3 | 4) {
                return Err(Error::not_a_dataset(
                    path,
                    format!(
                        "{:?} has {channels} channels; pixel arrays need 1, 3 or 4",
                        names.images
                    ),
                ));
            }
            let pixels = (height as u64).saturating_mul(width as u64);
            if pixels == 0 || pixels > crate::decode::DEFAULT_MAX_PIXELS {
                return Err(Error::not_a_dataset(
                    path,
                    format!(
                        "{:?} holds {height}x{width} images; each must have 1..={} pixels",
                        names.images,
                        crate::decode::DEFAULT_MAX_PIXELS
                    ),
                ));
            }
            // Fits in u64: check_stored accepted the whole array's size.
            let len = n as u64 * pixels * channels as u64;
            let file_offset = contiguous_offset(&images, len);
            if let Some(offset) = file_offset {
                check_inside_file(path, offset, len, file_len)?;
            }
            (
                Layout::Pixels {
                    images: names.images.clone(),
                    rank: shape.len(),
                    height,
                    width,
                    channels,
                    file_offset,
                },
                PayloadKind::RawRgb8,
            )
        }
        _ => {
            return Err(Error::not_a_dataset(
                path,
                format!(
                    "{:?} is {dtype} with shape {shape:?}; expected variable-length uint8 \
                     (encoded images) or an N×H×W×C uint8 array",
                    names.images
                ),
            ));
        }
    };
    let mut notices = Vec::new();
    let classes = match class_names(file, file_len).or_else(|| class_names(&labels_ds, file_len)) {
        Some(classes) => classes,
        None => {
            let mut inference = crate::dataset::ClassInference::default();
            for (index, &label) in labels.iter().enumerate() {
                inference.see(|| format!("{}[{index}]", names.labels), Some(label));
            }
            let (classes, notice) = inference.classes();
            notices.extend(notice);
            classes
        }
    };
    Ok(Shared {
        path: path.to_path_buf(),
        info: DatasetInfo {
            format: FormatKind::Hdf5,
            classes,
            num_samples: n,
            payload,
            resized_short_side: None,
            part: None,
            rejected_at_pack: None,
        },
        labels,
        layout,
        notices,
        opened: None,
        identity: None,
    })
}

/// How h5py's variable-length images are read: each element's descriptor (its global heap ID)
/// is read here, from where the library says the dataset's raw data lies, so that records are
/// read with `pread` (`heap`) and never through the library. Descriptors stored through a
/// filter are read through the library instead. In the trial child (`plain` is `None`) only the
/// library's part runs.
fn var_len_layout(
    path: &Path,
    images: &hdf5::Dataset,
    name: &str,
    n: usize,
    plain: Option<&fs::File>,
    file_len: u64,
) -> Result<Layout> {
    let through_library = Layout::VarLenThroughLibrary {
        images: name.to_string(),
    };
    let Some(runs) = descriptor_runs(path, images, name, n)? else {
        return Ok(through_library);
    };
    let Some(plain) = plain else {
        return Ok(through_library);
    };
    let mut head = [0u8; 48];
    let got = plain.read_at(&mut head, 0).at(path)?;
    let widths = heap::superblock_widths(&head[..got])
        .map_err(|reason| Error::not_a_dataset(path, reason))?;
    let size = widths.descriptor() as u64;
    let mut ids = Vec::with_capacity(n);
    let mut bytes = Vec::new();
    for run in runs {
        let Some(address) = run.address else {
            // Storage never written: the elements are empty, as the library reads them.
            ids.extend(std::iter::repeat_n(HeapId::EMPTY, run.count));
            continue;
        };
        let len = run.count as u64 * size;
        if run.stored.is_some_and(|stored| stored < len) {
            return Err(Error::not_a_dataset(
                path,
                format!(
                    "a chunk of {name:?} at byte {address} holds {} bytes, too few for its {} \
                     element descriptors",
                    run.stored.unwrap_or(0),
                    run.count
                ),
            ));
        }
        if address.checked_add(len).is_none_or(|end| end > file_len) {
            return Err(Error::not_a_dataset(
                path,
                format!(
                    "{name:?}'s element descriptors lie at bytes {address}..+{len}, past the end \
                     of the {file_len}-byte file (truncated?)"
                ),
            ));
        }
        bytes.resize(len as usize, 0);
        plain.read_exact_at(&mut bytes, address).at(path)?;
        ids.extend(heap::parse_descriptors(&bytes, &widths));
    }
    debug_assert_eq!(ids.len(), n);
    Ok(Layout::VarLen {
        images: name.to_string(),
        widths,
        ids,
    })
}

/// `count` consecutive element descriptors at file offset `address` (`None`: never written),
/// in storage of `stored` bytes (`None`: as many as the file holds past `address`).
struct DescriptorRun {
    address: Option<u64>,
    count: usize,
    stored: Option<u64>,
}

/// The most chunks whose addresses are looked up one by one: libhdf5 1.10 walks the chunk
/// index for each lookup, so the time grows with the square of their number (64,000 chunks took
/// 26 s). A dataset of more chunks (h5py's `chunks=(1,)`, appended one element at a time) is
/// read through the library.
const MAX_CHUNK_LOOKUPS: usize = 4096;

/// Where the raw data of a one-dimensional variable-length dataset lies, in element order: one
/// run when it is contiguous, one per chunk when it is chunked; `None` when the library must
/// read it: stored through a filter (the bytes on disk are not the descriptors), compact (in the
/// object header), virtual or in external files, or in too many chunks.
fn descriptor_runs(
    path: &Path,
    dataset: &hdf5::Dataset,
    name: &str,
    n: usize,
) -> Result<Option<Vec<DescriptorRun>>> {
    if !readable_filters(path, dataset, name)?.is_empty() {
        return Ok(None);
    }
    if n == 0 {
        return Ok(Some(Vec::new()));
    }
    let dcpl = dataset
        .dcpl()
        .map_err(|e| gate::error(path, &format!("reading the layout of {name:?}"), e))?;
    match dcpl.layout() {
        hdf5::dataset::Layout::Contiguous if dcpl.external().is_empty() => {
            return Ok(match dataset.offset() {
                Some(address) => Some(vec![DescriptorRun {
                    address: Some(address),
                    count: n,
                    stored: None,
                }]),
                // Never written: every element is empty.
                None if dataset.storage_size() == 0 => Some(vec![DescriptorRun {
                    address: None,
                    count: n,
                    stored: None,
                }]),
                None => None,
            });
        }
        hdf5::dataset::Layout::Chunked => {}
        _ => return Ok(None),
    }
    let chunk = dataset
        .chunk()
        .and_then(|c| c.first().copied())
        .filter(|&c| c > 0)
        .ok_or_else(|| {
            Error::not_a_dataset(path, format!("{name:?} is chunked with no chunk shape"))
        })?;
    if n.div_ceil(chunk) > MAX_CHUNK_LOOKUPS {
        return Ok(None);
    }
    let mut runs = Vec::with_capacity(n.div_ceil(chunk));
    for start in (0..n).step_by(chunk) {
        let offset = [start as hdf5_sys::h5::hsize_t];
        let (mut mask, mut address, mut size) = (0, 0, 0);
        // SAFETY: the dataset id is valid while `dataset` lives; `offset` has one coordinate
        // per dimension (the dataset is one-dimensional) and the out-pointers are valid.
        let status = unsafe {
            hdf5_sys::h5d::H5Dget_chunk_info_by_coord(
                dataset.id(),
                offset.as_ptr(),
                &mut mask,
                &mut address,
                &mut size,
            )
        };
        if status < 0 {
            return Err(Error::not_a_dataset(
                path,
                format!("libhdf5 could not locate the chunk of {name:?} at element {start}"),
            ));
        }
        runs.push(DescriptorRun {
            address: (address != hdf5_sys::h5::HADDR_UNDEF).then_some(address),
            count: chunk.min(n - start),
            stored: Some(size),
        });
    }
    Ok(Some(runs))
}

/// The stored keys as strings. `VarLenUnicode::as_str` does not check its bytes, so each is
/// checked here: a key that is not UTF-8 is an error naming its index, never an invalid string.
fn utf8_keys(path: &Path, keys: &[VarLenUnicode]) -> Result<Vec<String>> {
    keys.iter()
        .enumerate()
        .map(|(index, k)| {
            checked_str(k.as_bytes())
                .map(str::to_owned)
                .ok_or_else(|| Error::CorruptRecord {
                    path: path.to_path_buf(),
                    index,
                    key: format!("#{index}"),
                    reason: "the stored key is not UTF-8".into(),
                })
        })
        .collect()
}

/// A stored string's bytes checked as UTF-8 (the hdf5 crate's `as_str` does not check).
fn checked_str(bytes: &[u8]) -> Option<&str> {
    std::str::from_utf8(bytes).ok()
}

/// The `classes` attribute of `location` as strings, when it has one. An attribute declaring
/// more strings than the file can hold is not read (libhdf5 would allocate and convert them
/// all: a damaged dimension took gigabytes and minutes).
fn class_names(location: &hdf5::Location, file_len: u64) -> Option<Vec<String>> {
    let attr = location.attr(CLASSES_ATTR).ok()?;
    // Each string's stored element (a variable-length string's descriptor, or a fixed-length
    // string's bytes) is at least 10 bytes, or the size its type declares.
    let element = attr.dtype().ok()?.size().max(10) as u64;
    let strings = attr
        .shape()
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d as u64))?;
    if strings.saturating_mul(element) > file_len {
        return None;
    }
    if let Ok(names) = attr.read_raw::<VarLenUnicode>() {
        return names
            .iter()
            .map(|s| checked_str(s.as_bytes()).map(str::to_owned))
            .collect();
    }
    attr.read_raw::<hdf5::types::VarLenAscii>()
        .ok()
        .and_then(|names| {
            names
                .iter()
                .map(|s| checked_str(s.as_bytes()).map(str::to_owned))
                .collect()
        })
}

impl Dataset for Hdf5 {
    fn info(&self) -> &DatasetInfo {
        &self.shared.info
    }

    fn notices(&self) -> &[String] {
        &self.shared.notices
    }

    fn path(&self) -> &Path {
        &self.shared.path
    }

    fn open_reader(&self) -> Result<Box<dyn RecordReader>> {
        let shared = Arc::clone(&self.shared);
        let path = &shared.path;
        let pread = matches!(
            shared.layout,
            Layout::Imagefeed { .. }
                | Layout::VarLen { .. }
                | Layout::Pixels {
                    file_offset: Some(_),
                    ..
                }
        );
        let (file, dataset) = if pread {
            (shared.opened.clone(), None)
        } else {
            let name = match &shared.layout {
                Layout::VarLenThroughLibrary { images } | Layout::Pixels { images, .. } => images,
                Layout::Imagefeed { .. } | Layout::VarLen { .. } => {
                    unreachable!("read with pread")
                }
            };
            // The library opens the path again: before and after, it must be the file the
            // dataset was opened from, or this worker would read another file's records.
            let check = || shared.identity.as_ref().map_or(Ok(()), |id| id.check(path));
            check()?;
            let dataset = gate::run(|| {
                open_unlocked(path)
                    .and_then(|f| f.dataset(name))
                    .map(Gated::new)
                    .map_err(|e| gate::error(path, "opening a reader", e))
            })?;
            check()?;
            (None, Some(dataset))
        };
        let heap = match &shared.layout {
            Layout::VarLen { widths, .. } => {
                let file_len = shared.identity.as_ref().map_or(0, |id| id.len);
                Some(HeapReader::new(*widths, file_len))
            }
            _ => None,
        };
        Ok(Box::new(Hdf5Reader {
            shared,
            file,
            dataset,
            heap,
            buffer: Vec::new(),
            pixels: Vec::new(),
            key: String::new(),
        }))
    }
}

/// Per-worker handle: the dataset's descriptor for `pread` (shared), or its own library handle.
struct Hdf5Reader {
    shared: Arc<Shared>,
    file: Option<Arc<fs::File>>,
    /// The library's handle, for the layouts read through it.
    dataset: Option<Gated<hdf5::Dataset>>,
    /// Reads h5py's variable-length elements (`Layout::VarLen`).
    heap: Option<HeapReader>,
    /// The payload handed out by `read`.
    buffer: Vec<u8>,
    /// Pixels of a pixel-array sample before they become a raw payload.
    pixels: Vec<u8>,
    /// The key of a sample from a file without keys (`images[i]`).
    key: String,
}

impl Hdf5Reader {
    fn set_key(&mut self, images: &str, index: usize) {
        use std::fmt::Write as _;
        self.key.clear();
        let _ = write!(self.key, "{images}[{index}]");
    }

    fn corrupt(&self, index: usize, key: &str, reason: impl Into<String>) -> Error {
        Error::CorruptRecord {
            path: self.shared.path.clone(),
            index,
            key: key.to_string(),
            reason: reason.into(),
        }
    }

    /// Turns the `H×W×C` pixels in `self.pixels` into a raw RGB payload in `self.buffer`.
    fn pixels_to_raw(&mut self, height: usize, width: usize, channels: usize) {
        RawImage::start(&mut self.buffer, width as u32, height as u32);
        match channels {
            3 => self.buffer.extend_from_slice(&self.pixels),
            1 => self
                .buffer
                .extend(self.pixels.iter().flat_map(|&g| [g, g, g])),
            _ => self.buffer.extend(
                self.pixels
                    .chunks_exact(channels)
                    .flat_map(|p| [p[0], p[1], p[2]]),
            ),
        }
    }
}

/// Reads `len` bytes at `offset` into `buffer` (resized to fit), or says why it could not.
fn pread_exact(
    file: Option<&fs::File>,
    buffer: &mut Vec<u8>,
    offset: u64,
    len: usize,
) -> std::result::Result<(), String> {
    buffer.resize(len, 0);
    let file = file.expect("pread layouts open a file");
    file.read_exact_at(buffer, offset).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            format!(
                "bytes {offset}..{} are past the end of the file (truncated?)",
                offset + len as u64
            )
        } else {
            format!("read failed: {e}")
        }
    })
}

impl RecordReader for Hdf5Reader {
    fn read(&mut self, index: usize) -> Result<Record<'_>> {
        let shared = Arc::clone(&self.shared);
        assert!(
            index < shared.info.num_samples,
            "index {index} out of range for {} samples",
            shared.info.num_samples
        );
        match &shared.layout {
            Layout::Imagefeed {
                data_offset,
                data_len,
                offsets,
                keys,
                checksums,
            } => {
                let key = keys[index].as_str();
                let (start, end) = (offsets[index], offsets[index + 1]);
                if start > end || end > *data_len {
                    return Err(self.corrupt(
                        index,
                        key,
                        format!(
                            "offsets {start}..{end} are outside the {data_len}-byte images dataset"
                        ),
                    ));
                }
                let len = (end - start) as usize;
                pread_exact(
                    self.file.as_deref(),
                    &mut self.buffer,
                    data_offset + start,
                    len,
                )
                .map_err(|reason| self.corrupt(index, key, reason))?;
                if let Some(checksums) = checksums {
                    let label = shared.labels[index] as u32;
                    let computed = crate::format::record_checksum(label, key, &self.buffer);
                    if computed != checksums[index] {
                        let reason = crate::format::checksum_mismatch(checksums[index], computed);
                        return Err(self.corrupt(index, key, reason));
                    }
                }
            }
            Layout::VarLen { images, ids, .. } => {
                self.set_key(images, index);
                let heap = self
                    .heap
                    .as_mut()
                    .expect("a VarLen reader has a heap reader");
                let file = self.file.as_deref().expect("pread layouts open a file");
                match heap.read(file, &ids[index]) {
                    Ok(bytes) => {
                        self.buffer.clear();
                        self.buffer.extend_from_slice(bytes);
                    }
                    Err(reason) => return Err(self.corrupt(index, &self.key, reason)),
                }
            }
            Layout::VarLenThroughLibrary { images } => {
                self.set_key(images, index);
                let buffer = &mut self.buffer;
                self.dataset
                    .as_ref()
                    .expect("library layouts open a dataset")
                    .with(|dataset| {
                        // The library's error (and the elements it allocated) are let go
                        // inside the gate.
                        let element = dataset
                            .read_slice_1d::<VarLenArray<u8>, _>(index..index + 1)
                            .map_err(|e| e.to_string())?;
                        buffer.clear();
                        buffer.extend_from_slice(element[0].as_slice());
                        Ok(())
                    })
                    .map_err(|e: String| self.corrupt(index, &self.key, format!("HDF5: {e}")))?;
            }
            &Layout::Pixels {
                ref images,
                rank,
                height,
                width,
                channels,
                file_offset,
            } => {
                self.set_key(images, index);
                let len = height * width * channels;
                match file_offset {
                    Some(offset) => {
                        let offset = offset + (index * len) as u64;
                        pread_exact(self.file.as_deref(), &mut self.pixels, offset, len)
                            .map_err(|reason| self.corrupt(index, &self.key, reason))?
                    }
                    None => {
                        let mut selection = vec![hdf5::SliceOrIndex::Index(index)];
                        selection.resize(rank, hdf5::SliceOrIndex::from(..));
                        let pixels = &mut self.pixels;
                        self.dataset
                            .as_ref()
                            .expect("library layouts open a dataset")
                            .with(|dataset| {
                                let read = dataset
                                    .read_slice::<u8, _, ndarray::IxDyn>(hdf5::Hyperslab::from(
                                        selection,
                                    ))
                                    .map_err(|e| e.to_string())?;
                                pixels.clear();
                                pixels.extend(read.iter().copied());
                                Ok(())
                            })
                            .map_err(|e: String| {
                                self.corrupt(index, &self.key, format!("HDF5: {e}"))
                            })?;
                    }
                }
                self.pixels_to_raw(height, width, channels);
            }
        }
        let key: &str = match &self.shared.layout {
            Layout::Imagefeed { keys, .. } => keys[index].as_str(),
            _ => self.key.as_str(),
        };
        let label =
            shared
                .info
                .check_stored_label(&shared.path, index, key, shared.labels[index])?;
        Ok(Record {
            index,
            key,
            label,
            payload: &self.buffer,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_checksums_match_whatever_the_block_boundaries() {
        // Payloads of 0, 1, 5, 0 and 9 bytes; the stream is cut into blocks of every size from
        // 1 byte to all of it, so boundaries fall inside, at the start and at the end of records.
        let payloads: [&[u8]; 5] = [b"", b"a", b"bcdef", b"", b"ghijklmno"];
        let labels = [0i64, 1, 2, 1, 0];
        let keys: Vec<String> = (0..5).map(|i| format!("c/{i}.jpg")).collect();
        let mut offsets = vec![0u64];
        for p in payloads {
            offsets.push(offsets.last().unwrap() + p.len() as u64);
        }
        let stream: Vec<u8> = payloads.concat();
        let want: Vec<u32> = (0..5)
            .map(|i| crate::format::record_checksum(labels[i] as u32, &keys[i], payloads[i]))
            .collect();
        for block in 1..=stream.len() {
            let mut sums = RecordChecksums::new(&offsets, &labels, &keys);
            for (n, chunk) in stream.chunks(block).enumerate() {
                sums.update((n * block) as u64, chunk);
            }
            assert_eq!(sums.finish(), want, "blocks of {block}");
        }
        // Zero records.
        assert!(RecordChecksums::new(&[0], &[], &[]).finish().is_empty());
    }

    #[test]
    fn staged_index_round_trips_and_rejects_cut_entries() {
        let mut bytes = Vec::new();
        for (end, label, key) in [(10u64, 2u32, "a/x.jpg"), (25, 0, "b/ü.png")] {
            push_staged_entry(&mut bytes, end, label, key);
        }
        let (ends, labels, keys) = parse_staged_index(&bytes).unwrap();
        assert_eq!(ends, [10, 25]);
        assert_eq!(labels, [2, 0]);
        assert_eq!(keys, ["a/x.jpg", "b/ü.png"]);
        assert!(
            parse_staged_index(&bytes[..bytes.len() - 1])
                .unwrap_err()
                .contains("inside a key")
        );
        assert!(
            parse_staged_index(&bytes[..20])
                .unwrap_err()
                .contains("inside")
        );
    }
}
