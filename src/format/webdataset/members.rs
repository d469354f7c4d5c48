//! Reading the tar members of WebDataset shards: telling a header by its checksum, walking a
//! shard header to header into sample spans (damage resynchronised at the next valid header),
//! and parsing one sample's members into its fields.

use std::io::Cursor;

/// Fields that hold the image, in the order they are preferred.
pub(super) const IMAGE_FIELDS: &[&str] = &[
    "jpg", "jpeg", "png", "webp", "ppm", "pgm", "bmp", "tif", "tiff",
];

/// Fields that hold the label, in the order they are preferred.
pub(super) const LABEL_FIELDS: &[&str] = &["cls", "class", "label", "target"];

/// A tar block.
pub(super) const BLOCK: u64 = 512;

/// One sample's place in its shard: the byte span of its members, headers included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Span {
    pub(super) offset: u64,
    pub(super) len: u64,
}

/// True when `block` is a tar header: 512 bytes whose checksum field matches the sum of its
/// bytes (the checksum field counted as spaces).
pub(crate) fn is_tar_header(block: &[u8]) -> bool {
    if block.len() < BLOCK as usize || block.iter().take(BLOCK as usize).all(|&b| b == 0) {
        return false;
    }
    let field = &block[148..156];
    let digits: String = field
        .iter()
        .take_while(|&&b| b != 0 && b != b' ')
        .skip_while(|&&b| b == b' ')
        .map(|&b| b as char)
        .collect();
    let Ok(stored) = u32::from_str_radix(digits.trim(), 8) else {
        return false;
    };
    let sum: u32 = block[..BLOCK as usize]
        .iter()
        .enumerate()
        .map(|(i, &b)| {
            if (148..156).contains(&i) {
                32
            } else {
                u32::from(b)
            }
        })
        .sum();
    sum == stored
}

/// A shard walked into samples.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Walk {
    pub(super) samples: Vec<Span>,
    /// `(sample position, reason)` of each damaged range.
    pub(super) damaged: Vec<(usize, String)>,
    /// Whether the shard ends cut short: damage runs to its last byte, so the walk never met
    /// the archive's end. How many samples the lost tail held is unknown; the last damaged
    /// range stands for all of them.
    pub(super) cut_end: bool,
    /// Whether the shard ends right after a whole member, without the end-of-archive block: cut
    /// between two members, or written by a writer that never writes one. (`cut_end` too.)
    pub(super) unterminated: bool,
    /// Where the bytes that are not the archive's start, when the shard ends in some: after a
    /// whole end-of-archive marker, holding no tar header, and not ending in a marker of their
    /// own (text appended to a finished tar). tar and Python's tarfile stop at the marker and
    /// never read them; neither does the walk.
    pub(super) trailing: Option<u64>,
    /// Members whose file name is no `key.field` (`README`, `.DS_Store`, macOS's `._a.jpg`),
    /// skipped as the webdataset package skips them; the first named by its path.
    pub(super) nameless: Tally,
    /// Samples whose key an earlier sample of the shard has (a tar not grouped by sample, or
    /// one holding a sample twice); the first as `"key", samples A and B`.
    pub(super) key_again: Tally,
    /// Where each key was first met, by its 64-bit hash (a collision costs at most a wrong
    /// count: about 10⁻⁷ for a million keys), not the text (a one-tar ImageNet held ~100 MB).
    keys: std::collections::HashMap<u64, usize>,
}

impl Walk {
    /// Counts sample `number`'s key, met once more if an earlier sample had it.
    fn meet(&mut self, key: &str, number: usize) {
        match self.keys.entry(hash_of(key)) {
            std::collections::hash_map::Entry::Occupied(earlier) => self
                .key_again
                .add(|| format!("{key:?}, samples {} and {number}", earlier.get())),
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(number);
            }
        }
    }
}

/// How many samples (or members) showed a trait, and the first of them, described: what a
/// notice counts and names.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Tally {
    pub(super) count: usize,
    pub(super) first: Option<String>,
}

impl Tally {
    pub(super) fn add(&mut self, first: impl FnOnce() -> String) {
        self.count += 1;
        if self.first.is_none() {
            self.first = Some(first());
        }
    }
}

