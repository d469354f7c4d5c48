//! h5py files stored through HDF5 filters: every filter this build can undo reads with the pixels
//! and labels h5py wrote, and one it cannot is an error at open naming the filter and the remedy,
//! never a dataset whose every record is bad. Files are written at test time by h5py (and
//! hdf5plugin, when the test Python has it: `make test` installs both into .venv).
#![cfg(feature = "hdf5")]

use crate::support;

use std::path::Path;

use imagefeed::decode::RawImage;
use imagefeed::format::{self, OpenOptions};
use imagefeed::loader::{BadSamplePolicy, Loader, LoaderConfig};
use imagefeed::transform::Transform;
use support::{
    fixture_records_without_broken, python_with, records, run_python, run_python_on_fixture_files,
};

/// Writes one file per filter into argv[1]: `N x 8 x 6 x 3` uint8 pixels (value
/// `(i*7 + y*3 + x*5 + c) % 256`) and int64 labels `i % 3`, both through the filter; checks
/// h5py reads each back equal; prints `name available` for each (available: this h5py could
/// write it). Then `vlen-lzf.h5`: argv[2..] files' bytes as variable-length uint8 through lzf.
const WRITE: &str = r#"
import os, sys
import h5py, numpy as np
out = sys.argv[1]
n, h, w = 12, 6, 8
i, y, x, c = np.meshgrid(np.arange(n), np.arange(h), np.arange(w), np.arange(3), indexing="ij")
pixels = ((i * 7 + y * 3 + x * 5 + c) % 256).astype(np.uint8)
labels = (np.arange(n) % 3).astype(np.int64)
filters = {
    "gzip": dict(compression="gzip", compression_opts=9),
    "gzip-shuffle-fletcher32": dict(compression="gzip", shuffle=True, fletcher32=True),
    "lzf": dict(compression="lzf"),
    "lzf-shuffle": dict(compression="lzf", shuffle=True),
    "scaleoffset": dict(scaleoffset=0),
}
if h5py.h5z.filter_avail(h5py.h5z.FILTER_SZIP):
    filters["szip"] = dict(compression="szip")
try:
    import hdf5plugin
    filters["blosc-lz4"] = dict(hdf5plugin.Blosc(cname="lz4", clevel=5))
    filters["blosc-zstd"] = dict(hdf5plugin.Blosc(cname="zstd", clevel=5))
    filters["blosc-snappy"] = dict(hdf5plugin.Blosc(cname="snappy", clevel=5))
    filters["blosc-zlib-bitshuffle"] = dict(hdf5plugin.Blosc(cname="zlib", shuffle=hdf5plugin.Blosc.BITSHUFFLE))
    filters["bitshuffle"] = dict(hdf5plugin.Bitshuffle())
    filters["zstd"] = dict(hdf5plugin.Zstd())
    filters["lz4"] = dict(hdf5plugin.LZ4())
except ImportError:
    pass
for name, options in filters.items():
    path = os.path.join(out, name + ".h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=pixels, chunks=(4, h, w, 3), **options)
        # szip needs 32 values per block: more than the labels have.
        f.create_dataset("labels", data=labels, chunks=(4,), **({} if name == "szip" else options))
    with h5py.File(path, "r") as f:
        assert (f["images"][()] == pixels).all() and (f["labels"][()] == labels).all(), name
    print(name)
with h5py.File(os.path.join(out, "vlen-lzf.h5"), "w") as f:
    files = sys.argv[2:]
    d = f.create_dataset("images", (len(files),), dtype=h5py.vlen_dtype(np.uint8), compression="lzf", chunks=(4,))
    for k, p in enumerate(files):
        d[k] = np.frombuffer(open(p, "rb").read(), np.uint8)
    f.create_dataset("labels", data=np.array([int(a) for a in os.environ["LABELS"].split(",")]), compression="lzf")
print("vlen-lzf")
# Variable-length, chunked without a filter (an appendable dataset: maxshape None): the
# descriptors lie in chunks, the last one partly used.
with h5py.File(os.path.join(out, "vlen-chunked.h5"), "w") as f:
    files = sys.argv[2:]
    d = f.create_dataset("images", (len(files),), maxshape=(None,), chunks=(3,), dtype=h5py.vlen_dtype(np.uint8))
    for k, p in enumerate(files):
        d[k] = np.frombuffer(open(p, "rb").read(), np.uint8)
    f.create_dataset("labels", data=np.array([int(a) for a in os.environ["LABELS"].split(",")]))
print("vlen-chunked")
# Gaps: 7 elements in chunks of 2, only 0, 1 and 5 written: chunks 1 and 3 never allocated,
# element 4 in an allocated chunk but never written.
with h5py.File(os.path.join(out, "vlen-gaps.h5"), "w") as f:
    d = f.create_dataset("images", (7,), chunks=(2,), dtype=h5py.vlen_dtype(np.uint8))
    for k in (0, 1, 5):
        d[k] = np.frombuffer(open(sys.argv[2 + k], "rb").read(), np.uint8)
    f.create_dataset("labels", data=np.zeros(7, np.int64))
    assert [len(d[k]) for k in range(7)][2:5] == [0, 0, 0]
print("vlen-gaps")
# Compact (the descriptors in the object header: no file offset), read through the library.
with h5py.File(os.path.join(out, "vlen-compact.h5"), "w") as f:
    files = sys.argv[2:]
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.COMPACT)
    space = h5py.h5s.create_simple((len(files),))
    d = h5py.Dataset(h5py.h5d.create(f.id, b"images", h5py.h5t.vlen_create(h5py.h5t.NATIVE_UINT8), space, dcpl=dcpl))
    for k, p in enumerate(files):
        d[k] = np.frombuffer(open(p, "rb").read(), np.uint8)
    f.create_dataset("labels", data=np.array([int(a) for a in os.environ["LABELS"].split(",")]))
