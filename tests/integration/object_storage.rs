//! Datasets in object storage, against a real S3 server on loopback (moto): the same records,
//! batches and digests as from a local directory; packed by us, by TensorFlow, or as
//! WebDataset; shards fetched into the cache and let go behind a shard window; clear errors
//! for wrong buckets, endpoints and incomplete uploads; and fork.
#![cfg(feature = "remote")]

use crate::support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use imagefeed::Error;
use imagefeed::cache::Cache;
use imagefeed::dataset::Dataset;
use imagefeed::format::shards::ShardSetProblem;
use imagefeed::format::{self, OpenOptions};
use imagefeed::loader::{Loader, LoaderConfig};
use imagefeed::pack::{PackFormat, PackOptions};
use imagefeed::transform::Transform;
use support::s3::{S3Server, server, unique_bucket};
use support::{records, small_options};

fn reaching(server: &S3Server, dir: &Path) -> OpenOptions {
    let mut options = OpenOptions::default().with_cache(Cache::at(dir.join("cache"), None));
    for (k, v) in server.options() {
        options = options.with_storage_option(k, v);
    }
    options
}

/// 60 JPEGs packed as about 8 record shards of ours.
fn packed_records(dir: &Path) -> std::path::PathBuf {
    support::packed_small_records(dir, "local.records")
}

fn digest(dataset: Arc<dyn Dataset>, window: Option<usize>) -> String {
    digest_with(
        dataset,
        window,
        LoaderConfig::default().with_batch_size(7).with_workers(2),
    )
}

fn digest_with(dataset: Arc<dyn Dataset>, window: Option<usize>, config: LoaderConfig) -> String {
    use sha2::{Digest as _, Sha256};
    let loader = Loader::new(
        dataset,
        config
            .with_seed(5)
            .with_transform(Transform::imagenet_train(8))
            .with_shard_window(window),
    )
    .unwrap();
    let mut hash = Sha256::new();
    for batch in loader.epoch(3) {
        let batch = batch.unwrap();
        hash.update(batch.bytes());
        for l in &batch.labels {
            hash.update(l.to_le_bytes());
        }
    }
    format!("{:x}", hash.finalize())
}

#[test]
fn records_of_ours_read_from_s3_give_the_local_records_and_digests() {
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let local = packed_records(dir.path());
    let bucket = server.bucket(&unique_bucket("ours"));
    server.upload_dir(&local, &bucket, "train/v1");
    let url = format!("s3://{bucket}/train/v1");
    let options = reaching(server, dir.path());
    let remote = format::open_with(&url, &options).unwrap();
    let here = format::open(&local).unwrap();
    assert_eq!(records(remote.as_ref()), records(here.as_ref()));
    assert_eq!(remote.classes(), here.classes());
    assert_eq!(remote.shard_starts(), here.shard_starts());
    for window in [None, Some(2)] {
        assert_eq!(
            digest(Arc::clone(&remote), window),
            digest(Arc::clone(&here), window),
            "window {window:?}"
        );
    }
    // A trailing slash names the same prefix.
    let slash = format::open_with(format!("{url}/"), &options).unwrap();
    assert_eq!(slash.len(), here.len());
    // `inspect` counts the objects' bytes in storage as the files' on disk (it said 0 B): the
    // prefix's, the objects a pattern picks, one shard's.
    let picks = ["", "/shard-0000[01].tfrecord", "/shard-00002.tfrecord"];
    for pick in picks {
        let there = imagefeed::inspect::inspect_with(format!("{url}{pick}"), &options).unwrap();
        let here_path = format!("{}{pick}", local.display());
        let here = imagefeed::inspect::inspect(&here_path).unwrap();
        assert_eq!(there.num_samples, here.num_samples, "{pick:?}");
        assert!(here.file_bytes > here.payload_bytes, "{pick:?}");
        assert_eq!(there.file_bytes, here.file_bytes, "{pick:?}");
    }
}