/// A 64-bit hash of `value`, for telling keys and shard starts apart without keeping them.
pub(super) fn hash_of(value: impl std::hash::Hash) -> u64 {
    use std::hash::Hasher as _;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}

/// Whether a member's path names a sample's field: its file name holds a dot after at least one
/// other character (`a.jpg`, `dir/a.seg.png`); not `README`, `.DS_Store` or `._a.jpg` (macOS's
/// AppleDouble companions), which the webdataset package skips too.
pub(super) fn names_a_field(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.find('.').is_some_and(|dot| dot > 0)
}

/// The key and field of a member's path: up to and after the first dot of its file name.
pub(super) fn key_and_field(path: &str) -> (&str, &str) {
    let name_start = path.rfind('/').map_or(0, |i| i + 1);
    match path[name_start..].find('.') {
        Some(dot) => (&path[..name_start + dot], &path[name_start + dot + 1..]),
        None => (path, ""),
    }
}

/// Walks a shard's headers (skipping data) into sample spans; damage costs only the bytes up to
/// the next valid header (see the module docs).
pub(super) fn walk_shard(bytes: &[u8]) -> Walk {
    let mut walk = Walk::default();
    let mut from = 0u64;
    let end = bytes.len() as u64;
    while from < end {
        match walk_from(bytes, from, &mut walk) {
            Ok(()) => break,
            Err((at, problem)) => {
                let problem = readable_problem(bytes, at, problem);
                // Resynchronise: the next block after the problem holding a valid header.
                let next = next_header(bytes, (at / BLOCK + 1) * BLOCK);
                let start = walk
                    .samples
                    .last()
                    .map_or(from, |s| (s.offset + s.len).max(from));
                let start = start.min(at);
                let reason = if start == next {
                    format!("the shard ends at byte {start}: {problem}")
                } else {
                    format!(
                        "bytes {start}..{next} of the shard are not tar members ({problem}){}",
                        if next == end {
                            " and nothing after them is"
                        } else {
                            "; the next member starts after them"
                        }
                    )
                };
                walk.damaged.push((walk.samples.len(), reason));
                walk.samples.push(Span {
                    offset: start,
                    len: next - start,
                });
                from = next;
            }
        }
    }
    // Damage that runs to the last byte means the walk never met the archive's end: where
    // the shard was cut, what followed is unknown. (Zeros at the file's end do not show an end
    // block: a cut inside a member's zero data looks the same, found by a hostile try.)
    walk.cut_end = walk.damaged.last().is_some_and(|&(at, _)| {
        let span = walk.samples[at];
        span.offset + span.len == end
    });
    walk
}

/// The reason a walk stopped at byte `at`, fit for a message. The tar reader's own error can
/// quote a header's fields, raw bytes and all (a hostile try's random file filled the message
/// with them): where no valid header stands that is said plainly instead; otherwise the text
/// keeps at most 200 characters, anything unprintable replaced.
fn readable_problem(bytes: &[u8], at: u64, problem: String) -> String {
    let raw = |c: char| c.is_control() || c == '\u{fffd}';
    if !problem.chars().any(raw) {
        return problem;
    }
    let block = &bytes[(at as usize).min(bytes.len())..bytes.len().min(at as usize + 512)];
    let header_ok = crate::mapguard::fault_in(block).is_ok() && is_tar_header(block);
    if !header_ok {
        return "no valid tar header there (its checksum does not match)".into();
    }
    let mut text: String = problem
        .chars()
        .map(|c| if raw(c) { '?' } else { c })
        .take(200)
        .collect();
    if problem.chars().count() > 200 {
        text.push('…');
    }
    text
}

/// The first block from `from` on (a multiple of [`BLOCK`]) that holds a valid tar header, or
/// the shard's end. Blocks that cannot be read ([`crate::mapguard`]: a page of a mapped shard
/// the disk failed to supply) are skipped a page at a time.
fn next_header(bytes: &[u8], from: u64) -> u64 {
    let end = bytes.len() as u64;
    let mut at = from;
    while at < end {
        let block = &bytes[at as usize..bytes.len().min((at + BLOCK) as usize)];
        if let Err(fault) = crate::mapguard::fault_in(block) {
            let past = crate::mapguard::past_page_of(bytes, fault) as u64;
            at = past.div_ceil(BLOCK) * BLOCK;
            continue;
        }
        if is_tar_header(block) {
            return at;
        }
        at += BLOCK;
    }
    end
}

