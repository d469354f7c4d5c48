//! Corrupt packed datasets (issue: reliability): bytes flipped in the middle of, and files cut at
//! many points of, an LMDB file, an HDF5 file, a record shard and its index. For each damaged
//! copy, a child process opens it, inspects it, verifies it, reads every record and runs one
//! epoch of the loader under each bad-sample policy, and compares everything it was handed with
//! the undamaged dataset. What must hold:
//!
//! - no crash: the child exits normally (a panic, SIGSEGV or SIGBUS is a finding);
//! - no hang: the child finishes within a minute;
//! - an error names the dataset (its path), a bad sample names its key or index;
//! - nothing wrong is accepted as good: every record and every batch slot handed out as good
//!   holds exactly the undamaged key, label and pixels of its index.
//!
//! Then every structure byte of an LMDB file (ours, and py-lmdb's folder2lmdb fixture: meta
//! pages, page headers, node tables, node headers, keys) is flipped alone, and every byte of an
//! HDF5 file that is not a payload stored as is (ours, and three h5py files: variable-length
//! bytes, contiguous and chunked, and two compressed pixel arrays), each copy checked by a child in the
//! same way. h5py's files keep no checksums: a changed label or pixel read as good from them is
//! listed, not a finding.
//!
//! `IMAGEFEED_CORRUPTIONS=N` sets the number of flips and of cuts per file (default 6: the
//! short version `make test` runs); `IMAGEFEED_STRUCTURE_FLIPS=N|all` the structure bytes
//! flipped per file (default 40, a seeded sample); `IMAGEFEED_STRUCTURE_FILES=a,b` limits the
//! structure flips to the files named (`d.lmdb`, `d-shared.lmdb` (packed with shared JPEG
//! headers), `folder2lmdb.lmdb`, `pristine-d.h5`,
//! `vlen.h5`, `vlen-chunked.h5`, `pixels.h5`, `pixels-lzf.h5`); `make corrupt` runs the long
//! ones.
//! `harness = false`: the binary is both the harness and, with `--child`, the child.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use imagefeed::decode::Decoder;
use imagefeed::loader::{BadSamplePolicy, Loader, LoaderConfig};
use imagefeed::pack::{self, NoProgress, PackFormat, PackOptions};
use imagefeed::rng::SampleRng;
use imagefeed::synthetic::{self, SyntheticSpec};
use imagefeed::transform::Transform;
use imagefeed::{Dataset, format};

/// What one record holds when good: key, label, decoded pixels.
type Expected = Vec<(String, u32, Vec<u8>)>;

fn expected(dataset: &dyn Dataset) -> Expected {
    let mut reader = dataset.open_reader().expect("the undamaged dataset reads");
    let mut decoder = Decoder::new();
    (0..dataset.len())
        .map(|i| {
            let record = reader.read(i).expect("the undamaged dataset reads");
            let mut pixels = Vec::new();
            decoder.decode_rgb(record.payload, &mut pixels).unwrap();
            (record.key.to_string(), record.label, pixels)
        })
        .collect()
}

