//! Datasets larger than the memory there is (`IMAGEFEED_MEMORY_LIMIT` stands in for a small
//! machine or container): record shards (ours, and others' scanned at open), WebDataset and MDS
//! shards are then read at random (their maps `MADV_RANDOM`, each batch's records asked for
//! together), LMDB with a `pread` per value (a Python folder2lmdb file's values found when
//! their batch is announced). They must read exactly what they read otherwise.
//! The limit is the process's environment, so the reading runs in a child of this test binary.

use crate::support;

use std::fs;
use std::path::Path;

use imagefeed::dataset::Dataset;
use imagefeed::format::folder::ImageFolder;
use imagefeed::format::{self, writer::PackFormat};
use imagefeed::{Error, pagecache};
use support::{
    Row, fixture_records_without_broken, fixture_root, pack_as, pack_lmdb, small_options,
};

/// Tells the child which directory holds the datasets.
const CHILD_DIR: &str = "IMAGEFEED_TEST_MEMORY_LIMIT_DIR";
/// Tells the child the URLs of the datasets in object storage, comma-separated (none where
/// the suite has no S3 server).
const CHILD_URLS: &str = "IMAGEFEED_TEST_MEMORY_LIMIT_URLS";

/// Writes `rows` as an MDS set of `shards` shards (an image column `x`, `jpeg`, and an `int`
/// label `y`), laid out as MDSWriter lays it out.
fn mds_set(dir: &Path, rows: &[Row], shards: usize) {
    fs::create_dir_all(dir).unwrap();
    let mut entries = Vec::new();
    for shard in 0..shards {
        let samples: Vec<Vec<u8>> = rows
            .iter()
            .enumerate()
            .filter(|(i, _)| i * shards / rows.len() == shard)
            .map(|(_, (_, label, bytes))| {
                let mut sample = (bytes.len() as u32).to_le_bytes().to_vec();
                sample.extend_from_slice(bytes);
                sample.extend_from_slice(&i64::from(*label).to_le_bytes());
                sample
            })
            .collect();
        let mut offsets = vec![4 + 4 * (samples.len() as u32 + 1)];
        for sample in &samples {
            offsets.push(offsets.last().unwrap() + sample.len() as u32);
        }
        let mut bytes = (samples.len() as u32).to_le_bytes().to_vec();
        bytes.extend(offsets.iter().flat_map(|o| o.to_le_bytes()));
        bytes.extend(samples.concat());
        let name = format!("shard.{shard:05}.mds");
        fs::write(dir.join(&name), &bytes).unwrap();
        entries.push(format!(
            r#"{{"format": "mds", "version": 2, "column_names": ["x", "y"],
            "column_encodings": ["jpeg", "int"], "column_sizes": [null, 8],
            "compression": null, "hashes": [], "size_limit": 67108864,
            "raw_data": {{"basename": "{name}", "bytes": {}, "hashes": {{}}}},
            "samples": {}, "zip_data": null}}"#,
            bytes.len(),
            samples.len()
        ));
    }
    fs::write(
        dir.join("index.json"),
        format!(r#"{{"version": 2, "shards": [{}]}}"#, entries.join(", ")),
    )
    .unwrap();
}

/// The datasets, by name: each holds the fixture tree's good files.
fn datasets(dir: &Path) -> Vec<(&'static str, std::path::PathBuf)> {
    let rows = fixture_records_without_broken();
    let records = dir.join("records");
    // Small shards, so that a batch spans several.
    pack_as(
        &fixture_root(),
        &records,
        PackFormat::Records,
        &small_options().with_shard_bytes(8 << 10),
    );
    // Others' TFRecord shards: ours without manifest or index, scanned at open.
    let foreign = dir.join("foreign");
    fs::create_dir(&foreign).unwrap();
    for entry in fs::read_dir(&records).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "tfrecord") {
            fs::copy(&path, foreign.join(path.file_name().unwrap())).unwrap();
        }
    }
    let wds = dir.join("wds");
    fs::create_dir(&wds).unwrap();
    crate::webdataset::rust_shards(&wds, "shard", 3);
    mds_set(&dir.join("mds"), &rows, 3);
    pack_lmdb(&fixture_root(), &dir.join("data.lmdb"), &small_options());
    vec![
        ("records", records),
        ("foreign", foreign),
        ("wds", wds),
        ("mds", dir.join("mds")),
        ("lmdb", dir.join("data.lmdb")),
    ]
}

/// (label, bytes) of every record, read in batches of 5, last batch first, each announced to
/// the reader before it is read (the loader's `plan_reads`).
fn read_in_batches(dataset: &dyn Dataset) -> Vec<(u32, Vec<u8>)> {
    let mut reader = dataset.open_reader().unwrap();
    let batches: Vec<Vec<usize>> = (0..dataset.len())
        .collect::<Vec<_>>()
        .chunks(5)
        .rev()
        .map(<[usize]>::to_vec)
        .collect();
    let mut read = vec![None; dataset.len()];
    for batch in batches {
        reader.plan_reads(&batch);
        for index in batch {
            let record = reader.read(index).unwrap();
            read[index] = Some((record.label, record.payload.to_vec()));
        }
    }
    read.into_iter().map(Option::unwrap).collect()
}