/// A cursor over bytes that may be a file's map, for the tar reader: each read is a guarded
/// copy ([`crate::mapguard`]), so a page the disk cannot supply is an I/O error (the member is
/// then damage, named with it) where reading it would be SIGBUS.
struct GuardedCursor<'a>(Cursor<&'a [u8]>);

impl std::io::Read for GuardedCursor<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let bytes = *self.0.get_ref();
        let start = usize::try_from(self.0.position())
            .unwrap_or(usize::MAX)
            .min(bytes.len());
        let wanted = &bytes[start..bytes.len().min(start.saturating_add(buf.len()))];
        crate::mapguard::copy_to_slice(&mut buf[..wanted.len()], wanted).map_err(|_| {
            std::io::Error::other("the disk failed to supply a page of it (an I/O error)")
        })?;
        self.0.set_position((start + wanted.len()) as u64);
        Ok(wanted.len())
    }
}

impl std::io::Seek for GuardedCursor<'_> {
    fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
        self.0.seek(to)
    }
}

/// Walks members from byte `from` to the end of the archive, adding samples to `walk`; on a
/// member that does not parse, returns where it was and why.
fn walk_from(bytes: &[u8], from: u64, walk: &mut Walk) -> std::result::Result<(), (u64, String)> {
    let mut archive = tar::Archive::new(GuardedCursor(Cursor::new(&bytes[from as usize..])));
    let entries = archive
        .entries_with_seek()
        .map_err(|e| (from, e.to_string()))?;
    // The sample being gathered: key, first header offset, end of its last member's data.
    let mut open: Option<(String, u64, u64)> = None;
    // A link (or FIFO, device) under a key no sample is gathering yet, and where it starts:
    // the sample of its key starts there if a file of that key follows it (so that the
    // sample's bad record can name it); otherwise it is skipped, as the webdataset package
    // skips such members, and makes no sample.
    let mut pending: Option<(String, u64)> = None;
    let close = |open: &mut Option<(String, u64, u64)>, walk: &mut Walk| {
        if let Some((_, start, end)) = open.take() {
            walk.samples.push(Span {
                offset: start,
                len: end - start,
            });
        }
    };
    // Where the previous member's data ends: the next member (its extension headers, such as
    // a GNU long name or PAX record, included) starts there.
    let mut last_end = from;
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(e) => {
                close(&mut open, walk);
                return Err((last_end, e.to_string()));
            }
        };
        let member_at = last_end;
        let data_at = from + entry.raw_file_position();
        let size = entry.size();
        let data_end = data_at.saturating_add(size);
        if data_end > bytes.len() as u64 {
            close(&mut open, walk);
            return Err((
                member_at,
                format!(
                    "a member declares {size} bytes but the shard ends {} bytes after its header",
                    (bytes.len() as u64).saturating_sub(data_at)
                ),
            ));
        }
        let padded_end = data_end.div_ceil(BLOCK) * BLOCK;
        last_end = padded_end.min(bytes.len() as u64);
        let kind = member_kind(entry.header().entry_type());
        if kind == MemberKind::NoMember {
            continue;
        }
        let path = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        if !names_a_field(&path) {
            walk.nameless.add(|| path);
            continue;
        }
        let (key, _) = key_and_field(&path);
        match &mut open {
            Some((current, _, end)) if current == key => *end = last_end,
            _ if kind != MemberKind::File => {
                if pending.as_ref().is_none_or(|(k, _)| k != key) {
                    pending = Some((key.to_string(), member_at));
                }
            }
            _ => {
                close(&mut open, walk);
                let start = match pending.take() {
                    Some((k, at)) if k == key => at,
                    _ => member_at,
                };
                walk.meet(key, walk.samples.len());
                open = Some((key.to_string(), start, last_end));
            }
        }
        if kind == MemberKind::File {
            pending = None;
        }
    }
    close(&mut open, walk);
    // The walk stops at an all-zero block (the end of the archive) or where a header is cut
    // short: only zeros may follow, else the tail is damage, never silently dropped.
    let tail = &bytes[last_end as usize..];
    if crate::mapguard::fault_in(tail).is_err() {
        return Err((
            last_end,
            "the bytes after the last member could not be read (an I/O error)".into(),
        ));
    }
    if tail.iter().any(|&b| b != 0) {
        if let Some(at) = trailing_junk(bytes, last_end) {
            walk.trailing = Some(at);
            return Ok(());
        }
        return Err((
            last_end,
            "the archive ends early: a header is cut short, or a block of zeros stands where a \
             header should"
                .into(),
        ));
    }
    // A tar ends with zero blocks (two; one is accepted, as GNU tar does). Without them the
    // shard may have been cut between two members (a copy or an upload that stopped), with
    // every later sample gone: that is a damaged end, never a complete shard.
    if (tail.len() as u64) < BLOCK {
        walk.unterminated = true;
        return Err((
            last_end,
            "the archive has no end-of-archive block after its last member: the shard was cut \
             short there, or its writer never finished it"
                .into(),
        ));
    }
    Ok(())
}

