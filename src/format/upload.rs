//! Publishing a finished output to object storage (`pack-dataset … s3://bucket/prefix`).
//!
//! The output is built as usual in a local staging copy (crash-safe and resumable like any pack:
//! in the cache directory's `upload/` section), then uploaded:
//!
//! 1. nothing is overwritten without `--force`: the target is checked before packing starts,
//!    and objects go up with `If-None-Match: *`;
//! 2. a records directory first gets a `progress.json` marker (our magic), then its shards and
//!    indexes (multipart when large), then its manifest, and the marker is removed last: a
//!    half-uploaded dataset never opens as complete (readers refuse a prefix holding our
//!    marker and no manifest; one without either holds no dataset of ours). A single-file
//!    output (LMDB, HDF5) is one object, which a PUT or a completed multipart upload makes
//!    appear whole;
//! 3. `--resume` finishes an interrupted pack locally, then uploads only the objects that are
//!    not there yet (same name and size);
//! 4. with `--force`, objects of ours the new dataset does not have (older shards) are deleted
//!    once the new manifest is up. During a forced replacement of a records directory the
//!    marker makes readers refuse it: unlike a local `--force`, the switch is not atomic.
//!
//! The local copy is deleted once everything is up.

use std::fs;
use std::path::{Path, PathBuf};

use crate::cache::Cache;
use crate::error::{Error, IoContext as _, Result};
use crate::format::tfrecord;
use crate::format::writer::StartMode;
use crate::remote::RemoteUrl;
use crate::remote::store::{self, Patience};

/// The marker a records upload leaves while it runs.
const MARKER: &str = tfrecord::PROGRESS;

/// Where the local staging copy of an upload to `url` goes.
pub fn staging_for(url: &RemoteUrl, cache: &Cache) -> PathBuf {
    use sha2::{Digest as _, Sha256};
    let digest: String = Sha256::digest(url.to_string().as_bytes())[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let name = match url.file_name() {
        "" => "dataset",
        name => name,
    };
    cache.root().join("upload").join(digest).join(name)
}

/// Refuses to start a pack to `url` that would overwrite something without `--force`: a dataset
/// (a manifest, one object at the URL) or any object under the prefix, unless resuming an
/// upload of ours.
pub fn check_target(url: &RemoteUrl, mode: StartMode) -> Result<()> {
    if mode.force {
        return Ok(());
    }
    let exists = |what: String| Error::AlreadyExists {
        path: PathBuf::from(url.to_string()),
        hint: format!("{what}; pass --force to replace it, or --resume to finish an upload"),
    };
    if !url.key().is_empty()
        && let Some(object) = store::head(url, Patience::Open)?
    {
        return if mode.resume {
            Ok(())
        } else {
            Err(exists(format!(
                "an object of {} bytes is there",
                object.size
            )))
        };
    }
    let under = store::list_dir(url, Patience::Open)?;
    if under.is_empty() {
        return Ok(());
    }
    let ours_unfinished = under.iter().any(|o| o.url.file_name() == MARKER)
        && !under
            .iter()
            .any(|o| o.url.file_name() == tfrecord::MANIFEST);
    if mode.resume && ours_unfinished {
        return Ok(());
    }
    Err(exists(format!(
        "{} objects are under this prefix{}",
        under.len(),
        if ours_unfinished {
            " (an unfinished upload of ours)"
        } else {
            ""
        }
    )))
}

/// Uploads the finished local output `local` to `url` (see the module docs), then deletes the
/// local copy.
pub fn publish(local: &Path, url: &RemoteUrl, mode: StartMode) -> Result<()> {
    let create = !mode.force;
    if local.is_dir() {
        publish_directory(local, url, mode, create)?;
        fs::remove_dir_all(local).at(local)?;
    } else {
        let present = store::head(url, Patience::Transfer)?;
        let size = fs::metadata(local).at(local)?.len();
        let done = mode.resume && present.as_ref().is_some_and(|o| o.size == size);
        if !done {
            store::upload(local, url, create)?;
        }
        fs::remove_file(local).at(local)?;
    }
    Ok(())
}

fn publish_directory(local: &Path, url: &RemoteUrl, mode: StartMode, create: bool) -> Result<()> {
    let present = store::list_dir(url, Patience::Transfer)?;
    let present_size = |name: &str| {
        present
            .iter()
            .find(|o| o.url.file_name() == name)
            .map(|o| o.size)
    };
    // The marker first: until the manifest is up, readers refuse the prefix.
    let marker = local.join(".upload-marker");
    fs::write(
        &marker,
        format!(
            "{{\"magic\": \"{}\", \"uploading\": true}}",
            tfrecord::MAGIC
        ),
    )
    .at(&marker)?;
    store::upload(&marker, &url.join(MARKER), false)?;
    fs::remove_file(&marker).at(&marker)?;
    let mut names: Vec<String> = fs::read_dir(local)
        .at(local)?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n != tfrecord::MANIFEST && n != MARKER)
        .collect();
    names.sort();
    for name in &names {
        let path = local.join(name);
        let size = fs::metadata(&path).at(&path)?.len();
        if mode.resume && present_size(name) == Some(size) {
            continue;
        }
        // A resumed upload may replace what an interrupted one left of its own shards.
        store::upload(&path, &url.join(name), create && !mode.resume)?;
    }
    store::upload(
        &local.join(tfrecord::MANIFEST),
        &url.join(tfrecord::MANIFEST),
        create,
    )?;
    if mode.force {
        for object in &present {
            let name = object.url.file_name();
            if tfrecord::is_writer_file(name)
                && name != tfrecord::MANIFEST
                && name != MARKER
                && !names.iter().any(|n| n == name)
            {
                store::delete(&object.url)?;
            }
        }
    }
    store::delete(&url.join(MARKER))
}

/// True when `listing` (a prefix's objects) is an unfinished upload of ours: the marker and no
/// manifest.
pub(crate) fn is_unfinished(listing: &[crate::remote::store::ObjectInfo]) -> bool {
    listing.iter().any(|o| o.url.file_name() == MARKER)
        && !listing
            .iter()
            .any(|o| o.url.file_name() == tfrecord::MANIFEST)
}
