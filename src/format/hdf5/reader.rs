//! The HDF5 reader ([`Hdf5`]): opening (in a trial child first, see `probe`), imagefeed's layout,
//! and the per-worker readers of every layout; the layouts others write are found in `foreign`.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hdf5::types::{VarLenArray, VarLenUnicode};

use super::chunks::{ChunkGrid, ChunkLayout, ChunkReader};
use super::foreign::open_foreign;
use super::gate::{self, Gated};
use super::heap::{self, HeapId, HeapReader, Widths};
use super::storage::{check_inside_file, check_stored, contiguous_offset};
use super::{
    CHECKSUMS, CHECKSUMS_SINCE, Hdf5Names, IMAGES, INFO_ATTR, KEYS, LABELS, MAGIC, OFFSETS,
    VERSION, has_signature,
};
use crate::dataset::{Dataset, DatasetInfo, FormatKind, Record, RecordReader};
use crate::decode::RawImage;
use crate::error::{Error, IoContext as _, Result};
use crate::format::staging;
use crate::format::{FileIdentity, InfoRecord};

/// How samples are laid out in the file, with what reading them needs.
pub(super) enum Layout {
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
    /// The same, with the elements' descriptors where only the library reads them (compact,
    /// virtual, external, through a filter of its own): read through it, one at a time.
    VarLenThroughLibrary { images: String },
    /// An `N×H×W×C` `uint8` array.
    Pixels {
        images: String,
        rank: usize,
        height: usize,
        width: usize,
        channels: usize,
        storage: PixelStorage,
    },
}

/// Where a pixel array's bytes lie, and so how a worker reads a sample.
pub(super) enum PixelStorage {
    /// One unfiltered run at this file offset: read with `pread`.
    Contiguous(u64),
    /// In chunks read as stored and decoded by checked code (`chunks`).
    Chunked(Arc<ChunkLayout>),
    /// Through the library, sample by sample (a filter only it undoes, or more unfiltered
    /// chunks than [`ChunkLayout`] reads); for a chunked array, its chunks, so that a sample in
    /// a chunk never stored is a bad sample rather than the fill value.
    Library(Option<Arc<ChunkGrid>>),
}

pub(super) struct Shared {
    pub(super) path: PathBuf,
    pub(super) info: DatasetInfo,
    pub(super) labels: Vec<i64>,
    pub(super) layout: Layout,
    /// What opening found that a user should hear about (labels left out of the classes).
    pub(super) notices: Vec<String>,
    /// The file as opened: `pread` layouts read through this descriptor in every worker, so a
    /// file replaced on disk later (`mv new.h5 train.h5`) is not read by the workers that
    /// start after it; a reader the library opens by path checks `identity` instead.
    pub(super) opened: Option<Arc<fs::File>>,
    pub(super) identity: Option<FileIdentity>,
}

