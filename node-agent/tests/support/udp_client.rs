//! A DNS-like client of a UDP listener: each query from a fresh socket
//! (a fresh source port, as resolvers use), one datagram, and a wait for
//! the answer; the test app answers with its identity.
//!
//! Include it with `#[path = "support/udp_client.rs"] mod udp_client;`.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::UdpSocket;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use genswap_crds::ListenerSpec;

/// How long a query waits for its answer before it counts as lost: longer
/// than a hold's gap, in which datagrams wait in the socket's buffer.
const ANSWER_WAIT: Duration = Duration::from_secs(5);

/// A UDP port on 127.0.0.1 free a moment ago.
pub fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("a free UDP port")
        .port()
}

/// A UDP listener named `dns` on 127.0.0.1:`port`.
pub fn udp_listener(port: u16) -> ListenerSpec {
    ListenerSpec {
        name: "dns".into(),
        tcp: None,
        udp: Some(format!("127.0.0.1:{port}")),
        unix: None,
        backlog: 4096,
    }
}

/// One query: the build that answered, or why none did.
pub fn query(port: u16) -> Result<String, String> {
    let socket = UdpSocket::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
    socket
        .set_read_timeout(Some(ANSWER_WAIT))
        .map_err(|e| format!("timeout: {e}"))?;
    socket
        .send_to(b"q", ("127.0.0.1", port))
        .map_err(|e| format!("send: {e}"))?;
    let mut buf = [0u8; 512];
    let n = socket
        .recv(&mut buf)
        .map_err(|e| format!("no answer: {e}"))?;
    let text = String::from_utf8_lossy(&buf[..n]);
    text.split_whitespace()
        .find_map(|word| word.strip_prefix("build="))
        .map(str::to_owned)
        .ok_or_else(|| format!("an answer without a build: {text}"))
}

/// Queries on a thread of their own, one after another, until finished.
pub struct DatagramLoad {
    running: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Tally>>,
}

/// What a load saw: answers by build, and the queries lost.
#[derive(Debug, Default)]
pub struct Tally {
    pub answered: BTreeMap<String, u64>,
    pub lost: Vec<String>,
}

impl Tally {
    pub fn sent(&self) -> u64 {
        self.answered.values().sum::<u64>() + self.lost.len() as u64
    }
}

impl DatagramLoad {
    pub fn start(port: u16) -> DatagramLoad {
        let running = Arc::new(AtomicBool::new(true));
        let thread = std::thread::spawn({
            let running = running.clone();
            move || {
                let mut tally = Tally::default();
                while running.load(Ordering::SeqCst) {
                    match query(port) {
                        Ok(build) => *tally.answered.entry(build).or_default() += 1,
                        Err(why) => tally.lost.push(why),
                    }
                }
                tally
            }
        });
        DatagramLoad {
            running,
            thread: Some(thread),
        }
    }

    /// Stops after the query in flight.
    pub fn finish(mut self) -> Tally {
        self.running.store(false, Ordering::SeqCst);
        self.thread
            .take()
            .and_then(|thread| thread.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for DatagramLoad {
    fn drop(&mut self) {
        self.running.store(false, Ordering::SeqCst);
    }
}
