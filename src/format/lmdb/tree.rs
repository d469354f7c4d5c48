//! A bounds-checked walk of an LMDB file's B-trees, run before liblmdb maps a file for reading.
//!
//! liblmdb trusts the bytes that hold a file together: a node whose flags say "duplicates" sends
//! it into a sub-cursor over garbage (SIGSEGV in `mdb_xcursor_init1`), a node offset or count
//! past its page makes it read beyond the page, a child page number it takes as it is. A damaged
//! or hostile file must cost a named error instead, so every page of every database a reader
//! opens (the main database, and the named databases the reader will open) is read here first
//! with `pread` and checked: the page is what its parent says (number, kind, level), its node
//! table and every node header and key lie inside it, a branch page has two children or more,
//! keys rise within the bounds the parent gives, child and overflow page numbers lie inside the
//! file, node flags are the ones a database without duplicates uses, databases have no flags,
//! no page (branch, leaf, or a value's overflow page) is reached twice, and each database holds
//! the number of entries its record says. Any of these refuses the file, naming the page. Values
//! are not read here: every value liblmdb hands back is checked against the map before it is
//! read (`MapBounds`), and a record's checksum catches the rest, so an inline value whose size
//! runs past its page is one bad record.
//!
//! The readers' lookups of values the walk did not locate (every value of a folder2lmdb file;
//! ours past [`LOCATED_MAX_RECORDS`]) search the checked trees here too ([`TreeRoot::find`]),
//! each page copied out of the map through the SIGBUS guard first, instead of liblmdb's search,
//! which reads the pages in place: a page the disk cannot supply was SIGBUS there.
//!
//! The layout is liblmdb's on a 64-bit build (`mdb.c`): a 16-byte page header (`mp_pgno` u64,
//! `mp_pad` u16, `mp_flags` u16, `mp_lower` u16, `mp_upper` u16), then `mp_lower - 16` bytes of
//! u16 node offsets from the page's start; a node is `mn_lo` u16, `mn_hi` u16, `mn_flags` u16,
//! `mn_ksize` u16, the key, then (leaf) the data or (branch) nothing: a branch node's child page
//! number is `mn_lo | mn_hi << 16 | mn_flags << 32`, a leaf's data size `mn_lo | mn_hi << 16`.
//! A database record (`MDB_db`, 48 bytes) is `md_pad` u32, `md_flags` u16, `md_depth` u16, the
//! branch, leaf and overflow page counts and `md_entries` (u64 each), `md_root` u64.
//!
//! Cost: a bit per page of the file, and reading each branch and leaf page, at every open (a
//! second open in a process shares the first one's environment, and is checked again: its
//! pages may have left the cache or changed since). A file of at most [`READ_THROUGH_BYTES`]
//! wholly in the page cache (read through at open, or cached already) is walked in place from a
//! read-only map of it, where only the bytes checked are touched; any other is read a page at a
//! time with `pread`, as the walk needs them (its leaves may lie far apart, between values'
//! overflow pages), in the order the writer put them in the file, so that readahead serves a
//! cold one. Those leaves lie far apart in a large file (between the values' overflow pages:
//! a leaf every ~600 KiB of a 2.4 GB file of 3 KB values), each a disk read of its own, so once
//! a `pread` shows the file cold the walk asks the kernel for the next 64 pages it will visit
//! before reading them (`POSIX_FADV_WILLNEED`): they come in together, not one at a time. Cold
//! opens of that 2.4 GB file (600,000 records, ~3,850 leaves) went from 1.24–1.42 to 0.89–0.96
//! s, the walk itself to ~0.1 s.
//! (A disk error is then an error, not SIGBUS.)
//! The 10,000 CIFAR-10 test images (14 MB): 3.5 ms with `pread`, 1.2 ms in place.

use std::fs;
use std::os::unix::fs::FileExt as _;
use std::path::Path;

use crate::error::{Error, IoContext as _, Result};
use crate::pagecache::READ_THROUGH_BYTES;

const PAGE_HEADER: usize = 16;
const NODE_HEADER: usize = 8;
const DB_RECORD: usize = 48;

const P_BRANCH: u16 = 0x01;
const P_LEAF: u16 = 0x02;
/// Set on pages in memory while a write transaction holds them; harmless if found on disk.
const P_DIRTY: u16 = 0x10;

const F_BIGDATA: u16 = 0x01;
const F_SUBDATA: u16 = 0x02;

/// `md_root` of an empty database.
const NO_PAGE: u64 = u64::MAX;
/// liblmdb's cursors hold at most 32 pages (`CURSOR_STACK`).
const MAX_DEPTH: u16 = 32;

/// A database record (`MDB_db`).
#[derive(Debug, Clone, Copy)]
struct DbRecord {
    flags: u16,
    depth: u16,
    entries: u64,
    root: u64,
}

impl DbRecord {
    fn parse(bytes: &[u8]) -> DbRecord {
        DbRecord {
            flags: u16_at(bytes, 4),
            depth: u16_at(bytes, 6),
            entries: u64_at(bytes, 32),
            root: u64_at(bytes, 40),
        }
    }
}

fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// Whether key `a` sorts before key `b` in liblmdb's order (`mdb_cmp_memn`: bytes, then the
/// shorter first), which is the slices' order; two 8-byte keys (sample indices) compared as
/// big-endian numbers, the same order without a `memcmp` call.
fn key_below(a: &[u8], b: &[u8]) -> bool {
    match (<[u8; 8]>::try_from(a), <[u8; 8]>::try_from(b)) {
        (Ok(a), Ok(b)) => u64::from_be_bytes(a) < u64::from_be_bytes(b),
        _ => a < b,
    }
}

/// A `pread` of a page that takes this long came from the disk, not the page cache (a cached
/// page takes a microsecond or two).
const COLD_READ: std::time::Duration = std::time::Duration::from_micros(40);

/// How many pages ahead of the walk a cold file's reads are started ([`Walk::read_ahead`]).
const READ_AHEAD_PAGES: usize = 64;