#[test]
fn a_shard_window_keeps_the_cache_within_its_limit() {
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let local = packed_records(dir.path());
    let bucket = server.bucket(&unique_bucket("window"));
    server.upload_dir(&local, &bucket, "ds");
    let here = format::open(&local).unwrap();
    let largest = std::fs::read_dir(&local)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tfrecord"))
        .map(|e| e.metadata().unwrap().len())
        .max()
        .unwrap();
    let total: u64 = std::fs::read_dir(&local)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tfrecord"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    // Room for five shards of the eight: a global shuffle could not fit; a window of one shard
    // does (the shards of the batches in flight, two windows fetched ahead, and the shard the
    // worker reads).
    let limit = largest * 5;
    assert!(
        limit < total,
        "the limit must be below the dataset for this test to mean anything"
    );
    let mut options = reaching(server, dir.path());
    options.cache = Some(Cache::at(dir.path().join("small-cache"), Some(limit)));
    let remote = format::open_with(format!("s3://{bucket}/ds"), &options).unwrap();
    let config = || {
        LoaderConfig::default()
            .with_batch_size(3)
            .with_workers(1)
            .with_prefetch(2)
    };
    assert_eq!(
        digest_with(remote, Some(1), config()),
        digest_with(here, Some(1), config())
    );
    let cached: u64 = std::fs::read_dir(dir.path().join("small-cache/remote"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert!(
        cached <= limit,
        "{cached} bytes cached over the {limit} limit"
    );
    // A cache of two shards cannot hold the fingerprint's eight probes' shards at once: they
    // are let go as it goes, so it is the same as with room for all (a hostile try's probes
    // each waited 5 s for room, then counted as unreadable).
    let mut tiny = reaching(server, dir.path());
    tiny.cache = Some(Cache::at(dir.path().join("tiny-cache"), Some(largest * 2)));
    let cramped = format::open_with(format!("s3://{bucket}/ds"), &tiny).unwrap();
    let roomy =
        format::open_with(format!("s3://{bucket}/ds"), &reaching(server, dir.path())).unwrap();
    assert_eq!(
        imagefeed::dataset::fingerprint(cramped.as_ref()),
        imagefeed::dataset::fingerprint(roomy.as_ref())
    );
}

#[test]
fn webdataset_and_tensorflow_shards_read_from_s3_as_from_disk() {
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let bucket = server.bucket(&unique_bucket("foreign"));
    // TensorFlow's GZIP shards, read with their label base.
    let gz = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/compat/tfrecord-gzip");
    server.upload_dir(&gz, &bucket, "tf");
    let options = reaching(server, dir.path()).with_label_base(1);
    let remote = format::open_with(format!("s3://{bucket}/tf"), &options).unwrap();
    let here = format::open_with(&gz, &options).unwrap();
    assert_eq!(records(remote.as_ref()), records(here.as_ref()));
    assert_eq!(remote.classes(), ["class00"]);
    // WebDataset tars: a prefix, a pattern, a brace list.
    let wds = dir.path().join("wds");
    std::fs::create_dir(&wds).unwrap();
    let rows = support::fixture_records_without_broken();
    for shard in 0..2 {
        let mut builder = tar::Builder::new(
            std::fs::File::create(wds.join(format!("s-{shard:06}.tar"))).unwrap(),
        );
        for (i, (_, label, bytes)) in rows.iter().enumerate().filter(|(i, _)| i % 2 == shard) {
            for (field, data) in [
                ("jpg", bytes.clone()),
                ("cls", label.to_string().into_bytes()),
            ] {
                support::append_tar_member(&mut builder, format!("k{i:04}.{field}"), &data[..]);
            }
        }
        builder.finish().unwrap();
    }
    server.upload_dir(&wds, &bucket, "wds");
    let options = reaching(server, dir.path());
    let here = records(format::open(&wds).unwrap().as_ref());
    for url in [
        format!("s3://{bucket}/wds"),
        format!("s3://{bucket}/wds/s-*.tar"),
        format!("s3://{bucket}/wds/s-{{000000..000001}}.tar"),
    ] {
        let remote = format::open_with(&url, &options).unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(records(remote.as_ref()), here, "{url}");
    }
    // A brace list naming a shard that is not there.
    let err = format::open_with(
        format!("s3://{bucket}/wds/s-{{000000..000002}}.tar"),
        &options,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::ShardSet { problem: ShardSetProblem::Missing { missing, .. }, .. } if missing == &["s-000002.tar"]),
        "{err}"
    );
}

/// Mosaic MDS written by Streaming's MDSWriter (plain and zstd), read from a prefix and from
/// its index.json URL: the local records, and the same batches with a shard window.
#[test]
fn mosaic_mds_read_from_s3_as_from_disk() {
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let bucket = server.bucket(&unique_bucket("mds"));
    let compat = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/compat");
    let options = reaching(server, dir.path());
    for name in ["mds", "mds-zstd"] {
        server.upload_dir(&compat.join(name), &bucket, name);
        let here = format::open_with(compat.join(name), &options).unwrap();
        for url in [
            format!("s3://{bucket}/{name}"),
            format!("s3://{bucket}/{name}/index.json"),
        ] {
            let remote = format::open_with(&url, &options).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(remote.classes(), here.classes(), "{url}");
            assert_eq!(records(remote.as_ref()), records(here.as_ref()), "{url}");
        }
        let remote = format::open_with(format!("s3://{bucket}/{name}"), &options).unwrap();
        let config = LoaderConfig::default()
            .with_batch_size(3)
            .with_workers(2)
            .with_bad_samples(imagefeed::loader::BadSamplePolicy::Skip)
            .with_max_bad(None);
        assert_eq!(
            digest_with(remote, Some(2), config.clone()),
            digest_with(here, Some(2), config),
            "{name}"
        );
    }
    // A shard the index lists that is not in the store.
    server.delete(&bucket, "mds/shard.00002.mds");
    let err = format::open_with(format!("s3://{bucket}/mds"), &options).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::ShardSet {
                problem: ShardSetProblem::Missing { missing, count: 1, expected: 4, .. },
                ..
            } if missing == &["shard.00002.mds"]
        ),
        "{err}"
    );
    // Allowed on purpose: the other three shards read.
    let allowed = options.clone().with_allow_missing_shards(true);
    let partial = format::open_with(format!("s3://{bucket}/mds"), &allowed).unwrap();
    assert_eq!(partial.missing_shards().named, ["shard.00002.mds"]);
    assert_eq!(records(partial.as_ref()).len(), partial.len());
    assert!(!partial.is_empty());
}

