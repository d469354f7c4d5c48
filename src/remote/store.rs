//! Clients for object storage, one set per process, and the few operations imagefeed needs
//! (list, head, get, download into a file, upload a file), as blocking calls.
//!
//! **Configuration** comes from the standard environment, as every tool of the field reads it:
//! `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`
//! (`AWS_DEFAULT_REGION`), `AWS_ENDPOINT_URL` for S3-compatible stores (MinIO, Ceph, R2,
//! SeaweedFS); `GOOGLE_SERVICE_ACCOUNT` and friends for GCS; `AZURE_STORAGE_ACCOUNT_NAME`,
//! `AZURE_STORAGE_ACCOUNT_KEY` for Azure. Plain HTTP is allowed when the endpoint is on the
//! loopback interface (a test server) or `AWS_ALLOW_HTTP=true` says so. object_store turns
//! HTTP off again for options set after `with_allow_http`, so it is set last.
//!
//! **Runtime and fork.** object_store is async (tokio). One multi-threaded runtime serves the
//! process, created when first needed (loading the library starts no thread). A process forked
//! from one that had it (a DataLoader worker, a `multiprocessing` child) inherits its memory but
//! not its threads, and its clients' pooled connections are the parent's sockets: the child
//! builds its own runtime and clients, and never touches the parent's (they are leaked, not
//! dropped: dropping a runtime whose threads are gone would wait for them forever). The state
//! is swapped in through an atomic pointer, never a lock a thread in the parent could have held
//! at the fork.
//!
//! **Retries** (object_store's, with jittered backoff): 5xx, throttling (`SlowDown`), resets and
//! timeouts are retried, and a body broken mid-transfer resumes with a ranged GET checked
//! against its ETag. Calls made while opening a dataset give up within about 10 s, so a wrong
//! endpoint, bucket or credentials fails fast saying which; downloads and uploads during
//! training retry for up to 2 minutes.

use std::collections::HashMap;
use std::fs;
use std::path::Path;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::TryStreamExt as _;
use object_store::path::Path as StorePath;
use object_store::{GetOptions, ObjectStore, ObjectStoreExt as _, PutMode, PutOptions, PutPayload};

use super::url::{RemoteUrl, Scheme};
use crate::error::{Error, IoContext as _, Result};

/// How patient a call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Patience {
    /// Opening: a few retries within about 10 s, so a wrong endpoint, bucket or credentials
    /// fails fast.
    Open,
    /// Moving data during training or packing: retries for up to 2 minutes.
    Transfer,
}

/// An object's size and version, as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    /// The object.
    pub url: RemoteUrl,
    /// Its size in bytes.
    pub size: u64,
    /// Its ETag (or version), when the store gives one.
    pub etag: Option<String>,
}

/// The process's runtime and clients (see the module docs).
struct State {
    pid: u32,
    runtime: tokio::runtime::Runtime,
    stores: Mutex<HashMap<StoreKey, Arc<dyn ObjectStore>>>,
    /// Ranged GETs under way in this process at once ([`start_range`]): however many loader
    /// workers start their batches' reads, connections and descriptors stay bounded.
    ranged: Arc<tokio::sync::Semaphore>,
}

/// The most ranged GETs under way in one process at once.
const RANGED_AT_ONCE: usize = 256;

/// What tells clients apart: the bucket, the patience, and the options given in code.
type StoreKey = (String, Patience, Vec<(String, String)>);

static STATE: AtomicPtr<State> = AtomicPtr::new(std::ptr::null_mut());