/// Checks every branch and leaf page of the main database of the LMDB file `file` (`path` in
/// messages), `file_len` bytes long, as the live meta page describes it, and of the named
/// databases in `opened` (the ones a reader will open; others are never read, so not walked);
/// `Err` names the page and what is wrong with it.
///
/// With `locate`, also returns where the values of that database's records lie, by index,
/// when its keys are sample indices ([`super::sample_key`]) and it holds at most
/// [`LOCATED_MAX_RECORDS`]; see [`Located`].
pub(super) fn check(
    path: &Path,
    file: &fs::File,
    file_len: u64,
    opened: &[&str],
    locate: Option<&str>,
) -> Result<(Option<Located>, Roots)> {
    // Read through at open, or cached already: walked in place. (`mincore` costs a byte and a
    // look per page of the file's length: asked only of files that size allows.)
    let map = (file_len <= READ_THROUGH_BYTES)
        .then(|| {
            // SAFETY: a read-only shared map of a file imagefeed does not modify, dropped before
            // this returns; every read from it is bounds-checked against its length and goes
            // through `Pages::slice`, whose guard turns a page the disk cannot supply (or that
            // a concurrent truncation removed) into the error `pread` would give. It is walked
            // in place only where every page is in the page cache: cheaper than `pread` then.
            unsafe { memmap2::Mmap::map(file) }.ok()
        })
        .flatten()
        .filter(|map| crate::pagecache::is_resident(map));
    let pages = match &map {
        Some(map) => Pages::Mapped(map),
        None => Pages::Read(file),
    };
    let (found, roots) = check_pages(path, pages, file_len, opened, locate, false)?;
    let located = found.map(|(offsets, lens)| Located {
        file_len,
        offsets,
        lens,
    });
    Ok((located, roots))
}

/// A database's B-tree as the open's check found it: where [`TreeRoot::find`] starts.
#[derive(Debug, Clone, Copy)]
pub(super) struct TreeRoot {
    root: u64,
    depth: u16,
    page_size: usize,
}

/// The trees [`check`] walked: the main database's and each named one's it opened.
#[derive(Debug, Clone, Default)]
pub(super) struct Roots {
    pub(super) main: Option<TreeRoot>,
    pub(super) named: Vec<(Vec<u8>, TreeRoot)>,
}

impl Roots {
    /// The tree of the named database `name`, if it was walked and is not empty.
    pub(super) fn named(&self, name: &str) -> Option<TreeRoot> {
        self.named
            .iter()
            .find(|(n, _)| n.as_slice() == name.as_bytes())
            .map(|&(_, root)| root)
    }
}

/// The pages [`TreeRoot::find`] copied last, one per level of the tree, by page number: the
/// root's and the upper branch pages are the same for most searches, and are copied once.
#[derive(Debug, Default)]
pub(super) struct SearchPages {
    levels: Vec<(Option<u64>, Vec<u8>)>,
}

/// Why [`TreeRoot::find`] found no value: a page it could not read (the error for it), or a
/// page that is no longer what the open's check found (the file changed since).
#[derive(Debug)]
pub(super) enum NotFound {
    Unreadable(Error),
    Changed(String),
}

impl TreeRoot {
    /// Where the value of `key` lies in the file, `(offset, length)` (`None`: no such key),
    /// found by searching the tree in `map`, a map of the file at `path` from its first byte
    /// (its length the file's when it was checked). Each page is copied out of the map through the SIGBUS
    /// guard into `page` before it is read ([`crate::mapguard`]): a page the disk cannot supply,
    /// or one cut from the file, is an error here instead of SIGBUS in liblmdb's own search. The
    /// pages were checked at open; each is checked again as far as the search relies on it
    /// (number, kind, node table and keys inside the page), so a file changed in place since
    /// is [`NotFound::Changed`], never a read outside the page. The value's bytes are the
    /// caller's to copy out. A page copied by an earlier search with the same `pages` is not
    /// copied again (the root's and the upper branch pages are shared by most searches).
    pub(super) fn find(
        &self,
        path: &Path,
        map: &[u8],
        key: &[u8],
        pages: &mut SearchPages,
    ) -> std::result::Result<Option<(u64, usize)>, NotFound> {
        let span = (map.as_ptr() as usize, map.len() as u64);
        pages
            .levels
            .resize_with(usize::from(self.depth), Default::default);
        let changed = |why: String| NotFound::Changed(why);
        let size = self.page_size;
        let mut number = self.root;
        for level in 1..=self.depth {
            let bytes = usize::try_from(number)
                .ok()
                .and_then(|n| n.checked_mul(size))
                .and_then(|at| map.get(at..at.checked_add(size)?))
                .ok_or_else(|| changed(format!("page {number} lies past the file's end")))?;
            let at = number * size as u64;
            let (copied, page) = &mut pages.levels[usize::from(level) - 1];
            if *copied != Some(number) {
                *copied = None;
                crate::mapguard::copy_mapped(path, Some(span), bytes, page)
                    .map_err(NotFound::Unreadable)?;
                *copied = Some(number);
            }
            let page = page.as_slice();
            let leaf = level == self.depth;
            let nodes = SearchPage::new(page, number, leaf).map_err(changed)?;
            if !leaf {
                // Child i holds the keys from node i's up to node i + 1's (node 0's key is
                // unused): the child of the last node whose key is at most `key`.
                let child = match nodes.search(1, key).map_err(changed)? {
                    (i, true) => i,
                    (i, false) => i - 1,
                };
                let node = nodes.node(child).map_err(changed)?;
                number =
                    u64::from(node.lo) | u64::from(node.hi) << 16 | u64::from(node.flags) << 32;
                continue;
            }
            let (i, true) = nodes.search(0, key).map_err(changed)? else {
                return Ok(None);
            };
            let node = nodes.node(i).map_err(changed)?;
            let len = u32::from(node.lo) | u32::from(node.hi) << 16;
            let offset = match node.flags {
                0 => at + node.key.end as u64,
                F_BIGDATA => {
                    let first = page
                        .get(node.key.end..node.key.end + 8)
                        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                        .ok_or_else(|| {
                            changed(format!("node {i} of page {number} has data past the page"))
                        })?;
                    first
                        .checked_mul(size as u64)
                        .and_then(|o| o.checked_add(PAGE_HEADER as u64))
                        .ok_or_else(|| {
                            changed(format!("node {i} of page {number} names page {first}"))
                        })?
                }
                flags => {
                    return Err(changed(format!(
                        "node {i} of page {number} has flags {flags:#x}"
                    )));
                }
            };
            return Ok(Some((offset, len as usize)));
        }
        Err(changed("the tree has no leaf level".into()))
    }
}

