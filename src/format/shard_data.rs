//! The bytes of one shard, wherever they live: a local file mapped at open, or an object in
//! object storage fetched into the cache directory when first needed (or ahead of need), mapped,
//! and let go once the loader has moved past it so the cache may evict it.
//!
//! Readers take an [`Arc<Mapped>`](Mapped) for each read and keep it while the record they
//! returned is in use; releasing a remote shard only drops the shard's own reference, so the
//! mapping (and the shared lock that keeps the cache from evicting the file) lasts until the
//! last reader lets go.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use memmap2::Mmap;

use crate::error::{IoContext as _, Result};
use crate::pagecache::{Prefetched, SetPrefetch};

/// A shard's bytes, mapped, with the file that keeps a cache entry held.
pub struct Mapped {
    map: Mmap,
    _file: Option<fs::File>,
    /// Read at random (a set larger than memory): see [`Mapped::ready_for`].
    at_random: AtomicBool,
}

impl Mapped {
    /// Maps `file` (opened from `path`, for messages); `hold` keeps it open (a cache entry's
    /// shared lock) as long as the mapping lives.
    pub(crate) fn new(path: &Path, file: fs::File, hold: bool) -> Result<Mapped> {
        // SAFETY: a read-only mapping of a shard or cache entry imagefeed never modifies; every
        // read is bounds-checked against the length the file had when mapped, and goes through
        // `mapguard` (a record copied out, a header touched first), so a file cut or a page
        // the disk cannot supply is an error rather than SIGBUS.
        let map = unsafe { Mmap::map(&file) }.at(path)?;
        Ok(Mapped {
            map,
            _file: hold.then_some(file),
            at_random: AtomicBool::new(false),
        })
    }

    /// Readies the map for a set's readers, once the open has read what it needs of it (a
    /// scan reads a shard in order, and gains from the read-around): advised to stream into
    /// the page cache where the set is advised to ([`SetPrefetch`]); where the set is larger
    /// than all the memory there is, marked read at random (`MADV_RANDOM`). A page fault on a
    /// map reads the disk's read-around window around the page (8 MiB on some disks): for a
    /// set the page cache cannot hold, each such read evicts what later reads need, and a
    /// record set of 407 MB in 256 MiB took 20–26 s an epoch against 2.0–2.1 s warm. At
    /// random, a fault reads only its page, and each batch's records are asked for together
    /// ahead of their reads ([`ShardData::plan_read`]).
    pub(crate) fn ready_for(&self, set: &SetPrefetch) {
        match set.plan() {
            Prefetched::Advised => self.will_need(),
            Prefetched::TooLarge => {
                if self.map.advise(memmap2::Advice::Random).is_ok() {
                    self.at_random.store(true, Ordering::Relaxed);
                }
            }
            Prefetched::InCache | Prefetched::NotRead => {}
        }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Advises the kernel that the bytes will be needed soon.
    pub(crate) fn will_need(&self) {
        let _ = self.map.advise(memmap2::Advice::WillNeed);
    }

    /// Starts reading bytes `offset..offset + len` (`MADV_WILLNEED`, which returns at once)
    /// of a map read at random ([`Mapped::ready_for`]); nothing for any other map, whose
    /// faults read around themselves, or a range not inside the map.
    fn will_need_range(&self, offset: u64, len: u64) {
        if !self.at_random.load(Ordering::Relaxed) || len == 0 {
            return;
        }
        let (Ok(offset), Ok(len)) = (usize::try_from(offset), usize::try_from(len)) else {
            return;
        };
        if offset
            .checked_add(len)
            .is_some_and(|end| end <= self.map.len())
        {
            // Advice only: failure changes nothing but speed.
            let _ = self
                .map
                .advise_range(memmap2::Advice::WillNeed, offset, len);
        }
    }
}

/// Readies every shard of a set of `total` bytes for its readers ([`ShardData::ready_for`]),
/// by what [`SetPrefetch`] plans for that size: for a set opened without reading it through
/// (one in object storage, fetched into the cache).
#[cfg(feature = "remote")]
pub(crate) fn ready_set<'a>(shards: impl IntoIterator<Item = &'a ShardData>, total: u64) {
    let set = SetPrefetch::for_total(total);
    for shard in shards {
        shard.ready_for(&set);
    }
}

