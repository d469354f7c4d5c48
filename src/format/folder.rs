//! Raw ImageFolder trees: `root/<class>/**/<file>`, read one file per sample.
//!
//! Classes and order follow torchvision's `ImageFolder` exactly, so labels never change when a
//! user switches loaders:
//! - classes are the sub-directories of `root` (symlinks followed), sorted by name
//!   (code-point order, as Python sorts `str`); a class's label is its position in that list;
//! - inside a class, files are collected recursively like `sorted(os.walk(class_dir,
//!   followlinks=True))`: directories in sorted path order, each directory's files sorted by name;
//! - a file counts when its name ends, case-insensitively, with one of [`IMAGE_EXTENSIONS`];
//!   other files are skipped (and counted in [`ImageFolder::skipped_files`]);
//! - a class with no image file, or a root with no class, is an error, as in torchvision.
//!
//! Writing is `pack-dataset`'s job; the only "writer" of this format is
//! [`synthetic`](crate::synthetic), which makes test trees.

use std::collections::HashSet;
use std::fs;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dataset::{Dataset, DatasetInfo, FormatKind, PayloadKind, Record, RecordReader};
use crate::error::{Error, IoContext as _, Result};
use crate::format::Recognizer;

/// torchvision's `IMG_EXTENSIONS`, matched case-insensitively at the end of the file name.
pub const IMAGE_EXTENSIONS: &[&str] = &[
    ".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp",
];

/// True when `name` has one of [`IMAGE_EXTENSIONS`] (case-insensitive).
pub fn has_image_extension(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    IMAGE_EXTENSIONS.iter().any(|ext| lower.ends_with(ext))
}

/// One sample of a scanned tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FolderEntry {
    /// Path relative to the root, `/`-separated (the record key in packed formats).
    pub key: String,
    /// Class index.
    pub label: u32,
    /// The file's name (or a directory's on its path) is not valid UTF-8: `key` is its lossy
    /// form, and reading the entry fails with a reason naming it. One such file costs only
    /// itself, not the scan of the tree.
    pub non_utf8_name: bool,
}

/// A scanned ImageFolder tree.
#[derive(Debug, Clone)]
pub struct ImageFolder {
    root: PathBuf,
    info: DatasetInfo,
    entries: Arc<[FolderEntry]>,
    skipped_files: usize,
    /// What scanning found that a user should hear about (class names that are not UTF-8).
    notices: Vec<String>,
}

/// [`format::open`](crate::format::open)'s recognizer for an ImageFolder tree: any directory
/// no format before it recognised.
pub(crate) const TREE: Recognizer = Recognizer {
    holds: |path| Ok(path.is_dir()),
    open: |path, _| Ok(Arc::new(ImageFolder::open(path)?)),
};

