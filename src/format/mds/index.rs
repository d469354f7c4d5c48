//! `index.json` of a Mosaic MDS dataset: the shards it lists, and which of their columns hold
//! the image and the label.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};

/// The name of the index file at the top of an MDS dataset.
pub const INDEX: &str = "index.json";

/// The most bytes an `index.json` may have (ImageNet's, with 300 shards, is under 200 KB).
pub const MAX_INDEX_BYTES: u64 = 256 << 20;

/// `index.json`, as Streaming writes it (fields it does not need are ignored).
#[derive(Debug, Deserialize)]
struct RawIndex {
    version: Option<u64>,
    shards: Vec<RawShard>,
}

#[derive(Debug, Deserialize)]
struct RawShard {
    format: String,
    #[serde(default)]
    version: Option<u64>,
    #[serde(default)]
    column_names: Vec<String>,
    #[serde(default)]
    column_encodings: Vec<String>,
    #[serde(default)]
    column_sizes: Vec<Option<u64>>,
    #[serde(default)]
    compression: Option<String>,
    raw_data: RawFile,
    #[serde(default)]
    zip_data: Option<RawFile>,
    samples: u64,
}

#[derive(Debug, Deserialize)]
struct RawFile {
    basename: String,
    bytes: u64,
}

/// One shard the index lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardEntry {
    /// The uncompressed shard's path under the dataset (`shard.00000.mds`, or
    /// `part-0/shard.00000.mds` in a merged index), and its size.
    pub raw: (String, u64),
    /// The compressed shard, when the dataset was written with `compression=`: its path and
    /// how it was compressed.
    pub zip: Option<(String, ShardCompression)>,
    /// Samples in the shard.
    pub samples: usize,
}

/// How a shard was compressed (`compression="zstd"`, `"zstd:7"`, `"gz"`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardCompression {
    /// Zstandard.
    Zstd,
    /// gzip.
    Gzip,
}

/// How a column's value is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Its name.
    pub name: String,
    /// Streaming's encoding name (`jpeg`, `int`, ...).
    pub encoding: String,
    /// Its fixed size in bytes, or `None` when each sample says (a `u32` before the values).
    pub size: Option<u32>,
}

/// What an image column holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageColumn {
    /// An image file's bytes (`jpeg`, `png`, or `bytes`).
    Encoded,
    /// PIL's raw pixels (`pil`): `u32 width | u32 height | u32 mode length | mode | pixels`.
    Pil,
}

/// How a label column stores the label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LabelColumn {
    /// A little-endian integer of this many bytes, signed or not.
    Int {
        /// Its width in bytes (1, 2, 4 or 8).
        bytes: u8,
        /// Whether it is signed.
        signed: bool,
    },
    /// The integer as decimal text (`str_int`).
    Text,
}

/// The columns every shard has, and which hold the image and the label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The columns in stored order.
    pub columns: Vec<Column>,
    /// The image column's position, and what it holds.
    pub image: (usize, ImageColumn),
    /// The label column's position, and how it stores the label.
    pub label: (usize, LabelColumn),
    /// A `str` column that names each sample (`key`, `path`, ...), when there is one.
    pub key: Option<usize>,
}

impl Layout {
    /// How many columns are of variable size (each sample starts with their sizes).
    pub fn variable_columns(&self) -> usize {
        self.columns.iter().filter(|c| c.size.is_none()).count()
    }
}

/// A parsed index: the shards and the columns they share.
#[derive(Debug)]
pub struct Index {
    /// The shards, in the index's order (which is the sample order).
    pub shards: Vec<ShardEntry>,
    /// Their columns.
    pub layout: Layout,
    /// What opening says about the choice of columns (logged as notices when parsed).
    pub notes: Vec<String>,
}

/// Column names taken as the image when several columns could be (Streaming's converters use
/// `x`).
const IMAGE_NAMES: &[&str] = &["x", "image", "img", "jpg", "jpeg", "png", "webp"];
/// Column names taken as the label when several integer columns could be (Streaming's
/// converters use `y`; an ImageNet conversion also has the index `i`).
const LABEL_NAMES: &[&str] = &["y", "label", "labels", "cls", "class", "target", "targets"];
/// Names of a `str` column taken as the sample's key (else it is named `SHARD#N`).
const KEY_NAMES: &[&str] = &[
    "__key__",
    "key",
    "path",
    "filename",
    "file_name",
    "name",
    "id",
];