/// The child: checks the damaged dataset at `damaged` against the undamaged one at `pristine`,
/// printing `finding: ...` lines for broken promises and one summary line. `unchecked`: the
/// format keeps no checksums (h5py's files), so a changed value (a label, a pixel) cannot be
/// told from a true one: a record that reads as good but differs is counted (`unchecked:`
/// lines), not a finding.
fn child(pristine: &Path, damaged: &Path, unchecked: bool) {
    let differs = if unchecked { "unchecked" } else { "finding" };
    let wrong = std::cell::Cell::new(0usize);
    let want = expected(&*format::open(pristine).expect("the undamaged dataset opens"));
    let name = damaged.file_name().unwrap().to_string_lossy().to_string();
    let dataset = match format::open(damaged) {
        Ok(dataset) => dataset,
        Err(e) => {
            let text = e.to_string();
            if !text.contains(&name) {
                println!("finding: open error does not name the dataset: {text}");
            }
            println!("summary: refused at open: {text}");
            return;
        }
    };
    // inspect and verify: an Ok or a clear error; their findings are printed, not judged.
    let inspected = imagefeed::inspect::inspect(damaged).map(|_| ());
    let verified = imagefeed::verify::verify(damaged, None);
    if let Ok(report) = &verified {
        for problem in &report.problems {
            if problem.key.is_empty() && problem.index.is_none() {
                println!(
                    "finding: a verify problem names nothing: {}",
                    problem.problem
                );
            }
        }
    }
    // Every record: good only when exactly what was packed.
    let mut bad_reads = 0;
    if let Ok(mut reader) = dataset.open_reader() {
        let mut decoder = Decoder::new();
        for (i, (key, label, pixels)) in want.iter().enumerate().take(dataset.len()) {
            match reader.read(i) {
                Ok(record) => {
                    let mut got = Vec::new();
                    if decoder.decode_rgb(record.payload, &mut got).is_err() {
                        bad_reads += 1;
                        continue;
                    }
                    if record.key != key || record.label != *label || got != *pixels {
                        wrong.set(wrong.get() + 1);
                        println!(
                            "{differs}: record {i} read as good but differs: key {:?} (want {key:?}), \
                             label {} (want {label}), pixels {}",
                            record.key,
                            record.label,
                            if got == *pixels { "same" } else { "differ" }
                        );
                    }
                }
                Err(e) => {
                    bad_reads += 1;
                    let text = e.to_string();
                    if !text.contains(key.as_str()) && !text.contains(&format!("record {i}")) {
                        println!("finding: record {i}'s error names neither key nor index: {text}");
                    }
                }
            }
        }
    }
    if dataset.len() > want.len() {
        println!(
            "finding: {} records, more than the {} packed",
            dataset.len(),
            want.len()
        );
    }
    // The loader under each policy: delivered slots hold the undamaged pixels of their index.
    let mut outcomes = Vec::new();
    for policy in [
        BadSamplePolicy::Skip,
        BadSamplePolicy::Replace,
        BadSamplePolicy::Error,
    ] {
        let config = LoaderConfig::default()
            .with_batch_size(4)
            .with_workers(2)
            .with_seed(3)
            .with_transform(Transform::none())
            .with_bad_samples(policy)
            .with_max_bad(None);
        let loader = match Loader::new(Arc::clone(&dataset), config) {
            Ok(loader) => loader,
            Err(e) => {
                outcomes.push(format!("{policy:?}: refused: {e}"));
                continue;
            }
        };
        let (mut good, mut bad) = (0, 0);
        let mut error = None;
        for batch in loader.epoch(0) {
            let batch = match batch {
                Ok(batch) => batch,
                Err(e) => {
                    error = Some(e.to_string());
                    break;
                }
            };
            bad += batch.bad.len();
            let per = batch.shape[1] * batch.shape[2] * batch.shape[3];
            for (slot, &index) in batch.samples.iter().enumerate() {
                let (_, label, pixels) = &want[index];
                let got = &batch.as_u8()[slot * per..(slot + 1) * per];
                if got != pixels.as_slice() || batch.labels[slot] != *label {
                    wrong.set(wrong.get() + 1);
                    println!(
                        "{differs}: {policy:?}: sample {index} handed out as good but differs ({})",
                        if batch.labels[slot] != *label {
                            "label"
                        } else {
                            "pixels"
                        }
                    );
                }
                good += 1;
            }
        }
        if policy == BadSamplePolicy::Error && bad_reads > 0 && error.is_none() {
            println!("finding: Error policy finished an epoch with {bad_reads} unreadable records");
        }
        outcomes.push(format!(
            "{policy:?}: {good} good, {bad} bad{}",
            error.map(|e| format!(", stopped: {e}")).unwrap_or_default()
        ));
    }
    println!(
        "summary: opened{}, {} of {} records unreadable; inspect {}; verify {}; {}",
        if wrong.get() > 0 {
            " with a changed value read as good (the format keeps no checksums)"
        } else {
            ""
        },
        bad_reads,
        want.len(),
        if inspected.is_ok() { "ok" } else { "error" },
        match &verified {
            Ok(r) => format!("{} problems", r.problems.len()),
            Err(_) => "error".into(),
        },
        outcomes.join("; ")
    );
}

/// Copies the dataset at `src` (a file or a directory of files) to `dst`.
fn copy_dataset(src: &Path, dst: &Path) {
    let _ = std::fs::remove_dir_all(dst);
    let _ = std::fs::remove_file(dst);
    if src.is_dir() {
        std::fs::create_dir_all(dst).unwrap();
        for entry in std::fs::read_dir(src).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
        }
    } else {
        std::fs::copy(src, dst).unwrap();
    }
}