impl ImageFolder {
    /// Scans `root`. Fails when it is not a directory, has no class directory, or when a class
    /// holds no image file. A name that is not valid UTF-8 costs only the files under it: a
    /// class directory so named keeps its place in torchvision's order (its name shown lossily,
    /// with a notice) and each of its files, like any file or nested directory so named,
    /// becomes an entry that fails to read (see [`FolderEntry::non_utf8_name`]).
    pub fn open(root: impl AsRef<Path>) -> Result<ImageFolder> {
        let root = root.as_ref().to_path_buf();
        let meta = fs::metadata(&root).at(&root)?;
        if !meta.is_dir() {
            return Err(Error::not_a_dataset(&root, "not a directory"));
        }
        let mut class_dirs = Vec::new();
        for entry in fs::read_dir(&root).at(&root)? {
            let entry = entry.at(&root)?;
            // fs::metadata follows symlinks, like os.scandir's is_dir().
            if fs::metadata(entry.path())
                .map(|m| m.is_dir())
                .unwrap_or(false)
            {
                class_dirs.push(entry.file_name());
            }
        }
        // torchvision sorts the names Python decoded (undecodable bytes as U+DC80..U+DCFF).
        class_dirs.sort_by_cached_key(|name| python_order(name.as_bytes()));
        let mut notices = Vec::new();
        let classes: Vec<String> = class_dirs
            .iter()
            .map(|name| {
                let lossy = escaped_name(name.as_bytes());
                if name.to_str().is_none() {
                    crate::dataset::notice(
                        &mut notices,
                        format!(
                            "{}: the class directory {lossy:?} has a name that is not valid \
                             UTF-8: it keeps its label (so the others match torchvision's), and \
                             each of its files is refused until it is renamed",
                            root.display()
                        ),
                    );
                }
                lossy
            })
            .collect();
        // Two names alike are two classes nothing downstream tells apart (a name-to-class
        // table keeps one): only a name escaped as another spells it can make them.
        if let Some((first, second)) = crate::dataset::first_repeat(classes.iter()) {
            return Err(Error::BadImageFolder {
                path: root,
                reason: format!(
                    "class directories {:?} and {:?} are both named {:?} once their bytes that \
                     are not UTF-8 are escaped: rename one",
                    class_dirs[first], class_dirs[second], classes[first]
                ),
            });
        }
        if classes.is_empty() {
            // A class folder given as the root (one level too deep) is the usual reason.
            let images = fs::read_dir(&root)
                .map(|entries| {
                    entries
                        .filter_map(|e| e.ok())
                        .filter(|e| e.file_name().to_str().is_some_and(has_image_extension))
                        .count()
                })
                .unwrap_or(0);
            // (Given as `class00`, the directory above is `.`.)
            let parent = std::path::absolute(&root)
                .ok()
                .and_then(|r| r.parent().map(Path::to_path_buf));
            let hint = match parent {
                Some(parent) if images > 0 => format!(
                    "; it holds {} itself: a class folder? The root is the directory above \
                     its class folders ({})",
                    crate::dataset::plural(images, "image file", "image files"),
                    parent.display()
                ),
                _ => String::new(),
            };
            return Err(Error::BadImageFolder {
                path: root,
                reason: format!("no class directories (expected root/<class>/<image files>){hint}"),
            });
        }
        let mut entries = Vec::new();
        let mut skipped_files = 0;
        let mut empty = Vec::new();
        for (label, (class, dir)) in classes.iter().zip(&class_dirs).enumerate() {
            let before = entries.len();
            let mut files = Vec::new();
            walk_sorted(&root, dir, class, &mut HashSet::new(), &mut files)?;
            for (key, non_utf8_name) in files {
                let name = key.rsplit('/').next().unwrap_or(&key);
                if has_image_extension(name) {
                    entries.push(FolderEntry {
                        key,
                        label: label as u32,
                        non_utf8_name,
                    });
                } else {
                    skipped_files += 1;
                }
            }
            if entries.len() == before {
                empty.push(class.clone());
            }
        }
        if !empty.is_empty() {
            return Err(Error::BadImageFolder {
                path: root,
                reason: format!(
                    "no image file in {} (extensions: {})",
                    match &empty[..] {
                        [one] => format!("class folder {one}"),
                        // A root one level too high (the user's home, /tmp) lists hundreds.
                        many => format!(
                            "{} class folders: {}",
                            many.len(),
                            crate::dataset::first_of(many, 5)
                        ),
                    },
                    IMAGE_EXTENSIONS.join(" ")
                ),
            });
        }
        let info = DatasetInfo {
            format: FormatKind::Folder,
            num_samples: entries.len(),
            classes,
            payload: PayloadKind::Encoded,
            resized_short_side: None,
            part: None,
            rejected_at_pack: None,
            restart_markers: false,
        };
        Ok(ImageFolder {
            root,
            info,
            entries: entries.into(),
            skipped_files,
            notices,
        })
    }

    /// The samples, in dataset order.
    pub fn entries(&self) -> &[FolderEntry] {
        &self.entries
    }

    /// Files skipped because their extension is not an image extension.
    pub fn skipped_files(&self) -> usize {
        self.skipped_files
    }

