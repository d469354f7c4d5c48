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
    // Most errors name a file and a reason: set once below.
    let mut located: Option<(&std::path::Path, String)> = None;
    let class = match err {
        Error::Io { path, source } => {
            located = Some((path, source.to_string()));
            attrs.set_item("errno", source.raw_os_error())?;
            if source.kind() == std::io::ErrorKind::NotFound {
                "DatasetNotFoundError"
            } else {
                "FileError"
            }
        }
        Error::Lmdb { path, source } => {
            located = Some((path, source.to_string()));
            "DataError"
        }
        Error::Hdf5 {
            path,
            doing,
            source,
        } => {
            located = Some((path, format!("{doing}: {source}")));
            "DataError"
        }
        Error::NotADataset { path, reason }
        | Error::BadImageFolder { path, reason }
        | Error::RefusedFile { path, reason } => {
            located = Some((path, reason.clone()));
            "DataError"
        }
        Error::FileChanged { path, change } => {
            located = Some((path, change.clone()));
            "DatasetChangedError"
        }
        Error::Rejected { path, reason } => {
            located = Some((path, reason.clone()));
            "RejectedFileError"
        }
        Error::Incomplete { path, reason } => {
            located = Some((path, reason.clone()));
            "IncompleteDatasetError"
        }
        Error::ShardSet { path, problem } => {
            located = Some((path, problem.to_string()));
            if let imagefeed::format::shards::ShardSetProblem::Missing { missing, .. } = problem {
                attrs.set_item("missing", missing.clone())?;
            }
            "ShardSetError"
        }
        Error::Unsupported { path, what, remedy } => {
            located = Some((path, format!("{what}: {remedy}")));
            "UnsupportedDataError"
        }
        Error::BadUrl { url, reason } => {
            attrs.set_item("path", url)?;
            attrs.set_item("reason", reason)?;
            "DataError"
        }
        Error::Remote { url, doing, source } => {
            attrs.set_item("path", url)?;
            attrs.set_item("reason", format!("{doing}: {source}"))?;
            "DataError"
        }
        Error::CacheFull { dir, .. } => {
            located = Some((dir, err.to_string()));
            "CacheFullError"
        }
        Error::CorruptRecord {
            path,
            index,
            key,
            reason,
        } => {
            located = Some((path, reason.clone()));
            attrs.set_item("index", index)?;
            attrs.set_item("key", key)?;
            "DataError"
        }
        Error::Decode { location, source } => {
            attrs.set_item("key", location)?;
            attrs.set_item("reason", source.to_string())?;
            "BadSampleError"
        }
        Error::BadSample {
            index,
            key,
            kind,
            reason,
        } => {
            attrs.set_item("index", index)?;
            attrs.set_item("key", key)?;
            attrs.set_item("kind", kind.name())?;
            attrs.set_item("reason", reason)?;
            "BadSampleError"
        }
        Error::TooManyBadSamples {
            count,
            seen,
            limit,
            index,
            key,
            kind,
            reason,
        } => {
            attrs.set_item("count", count)?;
            attrs.set_item("seen", seen)?;
            attrs.set_item("limit", limit)?;
            attrs.set_item("index", index)?;
            attrs.set_item("key", key)?;
            attrs.set_item("kind", kind.name())?;
            attrs.set_item("reason", reason)?;
            "TooManyBadSamplesError"
        }
        Error::ShapeMismatch { first_key, key, .. } => {
            attrs.set_item("key", key)?;
            attrs.set_item("first_key", first_key)?;
            "ShapeMismatchError"
        }
        Error::AlreadyExists { path, hint: reason } | Error::NotReplaceable { path, reason } => {
            located = Some((path, reason.clone()));
            "OutputExistsError"
        }
        Error::FeatureDisabled {
            path,
            what,
            feature,
        } => {
            // Not in the wheel (it is built with every feature); for other builds of it.
            located = Some((path, format!("{what} needs the `{feature}` feature")));
            "ConfigError"
        }
        Error::ResumeMismatch { path, reason } => {
            located = Some((path, reason.clone()));
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
        Error::Config(reason) => {
            attrs.set_item("reason", reason)?;
            "ConfigError"
        }
        Error::Interrupted { path, reason } => {
            located = Some((path, reason.clone()));
            "Error"
        }
        Error::Cuda { doing, source } => {
            // What was done, and what the library said.
            let reason = match source {
                Some(source) => format!("{doing}: {source}"),
                None => doing.clone(),
            };
            attrs.set_item("reason", reason)?;
            "CudaError"
        }
        Error::OutOfMemory { bytes, .. } => {
            attrs.set_item("bytes", bytes)?;
            attrs.set_item("reason", err.to_string())?;
            "OutOfMemoryError"
        }
        // Cancelled, Panicked, WorkersStopped, ThreadSpawn: no file, no better class.
        _ => {
            attrs.set_item("reason", err.to_string())?;
            "Error"
        }
    };
    // The path and key the error names are kept as they are where the message quotes them.
    let mut quoted: Vec<String> = Vec::new();
    if let Some((path, _)) = &located {
        quoted.push(path.to_string_lossy().into_owned());
    }
    for name in ["path", "key"] {
        if let Some(value) = attrs.get_item(name)?
            && let Ok(text) = value.extract::<String>()
        {
            quoted.push(text);
        }
    }
    if let Some((path, reason)) = located {
        attrs.set_item("path", path.to_string_lossy().into_owned())?;
        attrs.set_item("reason", in_python(&reason, &quoted))?;
    } else if let Some(reason) = attrs.get_item("reason")? {
        attrs.set_item("reason", in_python(&reason.extract::<String>()?, &quoted))?;
    }
    let module = py.import("imagefeed.errors")?;
    let exception = module
        .getattr(class)?
        .call1((in_python(&err.to_string(), &quoted),))?;
    for (name, value) in attrs.iter() {
        exception.setattr(name.cast_into::<pyo3::types::PyString>()?, value)?;
    }
    Ok(PyErr::from_value(exception))
}

