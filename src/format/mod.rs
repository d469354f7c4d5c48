//! On-disk formats, one module each, reader and writer side by side, all behind the
//! [`Dataset`] trait.
//!
//! - [`folder`]: raw ImageFolder trees (torchvision's layout and order).
//! - [`lmdb`]: single-file LMDB written by `pack-dataset imagefolder2lmdb`, and the LMDBs the
//!   Python folder2lmdb scripts write (pickled `(image_bytes, label)` values).

use std::path::Path;
use std::sync::Arc;

use crate::dataset::Dataset;
use crate::error::{Error, Result};

pub mod folder;
pub mod lmdb;
pub(crate) mod pickle;

/// Opens any dataset this library reads, choosing the format from what is on disk: a directory
/// is an ImageFolder tree, a file is a packed dataset (identified by its magic bytes).
pub fn open(path: impl AsRef<Path>) -> Result<Arc<dyn Dataset>> {
    let path = path.as_ref();
    // An LMDB in directory form (Python's lmdb.open default): DIR/data.mdb.
    if path.is_dir() && path.join("data.mdb").is_file() {
        return Ok(Arc::new(lmdb::Lmdb::open(path.join("data.mdb"))?));
    }
    if path.is_dir() {
        return Ok(Arc::new(folder::ImageFolder::open(path)?));
    }
    match lmdb::Lmdb::open(path) {
        Ok(lmdb) => Ok(Arc::new(lmdb)),
        Err(Error::NotADataset { reason, .. }) if reason.contains("bad magic") => {
            Err(Error::not_a_dataset(
                path,
                "neither an ImageFolder directory nor a dataset file this build reads (LMDB)",
            ))
        }
        Err(e) => Err(e),
    }
}