print("vlen-compact")
# Written with a 512-byte user block, which was then cut off: the superblock is at byte 0 but
# its base address field still says 512 (libhdf5 takes the superblock's position instead).
with h5py.File(os.path.join(out, "ub.h5"), "w", userblock_size=512) as f:
    files = sys.argv[2:]
    d = f.create_dataset("images", (len(files),), dtype=h5py.vlen_dtype(np.uint8))
    for k, p in enumerate(files):
        d[k] = np.frombuffer(open(p, "rb").read(), np.uint8)
    f.create_dataset("labels", data=np.array([int(a) for a in os.environ["LABELS"].split(",")]))
with open(os.path.join(out, "ub.h5"), "rb") as f:
    open(os.path.join(out, "vlen-user-block-cut.h5"), "wb").write(f.read()[512:])
print("vlen-user-block-cut")
# Appended one element per chunk, more chunks than are looked up one by one: 5,000 elements of
# 3 bytes (element i is [i % 251, 7, i // 251]).
with h5py.File(os.path.join(out, "vlen-many-chunks.h5"), "w") as f:
    n = 5000
    d = f.create_dataset("images", (n,), maxshape=(None,), chunks=(1,), dtype=h5py.vlen_dtype(np.uint8))
    for i in range(n):
        d[i] = np.array([i % 251, 7, i // 251], np.uint8)
    f.create_dataset("labels", data=np.zeros(n, np.int64))
print("vlen-many-chunks")
"#;

/// The filters hdf5plugin adds that this build has no decoder for: refused by name.
const PLUGIN_ONLY: [&str; 3] = ["bitshuffle", "zstd", "lz4"];

fn expected_pixels(i: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(6 * 8 * 3);
    for y in 0..6 {
        for x in 0..8 {
            for c in 0..3 {
                out.push(((i * 7 + y * 3 + x * 5 + c) % 256) as u8);
            }
        }
    }
    out
}

/// Writes the files; `None` (skipped, with the reason printed) without h5py.
fn write_files(dir: &Path) -> Option<Vec<String>> {
    let python = python_with("h5py, numpy")?;
    let rows = fixture_records_without_broken();
    Some(run_python_on_fixture_files(&python, WRITE, dir, &rows))
}

#[test]
fn every_filter_this_build_undoes_reads_what_h5py_wrote_and_others_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let Some(written) = write_files(dir.path()) else {
        return;
    };
    assert!(written.contains(&"lzf".to_string()), "{written:?}");
    let mut read = Vec::new();
    for name in written.iter().filter(|n| !n.starts_with("vlen-")) {
        let path = dir.path().join(format!("{name}.h5"));
        let opened = format::open(&path);
        if PLUGIN_ONLY.contains(&name.as_str()) {
            match opened {
                Err(imagefeed::Error::Unsupported {
                    path: at,
                    what,
                    remedy,
                }) => {
                    assert_eq!(at, path);
                    assert!(
                        what.contains("\"images\"") || what.contains("\"labels\""),
                        "{what}"
                    );
                    assert!(what.contains(name.as_str()), "{name}: {what}");
                    assert!(remedy.contains("HDF5_PLUGIN_PATH"), "{remedy}");
                }
                other => panic!("{name}: expected Unsupported, got {other:?}"),
            }
            continue;
        }
        let dataset = opened.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(dataset.len(), 12, "{name}");
        for (i, (_, label, payload)) in records(dataset.as_ref()).into_iter().enumerate() {
            let (w, h, pixels) = RawImage::parse(&payload).unwrap();
            assert_eq!((w, h), (8, 6), "{name}");
            assert_eq!(pixels, expected_pixels(i), "{name} sample {i}");
            assert_eq!(label, (i % 3) as u32, "{name} sample {i}");
        }
        read.push(name.clone());
    }
    // h5py's own lzf (the case that used to read as an empty epoch) and libhdf5's filters.
    for name in [
        "gzip",
        "gzip-shuffle-fletcher32",
        "lzf",
        "lzf-shuffle",
        "scaleoffset",
    ] {
        assert!(
            read.contains(&name.to_string()),
            "{name} not read: {read:?}"
        );
    }
    // Encoded images in a variable-length dataset through lzf: the files' bytes, in order.
    let vlen = format::open_with(dir.path().join("vlen-lzf.h5"), &OpenOptions::default()).unwrap();
    let want: Vec<(u32, Vec<u8>)> = fixture_records_without_broken()
        .into_iter()
        .map(|(_, label, bytes)| (label, bytes))
        .collect();
    let got: Vec<(u32, Vec<u8>)> = records(vlen.as_ref())
        .into_iter()
        .map(|(_, label, bytes)| (label, bytes))
        .collect();
    assert_eq!(got, want);
    // The loader delivers a whole epoch of it, with no bad sample.
    let loader = Loader::new(
        vlen,
        LoaderConfig::default()
            .with_batch_size(4)
            .with_transform(Transform::cifar())
            .with_bad_samples(BadSamplePolicy::Error),
    )
    .unwrap();
    let delivered: usize = loader.epoch(0).map(|b| b.unwrap().len()).sum();
    assert_eq!(delivered, want.len());

    // Chunked without a filter: the same records, read with pread from the descriptors in the
    // chunks (not through libhdf5, which would refuse a reader of the file renamed over it).
    let chunked = dir.path().join("vlen-chunked.h5");
    let vlen = format::open(&chunked).unwrap();
    std::fs::rename(dir.path().join("vlen-lzf.h5"), &chunked).unwrap();
    let got: Vec<(u32, Vec<u8>)> = records(vlen.as_ref())
        .into_iter()
        .map(|(_, label, bytes)| (label, bytes))
        .collect();
    assert_eq!(got, want);
    // A compact dataset (read through the library) and one whose superblock's base address
    // field is stale (read with pread at the superblock's position): the same records.
    for name in ["vlen-compact.h5", "vlen-user-block-cut.h5"] {
        let got: Vec<(u32, Vec<u8>)> =
            records(format::open(dir.path().join(name)).unwrap().as_ref())
                .into_iter()
                .map(|(_, label, bytes)| (label, bytes))
                .collect();
        assert_eq!(got, want, "{name}");
    }
    // One element per chunk, 5,000 chunks, no filter: each chunk's size would have to come from
    // its own index entry, which libhdf5 1.10 finds by walking the whole index, so the
    // descriptors are read through the library, which opens the path again (a file renamed
    // over it is refused).
    let many = dir.path().join("vlen-many-chunks.h5");
    let dataset = format::open(&many).unwrap();
    let mut reader = dataset.open_reader().unwrap();
    for i in [0usize, 1, 2500, 4999] {
        let record = reader.read(i).unwrap();
        assert_eq!(
            record.payload,
            [(i % 251) as u8, 7, (i / 251) as u8],
            "element {i}"
        );
    }
    drop(reader);
    std::fs::rename(dir.path().join("ub.h5"), &many).unwrap();
    assert!(matches!(
        dataset.open_reader(),
        Err(imagefeed::Error::FileChanged { .. })
    ));
    // Chunks never allocated and elements never written read as empty, as h5py reads them.
    let gaps = records(
        format::open(dir.path().join("vlen-gaps.h5"))
            .unwrap()
            .as_ref(),
    );
    let lengths: Vec<usize> = gaps.iter().map(|r| r.2.len()).collect();
    assert_eq!(lengths[2..5], [0, 0, 0]);
    assert_eq!(lengths[6], 0);
    for k in [0, 1, 5] {
        assert_eq!(gaps[k].2, want[k].1, "element {k}");
    }
}

/// The remedy the error names works: with `HDF5_PLUGIN_PATH` at hdf5plugin's plugins, libhdf5
/// loads the zstd plugin and the file reads. (`HDF5_PLUGIN_PATH` is read when libhdf5 starts,
/// so the open runs in a child: this test binary again, running [`child_opens_a_file`].)
#[test]
fn the_named_remedy_makes_a_plugin_filter_readable() {
    let Some(python) = python_with("h5py, hdf5plugin") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    write_files(dir.path()).unwrap();
    let plugins = std::process::Command::new(&python)
        .args(["-c", "import hdf5plugin; print(hdf5plugin.PLUGIN_PATH)"])
        .output()
        .unwrap();
    let plugins = String::from_utf8(plugins.stdout).unwrap();
    for (env, opens) in [(None, false), (Some(plugins.trim()), true)] {
        let mut child = support::test_alone(module_path!(), "child_opens_a_file");
        child
            .env("IMAGEFEED_TEST_OPEN", dir.path().join("zstd.h5"))
            .env_remove("HDF5_PLUGIN_PATH");
        if let Some(path) = env {
            child.env("HDF5_PLUGIN_PATH", path);
        }
        let line = opened_in_child(&mut child);
        if opens {
            assert_eq!(line, "opened: 12 samples");
        } else {
            assert!(line.contains("zstd filter"), "{line}");
        }
    }
}

/// The HDF5 settings in the environment: a value that is no number of theirs is an error
/// naming the variable (a hostile try: `IMAGEFEED_HDF5_OPEN_SECONDS=1e20` panicked at every
/// open, and "abc" or "-5" in any of them was taken silently as the default).
#[test]
fn hdf5_settings_in_the_environment_are_numbers_or_an_error_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("labels.h5");
    support::pack_as(
        &support::fixture_root(),
        &path,
        imagefeed::pack::PackFormat::Hdf5,
        &support::small_options(),
    );
    for (name, value, opens) in [
        ("IMAGEFEED_HDF5_OPEN_SECONDS", "1e20", false),
        ("IMAGEFEED_HDF5_OPEN_SECONDS", "-5", false),
        ("IMAGEFEED_HDF5_OPEN_SECONDS", "0", true),
        ("IMAGEFEED_HDF5_OPEN_SECONDS", "2.5", true),
        ("IMAGEFEED_HDF5_OPEN_MIB", "abc", false),
        ("IMAGEFEED_HDF5_OPEN_MIB", "2048", true),
        ("IMAGEFEED_HDF5_CHUNK_CACHE_MIB", "-1", false),
        ("IMAGEFEED_HDF5_CHUNK_CACHE_MIB", "", true),
    ] {
        let line = opened_in_child(
            support::test_alone(module_path!(), "child_opens_a_file")
                .env("IMAGEFEED_TEST_OPEN", &path)
                .env(name, value),
        );
        if opens {
            assert_eq!(line, "opened: 16 samples", "{name}={value}");
        } else {
            assert!(
                line.contains("invalid configuration") && line.contains(name),
                "{name}={value}: {line}"
            );
        }
    }
}

