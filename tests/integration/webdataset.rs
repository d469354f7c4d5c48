//! WebDataset tar shards as the `webdataset` package (and Python's `tarfile`) write them: every
//! sample read with its image bytes and label, sets named by directory, pattern or brace list,
//! gzipped shards, and damaged shards costing only the samples they touch.

use crate::support;

use std::fs;
use std::path::{Path, PathBuf};

use imagefeed::Error;
use imagefeed::cache::Cache;
use imagefeed::dataset::FormatKind;
use imagefeed::format::shards::ShardSetProblem;
use imagefeed::format::{self, OpenOptions};
use imagefeed::loader::{Loader, LoaderConfig};
use imagefeed::transform::Transform;
use support::{
    Row, fixture_records_without_broken, fixture_root, python_with, records,
    run_python_on_fixture_files,
};

/// The fixture tree's good files, as (key, label, bytes), in ImageFolder order.
fn expected() -> Vec<Row> {
    fixture_records_without_broken()
}

/// Writes `expected()` as tar shards with the `tar` crate: `n` shards `NAME-00000i.tar`,
/// each sample `key.jpg` (or `.png`, whatever the file is), `key.cls`, `key.json`.
pub(crate) fn rust_shards(dir: &Path, name: &str, n: usize) -> Vec<PathBuf> {
    let rows = expected();
    let mut paths = Vec::new();
    for shard in 0..n {
        let path = dir.join(format!("{name}-{shard:06}.tar"));
        let mut builder = tar::Builder::new(fs::File::create(&path).unwrap());
        for (i, (key, label, bytes)) in rows.iter().enumerate() {
            if i * n / rows.len() != shard {
                continue;
            }
            let stem = key.rsplit_once('.').map_or(key.as_str(), |(s, _)| s);
            let ext = key
                .rsplit_once('.')
                .map_or("jpg", |(_, e)| e)
                .to_ascii_lowercase();
            let ext = if ext == "jpeg" {
                "jpg".to_string()
            } else {
                ext
            };
            for (field, data) in [
                (ext.as_str(), bytes.clone()),
                ("cls", label.to_string().into_bytes()),
                ("json", b"{}".to_vec()),
            ] {
                support::append_tar_member(&mut builder, format!("{stem}.{field}"), &data[..]);
            }
        }
        builder.finish().unwrap();
        paths.push(path);
    }
    paths
}

/// Cuts the tar at `path` right after its last member, leaving out its end-of-archive blocks.
fn drop_end_blocks(path: &Path) {
    let bytes = fs::read(path).unwrap();
    let end = bytes.len() - bytes.iter().rev().take_while(|&&b| b == 0).count();
    fs::write(path, &bytes[..end.div_ceil(512) * 512]).unwrap();
}

/// (label, bytes) of rows, for comparing what has no file names for keys.
fn labels_and_bytes(rows: Vec<Row>) -> Vec<(u32, Vec<u8>)> {
    rows.into_iter().map(|(_, l, b)| (l, b)).collect()
}

fn cached(dir: &Path) -> OpenOptions {
    OpenOptions::default().with_cache(Cache::at(dir.join("cache"), None))
}

#[test]
fn a_directory_a_pattern_and_a_brace_list_read_the_samples_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let shards = dir.path().join("shards");
    fs::create_dir(&shards).unwrap();
    rust_shards(&shards, "train", 3);
    let want = labels_and_bytes(expected());
    for path in [
        shards.clone(),
        shards.join("train-*.tar"),
        shards.join("train-{000000..000002}.tar"),
    ] {
        let dataset = format::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(dataset.info().format, FormatKind::WebDataset);
        assert_eq!(
            labels_and_bytes(records(dataset.as_ref())),
            want,
            "{}",
            path.display()
        );
        assert_eq!(dataset.classes(), ["0", "1", "2"]);
    }
    // Keys are the sample keys: the file's path up to the first dot of its name.
    let dataset = format::open(&shards).unwrap();
    let first = records(dataset.as_ref()).remove(0);
    assert_eq!(first.0, expected()[0].0.rsplit_once('.').unwrap().0);
    // A brace list with a member missing names it, or reads the rest when allowed.
    fs::remove_file(shards.join("train-000001.tar")).unwrap();
    let braces = shards.join("train-{000000..000002}.tar");
    match format::open(&braces) {
        Err(Error::ShardSet {
            problem: ShardSetProblem::Missing { missing, .. },
            ..
        }) => assert_eq!(missing, ["train-000001.tar"]),
        other => panic!("{other:?}"),
    }
    let partial = format::open_with(
        &braces,
        &OpenOptions::default().with_allow_missing_shards(true),
    )
    .unwrap();
    assert_eq!(partial.missing_shards().named, ["train-000001.tar"]);
    // So does the directory: numbered shards with a gap.
    assert!(matches!(
        format::open(&shards),
        Err(Error::ShardSet {
            problem: ShardSetProblem::Missing { .. },
            ..
        })
    ));
}