/// Runs the child on `damaged`; returns its findings (a crash or hang is one).
fn run_child(
    pristine: &Path,
    damaged: &Path,
    what: &str,
    unchecked: bool,
) -> (Vec<String>, String) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .arg(if unchecked {
            "--child-unchecked"
        } else {
            "--child"
        })
        .arg(pristine)
        .arg(damaged)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return (vec![format!("{what}: hung (over 60 s)")], String::new());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let mut findings: Vec<String> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("finding: "))
        .map(|f| format!("{what}: {f}"))
        .collect();
    if !out.status.success() {
        findings.push(format!(
            "{what}: the child died ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .take(6)
                .collect::<Vec<_>>()
                .join(" | ")
        ));
    }
    let summary = stdout
        .lines()
        .find_map(|l| l.strip_prefix("summary: "))
        .unwrap_or("")
        .to_string();
    if summary.is_empty() && out.status.success() {
        findings.push(format!("{what}: the child printed no summary"));
    }
    (findings, summary)
}

/// Writes `src` (an ImageFolder tree) to `out` as the Python folder2lmdb scripts do, with
/// py-lmdb: keys "0", "1", ..., values `pickle.dumps((file bytes, label))`, then `__keys__` and
/// `__len__`. False, saying why, where py-lmdb is not installed.
fn write_folder2lmdb(src: &Path, out: &Path) -> bool {
    let Some(python) = support::python_with("lmdb") else {
        return false;
    };
    let script = r#"
import os, pickle, sys, lmdb
src, out = sys.argv[1], sys.argv[2]
classes = sorted(e.name for e in os.scandir(src) if e.is_dir())
samples = [(os.path.join(src, c, f), label) for label, c in enumerate(classes)
           for f in sorted(os.listdir(os.path.join(src, c)))]
db = lmdb.open(out, subdir=False, map_size=1 << 26, lock=False)
with db.begin(write=True) as txn:
    for idx, (path, label) in enumerate(samples):
        with open(path, "rb") as f:
            txn.put(str(idx).encode("ascii"), pickle.dumps((f.read(), label)))
    txn.put(b"__keys__", pickle.dumps([str(i).encode("ascii") for i in range(len(samples))]))
    txn.put(b"__len__", pickle.dumps(len(samples)))
db.close()
"#;
    let status = Command::new(python)
        .args(["-c", script])
        .arg(src)
        .arg(out)
        .status()
        .unwrap();
    assert!(status.success(), "py-lmdb wrote {}", out.display());
    true
}

impl Tally {
    /// Checks a copy of `bytes` (the file at `pristine`) per `(offset, xor)` in `flips`, each
    /// with that one byte changed, in a child; as many children at once as there are cores.
    fn check_flips(
        &mut self,
        pristine: &Path,
        bytes: &[u8],
        flips: &[(usize, u8)],
        dir: &Path,
        name: &str,
        unchecked: bool,
    ) {
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
        let next = std::sync::atomic::AtomicUsize::new(0);
        let tally = std::sync::Mutex::new(std::mem::take(self));
        let label = format!("{name} structure");
        std::thread::scope(|scope| {
            for worker in 0..workers {
                let (next, tally, label) = (&next, &tally, &label);
                scope.spawn(move || {
                    let extension = Path::new(name).extension().unwrap_or_default();
                    let damaged = dir
                        .join(format!("flipped-{worker}-{name}"))
                        .with_extension(extension);
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(at, xor)) = flips.get(i) else {
                            break;
                        };
                        let mut flipped = bytes.to_vec();
                        flipped[at] ^= xor;
                        std::fs::write(&damaged, &flipped).unwrap();
                        let what = format!("{name}: byte {at} flipped to {:#04x}", flipped[at]);
                        let outcome = run_child(pristine, &damaged, &what, unchecked);
                        tally.lock().unwrap().count(outcome, label, &what);
                    }
                });
            }
        });
        *self = tally.into_inner().unwrap();
    }
}

/// Whether `IMAGEFEED_STRUCTURE_FILES` (a comma-separated list; unset: every file) names `name`.
fn structure_file_wanted(name: &str) -> bool {
    std::env::var("IMAGEFEED_STRUCTURE_FILES")
        .map_or(true, |files| files.split(',').any(|f| f.trim() == name))
}

/// The indexes of a seeded sample of `n` of `offsets` (all of them for `"all"`; 40 by default).
fn sample_offsets(offsets: &mut Vec<usize>, flips: Option<&str>, points: &mut SampleRng) {
    if flips == Some("all") {
        return;
    }
    let n = flips.and_then(|v| v.parse().ok()).unwrap_or(40usize);
    // A seeded sample: a partial Fisher-Yates shuffle's first n.
    for i in 0..n.min(offsets.len()) {
        let j = i + points.below((offsets.len() - i) as u64) as usize;
        offsets.swap(i, j);
    }
    offsets.truncate(n);
}

