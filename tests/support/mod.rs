//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use imagefeed::pack::{self, NoProgress, PackFormat, PackOptions, PackSummary};
use imagefeed::synthetic::SyntheticSpec;

pub mod fault_proxy;
pub mod lmdb_pages;
#[cfg(feature = "remote")]
pub mod s3;

/// The entries of `list` whose format this build writes (HDF5 needs the `hdf5` feature), so one
/// suite runs over every format a build has.
pub fn writable<T>(list: impl IntoIterator<Item = (PackFormat, T)>) -> Vec<(PackFormat, T)> {
    list.into_iter().filter(|(f, _)| f.is_available()).collect()
}

/// HDF5 where the build has it, else LMDB: for tests that need some single-file output.
pub fn hdf5_else_lmdb() -> PackFormat {
    if PackFormat::Hdf5.is_available() {
        PackFormat::Hdf5
    } else {
        PackFormat::Lmdb
    }
}

/// The committed fixture tree.
pub fn fixture_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/imagefolder")
}

/// The spec that generated the fixture tree (see fixtures/README.md).
pub fn fixture_spec() -> SyntheticSpec {
    SyntheticSpec {
        classes: 3,
        per_class: 4,
        width: 40,
        height: 32,
        edge_cases: true,
        ..SyntheticSpec::default()
    }
}

/// Keys of the broken fixture files, which packing must reject.
pub const BROKEN: [&str; 4] = [
    "class01/bad-bomb.jpg",
    "class01/bad-empty.jpg",
    "class01/bad-text.jpg",
    "class01/bad-truncated.jpg",
];

/// Test-sized pack options (small map, small chunks so several commits happen).
pub fn small_options() -> PackOptions {
    PackOptions::default()
        .with_lmdb_map_size(64 << 20)
        .with_chunk_size(4)
        .with_threads(Some(2))
}

/// [`small_options`] with `--resume`.
pub fn small_resume_options() -> PackOptions {
    small_options().with_mode(pack::StartMode {
        force: false,
        resume: true,
    })
}

/// Packs `src` into `out` as LMDB.
pub fn pack_lmdb(src: &Path, out: &Path, options: &PackOptions) -> PackSummary {
    try_pack_lmdb(src, out, options).expect("pack succeeds")
}

/// Packs `src` into `out` as LMDB, returning the error if any.
pub fn try_pack_lmdb(
    src: &Path,
    out: &Path,
    options: &PackOptions,
) -> imagefeed::Result<PackSummary> {
    pack::pack_image_folder(src, out, PackFormat::Lmdb, options, &NoProgress)
}

/// Stops a pack by panicking (which unwinds like a crash at that point: nothing after the last
/// commit is kept) once `stop_after` chunks have been committed.
pub struct Crash {
    chunks: std::sync::atomic::AtomicUsize,
    stop_after: usize,
}

impl Crash {
    /// A crash after `stop_after` committed chunks.
    pub fn after(stop_after: usize) -> Crash {
        Crash {
            chunks: std::sync::atomic::AtomicUsize::new(0),
            stop_after,
        }
    }
}

impl pack::PackObserver for Crash {
    fn advanced(&self, _done: usize, _bytes: u64) {
        use std::sync::atomic::Ordering;
        if self.chunks.fetch_add(1, Ordering::SeqCst) + 1 == self.stop_after {
            panic!("simulated crash");
        }
    }
}

/// Packs `src` into `out` in `format`.
pub fn pack_as(src: &Path, out: &Path, format: PackFormat, options: &PackOptions) -> PackSummary {
    pack::pack_image_folder(src, out, format, options, &NoProgress).expect("pack succeeds")
}

/// 60 small synthetic JPEGs (3 classes, 16x12) at `dir/src`, written unless already there;
/// returns that path.
pub fn small_tree(dir: &Path) -> PathBuf {
    let src = dir.join("src");
    if !src.exists() {
        let spec = SyntheticSpec {
            classes: 3,
            per_class: 20,
            width: 16,
            height: 12,
            ..SyntheticSpec::default()
        };
        imagefeed::synthetic::write_image_folder(&src, &spec).unwrap();
    }
    src
}

/// [`small_tree`] packed as record shards of about 8 samples each at `dir/name`; returns that
/// path.
pub fn packed_small_records(dir: &Path, name: &str) -> PathBuf {
    let src = small_tree(dir);
    let out = dir.join(name);
    pack_as(
        &src,
        &out,
        PackFormat::Records,
        &small_options().with_shard_bytes(8 * 700),
    );
    out
}

/// Appends a regular file member `path` holding `data` to a tar being built (GNU header, mode
/// 0644), as the `webdataset` package's writer does.
pub fn append_tar_member<W: std::io::Write>(
    builder: &mut tar::Builder<W>,
    path: impl AsRef<Path>,
    data: &[u8],
) {
    let mut header = tar::Header::new_gnu();
    header.set_size(data.len() as u64);
    header.set_mode(0o644);
    header.set_entry_type(tar::EntryType::Regular);
    builder.append_data(&mut header, path, data).unwrap();
}