#[test]
fn gzipped_shards_give_the_same_stream_as_plain_ones() {
    use std::io::Write as _;
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain");
    let gz = dir.path().join("gz");
    fs::create_dir_all(&plain).unwrap();
    fs::create_dir_all(&gz).unwrap();
    for path in rust_shards(&plain, "s", 2) {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(&fs::read(&path).unwrap()).unwrap();
        let name = path
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .replace(".tar", ".tar.gz");
        fs::write(gz.join(name), e.finish().unwrap()).unwrap();
    }
    let options = cached(dir.path());
    let digest = |path: &Path| {
        use sha2::{Digest as _, Sha256};
        let loader = Loader::new(
            format::open_with(path, &options).unwrap(),
            LoaderConfig::default()
                .with_batch_size(5)
                .with_seed(3)
                .with_transform(Transform::cifar()),
        )
        .unwrap();
        let mut hash = Sha256::new();
        for batch in loader.epoch(2) {
            let batch = batch.unwrap();
            hash.update(batch.bytes());
            for l in &batch.labels {
                hash.update(l.to_le_bytes());
            }
        }
        hash.finalize().to_vec()
    };
    assert_eq!(digest(&plain), digest(&gz));
}

#[test]
fn a_damaged_shard_costs_only_the_samples_it_touches() {
    let dir = tempfile::tempdir().unwrap();
    let path = rust_shards(dir.path(), "d", 1).remove(0);
    let mut bytes = fs::read(&path).unwrap();
    let clean = records(format::open(&path).unwrap().as_ref());
    // The 5th sample's first header: flip a byte of its name (the checksum no longer holds).
    let mut archive = tar::Archive::new(std::io::Cursor::new(&bytes[..]));
    let fifth = archive
        .entries_with_seek()
        .unwrap()
        .nth(12)
        .unwrap()
        .unwrap()
        .raw_header_position() as usize;
    bytes[fifth + 3] ^= 0x20;
    fs::write(&path, &bytes).unwrap();
    // Every other sample reads as before (found by key); the damaged header's bytes are one
    // bad record, and the rest of that sample (its label and json, now without an image)
    // another.
    let dataset = format::open(&path).unwrap();
    let mut reader = dataset.open_reader().unwrap();
    let mut bad = Vec::new();
    let mut good = std::collections::HashMap::new();
    for index in 0..dataset.len() {
        match reader.read(index) {
            Ok(record) => {
                good.insert(record.key.to_string(), record.payload.to_vec());
            }
            Err(Error::CorruptRecord { reason, .. }) => bad.push(reason),
            Err(other) => panic!("{other}"),
        }
    }
    let damaged_key = clean[4].0.clone();
    for (key, _, payload) in clean.iter().filter(|r| r.0 != damaged_key) {
        assert_eq!(good.get(key), Some(payload), "{key}");
    }
    assert_eq!(good.len(), clean.len() - 1);
    assert_eq!(bad.len(), 2, "{bad:?}");
    assert!(bad[0].contains("checksum"), "{}", bad[0]);
    assert!(bad[1].contains("no image field"), "{}", bad[1]);
    assert!(
        dataset
            .notices()
            .iter()
            .any(|n| n.contains("sample 4 is damaged"))
    );
}

