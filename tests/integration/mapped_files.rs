//! Datasets read through memory maps (LMDB, record shards, WebDataset and MDS shards) whose file
//! is cut short under an open reader, as `cp other.lmdb train.lmdb` does to a running job: the
//! pages past the cut are gone, and reading them through the map is SIGBUS. Every read must be
//! the record as before or [`Error::FileChanged`] naming the file, and a loader must fail the
//! batch saying so: never a dead process.

use crate::support;

use std::fs;
use std::path::{Path, PathBuf};

use imagefeed::dataset::Dataset;
use imagefeed::format::{self, writer::PackFormat};
use imagefeed::loader::{Loader, LoaderConfig};
use imagefeed::transform::Transform;
use imagefeed::{Error, pack};
use support::{pack_lmdb, packed_small_records, small_options, small_tree};

/// Reads every record of `dataset` through one reader, cuts `file` to `keep` bytes, and reads
/// them all again through the same reader: each is the same record or `FileChanged` naming
/// `file`, and at least one is the latter. Returns how many were.
fn cut_under_a_reader(dataset: &dyn Dataset, file: &Path, keep: u64) -> usize {
    let mut reader = dataset.open_reader().unwrap();
    let before: Vec<Vec<u8>> = (0..dataset.len())
        .map(|i| reader.read(i).unwrap().payload.to_vec())
        .collect();
    let len = fs::metadata(file).unwrap().len();
    assert!(keep < len, "{} is only {len} bytes", file.display());
    fs::OpenOptions::new()
        .write(true)
        .open(file)
        .unwrap()
        .set_len(keep)
        .unwrap();
    let mut gone = 0;
    for (index, payload) in before.iter().enumerate() {
        match reader.read(index) {
            Ok(record) => assert_eq!(&record.payload, payload, "record {index}"),
            Err(Error::FileChanged { path, change }) => {
                assert_eq!(path, file, "record {index}: {change}");
                assert!(change.contains(&format!("from {len}")), "{change}");
                gone += 1;
            }
            Err(other) => panic!("record {index}: {other}"),
        }
    }
    assert!(gone > 0, "no record of {} was past the cut", file.display());
    gone
}

#[test]
fn an_lmdb_cut_short_under_a_reader_is_an_error_not_sigbus() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("small.lmdb");
    pack_lmdb(&small_tree(dir.path()), &out, &small_options());
    let dataset = format::open(&out).unwrap();
    // Two pages keep both meta pages; most values lie beyond.
    let gone = cut_under_a_reader(dataset.as_ref(), &out, 8192);
    assert!(gone > dataset.len() / 2, "{gone} of {}", dataset.len());
}

#[test]
fn an_lmdb_cut_inside_a_page_is_a_changed_file_not_damage() {
    // The rest of the page the cut falls in reads as zeros, which the value's checksum refuses:
    // the reader then finds the file shorter and says so.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("small.lmdb");
    pack_lmdb(&small_tree(dir.path()), &out, &small_options());
    let dataset = format::open(&out).unwrap();
    // A page in the middle: a leaf of sample values, whose values lie at its end, past byte 100.
    let pages = fs::metadata(&out).unwrap().len() / 4096;
    cut_under_a_reader(dataset.as_ref(), &out, pages / 2 * 4096 + 100);
}

#[test]
fn a_folder2lmdb_file_cut_short_under_a_reader_is_an_error_not_sigbus() {
    // Its values are searched for by key (nothing locates them at open): the search reads the
    // B-tree's pages from the map, which a reader opened before the cut meets gone.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("folder2lmdb.lmdb");
    fs::copy(crate::compat::compat("folder2lmdb.lmdb"), &file).unwrap();
    let dataset = format::open(&file).unwrap();
    let mut fresh = dataset.open_reader().unwrap();
    cut_under_a_reader(dataset.as_ref(), &file, 8192);
    let mut gone = 0;
    for index in 0..dataset.len() {
        match fresh.read(index) {
            Ok(record) => panic!("record {index} ({}) read past the cut", record.key),
            Err(Error::FileChanged { path, change }) => {
                assert_eq!(path, file, "{change}");
                gone += 1;
            }
            Err(other) => panic!("record {index}: {other}"),
        }
    }
    assert_eq!(gone, dataset.len());
}

#[test]
fn a_record_shard_cut_short_under_a_reader_is_an_error_not_sigbus() {
    let dir = tempfile::tempdir().unwrap();
    let out = packed_small_records(dir.path(), "small.records");
    let dataset = format::open(&out).unwrap();
    let shard = largest_file(&out, ".tfrecord");
    cut_under_a_reader(dataset.as_ref(), &shard, 4096);
}

#[test]
fn a_record_shard_cut_inside_a_page_is_a_changed_file_not_damage() {
    // The rest of the page the cut falls in reads as zeros, which the record's CRC refuses:
    // the reader then finds the file shorter and says so.
    let dir = tempfile::tempdir().unwrap();
    let out = packed_small_records(dir.path(), "small.records");
    let dataset = format::open(&out).unwrap();
    cut_under_a_reader(dataset.as_ref(), &largest_file(&out, ".tfrecord"), 100);
}

#[test]
fn a_webdataset_shard_cut_short_under_a_reader_is_an_error_not_sigbus() {
    let dir = tempfile::tempdir().unwrap();
    let shards = crate::webdataset::rust_shards(dir.path(), "train", 2);
    let dataset = format::open(dir.path()).unwrap();
    cut_under_a_reader(dataset.as_ref(), &shards[1], 4096);
}