#[test]
fn wrong_buckets_endpoints_and_half_uploads_fail_fast_saying_which() {
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let options = reaching(server, dir.path());
    // A bucket that does not exist.
    let started = Instant::now();
    let err = format::open_with("s3://no-such-bucket-here/x", &options).unwrap_err();
    assert!(matches!(err, Error::Remote { .. }), "{err:?}");
    assert!(
        err.to_string().contains("s3://no-such-bucket-here"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    // An endpoint nobody listens on.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let mut wrong = OpenOptions::default().with_cache(Cache::at(dir.path().join("c2"), None));
    for (k, v) in server.options() {
        let v = if k == "aws_endpoint" {
            format!("http://127.0.0.1:{closed}")
        } else {
            v
        };
        wrong = wrong.with_storage_option(k, v);
    }
    let started = Instant::now();
    let err = format::open_with("s3://any/x", &wrong).unwrap_err();
    assert!(matches!(err, Error::Remote { .. }), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    // An unknown scheme is an error, never a local directory.
    assert!(matches!(
        format::open("s4://bucket/x"),
        Err(Error::BadUrl { .. })
    ));
    assert!(!Path::new("s4:").exists());
    // An empty prefix; a prefix whose manifest names a shard that was not uploaded.
    let bucket = server.bucket(&unique_bucket("half"));
    let err = format::open_with(format!("s3://{bucket}/nothing"), &options).unwrap_err();
    assert!(
        matches!(&err, Error::NotADataset { reason, .. } if reason.contains("no object")),
        "{err}"
    );
    let local = packed_records(dir.path());
    server.upload_dir(&local, &bucket, "ds");
    let whole = format::open_with(format!("s3://{bucket}/ds"), &options)
        .unwrap()
        .len();
    server.delete(&bucket, "ds/shard-00003.tfrecord");
    let err = format::open_with(format!("s3://{bucket}/ds"), &options).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::ShardSet {
                problem: ShardSetProblem::Missing { missing, count: 1, .. },
                ..
            } if missing == &["shard-00003.tfrecord"]
        ),
        "{err}"
    );
    // Allowed on purpose, the rest reads and the dataset names what is missing.
    let allowed = options.clone().with_allow_missing_shards(true);
    let partial = format::open_with(format!("s3://{bucket}/ds"), &allowed).unwrap();
    assert_eq!(partial.missing_shards().named, ["shard-00003.tfrecord"]);
    assert!(partial.len() < whole, "{} of {whole}", partial.len());
    assert_eq!(records(partial.as_ref()).len(), partial.len());
    // A shard's index gone while the shard is there is still an error naming it.
    server.delete(&bucket, "ds/shard-00002.index");
    let err = format::open_with(format!("s3://{bucket}/ds"), &allowed).unwrap_err();
    assert!(
        matches!(&err, Error::Incomplete { reason, .. } if reason.contains("shard-00002.index")),
        "{err}"
    );
}

#[test]
fn two_sets_under_one_prefix_are_refused_and_a_pattern_picks_one() {
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let bucket = server.bucket(&unique_bucket("sets"));
    let gz = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/compat");
    server.upload_dir(&gz.join("tfrecord-gzip"), &bucket, "mixed");
    server.upload_dir(&gz.join("tfrecord-zlib"), &bucket, "mixed");
    let options = reaching(server, dir.path()).with_label_base(1);
    let err = format::open_with(format!("s3://{bucket}/mixed"), &options).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::ShardSet {
                problem: ShardSetProblem::Mixed { .. },
                ..
            }
        ),
        "{err}"
    );
    let train = format::open_with(format!("s3://{bucket}/mixed/train-*"), &options).unwrap();
    assert_eq!(train.len(), 8);
}

