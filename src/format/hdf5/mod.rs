//! HDF5 datasets: the writer `pack-dataset imagefolder2hdf5` uses, and a reader for that layout
//! and for the two layouts h5py users most often already have.
//!
//! # Layout (version 2)
//!
//! One HDF5 file with five datasets in the root group, all uncompressed:
//!
//! | name      | type                  | shape   | content                                         |
//! |-----------|-----------------------|---------|-------------------------------------------------|
//! | `images`  | `uint8`, contiguous   | `(B,)`  | every payload, concatenated in sample order    |
//! | `offsets` | `uint64`              | `(N+1,)`| sample `i` is `images[offsets[i]:offsets[i+1]]` |
//! | `labels`  | `int64`               | `(N,)`  | class index, `0 ≤ label < len(classes)`         |
//! | `keys`    | variable-length UTF-8 | `(N,)`  | path relative to the ImageFolder root           |
//! | `checksums` | `uint32`            | `(N,)`  | CRC-32C of `label u32 LE, len(key) u32 LE, key, payload` |
//!
//! The reader checks each record against its checksum
//! ([`record_checksum`](crate::format::record_checksum)), so bytes changed since packing make a
//! bad sample that says so, never wrong pixels, labels or keys handed out as good. Version 1
//! files (no `checksums`, written before 0.2) are still read, unchecked.
//!
//! and two root attributes: `classes` (variable-length UTF-8 strings, indexed by label) and
//! `imagefeed`, a JSON string `{"magic": "imagefeed-hdf5", "version": 2, "complete": true,
//! "format": "hdf5", "classes": [...], "num_samples": N, "payload": "encoded" | "raw-rgb8", ...}`.
//! Payloads are the original files' bytes, or with `--raw` decoded pixels
//! (`"RGB8" | u32 LE width | u32 LE height | RGB`). h5py reads sample `i` with
//!
//! ```python
//! with h5py.File("train.h5", "r") as f:
//!     o = f["offsets"]
//!     image_bytes = f["images"][o[i]:o[i + 1]].tobytes()
//!     label = int(f["labels"][i])
//! ```
//!
//! # Reading without the HDF5 lock
//!
//! Every call into libhdf5 takes one process-wide lock, so worker threads reading through the
//! library would take turns. `images` is contiguous and unfiltered, so its bytes sit at one file
//! offset (the `hdf5` crate's `Dataset::offset`): the library is used once at open to read the metadata and
//! that offset, and each worker then reads payloads with `pread` on its own file handle. The
//! same holds for a contiguous pixel array written by h5py.
//!
//! # Layouts written by others
//!
//! Opened with `Hdf5::open_with` (dataset names configurable, default `images` and `labels`):
//!
//! - **encoded images in a variable-length dataset** (`h5py.vlen_dtype(np.uint8)`), one element
//!   per sample: each element's descriptor is read at open (from one file offset when the
//!   dataset is contiguous, chunk by chunk when it is chunked: `chunks.rs`), and each record
//!   with `pread` from the global heap that holds it (`heap.rs`, checked, no libhdf5 and no
//!   lock). Descriptors only the library can read (compact, virtual, external, through a filter
//!   other than deflate, LZF, shuffle and fletcher32) are read through it, one element at a time.
//! - **a fixed-shape pixel array** `N×H×W×C` (C = 1, 3 or 4) or `N×H×W` of `uint8`: contiguous
//!   arrays are read with `pread`; chunked ones chunk by chunk (`chunks.rs`: libhdf5 finds a
//!   chunk and hands over its stored bytes, checked code of ours undoes deflate, LZF, shuffle
//!   and fletcher32 outside the lock and copies the sample out); through other filters, by the
//!   library, sample by sample. Samples come
//!   out as raw RGB payloads (grey replicated to three channels, a fourth channel dropped).
//!
//! with a labels dataset of any integer type, booleans (classes 0 and 1) or an enum (h5py's
//! `enum_dtype`; its values are the classes). Class names come from the first of: a `classes`
//! attribute on the root, on the labels dataset or on the images dataset, a `classes` dataset
//! in the root, the labels' enum members (when numbered `0..N`); else they are
//! `"0"..="max label"`. Names found in two places that differ are a notice.
//!
//! # Fork
//!
//! Every libhdf5 call (opening, reading, writing, dropping a handle) runs inside one gate
//! (`gate.rs`) that a `pthread_atfork` handler takes before any fork in the process, so a child
//! forked at any moment finds the library consistent and unlocked and can open and read HDF5
//! files (a DataLoader's forked workers).
//!
//! # File locks
//!
//! Files are opened and created with HDF5's file locking off (see `open_unlocked`): libhdf5
//! does not open files close-on-exec, so any child process started meanwhile would inherit and
//! hold the lock.
//!
//! # Crash safety
//!
//! A contiguous dataset cannot grow, and its size is only known once every file has been checked.
//! The writer therefore stages payloads and an index in the directory `OUT.partial/`
//! (`payloads.bin`, `index.bin`, and `progress.json`, which is replaced atomically after each
//! chunk has been synced), so a killed run resumes from its last chunk. Finishing writes the HDF5
//! file inside that directory in one sequential pass, syncs it, renames it to `OUT` and deletes
//! the staging directory: `OUT` only ever exists complete. The cost is writing the payloads twice.
//!
//! # Module layout
//!
//! This module holds the layout's names and what can be told about a path without libhdf5
//! (the signature, the writer's staging files). With the `hdf5` feature (on by default):
//! `reader.rs` opens files and reads records ([`Hdf5`]), `foreign.rs` finds the layouts h5py
//! users have, `storage.rs` says where a dataset's bytes lie and which filters this build can
//! undo, `chunks.rs` reads chunked datasets chunk by chunk, `heap.rs` reads h5py's
//! variable-length elements without libhdf5, `writer.rs` packs
//! ([`Hdf5Writer`]), `probe.rs` tries each open in a child first, and `gate.rs` keeps every
//! libhdf5 call fork-safe. Without the feature an HDF5 path is still recognized, and opening
//! or packing one fails with [`Error::FeatureDisabled`].