/// The state of this process: the current one, or a new one when there is none yet or it was
/// inherited through a fork.
fn state() -> Result<&'static State> {
    let pid = std::process::id();
    let current = STATE.load(Ordering::Acquire);
    // SAFETY: a non-null pointer in STATE came from Box::leak below and is never freed.
    if let Some(state) = unsafe { current.as_ref() }
        && state.pid == pid
    {
        return Ok(state);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("imagefeed-io")
        .enable_all()
        .build()
        .map_err(|e| Error::io("the object storage runtime", e))?;
    let fresh: &'static mut State = Box::leak(Box::new(State {
        pid,
        runtime,
        stores: Mutex::new(HashMap::new()),
        ranged: Arc::new(tokio::sync::Semaphore::new(RANGED_AT_ONCE)),
    }));
    match STATE.compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire) {
        // An inherited state (or none) replaced: the old one is leaked on purpose.
        Ok(_) => Ok(fresh),
        Err(winner) => {
            // Another thread of this process made one first: use it. Ours started threads; it
            // is shut down without waiting (nothing runs on it yet).
            // SAFETY: `fresh` was leaked above and is not shared; reclaiming it is sound.
            let ours = unsafe { Box::from_raw(fresh as *mut State) };
            ours.runtime.shutdown_background();
            // SAFETY: as above, `winner` is a leaked, never-freed State.
            match unsafe { winner.as_ref() } {
                Some(state) if state.pid == pid => Ok(state),
                _ => state(),
            }
        }
    }
}

/// Runs `future` to completion on the process's runtime, from a thread that is not one of its
/// own (every caller in imagefeed).
fn block_on<F: std::future::Future>(future: F) -> Result<F::Output> {
    Ok(state()?.runtime.block_on(future))
}

/// True when `endpoint` is an `http://` URL to the loopback interface.
fn loopback_http(endpoint: &str) -> bool {
    let Some(rest) = endpoint.strip_prefix("http://") else {
        return false;
    };
    let host = rest.split(['/', ':']).next().unwrap_or("");
    host == "localhost" || host.starts_with("127.") || host == "[::1]"
}

/// Why `endpoint` (`AWS_ENDPOINT_URL`, or the `aws_endpoint` option) cannot be used, if it
/// cannot: object_store takes any string and panics when it first builds a request from one
/// that is not a URL (a hostile try: `127.0.0.1:9000`, MinIO's docs' way of writing it, a port
/// past 65535, `http://`, a space), so it is checked here first.
fn check_endpoint(endpoint: &str) -> std::result::Result<(), String> {
    let Some(rest) = endpoint
        .strip_prefix("http://")
        .or_else(|| endpoint.strip_prefix("https://"))
    else {
        return Err("must start with http:// or https:// (e.g. http://127.0.0.1:9000)".into());
    };
    if let Some(c) = endpoint
        .chars()
        .find(|c| c.is_whitespace() || c.is_control())
    {
        return Err(format!("holds {c:?}, which no URL may"));
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let authority = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    let (host, port) = match authority.strip_prefix('[') {
        // An IPv6 address: `[::1]:9000`.
        Some(v6) => match v6.split_once(']') {
            Some((host, after)) => (host, after.strip_prefix(':')),
            None => return Err("has an IPv6 address without its closing ']'".into()),
        },
        None => match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        },
    };
    if host.is_empty() {
        return Err("names no host".into());
    }
    if let Some(port) = port
        && port.parse::<u16>().is_err()
    {
        return Err(format!("has the port {port:?}, not a number in 0..65535"));
    }
    Ok(())
}

/// The client for the store `url` is in, with `patience`'s retries.
fn store(url: &RemoteUrl, patience: Patience) -> Result<Arc<dyn ObjectStore>> {
    let state = state()?;
    let key = (url.root(), patience, url.options().to_vec());
    if let Some(store) = state.stores.lock().expect("not poisoned").get(&key) {
        return Ok(Arc::clone(store));
    }
    let built = build(url, patience)?;
    let mut stores = state.stores.lock().expect("not poisoned");
    Ok(Arc::clone(stores.entry(key).or_insert(built)))
}

/// Our own client options, taken before the rest go to object_store's builder.
const RETRY_OPTIONS: [&str; 2] = ["max_retries", "retry_timeout"];