/// Writes h5py's layouts of the tree `src` into `dir`: `vlen.h5` (each file's bytes in a
/// contiguous variable-length `uint8` dataset, `labels` int64, a `classes` attribute),
/// `vlen-chunked.h5` (the same, chunked and appendable), `pixels.h5` (an `N×8×8×3` uint8
/// array, chunked and gzip-compressed) and `pixels-lzf.h5` (the same array through shuffle,
/// LZF and fletcher32, in chunks that split every dimension). Empty, saying why, where h5py is not installed.
#[cfg(feature = "hdf5")]
fn write_h5py(src: &Path, dir: &Path) -> Vec<PathBuf> {
    let Some(python) = support::python_with("h5py, numpy") else {
        return Vec::new();
    };
    let script = r#"
import os, sys
import h5py, numpy as np
src, out = sys.argv[1], sys.argv[2]
classes = sorted(e.name for e in os.scandir(src) if e.is_dir())
samples = [(os.path.join(src, c, f), label) for label, c in enumerate(classes)
           for f in sorted(os.listdir(os.path.join(src, c)))]
labels = np.array([label for _, label in samples], np.int64)
for name, extra in (("vlen.h5", {}), ("vlen-chunked.h5", dict(maxshape=(None,), chunks=(5,)))):
    with h5py.File(os.path.join(out, name), "w") as f:
        d = f.create_dataset("images", (len(samples),), dtype=h5py.vlen_dtype(np.uint8), **extra)
        for k, (path, _) in enumerate(samples):
            d[k] = np.frombuffer(open(path, "rb").read(), np.uint8)
        f.create_dataset("labels", data=labels)
        f.attrs["classes"] = classes
n = 12
i, y, x, c = np.meshgrid(np.arange(n), np.arange(8), np.arange(8), np.arange(3), indexing="ij")
with h5py.File(os.path.join(out, "pixels.h5"), "w") as f:
    f.create_dataset("images", data=((i * 7 + y * 3 + x * 5 + c) % 256).astype(np.uint8),
                     chunks=(4, 8, 8, 3), compression="gzip")
    f.create_dataset("labels", data=(np.arange(n) % 3).astype(np.int64), compression="gzip")
with h5py.File(os.path.join(out, "pixels-lzf.h5"), "w") as f:
    f.create_dataset("images", data=((i * 7 + y * 3 + x * 5 + c) % 256).astype(np.uint8),
                     chunks=(5, 4, 8, 2), compression="lzf", shuffle=True, fletcher32=True)
    f.create_dataset("labels", data=(np.arange(n) % 3).astype(np.int64), compression="lzf")
"#;
    let status = Command::new(python)
        .args(["-c", script])
        .arg(src)
        .arg(dir)
        .status()
        .unwrap();
    assert!(
        status.success(),
        "h5py wrote its files into {}",
        dir.display()
    );
    ["vlen.h5", "vlen-chunked.h5", "pixels.h5", "pixels-lzf.h5"]
        .iter()
        .map(|name| dir.join(name))
        .collect()
}

/// The offsets of `file`'s bytes that are not a record's payload stored as is: each payload
/// (as the reader hands it out) is looked for in turn after the last one found, and the bytes
/// it covers are left out. Payloads stored transformed (compressed pixels) are not found, and
/// every byte of their file is kept.
#[cfg(feature = "hdf5")]
fn non_payload_bytes(file: &[u8], payloads: &[Vec<u8>]) -> Vec<usize> {
    let mut payload = vec![false; file.len()];
    let mut from = 0;
    for p in payloads.iter().filter(|p| p.len() >= 8) {
        if let Some(at) = file[from..]
            .windows(p.len())
            .position(|w| w == p.as_slice())
        {
            payload[from + at..from + at + p.len()].fill(true);
            from += at + p.len();
        }
    }
    (0..file.len()).filter(|&i| !payload[i]).collect()
}

