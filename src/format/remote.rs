//! Opening a dataset a URL names (`s3://bucket/prefix/`, `gs://…`, `az://…`, `https://…`):
//! which objects it selects, and which format's reader takes them.
//!
//! A URL names, as a local path does: a prefix (a "directory": every shard directly under it;
//! one set only), a pattern or brace list in its last part (`…/train-*`,
//! `…/shard-{000000..000146}.tar`), or one object. A prefix holding `imagefeed-records.json` is
//! one of ours; one holding `index.json` is Mosaic MDS; otherwise TFRecord shards by name, or
//! WebDataset `*.tar` shards. Sets are
//! checked as local sets are ([`crate::format::shards`]).

use std::path::PathBuf;
use std::sync::Arc;

use crate::cache::Cache;
use crate::dataset::Dataset;
use crate::error::{Error, Result};
use crate::format::shards::{self, ShardSetProblem, check_sets};
use crate::format::{OpenOptions, mds, tfrecord, webdataset};
use crate::remote::RemoteUrl;
use crate::remote::store::{self, ObjectInfo, Patience};

/// What a URL opened as.
pub(crate) enum Opened {
    Records(tfrecord::Records),
    Other(Arc<dyn Dataset>),
}

/// Opens the dataset `text` (a URL) names.
pub(crate) fn open_url(text: &str, options: &OpenOptions) -> Result<Arc<dyn Dataset>> {
    Ok(match open(text, options)? {
        Opened::Records(records) => Arc::new(records),
        Opened::Other(dataset) => dataset,
    })
}

/// Opens the TFRecord shards `text` (a URL) names; anything else is an error.
pub(crate) fn open_records_url(text: &str, options: &OpenOptions) -> Result<tfrecord::Records> {
    match open(text, options)? {
        Opened::Records(records) => Ok(records),
        Opened::Other(dataset) => Err(Error::not_a_dataset(
            dataset.path(),
            format!(
                "{} shards, not TFRecord shards",
                dataset.info().format.name()
            ),
        )),
    }
}

/// The shards of ours a pattern (`picked`) under `dir` would pick and that are not among
/// `objects`, what it picked, when `dir` is a prefix of ours
/// ([`picked_members_missing`](shards::picked_members_missing)), and its manifest when the
/// objects are all its shards ([`claiming`](tfrecord::Manifest::claiming)). An upload
/// of ours that did not finish is refused as its prefix is: a hostile try killed a pack to S3
/// and read `PREFIX/shard-*` as a whole dataset of a third of the records.
fn missing_from_our_manifest(
    dir: &RemoteUrl,
    label: &std::path::Path,
    listing: &[ObjectInfo],
    picked: shards::Picked<'_>,
    objects: &[ObjectInfo],
    options: &OpenOptions,
) -> Result<(Vec<String>, Option<tfrecord::Manifest>)> {
    if crate::format::upload::is_unfinished(listing) {
        return Err(Error::Incomplete {
            path: label.to_path_buf(),
            reason: format!(
                "its shards are an upload of ours that did not finish ({dir} has no manifest \
                 yet): rerun the pack with --resume to finish it"
            ),
        });
    }
    if !listing
        .iter()
        .any(|o| o.url.file_name() == tfrecord::MANIFEST)
    {
        return Ok((Vec::new(), None));
    }
    let manifest = tfrecord::remote::our_manifest(dir)?;
    let missing = shards::picked_members_missing(
        label,
        manifest.shard_files(),
        picked,
        |name| objects.iter().any(|o| o.url.file_name() == name),
        objects.len(),
        options.allow_missing_shards,
    )?;
    let names = objects.iter().map(|o| o.url.file_name());
    Ok((
        missing,
        manifest.claiming(&PathBuf::from(dir.to_string()), names)?,
    ))
}