impl Index {
    /// Parses `text`, the index `path` names (for messages).
    pub fn parse(path: &Path, text: &[u8]) -> Result<Index> {
        let bad = |reason: String| Error::not_a_dataset(path, reason);
        let raw: RawIndex = serde_json::from_slice(text)
            .map_err(|e| bad(format!("not a Mosaic MDS index: {e}")))?;
        if let Some(version) = raw.version
            && version != 2
        {
            return Err(bad(format!(
                "MDS index version {version}; imagefeed reads version 2"
            )));
        }
        let mut layout: Option<(Vec<Column>, usize)> = None;
        let mut seen = std::collections::HashSet::new();
        let mut shards = Vec::with_capacity(raw.shards.len());
        for (number, shard) in raw.shards.into_iter().enumerate() {
            let at = |reason: String| bad(format!("shard {number} in the index: {reason}"));
            if shard.format != "mds" {
                return Err(at(format!(
                    "Streaming's {:?} format; imagefeed reads its \"mds\" shards",
                    shard.format
                )));
            }
            if let Some(version) = shard.version
                && version != 2
            {
                return Err(at(format!("shard version {version}; imagefeed reads 2")));
            }
            let columns = columns(&shard).map_err(at)?;
            match &layout {
                None => layout = Some((columns, number)),
                Some((first, first_number)) if *first != columns => {
                    return Err(at(format!(
                        "its columns ({}) differ from shard {first_number}'s ({}): an index \
                         merged from different datasets",
                        describe(&columns),
                        describe(first)
                    )));
                }
                Some(_) => {}
            }
            if shard.samples > u64::from(u32::MAX) {
                return Err(at(format!(
                    "{} samples; an MDS shard holds at most 2^32 - 1",
                    shard.samples
                )));
            }
            // The offsets alone take 4 bytes a sample: a count the index's own size for the
            // shard cannot hold is not believed (it would make billions of samples of a few
            // bytes).
            if shard.samples.saturating_mul(4).saturating_add(8) > shard.raw_data.bytes {
                return Err(at(format!(
                    "{} samples in {} bytes, too few for their offsets",
                    shard.samples, shard.raw_data.bytes
                )));
            }
            let raw_name = checked_basename(&shard.raw_data.basename).map_err(at)?;
            if !seen.insert(raw_name.clone()) {
                return Err(at(format!(
                    "{raw_name} is listed twice: its samples would be read twice"
                )));
            }
            let zip = match (&shard.compression, &shard.zip_data) {
                (None, _) => None,
                (Some(compression), Some(zip)) => Some((
                    checked_basename(&zip.basename).map_err(at)?,
                    compression_of(compression).map_err(at)?,
                )),
                (Some(compression), None) => {
                    return Err(at(format!(
                        "compression {compression:?} but no zip_data naming the compressed file"
                    )));
                }
            };
            shards.push(ShardEntry {
                raw: (raw_name, shard.raw_data.bytes),
                zip,
                samples: shard.samples as usize,
            });
        }
        let Some((columns, _)) = layout else {
            return Err(bad("the index lists no shards".into()));
        };
        let layout = choose(columns).map_err(bad)?;
        let mut notes = Vec::new();
        let label = &layout.columns[layout.label.0];
        let named_like_a_label =
            |c: &Column| LABEL_NAMES.iter().any(|n| c.name.eq_ignore_ascii_case(n));
        // A column named like the label that is not an integer column, beside the one integer
        // column taken instead (a hostile try: Streaming's ImageNet layout with `y` as float32
        // read the sample index `i` as the label, 60 classes of one sample).
        if !named_like_a_label(label) {
            if let Some(named) = layout.columns.iter().find(|c| named_like_a_label(c)) {
                return Err(bad(format!(
                    "column {:?} ({}) is named like the label but does not hold integers; the \
                     only integer column is {:?} ({}), which is not named like one: imagefeed \
                     reads integer labels (int, int8..int64, uint8..uint64, str_int)",
                    named.name, named.encoding, label.name, label.encoding
                )));
            }
            crate::dataset::notice(
                &mut notes,
                format!(
                    "{}: the label is column {:?} ({}), the only integer column; no column is \
                     named {}",
                    path.display(),
                    label.name,
                    label.encoding,
                    LABEL_NAMES.join(" or ")
                ),
            );
        }
        let image = &layout.columns[layout.image.0];
        if image.encoding == "bytes"
            && !IMAGE_NAMES
                .iter()
                .any(|n| image.name.eq_ignore_ascii_case(n))
        {
            crate::dataset::notice(
                &mut notes,
                format!(
                    "{}: the images are column {:?} (bytes), the only bytes column",
                    path.display(),
                    image.name
                ),
            );
        }
        Ok(Index {
            shards,
            layout,
            notes,
        })
    }
}

