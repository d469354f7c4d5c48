//! Random access to one dataset, for `imagefeed.Dataset` (a map-style dataset for
//! `torch.utils.data.DataLoader` pipelines).
//!
//! A [`NativeDataset`] opens its file when made and reads through one lazily opened handle. The
//! Python class makes it lazily in each process (and again after a fork), so a handle is never
//! shared between processes: the LMDB/HDF5 problem people meet with `DataLoader` workers.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use imagefeed::decode::Decoder;
use imagefeed::format;
use imagefeed::{Dataset, LazyReader};

use crate::dlpack::{Element, HostArray, HostMemory};
use crate::errors::{config, to_py};

/// The handle and decoder of one dataset.
struct Reading {
    reader: LazyReader,
    decoder: Decoder,
}

/// The Rust side of `imagefeed.Dataset`.
#[pyclass(module = "imagefeed._native")]
pub struct NativeDataset {
    dataset: Arc<dyn Dataset>,
    reading: Mutex<Reading>,
}

impl NativeDataset {
    /// The handle and decoder, locked; first, the SIGBUS guard put back in front of any handler
    /// installed since the last read (PyTorch's DataLoader installs one in each worker).
    fn lock_reading(&self) -> std::sync::MutexGuard<'_, Reading> {
        imagefeed::reclaim_sigbus_guard();
        self.reading.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check(&self, index: i64) -> PyResult<usize> {
        let len = self.dataset.len() as i64;
        let at = if index < 0 { index + len } else { index };
        if !(0..len).contains(&at) {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "index {index} is out of range for a dataset of {len} samples"
            )));
        }
        Ok(at as usize)
    }
}

#[pymethods]
impl NativeDataset {
    #[new]
    #[pyo3(signature = (paths, *, reading=None, max_pixels=None))]
    fn new(
        py: Python<'_>,
        paths: Vec<std::path::PathBuf>,
        reading: Option<crate::Reading>,
        max_pixels: Option<u64>,
    ) -> PyResult<NativeDataset> {
        let options = reading.unwrap_or_default().open_options();
        let dataset = py
            .detach(|| format::open_files(&paths, &options))
            .map_err(to_py)?;
        let mut decoder = Decoder::new();
        if let Some(max_pixels) = max_pixels {
            if max_pixels == 0 {
                return Err(config("max_pixels 0 would refuse every image"));
            }
            decoder = decoder.with_max_pixels(max_pixels);
        }
        Ok(NativeDataset {
            reading: Mutex::new(Reading {
                reader: LazyReader::new(Arc::clone(&dataset)),
                decoder,
            }),
            dataset,
        })
    }

    fn __len__(&self) -> usize {
        self.dataset.len()
    }

    /// Class names, indexed by label.
    #[getter]
    fn classes(&self) -> Vec<String> {
        self.dataset.classes().to_vec()
    }

    /// The format's name (`lmdb`, `hdf5`, `records`, `folder`, ...).
    #[getter]
    fn format(&self) -> &'static str {
        self.dataset.info().format.name()
    }

    /// The dataset's fingerprint (format, count, classes and up to eight probed records): what
    /// a loader's state records, and what tells a reopened path from the dataset first opened.
    #[getter]
    fn fingerprint(&self, py: Python<'_>) -> String {
        imagefeed::reclaim_sigbus_guard();
        let dataset = &self.dataset;
        py.detach(|| imagefeed::dataset::fingerprint(dataset.as_ref()))
    }

    /// A digest of every record's key and label (an image folder) or stored checksum
    /// (imagefeed's packs), `None` for other formats: what tells a reopened path from the
    /// dataset first opened where the fingerprint's probes do not look.
    #[getter]
    fn listing(&self, py: Python<'_>) -> Option<String> {
        let dataset = &self.dataset;
        py.detach(|| imagefeed::dataset::listing_digest(dataset.as_ref()))
    }

    /// True for a dataset in object storage (opened from a URL).
    #[getter]
    fn remote(&self) -> bool {
        self.dataset
            .path()
            .to_str()
            .is_some_and(imagefeed::remote::is_url)
    }

    /// Every record's `(key, label)`, in index order: an image folder's from its listing,
    /// other formats' by reading every record (the GIL released).
    fn keys_and_labels(&self, py: Python<'_>) -> PyResult<Vec<(String, u32)>> {
        imagefeed::reclaim_sigbus_guard();
        let dataset = &self.dataset;
        py.detach(|| imagefeed::dataset::keys_and_labels(dataset.as_ref()))
            .map_err(to_py)
    }

    /// Record `index` as `(payload bytes, label, key)`.
    fn read<'py>(
        &self,
        py: Python<'py>,
        index: i64,
    ) -> PyResult<(Bound<'py, PyBytes>, u32, String)> {
        let index = self.check(index)?;
        let mut guard = self.lock_reading();
        let reading = &mut *guard;
        let (payload, label, key) = py
            .detach(|| {
                reading
                    .reader
                    .read(index)
                    .map(|r| (r.payload.to_vec(), r.label, r.key.to_owned()))
            })
            .map_err(to_py)?;
        Ok((PyBytes::new(py, &payload), label, key))
    }

    /// Record `index`'s key (its path relative to the source root), without copying its payload.
    fn key(&self, py: Python<'_>, index: i64) -> PyResult<String> {
        let index = self.check(index)?;
        let mut guard = self.lock_reading();
        let reading = &mut *guard;
        py.detach(|| reading.reader.read(index).map(|r| r.key.to_owned()))
            .map_err(to_py)
    }

    /// Record `index` decoded to RGB: `(array of shape (height, width, 3) uint8, label, key)`.
    fn decode(&self, py: Python<'_>, index: i64) -> PyResult<(HostArray, u32, String)> {
        let index = self.check(index)?;
        let mut guard = self.lock_reading();
        let reading = &mut *guard;
        let path = self.dataset.path().to_path_buf();
        let (pixels, width, height, label, key) = py
            .detach(|| {
                let Reading { reader, decoder } = reading;
                let record = reader.read(index)?;
                let mut pixels = Vec::new();
                let header = decoder
                    .decode_rgb(record.payload, &mut pixels)
                    .map_err(|source| imagefeed::Error::Decode {
                        location: format!("{}: record {index} ({})", path.display(), record.key),
                        source,
                    })?;
                Ok::<_, imagefeed::Error>((
                    pixels,
                    header.width as usize,
                    header.height as usize,
                    record.label,
                    record.key.to_owned(),
                ))
            })
            .map_err(to_py)?;
        let memory = Arc::new(HostMemory::from_vec(pixels));
        let array = HostArray::new(memory, &[height, width, 3], Element::U8)?;
        Ok((array, label, key))
    }
}