use std::io::Read as _;
use std::path::Path;
use std::sync::Arc;

use crate::dataset::Dataset;
use crate::error::{Error, Result};
use crate::format::writer::{DatasetWriter, PackPlan, PackProgress, WriterOptions};

#[cfg(feature = "hdf5")]
mod chunks;
#[cfg(feature = "hdf5")]
mod class_names;
#[cfg(feature = "hdf5")]
mod filters;
#[cfg(feature = "hdf5")]
mod foreign;
#[cfg(feature = "hdf5")]
mod gate;
#[cfg(feature = "hdf5")]
mod heap;
#[cfg(feature = "hdf5")]
mod probe;
#[cfg(feature = "hdf5")]
mod reader;
#[cfg(feature = "hdf5")]
mod storage;
#[cfg(feature = "hdf5")]
mod writer;
#[cfg(all(feature = "hdf5", feature = "fuzzing"))]
pub(crate) use heap::fuzz as fuzz_global_heap;
#[cfg(feature = "hdf5")]
pub use reader::Hdf5;
#[cfg(feature = "hdf5")]
pub use writer::Hdf5Writer;
#[cfg(all(feature = "hdf5", feature = "fuzzing"))]
pub(crate) use writer::{parse_staged_index, push_staged_entry, write_raw_parts};

/// The `magic` value in the `imagefeed` attribute.
pub const MAGIC: &str = "imagefeed-hdf5";
/// The layout version this build writes and the newest it reads.
pub const VERSION: u32 = 2;
/// The eight bytes every HDF5 file starts with (at offset 0 when there is no user block).
pub const SIGNATURE: &[u8; 8] = b"\x89HDF\r\n\x1a\n";

const IMAGES: &str = "images";
const LABELS: &str = "labels";
/// The first layout version with the `checksums` dataset.
#[cfg(feature = "hdf5")]
const CHECKSUMS_SINCE: u32 = 2;
/// The root attribute holding the JSON info record.
#[cfg(feature = "hdf5")]
const INFO_ATTR: &str = "imagefeed";
#[cfg(feature = "hdf5")]
const CLASSES_ATTR: &str = "classes";
#[cfg(feature = "hdf5")]
const OFFSETS: &str = "offsets";
#[cfg(feature = "hdf5")]
const KEYS: &str = "keys";
#[cfg(feature = "hdf5")]
const CHECKSUMS: &str = "checksums";