/// Where bytes appended to a finished tar start, when the tail after its last member (from
/// `last_end`) is such: the end-of-archive marker (two zero blocks), then bytes holding no tar
/// header that do not end in a marker of their own. Anything else that is not zeros is damage:
/// zeros over a header with its member's data left after them, and the archive's own marker
/// after that, end in zeros; a zeroed stretch before more members has a header after it.
fn trailing_junk(bytes: &[u8], last_end: u64) -> Option<u64> {
    let tail = &bytes[last_end as usize..];
    let zeros = tail.iter().take_while(|&&b| b == 0).count() as u64;
    if zeros < 2 * BLOCK {
        return None;
    }
    let junk = last_end + zeros / BLOCK * BLOCK;
    let ends_in_marker = tail.len() as u64 >= 2 * BLOCK
        && tail[tail.len() - 2 * BLOCK as usize..]
            .iter()
            .all(|&b| b == 0);
    (!ends_in_marker && next_header(bytes, junk) == bytes.len() as u64).then_some(junk)
}

/// The members of one sample: its key, and each field's name and data range in `span`.
pub(super) struct Members<'a> {
    pub(super) key: String,
    pub(super) fields: Vec<(String, &'a [u8])>,
    /// A field two members of the sample hold (`key.jpg` twice in a row: a writer that
    /// repeated a key). Which image goes with which label is then unknown: the `webdataset`
    /// package refuses such a shard, and the sample is a bad record.
    pub(super) repeated: Option<String>,
    /// Members of the sample's key that are no file (`key.jpg` as a symbolic or hard link, a
    /// FIFO), named with what they are: never read (the `webdataset` package skips them),
    /// named in messages.
    pub(super) not_files: Vec<String>,
}

/// What a tar member is to a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MemberKind {
    /// A file: one of its key's fields.
    File,
    /// Named like a field, never read: a link, a FIFO, a device (what it is, for messages).
    Unread(&'static str),
    /// No member of a sample: a directory, a global PAX header.
    NoMember,
}

fn member_kind(kind: tar::EntryType) -> MemberKind {
    match kind {
        _ if kind.is_file() => MemberKind::File,
        tar::EntryType::Symlink => MemberKind::Unread("a symbolic link"),
        tar::EntryType::Link => MemberKind::Unread("a hard link"),
        tar::EntryType::Fifo => MemberKind::Unread("a FIFO"),
        tar::EntryType::Char | tar::EntryType::Block => MemberKind::Unread("a device"),
        _ => MemberKind::NoMember,
    }
}