fn build(url: &RemoteUrl, patience: Patience) -> Result<Arc<dyn ObjectStore>> {
    use object_store::ClientOptions;
    // reqwest is built without a TLS provider of its own (see Cargo.toml): ring's.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let retry = retry_config(url, patience)?;
    let options = ClientOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        .with_timeout(Duration::from_secs(match patience {
            Patience::Open => 15,
            Patience::Transfer => 120,
        }));
    // An option given in code, else the environment's.
    let given = |names: &[&str]| {
        url.options()
            .iter()
            .find(|(k, _)| names.iter().any(|n| k.eq_ignore_ascii_case(n)))
            .map(|(_, v)| v.clone())
    };
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let failed = |e: object_store::Error| Error::remote(url, "configuring the client", e);
    let store: Arc<dyn ObjectStore> = match url.scheme() {
        Scheme::S3 => {
            let endpoint = given(&["aws_endpoint", "aws_endpoint_url", "endpoint"])
                .or_else(|| env("AWS_ENDPOINT_URL"))
                .or_else(|| env("AWS_ENDPOINT"));
            if let Some(endpoint) = &endpoint {
                check_endpoint(endpoint).map_err(|reason| Error::BadUrl {
                    url: url.to_string(),
                    reason: format!("the S3 endpoint {endpoint:?} {reason}"),
                })?;
            }
            let allow_http = endpoint.as_deref().is_some_and(loopback_http)
                || given(&["aws_allow_http", "allow_http"])
                    .or_else(|| env("AWS_ALLOW_HTTP"))
                    .is_some_and(|v| v.eq_ignore_ascii_case("true"));
            let mut builder = object_store::aws::AmazonS3Builder::from_env()
                .with_url(url.root())
                .with_retry(retry)
                .with_client_options(options);
            if env("AWS_REGION").is_none()
                && env("AWS_DEFAULT_REGION").is_none()
                && given(&["aws_region", "region"]).is_none()
            {
                builder = builder.with_region("us-east-1");
            }
            for (key, value) in store_options::<object_store::aws::AmazonS3ConfigKey>(url)? {
                builder = builder.with_config(key, value);
            }
            // Last: client options set after it would turn plain HTTP off again.
            Arc::new(
                builder
                    .with_allow_http(allow_http)
                    .build()
                    .map_err(failed)?,
            )
        }
        Scheme::Gcs => {
            let mut builder = object_store::gcp::GoogleCloudStorageBuilder::from_env()
                .with_url(url.root())
                .with_retry(retry)
                .with_client_options(options);
            for (key, value) in store_options::<object_store::gcp::GoogleConfigKey>(url)? {
                builder = builder.with_config(key, value);
            }
            Arc::new(builder.build().map_err(failed)?)
        }
        Scheme::Azure => {
            let mut builder = object_store::azure::MicrosoftAzureBuilder::from_env()
                .with_url(url.root())
                .with_retry(retry)
                .with_client_options(options);
            for (key, value) in store_options::<object_store::azure::AzureConfigKey>(url)? {
                builder = builder.with_config(key, value);
            }
            Arc::new(builder.build().map_err(failed)?)
        }
        Scheme::Http => {
            let allow_http = loopback_http(&url.root());
            Arc::new(
                object_store::http::HttpBuilder::new()
                    .with_url(url.root())
                    .with_retry(retry)
                    .with_client_options(options.with_allow_http(allow_http))
                    .build()
                    .map_err(failed)?,
            )
        }
    };
    Ok(store)
}

/// The retries for `patience` (opening: few and short; transfers: object_store's), bounded by
/// the URL's `max_retries` and `retry_timeout` (seconds) where those are smaller.
fn retry_config(url: &RemoteUrl, patience: Patience) -> Result<object_store::RetryConfig> {
    use object_store::{BackoffConfig, RetryConfig};
    let mut retry = match patience {
        Patience::Open => RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(2),
                base: 2.0,
            },
            max_retries: 3,
            retry_timeout: Duration::from_secs(10),
        },
        Patience::Transfer => RetryConfig {
            backoff: BackoffConfig::default(),
            max_retries: 10,
            retry_timeout: Duration::from_secs(120),
        },
    };
    for (key, value) in url.options() {
        let number = || {
            value.parse::<u64>().map_err(|_| Error::BadUrl {
                url: url.to_string(),
                reason: format!("client option {key}={value:?} is not a whole number"),
            })
        };
        match key.as_str() {
            "max_retries" => retry.max_retries = retry.max_retries.min(number()? as usize),
            "retry_timeout" => {
                retry.retry_timeout = retry.retry_timeout.min(Duration::from_secs(number()?));
            }
            _ => {}
        }
    }
    Ok(retry)
}

