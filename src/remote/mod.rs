//! Datasets in object storage: S3 and S3-compatible stores, GCS, Azure, HTTP(S).
//!
//! - [`url`]: the URLs users type (`s3://bucket/prefix/`), parsed and checked (always built, so
//!   a build without object storage still refuses a URL by name instead of taking it for a
//!   local path);
//! - `store` (feature `remote`): one set of clients and one async runtime per process
//!   (recreated after a fork), configured from the standard environment, with blocking calls
//!   for the few operations imagefeed needs;
//! - `fetch` (feature `remote`): whole shards fetched into the local cache directory
//!   ([`crate::cache`]), written aside and renamed once complete and checked, one download per
//!   shard per machine.

#[cfg(feature = "remote")]
pub mod fetch;
#[cfg(feature = "remote")]
pub mod store;
pub mod url;

pub use url::{RemoteUrl, Scheme, is_url};
