//! A free 127.0.0.1 port, a listener spec for it, `GET /` over a new TCP
//! connection to it, and a client sending such requests without pause.
//!
//! Include it with `#[path = "support/tcp_client.rs"] mod tcp_client;`.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use genswap_crds::ListenerSpec;

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

/// A TCP listener named `web` on 127.0.0.1:`port`.
pub fn listener(port: u16) -> ListenerSpec {
    ListenerSpec {
        name: "web".into(),
        tcp: Some(format!("127.0.0.1:{port}")),
        udp: None,
        unix: None,
        backlog: 4096,
    }
}

/// Requests to the port on a thread of their own until stopped.
pub struct Load {
    running: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    failures: Arc<std::sync::Mutex<Vec<String>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Load {
    pub fn start(port: u16) -> Load {
        let running = Arc::new(AtomicBool::new(true));
        let sent = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
        let thread = std::thread::spawn({
            let (running, sent, failures) = (running.clone(), sent.clone(), failures.clone());
            move || {
                while running.load(Ordering::SeqCst) {
                    sent.fetch_add(1, Ordering::SeqCst);
                    if let Err(error) = get(port) {
                        failures.lock().expect("failures").push(error);
                    }
                }
            }
        });
        Load {
            running,
            sent,
            failures,
            thread: Some(thread),
        }
    }

    /// Waits (10 s at most) until it has sent `n` requests.
    pub fn wait_sent(&self, n: u64) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while self.sent.load(Ordering::SeqCst) < n {
            assert!(
                std::time::Instant::now() < deadline,
                "the load sent {} of {n} requests in 10 s",
                self.sent.load(Ordering::SeqCst)
            );
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }

    /// Stops after the request in flight and asserts that it ran and that
    /// none of its requests failed; returns how many it sent.
    pub fn finish_with_none_failed(self) -> u64 {
        let (sent, failures) = self.finish();
        assert!(sent > 10, "the load ran: {sent}");
        assert!(
            failures.is_empty(),
            "{} of {sent} requests failed: {:?}",
            failures.len(),
            &failures[..failures.len().min(5)]
        );
        sent
    }

    /// Stops after the request in flight; (sent, failures).
    pub fn finish(mut self) -> (u64, Vec<String>) {
        self.running.store(false, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let failures = self.failures.lock().expect("failures").clone();
        (self.sent.load(Ordering::SeqCst), failures)
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.running.store(false, Ordering::SeqCst);
    }
}