/// Where a shard's bytes come from.
enum Source {
    Local(Arc<Mapped>),
    #[cfg(feature = "remote")]
    Remote(Box<RemoteSource>),
}

#[cfg(feature = "remote")]
struct RemoteSource {
    object: crate::remote::store::ObjectInfo,
    cache: crate::cache::Cache,
    /// The mapping while the shard is in use.
    resident: Mutex<Option<Arc<Mapped>>>,
    /// What the set's readers want of each mapping made ([`ShardData::ready_for`]).
    set: Mutex<Option<SetPrefetch>>,
    /// Read record by record ([`ShardData::read_range`]), never fetched whole by the planner.
    ranged: bool,
    /// What the store said once the object was found changed since it was listed
    /// ([`crate::Error::FileChanged`]): every later read of it is refused at once, without
    /// asking the store again (a hostile try saw one refused GET per record of the shard).
    changed: std::sync::OnceLock<String>,
}

#[cfg(feature = "remote")]
impl RemoteSource {
    /// [`crate::Error::FileChanged`] when a read found the object changed.
    fn refuse_if_changed(&self, name: &Path) -> Result<()> {
        match self.changed.get() {
            Some(change) => Err(crate::Error::FileChanged {
                path: name.to_path_buf(),
                change: change.clone(),
            }),
            None => Ok(()),
        }
    }

    /// `result`, remembering what a [`crate::Error::FileChanged`] said.
    fn remember_change<T>(&self, result: Result<T>) -> Result<T> {
        if let Err(crate::Error::FileChanged { change, .. }) = &result {
            let _ = self.changed.set(change.clone());
        }
        result
    }
}

/// One shard's bytes (see the module docs).
pub struct ShardData {
    /// What messages call it: the local path, or the URL.
    name: PathBuf,
    source: Source,
}

impl ShardData {
    /// A local shard, already mapped.
    pub(crate) fn local(path: &Path, mapped: Mapped) -> ShardData {
        ShardData {
            name: path.to_path_buf(),
            source: Source::Local(Arc::new(mapped)),
        }
    }

    /// A remote shard, fetched into `cache` when first needed.
    #[cfg(feature = "remote")]
    pub(crate) fn remote(
        object: crate::remote::store::ObjectInfo,
        cache: crate::cache::Cache,
    ) -> ShardData {
        ShardData {
            name: PathBuf::from(object.url.to_string()),
            source: Source::Remote(Box::new(RemoteSource {
                object,
                cache,
                resident: Mutex::new(None),
                set: Mutex::new(None),
                ranged: false,
                changed: std::sync::OnceLock::new(),
            })),
        }
    }

    /// A remote shard whose records are read one ranged GET each, the shard never fetched
    /// whole ([`OpenOptions::ranged_reads`](crate::format::OpenOptions::ranged_reads)).
    #[cfg(feature = "remote")]
    pub(crate) fn ranged(
        object: crate::remote::store::ObjectInfo,
        cache: crate::cache::Cache,
    ) -> ShardData {
        let mut data = ShardData::remote(object, cache);
        if let Source::Remote(remote) = &mut data.source {
            remote.ranged = true;
        }
        data
    }

    /// Readies the shard's map for the readers of its set ([`Mapped::ready_for`]): a local
    /// shard's now; a remote shard's (its cache entry, mapped once fetched) now if it is
    /// mapped, and each time it is mapped again.
    pub(crate) fn ready_for(&self, set: &SetPrefetch) {
        match &self.source {
            Source::Local(mapped) => mapped.ready_for(set),
            #[cfg(feature = "remote")]
            Source::Remote(remote) => {
                *remote.set.lock().expect("not poisoned") = Some(*set);
                if let Some(mapped) = remote.resident.lock().expect("not poisoned").as_ref() {
                    mapped.ready_for(set);
                }
            }
        }
    }

