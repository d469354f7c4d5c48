//! An S3 server on loopback for the object storage tests: moto's (`moto_server`, installed into
//! the test Python by `make test`), started once per test binary on a free port, dying with the
//! test process. Tests that cannot get one skip, saying why.

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;

/// A running S3 server.
pub struct S3Server {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    _child: Child,
    python: String,
}

/// The server of this test binary, started on first use; `None` (with the reason printed as
/// SKIPPED) when moto is not installed.
pub fn server() -> Option<&'static S3Server> {
    static SERVER: OnceLock<Option<S3Server>> = OnceLock::new();
    SERVER
        .get_or_init(|| {
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

fn start() -> Option<S3Server> {
    let python = super::python_with("moto, boto3")?;
    let moto = Path::new(&python).with_file_name("moto_server");
    let mut command = if moto.exists() {
        Command::new(moto)
    } else {
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
            _child: child,
            python,
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

    /// Runs `script` (Python with boto3, `s3` a client of this server) with `args`.
    pub fn python(&self, script: &str, args: &[&str]) {
        let prelude = format!(
            "import boto3, sys\ns3 = boto3.client('s3', endpoint_url='{}', \
             aws_access_key_id='test', aws_secret_access_key='test', region_name='us-east-1')\n",
            self.endpoint
        );
        let output = Command::new(&self.python)
            .arg("-c")
            .arg(format!("{prelude}{script}"))
            .args(args)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// Creates a bucket (fresh for each test, so tests do not see each other's objects).
    pub fn bucket(&self, name: &str) -> String {
        self.python("s3.create_bucket(Bucket=sys.argv[1])", &[name]);
        name.to_string()
    }

    /// Uploads every file under `dir` to `bucket` under `prefix`, with boto3.
    pub fn upload_dir(&self, dir: &Path, bucket: &str, prefix: &str) {
        self.python(
            "import os\nfor root, _, files in os.walk(sys.argv[1]):\n    for f in files:\n        \
             p = os.path.join(root, f)\n        \
             s3.upload_file(p, sys.argv[2], sys.argv[3] + '/' + os.path.relpath(p, sys.argv[1]))",
            &[&dir.to_string_lossy(), bucket, prefix],
        );
    }

    /// Puts the file at `path` as the object `key` (replacing any object there).
    pub fn put(&self, bucket: &str, key: &str, path: &Path) {
        self.python(
            "s3.put_object(Bucket=sys.argv[1], Key=sys.argv[2], Body=open(sys.argv[3], 'rb').read())",
            &[bucket, key, &path.to_string_lossy()],
        );
    }

    /// Deletes one object.
    pub fn delete(&self, bucket: &str, key: &str) {
        self.python(
            "s3.delete_object(Bucket=sys.argv[1], Key=sys.argv[2])",
            &[bucket, key],
        );
    }
}

/// A fresh bucket name for a test.
pub fn unique_bucket(tag: &str) -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A local scratch path.
pub fn local(dir: &Path, name: &str) -> PathBuf {
    dir.join(name)
}
