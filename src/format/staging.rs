//! A dataset's life while it is written, shared by every format's writer: it is built under
//! `OUT.partial` ([`partial_path`]) with an exclusive lock held (`lock_staging`), each chunk
//! is committed with a progress record that a resumed run reads back
//! (`read_staged_progress`, `cut_to_committed`), and the finished output is swapped into
//! place atomically ([`publish`]). Readers refuse what this leaves behind when a run is cut
//! short (`refuse_interrupted`).
//!
//! It also decides what `--force` may replace or delete: only what an imagefeed writer made,
//! recognised by content ([`is_own_output`], [`foreign_entry`]), deleted so that an interrupted
//! deletion never looks like a dataset (`remove_own_output`, [`DELETING`]).
//!
//! This module knows the formats only through their recognisers (`is_own_file`, `is_own_dir`,
//! staging file names); the writers themselves are in their format modules and implement
//! [`DatasetWriter`](super::writer::DatasetWriter).

use std::fs;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::writer::StartMode;
use super::{hdf5, lmdb, tfrecord};
use crate::error::{Error, IoContext as _, Result};

/// `OUT.partial`: where an output is built.
pub fn partial_path(out: &Path) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(".partial");
    PathBuf::from(name)
}

/// Whether `path` is named like a writer's staging output (`*.partial`). Readers refuse such
/// paths whatever they hold, and writers refuse them as outputs: a dataset under that name
/// could not be told from a half-written one.
pub fn is_staging_name(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.ends_with(".partial"))
}

/// Applies `mode` to an output path: errors if `out` exists without `force`, or a partial output
/// exists without `resume`/`force`; deletes a partial output when forcing a fresh start. Returns
/// the partial path to write.
///
/// `force` only ever replaces what an imagefeed writer made ([`is_own_output`]): an
/// existing `out` or `OUT.partial` that is anything else (a source tree, a folder2lmdb or h5py
/// file, a directory of other files) is an [`Error::NotReplaceable`], and nothing is touched.
/// The old `out` itself stays in place until the new one is complete ([`publish`]).
///
/// [`is_own_output`]: is_own_output
pub fn prepare_output(out: &Path, mode: StartMode) -> Result<PathBuf> {
    // Absolute, so that libraries that canonicalize the parent (heed does) accept a bare name.
    let out = &std::path::absolute(out).at(out)?;
    if is_staging_name(out) {
        return Err(Error::Config(format!(
            "{}: an output may not be named *.partial: that name is how pack-dataset marks \
             unfinished output, and readers refuse it",
            out.display()
        )));
    }
    let partial = partial_path(out);
    if exists(out) {
        if !mode.force {
            return Err(Error::AlreadyExists {
                path: out.to_path_buf(),
                hint: "use --force to replace it".into(),
            });
        }
        refuse_foreign(out)?;
    }
    if exists(&partial) && mode.resume {
        refuse_to_resume_into_foreign(&partial)?;
        drop(lock_staging(&partial)?);
    }
    if exists(&partial) && !mode.resume {
        if !mode.force {
            return Err(Error::AlreadyExists {
                path: partial,
                hint: "an interrupted run left it: --resume to finish it, or --force to start over"
                    .into(),
            });
        }
        refuse_foreign(&partial)?;
        let _writer_lock = lock_staging(&partial)?;
        remove_own_output(&partial)?;
    }
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).at(parent)?;
    }
    Ok(partial)
}

/// How long [`lock_staging`] waits for a lock held by a descriptor copy in a forked child.
const LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_millis(250);

/// Takes the writer's lock on the staging output `partial` (a directory or file): an exclusive,
/// non-blocking `flock` held as long as the returned handle lives, and released by the kernel
/// when the process dies however it dies. A second pack to the same `OUT` (with `--force` or
/// `--resume`) is refused while one is writing, instead of deleting or appending to its files.
pub(crate) fn lock_staging(partial: &Path) -> Result<fs::File> {
    use std::os::fd::AsRawFd as _;
    let file = fs::File::open(partial).at(partial)?;
    // A child forked by another thread at this moment (the HDF5 open trial, a DataLoader
    // worker) holds a copy of every descriptor until it closes them, which the trial does
    // first: a lock held that way is gone within milliseconds, while another run holds its
    // lock for the whole pack. So a held lock is tried again for a short while.
    let deadline = std::time::Instant::now() + LOCK_PATIENCE;
    // SAFETY: flock on a descriptor this function owns; no memory is passed.
    while unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
            continue;
        }
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(Error::NotReplaceable {
                path: partial.to_path_buf(),
                reason: "another pack-dataset run is writing it right now; wait for it to \
                         finish, or stop it first"
                    .into(),
            });
        }
        return Err(Error::io(partial, e));
    }
    Ok(file)
}