    /// A hint that bytes `offset..offset + len` are read soon: where the shard is mapped and
    /// read at random (a set larger than memory, [`Mapped::ready_for`]), their read starts now;
    /// nothing otherwise, and never a fetch.
    pub(crate) fn plan_read(&self, offset: u64, len: u64) {
        match &self.source {
            Source::Local(mapped) => mapped.will_need_range(offset, len),
            #[cfg(feature = "remote")]
            Source::Remote(remote) => {
                if let Some(mapped) = remote.resident.lock().expect("not poisoned").as_ref() {
                    mapped.will_need_range(offset, len);
                }
            }
        }
    }

    /// True for a shard mapped and read at random ([`Mapped::ready_for`]: its set is larger
    /// than memory).
    pub(crate) fn reads_at_random(&self) -> bool {
        self.get_if_resident()
            .is_some_and(|mapped| mapped.at_random.load(Ordering::Relaxed))
    }

    /// True for a shard read record by record (made by `ShardData::ranged`).
    pub fn is_ranged(&self) -> bool {
        match &self.source {
            Source::Local(_) => false,
            #[cfg(feature = "remote")]
            Source::Remote(remote) => remote.ranged,
        }
    }

    /// Bytes `offset..offset + len` of the shard into `out`: one ranged GET for a remote shard
    /// (checked against the listed version), a copy for a local one.
    pub(crate) fn read_range(&self, offset: u64, len: u64, out: &mut Vec<u8>) -> Result<()> {
        match &self.source {
            Source::Local(mapped) => {
                let bytes = usize::try_from(offset)
                    .ok()
                    .zip(usize::try_from(len).ok())
                    .and_then(|(start, len)| mapped.bytes().get(start..start.checked_add(len)?));
                let bytes = bytes.ok_or_else(|| crate::Error::Io {
                    path: self.name.clone(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("bytes {offset}..+{len} are past the shard's end"),
                    ),
                })?;
                crate::mapguard::copy_readable(&self.name, mapped.bytes(), bytes, out)?;
                Ok(())
            }
            #[cfg(feature = "remote")]
            Source::Remote(remote) => {
                remote.refuse_if_changed(&self.name)?;
                remote.remember_change(crate::remote::store::get_range(
                    &remote.object,
                    offset,
                    len,
                    out,
                ))
            }
        }
    }

    /// `result`, of a read of this shard started earlier ([`ShardData::start_range`]); a
    /// [`crate::Error::FileChanged`] is remembered, as [`ShardData::read_range`] remembers it.
    #[cfg(feature = "remote")]
    pub(crate) fn remember_change<T>(&self, result: Result<T>) -> Result<T> {
        match &self.source {
            Source::Remote(remote) => remote.remember_change(result),
            Source::Local(_) => result,
        }
    }

    /// A remote shard already fetched (and scanned) at open, its mapping `mapped`.
    #[cfg(feature = "remote")]
    pub(crate) fn remote_resident(
        object: crate::remote::store::ObjectInfo,
        cache: crate::cache::Cache,
        mapped: Mapped,
    ) -> ShardData {
        let data = ShardData::remote(object, cache);
        if let Source::Remote(remote) = &data.source {
            *remote.resident.lock().expect("not poisoned") = Some(Arc::new(mapped));
        }
        data
    }

    /// The object a remote shard is, when it is one.
    #[cfg(feature = "remote")]
    pub fn object(&self) -> Option<&crate::remote::store::ObjectInfo> {
        match &self.source {
            Source::Remote(remote) => Some(&remote.object),
            Source::Local(_) => None,
        }
    }

    /// The local path or URL, for messages.
    pub fn name(&self) -> &Path {
        &self.name
    }