/// Copies a directory tree.
pub fn copy_tree(src: &Path, dst: &Path) {
    fs::create_dir_all(dst).unwrap();
    for entry in fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        let target = dst.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Every file under `root`, as sorted relative paths with contents.
pub fn tree_contents(root: &Path) -> Vec<(String, Vec<u8>)> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, Vec<u8>)>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, out);
            } else {
                let rel = path
                    .strip_prefix(root)
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .to_string();
                out.push((rel, fs::read(&path).unwrap()));
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

/// (key, label, payload) of a record.
pub type Row = (String, u32, Vec<u8>);

/// (key, label, payload) of every record of `dataset`, in order.
pub fn records(dataset: &dyn imagefeed::Dataset) -> Vec<Row> {
    let mut reader = dataset.open_reader().unwrap();
    (0..dataset.len())
        .map(|i| {
            let r = reader.read(i).unwrap();
            (r.key.to_string(), r.label, r.payload.to_vec())
        })
        .collect()
}

/// The fixture tree as records (path key, label, file bytes) in ImageFolder order, without the
/// broken files: what packing it must store.
pub fn fixture_records_without_broken() -> Vec<Row> {
    let source = imagefeed::format::folder::ImageFolder::open(fixture_root()).unwrap();
    source
        .entries()
        .iter()
        .enumerate()
        .filter(|(_, e)| !BROKEN.contains(&e.key.as_str()))
        .map(|(i, e)| {
            (
                e.key.clone(),
                e.label,
                fs::read(source.file_path(i)).unwrap(),
            )
        })
        .collect()
}

/// A JPEG whose Huffman table counts are overwritten (`0xFF` × 16): libjpeg-turbo fails on its
/// header with "Bogus Huffman table definition".
pub fn with_bad_huffman_table(jpeg: &[u8]) -> Vec<u8> {
    let mut bad = jpeg.to_vec();
    let dht = bad
        .windows(2)
        .position(|w| w == [0xFF, 0xC4])
        .expect("a DHT segment");
    bad[dht + 5..dht + 21].fill(0xFF);
    bad
}

/// A one-class tree `root/cls/` of `good` synthetic 32×32 JPEGs (`0000.jpg`, ...) with a copy of
/// one whose Huffman table is corrupt sorted in after each of `bad_after` (`NNNN_bad.jpg`).
/// Returns the keys of the corrupt files.
pub fn tree_with_bad_huffman_tables(root: &Path, good: usize, bad_after: &[usize]) -> Vec<String> {
    let spec = SyntheticSpec {
        classes: 1,
        per_class: good,
        width: 32,
        height: 32,
        ..SyntheticSpec::default()
    };
    let tmp = root.with_extension("synth");
    imagefeed::synthetic::write_image_folder(&tmp, &spec).unwrap();
    let class = root.join("cls");
    fs::create_dir_all(&class).unwrap();
    let mut files: Vec<_> = fs::read_dir(tmp.join("class00"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let mut bad = Vec::new();
    for (i, file) in files.iter().enumerate() {
        let bytes = fs::read(file).unwrap();
        fs::write(class.join(format!("{i:04}.jpg")), &bytes).unwrap();
        if bad_after.contains(&i) {
            let key = format!("cls/{i:04}_bad.jpg");
            fs::write(root.join(&key), with_bad_huffman_table(&bytes)).unwrap();
            bad.push(key);
        }
    }
    fs::remove_dir_all(tmp).unwrap();
    bad
}

/// The Python the cross-tool tests use (`IMAGEFEED_PYTHON`, which `make test` points at .venv,
/// else `python3`) when it imports `modules` (comma-separated); `None`, with the reason printed as
/// SKIPPED, when it does not.
pub fn python_with(modules: &str) -> Option<String> {
    let python = std::env::var("IMAGEFEED_PYTHON").unwrap_or_else(|_| "python3".into());
    match Command::new(&python)
        .args(["-c", &format!("import {modules}")])
        .output()
    {
        Ok(o) if o.status.success() => Some(python),
        Ok(_) => {
            eprintln!(
                "SKIPPED: {python} lacks one of {modules} (make test installs them into .venv)"
            );
            None
        }
        Err(e) => {
            eprintln!("SKIPPED: no Python ({python}: {e})");
            None
        }
    }
}

/// Runs the Python script `script` with `args`, failing the test (with its stderr) unless it
/// succeeds; returns what it printed.
pub fn run_python(python: &str, script: &str, args: &[&Path]) -> String {
    python_output(Command::new(python).arg("-c").arg(script).args(args))
}

/// Runs the Python script `script` as the cross-tool writers take their input: `out`, then the
/// fixture file of each of `rows` (in order) as arguments, their labels comma-separated in
/// `LABELS`; fails the test (with its stderr) unless it succeeds; returns its printed lines.
pub fn run_python_on_fixture_files(
    python: &str,
    script: &str,
    out: &Path,
    rows: &[Row],
) -> Vec<String> {
    let source = imagefeed::format::folder::ImageFolder::open(fixture_root()).unwrap();
    let files: Vec<PathBuf> = rows
        .iter()
        .map(|(key, _, _)| {
            let i = source.entries().iter().position(|e| &e.key == key).unwrap();
            source.file_path(i)
        })
        .collect();
    let labels: Vec<String> = rows.iter().map(|r| r.1.to_string()).collect();
    python_output(
        Command::new(python)
            .arg("-c")
            .arg(script)
            .arg(out)
            .args(&files)
            .env("LABELS", labels.join(",")),
    )
    .lines()
    .map(str::to_owned)
    .collect()
}

/// Runs `command`, failing the test (with its stderr) unless it succeeds; what it printed.
fn python_output(command: &mut Command) -> String {
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// Runs a Python script that prints "key label payload-hex" lines and parses them.
pub fn python_rows(python: &str, script: &str, args: &[&Path]) -> Vec<(String, u32, Vec<u8>)> {
    run_python(python, script, args)
        .lines()
        .map(|l| {
            let mut parts = l.split(' ');
            let key = parts.next().unwrap().to_string();
            let label = parts.next().unwrap().parse().unwrap();
            let hex = parts.next().unwrap();
            let bytes = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            (key, label, bytes)
        })
        .collect()
}

/// A command that runs test `test` of this test binary alone in a child process (the caller's
/// `module_path!()` as `module_path`, see [`test_path`]), its output not captured: for tests
/// that need a process to themselves (a fork, or an environment of their own). (With
/// `--test-threads=1` added, libtest prints the test's name on the line its output starts.)
pub fn test_alone(module_path: &str, test: &str) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command.args(["--exact", &test_path(module_path, test), "--nocapture"]);
    command
}

/// The name libtest knows a test by, for re-running one test of this binary in a child process
/// (`--exact`): `module_path` is the caller's `module_path!()`, whose first segment (the test
/// crate) libtest leaves out.
pub fn test_path(module_path: &str, test: &str) -> String {
    match module_path.split_once("::") {
        Some((_, module)) => format!("{module}::{test}"),
        None => test.to_string(),
    }
}

/// Changes the single-file LMDB at `path` in one write transaction (`edit`), as a writer other
/// than ours would, and removes the lock file that leaves.
pub fn edit_lmdb(path: &Path, edit: impl FnOnce(&heed::Env, &mut heed::RwTxn<'_>)) {
    let mut options = heed::EnvOpenOptions::new();
    options.max_dbs(3);
    // SAFETY: test-only; nothing else has this file open.
    unsafe { options.flags(heed::EnvFlags::NO_SUB_DIR) };
    // SAFETY: as above.
    let env = unsafe { options.open(path) }.unwrap();
    let mut wtxn = env.write_txn().unwrap();
    edit(&env, &mut wtxn);
    wtxn.commit().unwrap();
    env.prepare_for_closing().wait();
    let mut lock = path.as_os_str().to_owned();
    lock.push("-lock");
    let _ = fs::remove_file(lock);
}

/// Rewrites the JSON record `key` of the `meta` database of the single-file LMDB at `path`
/// through `edit` ([`edit_lmdb`]).
pub fn edit_lmdb_meta(path: &Path, key: &str, edit: impl FnOnce(&mut serde_json::Value)) {
    edit_lmdb(path, |env, wtxn| {
        let meta: heed::Database<heed::types::Str, heed::types::Str> =
            env.open_database(wtxn, Some("meta")).unwrap().unwrap();
        let mut value: serde_json::Value =
            serde_json::from_str(meta.get(wtxn, key).unwrap().unwrap()).unwrap();
        edit(&mut value);
        meta.put(wtxn, key, &value.to_string()).unwrap();
    });
}

/// `names` as HDF5 variable-length UTF-8 strings (what h5py writes for a list of `str`).
#[cfg(feature = "hdf5")]
pub fn vlen_strings(names: &[&str]) -> Vec<hdf5::types::VarLenUnicode> {
    names.iter().map(|n| n.parse().unwrap()).collect()
}

/// Gives `location` (the file, or a dataset) a `classes` attribute of `names`, as h5py writes
/// `obj.attrs["classes"] = names`.
#[cfg(feature = "hdf5")]
pub fn classes_attribute(location: &hdf5::Location, names: &[&str]) {
    location
        .new_attr::<hdf5::types::VarLenUnicode>()
        .shape(names.len())
        .create("classes")
        .unwrap()
        .write(&vlen_strings(names))
        .unwrap();
}