/// Names of the datasets to read in an HDF5 file imagefeed did not write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hdf5Names {
    /// The images: encoded files in a variable-length `uint8` dataset, or an `N×H×W[×C]` `uint8`
    /// pixel array.
    pub images: String,
    /// The labels: an integer dataset of length `N`.
    pub labels: String,
}

impl Default for Hdf5Names {
    fn default() -> Self {
        Hdf5Names {
            images: IMAGES.into(),
            labels: LABELS.into(),
        }
    }
}

/// True when `path` is a file that starts with the HDF5 signature.
pub fn has_signature(path: &Path) -> bool {
    let mut head = [0u8; 8];
    crate::file::open_regular(path).is_ok_and(|(mut f, _)| f.read_exact(&mut head).is_ok())
        && &head == SIGNATURE
}

// The writer's staging directory, `OUT.partial/`.
const STAGED_PAYLOADS: &str = "payloads.bin";
const STAGED_INDEX: &str = "index.bin";
pub(crate) const STAGED_PROGRESS: &str = "progress.json";
const STAGED_HDF5: &str = "dataset.h5";

/// Whether `name` is one the HDF5 writer gives a file in its staging directory.
pub(crate) fn is_staging_file(name: &str) -> bool {
    [STAGED_PAYLOADS, STAGED_INDEX, STAGED_PROGRESS, STAGED_HDF5].contains(&name)
}

/// True when the directory `path` is an HDF5 writer's staging directory (`OUT.partial/`): its
/// progress record carries [`MAGIC`]. (The writer makes that record before anything else.)
pub(crate) fn is_own_staging(path: &Path) -> bool {
    super::staging::staged_magic(path, STAGED_PROGRESS).as_deref() == Some(MAGIC)
}

/// [`format::open`](crate::format::open)'s recognizer for an HDF5 file, by its signature (so
/// also in a build without the `hdf5` feature, where opening one is
/// [`Error::FeatureDisabled`]).
pub(crate) const FILE: crate::format::Recognizer = crate::format::Recognizer {
    holds: |path| Ok(has_signature(path)),
    open: |path, options| open_dataset(path, &options.hdf5),
};

/// Opens the HDF5 dataset at `path` ([`Hdf5::open_with`]); without the `hdf5` feature,
/// [`Error::FeatureDisabled`].
pub(crate) fn open_dataset(path: &Path, names: &Hdf5Names) -> Result<Arc<dyn Dataset>> {
    #[cfg(feature = "hdf5")]
    return Ok(Arc::new(Hdf5::open_with(path, names)?));
    #[cfg(not(feature = "hdf5"))]
    return {
        let _ = names;
        Err(feature_disabled(path, "reading an HDF5 file"))
    };
}

/// Starts an HDF5 writer for `out` ([`Hdf5Writer::start`]); without the `hdf5` feature,
/// [`Error::FeatureDisabled`].
pub(crate) fn start_writer(
    out: &Path,
    plan: &PackPlan,
    options: &WriterOptions,
) -> Result<(Box<dyn DatasetWriter>, PackProgress)> {
    #[cfg(feature = "hdf5")]
    return crate::format::writer::boxed::<Hdf5Writer>(out, plan, options);
    #[cfg(not(feature = "hdf5"))]
    return {
        let _ = (plan, options);
        Err(feature_disabled(out, "writing an HDF5 file"))
    };
}

/// [`Error::FeatureDisabled`] for `what` on `path`, in a build without the `hdf5` feature.
pub(crate) fn feature_disabled(path: &Path, what: &'static str) -> Error {
    Error::FeatureDisabled {
        path: path.to_path_buf(),
        what,
        feature: "hdf5",
    }
}

/// True when `path` is an HDF5 file an imagefeed writer made (its `imagefeed` attribute carries
/// [`MAGIC`]): what `--force` may replace. h5py files of other layouts are not. Without the
/// `hdf5` feature nothing can be confirmed, so this is false (and `--force` refuses).
pub(crate) fn is_own_file(path: &Path) -> bool {
    #[cfg(feature = "hdf5")]
    return reader::is_own_file(path);
    #[cfg(not(feature = "hdf5"))]
    return {
        let _ = path;
        false
    };
}