/// Runs `child` ([`child_opens_a_file`] with its environment) and returns the line it prints
/// about the open: `opened: N samples`, or `opened: ERROR`.
fn opened_in_child(child: &mut std::process::Command) -> String {
    let output = child.output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    stdout
        .lines()
        .find(|l| l.starts_with("opened:"))
        .unwrap_or_else(|| panic!("{stdout}"))
        .to_string()
}

/// Opens `IMAGEFEED_TEST_OPEN` and prints what happened (run by the tests above).
#[test]
fn child_opens_a_file() {
    let Some(path) = std::env::var_os("IMAGEFEED_TEST_OPEN") else {
        return;
    };
    match format::open(Path::new(&path)) {
        Ok(dataset) if dataset.info().payload == imagefeed::dataset::PayloadKind::Encoded => {
            println!("opened: {} samples", dataset.len());
        }
        Ok(dataset) => {
            let rows = records(dataset.as_ref());
            assert_eq!(RawImage::parse(&rows[5].2).unwrap().2, expected_pixels(5));
            println!("opened: {} samples", dataset.len());
        }
        Err(e) => println!("opened: {e}"),
    }
}

/// Writes pixel arrays whose chunks are read as stored and decoded by imagefeed (deflate, lzf,
/// shuffle, fletcher32), each beside `NAME.raw`: the array as h5py reads it. Prints each name.
const WRITE_CHUNKED: &str = r#"
import os, sys
import h5py, numpy as np
out = sys.argv[1]
rng = np.random.default_rng(7)
def save(name, data, **options):
    with h5py.File(os.path.join(out, name + ".h5"), "w") as f:
        f.create_dataset("images", data=data, **options)
        f.create_dataset("labels", data=np.arange(len(data)) % 3)
        back = f["images"][()]
    back.tofile(os.path.join(out, name + ".raw"))
    print(name)
