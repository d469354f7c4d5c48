//! Object storage URLs: what a user types for a dataset that lives in S3 and its kin.

use crate::error::{Error, Result};

/// A store a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// `s3://bucket/key` (AWS S3, and S3-compatible stores through `AWS_ENDPOINT_URL`: MinIO,
    /// Ceph, R2, SeaweedFS).
    S3,
    /// `gs://bucket/key` (Google Cloud Storage).
    Gcs,
    /// `az://container/key` (Azure Blob Storage; the account from `AZURE_STORAGE_ACCOUNT_NAME`).
    Azure,
    /// `https://host/path` or `http://host/path` (plain HTTP(S), WebDAV-style listing).
    Http,
}

/// A URL of an object or a prefix in object storage: `s3://bucket/prefix/shard-000000.tar`,
/// with the client options it is reached with (see [`RemoteUrl::with_options`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RemoteUrl {
    scheme: Scheme,
    /// The scheme as written (`s3`, `s3a`, `gs`, `az`, `abfs`, `http`, `https`).
    scheme_text: String,
    /// The bucket or container (for HTTP: `host[:port]`).
    bucket: String,
    /// The key within the bucket, without a leading `/` (empty: the bucket's root).
    key: String,
    /// Client options given in code (`aws_endpoint`, `aws_access_key_id`, ...), over the
    /// environment's: they travel with the URL to every object reached from it.
    options: std::sync::Arc<[(String, String)]>,
}

/// True when `text` starts with a URL scheme (`letters://`): it names something in object
/// storage, never a local path (a user who types `s3://bucket/x` must not get a local
/// directory named `s3:`).
pub fn is_url(text: &str) -> bool {
    match text.find("://") {
        Some(at) if at > 0 => {
            let scheme = &text[..at];
            scheme.as_bytes()[0].is_ascii_alphabetic()
                && scheme
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"+.-".contains(&b))
        }
        _ => false,
    }
}

impl RemoteUrl {
    /// Parses a URL; an unknown scheme or a URL without a bucket is an error naming it.
    pub fn parse(text: &str) -> Result<RemoteUrl> {
        let invalid = |why: &str| Error::BadUrl {
            url: text.to_string(),
            reason: why.to_string(),
        };
        let (scheme_text, rest) = text
            .split_once("://")
            .ok_or_else(|| invalid("not a URL (scheme://bucket/key)"))?;
        let scheme = match scheme_text.to_ascii_lowercase().as_str() {
            "s3" | "s3a" => Scheme::S3,
            "gs" | "gcs" => Scheme::Gcs,
            "az" | "abfs" | "abfss" | "azure" => Scheme::Azure,
            "http" | "https" => Scheme::Http,
            other => {
                return Err(invalid(&format!(
                    "unknown scheme {other:?}: imagefeed reads s3://, gs://, az://, http:// and \
                     https:// URLs (a local path needs no scheme)"
                )));
            }
        };
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(invalid("no bucket (s3://bucket/key)"));
        }
        if key.split('/').any(|part| part == "..") {
            return Err(invalid("'..' in a key names nothing in object storage"));
        }
        Ok(RemoteUrl {
            scheme,
            scheme_text: scheme_text.to_ascii_lowercase(),
            bucket: bucket.to_string(),
            key: key.trim_start_matches('/').to_string(),
            options: std::sync::Arc::new([]),
        })
    }

    /// This URL reached with these client options, in the names object_store's builders take
    /// (`aws_endpoint`, `aws_access_key_id`, `aws_secret_access_key`, `aws_region`,
    /// `aws_allow_http`, `google_service_account`, `azure_storage_account_name`, ...): they
    /// take precedence over the environment's, and travel to every object reached from here.
    pub fn with_options(mut self, options: &[(String, String)]) -> RemoteUrl {
        self.options = options.to_vec().into();
        self
    }

    /// The client options given with [`with_options`](Self::with_options).
    pub fn options(&self) -> &[(String, String)] {
        &self.options
    }

    /// The store.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// The bucket or container (HTTP: the host).
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The key within the bucket (no leading `/`).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The URL of the bucket's root: what one client serves.
    pub fn root(&self) -> String {
        format!("{}://{}", self.scheme_text, self.bucket)
    }

    /// This URL with `key` in place of its own.
    pub fn with_key(&self, key: &str) -> RemoteUrl {
        RemoteUrl {
            key: key.trim_start_matches('/').to_string(),
            ..self.clone()
        }
    }

    /// `name` inside this URL taken as a directory (`s3://b/p` + `x` = `s3://b/p/x`).
    pub fn join(&self, name: &str) -> RemoteUrl {
        let key = if self.key.is_empty() || self.key.ends_with('/') {
            format!("{}{name}", self.key)
        } else {
            format!("{}/{name}", self.key)
        };
        self.with_key(&key)
    }

    /// The last part of the key (a file name); empty for a bucket's root.
    pub fn file_name(&self) -> &str {
        self.key
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or("")
    }

    /// The URL of the directory holding this key.
    pub fn parent(&self) -> RemoteUrl {
        let trimmed = self.key.trim_end_matches('/');
        self.with_key(trimmed.rsplit_once('/').map_or("", |(dir, _)| dir))
    }
}

impl std::fmt::Display for RemoteUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}://{}/{}", self.scheme_text, self.bucket, self.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_a_store_a_bucket_and_a_key() {
        let url = RemoteUrl::parse("s3://data/imagenet/train/shard-000001.tar").unwrap();
        assert_eq!(url.scheme(), Scheme::S3);
        assert_eq!(
            (url.bucket(), url.key()),
            ("data", "imagenet/train/shard-000001.tar")
        );
        assert_eq!(url.file_name(), "shard-000001.tar");
        assert_eq!(url.parent().to_string(), "s3://data/imagenet/train");
        assert_eq!(
            url.parent().join("x").to_string(),
            "s3://data/imagenet/train/x"
        );
        assert_eq!(url.root(), "s3://data");
        let bucket = RemoteUrl::parse("gs://b").unwrap();
        assert_eq!((bucket.scheme(), bucket.key()), (Scheme::Gcs, ""));
        assert_eq!(bucket.join("x").key(), "x");
        assert_eq!(
            RemoteUrl::parse("https://host:8080/a/b").unwrap().bucket(),
            "host:8080"
        );
    }

    #[test]
    fn unknown_schemes_and_malformed_urls_are_errors() {
        for bad in [
            "ftp://x/y",
            "s3://",
            "s3:///key",
            "file://x",
            "s3://b/../etc",
        ] {
            assert!(
                matches!(RemoteUrl::parse(bad), Err(Error::BadUrl { .. })),
                "{bad}"
            );
        }
        assert!(is_url("s3://b/k") && is_url("weird+x://b"));
        assert!(!is_url("/data/x") && !is_url("relative/s3:/x") && !is_url("://x"));
    }
}