/// What a hostile try found in local sets holds for a prefix too: a shard cut short is
/// counted by what it lost, and a set whose numbers start past 1 is missing its first shards.
#[test]
fn a_shard_cut_short_or_a_set_missing_its_first_shards_is_refused_from_s3() {
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let bucket = server.bucket(&unique_bucket("cut"));
    let options = reaching(server, dir.path());
    let cut = dir.path().join("cut");
    std::fs::create_dir(&cut).unwrap();
    let files = crate::webdataset::rust_shards(&cut, "c", 3);
    let bytes = std::fs::read(&files[0]).unwrap();
    std::fs::write(&files[0], &bytes[..bytes.len() / 3 + 7]).unwrap();
    server.upload_dir(&cut, &bucket, "cut");
    let remote = format::open_with(format!("s3://{bucket}/cut"), &options).unwrap();
    let named: Vec<usize> = remote.shards_cut_at_end().iter().map(|(i, _)| *i).collect();
    assert_eq!(named, [0]);
    match Loader::new(remote, LoaderConfig::default()) {
        Err(Error::ShardSet {
            problem: ShardSetProblem::CutShort { shards, .. },
            ..
        }) => assert_eq!(shards, ["c-000000.tar"]),
        Err(other) => panic!("expected a cut-short error, got {other}"),
        Ok(_) => panic!("a cut set was loaded under the 1% limit"),
    }
    let late = dir.path().join("late");
    std::fs::create_dir(&late).unwrap();
    let files = crate::webdataset::rust_shards(&late, "c", 3);
    std::fs::remove_file(&files[0]).unwrap();
    std::fs::remove_file(&files[1]).unwrap();
    server.upload_dir(&late, &bucket, "late");
    let err = format::open_with(format!("s3://{bucket}/late"), &options).unwrap_err();
    assert!(
        matches!(&err, Error::ShardSet { problem: ShardSetProblem::Missing { missing, .. }, .. }
            if missing == &["c-000000.tar", "c-000001.tar"]),
        "{err}"
    );
}

/// A process that forks after reading from S3 (its runtime and connections are the
/// parent's): the child opens and reads on its own, without hanging. Runs as a child of this
/// test binary (`fork_child`), single-threaded until it forks.
#[test]
fn a_forked_child_reads_from_s3_on_its_own() {
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let local = packed_records(dir.path());
    let bucket = server.bucket(&unique_bucket("fork"));
    server.upload_dir(&local, &bucket, "ds");
    let output = support::test_alone(module_path!(), "fork_child")
        .arg("--test-threads=1")
        .env("IMAGEFEED_TEST_FORK_URL", format!("s3://{bucket}/ds"))
        .env("IMAGEFEED_TEST_ENDPOINT", &server.endpoint)
        .env("IMAGEFEED_CACHE_DIR", dir.path().join("fork-cache"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("child read 60 records"), "{stdout}");
}

#[test]
fn fork_child() {
    let Some(url) = std::env::var_os("IMAGEFEED_TEST_FORK_URL") else {
        return;
    };
    let endpoint = std::env::var("IMAGEFEED_TEST_ENDPOINT").unwrap();
    let options = OpenOptions::default()
        .with_storage_option("aws_endpoint", &endpoint)
        .with_storage_option("aws_access_key_id", "test")
        .with_storage_option("aws_secret_access_key", "test");
    let url = url.to_str().unwrap().to_string();
    // The parent reads (its runtime and connections now exist), then forks.
    let parent = format::open_with(&url, &options).unwrap();
    let count = records(parent.as_ref()).len();
    // SAFETY: the child only runs imagefeed's own code (which builds its own runtime and
    // clients after a fork) and leaves with _exit; the harness runs this test alone.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let status = std::panic::catch_unwind(|| {
            let child = format::open_with(&url, &options).unwrap();
            records(child.as_ref()).len()
        });
        let code = match status {
            Ok(n) if n == count => {
                println!("child read {n} records");
                0
            }
            _ => 1,
        };
        use std::io::Write as _;
        let _ = std::io::stdout().flush();
        // SAFETY: ends the child without running the parent's destructors or atexit handlers.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        // SAFETY: waitpid on the child just forked, non-blocking.
        let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if done == pid {
            break;
        }
        assert!(Instant::now() < deadline, "the forked child hung");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "child status {status}"
    );
    println!("child read {count} records");
}

fn pack_options(server: &S3Server, dir: &Path) -> PackOptions {
    small_options()
        .with_shard_bytes(8 * 700)
        .with_cache(Some(Cache::at(dir.join("pack-cache"), None)))
        .with_storage_options(server.options())
}