smooth = (np.indices((13, 7, 9, 3)).sum(axis=0) * 11 % 256).astype(np.uint8)
# Chunks that split every dimension, edge chunks reaching past all of them.
save("split", smooth, chunks=(5, 4, 2, 2), compression="gzip", shuffle=True, fletcher32=True)
with h5py.File(os.path.join(out, "split.h5"), "r") as f:
    d = f["images"].id
    with open(os.path.join(out, "split.chunks"), "w") as listing:
        for k in range(d.get_num_chunks()):
            info = d.get_chunk_info(k)
            listing.write(" ".join(map(str, (*info.chunk_offset, info.byte_offset, info.size))) + "\n")
# Noise LZF cannot shrink: h5py's optional filter is skipped for those chunks (mask bit set).
save("incompressible", rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8),
     chunks=(2, 16, 16, 3), compression="lzf")
# Grey N x H x W.
save("grey", smooth[..., 0].copy(), chunks=(4, 7, 4), compression="lzf", shuffle=True)
# Chunks never written (an unfinished writer's): their rows are bad samples; rows never written
# in a written chunk read as the fill value (nothing tells them from written ones).
def unstored(name):
    with h5py.File(os.path.join(out, name + ".h5"), "r") as f:
        d = f["images"]
        rows = [r for r in range(d.shape[0])
                if d.id.get_chunk_info_by_coord((r - r % d.chunks[0],) + (0,) * (d.ndim - 1)).byte_offset is None]
    with open(os.path.join(out, name + ".unstored"), "w") as listing:
        listing.write(" ".join(map(str, rows)))
