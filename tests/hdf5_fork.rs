//! `fork()` at any moment while HDF5 files are read and opened by other threads (issue #30,
//! finding 5: a child forked while a Loader's threads were inside libhdf5 hung in its first HDF5
//! call 30-40% of the time; a PyTorch DataLoader forking its workers hung 6 times in 7).
//!
//! Two threads keep libhdf5 busy (a Loader reading a chunked, gzip-compressed h5py pixel
//! array, which goes through the library record by record, and a thread opening HDF5 files
//! over and over), while the test forks 100 times at random moments. Each child opens every
//! HDF5 layout afresh, reads every record and compares it with what the parent read before
//! the storm. A child that hangs (killed after 30 s), dies of a signal or reads anything else
//! fails the test.
#![cfg(feature = "hdf5")]

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use imagefeed::format::hdf5::{Hdf5, Hdf5Names};
use imagefeed::loader::{Loader, LoaderConfig};
use imagefeed::pack::PackFormat;
use imagefeed::transform::Transform;
use imagefeed::{Dataset, format};
use support::{Row, fixture_root, pack_as, records, small_options};

const FORKS: usize = 100;
const CHILD_LIMIT: Duration = Duration::from_secs(30);

fn compat(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/compat")
        .join(name)
}

fn pixel_names() -> Hdf5Names {
    Hdf5Names {
        images: "pixels".into(),
        labels: "targets".into(),
    }
}

/// Every HDF5 layout: ours (pread), h5py's variable-length bytes (pread from the heap), h5py's
/// chunked gzip pixels (through the library).
fn open_all(ours: &Path) -> imagefeed::Result<Vec<Arc<dyn Dataset>>> {
    Ok(vec![
        format::open(ours)?,
        format::open(compat("h5py-vlen.h5"))?,
        Arc::new(Hdf5::open_with(compat("h5py-pixels.h5"), &pixel_names())?),
    ])
}

/// Our HDF5 layout packed under `dir`, and the records of every layout as this process reads
/// them (what each child must read too).
fn packed_with_records(dir: &Path) -> (PathBuf, Vec<Vec<Row>>) {
    let ours = dir.join("ours.h5");
    pack_as(&fixture_root(), &ours, PackFormat::Hdf5, &small_options());
    let want = open_all(&ours)
        .unwrap()
        .iter()
        .map(|d| records(d.as_ref()))
        .collect();
    (ours, want)
}

/// The child's work: 0 when every record of every layout reads as the parent read it.
fn child(ours: &Path, want: &[Vec<Row>]) -> i32 {
    let Ok(datasets) = open_all(ours) else {
        return 3;
    };
    for (dataset, want) in datasets.iter().zip(want) {
        let Ok(mut reader) = dataset.open_reader() else {
            return 4;
        };
        for (i, (key, label, payload)) in want.iter().enumerate() {
            match reader.read(i) {
                Ok(r) if r.key == key && r.label == *label && r.payload == payload => {}
                _ => return 5,
            }
        }
    }
    0
}

/// Waits for `pid` up to [`CHILD_LIMIT`]; its exit code, or why it failed.
fn wait(pid: libc::pid_t) -> Result<i32, String> {
    let started = Instant::now();
    let mut status = 0;
    loop {
        // SAFETY: `pid` is this process's child; `status` is a valid out-pointer.
        let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if done == pid {
            break;
        }
        assert!(done == 0, "waitpid failed");
        if started.elapsed() > CHILD_LIMIT {
            // SAFETY: as above.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return Err(format!("hung for {} s", CHILD_LIMIT.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    if libc::WIFSIGNALED(status) {
        return Err(format!("killed by signal {}", libc::WTERMSIG(status)));
    }
    Ok(libc::WEXITSTATUS(status))
}

#[test]
fn a_child_forked_while_other_threads_are_inside_libhdf5_opens_and_reads_every_layout() {
    let dir = tempfile::tempdir().unwrap();
    let (ours, want) = packed_with_records(dir.path());

    let stop = Arc::new(AtomicBool::new(false));
    // A Loader whose workers are inside libhdf5 most of the time (decompressing chunks).
    let pixels: Arc<dyn Dataset> =
        Arc::new(Hdf5::open_with(compat("h5py-pixels.h5"), &pixel_names()).unwrap());
    let loader = Loader::new(
        pixels,
        LoaderConfig::default()
            .with_batch_size(2)
            .with_workers(2)
            .with_transform(Transform::none()),
    )
    .unwrap();
    let reading = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut epochs = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for batch in loader.epoch(epochs) {
                    batch.unwrap();
                }
                epochs += 1;
            }
            epochs
        })
    };
    // A thread opening files through the library (and forking trial children) over and over.
    let opening = {
        let stop = Arc::clone(&stop);
        let ours = ours.clone();
        std::thread::spawn(move || {
            let mut opens = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let datasets = open_all(&ours).unwrap();
                drop(datasets);
                opens += 1;
            }
            opens
        })
    };

    let mut failures = Vec::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for fork in 0..FORKS {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::thread::sleep(Duration::from_micros(rng % 3000));
        // SAFETY: the child only opens and reads datasets (allocation and libhdf5, both made
        // fork-safe), prints nothing, and leaves with `_exit`.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let code = child(&ours, &want);
            // SAFETY: leaves the child without running the parent's destructors or exit
            // handlers (the test harness's among them).
            unsafe { libc::_exit(code) };
        }
        assert!(pid > 0, "fork failed");
        match wait(pid) {
            Ok(0) => {}
            Ok(code) => failures.push(format!("fork {fork}: the child exited with {code}")),
            Err(why) => failures.push(format!("fork {fork}: the child {why}")),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let epochs = reading.join().unwrap();
    let opens = opening.join().unwrap();
    assert!(
        epochs > 0 && opens > 0,
        "the threads did no work ({epochs} epochs, {opens} opens)"
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn a_child_forked_while_other_code_holds_the_hdf5_crates_lock_opens_every_layout() {
    // Regression: code outside imagefeed that uses the `hdf5` crate directly (as these tests
    // do to write damaged files) holds the crate's lock without the gate; a child copied at
    // that moment hung in its first HDF5 call (a trial open of `format::open`, then 1 run in
    // 20 of tests/integration/formats.rs). The fork now waits for the lock, and the child gets a fresh one.
    let dir = tempfile::tempdir().unwrap();
    let (ours, want) = packed_with_records(dir.path());
    for round in 0..3 {
        let (inside, is_inside) = std::sync::mpsc::channel();
        let holder = std::thread::spawn(move || {
            hdf5::sync::sync(|| {
                inside.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(300));
            })
        });
        is_inside.recv().unwrap();
        // SAFETY: as in the test above: the child opens and reads, then leaves with `_exit`.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let code = child(&ours, &want);
            // SAFETY: as above.
            unsafe { libc::_exit(code) };
        }
        assert!(pid > 0, "fork failed");
        holder.join().unwrap();
        assert_eq!(wait(pid), Ok(0), "round {round}");
    }
}