    /// The full path of sample `index` (lossy when [`FolderEntry::non_utf8_name`]).
    pub fn file_path(&self, index: usize) -> PathBuf {
        self.root.join(&self.entries[index].key)
    }

    /// Reads sample `index`'s file into `buffer`. Refused by path, without reading further: a
    /// file that is not a regular file, and one whose first bytes are not an image format we
    /// decode or whose length is more than an image of that format and declared size can take;
    /// an entry whose name is not UTF-8 is an [`Error::RefusedFile`] naming its lossy path.
    pub fn read_file(&self, index: usize, buffer: &mut Vec<u8>) -> Result<()> {
        read_entry(&self.root, &self.entries[index], buffer)
    }
}

fn read_entry(root: &Path, entry: &FolderEntry, buffer: &mut Vec<u8>) -> Result<()> {
    let path = root.join(&entry.key);
    if entry.non_utf8_name {
        return Err(Error::RefusedFile {
            path,
            reason: "its name, or a directory's on its path, is not valid UTF-8 (shown with \
                     U+FFFD in its place, or as \\xNN in a class directory's name); rename it"
                .into(),
        });
    }
    crate::file::read_image_file(&path, buffer)
}

/// Collects the files under `root/rel` as `/`-joined keys, in `sorted(os.walk(...))` order:
/// every directory of the subtree sorted by its full path *as a string* (so `a/sub` <
/// `a/sub b` < `a/sub/deeper`, because ' ' < '/'), and each directory's files sorted by name.
/// Each key comes with whether a name on its path is not UTF-8 (its key then holds the lossy
/// form).
fn walk_sorted(
    root: &Path,
    dir: &std::ffi::OsStr,
    class: &str,
    visited: &mut HashSet<PathBuf>,
    out: &mut Vec<(String, bool)>,
) -> Result<()> {
    let mut dirs = Vec::new();
    collect_dirs(
        root,
        Path::new(dir),
        class.to_string(),
        dir.to_str().is_none(),
        visited,
        &mut dirs,
    )?;
    dirs.sort_by(|a, b| a.0.cmp(&b.0));
    for (prefix, prefix_bad, files) in dirs {
        out.extend(
            files
                .into_iter()
                .map(|(f, bad)| (format!("{prefix}/{f}"), prefix_bad || bad)),
        );
    }
    Ok(())
}

/// A directory's key prefix, whether a name on it is not UTF-8, and its files' names (sorted)
/// each with whether it is not UTF-8.
type DirListing = (String, bool, Vec<(String, bool)>);

/// Pushes the listing of `rel` (whose key prefix is `prefix`) and of every directory below it.
fn collect_dirs(
    root: &Path,
    rel: &Path,
    prefix: String,
    prefix_bad: bool,
    visited: &mut HashSet<PathBuf>,
    out: &mut Vec<DirListing>,
) -> Result<()> {
    let dir = root.join(rel);
    // Guard against symlink cycles, which os.walk(followlinks=True) would loop on.
    let canonical = fs::canonicalize(&dir).at(&dir)?;
    if !visited.insert(canonical) {
        return Ok(());
    }
    let mut files = Vec::new();
    let mut subdirs = Vec::new();
    for entry in fs::read_dir(&dir).at(&dir)? {
        let entry = entry.at(&dir)?;
        let os_name = entry.file_name();
        let (name, bad) = match os_name.to_str() {
            Some(name) => (name.to_string(), false),
            None => (os_name.to_string_lossy().into_owned(), true),
        };
        match fs::metadata(entry.path()) {
            Ok(m) if m.is_dir() => subdirs.push((os_name, name, bad)),
            // A path longer than the system allows (PATH_MAX) cannot be opened by it: every
            // image below would be left out, and a hostile try found them counted as "files
            // without an image extension". An error naming it, as an unreadable directory is.
            Err(e) if e.raw_os_error() == Some(libc::ENAMETOOLONG) => {
                return Err(Error::io(
                    entry.path(),
                    std::io::Error::new(
                        e.kind(),
                        format!(
                            "{e}: a path of {} bytes, longer than this system opens; \
                             nothing below it could be read",
                            entry.path().as_os_str().len()
                        ),
                    ),
                ));
            }
            // Files, and dangling symlinks (os.walk lists them as files; reading one fails with
            // its path).
            _ => files.push((name, bad)),
        }
    }
    files.sort();
    out.push((prefix.clone(), prefix_bad, files));
    for (os_name, name, bad) in subdirs {
        collect_dirs(
            root,
            &rel.join(os_name),
            format!("{prefix}/{name}"),
            prefix_bad || bad,
            visited,
            out,
        )?;
    }
    Ok(())
}