/// Every byte of an HDF5 file that is not a payload (superblock, object headers, B-trees, heaps,
/// the index datasets, h5py's descriptors and labels), ours and h5py's, each flipped alone: a
/// seeded sample in `make test`, all of them in `make corrupt`.
#[cfg(feature = "hdf5")]
fn hdf5_structure_flips(tally: &mut Tally, dir: &Path, src: &Path, flips: Option<&str>) {
    let theirs = dir.join("h5py");
    std::fs::create_dir_all(&theirs).unwrap();
    let mut files = vec![(dir.join("pristine-d.h5"), false)];
    files.extend(write_h5py(src, &theirs).into_iter().map(|p| (p, true)));
    for (pristine, unchecked) in files {
        let name = pristine.file_name().unwrap().to_string_lossy().to_string();
        if !structure_file_wanted(&name) {
            continue;
        }
        let bytes = std::fs::read(&pristine).unwrap();
        let dataset = format::open(&pristine).expect("the undamaged file opens");
        let mut reader = dataset.open_reader().unwrap();
        let payloads: Vec<Vec<u8>> = (0..dataset.len())
            .map(|i| reader.read(i).unwrap().payload.to_vec())
            .collect();
        drop((reader, dataset));
        let mut offsets = non_payload_bytes(&bytes, &payloads);
        let total = offsets.len();
        let mut points = SampleRng::new(0x4df5, 0, 0);
        sample_offsets(&mut offsets, flips, &mut points);
        println!(
            "{name}: {} of its {total} non-payload bytes flipped ({} bytes in all)",
            offsets.len(),
            bytes.len()
        );
        let flips: Vec<(usize, u8)> = offsets
            .iter()
            .map(|&at| (at, 1 + points.below(255) as u8))
            .collect();
        tally.check_flips(&pristine, &bytes, &flips, dir, &name, unchecked);
    }
}

/// What the children found, over every damaged copy.
#[derive(Default)]
struct Tally {
    tried: usize,
    findings: Vec<String>,
    /// How many copies ended each way ("label: refused at open", ...).
    summaries: BTreeMap<String, usize>,
    /// The damage a format without checksums read as good values (not findings: listed).
    unchecked: Vec<String>,
}

impl Tally {
    /// Runs the child on `damaged` (described by `what`) and counts its outcome under `label`.
    fn check(&mut self, pristine: &Path, damaged: &Path, what: &str, label: &str) {
        self.count(run_child(pristine, damaged, what, false), label, what);
    }

    /// Counts a child's outcome (its findings and summary) under `label`.
    fn count(&mut self, (mut found, summary): (Vec<String>, String), label: &str, what: &str) {
        self.tried += 1;
        if summary.contains("read as good") {
            self.unchecked.push(what.to_string());
        }
        self.findings.append(&mut found);
        let kind = summary.split([':', ';']).next().unwrap_or("");
        *self
            .summaries
            .entry(format!("{label}: {kind}"))
            .or_default() += 1;
    }
}

/// The name of the LMDB packed with `--shared-headers`.
const SHARED_HEADERS_LMDB: &str = "d-shared.lmdb";

