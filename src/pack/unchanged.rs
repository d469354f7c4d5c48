//! The source a pack read is the one it opened: checked before the output is published.
//!
//! Readers catch a source file cut short at the first byte that is gone, and one replaced or
//! rewritten where a record's checksum fails; a file rewritten in place under a format without
//! checksums, a cut inside the last page of a mapped shard (read as zeros), or an image folder
//! moved away mid-pack (every file after it "rejected") left an output that looked complete
//! (hostile tries). The files' identities (device, inode, size, modification time) are taken
//! when the pack starts and compared before it publishes: any change stops it, the work done
//! kept in `OUT.partial`.

use std::fs;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use super::worker::Source;
use crate::dataset::Dataset as _;
use crate::error::{Error, IoContext as _, Result};
use crate::format::FileIdentity;

/// Files a directory source may hold that change while it is read without its records
/// changing: liblmdb's lock file.
const NOT_RECORDS: [&str; 1] = ["lock.mdb"];

/// The most files of a directory source whose identities are taken (a bound on the walk).
const MOST_FILES: usize = 1 << 20;

/// The identities of a source's files, and of an image folder's root.
pub(super) struct SourceFiles {
    files: Vec<(PathBuf, FileIdentity)>,
    /// An image folder's root and its (device, inode): its files are listed, not mapped, and
    /// one missing is a rejection of its own; the root gone or replaced is the source's.
    root: Option<(PathBuf, (u64, u64))>,
}

impl SourceFiles {
    /// The identities of `source`'s files now. A source in object storage or named by a
    /// pattern that matches nothing local has none (objects are checked by their ETags).
    pub(super) fn of(source: &Source<'_>) -> Result<SourceFiles> {
        if let Source::Folder(folder) = source {
            let root = folder.path();
            let meta = fs::metadata(root).at(root)?;
            return Ok(SourceFiles {
                files: Vec::new(),
                root: Some((root.to_path_buf(), (meta.dev(), meta.ino()))),
            });
        }
        let mut files = Vec::new();
        for path in source.paths() {
            let text = path.to_string_lossy();
            if crate::remote::is_url(&text) {
                continue;
            }
            if crate::format::shards::is_pattern(path) {
                for member in crate::format::shards::expand_pattern(path)? {
                    push_tree(&member, &mut files)?;
                }
            } else {
                push_tree(path, &mut files)?;
            }
        }
        Ok(SourceFiles { files, root: None })
    }

    /// `Ok` when every file is still the one the pack started with, else
    /// [`Error::FileChanged`] naming the first that is not.
    pub(super) fn check(&self) -> Result<()> {
        if let Some((root, identity)) = &self.root {
            let now = fs::metadata(root).ok().map(|m| (m.dev(), m.ino()));
            if now != Some(*identity) {
                return Err(Error::FileChanged {
                    path: root.clone(),
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

/// Pushes the identity of `path`, a file, or of every file under it, a directory.
fn push_tree(path: &Path, files: &mut Vec<(PathBuf, FileIdentity)>) -> Result<()> {
    let meta = fs::metadata(path).at(path)?;
    if !meta.is_dir() {
        files.push((path.to_path_buf(), FileIdentity::of(&meta)));
        return Ok(());
    }
    let mut dirs = vec![path.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).at(&dir)? {
            let entry = entry.at(&dir)?;
            let name = entry.file_name();
            if NOT_RECORDS.iter().any(|n| name == *n) {
                continue;
            }
            let file = entry.path();
            let Ok(meta) = fs::metadata(&file) else {
                continue; // a dangling link: no file the source reads
            };
            if meta.is_dir() {
                dirs.push(file);
            } else if meta.is_file() && files.len() < MOST_FILES {
                files.push((file, FileIdentity::of(&meta)));
            }
        }
    }
    Ok(())
}