/// A page as a search reads it: its node table, each node parsed (and checked to lie inside
/// the page) only when the search visits it.
struct SearchPage<'p> {
    page: &'p [u8],
    number: u64,
    /// The node table's end and the nodes' start.
    lower: usize,
    upper: usize,
}

impl<'p> SearchPage<'p> {
    /// `page` (page `number`, a leaf or a branch page as `leaf` says), with the checks a search
    /// relies on: its number and kind, its node table, and a branch's two children or more.
    fn new(page: &'p [u8], number: u64, leaf: bool) -> std::result::Result<Self, String> {
        if u64_at(page, 0) != number {
            return Err(format!(
                "page {number} now says it is page {}",
                u64_at(page, 0)
            ));
        }
        let flags = u16_at(page, 10) & !P_DIRTY;
        if flags != if leaf { P_LEAF } else { P_BRANCH } {
            return Err(format!("page {number} now has flags {flags:#x}"));
        }
        let (lower, upper) = (u16_at(page, 12) as usize, u16_at(page, 14) as usize);
        let least = if leaf { 1 } else { 2 };
        if lower < PAGE_HEADER + 2 * least || lower > upper || upper > page.len() {
            return Err(format!(
                "page {number} now has a node table at {PAGE_HEADER}..{lower}"
            ));
        }
        Ok(SearchPage {
            page,
            number,
            lower,
            upper,
        })
    }

    fn nodes(&self) -> usize {
        (self.lower - PAGE_HEADER) / 2
    }

    /// Node `i` (below [`nodes`](Self::nodes)), its header and key inside the page.
    fn node(&self, i: usize) -> std::result::Result<Node, String> {
        let page = self.page;
        let at = u16_at(page, PAGE_HEADER + 2 * i) as usize;
        let key_at = at + NODE_HEADER;
        let outside = || format!("node {i} of page {} now lies outside the page", self.number);
        if at < self.upper || key_at > page.len() {
            return Err(outside());
        }
        let key = key_at..key_at + u16_at(page, at + 6) as usize;
        if key.end > page.len() {
            return Err(outside());
        }
        Ok(Node {
            lo: u16_at(page, at),
            hi: u16_at(page, at + 2),
            flags: u16_at(page, at + 4),
            key,
        })
    }

    /// The first node in `from..nodes()` whose key is not below `key` (`nodes()` if none),
    /// and whether its key is `key`: a binary search, as liblmdb's (`mdb_node_search`).
    fn search(&self, from: usize, key: &[u8]) -> std::result::Result<(usize, bool), String> {
        let (mut low, mut high) = (from, self.nodes());
        while low < high {
            let middle = low + (high - low) / 2;
            let node = self.node(middle)?;
            match self.page[node.key].cmp(key) {
                std::cmp::Ordering::Less => low = middle + 1,
                std::cmp::Ordering::Equal => return Ok((middle, true)),
                std::cmp::Ordering::Greater => high = middle,
            }
        }
        Ok((low, false))
    }
}

/// The most records whose values [`check`] locates (12 bytes each: 48 MiB at the limit).
pub(super) const LOCATED_MAX_RECORDS: u64 = 1 << 22;

/// Where the values of a database keyed by sample index lie in the file, found by the walk
/// that checked its pages: a reader takes a sample's value from its environment's map at
/// that offset, without a B-tree search or a cursor (which cost a fresh reader ~1 µs a
/// sample). A value is the bytes liblmdb would return for the key: an inline value from just
/// past its key, or an overflow value from its first page's header on, of the size its node
/// gives. The sizes are as the pages hold them: a damaged one can run past the file, which
/// [`Located::location`] refuses.
pub(super) struct Located {
    file_len: u64,
    /// File offset of each index's value; 0 for an index no key names.
    offsets: Vec<u64>,
    lens: Vec<u32>,
}

impl Located {
    /// Where the value of record `index` lies, `(offset, length)`, inside the file: `None`
    /// when no key names it, `Err` when its size runs past the file.
    pub(super) fn location(
        &self,
        index: usize,
    ) -> Option<std::result::Result<(usize, usize), String>> {
        let (&offset, &len) = self.offsets.get(index).zip(self.lens.get(index))?;
        if offset == 0 {
            return None;
        }
        Some(
            offset
                .checked_add(u64::from(len))
                .filter(|&end| end <= self.file_len)
                .and_then(|_| Some((usize::try_from(offset).ok()?, len as usize)))
                .ok_or_else(|| {
                    format!(
                        "its node gives {len} bytes at offset {offset} of a {}-byte file: past \
                         the file's end (a damaged LMDB page)",
                        self.file_len
                    )
                }),
        )
    }

    /// The length of the file the offsets are in.
    pub(super) fn file_len(&self) -> u64 {
        self.file_len
    }

    /// The first and the last index with a location (to anchor the offsets to a map).
    pub(super) fn ends(&self) -> Option<(usize, usize)> {
        let first = self.offsets.iter().position(|&o| o != 0)?;
        let last = self.offsets.iter().rposition(|&o| o != 0)?;
        Some((first, last))
    }
}

/// Offsets and sizes of the located database's values, by index ([`Located`]).
type Locations = (Vec<u64>, Vec<u32>);

