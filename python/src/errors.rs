//! imagefeed errors as Python exceptions.
//!
//! The exception classes live in `imagefeed/errors.py` (a hierarchy under `imagefeed.Error`, with
//! `OSError`/`ValueError`/`FileExistsError` mixed in where Python code expects them). Each
//! exception carries the message of the Rust error and, as attributes, what the error names:
//! `path`, `key`, `index`, `reason`, and for a few errors more (`setting`/`saved`/`current`,
//! `count`/`keys`).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use imagefeed::Error;

/// Raises `err` as the matching `imagefeed.errors` exception.
pub fn to_py(err: Error) -> PyErr {
    Python::attach(|py| match build(py, &err) {
        Ok(exception) => exception,
        // The errors module could not be imported or an exception not built: still an error
        // with the full message rather than a panic.
        Err(failed) => {
            pyo3::exceptions::PyRuntimeError::new_err(format!("{err} (and {failed} raising it)"))
        }
    })
}

fn build(py: Python<'_>, err: &Error) -> PyResult<PyErr> {
    let attrs = PyDict::new(py);
    let path = |p: &std::path::Path| p.to_string_lossy().into_owned();
    let class = match err {
        Error::Io { path: p, source } => {
            attrs.set_item("path", path(p))?;
            attrs.set_item("errno", source.raw_os_error())?;
            attrs.set_item("reason", source.to_string())?;
            if source.kind() == std::io::ErrorKind::NotFound {
                "DatasetNotFoundError"
            } else {
                "FileError"
            }
        }
        Error::Lmdb { path: p, source } => {
            attrs.set_item("path", path(p))?;
            attrs.set_item("reason", source.to_string())?;
            "DataError"
        }
        Error::Hdf5 { path: p, reason }
        | Error::NotADataset { path: p, reason }
        | Error::BadImageFolder { path: p, reason }
        | Error::RefusedFile { path: p, reason } => {
            attrs.set_item("path", path(p))?;
            attrs.set_item("reason", reason)?;
            "DataError"
        }
        Error::Rejected { path: p, reason } => {
            attrs.set_item("path", path(p))?;
            attrs.set_item("reason", reason)?;
            "RejectedFileError"
        }
        Error::Incomplete { path: p, reason } => {
            attrs.set_item("path", path(p))?;
            attrs.set_item("reason", reason)?;
            "IncompleteDatasetError"
        }
        Error::CorruptRecord {
            path: p,
            index,
            key,
            reason,
        } => {
            attrs.set_item("path", path(p))?;
            attrs.set_item("index", index)?;
            attrs.set_item("key", key)?;
            attrs.set_item("reason", reason)?;
            "DataError"
        }
        Error::Decode { location, source } => {
            attrs.set_item("key", location)?;
            attrs.set_item("reason", source.to_string())?;
            "BadSampleError"
        }
        Error::BadSample { index, key, reason } => {
            attrs.set_item("index", index)?;
            attrs.set_item("key", key)?;
            attrs.set_item("reason", reason)?;
            "BadSampleError"
        }
        Error::TooManyBadSamples {
            count,
            seen,
            limit,
            index,
            key,
            reason,
        } => {
            attrs.set_item("count", count)?;
            attrs.set_item("seen", seen)?;
            attrs.set_item("limit", limit)?;
            attrs.set_item("index", index)?;
            attrs.set_item("key", key)?;
            attrs.set_item("reason", reason)?;
            "TooManyBadSamplesError"
        }
        Error::ShapeMismatch { first_key, key, .. } => {
            attrs.set_item("key", key)?;
            attrs.set_item("first_key", first_key)?;
            "ShapeMismatchError"
        }
        Error::AlreadyExists { path: p, hint } => {
            attrs.set_item("path", path(p))?;
            attrs.set_item("reason", hint)?;
            "OutputExistsError"
        }
        Error::NotReplaceable { path: p, reason } => {
            attrs.set_item("path", path(p))?;
            attrs.set_item("reason", reason)?;
            "OutputExistsError"
        }
        Error::ResumeMismatch { path: p, reason } => {
            attrs.set_item("path", path(p))?;
            attrs.set_item("reason", reason)?;
            "ConfigError"
        }
        Error::StateMismatch {
            setting,
            saved,
            current,
        } => {
            attrs.set_item("setting", *setting)?;
            attrs.set_item("saved", saved)?;
            attrs.set_item("current", current)?;
            "StateMismatchError"
        }
        Error::Config(reason) | Error::Options(reason) => {
            attrs.set_item("reason", reason)?;
            "ConfigError"
        }
        Error::Interrupted { path: p, reason } => {
            attrs.set_item("path", path(p))?;
            attrs.set_item("reason", reason)?;
            "Error"
        }
        Error::Cuda(reason) => {
            attrs.set_item("reason", reason)?;
            "CudaError"
        }
        _ => "Error",
    };
    let module = py.import("imagefeed.errors")?;
    let exception = module.getattr(class)?.call1((err.to_string(),))?;
    for (name, value) in attrs.iter() {
        exception.setattr(name.cast_into::<pyo3::types::PyString>()?, value)?;
    }
    Ok(PyErr::from_value(exception))
}

/// A configuration error raised from the bindings' own checks.
pub fn config(reason: impl Into<String>) -> PyErr {
    to_py(Error::Config(reason.into()))
}