with h5py.File(os.path.join(out, "gaps.h5"), "w") as f:
    d = f.create_dataset("images", (10, 5, 4, 3), np.uint8, chunks=(3, 5, 4, 3),
                         compression="gzip", fillvalue=17)
    d[0] = 1
    d[7] = 2
    f.create_dataset("labels", data=np.zeros(10, np.int64))
    f["images"][()].tofile(os.path.join(out, "gaps.raw"))
unstored("gaps")
print("gaps")
# Fill time "never": libhdf5 leaves never-written chunks as the reader's buffer was (h5py: 0).
with h5py.File(os.path.join(out, "fill-never.h5"), "w") as f:
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_chunk((4, 5, 4, 3))
    dcpl.set_deflate(4)
    dcpl.set_fill_value(np.array(77, np.uint8))
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    space = h5py.h5s.create_simple((10, 5, 4, 3))
    h5py.h5d.create(f.id, b"images", h5py.h5t.NATIVE_UINT8, space, dcpl=dcpl)
    f["images"][0:4] = smooth[:4, :5, :4]
    f.create_dataset("labels", data=np.zeros(10, np.int64))
    f["images"][()].tofile(os.path.join(out, "fill-never.raw"))
unstored("fill-never")
print("fill-never")
# Unfiltered, more chunks than imagefeed reads itself (libhdf5 reads them): rows 0..3000 of
# 5,000 written, one chunk per row, as a writer that died at row 3,000 leaves it.
with h5py.File(os.path.join(out, "many-gaps.h5"), "w") as f:
    d = f.create_dataset("images", (5000, 2, 2, 3), np.uint8, chunks=(1, 2, 2, 3))
    d[0:3000] = (np.arange(3000 * 12) % 251).astype(np.uint8).reshape(3000, 2, 2, 3)
    f.create_dataset("labels", data=np.zeros(5000, np.int64))
    f["images"][()].tofile(os.path.join(out, "many-gaps.raw"))
unstored("many-gaps")
print("many-gaps")
# Unfiltered, half its chunks never written: the array declares more bytes than the file holds.
with h5py.File(os.path.join(out, "sparse-plain.h5"), "w") as f:
    d = f.create_dataset("images", (200, 16, 16, 3), np.uint8, chunks=(2, 16, 16, 3))
    d[0:100] = (np.arange(100 * 768) % 253).astype(np.uint8).reshape(100, 16, 16, 3)
    f.create_dataset("labels", data=np.zeros(200, np.int64))
    f["images"][()].tofile(os.path.join(out, "sparse-plain.raw"))
