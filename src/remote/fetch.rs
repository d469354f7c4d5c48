//! Whole objects fetched into the local cache directory: a remote shard is downloaded once per
//! machine (the cache's lock: one process downloads, the others wait and map the same file),
//! as `NAME.partial` renamed once complete and checked against its listed size, and named by
//! its URL, size and ETag, so a changed object is fetched again.

use crate::cache::{Cache, CachedFile};
use crate::error::Result;

use super::store::{self, ObjectInfo};

/// The cache section remote objects go into.
pub const SECTION: &str = "remote";

/// The cache entry name of `object`: a digest of its URL, size and ETag, then its file name.
pub fn entry_name(object: &ObjectInfo) -> String {
    use sha2::{Digest as _, Sha256};
    let mut hash = Sha256::new();
    hash.update(object.url.to_string().as_bytes());
    hash.update(object.size.to_le_bytes());
    hash.update(object.etag.as_deref().unwrap_or("").as_bytes());
    crate::cache::keyed_name(hash, object.url.file_name())
}

/// The cached copy of `object`, downloaded first when the cache does not hold it.
pub fn fetch(object: &ObjectInfo, cache: &Cache) -> Result<CachedFile> {
    cache.get_or_fill(SECTION, &entry_name(object), Some(object.size), |file| {
        let path = file.path().to_path_buf();
        store::download(object, file, &path).map(|_| ())
    })
}
