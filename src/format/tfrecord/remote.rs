//! Record shards in object storage (feature `remote`): ours (the manifest says what each shard
//! holds, and each shard's index gives its records, so opening reads only those small files),
//! and other tools' shards (their `index/NAME.index` when `pack-dataset index` saved one, or
//! the index beside the shard, else the shard itself, fetched and scanned at open). Shards are
//! fetched into the cache directory when first read, or ahead of need
//! ([`crate::format::shard_data`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::foreign::{assemble_foreign, report_damage, scan_decompressed};
use super::reader::{Shard, assemble_ours, drop_missing_shards, entry_records, parse_manifest};
use super::{MANIFEST, Manifest, Records, check_index_covers, parse_index, starts_with_frame};
use crate::cache::Cache;
use crate::error::Result;
use crate::format::OpenOptions;
use crate::format::compressed;
use crate::format::shard_data::{Mapped, ShardData};
use crate::format::shards::SetReport;
use crate::remote::store::{self, ObjectInfo, Patience};
use crate::remote::{RemoteUrl, fetch};

/// The most bytes a manifest or an index may have to be read into memory.
const SMALL: u64 = 256 << 20;

/// Whole shards fetched at once while opening (fetches wait on the network, not the CPU).
pub(crate) const SHARDS_AT_ONCE: usize = 8;
/// Small objects (indexes) fetched at once while opening: each is mostly a round trip.
const INDEXES_AT_ONCE: usize = 32;

/// Runs `f` on every item, `at_once` at a time, and returns the results in order.
pub(crate) fn in_parallel<T: Sync, R: Send>(
    items: &[T],
    at_once: usize,
    f: impl Fn(&T) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<Result<R>>>> =
        items.iter().map(|_| std::sync::Mutex::new(None)).collect();
    let work = || {
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some(item) = items.get(i) else { break };
            *results[i].lock().expect("not poisoned") = Some(f(item));
        }
    };
    std::thread::scope(|scope| {
        for _ in 0..at_once.min(items.len()) {
            let spawned = std::thread::Builder::new()
                .name("imagefeed-open".into())
                .spawn_scoped(scope, work);
            if spawned.is_err() {
                break;
            }
        }
        // This thread works too (and alone, where no thread could start).
        work();
    });
    results
        .into_iter()
        .map(|slot| {
            slot.into_inner()
                .expect("not poisoned")
                .expect("every item ran")
        })
        .collect()
}

/// The data of a remote shard: fetched whole when first read, or read record by record with
/// ranged GETs ([`OpenOptions::ranged_reads`]).
fn shard_data(object: &ObjectInfo, options: &OpenOptions, cache: &Cache) -> Arc<ShardData> {
    Arc::new(if options.ranged_reads {
        ShardData::ranged(object.clone(), cache.clone())
    } else {
        ShardData::remote(object.clone(), cache.clone())
    })
}

/// The manifest of ours at `dir`.
pub(crate) fn our_manifest(dir: &RemoteUrl) -> Result<Manifest> {
    let manifest_url = dir.join(MANIFEST);
    let text = store::get_small(&manifest_url, SMALL, Patience::Open)?;
    parse_manifest(
        &PathBuf::from(dir.to_string()),
        &PathBuf::from(manifest_url.to_string()),
        &text,
    )
}