    /// The shard's bytes, fetching a remote shard first when it is not resident (blocking).
    pub fn get(&self) -> Result<Arc<Mapped>> {
        match &self.source {
            Source::Local(mapped) => Ok(Arc::clone(mapped)),
            #[cfg(feature = "remote")]
            Source::Remote(remote) => {
                if let Some(mapped) = remote.resident.lock().expect("not poisoned").as_ref() {
                    return Ok(Arc::clone(mapped));
                }
                remote.refuse_if_changed(&self.name)?;
                // Fetched outside the lock (readers of other shards go on); the cache makes
                // concurrent fetches of one shard a single download. A full cache whose
                // entries readers still hold frees up as the loader moves on: waited for a
                // while before it is an error.
                let mut waits = 0;
                let cached = loop {
                    let fetched = crate::remote::fetch::fetch(&remote.object, &remote.cache);
                    match remote.remember_change(fetched) {
                        Err(crate::Error::CacheFull { in_use, .. })
                            if in_use > 0 && waits < 100 && crate::dataset::waits_for_room() =>
                        {
                            waits += 1;
                            std::thread::sleep(std::time::Duration::from_millis(50));
                        }
                        other => break other?,
                    }
                };
                let mapped = Mapped::new(&cached.path, cached.file, true)?;
                if let Some(set) = *remote.set.lock().expect("not poisoned") {
                    mapped.ready_for(&set);
                }
                let mapped = Arc::new(mapped);
                let mut resident = remote.resident.lock().expect("not poisoned");
                Ok(Arc::clone(resident.get_or_insert(mapped)))
            }
        }
    }

    /// How long a local shard was when mapped (`None` for a remote one, whose bytes are a
    /// cache entry of imagefeed's own).
    pub(crate) fn mapped_len(&self) -> Option<u64> {
        match &self.source {
            Source::Local(mapped) => Some(mapped.bytes().len() as u64),
            #[cfg(feature = "remote")]
            Source::Remote(_) => None,
        }
    }

    /// The bytes when they are resident (a local shard always is), without fetching.
    pub fn get_if_resident(&self) -> Option<Arc<Mapped>> {
        match &self.source {
            Source::Local(mapped) => Some(Arc::clone(mapped)),
            #[cfg(feature = "remote")]
            Source::Remote(remote) => remote
                .resident
                .lock()
                .expect("not poisoned")
                .as_ref()
                .map(Arc::clone),
        }
    }

    /// Lets go of a remote shard's mapping (readers still holding it keep it until they are
    /// done), so the cache may evict it; nothing for a local shard.
    pub fn release(&self) {
        #[cfg(feature = "remote")]
        if let Source::Remote(remote) = &self.source {
            remote.resident.lock().expect("not poisoned").take();
        }
    }

    /// Starts reading bytes `offset..offset + len` of a shard read record by record
    /// ([`ShardData::ranged`]); `None` for any other shard, or when the read cannot start (the
    /// read that needs the bytes then reads them itself, and reports what went wrong).
    #[cfg(feature = "remote")]
    pub(crate) fn start_range(
        &self,
        offset: u64,
        len: u64,
    ) -> Option<crate::remote::store::PendingRange> {
        match &self.source {
            Source::Remote(remote) if remote.ranged && remote.changed.get().is_none() => {
                crate::remote::store::start_range(&remote.object, offset, len).ok()
            }
            _ => None,
        }
    }

    /// True for a shard in object storage.
    pub fn is_remote(&self) -> bool {
        !matches!(self.source, Source::Local(_))
    }

    /// True for a shard the planner fetches whole ahead of the readers: a remote one not read
    /// record by record.
    fn fetched_whole(&self) -> bool {
        self.is_remote() && !self.is_ranged()
    }

    /// For a remote shard: its size, and the byte limit of the cache it is fetched into.
    fn cache_cost(&self) -> Option<(u64, Option<u64>)> {
        match &self.source {
            Source::Local(_) => None,
            #[cfg(feature = "remote")]
            Source::Remote(remote) if remote.ranged => None,
            #[cfg(feature = "remote")]
            Source::Remote(remote) => Some((remote.object.size, remote.cache.limit())),
        }
    }
}