assert os.path.getsize(os.path.join(out, "sparse-plain.h5")) < 200 * 16 * 16 * 3
unstored("sparse-plain")
print("sparse-plain")
# Unfiltered chunks whose index entry gives the wrong size (written as is): 196 and 7 bytes
# for a 96-byte chunk. libhdf5 1.10 copies what the entry says into its reader's buffer.
for name, cut in (("plain-long", None), ("plain-short", 7)):
    with h5py.File(os.path.join(out, name + ".h5"), "w") as f:
        d = f.create_dataset("images", (8, 4, 4, 3), np.uint8, chunks=(2, 4, 4, 3))
        d[...] = smooth[:8, :4, :4]
        good = d[0:2].tobytes()
        d.id.write_direct_chunk((0, 0, 0, 0), good + b"x" * 100 if cut is None else good[:cut], 0)
        f.create_dataset("labels", data=np.zeros(8, np.int64))
    smooth[:8, :4, :4].tofile(os.path.join(out, name + ".raw"))
    print(name)
"#;

/// A directory holding what `WRITE_CHUNKED` writes; `None` (skipped, saying why) without h5py.
fn write_chunked_files() -> Option<tempfile::TempDir> {
    written_by_h5py(WRITE_CHUNKED)
}

/// A directory holding what the h5py `script` writes into `sys.argv[1]`; `None` (skipped,
/// saying why) without h5py.
fn written_by_h5py(script: &str) -> Option<tempfile::TempDir> {
    let python = python_with("h5py, numpy")?;
    let dir = tempfile::tempdir().unwrap();
    run_python(&python, script, &[dir.path()]);
    Some(dir)
}

/// Every sample of each file as h5py reads it: `(height, width, channels, bytes)`.
fn chunked_samples(dir: &Path, name: &str, shape: [usize; 4]) -> Vec<Vec<u8>> {
    let raw = std::fs::read(dir.join(format!("{name}.raw"))).unwrap();
    let [n, h, w, c] = shape;
    assert_eq!(raw.len(), n * h * w * c, "{name}");
    raw.chunks(h * w * c)
        .map(|sample| {
            // As the reader hands them out: RGB, grey replicated.
            if c == 1 {
                sample.iter().flat_map(|&g| [g, g, g]).collect()
            } else {
                sample.to_vec()
            }
        })
        .collect()
}

/// Reads every file `WRITE_CHUNKED` wrote in `dir` backwards and then forwards, each sample
/// compared with h5py's: chunk rows decoded afresh, and taken from the cache when it keeps them.
fn check_chunked_files(dir: &Path) {
    let files = [
        ("split", [13, 7, 9, 3]),
        ("incompressible", [6, 16, 16, 3]),
        ("grey", [13, 7, 9, 1]),
        ("gaps", [10, 5, 4, 3]),
        ("fill-never", [10, 5, 4, 3]),
        ("many-gaps", [5000, 2, 2, 3]),
        ("sparse-plain", [200, 16, 16, 3]),
    ];
    for (name, shape) in files {
        let want = chunked_samples(dir, name, shape);
        let dataset = format::open(dir.join(format!("{name}.h5"))).unwrap();
        assert_eq!(dataset.len(), want.len(), "{name}");
        // Rows in chunks never written (listed by h5py) are bad samples, naming the reason.
        let unstored: Vec<usize> = std::fs::read_to_string(dir.join(format!("{name}.unstored")))
            .map(|rows| {
                rows.split_whitespace()
                    .map(|r| r.parse().unwrap())
                    .collect()
            })
            .unwrap_or_default();
        if ["gaps", "fill-never", "many-gaps", "sparse-plain"].contains(&name) {
            assert!(!unstored.is_empty(), "{name}: no chunk left unwritten");
        }
        let mut reader = dataset.open_reader().unwrap();
        for i in (0..want.len()).rev().chain(0..want.len()) {
            if unstored.contains(&i) {
                match reader.read(i) {
                    Err(imagefeed::Error::CorruptRecord { index, reason, .. }) => {
                        assert_eq!(index, i);
                        assert!(reason.contains("never stored"), "{name} {i}: {reason}");
                    }
                    other => panic!("{name} sample {i}: {other:?}"),
                }
                continue;
            }
            let record = reader.read(i).unwrap();
            let (w, h, pixels) = RawImage::parse(record.payload).unwrap();
            assert_eq!((h as usize, w as usize), (shape[1], shape[2]), "{name}");
            assert_eq!(pixels, want[i], "{name} sample {i}");
        }
    }
}

