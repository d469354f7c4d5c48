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
//! `IMAGEFEED_CORRUPTIONS=N` sets the number of flips and of cuts per file (default 6: the
//! short version `make test` runs); `make corrupt` runs the long one. `harness = false`: the
//! binary is both the harness and, with `--child`, the child.

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
/// printing `finding: ...` lines for broken promises and one summary line.
fn child(pristine: &Path, damaged: &Path) {
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
                        println!(
                            "finding: record {i} read as good but differs: key {:?} (want {key:?}), \
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
                    println!(
                        "finding: {policy:?}: sample {index} handed out as good but differs ({})",
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
        "summary: opened, {} of {} records unreadable; inspect {}; verify {}; {}",
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
fn run_child(pristine: &Path, damaged: &Path, what: &str) -> (Vec<String>, String) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .arg("--child")
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
    let options = PackOptions {
        lmdb_map_size: 64 << 20,
        chunk_size: 8,
        threads: Some(1),
        shard_bytes: 8 << 10,
        ..PackOptions::default()
    };
    let mut findings = Vec::new();
    let mut tried = 0;
    let mut summaries: BTreeMap<String, usize> = BTreeMap::new();
    for (format, name) in support::writable([
        (PackFormat::Lmdb, "d.lmdb"),
        (PackFormat::Hdf5, "d.h5"),
        (PackFormat::Records, "d.records"),
    ]) {
        let pristine = dir.path().join(format!("pristine-{name}"));
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
                let (mut found, summary) = run_child(&pristine, &damaged, &what);
                tried += 1;
                findings.append(&mut found);
                let kind = summary.split([':', ';']).next().unwrap_or("").to_string();
                *summaries.entry(format!("{name}: {kind}")).or_default() += 1;
            }
        }
    }
    println!("{tried} corruptions tried");
    for (kind, count) in &summaries {
        println!("  {count:4}  {kind}");
    }
    assert!(
        findings.is_empty(),
        "{} findings:\n{}",
        findings.len(),
        findings.join("\n")
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        child(Path::new(&args[2]), Path::new(&args[3]));
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