#[test]
fn an_mds_shard_cut_short_under_a_reader_is_an_error_not_sigbus() {
    let dir = tempfile::tempdir().unwrap();
    let mds = crate::compat::copied("mds", dir.path());
    let dataset = format::open(&mds).unwrap();
    // At a page boundary: MDS has no checksums, and a cut inside a page leaves the rest of that
    // page reading as zeros (see `a_record_shard_cut_inside_a_page_...`).
    cut_under_a_reader(dataset.as_ref(), &largest_file(&mds, ".mds"), 4096);
}

#[test]
fn a_loader_over_a_file_cut_short_fails_the_batch_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("small.lmdb");
    pack::pack_image_folder(
        &small_tree(dir.path()),
        &out,
        PackFormat::Lmdb,
        &small_options(),
        &pack::NoProgress,
    )
    .unwrap();
    let dataset = format::open(&out).unwrap();
    let loader = Loader::new(
        dataset,
        LoaderConfig::default()
            .with_batch_size(8)
            .with_workers(2)
            .with_transform(Transform::cifar()),
    )
    .unwrap();
    assert!(loader.epoch(0).all(|batch| batch.is_ok()));
    fs::OpenOptions::new()
        .write(true)
        .open(&out)
        .unwrap()
        .set_len(8192)
        .unwrap();
    let failed = loader.epoch(1).find_map(|batch| batch.err());
    match failed {
        Some(Error::FileChanged { path, .. }) => assert_eq!(path, out),
        other => panic!(
            "expected FileChanged naming {}, got {other:?}",
            out.display()
        ),
    }
}

/// Cuts `file` (a copy of `packed`, made fresh each round) to nothing at a varying moment while
/// a loader's workers read and decode it, `rounds` times: each run ends with `FileChanged` (or
/// an I/O error) naming it, never a signal. Records used to be only touched before the decoder
/// read them from the map, and a cut during the decode was SIGBUS inside libjpeg-turbo.
fn cut_while_decoding(packed: &Path, file: impl Fn(&Path) -> PathBuf, rounds: u32) {
    for round in 0..rounds {
        let dir = tempfile::tempdir().unwrap();
        let copy = dir.path().join(packed.file_name().unwrap());
        if packed.is_dir() {
            support::copy_tree(packed, &copy);
        } else {
            fs::copy(packed, &copy).unwrap();
        }
        let dataset = format::open(&copy).unwrap();
        let loader = Loader::new(
            dataset,
            LoaderConfig::default()
                .with_batch_size(4)
                .with_workers(2)
                .with_seed(u64::from(round))
                .with_transform(Transform::cifar()),
        )
        .unwrap();
        let target = file(&copy);
        std::thread::scope(|s| {
            let reading = s.spawn(|| {
                for epoch in 0.. {
                    for batch in loader.epoch(epoch) {
                        if let Err(e) = batch {
                            return e;
                        }
                    }
                }
                unreachable!()
            });
            std::thread::sleep(std::time::Duration::from_micros(
                200 + 700 * u64::from(round),
            ));
            fs::OpenOptions::new()
                .write(true)
                .open(&target)
                .unwrap()
                .set_len(0)
                .unwrap();
            match reading.join().unwrap() {
                Error::FileChanged { path, .. } | Error::Io { path, .. } => {
                    assert_eq!(path, target, "round {round}")
                }
                other => panic!("round {round}: {other}"),
            }
        });
    }
}

#[test]
fn an_lmdb_cut_while_workers_decode_never_kills_the_process() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("small.lmdb");
    pack_lmdb(&small_tree(dir.path()), &out, &small_options());
    cut_while_decoding(&out, Path::to_path_buf, 12);
}

#[test]
fn a_record_shard_cut_while_workers_decode_never_kills_the_process() {
    let dir = tempfile::tempdir().unwrap();
    let out = packed_small_records(dir.path(), "small.records");
    cut_while_decoding(&out, |copy| largest_file(copy, ".tfrecord"), 12);
}

/// The largest file under `dir` whose name ends with `suffix`.
fn largest_file(dir: &Path, suffix: &str) -> PathBuf {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .max_by_key(|p| fs::metadata(p).unwrap().len())
        .unwrap_or_else(|| panic!("no {suffix} file under {}", dir.display()))
}

#[test]
fn an_lmdb_damaged_in_place_between_two_opens_is_refused_at_the_second() {
    // The second open in a process (a forked DataLoader worker's, every epoch) shares the first
    // one's environment: its pages are checked again before liblmdb reads them, so a page
    // damaged since (or one the disk can no longer supply, which liblmdb would meet as SIGBUS)
    // is the open's error.
    use std::os::unix::fs::FileExt as _;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("small.lmdb");
    pack_lmdb(&small_tree(dir.path()), &out, &small_options());
    let first = format::open(&out).unwrap();
    let pages = fs::metadata(&out).unwrap().len() / 4096;
    // Every page past the meta pages says it is another page (its first 8 bytes).
    let file = fs::OpenOptions::new().write(true).open(&out).unwrap();
    for page in 2..pages {
        file.write_all_at(&u64::MAX.to_le_bytes(), page * 4096)
            .unwrap();
    }
    match format::open(&out) {
        Err(Error::NotADataset { reason, .. }) => {
            assert!(reason.contains("damaged LMDB"), "{reason}");
        }
        Ok(_) => panic!("opened a file whose every tree page is damaged"),
        Err(other) => panic!("{other}"),
    }
    drop(first);
}