#[test]
fn chunked_pixel_arrays_read_as_h5py_reads_them_in_any_order() {
    let Some(dir) = write_chunked_files() else {
        return;
    };
    // With the default cache (every row kept), then in a child with none (every chunk decoded
    // for each sample that needs it).
    check_chunked_files(dir.path());
    let output = support::test_alone(module_path!(), "child_checks_chunked_files")
        .env("IMAGEFEED_TEST_CHUNKED", dir.path())
        .env("IMAGEFEED_HDF5_CHUNK_CACHE_MIB", "0")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(stdout.contains("checked without a cache"), "{stdout}");

    // Cut short after it was opened: libhdf5 may read past the end of a file as zeros, so
    // every read through it checks the file (a read that was a black image is the file's
    // error, as LMDB and record shards say it).
    let path = dir.path().join("incompressible.h5");
    let dataset = format::open(&path).unwrap();
    let mut reader = dataset.open_reader().unwrap();
    assert!(reader.read(5).is_ok());
    // Renamed under the reader: the file it opened reads on (a hostile try met a bad sample
    // per read, "No such file", when the check looked at the path).
    let renamed = dir.path().join("renamed.h5");
    std::fs::rename(&path, &renamed).unwrap();
    assert!(reader.read(4).is_ok());
    std::fs::rename(&renamed, &path).unwrap();
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    for index in [5, 0] {
        match reader.read(index) {
            Err(imagefeed::Error::FileChanged {
                path: named,
                change,
            }) => {
                assert_eq!(named, path);
                assert!(
                    change.contains(&format!("from {len} to {}", len / 2)),
                    "{change}"
                );
            }
            other => panic!("sample {index}: {:?}", other.map(|r| r.payload.len())),
        }
    }
}

/// The child of `chunked_pixel_arrays_read_as_h5py_reads_them_in_any_order`.
#[test]
fn child_checks_chunked_files() {
    let Some(dir) = std::env::var_os("IMAGEFEED_TEST_CHUNKED") else {
        return;
    };
    check_chunked_files(Path::new(&dir));
    println!("checked without a cache");
}

#[test]
fn an_unfiltered_chunk_whose_index_gives_the_wrong_size_is_a_bad_sample() {
    // Found by a hostile try: the index entry of an unfiltered chunk gives 196 (or 7) bytes for
    // a 96-byte chunk; reading it with the nominal size made libhdf5 1.10 write past the
    // buffer (or hand out zeros). Now the chunk's two samples are bad, the rest read.
    let Some(dir) = write_chunked_files() else {
        return;
    };
    for name in ["plain-long", "plain-short"] {
        let want = chunked_samples(dir.path(), name, [8, 4, 4, 3]);
        let path = dir.path().join(format!("{name}.h5"));
        // Opens: the trial child reads these chunks with the same checked code (before the
        // fix it crashed on "plain-long", refusing the file; a file past the trial's 3 s of
        // reads would have crashed the process itself).
        let dataset = imagefeed::format::hdf5::Hdf5::open(&path).unwrap();
        let mut reader = imagefeed::Dataset::open_reader(&dataset).unwrap();
        let mut bad = Vec::new();
        for (i, want) in want.iter().enumerate() {
            match reader.read(i) {
                Ok(record) => {
                    let (_, _, pixels) = RawImage::parse(record.payload).unwrap();
                    assert_eq!(&pixels, want, "{name} sample {i} read as good but differs");
                }
                Err(imagefeed::Error::CorruptRecord { index, .. }) => bad.push(index),
                Err(other) => panic!("{name} sample {i}: {other}"),
            }
        }
        assert_eq!(bad, [0, 1], "{name}");
    }
}