/// The URL's client options other than ours ([`RETRY_OPTIONS`]) as the store's configuration
/// keys `K`; an option the store does not know is a [`Error::BadUrl`] naming it.
fn store_options<K: std::str::FromStr>(url: &RemoteUrl) -> Result<Vec<(K, &String)>> {
    url.options()
        .iter()
        .filter(|(k, _)| !RETRY_OPTIONS.contains(&k.as_str()))
        .map(|(key, value)| {
            let parsed = key
                .to_ascii_lowercase()
                .parse()
                .map_err(|_| Error::BadUrl {
                    url: url.to_string(),
                    reason: format!("unknown client option {key:?} for this store"),
                })?;
            Ok((parsed, value))
        })
        .collect()
}

/// True when `error` is a transfer that broke off (a reset, a time-out, a body cut short)
/// rather than an answer: worth trying again. object_store retries requests, and resumes a
/// broken GET body itself, but not a listing's or a small object's body read to the end.
fn transient(error: &object_store::Error) -> bool {
    use object_store::client::{HttpError, HttpErrorKind};
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        if let Some(http) = e.downcast_ref::<HttpError>() {
            return matches!(
                http.kind(),
                HttpErrorKind::Connect
                    | HttpErrorKind::Request
                    | HttpErrorKind::Timeout
                    | HttpErrorKind::Interrupted
            );
        }
        source = e.source();
    }
    false
}

/// Runs `call` again while it fails transiently, with a growing pause, up to `patience`'s
/// number of attempts.
fn retrying<T>(
    patience: Patience,
    mut call: impl FnMut() -> Result<std::result::Result<T, object_store::Error>>,
) -> Result<std::result::Result<T, object_store::Error>> {
    let attempts = match patience {
        Patience::Open => 4,
        Patience::Transfer => 8,
    };
    let mut pause = Duration::from_millis(200);
    for _ in 1..attempts {
        match call()? {
            Err(e) if transient(&e) => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(5));
            }
            done => return Ok(done),
        }
    }
    call()
}

/// The key of `url` as object_store's path, exactly as written: `StorePath::from` would
/// percent-encode every non-ASCII character and `%`, so a pack to `s3://b/uml-ü` went to the
/// key `uml-%C3%BC` and was read back from `uml-%25C3%25BC` (a hostile try). A key it cannot
/// hold as written (a control character) is an error naming it.
fn store_path(url: &RemoteUrl) -> Result<StorePath> {
    key_path(url, url.key())
}

/// [`store_path`] for `key`, a key or prefix of `url`'s bucket.
fn key_path(url: &RemoteUrl, key: &str) -> Result<StorePath> {
    StorePath::parse(key).map_err(|e| Error::BadUrl {
        url: url.to_string(),
        reason: format!("the key {key:?} cannot be used as written: {e}"),
    })
}

/// The key of `url` taken as a directory, as object_store's path ([`key_path`]); `None` for the
/// bucket's root.
fn prefix_path(url: &RemoteUrl) -> Result<Option<StorePath>> {
    match url.key().trim_end_matches('/') {
        "" => Ok(None),
        prefix => key_path(url, prefix).map(Some),
    }
}

/// Every object under the prefix `url` (taken as a directory), in key order.
pub fn list(url: &RemoteUrl, patience: Patience) -> Result<Vec<ObjectInfo>> {
    let store = store(url, patience)?;
    let prefix = prefix_path(url)?;
    let metas: Vec<object_store::ObjectMeta> =
        block_on(async move { store.list(prefix.as_ref()).try_collect::<Vec<_>>().await })?
            .map_err(|e| Error::remote(url, "listing", e))?;
    let mut objects: Vec<ObjectInfo> = metas
        .into_iter()
        .map(|meta| ObjectInfo {
            url: url.with_key(meta.location.as_ref()),
            size: meta.size,
            etag: meta.e_tag,
        })
        .collect();
    objects.sort_by(|a, b| a.url.key().cmp(b.url.key()));
    Ok(objects)
}

