//! Opening and reading the files users name: only regular files, never blocking, and never
//! reading more than an image of the kind the file starts with can take.
//!
//! An ImageFolder tree is whatever is on disk: a FIFO named `pipe.jpg` would block a reader
//! forever at `open`, a symlink to `/dev/zero` never ends, and a 2 GiB sparse `.jpg` would be
//! read whole into memory (per thread) before a decoder saw it was not an image. So
//! [`open_regular`] refuses anything but a regular file by path, without blocking, and
//! [`read_image_file`] reads a file's first [`SNIFF_BYTES`] first and the rest only when its
//! length is one an image of that format and (where the header says) size can have.

use std::fs;
use std::io::{self, Read as _};
use std::os::unix::fs::{FileTypeExt as _, OpenOptionsExt as _};
use std::path::Path;

use crate::decode;
use crate::error::{Error, IoContext as _, Result};

/// How much of a file is read before its format is known.
pub const SNIFF_BYTES: usize = 64 << 10;

/// What a file that is not a regular file is, for messages.
pub(crate) fn kind(file_type: fs::FileType) -> &'static str {
    if file_type.is_dir() {
        "a directory"
    } else if file_type.is_fifo() {
        "a FIFO (named pipe)"
    } else if file_type.is_socket() {
        "a socket"
    } else if file_type.is_char_device() {
        "a character device"
    } else if file_type.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    }
}

/// Opens `path` (following symlinks) for reading when it is a regular file, and returns it
/// with its length. Anything else is an [`Error::RefusedFile`] naming the path and what it is;
/// a FIFO is never opened in a way that could block.
pub fn open_regular(path: &Path) -> Result<(fs::File, u64)> {
    let refuse = |file_type: fs::FileType| Error::RefusedFile {
        path: path.to_path_buf(),
        reason: format!("{}, not a regular file", kind(file_type)),
    };
    let meta = fs::metadata(path).at(path)?;
    if !meta.is_file() {
        return Err(refuse(meta.file_type()));
    }
    // Swapped for a FIFO since the check? O_NONBLOCK makes the open return at once, and the
    // check on the open file catches it. It changes nothing for a regular file.
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .at(path)?;
    let meta = file.metadata().at(path)?;
    if !meta.is_file() {
        return Err(refuse(meta.file_type()));
    }
    Ok((file, meta.len()))
}

/// Reads the first `want` bytes of the regular file at `path` (fewer if it is shorter) and
/// returns the file's length: an error naming the file when the read fails, or ends before the
/// file's length says it should (a failing disk or network filesystem), rather than bytes that
/// look like another format.
pub fn check_head_readable(path: &Path, want: u64) -> Result<u64> {
    let (file, len) = open_regular(path)?;
    let want = want.min(len);
    let mut head = Vec::new();
    let got = file
        .take(want)
        .read_to_end(&mut head)
        .map_err(|e| io::Error::new(e.kind(), format!("reading its first bytes: {e}")))
        .at(path)?;
    if (got as u64) < want {
        return Err(Error::io(
            path,
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the file is {len} bytes, but reading its start ended after {got}"),
            ),
        ));
    }
    Ok(len)
}

/// Reads the image file at `path` into `buffer` (cleared first; its capacity is reused).
///
/// Refuses, by path and without reading further, a file that is not a regular file, and one
/// longer than [`SNIFF_BYTES`] whose first bytes are not an image format we decode or whose
/// length is more than an image of that format and declared size can take
/// ([`decode::max_file_len`]).
pub fn read_image_file(path: &Path, buffer: &mut Vec<u8>) -> Result<()> {
    let (file, len) = open_regular(path)?;
    buffer.clear();
    // Room for the whole file (up to the first step) and the read that finds its end.
    buffer.reserve(len.min(SNIFF_BYTES as u64) as usize + 1);
    let mut reader = file.take(SNIFF_BYTES as u64);
    reader.read_to_end(buffer).at(path)?;
    if (buffer.len() as u64) < len {
        let most = decode::max_file_len(buffer).map_err(|reason| Error::RefusedFile {
            path: path.to_path_buf(),
            reason: format!("{len} bytes, and {reason}: refusing to read it"),
        })?;
        if len > most.bytes {
            return Err(Error::RefusedFile {
                path: path.to_path_buf(),
                reason: format!(
                    "{len} bytes, more than {} can take ({} bytes): refusing to read it",
                    most.what, most.bytes
                ),
            });
        }
        // At most one byte past the limit, in case the file grew since it was measured.
        buffer.reserve((len - buffer.len() as u64) as usize + 1);
        let mut rest = reader
            .into_inner()
            .take(most.bytes + 1 - buffer.len() as u64);
        rest.read_to_end(buffer).at(path)?;
        if buffer.len() as u64 > most.bytes {
            return Err(Error::RefusedFile {
                path: path.to_path_buf(),
                reason: format!(
                    "grew past the {} bytes {} can take while it was read",
                    most.bytes, most.what
                ),
            });
        }
    }
    Ok(())
}

