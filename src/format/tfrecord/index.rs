//! Per-shard indexes in the Python `tfrecord` package's format: one text line per record,
//! `"<byte offset> <record length in bytes>"`; where they live, parsing and checking them.
//!
//! Where: imagefeed's own records datasets keep `shard-NNNNN.index` beside each shard (their
//! manifest names both). For other tools' shards, `pack-dataset index` saves them in the
//! `index/` sub-directory of the shards' directory ([`saved_index_path`]), where no `NAME-*`
//! pattern over the shards (TensorFlow's usual `glob("DIR/train-*")`) can pick an index up as
//! a data shard. Opening looks there first, then beside the shard ([`index_path_for`], where
//! the `tfrecord` package's users and earlier imagefeed versions put them).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The sub-directory of a shard directory that saved indexes go into.
pub const INDEX_DIR: &str = "index";

/// Where `pack-dataset index` saves the index of the shard at `shard`: `DIR/index/NAME.index`.
pub fn saved_index_path(shard: &Path) -> PathBuf {
    let name = shard.file_name().unwrap_or_default();
    let mut file = name.to_owned();
    file.push(".index");
    shard
        .parent()
        .unwrap_or(Path::new(""))
        .join(INDEX_DIR)
        .join(file)
}

/// The index of the shard at `shard`, if it has one: [`saved_index_path`], else
/// [`index_path_for`].
pub fn find_index(shard: &Path) -> Option<PathBuf> {
    [saved_index_path(shard), index_path_for(shard)]
        .into_iter()
        .find(|p| p.is_file())
}

/// True when `path` is named like an index file (`*.index`, DALI's `*.idx`): never a data shard,
/// even when a pattern matches it.
pub fn is_index_name(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("index" | "idx")
    )
}

/// The index file beside a shard: `x.index` for `x.tfrecord`, else the shard name plus
/// `.index` (the `tfrecord` package's convention).
pub fn index_path_for(shard: &Path) -> PathBuf {
    match shard.extension().and_then(|e| e.to_str()) {
        Some("tfrecord" | "tfrecords" | "tfr") => shard.with_extension("index"),
        _ => {
            let mut name = shard.as_os_str().to_owned();
            name.push(".index");
            PathBuf::from(name)
        }
    }
}

/// Appends one index line, `"<offset> <length>\n"` (the `tfrecord` package's format, which
/// [`parse_index`] reads).
pub(super) fn push_index_line(index: &mut String, offset: u64, len: u64) {
    use std::fmt::Write as _;
    let _ = writeln!(index, "{offset} {len}");
}

/// The shortest TFRecord frame: its header (length and its checksum) and the data's checksum,
/// around no data.
const MIN_FRAME_BYTES: u64 = (super::framing::HEADER_BYTES + super::framing::FOOTER_BYTES) as u64;

/// Parses an index: one `"<offset> <length>"` line per record.
pub(crate) fn parse_index(path: &Path, text: &[u8]) -> Result<Vec<(u64, u64)>> {
    let text = std::str::from_utf8(text)
        .map_err(|_| Error::not_a_dataset(path, "index file is not text"))?;
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(number, line)| {
            let mut parts = line.split_whitespace();
            let parse = |s: Option<&str>| s.and_then(|s| s.parse::<u64>().ok());
            match (parse(parts.next()), parse(parts.next()), parts.next()) {
                // No frame is shorter than its header and footer: a hostile index of three
                // million `0 0` lines opened as three million records and took 2 GB to
                // inspect; and an end past u64 overflowed the sums made of it.
                (Some(offset), Some(len), None)
                    if len < MIN_FRAME_BYTES || offset.checked_add(len).is_none() =>
                {
                    Err(Error::not_a_dataset(
                        path,
                        format!(
                            "index line {} lists a record of {len} bytes at {offset}, which no \
                             shard holds (a frame takes at least {MIN_FRAME_BYTES} bytes)",
                            number + 1
                        ),
                    ))
                }
                (Some(offset), Some(len), None) => Ok((offset, len)),
                _ => Err(Error::not_a_dataset(
                    path,
                    format!(
                        "index line {} is not \"<offset> <length>\": {line:?}",
                        number + 1
                    ),
                )),
            }
        })
        .collect()
}

/// Refuses an index that does not account for every byte of its shard: its records must follow
/// one another from byte 0 to at least the shard's end. A stale or cut index would otherwise make
/// the records it does not list silently unreachable. (An index reaching past the end is a cut
/// shard: the records past the end read as bad records that say so.) Returns where the index
/// says the shard ends.
pub(crate) fn check_index_covers(
    index_path: &Path,
    records: &[(u64, u64)],
    shard_len: u64,
) -> Result<u64> {
    let mut end = 0u64;
    for (number, &(offset, len)) in records.iter().enumerate() {
        if offset != end {
            return Err(Error::not_a_dataset(
                index_path,
                format!(
                    "record {number} starts at byte {offset}, but the one before ends at {end}: \
                     the index does not match its shard (delete it to have it rebuilt)"
                ),
            ));
        }
        end = offset.saturating_add(len);
    }
    if end < shard_len {
        return Err(Error::not_a_dataset(
            index_path,
            format!(
                "lists records up to byte {end} but the shard has {shard_len} bytes: the index or \
                 the shard was changed (delete the index to have it rebuilt)"
            ),
        ));
    }
    Ok(end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_index_must_cover_its_shard() {
        let path = Path::new("x.index");
        assert_eq!(
            check_index_covers(path, &[(0, 21), (21, 29)], 50).unwrap(),
            50
        );
        // A shard cut after its index was written: the last record reads as truncated.
        assert_eq!(
            check_index_covers(path, &[(0, 21), (21, 29)], 40).unwrap(),
            50
        );
        let short = check_index_covers(path, &[(0, 21)], 50).unwrap_err();
        assert!(
            short
                .to_string()
                .contains("up to byte 21 but the shard has 50")
        );
        let gap = check_index_covers(path, &[(0, 21), (30, 20)], 50).unwrap_err();
        assert!(gap.to_string().contains("record 1 starts at byte 30"));
    }

    #[test]
    fn an_index_line_no_frame_fits_is_refused() {
        let path = Path::new("x.index");
        assert_eq!(
            parse_index(path, b"0 16\n16 20\n").unwrap(),
            [(0, 16), (16, 20)]
        );
        // Records shorter than a frame (a hostile index of millions of `0 0` lines opened as
        // millions of records), and one ending past u64 (its sums overflowed).
        for (text, line) in [
            (&b"0 0\n0 0\n"[..], 1),
            (b"0 16\n16 15\n", 2),
            (b"16 18446744073709551600\n", 1),
            (b"0 16\n18446744073709551600 100\n", 2),
        ] {
            let err = parse_index(path, text).unwrap_err();
            assert!(
                matches!(&err, Error::NotADataset { reason, .. }
                    if reason.starts_with(&format!("index line {line} lists a record of"))),
                "{err}"
            );
        }
    }
}