/// Opens records of ours at `dir` (the manifest is `manifest`, listed in `listing`).
pub(crate) fn open_ours(
    dir: &RemoteUrl,
    listing: &[ObjectInfo],
    options: &OpenOptions,
    cache: &Cache,
) -> Result<Records> {
    let label = PathBuf::from(dir.to_string());
    let manifest_label = PathBuf::from(dir.join(MANIFEST).to_string());
    let manifest = our_manifest(dir)?;
    let in_store = |name: &str| listing.iter().any(|o| o.url.file_name() == name);
    let (manifest, dropped) =
        drop_missing_shards(&label, manifest, options.allow_missing_shards, |entry| {
            !in_store(&entry.file)
        })?;
    let find = |name: &str| -> Result<ObjectInfo> {
        listing
            .iter()
            .find(|o| o.url.file_name() == name)
            .cloned()
            .ok_or_else(|| crate::error::Error::Incomplete {
                path: label.clone(),
                reason: format!(
                    "the manifest names {name}, which is not in the store: the upload was cut \
                     short, or the shard was removed"
                ),
            })
    };
    let entries: Vec<(ObjectInfo, ObjectInfo, &super::ShardEntry)> = manifest
        .shards
        .iter()
        .map(|entry| Ok((find(&entry.file)?, find(&entry.index)?, entry)))
        .collect::<Result<_>>()?;
    let shards = in_parallel(&entries, INDEXES_AT_ONCE, |(shard, index, entry)| {
        let index_label = PathBuf::from(index.url.to_string());
        let bytes = store::get_small(&index.url, SMALL, Patience::Open)?;
        let records = entry_records(&index_label, &bytes, entry, shard.size)?;
        Ok(Shard {
            path: PathBuf::from(shard.url.to_string()),
            data: shard_data(shard, options, cache),
            records,
            damaged: Default::default(),
            cut_end: false,
            unsaved_index: false,
        })
    })?;
    let lens: Vec<u64> = entries.iter().map(|(shard, _, _)| shard.size).collect();
    // A set larger than memory is read at random from the cache (`Mapped::ready_for`).
    crate::format::shard_data::ready_set(shards.iter().map(|s| &*s.data), lens.iter().sum());
    assemble_ours(&label, &manifest_label, manifest, dropped, shards, &lens)
}

/// The index files a set of remote shards may have, looked for as a local set's are
/// ([`find_index`](super::index::find_index)).
pub(crate) struct Indexes {
    /// The objects of the shards' `index/` directory (where `pack-dataset index` saves them).
    pub saved: Vec<ObjectInfo>,
    /// The index files beside the shards (ours, the `tfrecord` package's).
    pub beside: Vec<ObjectInfo>,
}

impl Indexes {
    /// The index of the shard `object`: its saved one, else the one beside it.
    fn of(&self, object: &ObjectInfo) -> Option<&ObjectInfo> {
        let shard = object.url.file_name();
        let saved = format!("{shard}.index");
        let beside = beside_index_name(shard);
        self.saved
            .iter()
            .find(|i| i.url.file_name() == saved)
            .or_else(|| self.beside.iter().find(|i| i.url.file_name() == beside))
    }
}

/// The name of the index beside the shard named `shard`
/// ([`index_path_for`](super::index::index_path_for)).
pub(crate) fn beside_index_name(shard: &str) -> String {
    super::index::index_path_for(Path::new(shard))
        .to_string_lossy()
        .into_owned()
}

/// Opens other tools' shards `objects` (named `name`), after the set checks found `set`;
/// `indexes` are the index files found for them. Our own shards named by a pattern open here
/// too, through the indexes beside them, with `ours`, their dataset's manifest.
pub(crate) fn open_foreign(
    name: &RemoteUrl,
    objects: &[ObjectInfo],
    (set, ours): (SetReport, Option<Manifest>),
    indexes: &Indexes,
    options: &OpenOptions,
    cache: &Cache,
) -> Result<Records> {
    let label = PathBuf::from(name.to_string());
    let mut notices = set.notices(&label);
    let opened = in_parallel(objects, SHARDS_AT_ONCE, |object| {
        open_foreign_shard(object, indexes, options, cache)
    })?;
    let mut shards = Vec::with_capacity(opened.len());
    let mut scanned = 0u64;
    for (shard, scan_bytes) in opened {
        report_damage(&shard.path, &shard_damage(&shard), &mut notices);
        scanned += scan_bytes;
        shards.push(shard);
    }
    if scanned > 0 {
        crate::dataset::notice(
            &mut notices,
            format!(
                "{name}: {scanned} bytes of shards without an index were fetched and scanned to \
                 find their records (kept in the cache); `pack-dataset index {name}` saves \
                 their indexes so later opens read only those"
            ),
        );
    }
    let total = objects.iter().map(|o| o.size).sum();
    crate::format::shard_data::ready_set(shards.iter().map(|s| &*s.data), total);
    let single = match objects {
        [one] => Some(PathBuf::from(one.url.to_string())),
        _ => None,
    };
    assemble_foreign(
        &label,
        shards,
        set,
        options,
        single.as_deref(),
        ours,
        notices,
    )
}