#[test]
fn a_shard_cut_short_counts_its_lost_tail_against_the_bad_sample_limit() {
    let dir = tempfile::tempdir().unwrap();
    let files = rust_shards(dir.path(), "c", 3);
    let whole = format::open(dir.path()).unwrap();
    let starts = whole.shard_starts().unwrap().to_vec();
    let bytes = fs::read(&files[0]).unwrap();
    // Cut between two members (no end-of-archive block), as a copy that stopped leaves it.
    let mut archive = tar::Archive::new(std::io::Cursor::new(&bytes[..]));
    let third_sample = archive
        .entries_with_seek()
        .unwrap()
        .nth(6)
        .unwrap()
        .unwrap()
        .raw_header_position() as usize;
    fs::write(&files[0], &bytes[..third_sample]).unwrap();

    let cut = format::open(dir.path()).unwrap();
    let named: Vec<usize> = cut.shards_cut_at_end().iter().map(|(i, _)| *i).collect();
    assert_eq!(named, [0]);
    let held = cut.shard_starts().unwrap()[1];
    // Two samples and the bad record standing for the rest.
    assert_eq!(held, 3);
    // Estimated by the whole shard that is not the last (shard 1).
    let lost = imagefeed::dataset::cut_loss(cut.as_ref())
        .unwrap()
        .lost
        .unwrap();
    assert_eq!(lost, (starts[2] - starts[1] - held) as u64);
    assert!(lost > 0);
    match Loader::new(cut.clone(), LoaderConfig::default()) {
        Err(Error::ShardSet {
            problem:
                ShardSetProblem::CutShort {
                    shards, lost: said, ..
                },
            ..
        }) => assert_eq!(
            (shards, said),
            (vec!["c-000000.tar".to_string()], Some(lost))
        ),
        Err(other) => panic!("expected a cut-short error, got {other}"),
        Ok(_) => panic!("a set missing {lost} samples was loaded under the 1% limit"),
    }
    let lifted = LoaderConfig::default()
        .with_batch_size(2)
        .with_max_bad(None);
    let samples: usize = Loader::new(cut.clone(), lifted)
        .unwrap()
        .epoch(0)
        .map(|b| b.unwrap().len())
        .sum();
    assert_eq!(samples, cut.len() - 1);

    // A set whose every tar ends without the end-of-archive block was written so (Python's
    // tarfile reads such tars): no shard is cut, and the loader starts.
    let unterminated = dir.path().join("unterminated");
    fs::create_dir(&unterminated).unwrap();
    for file in rust_shards(&unterminated, "u", 3) {
        drop_end_blocks(&file);
    }
    let written_so = format::open(&unterminated).unwrap();
    assert!(written_so.shards_cut_at_end().is_empty());
    assert_eq!(records(written_so.as_ref()).len(), whole.len());
    assert!(
        !written_so.notices().iter().any(|n| n.contains("damaged")),
        "{:?}",
        written_so.notices()
    );
    Loader::new(written_so, LoaderConfig::default()).unwrap();
    // One of them cut between two members, beside whole ones with their end blocks: cut.
    let files = rust_shards(dir.path(), "m", 3);
    drop_end_blocks(&files[1]);
    let one_cut = format::open(dir.path().join("m-*.tar")).unwrap();
    let named: Vec<usize> = one_cut
        .shards_cut_at_end()
        .iter()
        .map(|(i, _)| *i)
        .collect();
    assert_eq!(named, [1]);
}

#[test]
fn a_tar_cut_between_two_samples_in_an_unended_set_is_named_when_short() {
    // A set of tars its writer never ended (no end-of-archive blocks) cannot show a copy cut
    // between two samples: a shard left with under half the others' samples is named.
    let dir = tempfile::tempdir().unwrap();
    let rows = expected();
    for shard in 0..4 {
        let path = dir.path().join(format!("u-{shard:06}.tar"));
        let mut builder = tar::Builder::new(Vec::new());
        let samples = if shard == 1 { 10 } else { 40 };
        for n in 0..samples {
            let (_, label, bytes) = &rows[(shard * 40 + n) % rows.len()];
            for (field, data) in [
                ("jpg", bytes.clone()),
                ("cls", label.to_string().into_bytes()),
            ] {
                support::append_tar_member(
                    &mut builder,
                    format!("s{shard}_{n:03}.{field}"),
                    &data[..],
                );
            }
        }
        fs::write(&path, builder.into_inner().unwrap()).unwrap();
        drop_end_blocks(&path);
    }
    let dataset = format::open(dir.path()).unwrap();
    assert!(dataset.shards_cut_at_end().is_empty());
    assert_eq!(dataset.len(), 130);
    assert_eq!(dataset.short_shards(), 1);
    assert!(
        dataset
            .notices()
            .iter()
            .any(|n| n.contains("fewer than half") && n.contains("u-000001.tar")),
        "{:?}",
        dataset.notices()
    );
    Loader::new(dataset, LoaderConfig::default()).unwrap();
}

