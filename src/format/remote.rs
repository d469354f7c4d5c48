//! Opening a dataset a URL names (`s3://bucket/prefix/`, `gs://…`, `az://…`, `https://…`):
//! which objects it selects, and which format's reader takes them.
//!
//! A URL names, as a local path does: a prefix (a "directory": every shard directly under it;
//! one set only), a pattern or brace list in its last part (`…/train-*`,
//! `…/shard-{000000..000146}.tar`), or one object. A prefix holding `imagefeed-records.json` is
//! one of ours; otherwise TFRecord shards by name, or WebDataset `*.tar` shards. Sets are
//! checked as local sets are ([`crate::format::shards`]).

use std::path::PathBuf;
use std::sync::Arc;

use crate::cache::Cache;
use crate::dataset::Dataset;
use crate::error::{Error, Result};
use crate::format::shards::{self, ShardSetProblem, check_sets};
use crate::format::{OpenOptions, records, webdataset};
use crate::remote::RemoteUrl;
use crate::remote::store::{self, ObjectInfo, Patience};

/// Opens the dataset `text` (a URL) names.
pub(crate) fn open_url(text: &str, options: &OpenOptions) -> Result<Arc<dyn Dataset>> {
    let url = RemoteUrl::parse(text)?.with_options(&options.storage_options);
    let cache = match &options.cache {
        Some(cache) => cache.clone(),
        None => Cache::from_env()?,
    };
    let name = url.file_name().to_string();
    let label = PathBuf::from(url.to_string());
    let pattern = name.contains(['*', '?', '[']) || (name.contains('{') && name.contains('}'));
    let (objects, one_set, brace_missing) = if pattern {
        let dir = url.parent();
        let listing = store::list_dir(&dir, Patience::Open)?;
        let (objects, missing) = select(&url, &name, &listing, options)?;
        (objects, false, missing)
    } else if !url.key().is_empty()
        && !url.key().ends_with('/')
        && let Some(object) = store::head(&url, Patience::Open)?
    {
        (vec![object], false, Vec::new())
    } else {
        let listing = store::list_dir(&url, Patience::Open)?;
        if listing
            .iter()
            .any(|o| o.url.file_name() == records::MANIFEST)
        {
            return Ok(Arc::new(records::remote::open_ours(
                &url, &listing, &cache,
            )?));
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
                        records::MANIFEST
                    )
                },
            ));
        }
        (shards, true, Vec::new())
    };
    let names: Vec<PathBuf> = objects
        .iter()
        .map(|o| PathBuf::from(o.url.to_string()))
        .collect();
    let mut set = if names.len() > 1 || one_set {
        check_sets(&label, &names, one_set, options.allow_missing_shards)?
    } else {
        shards::SetReport::default()
    };
    set.add_missing(brace_missing);
    let tars = objects
        .iter()
        .all(|o| webdataset::is_shard_name(std::path::Path::new(o.url.file_name())));
    if tars {
        return Ok(Arc::new(webdataset::remote::open(
            &url, &objects, set, options, &cache,
        )?));
    }
    let dir = objects
        .first()
        .map_or_else(|| url.clone(), |o| o.url.parent());
    let indexes = store::list_dir(&dir.join(records::INDEX_DIR), Patience::Open)?;
    Ok(Arc::new(records::remote::open_foreign(
        &url, &objects, set, &indexes, options, &cache,
    )?))
}

/// True when `object` is named like a shard of a format read from object storage.
fn is_shard(object: &ObjectInfo) -> bool {
    let name = std::path::Path::new(object.url.file_name());
    records::is_shard_name(name) || webdataset::is_shard_name(name)
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
        .filter(|o| {
            let n = o.url.file_name();
            !n.ends_with(".index") && !n.ends_with(".idx") && n != records::MANIFEST
        })
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