/// `Err(NotReplaceable)` unless the staging output `partial` that `--resume` would continue is
/// our own, reached without links: not a link itself, recognised by content, a directory holding
/// only regular files our writers make (no link inside to write through), and a file with no
/// other hard link (a resume rewrites it in place).
fn refuse_to_resume_into_foreign(partial: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = fs::symlink_metadata(partial).at(partial)?;
    let refuse = |why: &str| {
        Err(Error::NotReplaceable {
            path: partial.to_path_buf(),
            reason: format!("--resume continues only its own staging output, and this is {why}"),
        })
    };
    if meta.file_type().is_symlink() {
        return refuse("a link (resuming would write wherever it leads)");
    }
    if meta.is_file() && meta.nlink() > 1 {
        return refuse("a file with other hard links (resuming would rewrite them too)");
    }
    match foreign_description(partial) {
        None => Ok(()),
        Some(what) => refuse(&what),
    }
}

/// True when something (even a dangling symlink) is at `path`.
fn exists(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok()
}

/// `Err(NotReplaceable)` unless `path` is an output an imagefeed writer made.
fn refuse_foreign(path: &Path) -> Result<()> {
    match foreign_description(path) {
        None => Ok(()),
        // Whether an HDF5 file is ours takes libhdf5 to tell: without it, say so instead of
        // calling the file foreign.
        Some(_) if !cfg!(feature = "hdf5") && hdf5::has_signature(path) => {
            Err(hdf5::feature_disabled(path, "replacing an HDF5 file"))
        }
        Some(what) => Err(Error::NotReplaceable {
            path: path.to_path_buf(),
            reason: format!(
                "it is {what}; --force only replaces datasets pack-dataset wrote, and only when \
                 they hold nothing else. Move it away or write somewhere else"
            ),
        }),
    }
}

/// `None` when `path` is an output an imagefeed writer made ([`is_own_output`]);
/// otherwise what it is, for the message that refuses it.
fn foreign_description(path: &Path) -> Option<String> {
    if is_own_output(path) {
        return None;
    }
    Some(match fs::metadata(path) {
        Ok(m) if m.is_dir() => match foreign_entry(path) {
            Some(name) if dir_says_ours(path) => {
                format!("a directory holding {name:?}, which pack-dataset did not write")
            }
            _ => "a directory that is not an imagefeed dataset (no imagefeed manifest or magic)"
                .to_string(),
        },
        Ok(m) if m.is_file() => {
            "a file that is not an imagefeed dataset (no imagefeed magic)".to_string()
        }
        _ => "not an imagefeed dataset".to_string(),
    })
}