fn open(text: &str, options: &OpenOptions) -> Result<Opened> {
    let url = RemoteUrl::parse(text)?.with_options(&options.storage_options);
    let cache = options.cache_or_env()?;
    let name = url.file_name().to_string();
    let label = PathBuf::from(url.to_string());
    if name == mds::index::INDEX {
        // An MDS dataset named by its index: the prefix holding it.
        refuse_ranged(options, &label, "Mosaic MDS")?;
        let dir = url.parent();
        let listing = store::list_dir(&dir, Patience::Open)?;
        let dataset = mds::remote::open(&dir, &listing, options, &cache)?;
        return Ok(Opened::Other(Arc::new(dataset)));
    }
    if name == tfrecord::MANIFEST {
        return Err(tfrecord::manifest_named(
            &label,
            format_args!("its prefix, {}", url.parent()),
        ));
    }
    let pattern = names_a_pattern(&name);
    // The index files beside the shards (ours, `shard-NNNNN.index`; the `tfrecord` package's
    // `NAME.index`), from the listing that found the shards; the manifest of ours beside the
    // shards a pattern picks (its classes, not inferred).
    let mut ours = None;
    let (objects, picked, brace_missing, beside) = if pattern {
        let dir = url.parent();
        let listing = store::list_dir(&dir, Patience::Open)?;
        let (objects, mut missing) = select(&url, &name, &listing, options)?;
        let picked = shards::Picked::by_pattern(&name);
        let (gone, manifest) =
            missing_from_our_manifest(&dir, &label, &listing, picked, &objects, options)?;
        missing.extend(gone);
        ours = manifest;
        (objects, picked, missing, index_objects(listing))
    } else if !url.key().is_empty()
        && !url.key().ends_with('/')
        && let Some(object) = store::head(&url, Patience::Open)?
    {
        if !is_shard(&object) {
            refuse_ranged(options, &label, "a single-file dataset (LMDB, HDF5)")?;
            return open_single_file(&object, options, &cache).map(Opened::Other);
        }
        let beside_url = object
            .url
            .parent()
            .join(&tfrecord::remote::beside_index_name(object.url.file_name()));
        let beside = store::head(&beside_url, Patience::Open)?;
        ours = manifest_listing(&object)?;
        (
            vec![object],
            shards::Picked::ByName,
            Vec::new(),
            beside.into_iter().collect(),
        )
    } else {
        let listing = store::list_dir(&url, Patience::Open)?;
        if crate::format::upload::is_unfinished(&listing) {
            return Err(Error::Incomplete {
                path: label,
                reason: "an upload of ours that did not finish (no manifest yet): rerun the pack \
                         with --resume to finish it"
                    .into(),
            });
        }
        if listing
            .iter()
            .any(|o| o.url.file_name() == tfrecord::MANIFEST)
        {
            return tfrecord::remote::open_ours(&url, &listing, options, &cache)
                .map(Opened::Records);
        }
        if mds::remote::holds_index(&listing) {
            refuse_ranged(options, &label, "Mosaic MDS")?;
            let dataset = mds::remote::open(&url, &listing, options, &cache)?;
            return Ok(Opened::Other(Arc::new(dataset)));
        }
        let shards: Vec<ObjectInfo> = listing.iter().filter(|o| is_shard(o)).cloned().collect();
        if shards.is_empty() {
            return Err(Error::not_a_dataset(
                &label,
                if listing.is_empty() {
                    "no object under this prefix (wrong bucket or prefix?)".to_string()
                } else {
                    format!(
                        "none of its {} objects is a TFRecord or WebDataset shard, and it has \
                         no {}",
                        listing.len(),
                        tfrecord::MANIFEST
                    )
                },
            ));
        }
        (
            shards,
            shards::Picked::All,
            Vec::new(),
            index_objects(listing),
        )
    };
    let names: Vec<PathBuf> = objects
        .iter()
        .map(|o| PathBuf::from(o.url.to_string()))
        .collect();
    let mut set = if names.len() > 1 || picked != shards::Picked::ByName {
        check_sets(&label, &names, picked, options.allow_missing_shards)?
    } else {
        shards::SetReport::default()
    };
    set.add_missing(brace_missing);
    let tars = objects
        .iter()
        .all(|o| webdataset::is_shard_name(std::path::Path::new(o.url.file_name())));
    if tars {
        refuse_ranged(
            options,
            &label,
            "WebDataset (a tar has no index of its members)",
        )?;
        let dataset = webdataset::remote::open(&url, &objects, set, options, &cache)?;
        return Ok(Opened::Other(Arc::new(dataset)));
    }
    let dir = objects
        .first()
        .map_or_else(|| url.clone(), |o| o.url.parent());
    let indexes = tfrecord::remote::Indexes {
        saved: store::list_dir(&dir.join(tfrecord::INDEX_DIR), Patience::Open)?,
        beside,
    };
    tfrecord::remote::open_foreign(&url, &objects, (set, ours), &indexes, options, &cache)
        .map(Opened::Records)
}

/// Whether the last part of a URL (`name`) is a pattern or brace list rather than an object's
/// or prefix's name.
fn names_a_pattern(name: &str) -> bool {
    name.contains(['*', '?', '[']) || (name.contains('{') && name.contains('}'))
}

/// What the objects `text` (a URL) names take in storage, as [`open`] selects them: the
/// objects a pattern or brace list picks, the one object named, or every object directly under
/// a prefix (the dataset's own files, as a local directory's are counted).
pub(crate) fn stored_bytes(text: &str, options: &OpenOptions) -> Result<u64> {
    let url = RemoteUrl::parse(text)?.with_options(&options.storage_options);
    let name = url.file_name().to_string();
    let pattern = names_a_pattern(&name);
    let objects = if pattern {
        let listing = store::list_dir(&url.parent(), Patience::Open)?;
        let options = options.clone().with_allow_missing_shards(true);
        select(&url, &name, &listing, &options)?.0
    } else if name == mds::index::INDEX {
        store::list_dir(&url.parent(), Patience::Open)?
    } else if !url.key().is_empty()
        && !url.key().ends_with('/')
        && let Some(object) = store::head(&url, Patience::Open)?
    {
        vec![object]
    } else {
        store::list_dir(&url, Patience::Open)?
    };
    Ok(objects.iter().map(|o| o.size).sum())
}