/// A class directory's name as text: UTF-8 as it is, every byte that is not valid UTF-8 as
/// `\xNN`. (A lossy conversion made every such byte U+FFFD, so `caf\xe9` and `caf\xe8` were
/// two classes of one name, which a pack wrote and every reader then refused.)
fn escaped_name(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut name = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        name.push_str(chunk.valid());
        for byte in chunk.invalid() {
            let _ = write!(name, "\\x{byte:02x}");
        }
    }
    name
}

/// The order Python (and so torchvision) sorts a file name in: by code point, after decoding
/// it as UTF-8 with `surrogateescape` (each undecodable byte `b` becomes U+DC00 + `b`). For a
/// valid UTF-8 name this is its byte order.
fn python_order(name: &[u8]) -> Vec<u32> {
    let mut order = Vec::with_capacity(name.len());
    for chunk in name.utf8_chunks() {
        order.extend(chunk.valid().chars().map(u32::from));
        order.extend(chunk.invalid().iter().map(|&b| 0xDC00 + u32::from(b)));
    }
    order
}

impl Dataset for ImageFolder {
    fn info(&self) -> &DatasetInfo {
        &self.info
    }

    fn path(&self) -> &Path {
        &self.root
    }

    fn notices(&self) -> &[String] {
        &self.notices
    }

    fn listed(&self, index: usize) -> Option<(&str, u32)> {
        self.entries.get(index).map(|e| (e.key.as_str(), e.label))
    }

    fn open_reader(&self) -> Result<Box<dyn RecordReader>> {
        Ok(Box::new(FolderReader {
            root: self.root.clone(),
            entries: Arc::clone(&self.entries),
            buffer: Vec::new(),
        }))
    }
}

/// Per-worker handle: reads whole files into a reused buffer.
struct FolderReader {
    root: PathBuf,
    entries: Arc<[FolderEntry]>,
    buffer: Vec<u8>,
}