/// Parses the members in a sample's bytes.
pub(super) fn members(span: &[u8]) -> std::result::Result<Members<'_>, String> {
    let mut archive = tar::Archive::new(GuardedCursor(Cursor::new(span)));
    let entries = archive.entries_with_seek().map_err(|e| e.to_string())?;
    let mut key = None;
    let mut fields: Vec<(String, &[u8])> = Vec::new();
    let mut repeated = None;
    // Unread members with their keys: only the sample's own are named.
    let mut not_files: Vec<(String, String)> = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| e.to_string())?;
        // (Borrowed, not copied, where the name is UTF-8: this runs for every member read.)
        let path_bytes = entry.path_bytes();
        let path = String::from_utf8_lossy(&path_bytes);
        if !names_a_field(&path) {
            continue;
        }
        let (k, field) = key_and_field(&path);
        match member_kind(entry.header().entry_type()) {
            MemberKind::File => {}
            MemberKind::Unread(what) => {
                let name = path.rsplit('/').next().unwrap_or(&path);
                not_files.push((k.to_string(), format!("{name} is {what}")));
                continue;
            }
            MemberKind::NoMember => continue,
        }
        let start = usize::try_from(entry.raw_file_position()).map_err(|e| e.to_string())?;
        let len = usize::try_from(entry.size()).map_err(|e| e.to_string())?;
        let data = span
            .get(start..start.saturating_add(len))
            .ok_or("a member runs past its sample's bytes")?;
        key.get_or_insert_with(|| k.to_string());
        let field = field.to_ascii_lowercase();
        if repeated.is_none() && fields.iter().any(|(f, _)| *f == field) {
            repeated = Some(field.clone());
        }
        fields.push((field, data));
    }
    // (The walk makes no sample of unread members alone.)
    let key = key.ok_or("no file in the sample")?;
    let not_files = not_files
        .into_iter()
        .filter(|(k, _)| *k == key)
        .map(|(_, what)| what)
        .collect();
    Ok(Members {
        key,
        fields,
        repeated,
        not_files,
    })
}

impl<'a> Members<'a> {
    /// The image: the first field named exactly like an image, else the first whose last part
    /// is (`seg.png`).
    pub(super) fn image(&self) -> Option<&'a [u8]> {
        self.image_field().map(|(_, data)| data)
    }

    /// The image's field name and data (see [`Members::image`]).
    pub(super) fn image_field(&self) -> Option<(&str, &'a [u8])> {
        IMAGE_FIELDS
            .iter()
            .find_map(|name| self.fields.iter().find(|(f, _)| f == name))
            .or_else(|| self.fields.iter().find(|(f, _)| is_image_field(f)))
            .map(|(f, data)| (f.as_str(), *data))
    }

    /// The names of every field that holds an image (`jpg`, `seg.png`, ...): more than one
    /// when a sample carries a second image (a mask, a depth map) beside the one read.
    pub(super) fn image_fields(&self) -> impl Iterator<Item = &str> {
        self.fields
            .iter()
            .map(|(f, _)| f.as_str())
            .filter(|f| is_image_field(f))
    }

    /// The fields' names, dotted (`.jpg, .cls`), and the members that are no file: what a
    /// message says a sample holds.
    pub(super) fn described(&self) -> String {
        let parts: Vec<String> = self.fields.iter().map(|(f, _)| format!(".{f}")).collect();
        let mut text = parts.join(", ");
        for what in &self.not_files {
            text.push_str(&format!("; {what}, which is not read"));
        }
        text
    }

    /// Two label fields holding different integers (`.cls` 0 and `.class` 1), as `.cls 0,
    /// .class 1`: the first is what [`Members::label`] reads.
    pub(super) fn differing_labels(&self) -> Option<String> {
        // (Nothing to compare, and nothing allocated, in the usual sample of one label field.)
        let label_fields = self
            .fields
            .iter()
            .filter(|(f, _)| LABEL_FIELDS.contains(&f.as_str()))
            .count();
        if label_fields < 2 {
            return None;
        }
        let found: Vec<(&str, i64)> = LABEL_FIELDS
            .iter()
            .filter_map(|name| self.fields.iter().find(|(f, _)| f == name))
            .filter_map(|(field, data)| {
                crate::mapguard::fault_in(data).ok()?;
                let value = std::str::from_utf8(data).ok()?.trim().parse().ok()?;
                Some((field.as_str(), value))
            })
            .collect();
        let differ = found.windows(2).any(|pair| pair[0].1 != pair[1].1);
        differ.then(|| {
            found
                .iter()
                .map(|(field, value)| format!(".{field} {value}"))
                .collect::<Vec<_>>()
                .join(", ")
        })
    }

    /// The label field's text as an integer, when there is one; `Err` when it is not an integer.
    pub(super) fn label(&self) -> Option<std::result::Result<i64, String>> {
        let (field, data) = LABEL_FIELDS
            .iter()
            .find_map(|name| self.fields.iter().find(|(f, _)| f == name))?;
        if crate::mapguard::fault_in(data).is_err() {
            return Some(Err(format!(
                "its .{field} could not be read (an I/O error)"
            )));
        }
        let text = std::str::from_utf8(data)
            .ok()
            .map(str::trim)
            .filter(|t| !t.is_empty());
        Some(text.and_then(|t| t.parse::<i64>().ok()).ok_or_else(|| {
            // Digits past i64 are an integer all the same, only no class (a hostile try's
            // 20-digit label was "not an integer").
            let digits = text
                .map(|t| t.strip_prefix(['-', '+']).unwrap_or(t))
                .is_some_and(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()));
            let what = if digits {
                "an integer past any class"
            } else {
                "not an integer label"
            };
            format!("its .{field} holds {}, {what}", describe_text(data))
        }))
    }
}