/// The objects directly under the prefix `url` taken as a directory (not those in its
/// sub-directories), in key order.
pub fn list_dir(url: &RemoteUrl, patience: Patience) -> Result<Vec<ObjectInfo>> {
    let store = store(url, patience)?;
    let prefix = prefix_path(url)?;
    let result = retrying(patience, || {
        block_on(async { store.list_with_delimiter(prefix.as_ref()).await })
    })?
    .map_err(|e| Error::remote(url, "listing", e))?;
    let mut objects: Vec<ObjectInfo> = result
        .objects
        .into_iter()
        .map(|meta| ObjectInfo {
            url: url.with_key(meta.location.as_ref()),
            size: meta.size,
            etag: meta.e_tag,
        })
        .collect();
    objects.sort_by(|a, b| a.url.key().cmp(b.url.key()));
    Ok(objects)
}

/// The object at `url`, when there is one.
pub fn head(url: &RemoteUrl, patience: Patience) -> Result<Option<ObjectInfo>> {
    let store = store(url, patience)?;
    let path = store_path(url)?;
    match retrying(patience, || block_on(async { store.head(&path).await }))? {
        Ok(meta) => Ok(Some(ObjectInfo {
            url: url.clone(),
            size: meta.size,
            etag: meta.e_tag,
        })),
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(Error::remote(url, "looking up", e)),
    }
}

/// The whole object at `url`, refused when it is larger than `limit` bytes (a manifest or an
/// index: small, and read into memory).
pub fn get_small(url: &RemoteUrl, limit: u64, patience: Patience) -> Result<Vec<u8>> {
    let store = store(url, patience)?;
    let path = store_path(url)?;
    let bytes = retrying(patience, || {
        block_on(async {
            let result = store.get(&path).await?;
            if result.meta.size > limit {
                return Ok(Err(result.meta.size));
            }
            result.bytes().await.map(Ok)
        })
    })?
    .map_err(|e| Error::remote(url, "reading", e))?
    .map_err(|size| Error::BadUrl {
        url: url.to_string(),
        reason: format!("{size} bytes, more than the {limit} a manifest or index may have"),
    })?;
    Ok(bytes.to_vec())
}

/// Bytes `offset..offset + len` of `object` into `out` (replacing what it held): one ranged
/// GET ([`start_range`], waited for at once).
pub fn get_range(object: &ObjectInfo, offset: u64, len: u64, out: &mut Vec<u8>) -> Result<()> {
    start_range(object, offset, len)?.wait(out)
}

/// A ranged GET under way on the process's runtime ([`start_range`]); dropped before it is
/// waited for, it is cancelled.
pub struct PendingRange {
    object: ObjectInfo,
    offset: u64,
    len: u64,
    /// The process whose runtime runs the task: in a forked child the task does not exist.
    pid: u32,
    task: Option<tokio::task::JoinHandle<std::result::Result<Vec<u8>, object_store::Error>>>,
}

/// Starts reading bytes `offset..offset + len` of `object`: a GET with that range and
/// `If-Match` on the listed ETag (as [`download`] sends), so a replaced object is
/// [`Error::FileChanged`] rather than bytes of another version. Transient failures are retried
/// as the blocking calls retry them. Returns at once; [`PendingRange::wait`] gives the bytes.
pub fn start_range(object: &ObjectInfo, offset: u64, len: u64) -> Result<PendingRange> {
    let url = &object.url;
    let Some(end) = offset.checked_add(len).filter(|&end| end <= object.size) else {
        return Err(Error::BadUrl {
            url: url.to_string(),
            reason: format!(
                "bytes {offset}..{} asked of an object listed with {}",
                offset.saturating_add(len),
                object.size
            ),
        });
    };
    let task = if len == 0 {
        None
    } else {
        let store = store(url, Patience::Transfer)?;
        let location = store_path(url)?;
        let options = GetOptions::new()
            .with_if_match(object.etag.clone())
            .with_range(Some(offset..end));
        let state = state()?;
        let permits = Arc::clone(&state.ranged);
        Some(state.runtime.spawn(async move {
            // Held until the bytes are in: at most RANGED_AT_ONCE requests at a time.
            let _permit = permits.acquire_owned().await;
            let mut pause = Duration::from_millis(200);
            for attempt in 1.. {
                let result = async {
                    store
                        .get_opts(&location, options.clone())
                        .await?
                        .bytes()
                        .await
                }
                .await;
                match result {
                    Err(e) if transient(&e) && attempt < 8 => {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_secs(5));
                    }
                    done => return done.map(|bytes| bytes.to_vec()),
                }
            }
            unreachable!("the loop returns")
        }))
    };
    Ok(PendingRange {
        object: object.clone(),
        offset,
        len,
        pid: std::process::id(),
        task,
    })
}

