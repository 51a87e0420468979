//! Zero downtime: clients send requests through `current.sock` without a
//! pause while the engine performs 20 back-to-back overlap swaps, and every
//! request gets its answer.
//!
//! Two clients run at once:
//! - one opens a new connection for every request (what a front proxy does
//!   for each new client connection);
//! - one keeps a connection alive across requests and reconnects when the
//!   server closes it. A connection the server closed before a request was
//!   written on it is a reconnect, not a failure; a request that was
//!   written and got no response is a failure.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use genswap_crds::Outcome;
use http::{Request, header};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use swap_host::{SwapHost, parse_identity};
use tokio::net::UnixStream;

const SWAPS: i64 = 20;
/// Between two requests of one client: enough to let the swaps run on a
/// 2-core machine, short enough that every swap is crossed by requests.
const PAUSE: Duration = Duration::from_millis(1);

/// What one client saw.
#[derive(Debug, Default)]
struct Tally {
    answered: u64,
    reconnects: u64,
    generations: BTreeSet<u64>,
    failures: Vec<String>,
}

impl Tally {
    fn answer(&mut self, status: u16, body: &[u8]) {
        match parse_identity(status, &String::from_utf8_lossy(body)) {
            Some(identity) if status == 200 => {
                self.answered += 1;
                self.generations.insert(identity.generation);
            }
            _ => self.failures.push(format!(
                "answered {status}: {:?}",
                String::from_utf8_lossy(body)
            )),
        }
    }
}

/// A new connection through `current.sock` for every request.
async fn connection_per_request(socket: PathBuf, stop: Arc<AtomicBool>) -> Tally {
    let mut tally = Tally::default();
    while !stop.load(Ordering::SeqCst) {
        match node_agent::health::get_within(&socket, "/", Duration::from_secs(10)).await {
            Ok((status, body)) => tally.answer(status, &body),
            Err(error) => tally.failures.push(format!("new connection: {error}")),
        }
        tokio::time::sleep(PAUSE).await;
    }
    tally
}

async fn connect(socket: &Path) -> Result<SendRequest<Empty<Bytes>>, String> {
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|e| format!("connect through {}: {e}", socket.display()))?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(async move {
        // The server closing the connection is expected; the requests on it
        // report what matters.
        let _ = connection.await;
    });
    Ok(sender)
}

/// One keep-alive connection, replaced whenever the server closes it.
async fn keep_alive(socket: PathBuf, stop: Arc<AtomicBool>) -> Tally {
    let mut tally = Tally::default();
    let mut sender: Option<SendRequest<Empty<Bytes>>> = None;
    let mut connected_before = false;
    while !stop.load(Ordering::SeqCst) {
        let mut current = match sender.take() {
            Some(open) if !open.is_closed() => open,
            _ => {
                if connected_before {
                    tally.reconnects += 1;
                }
                match connect(&socket).await {
                    Ok(open) => {
                        connected_before = true;
                        open
                    }
                    Err(error) => {
                        tally.failures.push(error);
                        tokio::time::sleep(PAUSE).await;
                        continue;
                    }
                }
            }
        };
        if current.ready().await.is_err() {
            // Closed while idle, before anything was written: reconnect.
            continue;
        }
        let request = Request::get("/")
            .header(header::HOST, "localhost")
            .body(Empty::<Bytes>::new())
            .expect("a valid request");
        match current.try_send_request(request).await {
            Ok(response) => {
                let status = response.status().as_u16();
                let closing = response
                    .headers()
                    .get(header::CONNECTION)
                    .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
                match response.into_body().collect().await {
                    Ok(body) => tally.answer(status, &body.to_bytes()),
                    Err(error) => tally
                        .failures
                        .push(format!("response body cut short: {error}")),
                }
                if !closing {
                    sender = Some(current);
                }
            }
            Err(mut error) => {
                if error.take_message().is_none() {
                    tally.failures.push(format!(
                        "a request was written and got no response: {}",
                        error.error()
                    ));
                }
                // Otherwise it was never written: the connection had closed.
            }
        }
        tokio::time::sleep(PAUSE).await;
    }
    tally
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_back_to_back_overlap_swaps_lose_no_request() {
    let host = SwapHost::new("zero-downtime");
    // Two builds alternate, so every swap changes the build that answers.
    let builds = [host.build("b-even"), host.build("b-odd")];
    let names = ["b-even", "b-odd"];
    let first = host.swap(&host.attempt(1, &builds[1], names[1])).await;
    assert_eq!(first.outcome, Outcome::Done, "install: {first:?}");

    let stop = Arc::new(AtomicBool::new(false));
    let per_request = tokio::spawn(connection_per_request(
        host.current_sock(),
        Arc::clone(&stop),
    ));
    let kept_alive = tokio::spawn(keep_alive(host.current_sock(), Arc::clone(&stop)));

    let mut generations = vec![first.generation.expect("a generation")];
    for rev in 2..2 + SWAPS {
        let which = usize::from(rev % 2 == 1);
        let result = host
            .swap(&host.attempt(rev, &builds[which], names[which]))
            .await;
        assert_eq!(result.outcome, Outcome::Done, "swap {rev}: {result:?}");
        let serving = host.who_serves().await.expect("something serves");
        assert_eq!(serving.build, names[which], "swap {rev}");
        assert_eq!(Some(serving.generation), result.generation, "swap {rev}");
        generations.push(serving.generation);
    }
    stop.store(true, Ordering::SeqCst);
    let per_request = per_request.await.expect("the per-request client");
    let kept_alive = kept_alive.await.expect("the keep-alive client");

    for (name, tally) in [("per-request", &per_request), ("keep-alive", &kept_alive)] {
        eprintln!(
            "{name}: {} answered, {} reconnects, {} generations seen, {} failures",
            tally.answered,
            tally.reconnects,
            tally.generations.len(),
            tally.failures.len()
        );
        assert!(
            tally.failures.is_empty(),
            "{name} client: {} failed requests: {:?}",
            tally.failures.len(),
            tally.failures
        );
        // Requests crossed the swaps: they reached more than a few of the
        // generations that served.
        assert!(
            tally.generations.len() > SWAPS as usize / 2,
            "{name} client saw generations {:?} of {generations:?}",
            tally.generations
        );
    }
    assert!(
        kept_alive.reconnects >= SWAPS as u64 / 2,
        "the keep-alive client followed the swaps: {kept_alive:?}"
    );
    host.assert_only(generations.last().copied());
    host.tear_down().await;
}
