//! The load generator, run as its own process (`genswap-bench loadgen`) so
//! that its threads never share a runtime or a scheduler with the agent
//! driver it measures.
//!
//! Two groups of clients run at once against one target:
//! - keep-alive clients: one connection each, reused across requests. A
//!   connection the server closed between requests (seen as EOF before the
//!   next request is written, a write that fails on it, or `connection:
//!   close` on the previous response) is a reconnect, not a failure.
//! - per-request clients: a new connection for every request.
//!
//! Against a UDP target (`udp:host:port`) a request is a DNS-like query
//! (`crate::datagram`): keep-alive clients send from one socket each,
//! per-request clients from a fresh one (a fresh source port) each time,
//! and an unanswered query is `lost`.
//!
//! Each group runs either at a fixed rate (requests per second, spread over
//! its clients, each client on its own schedule) or at saturation (every
//! client sends its next request as soon as the previous one ended, with a
//! 1 ms pause after a failure so a dead target does not spin).
//!
//! Every request is one sample: start (CLOCK_MONOTONIC ns, the clock the
//! driver stamps swaps with), latency, client group, result (the status
//! code, or `refused`, `nosocket`, `connect`, `write`, `eof`, `reset`,
//! `timeout`, `malformed`), and the generation that answered. It stops when
//! its stdin closes, and then writes the samples as CSV.

use std::fs::File;
use std::io::{self, BufRead, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::clock::mono_ns;
use crate::http1::{Connection, RequestError, Target};

/// How long a request may wait for its response before it counts as a
/// timeout.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// The pause after a failed request at saturation.
const FAILURE_PAUSE: Duration = Duration::from_millis(1);

/// The load generator's settings.
#[derive(Clone, Debug, clap::Args)]
pub struct LoadArgs {
    /// `unix:<path>` or `tcp:<host:port>`.
    #[arg(long)]
    pub target: Target,
    /// Keep-alive clients (one connection each).
    #[arg(long, default_value_t = 4)]
    pub keepalive: usize,
    /// Clients that open a new connection per request.
    #[arg(long, default_value_t = 4)]
    pub per_request: usize,
    /// Requests per second for each group; 0 is saturation.
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// The samples file (CSV).
    #[arg(long)]
    pub out: PathBuf,
}

/// Which group a client belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Group {
    /// One connection reused across requests.
    KeepAlive,
    /// A new connection per request.
    PerRequest,
}

impl Group {
    fn code(self) -> char {
        match self {
            Group::KeepAlive => 'k',
            Group::PerRequest => 'n',
        }
    }
}

/// One request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    /// When it started, CLOCK_MONOTONIC ns.
    pub start_ns: u64,
    /// From start to the end of the response (or the failure).
    pub latency_ns: u64,
    /// The client group.
    pub group: Group,
    /// The status code, or 0 for a failure without one.
    pub status: u16,
    /// Why it failed without a status (empty when it has one).
    pub error: &'static str,
    /// The generation that answered (0 when none did).
    pub generation: u64,
}

impl Sample {
    /// A 2xx answer.
    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// When the response ended.
    pub fn end_ns(&self) -> u64 {
        self.start_ns + self.latency_ns
    }
}

/// What the load generator says when it ends (one JSON line on stdout).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct LoadSummary {
    /// Requests sent.
    pub requests: u64,
    /// Keep-alive connections the server closed between requests, reopened.
    pub reconnects: u64,
}

/// Why the load generator could not run or save.
#[derive(Debug, Error)]
pub enum LoadError {
    /// The samples file could not be written.
    #[error("writing samples to {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The samples file could not be read.
    #[error("reading samples from {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A line of the samples file does not parse.
    #[error("{path}:{line}: not a sample")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The line number.
        line: usize,
    },
    /// A client thread could not be started or panicked.
    #[error("client thread: {0}")]
    Thread(String),
}

struct WorkerResult {
    samples: Vec<Sample>,
    reconnects: u64,
}