/// An HDF5 dataset opened for reading (see the module docs for the layouts).
pub struct Hdf5 {
    shared: Arc<Shared>,
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
        staging::refuse_interrupted(path)?;
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
        // (libhdf5 reads with `pread`: a part the disk cannot read fails the records in it,
        // each a bad sample, as it would without the read-through.)
        let _ = crate::pagecache::prefetch_if_it_fits(&plain);
        // Metadata that crashes or loops libhdf5 must cost an error, not the process: the
        // same open runs in a trial child first (see `probe`), with the reads the library does
        // record by record. The child has none of the parent's descriptors: it opens its own.
        super::probe::try_in_child(path, || {
            gate::run(|| {
                let plain = fs::File::open(path).ok();
                let opened = open_unlocked(path).ok().and_then(|file| {
                    open_metadata(path, &file, names, plain.as_ref(), file_len).ok()
                });
                if let Some(shared) = opened {
                    trial_reads(shared);
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

/// How long the trial child reads records through libhdf5 (see [`trial_reads`]).
const TRIAL_READING: std::time::Duration = std::time::Duration::from_secs(3);

/// How long the trial child looks up chunks in a chunked array's index before it reads records
/// (about 3 million lookups a second, warm: a dataset of 10 million chunks is walked whole).
const TRIAL_INDEX_WALK: std::time::Duration = std::time::Duration::from_secs(5);

/// In the trial child: reads the records libhdf5 has a part in reading (chunked pixel arrays,
/// whose chunks it finds in their index; those it reads whole through a filter of its own),
/// for up to [`TRIAL_READING`], so that damage the library meets only then crashes or stalls
/// the trial, refusing the file, instead of an epoch. Errors are ignored here: the process
/// meets them again as bad samples naming the record. A dataset too large to read in that
/// time is covered as far as the trial got.
fn trial_reads(shared: Shared) {
    if !matches!(
        shared.layout,
        Layout::VarLenThroughLibrary { .. }
            | Layout::Pixels {
                storage: PixelStorage::Chunked(_) | PixelStorage::Library(_),
                ..
            }
    ) {
        return;
    }
    let samples = shared.info.num_samples;
    let walking = std::time::Instant::now();
    if let Layout::Pixels {
        storage: PixelStorage::Chunked(layout),
        images,
        ..
    } = &shared.layout
    {
        // Every chunk's place in the index first: the index is what reads still ask libhdf5.
        if let Ok(dataset) = open_unlocked(&shared.path).and_then(|file| file.dataset(images)) {
            super::chunks::walk_index(layout, &dataset, walking + TRIAL_INDEX_WALK);
        }
    }
    let dataset = Hdf5 {
        shared: Arc::new(shared),
    };
    let Ok(mut reader) = dataset.open_reader() else {
        return;
    };
    let started = std::time::Instant::now();
    for index in 0..samples {
        let _ = reader.read(index);
        if started.elapsed() > TRIAL_READING {
            break;
        }
    }
}

/// What the file's metadata says: imagefeed's layout when it carries our attribute, else one
/// of the layouts others write. Runs inside the HDF5 gate. `plain` is the file as opened, for
/// what is read without the library (h5py's variable-length descriptors; the trial child
/// opens its own).
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

/// Opens a file read-only without HDF5's file lock.
///
/// libhdf5 opens files without `O_CLOEXEC` and `flock`s them, so a child process started while
/// a file is open (a DataLoader worker, a `Command`) inherits the lock and keeps it for its
/// lifetime, and another process's open then fails with "unable to lock file". imagefeed never
/// modifies a published file (and writes only a private staging copy), so the lock protects
/// nothing here.
pub(super) fn open_unlocked(path: &Path) -> hdf5::Result<hdf5::File> {
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
    crate::format::check_classes(path, &record.info.classes)?;
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
    // The writer puts the class names in the metadata and, for h5py users, in a `classes`
    // attribute: two lists that differ (an edit) would have h5py and imagefeed label alike
    // images differently (a hostile try).
    if let super::class_names::ClassNames::Names(listed) =
        super::class_names::attribute_names(file, file_len)
        && listed != info.classes
    {
        crate::dataset::notice(
            &mut notices,
            format!(
                "{}: its {:?} attribute (what h5py reads) names other classes than \
                 its metadata; the metadata's are read",
                path.display(),
                super::CLASSES_ATTR
            ),
        );
    }
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

/// The stored keys as strings. `VarLenUnicode::as_str` does not check its bytes, so each is
/// checked here: a key that is not UTF-8 is an error naming its index, never an invalid string.
pub(super) fn utf8_keys(path: &Path, keys: &[VarLenUnicode]) -> Result<Vec<String>> {
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
pub(super) fn checked_str(bytes: &[u8]) -> Option<&str> {
    std::str::from_utf8(bytes).ok()
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

    fn record_checksums(&self) -> Option<&[u32]> {
        match &self.shared.layout {
            Layout::Imagefeed { checksums, .. } => checksums.as_deref(),
            _ => None,
        }
    }

    fn open_reader(&self) -> Result<Box<dyn RecordReader>> {
        let shared = Arc::clone(&self.shared);
        let path = &shared.path;
        let pread = matches!(
            shared.layout,
            Layout::Imagefeed { .. }
                | Layout::VarLen { .. }
                | Layout::Pixels {
                    storage: PixelStorage::Contiguous(_),
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
            chunks: ChunkReader::new(),
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
    /// Reads chunked pixel arrays (`PixelStorage::Chunked`).
    chunks: ChunkReader,
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
    heap::read_at(file.expect("pread layouts open a file"), buffer, offset)
}

impl Hdf5Reader {
    /// imagefeed's layout: the payload at its offsets, checked against its checksum.
    fn read_imagefeed(&mut self, index: usize) -> Result<()> {
        let shared = Arc::clone(&self.shared);
        let Layout::Imagefeed {
            data_offset,
            data_len,
            offsets,
            keys,
            checksums,
        } = &shared.layout
        else {
            unreachable!("called for imagefeed's layout")
        };
        let key = keys[index].as_str();
        let (start, end) = (offsets[index], offsets[index + 1]);
        if start > end || end > *data_len {
            return Err(self.corrupt(
                index,
                key,
                format!("offsets {start}..{end} are outside the {data_len}-byte images dataset"),
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
        Ok(())
    }

    /// An h5py variable-length element read through the library (`self.buffer`).
    fn read_var_len_through_library(&mut self, index: usize) -> Result<()> {
        let buffer = &mut self.buffer;
        self.dataset
            .as_ref()
            .expect("library layouts open a dataset")
            .with(|dataset| {
                // The library's error (and the elements it allocated) are let go inside the
                // gate.
                let element = dataset
                    .read_slice_1d::<VarLenArray<u8>, _>(index..index + 1)
                    .map_err(|e| e.to_string())?;
                buffer.clear();
                buffer.extend_from_slice(element[0].as_slice());
                Ok(())
            })
            .map_err(|e: String| self.corrupt(index, &self.key, format!("HDF5: {e}")))
    }

    /// Sample `index` (`len` bytes) of a pixel array into `self.pixels`, however it is stored.
    fn read_pixels(
        &mut self,
        index: usize,
        len: usize,
        rank: usize,
        storage: &PixelStorage,
    ) -> Result<()> {
        match storage {
            PixelStorage::Contiguous(offset) => {
                let offset = offset + (index * len) as u64;
                pread_exact(self.file.as_deref(), &mut self.pixels, offset, len)
                    .map_err(|reason| self.corrupt(index, &self.key, reason))
            }
            PixelStorage::Chunked(layout) => {
                let dataset = self
                    .dataset
                    .as_ref()
                    .expect("chunked layouts open a dataset");
                self.chunks
                    .read_row(layout, dataset, index, &mut self.pixels)
                    .map_err(|reason| self.corrupt(index, &self.key, reason))
            }
            PixelStorage::Library(grid) => {
                let mut selection = vec![hdf5::SliceOrIndex::Index(index)];
                selection.resize(rank, hdf5::SliceOrIndex::from(..));
                let pixels = &mut self.pixels;
                // One turn of the gate: the chunks' check, then the read.
                self.dataset
                    .as_ref()
                    .expect("library layouts open a dataset")
                    .with(|dataset| {
                        if let Some(grid) = grid {
                            grid.check_row_stored(dataset, index)?;
                        }
                        let read = dataset
                            .read_slice::<u8, _, ndarray::IxDyn>(hdf5::Hyperslab::from(selection))
                            .map_err(|e| format!("HDF5: {e}"))?;
                        pixels.clear();
                        pixels.extend(read.iter().copied());
                        Ok(())
                    })
                    .map_err(|reason: String| self.corrupt(index, &self.key, reason))
            }
        }
    }
}

impl Hdf5Reader {
    /// Reads record `index`'s payload into `self.buffer`, or says where in the heap collection
    /// read for it it lies (h5py's variable-length elements).
    fn load(&mut self, index: usize) -> Result<Option<std::ops::Range<usize>>> {
        let shared = Arc::clone(&self.shared);
        let mut from_heap = None;
        match &shared.layout {
            Layout::Imagefeed { .. } => self.read_imagefeed(index)?,
            Layout::VarLen { images, ids, .. } => {
                self.set_key(images, index);
                let heap = self
                    .heap
                    .as_mut()
                    .expect("a VarLen reader has a heap reader");
                let file = self.file.as_deref().expect("pread layouts open a file");
                match heap.locate(file, &ids[index]) {
                    Ok(range) => from_heap = Some(range),
                    Err(reason) => return Err(self.corrupt(index, &self.key, reason)),
                }
            }
            Layout::VarLenThroughLibrary { images } => {
                self.set_key(images, index);
                self.read_var_len_through_library(index)?;
            }
            Layout::Pixels {
                images,
                rank,
                height,
                width,
                channels,
                storage,
            } => {
                self.set_key(images, index);
                self.read_pixels(index, height * width * channels, *rank, storage)?;
                self.pixels_to_raw(*height, *width, *channels);
            }
        }
        Ok(from_heap)
    }

    /// What a read of a record gave, or the file's error where the file changed since it was
    /// opened. Cut short, each record past the cut was a bad sample of its own, so a loader
    /// counted them up to its `max_bad` and a conversion published what came before as a whole
    /// dataset; rewritten in place, an h5py file gave the new file's pixels under the old
    /// file's labels (two hostile tries). LMDB and record shards, read through maps, say so
    /// at the first byte that is gone. Records with checksums (imagefeed's layout) are checked
    /// when their read fails: a `pread` of the file as opened fails past its end, and a
    /// rewritten record fails its checksum. Every other read is checked after it is made (the
    /// library's reads past the end of a file may give zeros).
    fn checked<T>(&self, read: Result<T>) -> Result<T> {
        let Some(identity) = &self.shared.identity else {
            return read;
        };
        let path = &self.shared.path;
        let checksummed = matches!(
            self.shared.layout,
            Layout::Imagefeed {
                checksums: Some(_),
                ..
            }
        );
        // The descriptor opened with the dataset: the file the library's handle reads too (it
        // was checked to be the same file when the reader opened), whatever is at the path now
        // (a file renamed under a reader reads on).
        let opened = self.file.as_deref().or(self.shared.opened.as_deref());
        match (opened, read) {
            (Some(file), read @ Err(Error::CorruptRecord { .. })) => {
                identity.check_open(file, path)?;
                read
            }
            (Some(_), read) if checksummed => read,
            (Some(file), read) => {
                identity.check_open(file, path)?;
                read
            }
            (None, read) => {
                identity.check(path)?;
                read
            }
        }
    }
}

impl RecordReader for Hdf5Reader {
    fn read(&mut self, index: usize) -> Result<Record<'_>> {
        let shared = Arc::clone(&self.shared);
        assert!(
            index < shared.info.num_samples,
            "index {index} out of range for {} samples",
            shared.info.num_samples
        );
        let loaded = self.load(index);
        let from_heap = self.checked(loaded)?;
        let key: &str = match &self.shared.layout {
            Layout::Imagefeed { keys, .. } => keys[index].as_str(),
            _ => self.key.as_str(),
        };
        let label =
            shared
                .info
                .check_stored_label(&shared.path, index, key, shared.labels[index])?;
        // h5py's variable-length elements are handed out from the collection read for them.
        let payload = match (from_heap, &self.heap) {
            (Some(range), Some(heap)) => heap.bytes(range),
            _ => &self.buffer,
        };
        Ok(Record {
            index,
            key,
            label,
            payload,
        })
    }
}