/// The files under `dir` this process maps, each with whether its map is read at random (the
/// kernel's `rr` flag in `/proc/self/smaps`).
fn maps_under(dir: &Path) -> Vec<(String, bool)> {
    let smaps = fs::read_to_string("/proc/self/smaps").unwrap();
    let mut maps = Vec::new();
    let mut current: Option<String> = None;
    for line in smaps.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if let Some(path) = current.take() {
                maps.push((path, flags.split_whitespace().any(|f| f == "rr")));
            }
        } else if let Some(path) = line.split_whitespace().nth(5)
            && line
                .split_whitespace()
                .next()
                .is_some_and(|r| r.contains('-'))
        {
            current = Path::new(path).starts_with(dir).then(|| path.to_string());
        }
    }
    maps
}

/// Every dataset opened under a memory limit far below its size reads what it reads without
/// one, batch hints given; its shards' maps are read at random only under the limit, and an
/// invalid limit is refused by name.
#[test]
fn datasets_larger_than_the_memory_limit_read_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let expected: Vec<(u32, Vec<u8>)> = fixture_records_without_broken()
        .into_iter()
        .map(|(_, label, bytes)| (label, bytes))
        .collect();
    let mut open = Vec::new();
    for (name, path) in datasets(dir.path()) {
        let dataset = format::open(&path).unwrap();
        assert_eq!(read_in_batches(dataset.as_ref()), expected, "{name}");
        open.push(dataset);
    }
    // (Unless the shell running the tests set a limit of its own.)
    if std::env::var_os(pagecache::MEMORY_LIMIT_ENV).is_none() {
        let maps = maps_under(dir.path());
        assert!(maps.len() >= 4, "{maps:?}");
        assert!(maps.iter().all(|(_, random)| !random), "{maps:?}");
    }
    drop(open);
    // The shard sets in object storage too, where the suite has a server: fetched into the
    // cache, and read from there.
    #[cfg_attr(not(feature = "remote"), allow(unused_mut))]
    let mut urls: Vec<String> = Vec::new();
    let mut child = support::test_alone(module_path!(), "larger_than_memory_child");
    #[cfg(feature = "remote")]
    if let Some(server) = support::s3::server() {
        let bucket = server.bucket(&support::s3::unique_bucket("memory-limit"));
        for name in ["records", "wds", "mds"] {
            server.upload_dir(&dir.path().join(name), &bucket, name);
            urls.push(format!("s3://{bucket}/{name}"));
        }
        for (key, value) in server.options() {
            child.env(key.to_ascii_uppercase(), value);
        }
        child.env("IMAGEFEED_CACHE_DIR", dir.path().join("cache"));
    }
    child
        .arg("--test-threads=1")
        .env(CHILD_DIR, dir.path())
        .env(CHILD_URLS, urls.join(","));
    let datasets = 6 + urls.len();
    for (limit, says) in [
        ("1K", format!("read {datasets} datasets at random")),
        ("lots", "an invalid limit is refused".to_string()),
    ] {
        let output = child
            .env(pagecache::MEMORY_LIMIT_ENV, limit)
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
        );
        assert!(output.status.success(), "{limit}: {stdout}{stderr}");
        assert!(stdout.contains(&says), "{limit}: {stdout}");
    }
}

/// The child of the test above (does nothing when run on its own).
#[test]
fn larger_than_memory_child() {
    let Some(dir) = std::env::var_os(CHILD_DIR) else {
        return;
    };
    let dir = Path::new(&dir);
    let mut names: Vec<String> = ["records", "foreign", "wds", "mds", "data.lmdb"]
        .iter()
        .map(|name| dir.join(name).to_string_lossy().into_owned())
        .collect();
    // A Python folder2lmdb file: its values are found by a search, made when a batch is
    // announced.
    names.push(
        crate::compat::compat("folder2lmdb.lmdb")
            .to_string_lossy()
            .into_owned(),
    );
    let urls = std::env::var(CHILD_URLS).unwrap_or_default();
    names.extend(
        urls.split(',')
            .filter(|u| !u.is_empty())
            .map(str::to_string),
    );
    if pagecache::memory_limit_from_env().is_err() {
        for name in &names {
            let refused = format::open(name).map(|_| ());
            assert!(
                matches!(refused, Err(Error::Config(_))),
                "{name}: {refused:?}"
            );
        }
        println!("an invalid limit is refused");
        return;
    }
    let expected: Vec<(u32, Vec<u8>)> = fixture_records_without_broken()
        .into_iter()
        .map(|(_, label, bytes)| (label, bytes))
        .collect();
    let mut open = Vec::new();
    // (folder2lmdb.lmdb holds every file of the fixture tree, the broken ones too.)
    let source = ImageFolder::open(fixture_root()).unwrap();
    let every_file: Vec<(u32, Vec<u8>)> = (0..source.len())
        .map(|i| {
            let entry = &source.entries()[i];
            (entry.label, fs::read(source.file_path(i)).unwrap())
        })
        .collect();
    for name in &names {
        let dataset = format::open(name).unwrap();
        let expected = if name.ends_with("folder2lmdb.lmdb") {
            &every_file
        } else {
            &expected
        };
        assert_eq!(&read_in_batches(dataset.as_ref()), expected, "{name}");
        open.push(dataset);
    }
    // Every shard map is read at random, cache entries of remote shards too (LMDB reads with
    // `pread`; its map is left as it is).
    let shards: Vec<(String, bool)> = maps_under(dir)
        .into_iter()
        .filter(|(path, _)| !path.contains("data.lmdb"))
        .collect();
    assert!(shards.len() >= 4, "{shards:?}");
    assert!(shards.iter().all(|(_, random)| *random), "{shards:?}");
    println!("read {} datasets at random", open.len());
}
