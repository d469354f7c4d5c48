//! MDS datasets in object storage (feature `remote`): `index.json` is read, then every shard
//! it lists is fetched into the cache directory at open (a compressed one decompressed), since
//! the classes come from reading every label; the shards stay mapped from the cache while the
//! dataset is open.

use std::path::PathBuf;

use super::index::{INDEX, Index, MAX_INDEX_BYTES};
use super::{Mds, assemble, checked_shard};
use crate::cache::Cache;
use crate::error::Result;
use crate::format::OpenOptions;
use crate::format::compressed;
use crate::format::shard_data::{Mapped, ShardData};
use crate::format::tfrecord::remote::{SHARDS_AT_ONCE, in_parallel};
use crate::remote::store::{self, ObjectInfo, Patience};
use crate::remote::{RemoteUrl, fetch};

/// True when `listing` (a prefix's objects) holds an MDS index.
pub(crate) fn holds_index(listing: &[ObjectInfo]) -> bool {
    listing.iter().any(|o| o.url.file_name() == INDEX)
}

/// Opens the MDS dataset under the prefix `dir`, whose objects are `listing`.
pub(crate) fn open(
    dir: &RemoteUrl,
    listing: &[ObjectInfo],
    options: &OpenOptions,
    cache: &Cache,
) -> Result<Mds> {
    let label = PathBuf::from(dir.to_string());
    let index_url = dir.join(INDEX);
    let text = store::get_small(&index_url, MAX_INDEX_BYTES, Patience::Open)?;
    let index = Index::parse(&PathBuf::from(index_url.to_string()), &text)?;
    // A merged index names shards in sub-prefixes, which a one-level listing does not show.
    let find = |name: &str| -> Result<Option<ObjectInfo>> {
        if let Some(found) = listing.iter().find(|o| o.url.file_name() == name) {
            return Ok(Some(found.clone()));
        }
        if name.contains('/') {
            return store::head(&dir.join(name), Patience::Open);
        }
        Ok(None)
    };
    let mut wanted = Vec::with_capacity(index.shards.len());
    let mut gone = Vec::new();
    for entry in &index.shards {
        let object = match (find(&entry.raw.0)?, &entry.zip) {
            (Some(raw), _) => Some((raw, None)),
            (None, Some((zip_name, compression))) => {
                find(zip_name)?.map(|zip| (zip, Some(*compression)))
            }
            (None, None) => None,
        };
        match object {
            Some(object) => wanted.push((object, entry)),
            None => gone.push(entry.raw.0.clone()),
        }
    }
    let mut notices = index.notes.clone();
    let missing = crate::format::shards::listed_members_missing(
        &label,
        gone,
        index.shards.len(),
        options.allow_missing_shards,
        &mut notices,
    )?;
    let fetched = in_parallel(&wanted, SHARDS_AT_ONCE, |((object, compression), entry)| {
        let path = PathBuf::from(object.url.to_string());
        let cached = fetch::fetch(object, cache)?;
        Ok(match compression {
            None => (path, Mapped::new(&cached.path, cached.file, true)?, None),
            Some(compression) => {
                let copy = compressed::decompress_at_most(
                    &cached.path,
                    &cached.file,
                    (*compression).into(),
                    cache,
                    Some(entry.raw.1),
                )?;
                let mapped = Mapped::new(&path, copy.file, true)?;
                (path, mapped, copy.damage)
            }
        })
    })?;
    let mut shards = Vec::with_capacity(fetched.len());
    for ((path, mapped, damage), (_, entry)) in fetched.into_iter().zip(&wanted) {
        shards.push(checked_shard(
            &path,
            &entry.raw.0,
            (ShardData::local(&path, mapped), damage),
            entry.samples,
            entry.raw.1,
            &mut notices,
        )?);
    }
    // A set larger than memory is read at random from the cache (`Mapped::ready_for`).
    let total = wanted.iter().map(|((object, _), _)| object.size).sum();
    crate::format::shard_data::ready_set(shards.iter().map(|s| &*s.data), total);
    assemble(&label, index.layout, shards, options, notices, missing)
}