/// Runs the load until stdin closes, then writes the samples.
pub fn run(args: &LoadArgs) -> Result<LoadSummary, LoadError> {
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = Arc::clone(&stop);
        // The driver closes our stdin to end the run (or dies, which closes it too).
        thread::Builder::new()
            .name("stdin".into())
            .spawn(move || {
                let mut sink = [0u8; 64];
                let mut stdin = io::stdin();
                while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
                stop.store(true, Ordering::SeqCst);
            })
            .map_err(|e| LoadError::Thread(e.to_string()))?;
    }
    let mut handles = Vec::new();
    for (group, clients) in [
        (Group::KeepAlive, args.keepalive),
        (Group::PerRequest, args.per_request),
    ] {
        let interval = (args.rate > 0.0 && clients > 0)
            .then(|| Duration::from_secs_f64(clients as f64 / args.rate));
        for index in 0..clients {
            let target = args.target.clone();
            let stop = Arc::clone(&stop);
            // Spread the clients of a group over one interval.
            let offset = interval.map(|i| i.mul_f64(index as f64 / clients as f64));
            let handle = thread::Builder::new()
                .name(format!("{}{index}", group.code()))
                .spawn(move || client(group, &target, interval, offset, &stop))
                .map_err(|e| LoadError::Thread(e.to_string()))?;
            handles.push(handle);
        }
    }
    let mut samples = Vec::new();
    let mut reconnects = 0;
    for handle in handles {
        let result = handle
            .join()
            .map_err(|_| LoadError::Thread("a client panicked".into()))?;
        samples.extend(result.samples);
        reconnects += result.reconnects;
    }
    samples.sort_by_key(|s| s.start_ns);
    write_samples(&args.out, &samples)?;
    Ok(LoadSummary {
        requests: samples.len() as u64,
        reconnects,
    })
}

fn client(
    group: Group,
    target: &Target,
    interval: Option<Duration>,
    offset: Option<Duration>,
    stop: &AtomicBool,
) -> WorkerResult {
    let mut result = WorkerResult {
        samples: Vec::with_capacity(1 << 16),
        reconnects: 0,
    };
    let mut connection: Option<Connection> = None;
    let mut datagram_socket = None;
    let mut next = mono_ns() + offset.map_or(0, duration_ns);
    while !stop.load(Ordering::Relaxed) {
        if let Some(interval) = interval {
            let now = mono_ns();
            if next > now {
                thread::sleep(Duration::from_nanos(next - now));
            }
            // A client that fell behind does not burst to catch up.
            next =
                next.max(mono_ns().saturating_sub(duration_ns(interval))) + duration_ns(interval);
        }
        let sample = match (target, group) {
            (Target::Udp(address), Group::PerRequest) => crate::datagram::one_fresh(address),
            (Target::Udp(address), Group::KeepAlive) => {
                crate::datagram::one_reused(address, &mut datagram_socket)
            }
            (_, Group::PerRequest) => one_per_request(target),
            (_, Group::KeepAlive) => one_keepalive(target, &mut connection, &mut result.reconnects),
        };
        let failed = !sample.ok();
        result.samples.push(sample);
        if failed && interval.is_none() {
            thread::sleep(FAILURE_PAUSE);
        }
    }
    result
}

fn one_per_request(target: &Target) -> Sample {
    let start = mono_ns();
    let outcome = Connection::open(target, REQUEST_TIMEOUT).and_then(|mut c| c.get(true));
    sample(Group::PerRequest, start, outcome)
}

fn one_keepalive(
    target: &Target,
    connection: &mut Option<Connection>,
    reconnects: &mut u64,
) -> Sample {
    if connection.as_ref().is_some_and(Connection::closed_by_peer) {
        *connection = None;
        *reconnects += 1;
    }
    let start = mono_ns();
    let outcome = loop {
        let reused = connection.is_some();
        let conn = match connection {
            Some(conn) => conn,
            None => match Connection::open(target, REQUEST_TIMEOUT) {
                Ok(conn) => connection.insert(conn),
                Err(error) => break Err(error),
            },
        };
        match conn.get(false) {
            // The server closed it just before the write: nothing was sent.
            Err(RequestError::Write(_)) if reused => {
                *connection = None;
                *reconnects += 1;
            }
            Ok(response) => {
                if response.close {
                    *connection = None;
                    *reconnects += 1;
                }
                break Ok(response);
            }
            Err(error) => {
                *connection = None;
                break Err(error);
            }
        }
    };
    sample(Group::KeepAlive, start, outcome)
}