fn harness() {
    let per_file: u64 = std::env::var("IMAGEFEED_CORRUPTIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let spec = SyntheticSpec {
        classes: 3,
        per_class: 8,
        width: 32,
        height: 24,
        ..SyntheticSpec::default()
    };
    synthetic::write_image_folder(&src, &spec).unwrap();
    let options = PackOptions::default()
        .with_lmdb_map_size(64 << 20)
        .with_chunk_size(8)
        .with_threads(Some(1))
        .with_shard_bytes(8 << 10);
    let mut tally = Tally::default();
    let mut outputs = support::writable([
        (PackFormat::Lmdb, "d.lmdb"),
        (PackFormat::Hdf5, "d.h5"),
        (PackFormat::Records, "d.records"),
    ]);
    // An LMDB with shared JPEG headers (layout version 3): its `headers` database and the
    // references in front of its payloads.
    outputs.push((PackFormat::Lmdb, SHARED_HEADERS_LMDB));
    for (format, name) in outputs {
        let pristine = dir.path().join(format!("pristine-{name}"));
        let options = options
            .clone()
            .with_shared_headers(name == SHARED_HEADERS_LMDB);
        pack::pack_image_folder(&src, &pristine, format, &options, &NoProgress).unwrap();
        // The files to damage: the dataset file itself, or each shard and index.
        let files: Vec<PathBuf> = if pristine.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(&pristine)
                .unwrap()
                .map(|e| e.unwrap().file_name().into())
                .filter(|p: &PathBuf| p.extension().is_some_and(|e| e != "json"))
                .collect();
            files.sort();
            files.truncate(4); // the first two shards and their indexes
            files
        } else {
            vec![PathBuf::new()]
        };
        let damaged = dir.path().join(name);
        let mut points = SampleRng::new(0x5eed ^ per_file, 0, 0);
        for file in &files {
            let target = |root: &Path| {
                if file.as_os_str().is_empty() {
                    root.to_path_buf()
                } else {
                    root.join(file)
                }
            };
            let len = std::fs::metadata(target(&pristine)).unwrap().len();
            for step in 0..per_file * 2 {
                copy_dataset(&pristine, &damaged);
                let path = target(&damaged);
                let what = if step < per_file {
                    // Flip 1..4 bytes somewhere in the middle 90% of the file.
                    let mut bytes = std::fs::read(&path).unwrap();
                    let at = (len / 20 + points.below((len * 9 / 10).max(1))) as usize;
                    let n = 1 + points.below(4) as usize;
                    for b in bytes.iter_mut().skip(at).take(n) {
                        *b ^= 1 + points.below(255) as u8;
                    }
                    std::fs::write(&path, bytes).unwrap();
                    format!("{name}/{}: {n} bytes flipped at {at}", file.display())
                } else {
                    let at = points.below(len.max(1));
                    std::fs::OpenOptions::new()
                        .write(true)
                        .open(&path)
                        .unwrap()
                        .set_len(at)
                        .unwrap();
                    format!("{name}/{}: cut to {at} of {len} bytes", file.display())
                };
                tally.check(&pristine, &damaged, &what, name);
            }
        }
    }
    // Every byte that holds an LMDB file together (meta pages, page headers, node tables, node
    // headers and keys, named databases' records), ours and py-lmdb's, each flipped alone: a
    // seeded sample in `make test`, all of them in `make corrupt`.
    let structure_flips = std::env::var("IMAGEFEED_STRUCTURE_FLIPS").ok();
    let mut lmdbs = vec![
        (dir.path().join("pristine-d.lmdb"), "d.lmdb"),
        (
            dir.path().join(format!("pristine-{SHARED_HEADERS_LMDB}")),
            SHARED_HEADERS_LMDB,
        ),
    ];
    let theirs = dir.path().join("pristine-folder2lmdb.lmdb");
    if write_folder2lmdb(&src, &theirs) {
        lmdbs.push((theirs, "folder2lmdb.lmdb"));
    }
    for (pristine, name) in lmdbs {
        if !structure_file_wanted(name) {
            continue;
        }
        let bytes = std::fs::read(&pristine).unwrap();
        let mut offsets = support::lmdb_pages::structure_bytes(&bytes);
        let mut points = SampleRng::new(0x57c7, 0, 0);
        sample_offsets(&mut offsets, structure_flips.as_deref(), &mut points);
        let flips: Vec<(usize, u8)> = offsets
            .iter()
            .map(|&at| (at, 1 + points.below(255) as u8))
            .collect();
        tally.check_flips(&pristine, &bytes, &flips, dir.path(), name, false);
    }
    #[cfg(feature = "hdf5")]
    hdf5_structure_flips(&mut tally, dir.path(), &src, structure_flips.as_deref());
    println!("{} corruptions tried", tally.tried);
    for (kind, count) in &tally.summaries {
        println!("  {count:4}  {kind}");
    }
    if !tally.unchecked.is_empty() {
        println!("changed values read as good from files without checksums (h5py's):");
        for what in &tally.unchecked {
            println!("  {what}");
        }
    }
    assert!(
        tally.findings.is_empty(),
        "{} findings:\n{}",
        tally.findings.len(),
        tally.findings.join("\n")
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("--child") => return child(Path::new(&args[2]), Path::new(&args[3]), false),
        Some("--child-unchecked") => {
            return child(Path::new(&args[2]), Path::new(&args[3]), true);
        }
        _ => {}
    }
    // Listing, as cargo-nextest asks every test binary (`--list --format terse`, then with
    // `--ignored`): one test, not ignored.
    if args.iter().any(|a| a == "--list") {
        if !args.iter().any(|a| a == "--ignored") {
            println!("corrupt: test");
        }
        return;
    }
    // `cargo test` passes libtest's flags (--quiet, a filter...): a filter that does not match
    // "corrupt" skips the harness, as libtest would.
    let filters: Vec<&String> = args[1..].iter().filter(|a| !a.starts_with('-')).collect();
    if !filters.is_empty() && !filters.iter().any(|f| "corrupt".contains(f.as_str())) {
        return;
    }
    harness();
    println!("test corrupt ... ok");
}
