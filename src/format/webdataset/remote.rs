//! WebDataset shards in object storage (feature `remote`): each shard is fetched into the cache
//! directory at open (a gzipped one decompressed) and walked, which gives every sample's place;
//! the shards stay mapped from the cache while the dataset is open.

use std::path::PathBuf;

use super::members::is_tar_header;
use super::{Shard, WebDataset, assemble, walked_copy};
use crate::cache::Cache;
use crate::error::Result;
use crate::format::OpenOptions;
use crate::format::compressed;
use crate::format::shard_data::Mapped;
use crate::format::shards::SetReport;
use crate::format::tfrecord::remote::{SHARDS_AT_ONCE, in_parallel};
use crate::remote::store::ObjectInfo;
use crate::remote::{RemoteUrl, fetch};

/// Opens the shards `objects` (named `name`), after the set checks found `set`.
pub(crate) fn open(
    name: &RemoteUrl,
    objects: &[ObjectInfo],
    set: SetReport,
    options: &OpenOptions,
    cache: &Cache,
) -> Result<WebDataset> {
    let label = PathBuf::from(name.to_string());
    let mut notices = set.notices(&label);
    let fetched = in_parallel(
        objects,
        SHARDS_AT_ONCE,
        |object| -> Result<(PathBuf, Mapped, Option<compressed::Damage>)> {
            let path = PathBuf::from(object.url.to_string());
            let cached = fetch::fetch(object, cache)?;
            let mut head = [0u8; compressed::SNIFF_BYTES];
            let got = {
                use std::os::unix::fs::FileExt as _;
                cached.file.read_at(&mut head, 0).unwrap_or(0)
            };
            let head = &head[..got];
            Ok(match compressed::sniff(head, is_tar_header, 512) {
                Some(compression) => {
                    let copy =
                        compressed::decompress(&cached.path, &cached.file, compression, cache)?;
                    (
                        path.clone(),
                        Mapped::new(&path, copy.file, true)?,
                        copy.damage,
                    )
                }
                None => {
                    super::refuse_unread_compression(&path, head)?;
                    (path, Mapped::new(&cached.path, cached.file, true)?, None)
                }
            })
        },
    )?;
    let mut shards: Vec<Shard> = Vec::with_capacity(fetched.len());
    for (path, mapped, damage) in fetched {
        shards.push(walked_copy(&path, mapped, damage.as_ref(), &mut notices));
    }
    // A set larger than memory is read at random from the cache (`Mapped::ready_for`).
    let total = objects.iter().map(|o| o.size).sum();
    crate::format::shard_data::ready_set(shards.iter().map(|s| &*s.data), total);
    assemble(&label, shards, set, options, notices)
}
