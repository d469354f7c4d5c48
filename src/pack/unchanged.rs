//! The source a pack read is the one it opened: checked before the output is published, and
//! what a `--resume` compares.
//!
//! Readers catch a source file cut short at the first byte that is gone, and one replaced or
//! rewritten where a record's checksum fails; a file rewritten in place under a format without
//! checksums, or an image folder's class directories moved away mid-pack (every file after
//! them "rejected") left an output that looked complete (hostile tries). The identities
//! (device, inode, size, modification time) of the source's files, and of an image folder's
//! root and class directories, are taken when the pack starts and compared before it
//! publishes: any change stops it, the work done kept in `OUT.partial`. Their digest is part
//! of the source's fingerprint, so a `--resume` refuses a source rewritten between the runs.

use std::ffi::OsString;
use std::fs;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use super::worker::Source;
use crate::dataset::Dataset as _;
use crate::error::{Error, IoContext as _, Result};
use crate::format::FileIdentity;
use crate::format::staging::partial_path;

/// Files a directory source may hold that change while it is read without its records
/// changing: liblmdb's lock file.
const NOT_RECORDS: [&str; 1] = ["lock.mdb"];

/// The most entries of a directory source the walk looks at, and how deep it goes.
const MOST_ENTRIES: usize = 1 << 20;
const DEEPEST: usize = 16;

/// The identities of a source's files, and of an image folder's directories.
pub(super) struct SourceFiles {
    files: Vec<(PathBuf, FileIdentity)>,
    /// An image folder's root, then its class directories, each with (device, inode): the
    /// files are listed, not mapped, and read by path.
    dirs: Vec<(PathBuf, (u64, u64))>,
}

impl SourceFiles {
    /// The identities of `source`'s files now, leaving out the output `out` (its staging
    /// copy and report) wherever it lies. A source in object storage has none (objects are
    /// checked by their ETags).
    pub(super) fn of(source: &Source<'_>, out: &Path) -> Result<SourceFiles> {
        let outputs = [
            out.to_path_buf(),
            partial_path(out),
            super::report_path(out),
        ];
        let is_output = |path: &Path| outputs.iter().any(|o| path.starts_with(o));
        if let Source::Folder(folder) = source {
            let root = folder.path();
            let meta = fs::metadata(root).at(root)?;
            let mut dirs = vec![(root.to_path_buf(), (meta.dev(), meta.ino()))];
            for entry in fs::read_dir(root).at(root)? {
                let path = entry.at(root)?.path();
                if let Ok(meta) = fs::metadata(&path)
                    && meta.is_dir()
                    && !is_output(&path)
                {
                    dirs.push((path, (meta.dev(), meta.ino())));
                }
            }
            return Ok(SourceFiles {
                files: Vec::new(),
                dirs,
            });
        }
        let mut files = Vec::new();
        for path in source.paths() {
            if crate::remote::is_url(&path.to_string_lossy()) {
                continue;
            }
            let members = if crate::format::shards::is_pattern(path) {
                crate::format::shards::expand_pattern(path)?
            } else {
                vec![path.to_path_buf()]
            };
            for member in members.iter().filter(|m| !is_output(m)) {
                push_tree(member, &is_output, &mut files)?;
            }
        }
        Ok(SourceFiles {
            files,
            dirs: Vec::new(),
        })
    }

    /// A digest of the identities: what changes when any file of the source does.
    pub(super) fn digest(&self) -> String {
        let mut hasher = Sha256::new();
        for (path, identity) in &self.files {
            hasher.update(path.as_os_str().as_encoded_bytes());
            hasher.update([0]);
            hasher.update(format!("{identity:?}").as_bytes());
        }
        for (path, (dev, ino)) in &self.dirs {
            hasher.update(path.as_os_str().as_encoded_bytes());
            hasher.update([0]);
            hasher.update(dev.to_le_bytes());
            hasher.update(ino.to_le_bytes());
        }
        crate::dataset::hex(&hasher.finalize())
    }

    /// `Ok` when every file and directory is still the one the pack started with, else
    /// [`Error::FileChanged`] naming the first that is not.
    pub(super) fn check(&self) -> Result<()> {
        for (dir, identity) in &self.dirs {
            let now = fs::metadata(dir).ok().map(|m| (m.dev(), m.ino()));
            if now != Some(*identity) {
                return Err(Error::FileChanged {
                    path: dir.clone(),
                    change: match now {
                        None => "the folder is gone (moved or deleted while packed)".into(),
                        Some(_) => "another folder was put in its place while packed".into(),
                    },
                });
            }
        }
        for (path, identity) in &self.files {
            identity.check(path).map_err(|e| match e {
                Error::Io { path, .. } => Error::FileChanged {
                    path,
                    change: "it is gone (moved or deleted while packed)".into(),
                },
                e => e,
            })?;
        }
        Ok(())
    }
}

/// Pushes the identity of `path`, a file, or of every file under it, a directory: real
/// directories only (a link to a directory is not followed: two links back up made the walk
/// endless), those it cannot list left out (the dataset's open does not read them either).
fn push_tree(
    path: &Path,
    is_output: &dyn Fn(&Path) -> bool,
    files: &mut Vec<(PathBuf, FileIdentity)>,
) -> Result<()> {
    let meta = fs::metadata(path).at(path)?;
    if !meta.is_dir() {
        files.push((path.to_path_buf(), FileIdentity::of(&meta)));
        return Ok(());
    }
    let mut dirs = vec![(path.to_path_buf(), 0)];
    let mut seen = 0;
    while let Some((dir, depth)) = dirs.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            if dir == path {
                fs::read_dir(&dir).at(&dir)?;
            }
            continue;
        };
        let mut names: Vec<(OsString, PathBuf)> = Vec::new();
        for entry in entries.flatten() {
            names.push((entry.file_name(), entry.path()));
        }
        names.sort();
        for (name, file) in names {
            seen += 1;
            if seen > MOST_ENTRIES || NOT_RECORDS.iter().any(|n| name == *n) || is_output(&file) {
                continue;
            }
            let Ok(link) = fs::symlink_metadata(&file) else {
                continue;
            };
            if link.is_dir() {
                if depth < DEEPEST {
                    dirs.push((file, depth + 1));
                }
                continue;
            }
            // A file, or a link to one (a link to a directory, or a dangling one, is left out).
            if let Ok(meta) = fs::metadata(&file)
                && meta.is_file()
            {
                files.push((file, FileIdentity::of(&meta)));
            }
        }
    }
    Ok(())
}
