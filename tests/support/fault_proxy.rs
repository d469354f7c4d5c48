//! A fault-injecting HTTP proxy on loopback, in front of the test S3 server: each request is
//! forwarded, or answered with a fault the test chooses (a reset connection, `503 SlowDown`, a
//! slow first byte, a body cut short, a fixed added latency), so retries, resumes and time-outs
//! are exercised against real HTTP.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// What the proxy does with one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward it.
    None,
    /// Close the connection without answering.
    Reset,
    /// Answer `503 Slow Down` (S3's throttling).
    SlowDown,
    /// Answer `500 Internal Server Error`.
    ServerError,
    /// Forward it, but wait this long before the first byte of the answer.
    Delay(Duration),
    /// Forward it, but cut the answer's body in half (the connection then closes).
    Truncate,
}

/// Chooses the fault for request number `n` (from 0), its method and path.
pub type Policy = dyn Fn(usize, &str, &str) -> Fault + Send + Sync;

/// A running proxy.
pub struct FaultProxy {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    /// Requests seen so far.
    pub requests: Arc<AtomicUsize>,
}

/// Starts a proxy to `upstream` (`http://host:port`) applying `policy`; it runs until the test
/// process ends.
pub fn start(upstream: &str, policy: Arc<Policy>) -> FaultProxy {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let upstream = upstream.trim_start_matches("http://").to_string();
    let requests = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&requests);
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let upstream = upstream.clone();
            let policy = Arc::clone(&policy);
            let counter = Arc::clone(&counter);
            std::thread::spawn(move || serve(stream, &upstream, &*policy, &counter));
        }
    });
    FaultProxy { endpoint, requests }
}

/// Serves one client connection (one or more requests) until it closes.
fn serve(mut client: TcpStream, upstream: &str, policy: &Policy, counter: &AtomicUsize) {
    let _ = client.set_read_timeout(Some(Duration::from_secs(30)));
    while let Some((head, body)) = read_request(&mut client) {
        let n = counter.fetch_add(1, Ordering::SeqCst);
        let first = head.lines().next().unwrap_or("").to_string();
        let mut parts = first.split(' ');
        let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        let fault = policy(n, method, path);
        match fault {
            Fault::Reset => return,
            Fault::SlowDown | Fault::ServerError => {
                let (status, code) = if fault == Fault::SlowDown {
                    ("503 Slow Down", "SlowDown")
                } else {
                    ("500 Internal Server Error", "InternalError")
                };
                let body = format!(
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code>\
                     <Message>injected</Message></Error>"
                );
                let _ = write!(
                    client,
                    "HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\
                     Connection: close\r\n\r\n{body}",
                    body.len()
                );
                return;
            }
            Fault::None | Fault::Delay(_) | Fault::Truncate => {}
        }
        let Some(response) = forward(upstream, &head, &body) else {
            return;
        };
        if let Fault::Delay(delay) = fault {
            std::thread::sleep(delay);
        }
        if fault == Fault::Truncate {
            let split = find(&response, b"\r\n\r\n").map_or(response.len(), |i| i + 4);
            let cut = split + (response.len() - split) / 2;
            let _ = client.write_all(&response[..cut]);
            return;
        }
        if client.write_all(&response).is_err() {
            return;
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// One request from `client`: its head (request line and headers, as text) and body.
fn read_request(client: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buffer = Vec::new();
    let mut byte = [0u8; 1];
    while find(&buffer, b"\r\n\r\n").is_none() {
        match client.read(&mut byte) {
            Ok(1) => buffer.push(byte[0]),
            _ => return None,
        }
        if buffer.len() > 1 << 20 {
            return None;
        }
    }
    let head = String::from_utf8_lossy(&buffer).into_owned();
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.trim()
                .eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    client.read_exact(&mut body).ok()?;
    Some((head, body))
}

/// Sends the request upstream on a fresh connection (asking it to close after answering) and
/// returns the whole answer.
fn forward(upstream: &str, head: &str, body: &[u8]) -> Option<Vec<u8>> {
    let mut server = TcpStream::connect(upstream).ok()?;
    let mut lines: Vec<&str> = head
        .trim_end_matches("\r\n\r\n")
        .split("\r\n")
        .filter(|l| !l.to_ascii_lowercase().starts_with("connection:"))
        .collect();
    lines.push("Connection: close");
    let head = format!("{}\r\n\r\n", lines.join("\r\n"));
    server.write_all(head.as_bytes()).ok()?;
    server.write_all(body).ok()?;
    let mut response = Vec::new();
    server.read_to_end(&mut response).ok()?;
    // The client's connection stays open for its next request: say how long the body is,
    // without `Connection: close` from upstream.
    let split = find(&response, b"\r\n\r\n")? + 4;
    let (response_head, response_body) = response.split_at(split);
    let text = String::from_utf8_lossy(response_head);
    let mut kept: Vec<String> = text
        .trim_end_matches("\r\n\r\n")
        .split("\r\n")
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            !l.starts_with("connection:") && !l.starts_with("transfer-encoding:")
        })
        .map(str::to_owned)
        .collect();
    let body = if text
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(response_body)?
    } else {
        response_body.to_vec()
    };
    if !kept
        .iter()
        .any(|l| l.to_ascii_lowercase().starts_with("content-length:"))
    {
        kept.push(format!("Content-Length: {}", body.len()));
    }
    let mut out = format!("{}\r\n\r\n", kept.join("\r\n")).into_bytes();
    out.extend_from_slice(&body);
    Some(out)
}

/// The body of a chunked transfer encoding.
fn dechunk(mut bytes: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = find(bytes, b"\r\n")?;
        let size = usize::from_str_radix(
            std::str::from_utf8(&bytes[..line_end])
                .ok()?
                .split(';')
                .next()?
                .trim(),
            16,
        )
        .ok()?;
        bytes = &bytes[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(bytes.get(..size)?);
        bytes = bytes.get(size + 2..)?;
    }
}