/// The damage a scan found in `shard`, for the notices.
fn shard_damage(shard: &Shard) -> Vec<(usize, String)> {
    let mut damaged: Vec<(usize, String)> =
        shard.damaged.iter().map(|(n, r)| (*n, r.clone())).collect();
    damaged.sort();
    damaged
}

/// One shard: through its saved index when there is one, else fetched and scanned (a
/// compressed one decompressed first). Returns the bytes scanned.
fn open_foreign_shard(
    object: &ObjectInfo,
    indexes: &Indexes,
    options: &OpenOptions,
    cache: &Cache,
) -> Result<(Shard, u64)> {
    let path = PathBuf::from(object.url.to_string());
    if let Some(index) = indexes.of(object) {
        let index_label = PathBuf::from(index.url.to_string());
        let bytes = store::get_small(&index.url, SMALL, Patience::Open)?;
        let records = parse_index(&index_label, &bytes)?;
        check_index_covers(&index_label, &records, object.size)?;
        return Ok((
            Shard {
                path,
                data: shard_data(object, options, cache),
                records,
                damaged: Default::default(),
                cut_end: false,
                unsaved_index: false,
            },
            0,
        ));
    }
    if options.ranged_reads {
        let shard = object.url.file_name();
        return Err(crate::error::Error::Config(format!(
            "{}: ranged reads need the shard's index, and it has none (no index/{shard}.index, \
             no {} beside it): `pack-dataset index` saves the indexes of a set once",
            object.url,
            beside_index_name(shard)
        )));
    }
    let cached = fetch::fetch(object, cache)?;
    let (mapped, damage, compressed) = scanned_copy(&path, cached, cache)?;
    let scan = scan_decompressed(mapped.bytes(), damage);
    let len = mapped.bytes().len() as u64;
    // A compressed shard's records are found in its decompressed copy, held as a local one;
    // a plain shard stays the remote object (the planner may let it go) and its clean scan is
    // an index `pack-dataset index` can save.
    let clean = scan.damaged.is_empty() && !compressed;
    let data = if compressed {
        ShardData::local(&path, mapped)
    } else {
        ShardData::remote_resident(object.clone(), cache.clone(), mapped)
    };
    Ok((
        Shard {
            path: path.clone(),
            data: Arc::new(data),
            records: scan.records,
            damaged: scan.damaged.into_iter().collect(),
            cut_end: scan.cut_end,
            unsaved_index: clean,
        },
        len,
    ))
}

/// The mapped bytes of a fetched shard, decompressed first when it is compressed (with why its
/// stream stopped early, if it did, and whether it was compressed).
fn scanned_copy(
    path: &Path,
    cached: crate::cache::CachedFile,
    cache: &Cache,
) -> Result<(Mapped, Option<String>, bool)> {
    let mut head = [0u8; compressed::SNIFF_BYTES];
    let got = {
        use std::os::unix::fs::FileExt as _;
        cached.file.read_at(&mut head, 0).unwrap_or(0)
    };
    let head = &head[..got];
    match compressed::sniff(head, starts_with_frame, super::framing::HEADER_BYTES) {
        Some(compression) => {
            let copy = compressed::decompress(&cached.path, &cached.file, compression, cache)?;
            Ok((
                Mapped::new(path, copy.file, true)?,
                copy.damage.map(|d| d.reason),
                true,
            ))
        }
        None => Ok((Mapped::new(&cached.path, cached.file, true)?, None, false)),
    }
}