impl RecordReader for FolderReader {
    fn read(&mut self, index: usize) -> Result<Record<'_>> {
        let entry = &self.entries[index];
        read_entry(&self.root, entry, &mut self.buffer)?;
        Ok(Record {
            index,
            key: &entry.key,
            label: entry.label,
            payload: &self.buffer,
        })
    }

    /// Each read opens and reads a file again: a system call or two per image, about what
    /// decoding a small JPEG together with others saves.
    fn rereads_are_cheap(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(root: &Path, rel: &str) {
        let path = root.join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, rel.as_bytes()).unwrap();
    }

    /// Images below a path longer than PATH_MAX were left out as "files without an image
    /// extension" (a hostile try); the scan now fails naming the path.
    #[test]
    fn a_directory_nested_past_the_path_limit_is_an_error_naming_it() {
        use std::ffi::CString;
        use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        touch(root, "a/1.jpg");
        // Made relative to each level's descriptor (the whole path is too long to name).
        let name = CString::new("d".repeat(200)).unwrap();
        let mut at = OwnedFd::from(fs::File::open(root.join("a")).unwrap());
        for _ in 0..22 {
            // SAFETY: plain syscalls on a descriptor this test owns and a NUL-terminated name.
            unsafe {
                assert_eq!(libc::mkdirat(at.as_raw_fd(), name.as_ptr(), 0o755), 0);
                let next = libc::openat(at.as_raw_fd(), name.as_ptr(), libc::O_DIRECTORY);
                assert!(next >= 0);
                at = OwnedFd::from_raw_fd(next);
            }
        }
        match ImageFolder::open(root) {
            Err(Error::Io { path, source }) => {
                assert!(path.as_os_str().len() > libc::PATH_MAX as usize, "{path:?}");
                assert_eq!(source.raw_os_error(), None, "wrapped with what it means");
                assert!(source.to_string().contains("longer than"), "{source}");
            }
            other => panic!("{:?}", other.map(|f| f.len())),
        }
    }

    /// A class directory whose name is not UTF-8 used to fail the whole scan (torchvision takes
    /// it). It now keeps its place in Python's order (undecodable bytes sort as U+DC80..U+DCFF,
    /// which is not byte order: b"\xf5" before "\u{E000}", whose first byte is 0xEE), with a
    /// notice; its files are entries that fail to read, the other classes read as before.
    #[test]
    fn a_class_named_in_bytes_that_are_not_utf8_keeps_its_label_and_costs_only_its_files() {
        use std::os::unix::ffi::OsStrExt as _;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        touch(root, "a/1.jpg");
        touch(root, "\u{E000}/1.jpg");
        let odd = root.join(std::ffi::OsStr::from_bytes(b"\xf5"));
        fs::create_dir(&odd).unwrap();
        fs::write(odd.join("1.jpg"), b"x").unwrap();
        fs::write(odd.join("2.jpg"), b"x").unwrap();

        let folder = ImageFolder::open(root).unwrap();
        assert_eq!(folder.info().classes, ["a", "\\xf5", "\u{E000}"]);
        assert_eq!(folder.notices().len(), 1, "{:?}", folder.notices());
        assert!(folder.notices()[0].contains("not valid UTF-8"));
        let labels: Vec<(u32, bool)> = folder
            .entries()
            .iter()
            .map(|e| (e.label, e.non_utf8_name))
            .collect();
        assert_eq!(labels, [(0, false), (1, true), (1, true), (2, false)]);
        let mut reader = folder.open_reader().unwrap();
        assert_eq!(reader.read(0).unwrap().payload, b"a/1.jpg");
        assert!(matches!(reader.read(1), Err(Error::RefusedFile { .. })));
        assert_eq!(reader.read(3).unwrap().payload, "\u{E000}/1.jpg".as_bytes());
        assert!(python_order(b"\xf5") < python_order("\u{E000}".as_bytes()));
        assert!(
            b"\xf5".as_slice() > "\u{E000}".as_bytes(),
            "byte order differs"
        );

        // Two such names are two classes (lossily, both were "caf\u{FFFD}": a pack wrote two
        // classes of one name, which every reader then refused).
        for name in [&b"caf\xe9"[..], b"caf\xe8"] {
            let class = root.join(std::ffi::OsStr::from_bytes(name));
            fs::create_dir(&class).unwrap();
            fs::write(class.join("1.jpg"), b"x").unwrap();
        }
        let folder = ImageFolder::open(root).unwrap();
        assert_eq!(
            folder.info().classes,
            ["a", "caf\\xe8", "caf\\xe9", "\\xf5", "\u{E000}"]
        );
        // Only a name spelling another's escape reads alike: refused, naming both.
        touch(root, "caf\\xe9/1.jpg");
        let err = ImageFolder::open(root).unwrap_err();
        assert!(
            matches!(&err, Error::BadImageFolder { reason, .. }
                if reason.contains("are both named \"caf\\\\xe9\"")),
            "{err}"
        );
    }

    #[test]
    fn order_and_labels_follow_torchvision() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        // Classes sort by code point: "B" < "a" < "b"; extensions are case-insensitive;
        // nested files come after the directory's own files, sub-directories in path order.
        for rel in [
            "b/2.JPG",
            "b/10.jpeg",
            "b/notes.txt",
            "a/z.png",
            "a/sub/a.webp",
            "a/sub b/c.bmp",
            "a/sub/deeper/d.tif",
            "a/a.jpg",
            "B/x.PPM",
        ] {
            touch(root, rel);
        }
        let folder = ImageFolder::open(root).unwrap();
        assert_eq!(folder.classes(), ["B", "a", "b"]);
        let got: Vec<(&str, u32)> = folder
            .entries()
            .iter()
            .map(|e| (e.key.as_str(), e.label))
            .collect();
        // sorted(os.walk): "a" < "a/sub" < "a/sub b" < "a/sub/deeper" as full path strings.
        assert_eq!(
            got,
            [
                ("B/x.PPM", 0),
                ("a/a.jpg", 1),
                ("a/z.png", 1),
                ("a/sub/a.webp", 1),
                ("a/sub b/c.bmp", 1),
                ("a/sub/deeper/d.tif", 1),
                ("b/10.jpeg", 2),
                ("b/2.JPG", 2),
            ]
        );
        assert_eq!(folder.skipped_files(), 1);
        assert_eq!(folder.len(), 8);
    }

    #[test]
    fn reader_returns_file_bytes() {
        let dir = tempfile::tempdir().unwrap();
        touch(dir.path(), "cat/1.jpg");
        touch(dir.path(), "dog/2.jpg");
        let folder = ImageFolder::open(dir.path()).unwrap();
        let mut reader = folder.open_reader().unwrap();
        let record = reader.read(1).unwrap();
        assert_eq!(
            (record.key, record.label, record.payload),
            ("dog/2.jpg", 1, &b"dog/2.jpg"[..])
        );
    }

    #[test]
    fn empty_class_and_empty_root_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let err = ImageFolder::open(dir.path()).unwrap_err();
        assert!(
            matches!(&err, Error::BadImageFolder { reason, .. }
                if reason == "no class directories (expected root/<class>/<image files>)"),
            "{err}"
        );
        // A class folder given as the root: says so, naming the directory above.
        let class = dir.path().join("cat");
        touch(dir.path(), "cat/1.jpg");
        touch(dir.path(), "cat/2.png");
        let err = ImageFolder::open(&class).unwrap_err();
        assert!(
            matches!(&err, Error::BadImageFolder { reason, .. }
                if reason.ends_with(&format!("it holds 2 image files itself: a class folder? \
                    The root is the directory above its class folders ({})",
                    dir.path().display()))),
            "{err}"
        );
        fs::remove_dir_all(&class).unwrap();
        touch(dir.path(), "cat/1.jpg");
        touch(dir.path(), "dog/readme.txt");
        let err = ImageFolder::open(dir.path()).unwrap_err();
        assert!(
            matches!(&err, Error::BadImageFolder { reason, .. }
                if reason.starts_with("no image file in class folder dog (")),
            "{err}"
        );
        // A root one level too high: hundreds of "classes" without images, not all listed.
        for i in 0..200 {
            fs::create_dir(dir.path().join(format!("empty{i:03}"))).unwrap();
        }
        let err = ImageFolder::open(dir.path()).unwrap_err();
        assert!(
            matches!(&err, Error::BadImageFolder { reason, .. }
                if reason.starts_with("no image file in 201 class folders: dog, empty000, \
                                       empty001, empty002, empty003 and 196 more (")),
            "{err}"
        );
    }

    #[test]
    fn missing_file_error_names_it() {
        let dir = tempfile::tempdir().unwrap();
        touch(dir.path(), "cat/1.jpg");
        let folder = ImageFolder::open(dir.path()).unwrap();
        fs::remove_file(dir.path().join("cat/1.jpg")).unwrap();
        let err = folder.open_reader().unwrap().read(0).unwrap_err();
        assert!(err.to_string().contains("cat/1.jpg"), "{err}");
    }
}