/// [`check`] over pages read from `pages`; with `cold`, the file taken for cold from the start
/// (its pages read ahead of the walk from the first: tests; [`check`] lets the walk find out).
fn check_pages(
    path: &Path,
    pages: Pages<'_>,
    file_len: u64,
    opened: &[&str],
    locate: Option<&str>,
    cold: bool,
) -> Result<(Option<Locations>, Roots)> {
    let mut walk = Walk::start(path, pages, file_len)?;
    walk.cold = cold;
    let main = walk.main;
    let mut named = Vec::new();
    walk.database("the main database", main, Some(&mut named))?;
    let page_size = walk.page_size;
    let root_of = |record: &DbRecord| {
        (record.root != NO_PAGE).then_some(TreeRoot {
            root: record.root,
            depth: record.depth,
            page_size,
        })
    };
    let mut roots = Roots {
        main: root_of(&main),
        named: Vec::new(),
    };
    let mut located = None;
    for (name, record) in named {
        if opened.iter().any(|o| o.as_bytes() == name.as_slice()) {
            if let Some(root) = root_of(&record) {
                roots.named.push((name.clone(), root));
            }
            let what = format!("database {:?}", String::from_utf8_lossy(&name));
            walk.locations = (locate.is_some_and(|l| l.as_bytes() == name.as_slice())
                // (A record claiming more entries than the file can hold allocates nothing.)
                && record.entries <= LOCATED_MAX_RECORDS.min(file_len / 16))
            .then(|| {
                let n = record.entries as usize;
                (vec![0; n], vec![0; n])
            });
            walk.database(&what, record, None)?;
            located = located.or(walk.locations.take());
        }
    }
    Ok((located, roots))
}

/// A page to visit: its number, its level (the root is 1), and the keys its parent allows it
/// (at least `low`, below `high`; `None`: no bound).
struct Visit {
    number: u64,
    level: u16,
    low: Option<Vec<u8>>,
    high: Option<Vec<u8>>,
    /// Already asked of the kernel ahead of its read ([`Walk::read_ahead`]).
    advised: bool,
}

/// One node of a page, as read: its flags, the two halves of its size or child page number,
/// and where its key and data lie in the page.
struct Node {
    lo: u16,
    hi: u16,
    flags: u16,
    key: std::ops::Range<usize>,
}

/// Where a walk reads pages from.
#[derive(Clone, Copy)]
enum Pages<'a> {
    /// A map of the whole file: a page is a slice of it.
    Mapped(&'a [u8]),
    /// The file: a page is read with `pread`.
    Read(&'a fs::File),
}

impl Pages<'_> {
    /// Fills `buf` from `offset`; an unexpected end of file where the file holds less.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        match self {
            Pages::Read(file) => file.read_exact_at(buf, offset),
            Pages::Mapped(map) => {
                buf.copy_from_slice(Self::slice(map, offset, buf.len())?);
                Ok(())
            }
        }
    }

    /// `map[offset..offset + len]`, or an unexpected end of file; or the I/O error `pread`
    /// would have given where a page of it cannot be read (it left the page cache since the
    /// open found it there, and the disk failed: [`crate::mapguard`]).
    fn slice(map: &[u8], offset: u64, len: usize) -> std::io::Result<&[u8]> {
        let bytes = usize::try_from(offset)
            .ok()
            .and_then(|at| map.get(at..at.checked_add(len)?))
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
        crate::mapguard::fault_in(bytes)
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EIO))?;
        Ok(bytes)
    }
}

struct Walk<'a> {
    path: &'a Path,
    pages: Pages<'a>,
    page_size: usize,
    /// The last page the live meta page uses; every page number must be at most this.
    last_page: u64,
    main: DbRecord,
    /// Pages reached so far (branch, leaf and overflow), one bit each: a page reached twice is
    /// a loop, a shared page, or two values on the same pages.
    seen: Vec<u64>,
    /// The page last read: in `buffer` (read), or at `mapped` (mapped).
    buffer: Vec<u8>,
    mapped: &'a [u8],
    /// While walking the database to locate ([`check`]): its values' offsets and sizes.
    locations: Option<Locations>,
    /// The nodes of the page last read (kept to reuse its allocation).
    nodes: Vec<Node>,
    /// Set once a `pread` of a page took as long as a disk read: from then on the pages next
    /// in the walk are asked of the kernel ahead of their reads ([`Walk::read_ahead`]).
    cold: bool,
}