/// True for a field named like an image, or whose last part is (`seg.png`).
fn is_image_field(field: &str) -> bool {
    field
        .rsplit('.')
        .next()
        .is_some_and(|last| IMAGE_FIELDS.contains(&last))
}

/// What a label field holds, for a message: its text quoted (the first 24 characters), or
/// that it is empty or not text.
fn describe_text(data: &[u8]) -> String {
    match std::str::from_utf8(data) {
        Ok(text) if text.trim().is_empty() => "nothing".to_string(),
        Ok(text) => {
            let text = text.trim();
            let shown: String = text.chars().take(24).collect();
            if shown.len() < text.len() {
                format!("{shown:?}... ({} bytes)", data.len())
            } else {
                format!("{shown:?}")
            }
        }
        Err(_) => format!("{} bytes that are not text", data.len()),
    }
}

pub(super) fn slice(map: &[u8], span: Span) -> Option<&[u8]> {
    let start = usize::try_from(span.offset).ok()?;
    let end = start.checked_add(usize::try_from(span.len).ok()?)?;
    map.get(start..end)
}

/// A tar file of `members` (path, bytes) in order, as WebDataset's writers make them: GNU
/// headers, with a long-name entry where a path exceeds 100 bytes. (For tests and fuzz seeds.)
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn tar(members: &[(&str, &[u8])]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, data) in members {
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_entry_type(tar::EntryType::Regular);
        builder
            .append_data(&mut header, path, *data)
            .expect("an in-memory tar");
    }
    builder.into_inner().expect("an in-memory tar")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_walk_over_a_map_whose_file_was_cut_marks_the_rest_unreadable_not_sigbus() {
        let data: Vec<(String, Vec<u8>)> = (0..40)
            .flat_map(|i| {
                [
                    (format!("s{i:02}.jpg"), vec![b'J'; 700]),
                    (format!("s{i:02}.cls"), b"1".to_vec()),
                ]
            })
            .collect();
        let members_list: Vec<(&str, &[u8])> = data
            .iter()
            .map(|(p, d)| (p.as_str(), d.as_slice()))
            .collect();
        let bytes = tar(&members_list);
        let clean = walk_shard(&bytes);
        assert_eq!(clean.samples.len(), 40);
        let (_dir, _, map) = crate::mapguard::map_then_cut(&bytes, 4 * 4096);
        let walk = walk_shard(&map);
        let (last, before) = walk.samples.split_last().unwrap();
        // Samples before the cut as they were; the one it falls in ends at its last readable
        // member (its .cls header lies past the cut), and the damage runs to the end.
        let (cut, whole) = before.split_last().unwrap();
        assert_eq!(whole, &clean.samples[..whole.len()]);
        assert_eq!(cut.offset, clean.samples[whole.len()].offset);
        assert_eq!(cut.offset + cut.len, last.offset);
        assert!((4 * 4096..5 * 4096).contains(&last.offset), "{last:?}");
        assert_eq!(last.offset + last.len, bytes.len() as u64);
        assert_eq!(walk.damaged.len(), 1, "{:?}", walk.damaged);
        assert!(
            walk.damaged[0].1.contains("I/O error"),
            "{:?}",
            walk.damaged
        );
        // A sample past the cut, parsed on its own: an error, not SIGBUS.
        let past = clean.samples[30];
        assert!(members(slice(&map, past).unwrap()).is_err());
        // One before it reads as it did.
        let early = members(slice(&map, clean.samples[1]).unwrap()).unwrap();
        assert_eq!(early.label(), Some(Ok(1)));
    }

    #[test]
    fn bytes_appended_after_the_end_of_archive_are_left_out_as_tar_leaves_them() {
        // A hostile try: text appended to a finished tar read as one damaged sample, and the
        // shard as cut short, where tar and Python's tarfile read it whole.
        let bytes = tar(&[
            ("a.jpg", &[1u8; 600]),
            ("a.cls", b"0"),
            ("b.jpg", b"B"),
            ("b.cls", b"1"),
        ]);
        let clean = walk_shard(&bytes);
        let mut appended = bytes.clone();
        appended.extend(b"trailing junk\n".repeat(10));
        let walk = walk_shard(&appended);
        assert_eq!(walk.samples, clean.samples);
        assert_eq!(walk.damaged, []);
        assert!(!walk.cut_end && !walk.unterminated);
        let marker = clean.samples[1].offset + clean.samples[1].len;
        assert_eq!(walk.trailing, Some(bytes.len() as u64));
        assert!(bytes.len() as u64 >= marker + 2 * BLOCK);
        assert_eq!(clean.trailing, None);

        // Zeros over the last member's header, its data left after them and the archive's own
        // marker after that: damage, not junk (it ends in a marker).
        let mut zeroed = bytes.clone();
        let b_at = clean.samples[1].offset as usize;
        zeroed[b_at..b_at + 3 * BLOCK as usize].fill(0);
        let walk = walk_shard(&zeroed);
        assert_eq!(walk.trailing, None);
        assert_eq!(walk.damaged.len(), 1, "{walk:?}");
        // Bytes right after the last member, with one zero block or none: damage too.
        for zeros in [0, 512] {
            let mut short = bytes[..marker as usize + zeros].to_vec();
            short.extend(b"junk".repeat(300));
            let walk = walk_shard(&short);
            assert_eq!(walk.trailing, None, "{zeros} zeros");
            assert_eq!(walk.damaged.len(), 1, "{zeros} zeros: {walk:?}");
        }
        // A second archive after the first one's marker (`cat a.tar b.tar`) is read, not left
        // out: its header is found after the zeros.
        let second = tar(&[("c.jpg", b"C"), ("c.cls", b"2")]);
        let mut joined = bytes[..marker as usize + 2 * BLOCK as usize].to_vec();
        joined.extend(&second);
        let walk = walk_shard(&joined);
        assert_eq!(walk.trailing, None);
        let readable = walk
            .samples
            .iter()
            .enumerate()
            .filter(|(i, _)| !walk.damaged.iter().any(|(d, _)| d == i))
            .count();
        assert_eq!(readable, 3, "{walk:?}");
    }

    #[test]
    fn keys_and_fields_split_at_the_first_dot_of_the_name() {
        assert_eq!(key_and_field("a/b.c/x.seg.png"), ("a/b.c/x", "seg.png"));
        assert_eq!(key_and_field("000001.jpg"), ("000001", "jpg"));
        assert_eq!(key_and_field("README"), ("README", ""));
    }

    #[test]
    fn members_group_into_samples_by_key() {
        let long = format!("{}/img.jpg", "d".repeat(150));
        let bytes = tar(&[
            ("s0.jpg", b"J0"),
            ("s0.cls", b"3"),
            ("s0.json", b"{}"),
            ("s1.cls", b" 1\n"),
            ("s1.png", b"P1"),
            (&long, b"J2"),
            (&long.replace("img.jpg", "img.cls"), b"0"),
        ]);
        let walk = walk_shard(&bytes);
        assert_eq!(walk.damaged, []);
        assert_eq!(walk.samples.len(), 3);
        let read = |i: usize| {
            let m = members(slice(&bytes, walk.samples[i]).unwrap()).unwrap();
            (
                m.key.clone(),
                m.image().unwrap().to_vec(),
                m.label().unwrap().unwrap(),
            )
        };
        assert_eq!(read(0), ("s0".into(), b"J0".to_vec(), 3));
        assert_eq!(read(1), ("s1".into(), b"P1".to_vec(), 1));
        assert_eq!(read(2), (long.replace(".jpg", ""), b"J2".to_vec(), 0));
    }

    #[test]
    fn damage_costs_only_the_samples_it_touches() {
        let bytes = tar(&[
            ("a.jpg", &[1u8; 600]),
            ("a.cls", b"0"),
            ("b.jpg", b"B"),
            ("b.cls", b"1"),
            ("c.jpg", b"C"),
            ("c.cls", b"2"),
        ]);
        let clean = walk_shard(&bytes);
        assert_eq!(clean.samples.len(), 3);
        // b's first header: corrupt its checksum.
        let b_at = clean.samples[1].offset as usize;
        let mut bad = bytes.clone();
        bad[b_at + 150] ^= 0x07;
        let walk = walk_shard(&bad);
        assert_eq!(walk.damaged.len(), 1, "{walk:?}");
        let (at, reason) = &walk.damaged[0];
        assert_eq!(*at, 1);
        assert!(reason.contains("next member starts after them"), "{reason}");
        assert!(!walk.cut_end, "damage inside the shard is not a cut end");
        // a before it and b's label member, then c after it, still read.
        let keys: Vec<String> = walk
            .samples
            .iter()
            .enumerate()
            .filter(|(i, _)| !walk.damaged.iter().any(|(d, _)| d == i))
            .map(|(_, s)| members(slice(&bad, *s).unwrap()).unwrap().key)
            .collect();
        assert_eq!(keys, ["a", "b", "c"]);
        // A shard cut inside a member's data, or inside a header: its tail is one damaged
        // sample, never dropped without a word.
        for cut_at in [1000, clean.samples[2].offset as usize + 1024 + 100] {
            let walk = walk_shard(&bytes[..cut_at]);
            assert_eq!(walk.damaged.len(), 1, "cut at {cut_at}: {walk:?}");
            assert!(
                walk.damaged[0].1.contains("nothing after them is"),
                "{:?}",
                walk.damaged
            );
            assert!(walk.cut_end, "cut at {cut_at}");
        }
        // Without its end-of-archive blocks the shard may have been cut between two members
        // (a hostile try found the later samples gone and the shard "OK"): its end is
        // damaged; the members before it still read. One zero block is end enough.
        let walk = walk_shard(&bytes[..bytes.len() - 1024]);
        assert_eq!(walk.samples.len(), 4, "{walk:?}");
        assert_eq!(walk.damaged.len(), 1, "{walk:?}");
        assert_eq!(walk.damaged[0].0, 3);
        assert!(
            walk.damaged[0].1.contains("no end-of-archive block"),
            "{walk:?}"
        );
        assert!(walk.cut_end && walk.unterminated);
        let walk = walk_shard(&bytes[..bytes.len() - 512]);
        assert_eq!((walk.samples.len(), walk.damaged.len()), (3, 0));
        assert!(!walk.cut_end && !walk_shard(&bytes).cut_end);
    }

    #[test]
    fn random_bytes_are_damage_described_in_words_not_quoted() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let noise: Vec<u8> = (0..20_000)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            })
            .collect();
        let walk = walk_shard(&noise);
        assert!(!walk.damaged.is_empty());
        for (_, reason) in &walk.damaged {
            assert!(
                !reason.chars().any(|c| c.is_control() || c == '\u{fffd}'),
                "{reason:?}"
            );
            assert!(reason.len() < 400, "{reason:?}");
        }
        assert!(
            walk.damaged[0].1.contains("no valid tar header"),
            "{:?}",
            walk.damaged
        );
    }

    #[test]
    fn a_cut_inside_zeros_is_still_a_cut_end() {
        // Found by a hostile try: cut at a block boundary inside a member of zeros (an .npy),
        // the file ended in zero blocks and the cut went unseen.
        let zeros = [0u8; 8192];
        let bytes = tar(&[
            ("a.jpg", b"J"),
            ("a.npy", &zeros),
            ("a.cls", b"0"),
            ("b.jpg", b"K"),
            ("b.cls", b"1"),
        ]);
        let cut = 1536 + 4096;
        assert!(bytes[cut - 512..cut].iter().all(|&b| b == 0));
        let walk = walk_shard(&bytes[..cut]);
        assert!(walk.cut_end, "{walk:?}");
        assert!(!walk_shard(&bytes).cut_end);
    }

    #[test]
    fn headers_are_told_by_their_checksum() {
        let bytes = tar(&[("a.jpg", b"x")]);
        assert!(is_tar_header(&bytes));
        let mut bad = bytes.clone();
        bad[0] ^= 1;
        assert!(!is_tar_header(&bad));
        assert!(!is_tar_header(&[0u8; 512]));
        assert!(!is_tar_header(b"short"));
    }
}
