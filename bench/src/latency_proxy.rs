//! `imagefeed-bench latency-proxy`: adds a fixed delay to every request on its way to an object
//! store on loopback, the way a store across a network answers later than one on the machine
//! (Linux `tc netem` is not available on these machines). Bytes are relayed as they come, so
//! large downloads stream; the delay is added each time the client sends (a request), once.

use std::io::{Read as _, Write as _};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::Duration;

use anyhow::{Context as _, Result};

/// Listens on a free loopback port, prints `http://127.0.0.1:PORT`, and relays connections to
/// `upstream` until killed.
pub fn run(upstream: &str, delay: Duration) -> Result<()> {
    let upstream = upstream.trim_start_matches("http://").to_string();
    let listener = TcpListener::bind("127.0.0.1:0").context("binding the proxy")?;
    println!("http://{}", listener.local_addr()?);
    std::io::stdout().flush()?;
    for client in listener.incoming().flatten() {
        let upstream = upstream.clone();
        std::thread::spawn(move || {
            let _ = relay(client, &upstream, delay);
        });
    }
    Ok(())
}

fn relay(client: TcpStream, upstream: &str, delay: Duration) -> std::io::Result<()> {
    let server = TcpStream::connect(upstream)?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (mut client_in, mut server_out) = (client.try_clone()?, server.try_clone()?);
    let requests = std::thread::spawn(move || -> std::io::Result<()> {
        let mut buffer = vec![0u8; 64 << 10];
        loop {
            let n = client_in.read(&mut buffer)?;
            if n == 0 {
                let _ = server_out.shutdown(Shutdown::Write);
                return Ok(());
            }
            if !delay.is_zero() {
                std::thread::sleep(delay);
            }
            server_out.write_all(&buffer[..n])?;
        }
    });
    let (mut server_in, mut client_out) = (server, client);
    let mut buffer = vec![0u8; 256 << 10];
    loop {
        let n = server_in.read(&mut buffer)?;
        if n == 0 {
            let _ = client_out.shutdown(Shutdown::Write);
            break;
        }
        client_out.write_all(&buffer[..n])?;
    }
    let _ = requests.join();
    Ok(())
}
