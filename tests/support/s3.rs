//! An S3 server on loopback for the object storage tests: moto's (`moto_server`, installed into
//! the test Python by `make test`). `make test` starts one for the whole run and names it in
//! `IMAGEFEED_TEST_S3_ENDPOINT` (each test works in buckets of its own); otherwise each test
//! binary starts its own on a free port, dying with the test process. Tests that cannot get one
//! skip, saying why.
//!
//! Objects are put with imagefeed's own uploads (signed requests through `object_store`), not a
//! Python client per call: a boto3 process costs ~0.7 s of CPU, and the suite made 46 of them.
//! Keys whose encoding is under test are uploaded with boto3 ([`S3Server::upload_dir_with_boto3`]).

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;

use imagefeed::remote::RemoteUrl;
use imagefeed::remote::store;

/// The variable that names a server already running (`http://127.0.0.1:PORT`), for every test
/// of a run to share.
pub const ENDPOINT_VARIABLE: &str = "IMAGEFEED_TEST_S3_ENDPOINT";

/// A running S3 server.
pub struct S3Server {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    /// The server this test binary started (`None`: one shared by the run).
    _child: Option<Child>,
}

/// The server of this test binary: the run's (`IMAGEFEED_TEST_S3_ENDPOINT`), else one started
/// on first use; `None` (with the reason printed as SKIPPED) when moto is not installed.
pub fn server() -> Option<&'static S3Server> {
    static SERVER: OnceLock<Option<S3Server>> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            if let Ok(endpoint) = std::env::var(ENDPOINT_VARIABLE) {
                return Some(S3Server {
                    endpoint,
                    _child: None,
                });
            }
            // PR_SET_PDEATHSIG fires when the *thread* that started the server ends: start it
            // from a thread that lives as long as the test process.
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = tx.send(start());
                loop {
                    std::thread::park();
                }
            });
            rx.recv().ok().flatten()
        })
        .as_ref()
}

/// The test Python (`IMAGEFEED_PYTHON`, else `python3`).
fn python() -> String {
    std::env::var("IMAGEFEED_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn start() -> Option<S3Server> {
    // moto installs `moto_server` beside its Python; without it, ask that Python for the module
    // (importing moto to find out costs a second of CPU, so only then).
    let python = python();
    let moto = Path::new(&python).with_file_name("moto_server");
    let mut command = if moto.exists() {
        Command::new(moto)
    } else {
        super::python_with("moto, boto3")?;
        let mut c = Command::new(&python);
        c.args(["-m", "moto.server"]);
        c
    };
    command
        .args(["-H", "127.0.0.1", "-p", "0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: prctl is async-signal-safe; it only asks the kernel to end the child with the
    // test process.
    unsafe {
        use std::os::unix::process::CommandExt as _;
        command.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) => {
            eprintln!("SKIPPED: cannot start moto_server: {e}");
            return None;
        }
    };
    // Werkzeug prints "Running on http://127.0.0.1:PORT" on stderr (stdout in some versions).
    let (tx, rx) = std::sync::mpsc::channel();
    for stream in [
        Box::new(child.stderr.take().unwrap()) as Box<dyn std::io::Read + Send>,
        Box::new(child.stdout.take().unwrap()),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if let Some(at) = line.find("http://127.0.0.1:") {
                    let endpoint: String = line[at..]
                        .chars()
                        .take_while(|c| !c.is_whitespace())
                        .collect();
                    let _ = tx.send(endpoint);
                }
            }
        });
    }
    match rx.recv_timeout(std::time::Duration::from_secs(30)) {
        Ok(endpoint) => Some(S3Server {
            endpoint,
            _child: Some(child),
        }),
        Err(_) => {
            eprintln!("SKIPPED: moto_server did not say its port within 30 s");
            let _ = child.kill();
            None
        }
    }
}

impl S3Server {
    /// The client options that reach this server.
    pub fn options(&self) -> Vec<(String, String)> {
        [
            ("aws_endpoint", self.endpoint.as_str()),
            ("aws_access_key_id", "test"),
            ("aws_secret_access_key", "test"),
            ("aws_region", "us-east-1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    /// `s3://BUCKET/KEY` reached through this server.
    pub fn url(&self, bucket: &str, key: &str) -> RemoteUrl {
        RemoteUrl::parse(&format!("s3://{bucket}/{key}"))
            .unwrap()
            .with_options(&self.options())
    }

    /// Creates a bucket (fresh for each test, so tests do not see each other's objects). moto
    /// takes an unsigned `PUT /BUCKET`, and `object_store` has no call that makes buckets.
    pub fn bucket(&self, name: &str) -> String {
        let host = self
            .endpoint
            .strip_prefix("http://")
            .expect("the test server's endpoint is http://HOST:PORT");
        let mut stream = std::net::TcpStream::connect(host).unwrap();
        write!(
            stream,
            "PUT /{name} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        let status = answer.lines().next().unwrap_or_default();
        assert!(
            status.split_whitespace().nth(1) == Some("200"),
            "creating bucket {name}: {answer}"
        );
        name.to_string()
    }

    /// Uploads every file under `dir` to `bucket` under `prefix`.
    pub fn upload_dir(&self, dir: &Path, bucket: &str, prefix: &str) {
        for (path, relative) in files_under(dir) {
            self.put(bucket, &format!("{prefix}/{relative}"), &path);
        }
    }

    /// Uploads every file under `dir` to `bucket` under `prefix` with boto3, another tool's
    /// client: for keys whose encoding is what a test checks.
    pub fn upload_dir_with_boto3(&self, dir: &Path, bucket: &str, prefix: &str) {
        let script = format!(
            "import boto3, os, sys\ns3 = boto3.client('s3', endpoint_url='{}', \
             aws_access_key_id='test', aws_secret_access_key='test', region_name='us-east-1')\n\
             for root, _, files in os.walk(sys.argv[1]):\n    for f in files:\n        \
             p = os.path.join(root, f)\n        \
             s3.upload_file(p, sys.argv[2], sys.argv[3] + '/' + os.path.relpath(p, sys.argv[1]))",
            self.endpoint
        );
        let output = Command::new(python())
            .arg("-c")
            .arg(script)
            .args([&dir.to_string_lossy(), bucket, prefix])
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// Puts the file at `path` as the object `key` (replacing any object there).
    pub fn put(&self, bucket: &str, key: &str, path: &Path) {
        store::upload(path, &self.url(bucket, key), false)
            .unwrap_or_else(|e| panic!("uploading {} to {bucket}/{key}: {e}", path.display()));
    }

    /// Deletes one object.
    pub fn delete(&self, bucket: &str, key: &str) {
        store::delete(&self.url(bucket, key))
            .unwrap_or_else(|e| panic!("deleting {bucket}/{key}: {e}"));
    }
}

/// Every file under `dir` (recursively), with its path relative to `dir` (`/`-separated).
fn files_under(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(at) = pending.pop() {
        for entry in std::fs::read_dir(&at).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else {
                let relative = path.strip_prefix(dir).unwrap().to_str().unwrap();
                files.push((path.clone(), relative.to_string()));
            }
        }
    }
    files
}

/// A fresh bucket name for a test.
pub fn unique_bucket(tag: &str) -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    // The clock too: on a server shared by a whole run, a later test process may get an
    // earlier one's process id.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "{tag}-{}-{}-{:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        nanos % (1 << 40)
    )
}

/// A local scratch path.
pub fn local(dir: &Path, name: &str) -> PathBuf {
    dir.join(name)
}
