//! DNS-like queries to a UDP listener, for the load generator: one
//! datagram out, one answer back (the test app answers each with its
//! identity, `build=… generation=… pid=…`). A query without an answer
//! within [`ANSWER_WAIT`] is lost.

use std::io;
use std::net::UdpSocket;
use std::time::Duration;

use crate::clock::mono_ns;
use crate::loadgen::{Group, Sample};

/// Longer than any hold's gap, in which queries wait in the socket buffer.
pub const ANSWER_WAIT: Duration = Duration::from_secs(2);

/// A query from a socket of its own (a fresh source port, as a resolver
/// that randomises ports sends).
pub fn one_fresh(address: &str) -> Sample {
    let start = mono_ns();
    let outcome = open(address).and_then(|socket| ask(&socket));
    sample(Group::PerRequest, start, outcome)
}

/// A query from `socket`, kept across queries (a stub resolver's one
/// socket). After a lost query the socket is dropped, so a late answer
/// to it cannot be taken for the next one's.
pub fn one_reused(address: &str, socket: &mut Option<UdpSocket>) -> Sample {
    let start = mono_ns();
    let outcome = match socket {
        Some(socket) => ask(socket),
        None => open(address).and_then(|opened| ask(socket.insert(opened))),
    };
    if outcome.is_err() {
        *socket = None;
    }
    sample(Group::KeepAlive, start, outcome)
}

fn open(address: &str) -> Result<UdpSocket, &'static str> {
    let socket = UdpSocket::bind("127.0.0.1:0").map_err(|_| "bind")?;
    socket.connect(address).map_err(|_| "connect")?;
    socket
        .set_read_timeout(Some(ANSWER_WAIT))
        .map_err(|_| "bind")?;
    Ok(socket)
}

/// Sends one query; the generation that answered.
fn ask(socket: &UdpSocket) -> Result<u64, &'static str> {
    socket.send(b"q").map_err(|_| "send")?;
    let mut buf = [0u8; 512];
    let n = match socket.recv(&mut buf) {
        Ok(n) => n,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            return Err("lost");
        }
        // An ICMP port unreachable: nothing was bound to the port.
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => return Err("refused"),
        Err(_) => return Err("receive"),
    };
    generation_of(&buf[..n]).ok_or("malformed")
}

/// `generation=N` in an answer.
fn generation_of(answer: &[u8]) -> Option<u64> {
    String::from_utf8_lossy(answer)
        .split_whitespace()
        .find_map(|word| word.strip_prefix("generation="))
        .and_then(|n| n.parse().ok())
}

fn sample(group: Group, start_ns: u64, outcome: Result<u64, &'static str>) -> Sample {
    let latency_ns = mono_ns().saturating_sub(start_ns);
    match outcome {
        Ok(generation) => Sample {
            start_ns,
            latency_ns,
            group,
            status: 200,
            error: "",
            generation,
        },
        Err(error) => Sample {
            start_ns,
            latency_ns,
            group,
            status: 0,
            error,
            generation: 0,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_is_answered_by_the_generation_its_answer_names_and_lost_without_one() {
        let server = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let address = server.local_addr().expect("address").to_string();
        let answering = std::thread::spawn({
            let server = server.try_clone().expect("clone");
            move || {
                let mut buf = [0u8; 64];
                let (_, peer) = server.recv_from(&mut buf).expect("a query");
                server
                    .send_to(b"build=b7 generation=7 pid=1\n", peer)
                    .expect("answer");
            }
        });
        let mut kept = None;
        let answered = one_reused(&address, &mut kept);
        answering.join().expect("the server thread");
        assert!(answered.ok(), "{answered:?}");
        assert_eq!(answered.generation, 7);
        assert!(kept.is_some(), "the socket is kept for the next query");

        // Nobody answers now: the query is lost after ANSWER_WAIT.
        let lost = one_reused(&address, &mut kept);
        assert_eq!((lost.status, lost.error), (0, "lost"));
        assert!(kept.is_none(), "a lost query's socket is not reused");
        drop(server);
    }
}
