//! Command-line pieces the binaries share (feature `cli`), as ripgrep's `grep-cli` holds what its
//! tools share: the reading options every command that opens a dataset takes, so `pack-dataset
//! inspect/verify/index/convert` and `imagefeed-bench load/read` spell and document them once.

use std::path::PathBuf;
use std::sync::Arc;

use crate::dataset::Dataset;
use crate::error::Result;
use crate::format::{self, OpenOptions};
use crate::loader::MaxBad;

/// How to read a dataset other tools wrote, and sets of shards ([`OpenOptions`]).
#[derive(clap::Args, Debug, Clone)]
pub struct ReadingArgs {
    /// h5py input: the dataset holding the images (variable-length uint8, or N×H×W×C uint8).
    #[arg(long, default_value = "images", value_name = "NAME")]
    pub images_dataset: String,
    /// h5py input: the dataset holding the labels.
    #[arg(long, default_value = "labels", value_name = "NAME")]
    pub labels_dataset: String,
    /// TFRecord input without a manifest: the smallest label (ImageNet TFRecords: 1).
    #[arg(long, value_name = "BASE")]
    pub input_label_base: Option<u32>,
    /// TFRecord input without a manifest: the number of classes (else found by a scan).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=crate::dataset::MAX_CLASSES as i64))]
    pub num_classes: Option<u32>,
    /// Read a set of shards (NAME-NNNNN-of-TTTTT), or a records or MDS dataset whose index
    /// lists shards that are gone, with those members missing, on purpose, instead of refusing
    /// it.
    #[arg(long)]
    pub allow_missing_shards: bool,
    /// A dataset in object storage: read each record with a ranged GET of its own instead of
    /// fetching whole shards into the cache (record shards with their index; a loader
    /// worker starts each batch's reads together, other commands read one at a time).
    #[arg(long)]
    pub ranged_reads: bool,
}

impl ReadingArgs {
    /// The options these flags ask for.
    pub fn open_options(&self) -> OpenOptions {
        let mut options = OpenOptions::default()
            .with_hdf5_names(self.images_dataset.clone(), self.labels_dataset.clone())
            .with_allow_missing_shards(self.allow_missing_shards)
            .with_ranged_reads(self.ranged_reads);
        options.records.label_base = self.input_label_base;
        options.records.num_classes = self.num_classes.map(|n| n as usize);
        options
    }
}

/// Opens what a command's `DATASET...` arguments name: one path (a file, a directory, or a
/// quoted pattern such as `'DIR/train-*'`), or several shard files (what a shell makes of an
/// unquoted pattern) read as one dataset.
pub fn open(paths: &[PathBuf], options: &OpenOptions) -> Result<Arc<dyn Dataset>> {
    match paths {
        [one] => format::open_with(one, options),
        _ => format::open_files(paths, options),
    }
}

/// What `DATASET...` arguments name, for messages: the path, or the first and a count.
pub fn describe(paths: &[PathBuf]) -> String {
    match paths {
        [one] => one.display().to_string(),
        [first, rest @ ..] => format!("{} (and {} more files)", first.display(), rest.len()),
        [] => "no dataset".into(),
    }
}

/// A `--max-bad` value: a cap, or none. Parsed by [`parse_max_bad`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaxBadArg(pub Option<MaxBad>);

impl std::str::FromStr for MaxBadArg {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<Self, String> {
        parse_max_bad(text).map(MaxBadArg)
    }
}

/// Parses `--max-bad`: a count (`10`), a fraction of the epoch (`0.01`, `1%`), or `none`.
pub fn parse_max_bad(text: &str) -> std::result::Result<Option<MaxBad>, String> {
    let text = text.trim();
    if text.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    if let Some(percent) = text.strip_suffix('%') {
        return match percent.trim().parse::<f64>() {
            Ok(p) if (0.0..=100.0).contains(&p) => Ok(Some(MaxBad::Fraction(p / 100.0))),
            _ => Err(format!("{text:?}: a percentage must be 0%..100%")),
        };
    }
    if let Ok(count) = text.parse::<u64>() {
        return Ok(Some(MaxBad::Count(count)));
    }
    match text.parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(Some(MaxBad::Fraction(f))),
        _ => Err(format!(
            "{text:?}: expected a count (10), a fraction of the epoch (0.01 or 1%), or none"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_bad_takes_counts_fractions_percentages_and_none() {
        assert_eq!(parse_max_bad("10"), Ok(Some(MaxBad::Count(10))));
        assert_eq!(parse_max_bad("0.25"), Ok(Some(MaxBad::Fraction(0.25))));
        assert_eq!(parse_max_bad("5%"), Ok(Some(MaxBad::Fraction(0.05))));
        assert_eq!(parse_max_bad("None"), Ok(None));
        for bad in ["-1", "1.5", "200%", "lots", ""] {
            assert!(parse_max_bad(bad).is_err(), "{bad}");
        }
    }
}