/// The part of a cache's limit the planner fills ahead of the readers; the rest is room for
/// the shards readers still hold after the planner let them go (each worker holds the one it
/// reads), so a fetch the readers need never waits for the planner's own.
const PLAN_SHARE_OF_LIMIT: (u64, u64) = (3, 4);

/// The start of `plan` (shard numbers, soonest needed first) that the planner fetches ahead and
/// holds: all of it without a cache limit; under one, shards while their sizes together stay
/// within [`PLAN_SHARE_OF_LIMIT`] of it, and always the first (the batches in flight read it
/// now). A plan bigger than the cache (a shard window's two windows of large shards) would
/// otherwise fill the cache with shards needed later, and readers would wait for room that only
/// frees when the loader moves on: throughput fell to a fifth of the uncapped run's.
fn fitting_start(plan: &[usize], shards: &[Arc<ShardData>]) -> usize {
    let mut held = 0u64;
    for (i, &number) in plan.iter().enumerate() {
        let Some((size, Some(limit))) = shards.get(number).and_then(|s| s.cache_cost()) else {
            continue;
        };
        let room = limit / PLAN_SHARE_OF_LIMIT.1 * PLAN_SHARE_OF_LIMIT.0;
        held = held.saturating_add(size);
        if i > 0 && held > room {
            return i;
        }
    }
    plan.len()
}

/// The shard a per-worker reader is on: its number and mapping, kept while the record borrowed
/// from it is in use (a remote shard stays mapped, and so held in the cache), and so that reading
/// on in the same shard costs no lookup.
#[derive(Default)]
pub(crate) struct HeldShard(Option<(usize, Arc<Mapped>)>);

impl HeldShard {
    /// The bytes of shard `number`, whose data is `data`: the held mapping when it is that
    /// shard, else `data`'s (fetched first when remote and not resident), then held.
    pub(crate) fn bytes(&mut self, number: usize, data: &ShardData) -> Result<&[u8]> {
        if !matches!(&self.0, Some((held, _)) if *held == number) {
            self.0 = Some((number, data.get()?));
        }
        Ok(self.0.as_ref().expect("just set").1.bytes())
    }
}

/// Fetches a dataset's remote shards ahead of the loader and lets go of those it has moved
/// past ([`Dataset::plan_shards`](crate::dataset::Dataset::plan_shards)): a thread of its own,
/// started by the first plan (opening starts none), working on the latest plan only, with
/// a few downloads in flight (8 to 32, by shard size). It ends with the dataset.
pub struct ShardPlanner {
    shards: Arc<[Arc<ShardData>]>,
    /// The latest plan, and whether the thread runs.
    state: Arc<(Mutex<PlanState>, std::sync::Condvar)>,
}

/// Bytes the planner aims to have downloading at once: small shards are fetched many at a
/// time, so that each round trip's latency is shared by more of them.
const FETCH_BYTES_IN_FLIGHT: u64 = 64 << 20;

/// Shards the planner fetches at once: enough to have [`FETCH_BYTES_IN_FLIGHT`] under way,
/// between 8 (large shards) and 32 (small ones; CIFAR-size datasets in 2 MiB shards).
fn fetchers(shards: &[Arc<ShardData>]) -> usize {
    let sizes: Vec<u64> = shards
        .iter()
        .filter_map(|s| s.cache_cost().map(|(size, _)| size))
        .collect();
    let mean = sizes.iter().sum::<u64>() / (sizes.len() as u64).max(1);
    usize::try_from(FETCH_BYTES_IN_FLIGHT / mean.max(1))
        .unwrap_or(usize::MAX)
        .clamp(8, 32)
}

#[derive(Default)]
struct PlanState {
    plan: Option<Vec<usize>>,
    started: bool,
    closed: bool,
}