/// Moves the finished `partial` to `out`, replacing what is there, so that at every instant
/// `out` is either the old dataset or the new complete one, and syncs the directory so the
/// change survives a crash.
///
/// A file replaces a file with one `rename`, which is atomic. Where a directory is involved (a
/// records dataset), the two are swapped with `renameat2(RENAME_EXCHANGE)`, atomic too, and the
/// old one, now at `partial`, is deleted afterwards (marked, then manifest first: see
/// `remove_own_output`); a crash during that
/// deletion leaves the new dataset in place and the remains of the old one at `partial`, which no
/// reader accepts and the next `--force` run deletes. On a file system without
/// `RENAME_EXCHANGE` the old one is first renamed to `OUT.replaced`, then the new one into place.
pub fn publish(partial: &Path, out: &Path) -> Result<()> {
    // LMDB creates files 0600; a dataset is meant to be shared (readable by all, like cp).
    if partial.is_file() {
        use std::os::unix::fs::PermissionsExt as _;
        fs::set_permissions(partial, fs::Permissions::from_mode(0o644)).at(partial)?;
    }
    let sync_parent = || -> Result<()> {
        if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
            fs::File::open(parent)
                .and_then(|d| d.sync_all())
                .at(parent)?;
        }
        Ok(())
    };
    let old = fs::symlink_metadata(out).ok();
    if old.is_some() {
        // Checked when the pack started, and again now: something may have been put there since.
        refuse_foreign(out)?;
    }
    let involves_a_directory = old.as_ref().is_some_and(|m| m.is_dir()) || partial.is_dir();
    if old.is_none() || !involves_a_directory {
        fs::rename(partial, out).at(out)?;
        return sync_parent();
    }
    match exchange(partial, out) {
        Ok(()) => {
            sync_parent()?;
            // The new dataset is in place; what is at `partial` now is the old one.
            remove_own_output(partial)
        }
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EINVAL | libc::ENOSYS | libc::ENOTSUP)
            ) =>
        {
            let mut aside = out.as_os_str().to_owned();
            aside.push(".replaced");
            let aside = PathBuf::from(aside);
            fs::rename(out, &aside).at(out)?;
            fs::rename(partial, out).at(out)?;
            sync_parent()?;
            remove_own_output(&aside)
        }
        Err(e) => Err(Error::io(out, e)),
    }
}

/// Swaps two paths atomically (Linux `renameat2` with `RENAME_EXCHANGE`).
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt as _;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes()).map_err(|_| std::io::Error::other("NUL in path"))
    };
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: both paths are NUL-terminated strings that live across the call; renameat2 reads
    // them and touches no memory of ours.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(_a: &Path, _b: &Path) -> std::io::Result<()> {
    Err(std::io::Error::from_raw_os_error(libc::ENOSYS))
}

/// `Err(Incomplete)` when `path` does not exist but `PATH.partial` does: a pack was interrupted,
/// and the message says how to finish it.
pub(crate) fn refuse_interrupted(path: &Path) -> Result<()> {
    if is_staging_name(path) {
        return Err(Error::Incomplete {
            path: path.to_path_buf(),
            reason: "named like a pack's staging output (*.partial), which is never a dataset: \
                     it may hold part of one, or the old dataset of an interrupted --force \
                     replacement. Finish the pack with --resume, start over with --force, or \
                     rename it if you know it is complete"
                .into(),
        });
    }
    let partial = partial_path(path);
    let mut aside = path.as_os_str().to_owned();
    aside.push(".replaced");
    let aside = PathBuf::from(aside);
    if !exists(path) && exists(&aside) {
        return Err(Error::Incomplete {
            path: path.to_path_buf(),
            reason: format!(
                "a replacement was interrupted: the old dataset is {} and the new one {}; \
                 rename the one you want to {}",
                aside.display(),
                partial.display(),
                path.display()
            ),
        });
    }
    if !path.exists() && partial.exists() {
        return Err(Error::Incomplete {
            path: path.to_path_buf(),
            reason: format!(
                "only {} exists: the pack was interrupted; rerun it with --resume",
                partial.display()
            ),
        });
    }
    Ok(())
}

/// True when the staging directory `partial` was left by a run killed before its first progress
/// record (`progress_name`) was renamed into place: it holds nothing but uncommitted `.tmp`
/// files of our writers, so nothing was committed and `--resume` starts afresh in it. Call with
/// the staging lock held, then [`clear_uncommitted`].
pub(crate) fn nothing_committed(partial: &Path, progress_name: &str) -> bool {
    !partial.join(progress_name).exists()
        && foreign_entry(partial).is_none()
        && fs::read_dir(partial).is_ok_and(|entries| {
            entries.into_iter().all(|e| {
                e.is_ok_and(|e| {
                    e.file_type().is_ok_and(|t| t.is_file())
                        && e.file_name().to_string_lossy().ends_with(".tmp")
                })
            })
        })
}

/// Removes the uncommitted `.tmp` files of a staging directory [`nothing_committed`] accepted.
pub(crate) fn clear_uncommitted(partial: &Path) -> Result<()> {
    for entry in fs::read_dir(partial).at(partial)? {
        let path = entry.at(partial)?.path();
        fs::remove_file(&path).at(&path)?;
    }
    Ok(())
}