impl<'a> Walk<'a> {
    /// Reads both meta pages and takes the one liblmdb takes: the later transaction.
    fn start(path: &'a Path, file: Pages<'a>, file_len: u64) -> Result<Walk<'a>> {
        let damaged = |why: String| Error::not_a_dataset(path, format!("damaged LMDB: {why}"));
        let mut meta = [0u8; super::env::META_PAGE_BYTES];
        file.read_exact_at(&mut meta, 0).at(path)?;
        let page_size = u32_at(&meta, 40) as usize;
        if !(512..=65536).contains(&page_size) || !page_size.is_power_of_two() {
            return Err(damaged(format!(
                "meta page 0 gives a page size of {page_size}"
            )));
        }
        let mut second = [0u8; super::env::META_PAGE_BYTES];
        file.read_exact_at(&mut second, page_size as u64).at(path)?;
        // liblmdb's choice (`mdb_env_pick_meta`): the later transaction, the first on a tie.
        // It then takes the page size from the page it chose: one that disagrees with the
        // first (by which the second was found) makes it address every page wrongly (SIGBUS).
        if u64_at(&second, 144) > u64_at(&meta, 144) {
            let live = u32_at(&second, 40) as usize;
            if live != page_size {
                return Err(damaged(format!(
                    "the meta pages disagree on the page size ({page_size} and {live})"
                )));
            }
            meta = second;
        }
        let last_page = u64_at(&meta, 136);
        let pages = file_len / page_size as u64;
        if last_page < 1 || last_page >= pages {
            return Err(damaged(format!(
                "the meta page's last page is {last_page} but the file holds {pages} pages"
            )));
        }
        Ok(Walk {
            path,
            pages: file,
            page_size,
            last_page,
            main: DbRecord::parse(&meta[88..88 + DB_RECORD]),
            seen: vec![0; (last_page as usize + 1).div_ceil(64)],
            buffer: match file {
                Pages::Read(_) => vec![0; page_size],
                Pages::Mapped(_) => Vec::new(),
            },
            mapped: &[],
            locations: None,
            nodes: Vec::new(),
            cold: false,
        })
    }

    fn damaged(&self, why: String) -> Error {
        Error::not_a_dataset(self.path, format!("damaged LMDB: {why}"))
    }

    /// Marks page `number` reached; `Err` when it was already.
    fn mark(&mut self, what: &str, number: u64, by: &str) -> Result<()> {
        let (word, bit) = ((number / 64) as usize, number % 64);
        if self.seen[word] & (1 << bit) != 0 {
            return Err(self.damaged(format!("{what} reaches page {number} twice ({by})")));
        }
        self.seen[word] |= 1 << bit;
        Ok(())
    }

    /// Walks one database's tree; `named` (main database only) collects the records of the
    /// named databases it lists.
    fn database(
        &mut self,
        what: &str,
        db: DbRecord,
        mut named: Option<&mut Vec<(Vec<u8>, DbRecord)>>,
    ) -> Result<()> {
        // No flag at all: duplicates (sorted, fixed-size, integer, reverse), integer or
        // reverse keys change how liblmdb reads a database, and none of the files we read
        // uses them; unknown bits make it refuse every read.
        if db.flags != 0 {
            return Err(self.damaged(format!(
                "{what} has flags {:#x}; no dataset's database has any",
                db.flags
            )));
        }
        if db.root == NO_PAGE {
            if db.entries != 0 || db.depth != 0 {
                return Err(self.damaged(format!(
                    "{what} has no root page but says it holds {} entries at depth {}",
                    db.entries, db.depth
                )));
            }
            return Ok(());
        }
        if db.depth == 0 || db.depth > MAX_DEPTH {
            return Err(self.damaged(format!("{what} has a depth of {}", db.depth)));
        }
        let mut entries = 0u64;
        let mut stack = vec![Visit {
            number: db.root,
            level: 1,
            low: None,
            high: None,
            advised: false,
        }];
        let mut nodes = std::mem::take(&mut self.nodes);
        // Each page's read may show the file cold; the pages next in line are then asked for
        // before the next is read.
        loop {
            self.read_ahead(&mut stack);
            let Some(visit) = stack.pop() else {
                break;
            };
            let number = visit.number;
            let leaf = visit.level == db.depth;
            self.read_page(what, &visit, leaf, db.depth, &mut nodes)?;
            if !leaf {
                // Child i holds the keys from node i's key (the parent's bound for node 0,
                // whose key liblmdb leaves empty) up to node i + 1's. Pushed last to first, so
                // that the walk visits the leaves in key order: the order a dataset's writer
                // put them in the file, which the kernel's readahead follows on a cold file
                // (backwards, each page was a read of its own: 1.5 s for an 84 MB file).
                for (i, node) in nodes.iter().enumerate().rev() {
                    let child =
                        u64::from(node.lo) | u64::from(node.hi) << 16 | u64::from(node.flags) << 32;
                    let low = if i == 0 {
                        visit.low.clone()
                    } else {
                        Some(self.page()[node.key.clone()].to_vec())
                    };
                    let high = match nodes.get(i + 1) {
                        Some(next) => Some(self.page()[next.key.clone()].to_vec()),
                        None => visit.high.clone(),
                    };
                    stack.push(Visit {
                        number: child,
                        level: visit.level + 1,
                        low,
                        high,
                        advised: false,
                    });
                }
                continue;
            }
            entries += nodes.len() as u64;
            let overflow = self.leaf_values(what, number, &nodes, named.as_deref_mut())?;
            self.locate(number, &nodes);
            // Each value's pages belong to it alone: a flipped page number that lands on
            // another value's run (or on a branch or leaf page) would hand out other bytes.
            for (i, first, pages) in overflow {
                for page in first..first + pages {
                    self.mark(
                        what,
                        page,
                        &format!("the value of node {i} of page {number}"),
                    )?;
                }
            }
        }
        self.nodes = nodes;
        if entries != db.entries {
            return Err(self.damaged(format!(
                "{what} holds {entries} entries but its record says {}",
                db.entries
            )));
        }
        Ok(())
    }

    /// Checks the values of leaf page `number`'s `nodes`: inline, on overflow pages (returned as
    /// `(node, first page, pages)` for the caller to claim), or (main database only, `named`)
    /// the record of a named database, collected.
    fn leaf_values(
        &self,
        what: &str,
        number: u64,
        nodes: &[Node],
        mut named: Option<&mut Vec<(Vec<u8>, DbRecord)>>,
    ) -> Result<Vec<(usize, u64, u64)>> {
        let page = self.page();
        let mut overflow = Vec::new();
        for (i, node) in nodes.iter().enumerate() {
            let size = u64::from(node.lo) | u64::from(node.hi) << 16;
            let data_at = node.key.end;
            match node.flags {
                // An inline value whose size runs past the page is left to the reads:
                // liblmdb only computes its slice, which is checked against the map before
                // anything reads it, and the record's checksum then fails. One damaged
                // record is a bad record, not a dataset refused.
                0 => {}
                F_BIGDATA => {
                    if data_at + 8 > self.page_size {
                        return Err(self.node_error(what, number, i, "has data past the page"));
                    }
                    let first = u64_at(page, data_at);
                    let pages = (size + PAGE_HEADER as u64).div_ceil(self.page_size as u64);
                    if size == 0
                        || first < 2
                        || first
                            .checked_add(pages - 1)
                            .is_none_or(|last| last > self.last_page)
                    {
                        return Err(self.node_error(
                            what,
                            number,
                            i,
                            &format!(
                                "puts {size} bytes on {pages} overflow pages from page \
                                 {first}, past the file's {} pages",
                                self.last_page + 1
                            ),
                        ));
                    }
                    overflow.push((i, first, pages));
                }
                F_SUBDATA => {
                    let Some(named) = named.as_deref_mut() else {
                        return Err(self.node_error(
                            what,
                            number,
                            i,
                            "names a database inside a named database",
                        ));
                    };
                    if size != DB_RECORD as u64 || data_at + DB_RECORD > self.page_size {
                        return Err(self.node_error(
                            what,
                            number,
                            i,
                            "names a database with a record of the wrong size",
                        ));
                    }
                    let record = DbRecord::parse(&page[data_at..data_at + DB_RECORD]);
                    named.push((page[node.key.clone()].to_vec(), record));
                }
                other => {
                    return Err(self.node_error(
                        what,
                        number,
                        i,
                        &format!("has flags {other:#x} (duplicates or unknown)"),
                    ));
                }
            }
        }
        Ok(overflow)
    }

    /// Reads the page `visit` names into `self.page` (once per walk) and checks it: its
    /// number, its kind (`leaf` or branch, at a level of `depth`), its node table, each node's
    /// header and key inside it, its keys in increasing order within the bounds its parent
    /// gives, and at least two children on a branch page. Returns its nodes.
    fn read_page(
        &mut self,
        what: &str,
        visit: &Visit,
        leaf: bool,
        depth: u16,
        nodes: &mut Vec<Node>,
    ) -> Result<()> {
        let number = visit.number;
        if number < 2 || number > self.last_page {
            return Err(self.damaged(format!(
                "{what} refers to page {number}, outside pages 2..={}",
                self.last_page
            )));
        }
        self.mark(what, number, "as a branch or leaf page")?;
        let at = number * self.page_size as u64;
        // An I/O error names the page, as damage does.
        let reading = |e: std::io::Error| {
            std::io::Error::new(e.kind(), format!("reading page {number} at byte {at}: {e}"))
        };
        match self.pages {
            Pages::Read(file) => {
                let started = std::time::Instant::now();
                file.read_exact_at(&mut self.buffer, at)
                    .map_err(reading)
                    .at(self.path)?;
                self.cold |= started.elapsed() >= COLD_READ;
            }
            Pages::Mapped(map) => {
                self.mapped = Pages::slice(map, at, self.page_size)
                    .map_err(reading)
                    .at(self.path)?;
            }
        }
        let page = self.page();
        let recorded = u64_at(page, 0);
        if recorded != number {
            return Err(self.damaged(format!(
                "page {number} of {what} says it is page {recorded}"
            )));
        }
        let flags = u16_at(page, 10) & !P_DIRTY;
        let expected = if leaf { P_LEAF } else { P_BRANCH };
        if flags != expected {
            return Err(self.damaged(format!(
                "page {number} of {what} has flags {flags:#x}: a {} page at level {} of {depth} \
                 was expected",
                if leaf { "leaf" } else { "branch" },
                visit.level,
            )));
        }
        let (lower, upper) = (u16_at(page, 12) as usize, u16_at(page, 14) as usize);
        // liblmdb asserts (debug builds abort) that a branch page has two children or more.
        let least = if leaf { 1 } else { 2 };
        if lower < PAGE_HEADER + 2 * least
            || !(lower - PAGE_HEADER).is_multiple_of(2)
            || lower > upper
            || upper > self.page_size
        {
            return Err(self.damaged(format!(
                "page {number} of {what} has its node table at {PAGE_HEADER}..{lower} and its \
                 nodes from {upper} of a {}-byte page",
                self.page_size
            )));
        }
        nodes.clear();
        for i in 0..(lower - PAGE_HEADER) / 2 {
            let at = u16_at(page, PAGE_HEADER + 2 * i) as usize;
            let key_at = at + NODE_HEADER;
            if at < upper || key_at > self.page_size {
                return Err(self.node_error(what, number, i, "lies outside the page's nodes"));
            }
            let key = key_at..key_at + u16_at(page, at + 6) as usize;
            if key.end > self.page_size {
                return Err(self.node_error(what, number, i, "has a key past the page"));
            }
            nodes.push(Node {
                lo: u16_at(page, at),
                hi: u16_at(page, at + 2),
                flags: u16_at(page, at + 4),
                key,
            });
        }
        // liblmdb's order (`mdb_cmp_memn`: bytes, then the shorter first) is the slices' order.
        // A branch's first key is not used (liblmdb leaves it empty).
        let keys = &nodes[usize::from(!leaf)..];
        let key = |node: &Node| &page[node.key.clone()];
        let in_order = keys
            .windows(2)
            .all(|pair| key_below(key(&pair[0]), key(&pair[1])))
            && visit
                .low
                .as_deref()
                .is_none_or(|low| keys.first().is_none_or(|first| !key_below(key(first), low)))
            && visit
                .high
                .as_deref()
                .is_none_or(|high| keys.last().is_none_or(|last| key_below(key(last), high)));
        if !in_order {
            return Err(self.damaged(format!(
                "page {number} of {what} holds keys out of order (or outside what its parent \
                 gives it)"
            )));
        }
        Ok(())
    }

    /// Once the walk has found the file cold (a `pread` as slow as a disk read), asks the
    /// kernel for the next [`READ_AHEAD_PAGES`] pages of the walk not yet asked for
    /// (`POSIX_FADV_WILLNEED`, which starts their reads and returns), so that they come in
    /// together instead of one read at a time: the leaves of a large file lie far apart, each
    /// a disk read of its own. A file in the page cache never sets `cold`, and costs nothing.
    fn read_ahead(&self, stack: &mut [Visit]) {
        let Pages::Read(file) = self.pages else {
            return;
        };
        if !self.cold {
            return;
        }
        let page = self.page_size as i64;
        for visit in stack.iter_mut().rev().take(READ_AHEAD_PAGES) {
            if visit.advised {
                continue;
            }
            visit.advised = true;
            let Some(at) = i64::try_from(visit.number)
                .ok()
                .and_then(|n| n.checked_mul(page))
            else {
                continue;
            };
            // SAFETY: a plain syscall on a valid, open file descriptor; the advice is
            // asynchronous and has no effect on what any read returns.
            unsafe {
                libc::posix_fadvise(
                    std::os::fd::AsRawFd::as_raw_fd(file),
                    at,
                    page,
                    libc::POSIX_FADV_WILLNEED,
                )
            };
        }
    }

    /// Notes where the values of leaf page `number`'s `nodes` (just checked) lie, when locating
    /// and their keys are sample indices.
    fn locate(&mut self, number: u64, nodes: &[Node]) {
        let Some((offsets, lens)) = self.locations.as_mut() else {
            return;
        };
        let page = match self.pages {
            Pages::Read(_) => &self.buffer[..],
            Pages::Mapped(_) => self.mapped,
        };
        let page_at = number * self.page_size as u64;
        for node in nodes {
            let Ok(key) = <[u8; 8]>::try_from(&page[node.key.clone()]) else {
                continue;
            };
            let Some(index) = usize::try_from(u64::from_be_bytes(key))
                .ok()
                .filter(|&i| i < offsets.len())
            else {
                continue;
            };
            let size = u32::from(node.lo) | u32::from(node.hi) << 16;
            let offset = match node.flags {
                0 => page_at + node.key.end as u64,
                // Checked by `leaf_values`: the page number lies inside the file.
                F_BIGDATA => {
                    u64_at(page, node.key.end) * self.page_size as u64 + PAGE_HEADER as u64
                }
                _ => continue,
            };
            offsets[index] = offset;
            lens[index] = size;
        }
    }

    /// The page [`read_page`](Self::read_page) read last.
    fn page(&self) -> &[u8] {
        match self.pages {
            Pages::Read(_) => &self.buffer,
            Pages::Mapped(_) => self.mapped,
        }
    }

    fn node_error(&self, what: &str, page: u64, node: usize, why: &str) -> Error {
        self.damaged(format!("node {node} of page {page} of {what} {why}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use heed::types::Bytes;
    use heed::{Database, EnvOpenOptions};

    /// A small LMDB file like a dataset's: a `samples` database with inline values over a
    /// two-level tree, a few values on overflow pages, and a `meta` database.
    fn small_lmdb(dir: &Path) -> std::path::PathBuf {
        let path = dir.join("small.lmdb");
        let env = open_env(&path, EnvOpenOptions::new().max_dbs(3).map_size(16 << 20));
        let mut txn = env.write_txn().unwrap();
        let samples: Database<Bytes, Bytes> =
            env.create_database(&mut txn, Some("samples")).unwrap();
        let meta: Database<Bytes, Bytes> = env.create_database(&mut txn, Some("meta")).unwrap();
        for i in 0u64..60 {
            let len = if i % 40 == 7 { 9000 } else { 300 + i as usize };
            let value: Vec<u8> = (0..len).map(|b| (b as u64 * 31 + i) as u8).collect();
            samples.put(&mut txn, &i.to_be_bytes(), &value).unwrap();
        }
        meta.put(&mut txn, b"info", b"{}").unwrap();
        txn.commit().unwrap();
        drop(env);
        path
    }

    /// The LMDB file at `path`, opened with liblmdb to compare against.
    fn open_read_only(path: &Path) -> heed::Env {
        open_env(path, EnvOpenOptions::new().max_dbs(3))
    }

    /// The single-file LMDB at `path` (created if missing) with `options`.
    fn open_env(path: &Path, options: &mut EnvOpenOptions) -> heed::Env {
        // SAFETY: test files, each opened by the test that made it alone (only one
        // environment per file at a time).
        unsafe {
            options
                .flags(heed::EnvFlags::NO_SUB_DIR)
                .open(path)
                .unwrap()
        }
    }

    type Outcome = std::result::Result<Option<Locations>, String>;

    /// The outcome of checking `bytes` (the whole of the file at `path`, which `file` has open)
    /// both ways the walk reads pages, locating the samples' values; with `cold_too`, the
    /// `pread` walk also with the file taken for cold (its pages read ahead), which must find
    /// the same.
    fn both_ways(path: &Path, file: &fs::File, bytes: &[u8], cold_too: bool) -> (Outcome, Outcome) {
        let len = bytes.len() as u64;
        let opened = ["meta", "samples"];
        let locate = Some("samples");
        let walk = |pages: Pages<'_>, cold: bool| {
            check_pages(path, pages, len, &opened, locate, cold)
                .map(|(located, _)| located)
                .map_err(|e| e.to_string())
        };
        let read = walk(Pages::Read(file), false);
        if cold_too {
            assert_eq!(read, walk(Pages::Read(file), true), "read ahead");
        }
        (read, walk(Pages::Mapped(bytes), false))
    }

    #[test]
    fn eight_byte_keys_compare_as_the_slices_do() {
        let keys: Vec<Vec<u8>> = [
            &b""[..],
            b"\x00",
            b"\x00\x00\x00\x00\x00\x00\x00\x00",
            b"\x00\x00\x00\x00\x00\x00\x00\x01",
            b"\x00\x00\x00\x00\x00\x00\x01\x00",
            b"\x00\x00\x00\x00\x00\x00\x01\x00\x00",
            b"\x01\x00\x00\x00\x00\x00\x00\x00",
            b"\x7f\xff\xff\xff\xff\xff\xff\xff",
            b"\x80\x00\x00\x00\x00\x00\x00\x00",
            b"\xff\xff\xff\xff\xff\xff\xff",
            b"\xff\xff\xff\xff\xff\xff\xff\xff",
            b"meta",
        ]
        .iter()
        .map(|k| k.to_vec())
        .collect();
        for a in &keys {
            for b in &keys {
                assert_eq!(key_below(a, b), a < b, "{a:02x?} < {b:02x?}");
            }
        }
    }

    #[test]
    fn a_mapped_walk_finds_exactly_what_a_read_walk_finds_for_every_damaged_byte() {
        use std::os::unix::fs::FileExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = small_lmdb(dir.path());
        let mut bytes = fs::read(&path).unwrap();
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let (read, mapped) = both_ways(&path, &file, &bytes, true);
        assert_eq!(read, mapped);
        // Every sample's value located, and where liblmdb finds it.
        let (offsets, lens) = read.unwrap().expect("located");
        let env = open_read_only(&path);
        let txn = env.read_txn().unwrap();
        let samples: Database<Bytes, Bytes> =
            env.open_database(&txn, Some("samples")).unwrap().unwrap();
        assert_eq!(offsets.len(), 60);
        for (i, (&offset, &len)) in offsets.iter().zip(&lens).enumerate() {
            let value = samples
                .get(&txn, &(i as u64).to_be_bytes())
                .unwrap()
                .unwrap();
            let at = offset as usize;
            assert_eq!(&bytes[at..at + len as usize], value, "sample {i}");
        }
        drop(txn);
        drop(env);
        // Every byte of the file, each changed two ways (in the file and in the copy the
        // mapped walk reads), then put back.
        let mut refused = 0;
        for at in 0..bytes.len() {
            let pristine = bytes[at];
            for flip in [0x01u8, 0xff] {
                bytes[at] = pristine ^ flip;
                file.write_all_at(&bytes[at..=at], at as u64).unwrap();
                // (Read ahead at every fourth byte: the walk is the same, the advice aside.)
                let (read, mapped) = both_ways(&path, &file, &bytes, at % 4 == 0);
                assert_eq!(read, mapped, "byte {at} ^ {flip:#x}");
                refused += usize::from(read.is_err());
            }
            bytes[at] = pristine;
            file.write_all_at(&bytes[at..=at], at as u64).unwrap();
        }
        // The walk is not vacuous: damaged structure is refused.
        assert!(refused > 1000, "{refused} refusals");
        // A file cut short (shorter than the meta page says) fails both ways alike.
        for cut in [bytes.len() - 1, bytes.len() / 2, 4096 * 3 + 17] {
            file.set_len(cut as u64).unwrap();
            let (read, mapped) = both_ways(&path, &file, &bytes[..cut], true);
            assert!(read.is_err(), "cut at {cut}");
            assert_eq!(read, mapped, "cut at {cut}");
        }
    }
    /// The value of key `i` in [`string_keys_lmdb`]: inline, and every 997th on overflow pages.
    fn keyed_value(i: usize) -> Vec<u8> {
        let len = if i % 997 == 5 { 5000 } else { 20 + i % 50 };
        (0..len).map(|b| (b * 31 + i) as u8).collect()
    }

    fn string_key(i: usize) -> String {
        format!("n{:05}/{:07}.JPEG", i % 100, i * 7)
    }

    /// An LMDB file like a folder2lmdb one: 20,000 string keys in the main database, three
    /// levels deep.
    fn string_keys_lmdb(dir: &Path) -> std::path::PathBuf {
        let path = dir.join("keys.lmdb");
        let env = open_env(&path, EnvOpenOptions::new().map_size(64 << 20));
        let mut txn = env.write_txn().unwrap();
        let db: Database<Bytes, Bytes> = env.create_database(&mut txn, None).unwrap();
        for i in 0..20_000 {
            db.put(&mut txn, string_key(i).as_bytes(), &keyed_value(i))
                .unwrap();
        }
        txn.commit().unwrap();
        path
    }

    #[test]
    fn a_guarded_search_finds_every_value_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = string_keys_lmdb(dir.path());
        let file = fs::File::open(&path).unwrap();
        let len = file.metadata().unwrap().len();
        let (_, roots) = check(&path, &file, len, &[], None).unwrap();
        let tree = roots.main.expect("a main database");
        assert!(tree.depth >= 3, "depth {}", tree.depth);
        let bytes = fs::read(&path).unwrap();
        let find =
            |bytes: &[u8], key: &[u8]| tree.find(&path, bytes, key, &mut SearchPages::default());
        // In a scattered order, through one set of copied pages (most searches share the upper
        // ones), and each key with fresh ones.
        let mut shared = SearchPages::default();
        for i in (0..20_000).map(|i| i * 7919 % 20_000) {
            let (offset, len) = tree
                .find(&path, &bytes, string_key(i).as_bytes(), &mut shared)
                .unwrap()
                .unwrap_or_else(|| panic!("key {i} not found"));
            assert_eq!(&bytes[offset as usize..][..len], keyed_value(i), "key {i}");
            assert_eq!(
                find(&bytes, string_key(i).as_bytes()).unwrap(),
                Some((offset, len))
            );
        }
        for i in 0..20_000 {
            let (offset, len) = find(&bytes, string_key(i).as_bytes())
                .unwrap()
                .unwrap_or_else(|| panic!("key {i} not found"));
            assert_eq!(&bytes[offset as usize..][..len], keyed_value(i), "key {i}");
        }
        // Before the first key, after the last, between two, a key's prefix and extension.
        for absent in ["", "a", "n00000/", "n00000/0000000.JPEG0", "n00050", "zzzz"] {
            assert!(
                find(&bytes, absent.as_bytes()).unwrap().is_none(),
                "{absent:?}"
            );
        }
        // A page changed since the check (the root page's number), or past a shorter map.
        let mut changed = bytes.clone();
        let at = tree.root as usize * tree.page_size;
        changed[at] ^= 1;
        assert!(matches!(
            find(&changed, string_key(1).as_bytes()),
            Err(NotFound::Changed(_))
        ));
        assert!(matches!(
            find(&bytes[..at], string_key(1).as_bytes()),
            Err(NotFound::Changed(_))
        ));
        // Every byte of the root page changed: found as before, not found, or a changed file;
        // never a read outside the page (the search would panic or fault).
        for at in at..at + tree.page_size {
            changed.copy_from_slice(&bytes);
            changed[at] ^= 0xff;
            let _ = find(&changed, string_key(12_345).as_bytes());
        }
    }
    #[test]
    fn a_guarded_search_of_a_named_database_finds_what_liblmdb_finds() {
        let dir = tempfile::tempdir().unwrap();
        let path = small_lmdb(dir.path());
        let file = fs::File::open(&path).unwrap();
        let len = file.metadata().unwrap().len();
        let (_, roots) = check(&path, &file, len, &["meta", "samples"], None).unwrap();
        let tree = roots.named("samples").expect("the samples database");
        let bytes = fs::read(&path).unwrap();
        let env = open_read_only(&path);
        let txn = env.read_txn().unwrap();
        let samples: Database<Bytes, Bytes> =
            env.open_database(&txn, Some("samples")).unwrap().unwrap();
        let mut pages = SearchPages::default();
        for i in 0u64..62 {
            let key = i.to_be_bytes();
            let found = tree.find(&path, &bytes, &key, &mut pages).unwrap();
            let expected = samples.get(&txn, &key).unwrap();
            assert_eq!(
                found.map(|(offset, len)| &bytes[offset as usize..][..len]),
                expected,
                "sample {i}"
            );
        }
        assert!(roots.named("nothing").is_none());
    }
}