fn sample(
    group: Group,
    start_ns: u64,
    outcome: Result<crate::http1::Response, RequestError>,
) -> Sample {
    let latency_ns = mono_ns().saturating_sub(start_ns);
    match outcome {
        Ok(response) => Sample {
            start_ns,
            latency_ns,
            group,
            status: response.status,
            error: "",
            generation: response.generation.unwrap_or(0),
        },
        Err(error) => Sample {
            start_ns,
            latency_ns,
            group,
            status: 0,
            error: error.label(),
            generation: 0,
        },
    }
}

fn duration_ns(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// Writes samples as CSV: `start_ns,latency_ns,group,result,generation`.
pub fn write_samples(path: &Path, samples: &[Sample]) -> Result<(), LoadError> {
    let write_error = |source| LoadError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut out = BufWriter::new(File::create(path).map_err(write_error)?);
    writeln!(out, "start_ns,latency_ns,group,result,generation").map_err(write_error)?;
    for s in samples {
        let result: &dyn std::fmt::Display = if s.status > 0 { &s.status } else { &s.error };
        writeln!(
            out,
            "{},{},{},{},{}",
            s.start_ns,
            s.latency_ns,
            s.group.code(),
            result,
            s.generation
        )
        .map_err(write_error)?;
    }
    out.flush().map_err(write_error)
}

/// Reads a samples file written by [`write_samples`].
pub fn read_samples(path: &Path) -> Result<Vec<Sample>, LoadError> {
    let file = File::open(path).map_err(|source| LoadError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut samples = Vec::new();
    for (index, line) in io::BufReader::new(file).lines().enumerate().skip(1) {
        let line = line.map_err(|source| LoadError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let parsed = parse_sample(&line).ok_or_else(|| LoadError::Parse {
            path: path.to_path_buf(),
            line: index + 1,
        })?;
        samples.push(parsed);
    }
    Ok(samples)
}

const ERROR_LABELS: [&str; 8] = [
    "refused",
    "nosocket",
    "connect",
    "write",
    "eof",
    "reset",
    "timeout",
    "malformed",
];

fn parse_sample(line: &str) -> Option<Sample> {
    let mut fields = line.split(',');
    let start_ns = fields.next()?.parse().ok()?;
    let latency_ns = fields.next()?.parse().ok()?;
    let group = match fields.next()? {
        "k" => Group::KeepAlive,
        "n" => Group::PerRequest,
        _ => return None,
    };
    let result = fields.next()?;
    let generation = fields.next()?.parse().ok()?;
    let (status, error) = match result.parse::<u16>() {
        Ok(status) => (status, ""),
        Err(_) => (0, *ERROR_LABELS.iter().find(|l| **l == result)?),
    };
    Some(Sample {
        start_ns,
        latency_ns,
        group,
        status,
        error,
        generation,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_survive_the_csv_round_trip() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("samples.csv");
        let samples = vec![
            Sample {
                start_ns: 10,
                latency_ns: 5,
                group: Group::KeepAlive,
                status: 200,
                error: "",
                generation: 3,
            },
            Sample {
                start_ns: 12,
                latency_ns: 7,
                group: Group::PerRequest,
                status: 0,
                error: "refused",
                generation: 0,
            },
        ];
        write_samples(&path, &samples).expect("written");
        assert_eq!(read_samples(&path).expect("read"), samples);
    }
}

#[cfg(test)]
mod client_tests {
    use std::io::Write;

    use super::*;
    use crate::http1::tests::{read_request, serve};

    #[test]
    fn a_server_closing_between_requests_costs_reconnects_not_failures() {
        let dir = tempfile::tempdir().expect("temp dir");
        // Each connection: one keep-alive answer, then closed.
        let (target, server) = serve(dir.path(), 4, |mut stream| {
            assert!(read_request(&mut stream), "a request");
            stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .expect("answer");
        });
        let mut connection = None;
        let mut reconnects = 0;
        for request in 0..4 {
            let sample = one_keepalive(&target, &mut connection, &mut reconnects);
            assert!(sample.ok(), "request {request}: {sample:?}");
            // Let the server's close arrive before the next request.
            if let Some(conn) = &connection {
                let deadline = std::time::Instant::now() + Duration::from_secs(10);
                while !conn.closed_by_peer() {
                    assert!(std::time::Instant::now() < deadline, "close not seen");
                    thread::sleep(Duration::from_millis(2));
                }
            }
        }
        assert_eq!(
            reconnects, 3,
            "one per connection the server closed, before the next request"
        );
        server.join().expect("server thread");
    }
}