/// Bytes an unprivileged writer can still put on the file system that holds `path` (or, when
/// `path` does not exist, its directory), or `None` when that cannot be found out.
pub fn free_space(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt as _;
    let existing = if path.exists() { path } else { path.parent()? };
    let name = std::ffi::CString::new(existing.as_os_str().as_bytes()).ok()?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `name` is NUL-terminated and `stat` is valid for writes of one statvfs.
    if unsafe { libc::statvfs(name.as_ptr(), stat.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `stat`.
    let stat = unsafe { stat.assume_init() };
    // Both are narrower than u64 on 32-bit targets.
    #[allow(clippy::useless_conversion)]
    let free = u64::from(stat.f_bavail).saturating_mul(u64::from(stat.f_frsize));
    Some(free)
}

/// What is at `path` itself (a link is described, not followed); `None` when nothing is.
pub(crate) fn entry_metadata(path: &Path) -> Result<Option<fs::Metadata>> {
    match fs::symlink_metadata(path) {
        Ok(meta) => Ok(Some(meta)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// Replaces `path` with a file holding `bytes`: written to `tmp` (beside it), synced when
/// `sync`, then renamed over `path`. Whatever was at `tmp` (a crash's leftover, a link) is
/// unlinked and the new file created exclusively, and the rename replaces a link at `path`:
/// no link is ever written through, and `path` is never seen half written.
pub(crate) fn replace_via(tmp: &Path, path: &Path, bytes: &[u8], sync: bool) -> Result<()> {
    use std::io::Write as _;
    match fs::remove_file(tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(tmp, e)),
        _ => {}
    }
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(tmp)
        .at(tmp)?;
    file.write_all(bytes).at(tmp)?;
    if sync {
        file.sync_all().at(tmp)?;
    }
    drop(file);
    fs::rename(tmp, path).at(path)
}

/// Serializes a path as text, bytes that are not UTF-8 replaced with U+FFFD: for the reports
/// (pack, inspect, verify) whose paths a user named, which need not be UTF-8; serde's own
/// `Path` serializer fails on them, and a report must not.
pub(crate) fn serialize_lossy<S: serde::Serializer>(
    path: &Path,
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    serializer.serialize_str(&path.to_string_lossy())
}

/// [`serialize_lossy`] for an optional path.
pub(crate) fn serialize_lossy_option<S: serde::Serializer>(
    path: &Option<std::path::PathBuf>,
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    match path {
        Some(path) => serializer.serialize_some(&*path.to_string_lossy()),
        None => serializer.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pipe.jpg");
        let name = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let err = read_image_file(&fifo, &mut Vec::new()).unwrap_err();
        assert!(
            matches!(err, Error::RefusedFile { .. }) && err.to_string().contains("FIFO"),
            "{err}"
        );
        assert!(err.to_string().contains("pipe.jpg"));
    }

    #[test]
    fn devices_and_directories_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("zero.jpg");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let err = read_image_file(&link, &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("character device"), "{err}");
        let err = read_image_file(dir.path(), &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("a directory"), "{err}");
    }

    #[test]
    fn a_large_file_that_is_not_an_image_is_refused_after_its_first_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let sparse = dir.path().join("sparse.jpg");
        let file = fs::File::create(&sparse).unwrap();
        file.set_len(2 << 30).unwrap(); // 2 GiB of holes
        let mut buffer = Vec::new();
        let err = read_image_file(&sparse, &mut buffer).unwrap_err();
        assert!(
            err.to_string()
                .contains("2147483648 bytes, and its first bytes are not an image format"),
            "{err}"
        );
        assert!(buffer.capacity() <= 2 * SNIFF_BYTES);
    }
}