impl PendingRange {
    /// Waits for the bytes and puts them in `out` (replacing what it held); fewer bytes than
    /// asked (an object cut short since it was listed) is an error naming the object.
    pub fn wait(mut self, out: &mut Vec<u8>) -> Result<()> {
        out.clear();
        let Some(task) = self.task.take() else {
            return Ok(());
        };
        if self.pid != std::process::id() {
            // Started by the process this one was forked from: its task is not here.
            std::mem::forget(task);
            return get_range(&self.object, self.offset, self.len, out);
        }
        let url = &self.object.url;
        let bytes = block_on(task)?
            .map_err(|e| Error::io(url.to_string(), std::io::Error::other(e)))?
            .map_err(|e| match e {
                object_store::Error::Precondition { .. } => Error::FileChanged {
                    path: url.to_string().into(),
                    change: format!(
                        "the object is no longer the version listed with ETag {}",
                        self.object.etag.as_deref().unwrap_or("?")
                    ),
                },
                e => Error::remote(url, "reading a range of", e),
            })?;
        if bytes.len() as u64 != self.len {
            // The object is not the one listed (a store without ETags cannot refuse the
            // request): every later read of it would fail or read another version.
            return Err(Error::FileChanged {
                path: url.to_string().into(),
                change: format!(
                    "a ranged read of bytes {}..{} gave {} bytes: cut short since it was listed",
                    self.offset,
                    self.offset + self.len,
                    bytes.len()
                ),
            });
        }
        *out = bytes;
        Ok(())
    }
}

impl Drop for PendingRange {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            if self.pid == std::process::id() {
                task.abort();
            } else {
                // The parent's runtime: not ours to touch.
                std::mem::forget(task);
            }
        }
    }
}

/// Streams the object `object` into `file` (at `path`, for messages), checking that it is as
/// long as listed; returns the bytes written.
///
/// The GET carries `If-Match` with the ETag the listing gave, so an object replaced since the
/// dataset was opened is refused by the store ([`Error::FileChanged`]) instead of being cached
/// under the old version's name with the new version's bytes, which would be read against the
/// old shard's index (an object of the same size would pass the length check).
pub fn download(
    object: &ObjectInfo,
    file: &mut (impl std::io::Write + std::io::Seek),
    path: &Path,
) -> Result<u64> {
    let url = &object.url;
    let store = store(url, Patience::Transfer)?;
    let location = store_path(url)?;
    let mut written = 0u64;
    let outcome = retrying(Patience::Transfer, || {
        // A new attempt writes the file over from its start (its length stays, so a cache
        // reservation made with it holds; what lies past the end is cut off when done).
        written = 0;
        if let Err(e) = file.rewind() {
            return Ok(Ok(Err(e)));
        }
        block_on(async {
            let options = GetOptions::new().with_if_match(object.etag.clone());
            let result = store.get_opts(&location, options).await?;
            let mut stream = result.into_stream();
            while let Some(chunk) = stream.try_next().await? {
                if let Err(e) = file.write_all(&chunk) {
                    return Ok(Err(e));
                }
                written += chunk.len() as u64;
            }
            Ok(Ok(()))
        })
    })?;
    outcome
        .map_err(|e| match e {
            object_store::Error::Precondition { .. } => Error::FileChanged {
                path: url.to_string().into(),
                change: format!(
                    "the object is no longer the version listed with ETag {}",
                    object.etag.as_deref().unwrap_or("?")
                ),
            },
            e => Error::remote(url, "downloading", e),
        })?
        .at(path)?;
    if written != object.size {
        return Err(Error::FileChanged {
            path: url.to_string().into(),
            change: format!(
                "the download gave {written} bytes, but the object was listed with {}",
                object.size
            ),
        });
    }
    Ok(written)
}