#[test]
fn packing_to_s3_uploads_a_dataset_that_reads_like_a_local_pack_and_never_overwrites() {
    use imagefeed::pack::{NoProgress, StartMode, pack_image_folder};
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let src = support::small_tree(dir.path());
    let bucket = server.bucket(&unique_bucket("pack"));
    let local = packed_records(dir.path());
    for (format, key) in [
        (PackFormat::Records, "out.records"),
        (PackFormat::Lmdb, "out.lmdb"),
    ] {
        let url = format!("s3://{bucket}/{key}");
        let summary = pack_image_folder(
            &src,
            Path::new(&url),
            format,
            &pack_options(server, dir.path()),
            &NoProgress,
        )
        .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(summary.output, Path::new(&url));
        let remote = format::open_with(&url, &reaching(server, dir.path())).unwrap();
        assert_eq!(
            records(remote.as_ref()),
            records(format::open(&local).unwrap().as_ref()),
            "{url}"
        );
        // The staging copy is gone once uploaded.
        assert!(
            std::fs::read_dir(dir.path().join("pack-cache/upload"))
                .unwrap()
                .all(|d| std::fs::read_dir(d.unwrap().path())
                    .unwrap()
                    .next()
                    .is_none()),
            "the local copy was left behind"
        );
        // Packing there again is refused, naming the URL; --force replaces.
        let again = pack_image_folder(
            &src,
            Path::new(&url),
            format,
            &pack_options(server, dir.path()),
            &NoProgress,
        );
        assert!(
            matches!(again, Err(Error::AlreadyExists { .. })),
            "{again:?}"
        );
        let forced = (pack_options(server, dir.path())).with_mode(StartMode {
            force: true,
            resume: false,
        });
        pack_image_folder(&src, Path::new(&url), format, &forced, &NoProgress).unwrap();
        // A dataset converted onto itself, or into the prefix holding it, is refused even
        // with --force (a hostile try replaced one with its 16-pixel copy), and stays whole.
        let reach = reaching(server, dir.path());
        for out in [url.clone(), format!("s3://{bucket}")] {
            let onto = imagefeed::pack::convert_with(
                Path::new(&url),
                Path::new(&out),
                format,
                &forced.clone().with_resize_short_side(Some(8)),
                &reach,
                &NoProgress,
            );
            assert!(
                matches!(onto, Err(Error::NotReplaceable { .. })),
                "{out}: {onto:?}"
            );
        }
        let remote = format::open_with(&url, &reach).unwrap();
        assert_eq!(
            records(remote.as_ref()),
            records(format::open(&local).unwrap().as_ref()),
            "{url}"
        );
    }
}

#[test]
fn keys_with_non_ascii_characters_and_percent_signs_are_used_as_written() {
    // A hostile try: a pack to `s3://b/k/uml-ü` went to the key `k/uml-%C3%BC` (object_store's
    // path encoding) and was read back from `k/uml-%25C3%25BC`; a dataset that boto3 put under
    // `daten-ü/` was "no object under this prefix".
    use imagefeed::pack::{NoProgress, pack_image_folder};
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let local = packed_records(dir.path());
    let bucket = server.bucket(&unique_bucket("keys"));
    server.upload_dir_with_boto3(&local, &bucket, "daten-ü %41");
    let here = format::open(&local).unwrap();
    let url = format!("s3://{bucket}/daten-ü %41");
    let there = format::open_with(&url, &reaching(server, dir.path())).unwrap();
    assert_eq!(records(there.as_ref()), records(here.as_ref()));
    // Packed there by imagefeed, read back by the same URL.
    let src = support::small_tree(dir.path());
    let packed = format!("s3://{bucket}/gepackt-ü%");
    pack_image_folder(
        &src,
        Path::new(&packed),
        PackFormat::Records,
        &pack_options(server, dir.path()),
        &NoProgress,
    )
    .unwrap();
    let back = format::open_with(&packed, &reaching(server, dir.path())).unwrap();
    assert_eq!(back.len(), format::open(&src).unwrap().len());
}