impl ShardPlanner {
    /// A planner over `shards` (by shard number); `None` when none of them is remote.
    pub fn new(shards: Vec<Arc<ShardData>>) -> Option<ShardPlanner> {
        if !shards.iter().any(|s| s.fetched_whole()) {
            return None;
        }
        Some(ShardPlanner {
            shards: shards.into(),
            state: Arc::new((Mutex::new(PlanState::default()), std::sync::Condvar::new())),
        })
    }

    /// Takes a new plan (see the type's docs); returns at once.
    pub fn plan(&self, upcoming: &[usize]) {
        let (lock, wake) = &*self.state;
        let mut state = lock.lock().expect("not poisoned");
        state.plan = Some(upcoming.to_vec());
        if !state.started {
            state.started = true;
            let shards = Arc::clone(&self.shards);
            let shared = Arc::clone(&self.state);
            let spawned = std::thread::Builder::new()
                .name("imagefeed-shards".into())
                .spawn(move || run(&shards, &shared));
            if spawned.is_err() {
                // No thread: reads fetch what they need themselves.
                state.started = false;
            }
        }
        wake.notify_one();
    }
}

impl Drop for ShardPlanner {
    fn drop(&mut self) {
        let (lock, wake) = &*self.state;
        lock.lock().expect("not poisoned").closed = true;
        wake.notify_one();
    }
}

/// The planner's thread: for each plan, cut to what fits in the cache ([`fitting_start`]),
/// release what it does not list, then fetch what it lists, in its order, a few at a time (a
/// newer plan is taken up between rounds).
fn run(shards: &[Arc<ShardData>], state: &(Mutex<PlanState>, std::sync::Condvar)) {
    let (lock, wake) = state;
    let at_once = fetchers(shards);
    loop {
        let plan = {
            let mut guard = lock.lock().expect("not poisoned");
            loop {
                if guard.closed {
                    return;
                }
                if let Some(plan) = guard.plan.take() {
                    break plan;
                }
                guard = wake.wait(guard).expect("not poisoned");
            }
        };
        let mut plan = plan;
        plan.truncate(fitting_start(&plan, shards));
        let wanted: std::collections::HashSet<usize> = plan.iter().copied().collect();
        for (number, shard) in shards.iter().enumerate() {
            if !wanted.contains(&number) {
                shard.release();
            }
        }
        let missing: Vec<usize> = plan
            .into_iter()
            .filter(|&n| {
                shards
                    .get(n)
                    .is_some_and(|s| s.fetched_whole() && s.get_if_resident().is_none())
            })
            .collect();
        // The fetchers take the plan's shards in order, each the next one as soon as it is
        // done (no round waits for its slowest shard), and stop taking more once a newer plan
        // has come.
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..at_once.min(missing.len()) {
                // Where no more threads start, fewer fetch (reads fetch what they need).
                let _ = std::thread::Builder::new().spawn_scoped(scope, || {
                    loop {
                        {
                            let guard = lock.lock().expect("not poisoned");
                            if guard.closed || guard.plan.is_some() {
                                return;
                            }
                        }
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&number) = missing.get(i) else {
                            return;
                        };
                        // A failed fetch is retried by the read that needs the shard, which
                        // reports it as a bad sample naming the shard.
                        drop(shards[number].get());
                    }
                });
            }
        });
    }
}

#[cfg(test)]
mod map_tests {
    use super::*;
    use crate::pagecache::{evict, residency};