/// Larger uploads go in parts (S3 limits one PUT to 5 GiB; parts also resume and overlap).
const MULTIPART_FROM: u64 = 64 << 20;

/// Uploads the file at `path` to `url`. With `create`, an existing object is never overwritten:
/// a small file goes up with `If-None-Match: *` (refused atomically by the store), a large one
/// in parts after a check that nothing is there ([`Error::AlreadyExists`] either way).
pub fn upload(path: &Path, url: &RemoteUrl, create: bool) -> Result<()> {
    let store = store(url, Patience::Transfer)?;
    let location = store_path(url)?;
    let len = fs::metadata(path).at(path)?.len();
    let exists = || Error::AlreadyExists {
        path: url.to_string().into(),
        hint: "an object is already there; pass --force to replace it".into(),
    };
    if len < MULTIPART_FROM {
        let bytes = fs::read(path).at(path)?;
        let mode = if create {
            PutMode::Create
        } else {
            PutMode::Overwrite
        };
        let put = block_on(async {
            store
                .put_opts(
                    &location,
                    PutPayload::from(bytes),
                    PutOptions {
                        mode,
                        ..PutOptions::default()
                    },
                )
                .await
        })?;
        return match put {
            Ok(_) => Ok(()),
            Err(object_store::Error::AlreadyExists { .. }) => Err(exists()),
            Err(e) => Err(Error::remote(url, "uploading", e)),
        };
    }
    if create && head(url, Patience::Transfer)?.is_some() {
        return Err(exists());
    }
    let mut file = fs::File::open(path).at(path)?;
    let outcome = block_on(async {
        let upload = store.put_multipart(&location).await?;
        let mut writer = object_store::WriteMultipart::new_with_chunk_size(upload, 16 << 20);
        let mut buffer = vec![0u8; 8 << 20];
        loop {
            let n = match std::io::Read::read(&mut file, &mut buffer) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    writer.abort().await?;
                    return Ok(Err(e));
                }
            };
            writer.wait_for_capacity(4).await?;
            writer.write(&buffer[..n]);
        }
        writer.finish().await?;
        Ok(Ok(()))
    })?;
    outcome
        .map_err(|e: object_store::Error| Error::remote(url, "uploading", e))?
        .at(path)
}

/// Deletes the object at `url` (nothing there is not an error).
pub fn delete(url: &RemoteUrl) -> Result<()> {
    let store = store(url, Patience::Transfer)?;
    let location = store_path(url)?;
    match block_on(async move { store.delete(&location).await })? {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(Error::remote(url, "deleting", e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_object_store_would_panic_on_are_refused() {
        for good in [
            "http://127.0.0.1:9000",
            "https://s3.example.com",
            "http://localhost:9000/",
            "http://[::1]:9000",
            "https://minio.internal:443/base",
        ] {
            assert_eq!(check_endpoint(good), Ok(()), "{good}");
        }
        for bad in [
            "127.0.0.1:9000",
            "http://127.0.0.1:99999",
            "http://",
            "http://127.0.0.1:9000/some path",
            "http://:9000",
            "http://[::1:9000",
            "ftp://host",
        ] {
            assert!(check_endpoint(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn plain_http_only_to_the_loopback_interface() {
        assert!(loopback_http("http://127.0.0.1:9000"));
        assert!(loopback_http("http://localhost/x"));
        assert!(!loopback_http("http://10.0.0.1:9000"));
        assert!(!loopback_http("https://127.0.0.1"));
    }

    #[test]
    fn the_state_is_made_once_per_process() {
        let a = state().unwrap() as *const State;
        let b = state().unwrap() as *const State;
        assert_eq!(a, b);
    }
}