#[test]
fn an_upload_cut_short_never_opens_and_resume_finishes_it() {
    use imagefeed::pack::{NoProgress, StartMode, pack_image_folder};
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let src = support::small_tree(dir.path());
    let bucket = server.bucket(&unique_bucket("cut"));
    // What an upload killed after its marker and two shards leaves.
    let local = packed_records(dir.path());
    let partial = dir.path().join("partial");
    std::fs::create_dir(&partial).unwrap();
    std::fs::write(
        partial.join("progress.json"),
        br#"{"magic": "imagefeed-records", "uploading": true}"#,
    )
    .unwrap();
    for name in [
        "shard-00000.tfrecord",
        "shard-00000.index",
        "shard-00001.tfrecord",
    ] {
        std::fs::copy(local.join(name), partial.join(name)).unwrap();
    }
    server.upload_dir(&partial, &bucket, "ds");
    let url = format!("s3://{bucket}/ds");
    let err = format::open_with(&url, &reaching(server, dir.path())).unwrap_err();
    assert!(matches!(err, Error::Incomplete { .. }), "{err}");
    // So does a pattern over its shards (a hostile try read them as a whole dataset).
    let pattern = format!("{url}/shard-*");
    let err = format::open_with(&pattern, &reaching(server, dir.path())).unwrap_err();
    assert!(matches!(err, Error::Incomplete { .. }), "{err}");
    // A plain pack refuses it; --resume finishes it (only what is missing goes up).
    let plain = pack_image_folder(
        &src,
        Path::new(&url),
        PackFormat::Records,
        &pack_options(server, dir.path()),
        &NoProgress,
    );
    assert!(
        matches!(plain, Err(Error::AlreadyExists { .. })),
        "{plain:?}"
    );
    let resume = (pack_options(server, dir.path())).with_mode(StartMode {
        resume: true,
        force: false,
    });
    pack_image_folder(
        &src,
        Path::new(&url),
        PackFormat::Records,
        &resume,
        &NoProgress,
    )
    .unwrap();
    let remote = format::open_with(&url, &reaching(server, dir.path())).unwrap();
    assert_eq!(
        records(remote.as_ref()),
        records(format::open(&local).unwrap().as_ref())
    );
    // Its manifest's URL is not the dataset's (it was named by its cache file).
    let manifest = format!("{url}/{}", format::tfrecord::MANIFEST);
    assert!(matches!(
        format::open_with(&manifest, &reaching(server, dir.path())),
        Err(Error::NotADataset { reason, .. }) if reason.contains("name its prefix")
    ));
    // Finished, a pattern over its shards is checked against its manifest: one gone is named.
    assert_eq!(
        format::open_with(&pattern, &reaching(server, dir.path()))
            .unwrap()
            .len(),
        remote.len()
    );
    server.delete(&bucket, "ds/shard-00001.tfrecord");
    match format::open_with(&pattern, &reaching(server, dir.path())) {
        Err(Error::ShardSet {
            problem: ShardSetProblem::Missing { missing, .. },
            ..
        }) => assert_eq!(missing, ["shard-00001.tfrecord"]),
        Err(other) => panic!("expected the missing shard named, got {other}"),
        Ok(d) => panic!("opened {} samples with a shard gone", d.len()),
    }
}

/// Options reaching the S3 server through `proxy`, with transfers' retries bounded by
/// `retry_timeout` seconds.
fn through(
    server: &S3Server,
    proxy: &support::fault_proxy::FaultProxy,
    dir: &Path,
    cache: &str,
    retry_timeout: u64,
) -> OpenOptions {
    let mut options = OpenOptions::default().with_cache(Cache::at(dir.join(cache), None));
    for (k, v) in server.options() {
        let v = if k == "aws_endpoint" {
            proxy.endpoint.clone()
        } else {
            v
        };
        options = options.with_storage_option(k, v);
    }
    options.with_storage_option("retry_timeout", retry_timeout.to_string())
}

#[test]
fn resets_throttling_cut_bodies_and_slow_answers_are_retried_to_the_same_epoch() {
    use support::fault_proxy::{self, Fault};
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let local = packed_records(dir.path());
    let bucket = server.bucket(&unique_bucket("faults"));
    server.upload_dir(&local, &bucket, "ds");
    let here = format::open(&local).unwrap();
    // The first GET of every object (listings, manifest, indexes, shards) meets a fault, in
    // turn each kind; the next attempt goes through.
    let seen = std::sync::Mutex::new(std::collections::HashMap::<String, usize>::new());
    let kinds = std::sync::atomic::AtomicUsize::new(0);
    let proxy = fault_proxy::start(
        &server.endpoint,
        Arc::new(move |_, method, path| {
            if method != "GET" {
                return Fault::None;
            }
            let mut seen = seen.lock().unwrap();
            let attempt = seen.entry(path.to_string()).or_default();
            *attempt += 1;
            if *attempt > 1 {
                return Fault::None;
            }
            match kinds.fetch_add(1, std::sync::atomic::Ordering::SeqCst) % 5 {
                0 => Fault::SlowDown,
                1 => Fault::Reset,
                2 => Fault::Truncate,
                3 => Fault::Delay(Duration::from_millis(300)),
                _ => Fault::ServerError,
            }
        }),
    );
    let options = through(server, &proxy, dir.path(), "faulty-cache", 60);
    let remote = format::open_with(format!("s3://{bucket}/ds"), &options).unwrap();
    assert_eq!(records(remote.as_ref()), records(here.as_ref()));
    assert_eq!(digest(remote, Some(2)), digest(here, Some(2)));
    assert!(proxy.requests.load(std::sync::atomic::Ordering::SeqCst) > 10);
}