    /// An evicted 8 MiB file of a set larger than any memory, and its shard.
    fn cold_shard(dir: &Path) -> (PathBuf, ShardData) {
        let path = dir.join("shard.bin");
        let bytes: Vec<u8> = (0..8u32 << 20).map(|i| (i % 251) as u8).collect();
        fs::write(&path, &bytes).unwrap();
        // (Eviction can miss a page another thread's LRU batch holds for a moment.)
        for _ in 0..50 {
            if evict(&path).unwrap().resident_bytes == 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(residency(&path).unwrap().resident_bytes, 0, "not evicted");
        let mapped = Mapped::new(&path, fs::File::open(&path).unwrap(), false).unwrap();
        (path.clone(), ShardData::local(&path, mapped))
    }

    #[test]
    fn a_shard_of_a_set_larger_than_memory_reads_only_the_pages_asked_for() {
        const KIB: u64 = 1 << 10;
        let dir = tempfile::tempdir().unwrap();
        let (path, data) = cold_shard(dir.path());
        data.ready_for(&SetPrefetch::for_total(u64::MAX / 2));
        assert!(data.reads_at_random());
        // A record read out of the map faults in its pages only, not the read-around window.
        let mut out = Vec::new();
        data.read_range(4096 * KIB + 100, 3000, &mut out).unwrap();
        assert_eq!(out[0], ((4096 * KIB + 100) % 251) as u8);
        let faulted = residency(&path).unwrap().resident_bytes;
        assert!(
            (4 * KIB..=8 * KIB).contains(&faulted),
            "{faulted} bytes read"
        );
        // A planned range is read in the background, and only it.
        data.plan_read(6144 * KIB, 64 * KIB);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut resident = residency(&path).unwrap().resident_bytes;
        while resident < faulted + 64 * KIB && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
            resident = residency(&path).unwrap().resident_bytes;
        }
        assert_eq!(resident, faulted + 64 * KIB);
        // Ranges outside the map, or empty, are ignored.
        data.plan_read(8 << 20, 4096);
        data.plan_read(u64::MAX - 1, 2);
        data.plan_read(0, 0);
        assert_eq!(residency(&path).unwrap().resident_bytes, resident);
    }

    #[test]
    fn a_shard_of_a_set_that_fits_is_left_to_the_read_around() {
        let dir = tempfile::tempdir().unwrap();
        let (path, data) = cold_shard(dir.path());
        // A set that fits is read through at open: its maps are left as they are.
        data.ready_for(&SetPrefetch::for_total(1 << 20));
        assert!(!data.reads_at_random());
        data.plan_read(0, 1 << 20);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(residency(&path).unwrap().resident_bytes, 0);
    }
}

#[cfg(all(test, feature = "remote"))]
mod tests {
    use super::*;
    use crate::cache::Cache;
    use crate::remote::store::ObjectInfo;
    use crate::remote::url::RemoteUrl;

    fn shards(sizes: &[u64], limit: Option<u64>) -> Vec<Arc<ShardData>> {
        let cache = Cache::at(std::env::temp_dir().join("imagefeed-plan-test"), limit);
        sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| {
                let object = ObjectInfo {
                    url: RemoteUrl::parse(&format!("s3://bucket/shard-{i}.tfrecord")).unwrap(),
                    size,
                    etag: None,
                };
                Arc::new(ShardData::remote(object, cache.clone()))
            })
            .collect()
    }

    #[test]
    fn the_planner_holds_no_more_shards_ahead_than_the_cache_fits() {
        // Found by the object storage benchmark: a shard window of 4 plans two windows and the
        // batches in flight (12 shards of 24 MiB here) while the cache held half the dataset
        // (254 MB): the planner filled it with later shards and readers waited for room.
        const MIB: u64 = 1 << 20;
        let plan: Vec<usize> = (0..12).collect();
        let capped = shards(&[24 * MIB; 12], Some(254_000_000));
        let fits = fitting_start(&plan, &capped);
        assert_eq!(fits, 7, "7 x 24 MiB fit in 3/4 of 254 MB, 8 do not");
        // No limit: the whole plan. Remote or not, a limit smaller than one shard: still the
        // first shard (the batches in flight read it now).
        assert_eq!(fitting_start(&plan, &shards(&[24 * MIB; 12], None)), 12);
        assert_eq!(fitting_start(&plan, &shards(&[24 * MIB; 12], Some(MIB))), 1);
        // The plan's order counts, not shard numbers: the soonest needed are kept.
        let reversed: Vec<usize> = (0..12).rev().collect();
        assert_eq!(fitting_start(&reversed, &capped), 7);
        assert_eq!(fitting_start(&[], &capped), 0);
    }
}
