//! Datasets other tools made (fixtures/compat, written by py-lmdb through
//! scripts/make_compat_fixtures.py), and other tools reading what we make.

mod support;

use std::fs;
use std::path::Path;
use std::process::Command;

use imagefeed::format;
use imagefeed::format::folder::ImageFolder;
use imagefeed::loader::{BadSamplePolicy, Loader, LoaderConfig};
use imagefeed::transform::Transform;
use support::{
    BROKEN, fixture_records_without_broken, fixture_root, pack_lmdb, records, small_options,
};

fn compat(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/compat")
        .join(name)
}

#[test]
fn python_folder2lmdb_files_read_like_their_source_tree() {
    let source = ImageFolder::open(fixture_root()).unwrap();
    let expected: Vec<(String, u32, Vec<u8>)> = source
        .entries()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            (
                i.to_string(),
                e.label,
                fs::read(source.file_path(i)).unwrap(),
            )
        })
        .collect();
    for path in [compat("folder2lmdb.lmdb"), compat("folder2lmdb-dir")] {
        let dataset = format::open(&path).unwrap();
        assert_eq!(dataset.len(), 20, "{}", path.display());
        // No class names are stored: 0..=max label.
        assert_eq!(dataset.classes(), ["0", "1", "2"]);
        assert_eq!(records(dataset.as_ref()), expected, "{}", path.display());
    }
}

#[test]
fn the_loader_reports_the_broken_files_inside_a_python_lmdb() {
    let loader = Loader::new(
        format::open(compat("folder2lmdb.lmdb")).unwrap(),
        LoaderConfig {
            batch_size: 5,
            shuffle: false,
            transform: Transform::cifar(),
            bad_samples: BadSamplePolicy::Skip,
            ..LoaderConfig::default()
        },
    )
    .unwrap();
    let source = ImageFolder::open(fixture_root()).unwrap();
    let mut bad = Vec::new();
    let mut good = 0;
    for batch in loader.epoch(0) {
        let batch = batch.unwrap();
        good += batch.len();
        bad.extend(
            batch
                .bad
                .iter()
                .map(|b| source.entries()[b.index].key.clone()),
        );
        assert!(
            batch.bad.iter().all(|b| b.key == b.index.to_string()),
            "{:?}",
            batch.bad
        );
    }
    bad.sort();
    assert_eq!(good, 16);
    assert_eq!(bad, BROKEN);
}

/// The Python used for the cross-reads: $IMAGEFEED_PYTHON (make test points it at a virtual
/// environment with the `lmdb` package), else `python3`. `None`, with the reason printed, when it
/// or its `lmdb` package is missing.
fn python_with_lmdb() -> Option<String> {
    let python = std::env::var("IMAGEFEED_PYTHON").unwrap_or_else(|_| "python3".into());
    match Command::new(&python).args(["-c", "import lmdb"]).output() {
        Ok(o) if o.status.success() => Some(python),
        Ok(_) => {
            eprintln!("SKIPPED: {python} has no `lmdb` package (make test installs it into .venv)");
            None
        }
        Err(e) => {
            eprintln!("SKIPPED: no Python ({python}: {e})");
            None
        }
    }
}

#[test]
fn py_lmdb_reads_our_lmdb_as_the_readme_documents() {
    let Some(python) = python_with_lmdb() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ours.lmdb");
    pack_lmdb(&fixture_root(), &out, &small_options());
    // The README's snippet, for every record, printed as "key label payload-hex".
    let script = r#"
import json, lmdb, struct, sys
env = lmdb.open(sys.argv[1], subdir=False, readonly=True, lock=False, max_dbs=2)
meta, samples = env.open_db(b"meta"), env.open_db(b"samples")  # before the transaction
with env.begin() as txn:
    info = json.loads(txn.get(b"info", db=meta))
    for i in range(info["num_samples"]):
        v = txn.get(i.to_bytes(8, "big"), db=samples)
        label, k = struct.unpack_from("<II", v)
        print(v[8:8 + k].decode(), label, v[8 + k:].hex())
"#;
    let output = Command::new(&python)
        .arg("-c")
        .arg(script)
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).unwrap();
    let got: Vec<(String, u32, Vec<u8>)> = text
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
        .collect();
    let expected = fixture_records_without_broken();
    assert_eq!(got, expected);
}

#[test]
fn convert_rewrites_a_python_lmdb_into_ours() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("converted.lmdb");
    let summary = imagefeed::pack::convert(
        &compat("folder2lmdb.lmdb"),
        &out,
        imagefeed::pack::PackFormat::Lmdb,
        &small_options(),
        &imagefeed::pack::NoProgress,
    )
    .unwrap();
    assert_eq!(summary.samples, 16);
    // The broken images stored unchecked by the Python script are rejected by key, with reasons.
    let source = ImageFolder::open(fixture_root()).unwrap();
    let mut rejected: Vec<String> = summary
        .rejected
        .iter()
        .map(|r| {
            source.entries()[r.key.parse::<usize>().unwrap()]
                .key
                .clone()
        })
        .collect();
    rejected.sort();
    assert_eq!(rejected, BROKEN);
    let converted = format::open(&out).unwrap();
    assert_eq!(converted.classes(), ["0", "1", "2"]);
    let python = format::open(compat("folder2lmdb.lmdb")).unwrap();
    let keep: Vec<_> = records(python.as_ref())
        .into_iter()
        .filter(|(key, _, _)| !summary.rejected.iter().any(|r| &r.key == key))
        .collect();
    assert_eq!(records(converted.as_ref()), keep);
    assert!(imagefeed::verify::verify(&out, None).unwrap().is_ok());

    // Refuses to overwrite its own source.
    let err = imagefeed::pack::convert(
        &out,
        &out,
        imagefeed::pack::PackFormat::Lmdb,
        &imagefeed::pack::PackOptions {
            mode: imagefeed::pack::StartMode {
                force: true,
                resume: false,
            },
            ..small_options()
        },
        &imagefeed::pack::NoProgress,
    )
    .unwrap_err();
    assert!(err.to_string().contains("is the source itself"), "{err}");
}