/// The command-line options messages name, and the keyword arguments of the Python calls
/// that take their place.
const AS_KEYWORDS: [(&str, &str); 20] = [
    ("--resume", "resume=True"),
    ("--force", "force=True"),
    ("--restart-markers", "restart_markers"),
    ("--restart-rows", "restart_markers"),
    ("--shared-headers", "shared_headers"),
    ("--raw", "raw"),
    ("--resize", "resize"),
    ("--quality", "quality"),
    ("--max-pixels", "max_pixels"),
    ("--threads", "threads"),
    ("--shard-size", "shard_bytes"),
    ("--part-index", "part=(i, n)"),
    ("--num-parts", "part=(i, n)"),
    ("--label-base", "label_base"),
    ("--input-label-base", "input_label_base"),
    ("--num-classes", "num_classes"),
    ("--allow-missing-shards", "allow_missing_shards=True"),
    ("--max-bad", "max_bad"),
    ("--against", "against"),
    ("--strict", "strict=True"),
];

/// A message as a Python user acts on it: the packer's command-line options it names are the
/// keyword arguments of the Python calls (a hostile try was told to "rerun it with --resume"
/// by a Python call). Only those options, each as a word of its own, and never inside the
/// `quoted` path or key the error names (a path `src --force x/` stays as it is), nor advice
/// for other tools (`tar --sort=name`).
fn in_python(message: &str, quoted: &[String]) -> String {
    let first = quoted
        .iter()
        .filter(|q| !q.is_empty())
        .filter_map(|q| message.find(q.as_str()).map(|at| (at, q.len())))
        .min();
    match first {
        Some((at, len)) => format!(
            "{}{}{}",
            options_as_keywords(&message[..at]),
            &message[at..at + len],
            in_python(&message[at + len..], quoted)
        ),
        None => options_as_keywords(message),
    }
}

/// [`in_python`] of text that quotes no path or key.
fn options_as_keywords(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    // Where the last option rewritten ends in `out`: a `/` right after it continues a list.
    let mut option_end = None;
    while let Some(at) = rest.find("--") {
        let (before, from) = rest.split_at(at);
        out.push_str(before);
        let in_a_list = before == "/" && option_end == Some(out.len() - 1);
        let starts_a_word = in_a_list
            || out
                .chars()
                .next_back()
                .is_none_or(|c| c.is_whitespace() || "(\"'`,;".contains(c));
        let name_len = from[2..]
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
            .map_or(from.len(), |n| n + 2);
        let (flag, after) = from.split_at(name_len);
        let ends_a_word = match after.chars().next() {
            // A list of options (`--raw/--resize`) is one of options.
            Some('/') => after.starts_with("/--"),
            Some('=') => false,
            Some('.') => !after[1..].starts_with(char::is_alphanumeric),
            _ => true,
        };
        match AS_KEYWORDS.iter().find(|(cli, _)| *cli == flag) {
            Some((_, keyword)) if starts_a_word && ends_a_word => {
                out.push_str(keyword);
                option_end = Some(out.len());
            }
            _ => out.push_str(flag),
        }
        rest = after;
    }
    out.push_str(rest);
    out
}

/// A configuration error raised from the bindings' own checks.
pub fn config(reason: impl Into<String>) -> PyErr {
    to_py(Error::Config(reason.into()))
}