/// The manifest of the dataset of ours that lists the shard `object`, if one does.
fn manifest_listing(object: &ObjectInfo) -> Result<Option<tfrecord::Manifest>> {
    let dir = object.url.parent();
    if store::head(&dir.join(tfrecord::MANIFEST), Patience::Open)?.is_none() {
        return Ok(None);
    }
    tfrecord::remote::our_manifest(&dir)?.claiming(
        &PathBuf::from(dir.to_string()),
        std::iter::once(object.url.file_name()),
    )
}

/// The objects of `listing` named like index files.
fn index_objects(listing: Vec<ObjectInfo>) -> Vec<ObjectInfo> {
    listing
        .into_iter()
        .filter(|o| tfrecord::is_index_name(std::path::Path::new(o.url.file_name())))
        .collect()
}

/// With [`OpenOptions::ranged_reads`], a dataset of `format` is refused: its records' places
/// are not known without fetching its files whole, which the option asked not to do.
fn refuse_ranged(options: &OpenOptions, label: &std::path::Path, format: &str) -> Result<()> {
    if !options.ranged_reads {
        return Ok(());
    }
    Err(Error::Config(format!(
        "{}: ranged reads need each record's place at open (record shards with their index); \
         {format} is read by fetching its files whole: open it without ranged reads",
        label.display()
    )))
}

/// A single-file dataset (LMDB, HDF5) in object storage: fetched whole into the cache, then
/// opened like a local file; the cache entry is held while the dataset is open.
fn open_single_file(
    object: &ObjectInfo,
    options: &OpenOptions,
    cache: &Cache,
) -> Result<Arc<dyn Dataset>> {
    let cached = crate::remote::fetch::fetch(object, cache)?;
    let inner = crate::format::open_with(&cached.path, options)?;
    Ok(Arc::new(Fetched {
        inner,
        url: PathBuf::from(object.url.to_string()),
        _held: cached,
    }))
}

/// A dataset opened from a cache entry, holding the entry (and naming the URL it came from).
struct Fetched {
    inner: Arc<dyn Dataset>,
    url: PathBuf,
    _held: crate::cache::CachedFile,
}

impl Dataset for Fetched {
    fn info(&self) -> &crate::dataset::DatasetInfo {
        self.inner.info()
    }
    fn path(&self) -> &std::path::Path {
        &self.url
    }
    fn open_reader(&self) -> Result<Box<dyn crate::dataset::RecordReader>> {
        self.inner.open_reader()
    }
    fn notices(&self) -> &[String] {
        self.inner.notices()
    }
}

/// True when `object` is named like a shard of a format read from object storage.
fn is_shard(object: &ObjectInfo) -> bool {
    let name = std::path::Path::new(object.url.file_name());
    tfrecord::is_shard_name(name) || webdataset::is_shard_name(name)
}

/// The objects of `listing` a pattern or brace list (`name`, the last part of `url`) selects,
/// in name order (a brace list: in its order), and the brace-listed names that are missing
/// when that is allowed.
fn select(
    url: &RemoteUrl,
    name: &str,
    listing: &[ObjectInfo],
    options: &OpenOptions,
) -> Result<(Vec<ObjectInfo>, Vec<String>)> {
    let label = PathBuf::from(url.to_string());
    let find = |n: &str| listing.iter().find(|o| o.url.file_name() == n).cloned();
    if !name.contains(['*', '?', '[']) {
        let names = shards::expand_braces(name).map_err(|e| Error::not_a_dataset(&label, e))?;
        let (mut found, mut missing) = (Vec::new(), Vec::new());
        for n in names {
            match find(&n) {
                Some(object) => found.push(object),
                None => missing.push(n),
            }
        }
        if !missing.is_empty() && !options.allow_missing_shards {
            return Err(Error::ShardSet {
                path: label,
                problem: ShardSetProblem::Missing {
                    set: name.to_string(),
                    count: missing.len() as u64,
                    expected: (missing.len() + found.len()) as u64,
                    missing: missing.into_iter().take(10).collect(),
                    in_their_place: Vec::new(),
                },
            });
        }
        if found.is_empty() {
            return Err(Error::ShardSet {
                path: label,
                problem: ShardSetProblem::NoMatch,
            });
        }
        return Ok((found, missing));
    }
    let matcher = glob::Pattern::new(name)
        .map_err(|e| Error::not_a_dataset(&label, format!("not a valid pattern: {e}")))?;
    let options_glob = glob::MatchOptions {
        case_sensitive: true,
        require_literal_separator: true,
        require_literal_leading_dot: true,
    };
    let found: Vec<ObjectInfo> = listing
        .iter()
        .filter(|o| matcher.matches_with(o.url.file_name(), options_glob))
        .filter(|o| !tfrecord::is_never_a_shard(o.url.file_name()))
        .cloned()
        .collect();
    if found.is_empty() {
        return Err(Error::ShardSet {
            path: label,
            problem: ShardSetProblem::NoMatch,
        });
    }
    Ok((found, Vec::new()))
}