#[test]
fn shards_written_by_the_webdataset_package_and_tarfile_read_like_their_source() {
    let Some(python) = python_with("webdataset") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let rows = expected();
    // webdataset's ShardWriter (PAX headers, 6 samples a shard) and tarfile in GNU format with
    // keys longer than a ustar name holds.
    let script = r#"
import io, os, sys, tarfile
import webdataset as wds
out, files = sys.argv[1], sys.argv[2:]
labels = [int(l) for l in os.environ["LABELS"].split(",")]
os.makedirs(os.path.join(out, "wds"))
with wds.ShardWriter(os.path.join(out, "wds", "shard-%06d.tar"), maxcount=6) as sink:
    for i, (f, l) in enumerate(zip(files, labels)):
        ext = "png" if f.lower().endswith(".png") else "jpg"
        sink.write({"__key__": f"sample{i:04d}", ext: open(f, "rb").read(), "cls": l, "json": {"i": i}})
os.makedirs(os.path.join(out, "gnu"))
with tarfile.open(os.path.join(out, "gnu", "long.tar"), "w", format=tarfile.GNU_FORMAT) as t:
    for i, (f, l) in enumerate(zip(files, labels)):
        key = "deep/" + "x" * 120 + f"/s{i:04d}"
        ext = "png" if f.lower().endswith(".png") else "jpg"
        for field, data in ((ext, open(f, "rb").read()), ("cls", str(l).encode())):
            info = tarfile.TarInfo(f"{key}.{field}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
"#;
    run_python_on_fixture_files(&python, script, dir.path(), &rows);
    let want = labels_and_bytes(rows);
    for path in [dir.path().join("wds"), dir.path().join("gnu/long.tar")] {
        let dataset = format::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(
            labels_and_bytes(records(dataset.as_ref())),
            want,
            "{}",
            path.display()
        );
    }
    let long = records(
        format::open(dir.path().join("gnu/long.tar"))
            .unwrap()
            .as_ref(),
    );
    assert!(
        long[3].0.starts_with("deep/xxxx") && long[3].0.ends_with("/s0003"),
        "{}",
        long[3].0
    );
    // webdataset's own reader agrees on keys and labels.
    let check = r#"
import sys, webdataset as wds
for s in wds.WebDataset(sys.argv[1] + "/wds/shard-{000000..000002}.tar", shardshuffle=False):
    print(s["__key__"], int(s["cls"]), "00")
"#;
    let theirs = support::python_rows(&python, check, &[dir.path()]);
    let ours = records(format::open(dir.path().join("wds")).unwrap().as_ref());
    let keys = |rows: &[Row]| rows.iter().map(|r| (r.0.clone(), r.1)).collect::<Vec<_>>();
    assert_eq!(keys(&theirs), keys(&ours));
}

#[test]
fn samples_without_an_image_or_label_are_bad_records_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("odd.tar");
    let mut builder = tar::Builder::new(fs::File::create(&path).unwrap());
    for (name, data) in [
        (
            "a.jpg",
            &fs::read(fixture_root().join("class00/img00000.jpg")).unwrap()[..],
        ),
        ("a.cls", b"1"),
        ("b.txt", b"a caption"),
        ("b.cls", b"0"),
        ("c.jpg", b"not read"),
        ("c.cls", b"one"),
        // A writer that repeated a key: two samples' members in a row under one key (a
        // hostile try found the second silently dropped, the shard "OK").
        (
            "d.jpg",
            &fs::read(fixture_root().join("class00/img00000.jpg")).unwrap()[..],
        ),
        ("d.cls", b"0"),
        (
            "d.jpg",
            &fs::read(fixture_root().join("class01/img00000.jpg")).unwrap()[..],
        ),
        ("d.cls", b"1"),
    ] {
        support::append_tar_member(&mut builder, name, data);
    }
    builder.finish().unwrap();
    drop(builder);
    let dataset = format::open(&path).unwrap();
    assert_eq!(dataset.len(), 4);
    // The open says that a sample's label is not an integer, and which.
    assert!(
        dataset.notices().iter().any(|n| n
            .contains("1 of 4 samples hold a label that is no integer class number")
            && n.contains("(c)")),
        "{:?}",
        dataset.notices()
    );
    let mut reader = dataset.open_reader().unwrap();
    assert_eq!(reader.read(0).unwrap().label, 1);
    for (index, says) in [
        (1, "no image field (it has .txt, .cls)"),
        (2, "its .cls holds \"one\", not an integer label"),
        (3, "hold its .jpg (the key is repeated)"),
    ] {
        match reader.read(index) {
            Err(Error::CorruptRecord { key, reason, .. }) => {
                assert_eq!(key, ["a", "b", "c", "d"][index]);
                assert!(reason.contains(says), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }
    // A shard whose every sample repeats its key is refused at open, saying so.
    let repeated = dir.path().join("repeated.tar");
    let image = fs::read(fixture_root().join("class00/img00000.jpg")).unwrap();
    let mut builder = tar::Builder::new(fs::File::create(&repeated).unwrap());
    for (name, data) in [
        ("k.jpg", &image[..]),
        ("k.cls", b"0"),
        ("k.jpg", &image[..]),
        ("k.cls", b"1"),
    ] {
        support::append_tar_member(&mut builder, name, data);
    }
    builder.finish().unwrap();
    drop(builder);
    let err = format::open(&repeated).unwrap_err();
    assert!(
        matches!(&err, Error::NotADataset { reason, .. } if reason.contains("repeat their key")),
        "{err}"
    );
    // A shard with no labels at all is refused at open, saying which fields it looked for.
    let unlabeled = dir.path().join("unlabeled.tar");
    let mut builder = tar::Builder::new(fs::File::create(&unlabeled).unwrap());
    support::append_tar_member(&mut builder, "x.jpg", &b"x"[..]);
    builder.finish().unwrap();
    drop(builder);
    let err = format::open(&unlabeled).unwrap_err();
    assert!(
        matches!(&err, Error::NotADataset { reason, .. } if reason.contains(".cls")),
        "{err}"
    );
    // One whose labels are all floats is refused saying what the first holds (a hostile try
    // found only "no sample has a label").
    let floats = dir.path().join("floats.tar");
    let mut builder = tar::Builder::new(fs::File::create(&floats).unwrap());
    support::append_tar_member(&mut builder, "x.jpg", &image[..]);
    support::append_tar_member(&mut builder, "x.cls", &b"3.0\n"[..]);
    builder.finish().unwrap();
    drop(builder);
    let err = format::open(&floats).unwrap_err();
    assert!(
        matches!(&err, Error::NotADataset { reason, .. }
            if reason.contains("its .cls holds \"3.0\", not an integer label")),
        "{err}"
    );
    // Twenty digits are an integer, too large for a class (it was "not an integer"); a sign
    // alone is none.
    for (label, says) in [
        ("12345678901234567890", "an integer past any class"),
        ("-", "not an integer label"),
    ] {
        let path = dir.path().join("label.tar");
        tar_of(&path, &[("x.jpg", &image), ("x.cls", label.as_bytes())]);
        let err = format::open(&path).unwrap_err();
        assert!(
            matches!(&err, Error::NotADataset { reason, .. }
                if reason.contains(&format!("holds {label:?}, {says}"))),
            "{err}"
        );
    }
}

/// A sample with a second image (a segmentation mask, a depth map) is read as its first image
/// field, and the open says so, naming the fields, rather than dropping the other unannounced.
#[test]
fn samples_with_several_images_say_which_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("masks.tar");
    let photo = fs::read(fixture_root().join("class00/img00000.jpg")).unwrap();
    let mask = fs::read(fixture_root().join("class01/img00000.jpg")).unwrap();
    let mut builder = tar::Builder::new(fs::File::create(&path).unwrap());
    for (name, data) in [
        ("a.seg.jpg", &mask[..]),
        ("a.jpg", &photo[..]),
        ("a.cls", &b"1"[..]),
        ("b.jpg", &photo[..]),
        ("b.cls", &b"0"[..]),
    ] {
        support::append_tar_member(&mut builder, name, data);
    }
    builder.finish().unwrap();
    drop(builder);
    let dataset = format::open(&path).unwrap();
    assert_eq!(dataset.len(), 2);
    let notice = dataset
        .notices()
        .iter()
        .find(|n| n.contains("more than one image"))
        .unwrap_or_else(|| panic!("{:?}", dataset.notices()));
    assert!(
        notice.contains("1 of 2 samples")
            && notice.contains("(a) holds .seg.jpg, .jpg; .jpg is read"),
        "{notice}"
    );
    // The photo is what is read, not the mask that comes first in the tar.
    let mut reader = dataset.open_reader().unwrap();
    assert_eq!(reader.read(0).unwrap().payload, &photo[..]);
    // A set of one image per sample says nothing of the kind.
    let single = dir.path().join("single.tar");
    let mut builder = tar::Builder::new(fs::File::create(&single).unwrap());
    support::append_tar_member(&mut builder, "b.jpg", &photo[..]);
    support::append_tar_member(&mut builder, "b.cls", &b"0"[..]);
    builder.finish().unwrap();
    drop(builder);
    let dataset = format::open(&single).unwrap();
    assert!(
        !dataset
            .notices()
            .iter()
            .any(|n| n.contains("more than one image")),
        "{:?}",
        dataset.notices()
    );
}

/// A JPEG of the fixture tree, for samples' images.
fn fixture_jpeg() -> Vec<u8> {
    fs::read(fixture_root().join("class00/img00000.jpg")).unwrap()
}

/// Appends a symbolic link member `name` → `target` to a tar being built.
fn append_symlink<W: std::io::Write>(builder: &mut tar::Builder<W>, name: &str, target: &str) {
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(tar::EntryType::Symlink);
    header.set_size(0);
    builder.append_link(&mut header, name, target).unwrap();
}

/// Writes a tar of `members` at `path`.
fn tar_of(path: &Path, members: &[(&str, &[u8])]) {
    let mut builder = tar::Builder::new(fs::File::create(path).unwrap());
    for (name, data) in members {
        support::append_tar_member(&mut builder, name, data);
    }
    builder.finish().unwrap();
}

/// A tar not grouped by sample (`tar cf x.tar *.jpg *.cls`: every image, then every label)
/// opened as twice the samples, every one bad; it is refused, saying that keys come back later
/// in the shard. All labels negative are refused quoting the first.
#[test]
fn a_tar_not_grouped_by_sample_is_refused_saying_so() {
    let dir = tempfile::tempdir().unwrap();
    let image = fixture_jpeg();
    let ungrouped = dir.path().join("ungrouped.tar");
    tar_of(
        &ungrouped,
        &[
            ("s0.jpg", &image),
            ("s1.jpg", &image),
            ("s0.cls", b"0"),
            ("s1.cls", b"1"),
        ],
    );
    let err = format::open(&ungrouped).unwrap_err();
    assert!(
        matches!(&err, Error::NotADataset { reason, .. }
            if reason.contains("no sample has both an image and a label")
                && reason.contains("\"s0\", samples 0 and 2")
                && reason.contains("not grouped by sample")),
        "{err}"
    );
    // A directory's listing order (hash order on ext4): a few samples whole by chance, most
    // split; refused too, where half the samples meet a key again.
    let listed = dir.path().join("listed.tar");
    tar_of(
        &listed,
        &[
            ("s2.cls", b"2"),
            ("s0.jpg", &image),
            ("s0.cls", b"0"),
            ("s3.jpg", &image),
            ("s1.cls", b"1"),
            ("s2.jpg", &image),
            ("s3.cls", b"0"),
            ("s1.jpg", &image),
        ],
    );
    let err = format::open(&listed).unwrap_err();
    assert!(
        matches!(&err, Error::NotADataset { reason, .. }
            if reason.contains("only 1 of the samples have both an image and a label")
                && reason.contains("not grouped by sample")),
        "{err}"
    );
    // Each whole sample twice (a writer that ran twice into one tar): read, with a notice.
    let twice = dir.path().join("twice.tar");
    let pass: [(&str, &[u8]); 4] = [
        ("s0.jpg", &image),
        ("s0.cls", b"0"),
        ("s1.jpg", &image),
        ("s1.cls", b"1"),
    ];
    tar_of(&twice, &[pass, pass].concat());
    let dataset = format::open(&twice).unwrap();
    assert_eq!(dataset.len(), 4);
    assert!(
        dataset
            .notices()
            .iter()
            .any(|n| n.contains("2 of 4 samples have a key met earlier")),
        "{:?}",
        dataset.notices()
    );
    let negative = dir.path().join("negative.tar");
    tar_of(&negative, &[("s0.jpg", &image), ("s0.cls", b"-1")]);
    let err = format::open(&negative).unwrap_err();
    assert!(
        matches!(&err, Error::NotADataset { reason, .. }
            if reason.contains("hold a label outside 0..") && reason.contains("(s0) holds -1")),
        "{err}"
    );
}

/// What a readable set does that its user should hear of, each in a notice: a key met again
/// later in its shard (read as two samples, as the webdataset package reads it), label fields
/// that disagree (the first is read), two shards starting with one key (a copy), an image
/// member that is a link (not read, and the bad record says so).
#[test]
fn keys_met_twice_differing_labels_and_copied_shards_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let image = fixture_jpeg();
    let set = dir.path().join("set");
    fs::create_dir(&set).unwrap();
    let first = set.join("shard-000000.tar");
    tar_of(
        &first,
        &[
            ("s0.jpg", &image),
            ("s0.cls", b"0"),
            ("s1.jpg", &image),
            ("s1.cls", b"1"),
            ("s1.class", b"2"),
            ("s0.jpg", &image),
            ("s0.cls", b"0"),
        ],
    );
    fs::copy(&first, set.join("shard-000001.tar")).unwrap();
    let dataset = format::open(&set).unwrap();
    assert_eq!(dataset.len(), 6);
    let notices = dataset.notices();
    for says in [
        "have a key met earlier in their shard",
        "\"s0\", samples 0 and 2 of",
        "hold label fields that differ",
        "holds .cls 1, .class 2",
        "1 shard looks like a copy of another",
    ] {
        assert!(
            notices.iter().any(|n| n.contains(says)),
            "{says}: {notices:?}"
        );
    }
    let mut reader = dataset.open_reader().unwrap();
    assert_eq!(reader.read(1).unwrap().label, 1, ".cls is read");
    // With the classes given (no label scan), the layout is still told: the key met twice and
    // the copy (a hostile re-try read both twice without a word).
    let given = format::open_with(&set, &OpenOptions::default().with_num_classes(3)).unwrap();
    for says in [
        "have a key met earlier in their shard",
        "1 shard looks like a copy",
    ] {
        assert!(
            given.notices().iter().any(|n| n.contains(says)),
            "{says}: {:?}",
            given.notices()
        );
    }
    // Shards that only start with the same key (one writer per worker, keys counted within
    // each shard) are no copies.
    let workers = dir.path().join("workers");
    fs::create_dir(&workers).unwrap();
    for (n, label) in [(0, b"0"), (1, b"1")] {
        tar_of(
            &workers.join(format!("shard-{n:06}.tar")),
            &[("000000.jpg", &image), ("000000.cls", label)],
        );
    }
    let dataset = format::open(&workers).unwrap();
    assert!(dataset.notices().is_empty(), "{:?}", dataset.notices());

    // An image member that is a symbolic link: the sample's bad record names it.
    let linked = dir.path().join("linked.tar");
    let mut builder = tar::Builder::new(fs::File::create(&linked).unwrap());
    support::append_tar_member(&mut builder, "a.jpg", &image);
    support::append_tar_member(&mut builder, "a.cls", b"0");
    append_symlink(&mut builder, "b.jpg", "a.jpg");
    support::append_tar_member(&mut builder, "b.cls", b"1");
    // A stray link of a key of its own makes no sample (the webdataset package skips it).
    append_symlink(&mut builder, "latest.jpg", "a.jpg");
    builder.finish().unwrap();
    drop(builder);
    let dataset = format::open(&linked).unwrap();
    assert_eq!(dataset.len(), 2);
    let mut reader = dataset.open_reader().unwrap();
    match reader.read(1) {
        Err(Error::CorruptRecord { reason, .. }) => assert!(
            reason.contains(
                "no image field (it has .cls; b.jpg is a symbolic link, which is not read)"
            ),
            "{reason}"
        ),
        other => panic!("{other:?}"),
    }
}

/// A shard compressed in a way imagefeed does not read (bzip2 data named `.tar` or like a
/// TFRecord shard, an `x.tar.xz`) was "bytes 0..N are not tar members ... no sample has a label", or "nor a
/// dataset file this build reads": both now name the compression.
#[test]
fn shards_compressed_in_an_unread_way_are_named_so() {
    let dir = tempfile::tempdir().unwrap();
    let bzip2 = dir.path().join("shard-000000.tar");
    fs::write(&bzip2, b"BZh91AY&SY\x12\x34 and the rest of a bzip2 stream").unwrap();
    let err = format::open(&bzip2).unwrap_err();
    assert!(
        matches!(&err, Error::Unsupported { what, .. } if what.contains("bzip2-compressed")),
        "{err}"
    );
    // The same under a TFRecord shard's name.
    let tfrecord = dir.path().join("train-00000-of-00001");
    fs::write(
        &tfrecord,
        b"BZh91AY&SY\x12\x34 and the rest of a bzip2 stream",
    )
    .unwrap();
    let err = format::open(&tfrecord).unwrap_err();
    assert!(
        matches!(&err, Error::Unsupported { what, .. } if what.contains("bzip2-compressed")),
        "{err}"
    );
    let xz = dir.path().join("shard-000000.tar.xz");
    fs::write(&xz, b"\xFD7zXZ\x00\x00\x04 and the rest of an xz stream").unwrap();
    let err = format::open(&xz).unwrap_err();
    assert!(
        matches!(&err, Error::Unsupported { what, .. } if what.contains("xz-compressed")),
        "{err}"
    );
}

/// Members whose names are no `key.field` (macOS tar's `._a.jpg` AppleDouble companions,
/// `.DS_Store`, a `README`) are skipped as the webdataset package skips them, with a notice:
/// they had made a macOS tar look ungrouped (refused) and others' samples bad.
#[test]
fn members_named_like_no_sample_are_skipped_with_a_notice() {
    let dir = tempfile::tempdir().unwrap();
    let image = fixture_jpeg();
    let path = dir.path().join("mac.tar");
    tar_of(
        &path,
        &[
            ("./._s0.jpg", b"\x00\x05\x16\x07 AppleDouble"),
            ("./s0.jpg", &image),
            ("./._s0.cls", b"\x00\x05\x16\x07 AppleDouble"),
            ("./s0.cls", b"0"),
            ("./s1.jpg", &image),
            ("README", b"a dataset"),
            ("./s1.cls", b"1"),
            ("./.DS_Store", b"junk"),
        ],
    );
    let dataset = format::open(&path).unwrap();
    assert_eq!(dataset.len(), 2);
    let notices = dataset.notices();
    assert_eq!(notices.len(), 1, "{notices:?}");
    assert!(
        notices[0].contains("4 members are no sample's (the first, \"._s0.jpg\""),
        "{notices:?}"
    );
    let labels: Vec<u32> = support::records(dataset.as_ref())
        .into_iter()
        .map(|(_, label, _)| label)
        .collect();
    assert_eq!(labels, [0, 1]);
}

/// A gzipped shard whose checksum fails: a tar has no checksums of its own, so every sample is
/// a bad record saying why (a hostile try's flipped byte changed a label to 2, read as sound,
/// `verify` OK). A shard cut short keeps the samples before the cut.
#[test]
fn a_gzipped_shard_failing_its_checksum_reads_as_bad_records() {
    use std::io::Write as _;
    let dir = tempfile::tempdir().unwrap();
    let image = fixture_jpeg();
    let plain = dir.path().join("plain.tar");
    tar_of(
        &plain,
        &[
            ("s0.jpg", &image),
            ("s0.cls", b"0"),
            ("s1.jpg", &image),
            ("s1.cls", b"1"),
        ],
    );
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&fs::read(&plain).unwrap()).unwrap();
    let whole = gz.finish().unwrap();
    let mut checksum = whole.clone();
    let at = checksum.len() - 8; // the CRC-32 in the trailer
    checksum[at] ^= 0xFF;
    let set = dir.path().join("set");
    fs::create_dir(&set).unwrap();
    fs::write(set.join("shard-000000.tar.gz"), &whole).unwrap();
    fs::write(set.join("shard-000001.tar.gz"), &checksum).unwrap();
    let options = cached(dir.path());
    let dataset = format::open_with(&set, &options).unwrap();
    assert_eq!(dataset.len(), 4);
    let mut reader = dataset.open_reader().unwrap();
    assert_eq!(reader.read(1).unwrap().label, 1);
    for index in 2..4 {
        match reader.read(index) {
            Err(Error::CorruptRecord { reason, .. }) => {
                assert!(
                    reason.contains("none of its records can be trusted"),
                    "{reason}"
                )
            }
            other => panic!("{other:?}"),
        }
    }
    // That shard alone: nothing can be read, and the refusal says why.
    let err = format::open_with(set.join("shard-000001.tar.gz"), &options).unwrap_err();
    assert!(
        matches!(&err, Error::NotADataset { reason, .. }
            if reason.contains("2 are damaged") && reason.contains("can be trusted")),
        "{err}"
    );
    // Cut short near its end: the first sample reads.
    let cut = dir.path().join("cut.tar.gz");
    fs::write(&cut, &whole[..whole.len() - 30]).unwrap();
    let dataset = format::open_with(&cut, &options).unwrap();
    let mut reader = dataset.open_reader().unwrap();
    assert_eq!(reader.read(0).unwrap().label, 0);
}