#[test]
fn a_damaged_chunk_is_a_bad_sample_naming_its_record_and_the_rest_read() {
    let Some(dir) = write_chunked_files() else {
        return;
    };
    // "split" carries fletcher32 sums: damage to a chunk's stored bytes is caught there (or
    // by the inflater). One byte in the middle of one chunk of the chunk row 5..10 spoils
    // exactly the samples of that row.
    let want = chunked_samples(dir.path(), "split", [13, 7, 9, 3]);
    let mut bytes = std::fs::read(dir.path().join("split.h5")).unwrap();
    let listing = std::fs::read_to_string(dir.path().join("split.chunks")).unwrap();
    let (offset, size) = listing
        .lines()
        .map(|line| {
            line.split(' ')
                .map(|v| v.parse::<usize>().unwrap())
                .collect::<Vec<_>>()
        })
        .find(|v| v[..4] == [5, 4, 2, 0])
        .map(|v| (v[4], v[5]))
        .expect("h5py listed the chunk at (5, 4, 2, 0)");
    bytes[offset + size / 2] ^= 0x5a;
    let damaged = dir.path().join("split-damaged.h5");
    std::fs::write(&damaged, &bytes).unwrap();
    let dataset = format::open(&damaged).unwrap();
    let mut reader = dataset.open_reader().unwrap();
    let mut bad = Vec::new();
    for (i, want) in want.iter().enumerate() {
        match reader.read(i) {
            Ok(record) => {
                let (_, _, pixels) = RawImage::parse(record.payload).unwrap();
                assert_eq!(&pixels, want, "sample {i} read as good but differs");
            }
            Err(imagefeed::Error::CorruptRecord { index, key, .. }) => {
                assert_eq!(index, i);
                assert_eq!(key, format!("images[{i}]"));
                bad.push(i);
            }
            Err(other) => panic!("sample {i}: {other}"),
        }
    }
    assert_eq!(bad, (5..10).collect::<Vec<_>>());
}

#[test]
fn virtual_and_external_datasets_are_refused_saying_where_their_data_lives() {
    // Found by a hostile try: both were refused as declaring "more than the file can hold".
    let Some(dir) = written_by_h5py(
        r#"
import os, sys
import h5py, numpy as np
out = sys.argv[1]
pixels = np.zeros((4, 8, 8, 3), np.uint8)
with h5py.File(os.path.join(out, "source.h5"), "w") as f:
    f.create_dataset("images", data=pixels)
layout = h5py.VirtualLayout(shape=pixels.shape, dtype=np.uint8)
layout[...] = h5py.VirtualSource(os.path.join(out, "source.h5"), "images", shape=pixels.shape)
with h5py.File(os.path.join(out, "virtual.h5"), "w") as f:
    f.create_virtual_dataset("images", layout)
    f.create_dataset("labels", data=np.zeros(4, np.int64))
pixels.tofile(os.path.join(out, "pixels.bin"))
with h5py.File(os.path.join(out, "external.h5"), "w") as f:
    f.create_dataset("images", pixels.shape, np.uint8,
                     external=[(os.path.join(out, "pixels.bin"), 0, pixels.nbytes)])
    f.create_dataset("labels", data=np.zeros(4, np.int64))
"#,
    ) else {
        return;
    };
    for (name, says) in [
        ("virtual", "virtual dataset"),
        ("external", "external file"),
    ] {
        let path = dir.path().join(format!("{name}.h5"));
        match format::open(&path) {
            Err(imagefeed::Error::Unsupported { what, .. }) => {
                assert!(what.contains(says), "{name}: {what}")
            }
            Err(other) => panic!("{name}: expected Unsupported, got {other}"),
            Ok(d) => panic!("{name}: opened {} samples", d.len()),
        }
    }
}

#[test]
fn a_uint64_label_too_large_for_a_class_is_named_with_its_value() {
    // Found by a hostile try: 2^64 - 1 was quoted as 9223372036854775807 (libhdf5 clips it).
    let Some(dir) = written_by_h5py(
        r#"
import os, sys
import h5py, numpy as np
out = sys.argv[1]
for name, labels in (("huge", [0, 2**64 - 1]), ("fine", [0, 1])):
    with h5py.File(os.path.join(out, name + ".h5"), "w") as f:
        f.create_dataset("images", data=np.zeros((2, 4, 4, 3), np.uint8))
        f.create_dataset("labels", data=np.array(labels, np.uint64))
"#,
    ) else {
        return;
    };
    match format::open(dir.path().join("huge.h5")) {
        Err(imagefeed::Error::NotADataset { reason, .. }) => {
            assert!(reason.contains("[1] is 18446744073709551615"), "{reason}")
        }
        Err(other) => panic!("expected NotADataset, got {other}"),
        Ok(d) => panic!("opened {} samples", d.len()),
    }
    let fine = format::open(dir.path().join("fine.h5")).unwrap();
    assert_eq!(records(fine.as_ref()).len(), 2);
}
