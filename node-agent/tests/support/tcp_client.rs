//! A free 127.0.0.1 port, and `GET /` over a new TCP connection to it.
//!
//! Include it with `#[path = "support/tcp_client.rs"] mod tcp_client;`.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::time::Duration;

/// A port nothing listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// `GET /` on a new connection to the port: the whole 200 response, or why
/// not. Waits up to 30 s for the answer (a hold's gap is latency).
pub fn get(port: u16) -> Result<String, String> {
    let mut stream =
        std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .map_err(|e| format!("write: {e}"))?;
    let mut text = String::new();
    stream
        .read_to_string(&mut text)
        .map_err(|e| format!("read: {e}"))?;
    if text.starts_with("HTTP/1.1 200") {
        Ok(text)
    } else {
        Err(format!("answered {:?}", text.lines().next()))
    }
}