/// Reads the JSON progress record `name` that a staged writer keeps in `partial`.
pub(crate) fn read_staged_progress<T: for<'de> Deserialize<'de>>(
    partial: &Path,
    name: &str,
    what: &str,
) -> Result<T> {
    let path = partial.join(name);
    let text = fs::read_to_string(&path).map_err(|e| Error::ResumeMismatch {
        path: partial.to_path_buf(),
        reason: format!("not a partial {what} (no readable {name}: {e})"),
    })?;
    serde_json::from_str(&text).map_err(|e| Error::ResumeMismatch {
        path,
        reason: format!("malformed: {e}"),
    })
}

/// Cuts a staged file back to the `committed` length its progress record gives, dropping what
/// a chunk in flight wrote before the run stopped; refuses a file shorter than that.
pub(crate) fn cut_to_committed(file: &fs::File, path: &Path, committed: u64) -> Result<()> {
    let have = file.metadata().at(path)?.len();
    if have < committed {
        return Err(Error::ResumeMismatch {
            path: path.to_path_buf(),
            reason: format!("{have} bytes, but {committed} were committed: the file was cut"),
        });
    }
    file.set_len(committed).at(path)
}

/// Refuses to resume the staged output `partial` when the samples it holds (`staged`) are not
/// the ones its progress record counts: every writer checks this when it starts, so that a
/// record edited to count more never resumes past sources it never packed (a hostile try).
pub(crate) fn check_staged_samples(
    partial: &Path,
    staged: u64,
    progress: &super::writer::PackProgress,
) -> Result<()> {
    if staged == progress.samples_written as u64 {
        return Ok(());
    }
    Err(Error::ResumeMismatch {
        path: partial.to_path_buf(),
        reason: format!(
            "{staged} samples staged but the progress record says {}",
            progress.samples_written
        ),
    })
}

/// Opens the file `name` in the staging directory `partial` for reading and writing, creating
/// it when `create` (empty) and never truncating it: a resume cuts it back to what was
/// committed ([`cut_to_committed`]).
pub(crate) fn open_staged_file(partial: &Path, name: &str, create: bool) -> Result<fs::File> {
    let path = partial.join(name);
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .truncate(false)
        .open(&path)
        .at(&path)
}

/// Replaces `path` with `bytes` atomically: writes `PATH.tmp`, syncs it, renames it over `path`
/// ([`crate::file::replace_via`]: never through a link).
pub(crate) fn write_file_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    crate::file::replace_via(Path::new(&tmp), path, bytes, true)
}

/// True when `path` holds something an imagefeed writer made, which `pack-dataset --force` may
/// replace or delete: a dataset of ours (an LMDB or HDF5 file whose metadata carries our magic,
/// a records directory with our manifest), a writer's partial output (its progress record
/// carries our magic), one of those whose deletion was interrupted ([`DELETING`]), or something
/// that holds nothing (an empty directory or file, an LMDB never committed to, a directory
/// holding only a writer's uncommitted `.tmp` files).
///
/// A directory must say so by its content (the magic) *and* hold nothing but the regular files
/// our writers make there ([`foreign_entry`]): a directory of other files, even ones named like
/// our shards, is not ours, nor is one with a manifest of ours copied or forged into it next to
/// other files (a project tree, or a dataset someone added notes to). Anything else (a source
/// tree, an h5py or folder2lmdb file) is not ours either, whatever its name. Symlinks are
/// followed for the question (what is replaced or deleted is the link, never what it points
/// to). A missing path is not ours.
pub fn is_own_output(path: &Path) -> bool {
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => {
            // Empty, or holding only a writer's uncommitted `.tmp` files (a pack killed while
            // writing its first record), it holds nothing; otherwise it must carry our magic.
            let uncommitted = std::fs::read_dir(path).is_ok_and(|entries| {
                entries
                    .into_iter()
                    .all(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".tmp")))
            });
            (uncommitted || dir_says_ours(path)) && foreign_entry(path).is_none()
        }
        Ok(meta) if meta.is_file() => lmdb::is_own_file(path) || hdf5::is_own_file(path),
        _ => false,
    }
}