/// A shard's columns, checked.
fn columns(shard: &RawShard) -> std::result::Result<Vec<Column>, String> {
    let n = shard.column_names.len();
    let mut names = std::collections::HashSet::new();
    if let Some(twice) = shard.column_names.iter().find(|name| !names.insert(*name)) {
        return Err(format!("column {twice:?} is named twice"));
    }
    if shard.column_encodings.len() != n || shard.column_sizes.len() != n {
        return Err(format!(
            "{n} column names but {} encodings and {} sizes",
            shard.column_encodings.len(),
            shard.column_sizes.len()
        ));
    }
    (0..n)
        .map(|i| {
            let size = match shard.column_sizes[i] {
                None => None,
                Some(size) => Some(u32::try_from(size).map_err(|_| {
                    format!(
                        "column {:?} has a fixed size of {size} bytes",
                        shard.column_names[i]
                    )
                })?),
            };
            Ok(Column {
                name: shard.column_names[i].clone(),
                encoding: shard.column_encodings[i].clone(),
                size,
            })
        })
        .collect()
}

fn describe(columns: &[Column]) -> String {
    // The fixed size too: shards whose columns differ only there (a hostile try) must not be
    // described by two identical lists.
    columns
        .iter()
        .map(|c| match c.size {
            Some(size) => format!("{}: {} ({size} bytes)", c.name, c.encoding),
            None => format!("{}: {}", c.name, c.encoding),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A shard's path under the dataset, refused when it could leave it (absolute, or `..`).
fn checked_basename(name: &str) -> std::result::Result<String, String> {
    let path = Path::new(name);
    let inside = !name.is_empty()
        && path.is_relative()
        && path
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
    if inside {
        Ok(name.to_string())
    } else {
        Err(format!(
            "shard file {name:?} is not a path inside the dataset"
        ))
    }
}

fn compression_of(name: &str) -> std::result::Result<ShardCompression, String> {
    // Streaming writes `algorithm` or `algorithm:level`.
    match name.split(':').next().unwrap_or(name) {
        "zstd" => Ok(ShardCompression::Zstd),
        "gz" => Ok(ShardCompression::Gzip),
        other => Err(format!(
            "shards compressed with {other:?}; imagefeed reads zstd and gz (or uncompressed) \
             MDS shards"
        )),
    }
}

/// The encodings whose value is an image.
fn image_kind(encoding: &str) -> Option<ImageColumn> {
    match encoding {
        "jpeg" | "png" => Some(ImageColumn::Encoded),
        "pil" => Some(ImageColumn::Pil),
        _ => None,
    }
}

/// The encodings whose value is an integer.
fn label_kind(encoding: &str) -> Option<LabelColumn> {
    let int = |bytes, signed| Some(LabelColumn::Int { bytes, signed });
    match encoding {
        "int" | "int64" => int(8, true),
        "int32" => int(4, true),
        "int16" => int(2, true),
        "int8" => int(1, true),
        "uint64" => int(8, false),
        "uint32" => int(4, false),
        "uint16" => int(2, false),
        "uint8" => int(1, false),
        "str_int" => Some(LabelColumn::Text),
        _ => None,
    }
}

/// Picks the image and label columns: the only candidate, else the one named like one
/// ([`IMAGE_NAMES`], [`LABEL_NAMES`]). Pickled columns are never candidates: imagefeed does
/// not unpickle, and says so when one is all there is.
fn choose(columns: Vec<Column>) -> std::result::Result<Layout, String> {
    for column in &columns {
        let expected = match column.encoding.as_str() {
            "int" | "int64" | "uint64" => Some(8),
            "int32" | "uint32" => Some(4),
            "int16" | "uint16" => Some(2),
            "int8" | "uint8" => Some(1),
            _ => None,
        };
        if let Some(expected) = expected
            && column.size != Some(expected)
        {
            return Err(format!(
                "column {:?} ({}) is stored as {} bytes, not {expected}",
                column.name,
                column.encoding,
                column.size.map_or("variable".into(), |s| s.to_string())
            ));
        }
    }
    let pickled: Vec<&str> = columns
        .iter()
        .filter(|c| c.encoding == "pkl")
        .map(|c| c.name.as_str())
        .collect();
    let pickle_note = if pickled.is_empty() {
        String::new()
    } else {
        format!(
            "; column(s) {} are pickled (pkl), which imagefeed never unpickles",
            pickled.join(", ")
        )
    };
    // Image-encoded columns first; a `bytes` column only where there is none.
    let image = if columns.iter().any(|c| image_kind(&c.encoding).is_some()) {
        pick(&columns, IMAGE_NAMES, |c| image_kind(&c.encoding), "image")
    } else {
        pick(
            &columns,
            IMAGE_NAMES,
            |c| (c.encoding == "bytes").then_some(ImageColumn::Encoded),
            "image",
        )
    }
    .map_err(|e| format!("{e} (columns: {}){pickle_note}", describe(&columns)))?;
    let label = pick(&columns, LABEL_NAMES, |c| label_kind(&c.encoding), "label")
        .map_err(|e| format!("{e} (columns: {}){pickle_note}", describe(&columns)))?;
    let key = KEY_NAMES.iter().find_map(|name| {
        columns
            .iter()
            .position(|c| c.encoding == "str" && c.name.eq_ignore_ascii_case(name))
    });
    Ok(Layout {
        columns,
        image,
        label,
        key,
    })
}

/// The one column `kind` accepts, or the one of several named like `names` say.
fn pick<T: Copy>(
    columns: &[Column],
    names: &[&str],
    kind: impl Fn(&Column) -> Option<T>,
    what: &str,
) -> std::result::Result<(usize, T), String> {
    let candidates: Vec<(usize, T)> = columns
        .iter()
        .enumerate()
        .filter_map(|(i, c)| kind(c).map(|k| (i, k)))
        .collect();
    match candidates.as_slice() {
        [] => Err(format!("no {what} column")),
        [one] => Ok(*one),
        several => {
            for name in names {
                if let Some(found) = several
                    .iter()
                    .find(|(i, _)| columns[*i].name.eq_ignore_ascii_case(name))
                {
                    return Ok(*found);
                }
            }
            Err(format!(
                "{} columns could be the {what} ({}), and none is named {}",
                several.len(),
                several
                    .iter()
                    .map(|(i, _)| columns[*i].name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                names.join(" or ")
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(columns: &str) -> String {
        format!(
            r#"{{"version": 2, "shards": [{{"format": "mds", "version": 2, {columns},
            "compression": null, "raw_data": {{"basename": "shard.00000.mds", "bytes": 100}},
            "zip_data": null, "samples": 1}}]}}"#
        )
    }

    fn parse(text: &str) -> Result<Index> {
        Index::parse(Path::new("index.json"), text.as_bytes())
    }

    #[test]
    fn the_image_and_label_columns_are_found_by_encoding_then_by_name() {
        let imagenet = parse(&index(
            r#""column_names": ["i", "x", "y"], "column_encodings": ["int", "jpeg", "int"],
            "column_sizes": [8, null, 8]"#,
        ))
        .unwrap();
        assert_eq!(imagenet.layout.image, (1, ImageColumn::Encoded));
        assert_eq!(
            imagenet.layout.label,
            (
                2,
                LabelColumn::Int {
                    bytes: 8,
                    signed: true
                }
            )
        );
        let bytes = parse(&index(
            r#""column_names": ["caption", "image", "label"],
            "column_encodings": ["bytes", "bytes", "uint16"], "column_sizes": [null, null, 2]"#,
        ))
        .unwrap();
        assert_eq!(bytes.layout.image, (1, ImageColumn::Encoded));
        assert_eq!(bytes.layout.label.0, 2);
    }

    #[test]
    fn ambiguous_pickled_and_unknown_layouts_are_refused_naming_why() {
        let message = |text: &str| match parse(text) {
            Err(Error::NotADataset { reason, .. }) => reason,
            other => panic!("expected NotADataset, got {other:?}"),
        };
        let two = message(&index(
            r#""column_names": ["a", "b", "y"], "column_encodings": ["jpeg", "png", "int"],
            "column_sizes": [null, null, 8]"#,
        ));
        assert!(two.contains("a, b"), "{two}");
        let pickled = message(&index(
            r#""column_names": ["x", "y"], "column_encodings": ["pkl", "int"],
            "column_sizes": [null, 8]"#,
        ));
        assert!(pickled.contains("never unpickles"), "{pickled}");
        let json = message(&index(
            r#""column_names": ["x"], "column_encodings": ["jpeg"], "column_sizes": [null]"#,
        ));
        assert!(json.contains("no label column"), "{json}");
        let other_format = message(&index(r#""column_names": []"#).replace("\"mds\"", "\"json\""));
        assert!(other_format.contains("\"json\""), "{other_format}");
        let escape = message(
            &index(
                r#""column_names": ["x", "y"], "column_encodings": ["jpeg", "int"],
                "column_sizes": [null, 8]"#,
            )
            .replace("shard.00000.mds", "../../etc/passwd"),
        );
        assert!(escape.contains("not a path inside"), "{escape}");
        let wrong_size = message(&index(
            r#""column_names": ["x", "y"], "column_encodings": ["jpeg", "int"],
            "column_sizes": [null, 4]"#,
        ));
        assert!(wrong_size.contains("not 8"), "{wrong_size}");
        // Two shards whose columns differ only in a fixed size: the message shows the sizes.
        let shard = |sizes: &str, number: u32| {
            format!(
                r#"{{"format": "mds", "version": 2, "column_names": ["x", "y"],
                "column_encodings": ["jpeg", "bytes"], "column_sizes": {sizes},
                "compression": null, "raw_data": {{"basename": "shard.{number:05}.mds",
                "bytes": 100}}, "zip_data": null, "samples": 1}}"#
            )
        };
        let merged = message(&format!(
            r#"{{"version": 2, "shards": [{}, {}]}}"#,
            shard("[null, 8]", 0),
            shard("[null, 4]", 1)
        ));
        assert!(
            merged.contains("y: bytes (4 bytes)") && merged.contains("y: bytes (8 bytes)"),
            "{merged}"
        );
        let brotli = message(
            &index(
                r#""column_names": ["x", "y"], "column_encodings": ["jpeg", "int"],
                "column_sizes": [null, 8]"#,
            )
            .replace(r#""compression": null"#, r#""compression": "br:11""#)
            .replace(
                r#""zip_data": null"#,
                r#""zip_data": {"basename": "shard.00000.mds.br", "bytes": 5}"#,
            ),
        );
        assert!(brotli.contains("\"br\""), "{brotli}");
        assert!(matches!(parse("[1, 2]"), Err(Error::NotADataset { .. })));
        let twice = message(&index(
            r#""column_names": ["y", "x", "y"], "column_encodings": ["int", "jpeg", "int"],
            "column_sizes": [8, null, 8]"#,
        ));
        assert!(twice.contains("named twice"), "{twice}");
        let one_shard = index(
            r#""column_names": ["x", "y"], "column_encodings": ["jpeg", "int"],
            "column_sizes": [null, 8]"#,
        );
        let shard =
            &one_shard[one_shard.find("{\"format\"").unwrap()..one_shard.rfind(']').unwrap()];
        let listed_twice = message(&format!(
            r#"{{"version": 2, "shards": [{shard}, {shard}]}}"#
        ));
        assert!(listed_twice.contains("listed twice"), "{listed_twice}");
    }

    #[test]
    fn a_label_column_not_named_like_one_is_taken_with_a_note() {
        let width = parse(&index(
            r#""column_names": ["caption", "image", "width"],
            "column_encodings": ["str", "jpeg", "int"], "column_sizes": [null, null, 8]"#,
        ))
        .unwrap();
        assert_eq!(width.layout.label.0, 2);
        assert!(
            width.notes.iter().any(|n| n.contains("\"width\"")),
            "{:?}",
            width.notes
        );
        let named = parse(&index(
            r#""column_names": ["x", "y"], "column_encodings": ["jpeg", "int"],
            "column_sizes": [null, 8]"#,
        ))
        .unwrap();
        assert!(named.notes.is_empty(), "{:?}", named.notes);
    }

    #[test]
    fn a_label_named_column_that_is_not_integers_refuses_the_index_column() {
        // Streaming's ImageNet layout with the label stored as float32: `i` (the sample index)
        // was taken as the label, without a word.
        let Err(err) = parse(&index(
            r#""column_names": ["i", "x", "y"], "column_encodings": ["int", "jpeg", "float32"],
            "column_sizes": [8, null, 4]"#,
        )) else {
            panic!("opened");
        };
        assert!(
            matches!(&err, Error::NotADataset { reason, .. }
                if reason.contains("\"y\" (float32) is named like the label")
                    && reason.contains("\"i\"")),
            "{err}"
        );
    }
}