#[test]
fn a_shard_that_stays_unavailable_is_a_named_error_not_a_hang_or_a_short_epoch() {
    use support::fault_proxy::{self, Fault};
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let local = packed_records(dir.path());
    let bucket = server.bucket(&unique_bucket("dead"));
    server.upload_dir(&local, &bucket, "ds");
    // Every GET of one shard fails; opening (manifest, indexes) still works.
    let proxy = fault_proxy::start(
        &server.endpoint,
        Arc::new(|_, method, path| {
            if method == "GET" && path.contains("shard-00002.tfrecord") {
                Fault::ServerError
            } else {
                Fault::None
            }
        }),
    );
    let options = through(server, &proxy, dir.path(), "dead-cache", 3);
    let remote = format::open_with(format!("s3://{bucket}/ds"), &options).unwrap();
    let started = Instant::now();
    let loader = Loader::new(
        remote,
        LoaderConfig::default()
            .with_batch_size(5)
            .with_transform(Transform::imagenet_train(8)),
    )
    .unwrap();
    let failed = loader.epoch(0).find_map(Result::err);
    match failed {
        Some(Error::TooManyBadSamples { reason, .. }) => {
            assert!(reason.contains("shard-00002.tfrecord"), "{reason}");
        }
        other => panic!("expected TooManyBadSamples naming the shard, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_shard_replaced_after_opening_is_refused_not_read_against_the_old_index() {
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let local = packed_records(dir.path());
    let bucket = server.bucket(&unique_bucket("replaced"));
    server.upload_dir(&local, &bucket, "ds");
    let url = format!("s3://{bucket}/ds");
    let options = reaching(server, dir.path());
    let remote = format::open_with(&url, &options).unwrap();
    // Another version of one shard, the same size (so a length check cannot see it): a record
    // whose payload bytes differ.
    let shard = "shard-00002.tfrecord";
    let mut bytes = std::fs::read(local.join(shard)).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    let other = dir.path().join("other-version");
    std::fs::write(&other, &bytes).unwrap();
    server.put(&bucket, &format!("ds/{shard}"), &other);

    let mut reader = remote.open_reader().unwrap();
    let failed = (0..remote.len()).find_map(|i| reader.read(i).err());
    match failed {
        Some(Error::FileChanged { path, .. }) => {
            assert!(path.to_string_lossy().ends_with(shard), "{path:?}");
        }
        other => panic!("expected FileChanged naming the shard, got {other:?}"),
    }
    // The loader stops on it (a changed dataset is not a bad sample to skip).
    let loader = Loader::new(
        Arc::clone(&remote),
        LoaderConfig::default()
            .with_batch_size(5)
            .with_transform(Transform::imagenet_train(8)),
    );
    // (Making the loader may already read the shard, for the dataset's fingerprint.)
    let failed = match loader {
        Err(e) => Some(e),
        Ok(loader) => loader.epoch(0).find_map(Result::err),
    };
    assert!(
        matches!(failed, Some(Error::FileChanged { .. })),
        "{failed:?}"
    );
    // Opened again, the dataset reads the new version (its damaged record is a bad record,
    // the others read).
    let reopened = format::open_with(&url, &options).unwrap();
    let mut reader = reopened.open_reader().unwrap();
    let errors: Vec<Error> = (0..reopened.len())
        .filter_map(|i| reader.read(i).err())
        .collect();
    assert!(
        errors
            .iter()
            .all(|e| !matches!(e, Error::FileChanged { .. })),
        "{errors:?}"
    );
}

/// Ranged reads: each record one GET, nothing fetched whole; the same records and batches as
/// the local copy; a replaced object refused; formats whose records cannot be placed without
/// their files refused by name.
#[test]
fn ranged_reads_give_the_local_records_without_fetching_a_shard() {
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let local = packed_records(dir.path());
    let bucket = server.bucket(&unique_bucket("ranged"));
    server.upload_dir(&local, &bucket, "ds");
    let url = format!("s3://{bucket}/ds");
    let options = reaching(server, dir.path()).with_ranged_reads(true);
    let remote = format::open_with(&url, &options).unwrap();
    let here = format::open(&local).unwrap();
    assert_eq!(records(remote.as_ref()), records(here.as_ref()));
    for window in [None, Some(2)] {
        assert_eq!(
            digest(Arc::clone(&remote), window),
            digest(Arc::clone(&here), window),
            "window {window:?}"
        );
    }
    let cached_files = |cache: &Path| -> Vec<String> {
        std::fs::read_dir(cache.join("remote"))
            .map(|entries| {
                entries
                    .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .filter(|name| !name.ends_with(".lock"))
                    .collect()
            })
            .unwrap_or_default()
    };
    // Our shards named by a pattern: read through the indexes beside them (a hostile try
    // found them fetched and scanned, and ranged reads refused for want of an index).
    let picked = format::open_with(format!("{url}/shard-*"), &options).unwrap();
    assert_eq!(records(picked.as_ref()), records(here.as_ref()));
    assert_eq!(picked.info().classes, here.info().classes);
    let one = format::open_with(format!("{url}/shard-00001.tfrecord"), &options).unwrap();
    let here_one = format::open(local.join("shard-00001.tfrecord")).unwrap();
    assert_eq!(records(one.as_ref()), records(here_one.as_ref()));
    let cached = cached_files(&dir.path().join("cache"));
    assert!(
        cached.is_empty(),
        "fetched whole into the cache: {cached:?}"
    );

    // Other tools' shards with their saved indexes: read record by record too, given the
    // class count (finding it would read every record, so it is asked for).
    let tf = dir.path().join("tf-indexed");
    support::copy_tree(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/compat/tfrecord"),
        &tf,
    );
    let saved = imagefeed::format::tfrecord::Records::open_with(
        &tf,
        &imagefeed::format::tfrecord::RecordsOptions::default(),
    )
    .unwrap()
    .save_missing_indexes()
    .unwrap();
    assert!(!saved.is_empty());
    server.upload_dir(&tf, &bucket, "tf-indexed");
    let tf_url = format!("s3://{bucket}/tf-indexed");
    let foreign_cache = dir.path().join("foreign-cache");
    let mut foreign = options.clone().with_label_base(1);
    foreign.cache = Some(Cache::at(&foreign_cache, None));
    let err = format::open_with(&tf_url, &foreign).unwrap_err();
    assert!(
        matches!(&err, Error::Config(message) if message.contains("--num-classes")),
        "{err}"
    );
    let remote_tf = format::open_with(&tf_url, &foreign.clone().with_num_classes(3)).unwrap();
    let here_options = OpenOptions::default()
        .with_label_base(1)
        .with_num_classes(3);
    let here_tf = format::open_with(&tf, &here_options).unwrap();
    assert_eq!(records(remote_tf.as_ref()), records(here_tf.as_ref()));
    // The same with the indexes beside the shards, where the `tfrecord` package puts them.
    for index in &saved {
        let name = index.file_name().unwrap();
        std::fs::rename(index, tf.join(name)).unwrap();
    }
    std::fs::remove_dir(tf.join("index")).unwrap();
    server.upload_dir(&tf, &bucket, "tf-beside");
    let beside_tf = format::open_with(
        format!("s3://{bucket}/tf-beside"),
        &foreign.clone().with_num_classes(3),
    )
    .unwrap();
    assert_eq!(records(beside_tf.as_ref()), records(here_tf.as_ref()));
    let cached = cached_files(&foreign_cache);
    assert!(
        cached.is_empty(),
        "fetched whole into the cache: {cached:?}"
    );

    // Another version of a shard, the same size: its records are refused as changed.
    let shard = "shard-00001.tfrecord";
    let mut bytes = std::fs::read(local.join(shard)).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    let other = dir.path().join("other-version");
    std::fs::write(&other, &bytes).unwrap();
    server.put(&bucket, &format!("ds/{shard}"), &other);
    let mut reader = remote.open_reader().unwrap();
    let refused: Vec<usize> = (0..remote.len())
        .filter(|&i| {
            matches!(reader.read(i), Err(Error::FileChanged { path, .. })
                if path.to_string_lossy().ends_with(shard))
        })
        .collect();
    assert!(!refused.is_empty());
    // Once found changed, the shard is refused without asking the store again (one refused
    // GET per record before): with the first version put back (its ETag again), its records
    // stay refused until the dataset is opened again.
    server.put(&bucket, &format!("ds/{shard}"), &local.join(shard));
    let mut reader = remote.open_reader().unwrap();
    for &i in &refused {
        assert!(
            matches!(reader.read(i), Err(Error::FileChanged { .. })),
            "record {i}"
        );
    }
    let reopened = format::open_with(&url, &options).unwrap();
    assert_eq!(records(reopened.as_ref()), records(here.as_ref()));

    // WebDataset, MDS, an LMDB file, and TFRecord shards without their indexes: refused,
    // saying why (never fetched whole behind the user's back).
    let compat = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/compat");
    server.upload_dir(&compat.join("mds"), &bucket, "mds");
    let gz = compat.join("tfrecord-gzip");
    server.upload_dir(&gz, &bucket, "tf");
    let wds = dir.path().join("wds");
    std::fs::create_dir(&wds).unwrap();
    let mut builder = tar::Builder::new(std::fs::File::create(wds.join("s-000000.tar")).unwrap());
    support::append_tar_member(&mut builder, "k.cls", &b"0"[..]);
    builder.finish().unwrap();
    drop(builder);
    server.upload_dir(&wds, &bucket, "wds");
    let lmdb = dir.path().join("one.lmdb");
    support::pack_as(
        &dir.path().join("src"),
        &lmdb,
        PackFormat::Lmdb,
        &small_options(),
    );
    server.put(&bucket, "one.lmdb", &lmdb);
    for (name, says) in [
        ("mds", "Mosaic MDS"),
        ("mds/index.json", "Mosaic MDS"),
        ("wds", "WebDataset"),
        ("one.lmdb", "single-file"),
        ("tf", "pack-dataset index"),
    ] {
        let err = format::open_with(
            format!("s3://{bucket}/{name}"),
            &options.clone().with_label_base(1),
        )
        .err()
        .unwrap_or_else(|| panic!("{name}: opened with ranged reads"));
        assert!(
            matches!(&err, Error::Config(message) if message.contains(says) && message.contains("ranged reads")),
            "{name}: {err}"
        );
    }
}