/// True when the directory `path` carries our magic: a records manifest or progress record, an
/// HDF5 staging progress record, or the [`DELETING`] mark. (What else it holds is
/// [`foreign_entry`]'s question.)
pub(crate) fn dir_says_ours(path: &Path) -> bool {
    tfrecord::is_own_dir(path) || hdf5::is_own_staging(path) || is_being_deleted(path)
}

/// The first entry of the directory `dir` that no imagefeed writer makes there (anything but a
/// regular file named like a records manifest, progress record, shard or shard index, an HDF5
/// staging file, the [`DELETING`] mark, or one of those with `.tmp` appended; and, beside a
/// manifest of ours, a shard or index it does not list); `None` when there is none. An unreadable directory answers with its own name.
pub fn foreign_entry(dir: &Path) -> Option<std::ffi::OsString> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Some(dir.as_os_str().to_owned());
    };
    for entry in entries {
        let Ok(entry) = entry else {
            return Some(dir.as_os_str().to_owned());
        };
        let name = entry.file_name();
        let ours = entry.file_type().is_ok_and(|t| t.is_file())
            && name.to_str().is_some_and(|name| {
                let name = name.strip_suffix(".tmp").unwrap_or(name);
                name == DELETING || tfrecord::is_writer_file(name) || hdf5::is_staging_file(name)
            });
        if !ours {
            return Some(name);
        }
    }
    tfrecord::unlisted_shard_file(dir)
}

/// The file `remove_own_output` puts in a directory before deleting anything in it, and
/// deletes last: a directory whose deletion was interrupted still says it is ours, and that it
/// is not a dataset.
pub const DELETING: &str = "imagefeed-deleting";

/// The magic [`DELETING`] holds.
const DELETING_MAGIC: &str = "imagefeed-deleting";

/// True when `dir` is a directory of ours whose deletion was interrupted (see [`DELETING`]).
pub(crate) fn is_being_deleted(dir: &Path) -> bool {
    staged_magic(dir, DELETING).as_deref() == Some(DELETING_MAGIC)
}

/// Deletes an output [`is_own_output`] recognised; a symlink is removed, not what it points to.
/// A directory is marked first ([`DELETING`]), then loses its manifest and progress record, its
/// other files, and the mark last: if this is interrupted, what is left is never taken for a
/// dataset, and is still recognised as ours.
pub(crate) fn remove_own_output(path: &Path) -> Result<()> {
    let meta = std::fs::symlink_metadata(path).at(path)?;
    if meta.is_dir() {
        let mark = path.join(DELETING);
        let json = format!("{{\"magic\": \"{DELETING_MAGIC}\"}}\n");
        std::fs::write(&mark, json).at(&mark)?;
        let remove = |name: &std::ffi::OsStr| -> Result<()> {
            let entry = path.join(name);
            let result = match std::fs::symlink_metadata(&entry) {
                Ok(m) if m.is_dir() => std::fs::remove_dir_all(&entry),
                Ok(_) => std::fs::remove_file(&entry),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e),
            };
            result.at(entry)
        };
        // What makes it a dataset (or a resumable pack) goes first.
        remove(tfrecord::MANIFEST.as_ref())?;
        remove(tfrecord::PROGRESS.as_ref())?;
        remove(hdf5::STAGED_PROGRESS.as_ref())?;
        for entry in std::fs::read_dir(path).at(path)? {
            let name = entry.at(path)?.file_name();
            if name != DELETING {
                remove(&name)?;
            }
        }
        std::fs::remove_file(&mark).at(&mark)?;
        std::fs::remove_dir(path).at(path)
    } else {
        std::fs::remove_file(path).at(path)?;
        // An LMDB writer's lock file, if one was left.
        let mut lock = path.as_os_str().to_owned();
        lock.push("-lock");
        let _ = std::fs::remove_file(lock);
        Ok(())
    }
}

/// The `magic` field of the JSON file `name` in the directory `dir`, if it has one.
pub(crate) fn staged_magic(dir: &Path, name: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct Magic {
        magic: String,
    }
    use std::io::Read as _;
    let (file, _) = crate::file::open_regular(&dir.join(name)).ok()?;
    let mut text = Vec::new();
    // A progress record or manifest is small; a huge file under that name is not ours.
    file.take(64 << 20).read_to_end(&mut text).ok()?;
    serde_json::from_slice::<Magic>(&text).ok().map(|m| m.magic)
}
