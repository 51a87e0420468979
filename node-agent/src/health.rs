//! The health check: HTTP/1.1 `GET` over a generation's own unix socket
//! (SPEC §5.5 step 6).
//!
//! [`wait_healthy`] asks until an answer below 500 arrives or the deadline
//! passes. A missing socket (the process has not bound it yet), a refused
//! connection, a 5xx answer and a request that hangs are all retried, with a
//! short backoff (1 ms doubling to 200 ms), each try bounded by its own
//! request timeout. The last observation is kept, so a timeout says what
//! went wrong: "no healthy answer on /run/genswap/default.app/gen-3.sock
//! (GET /) within 30s after 212 attempts: last attempt: connection refused".
//!
//! For the one classifier (SPEC §5.4): [`HealthError::Timeout`] is `failed`
//! (the build's own failure), [`HealthError::Cancelled`] is `cancelled`, and
//! [`HealthError::InvalidPath`] is `stale` (the attempt's health path is
//! unusable; nothing is known about the build). [`HealthError::Request`]
//! comes only from the one-shot [`get`].

use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use thiserror::Error;
use tokio::net::UnixStream;
use tokio::task::JoinHandle;

/// The `Host` header every request carries.
pub const HOST: &str = "localhost";
/// How long [`get`] waits for the whole answer.
pub const DEFAULT_GET_TIMEOUT: Duration = Duration::from_secs(10);

/// How [`wait_healthy_with`] asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthPolicy {
    /// The whole wait, from the first try (`health.timeoutSeconds`).
    pub timeout: Duration,
    /// The longest one try may take, from connect to the status line
    /// (capped by what is left of `timeout`).
    pub request_timeout: Duration,
    /// The pause after the first failed try.
    pub initial_backoff: Duration,
    /// The pause doubles up to this.
    pub max_backoff: Duration,
}

impl HealthPolicy {
    /// The default policy with the given overall timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        Self {
            timeout,
            request_timeout: Duration::from_secs(5),
            // A try that finds no socket costs a failed connect; starting
            // at 1 ms finds a successor that binds a few ms late within a
            // ms or two of its bind, where 20 ms made it wait up to 20.
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(200),
        }
    }
}

/// A healthy answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthReport {
    /// The status code, below 500.
    pub status: u16,
    /// Tries made, the healthy one included.
    pub attempts: u32,
    /// From the first try to the healthy answer.
    pub elapsed: Duration,
}

/// What one try saw when it did not get a healthy answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Observation {
    /// Nothing at the socket path: the process has not bound it (yet).
    NoSocket,
    /// A socket file with nobody accepting on it.
    Refused,
    /// An answer of 500 or more.
    Status(u16),
    /// No status line within the try's timeout.
    Hung(Duration),
    /// The connect failed otherwise.
    Connect(String),
    /// The connection was made, but the HTTP exchange failed (closed early,
    /// not HTTP).
    Http(String),
}

impl Observation {
    /// The try got a connection accepted: what it saw is about the server.
    fn connected(&self) -> bool {
        matches!(
            self,
            Observation::Status(_) | Observation::Hung(_) | Observation::Http(_)
        )
    }

    /// Whether this try's observation, rather than `last`, is the reason
    /// to give. A hang the deadline cut short may only have been a slow
    /// answer: it says less than an earlier try that connected (a 5xx, a
    /// broken exchange, a full hang), but more than one that could not
    /// connect at all (not bound, refused).
    fn outranks(&self, last: Option<&Observation>, cut_short: bool) -> bool {
        match self {
            Observation::Hung(_) if cut_short => !last.is_some_and(Observation::connected),
            _ => true,
        }
    }
}

impl fmt::Display for Observation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Observation::NoSocket => f.write_str("no socket at the path (not bound)"),
            Observation::Refused => f.write_str("connection refused"),
            Observation::Status(code) => match StatusCode::from_u16(*code)
                .ok()
                .and_then(|s| s.canonical_reason())
            {
                Some(reason) => write!(f, "answered {code} {reason}"),
                None => write!(f, "answered {code}"),
            },
            Observation::Hung(after) => write!(f, "no answer within {after:?}"),
            Observation::Connect(error) => write!(f, "connect failed: {error}"),
            Observation::Http(error) => write!(f, "HTTP exchange failed: {error}"),
        }
    }
}

/// Why no healthy answer came.
#[derive(Debug, Error)]
pub enum HealthError {
    /// The deadline passed: the build's failure.
    #[error(
        "no healthy answer on {} (GET {path}) within {timeout:?} after {attempts} attempts: last attempt: {last}",
        socket.display()
    )]
    Timeout {
        socket: PathBuf,
        path: String,
        timeout: Duration,
        attempts: u32,
        last: Observation,
    },
    /// The attempt's lifetime ended first: not the build's fault.
    #[error(
        "health check on {} cancelled after {attempts} attempts ({elapsed:?})",
        socket.display()
    )]
    Cancelled {
        socket: PathBuf,
        attempts: u32,
        elapsed: Duration,
    },
    /// The health path cannot be sent in a request line.
    #[error("health path {path:?} is not an absolute HTTP path")]
    InvalidPath { path: String },
    /// [`get`]'s one try failed.
    #[error("GET {path} on {} failed: {last}", socket.display())]
    Request {
        socket: PathBuf,
        path: String,
        last: Observation,
    },
}

/// Waits until `GET path` on `socket` answers below 500, within `timeout`
/// (with [`HealthPolicy::with_timeout`]), or `cancel` resolves.
///
/// `cancel` is the attempt's lifetime: pass a future that resolves when it
/// ends (`std::future::pending()` for none).
pub async fn wait_healthy(
    socket: &Path,
    path: &str,
    timeout: Duration,
    cancel: impl Future<Output = ()>,
) -> Result<HealthReport, HealthError> {
    wait_healthy_with(socket, path, &HealthPolicy::with_timeout(timeout), cancel).await
}

/// [`wait_healthy`] with every knob.
pub async fn wait_healthy_with(
    socket: &Path,
    path: &str,
    policy: &HealthPolicy,
    cancel: impl Future<Output = ()>,
) -> Result<HealthReport, HealthError> {
    let uri = request_uri(path)?;
    let start = Instant::now();
    let deadline = start + policy.timeout;
    let mut cancel = std::pin::pin!(cancel);
    let mut backoff = policy.initial_backoff;
    let mut attempts = 0u32;
    let mut last: Option<Observation> = None;
    let cancelled = |attempts| HealthError::Cancelled {
        socket: socket.to_path_buf(),
        attempts,
        elapsed: start.elapsed(),
    };
    let timed_out = |attempts, last: Option<Observation>| HealthError::Timeout {
        socket: socket.to_path_buf(),
        path: path.to_string(),
        timeout: policy.timeout,
        attempts,
        last: last.unwrap_or(Observation::Hung(Duration::ZERO)),
    };
    loop {
        // The first try runs however short the timeout; later ones only
        // while time is left.
        let left = deadline.saturating_duration_since(Instant::now());
        if attempts > 0 && left.is_zero() {
            return Err(timed_out(attempts, last));
        }
        let limit = policy
            .request_timeout
            .min(left.max(Duration::from_millis(1)));
        attempts += 1;
        let observation = tokio::select! {
            biased;
            () = &mut cancel => return Err(cancelled(attempts)),
            observed = status_within(socket, &uri, limit) => observed,
        };
        match observation {
            Ok(status) => {
                return Ok(HealthReport {
                    status,
                    attempts,
                    elapsed: start.elapsed(),
                });
            }
            Err(observation) => {
                let cut_short = limit < policy.request_timeout;
                if observation.outranks(last.as_ref(), cut_short) {
                    last = Some(observation);
                }
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(timed_out(attempts, last));
        }
        let pause = backoff.min(deadline - now);
        tokio::select! {
            biased;
            () = &mut cancel => return Err(cancelled(attempts)),
            () = tokio::time::sleep(pause) => {}
        }
        backoff = (backoff * 2).min(policy.max_backoff);
    }
}

/// One `GET path` on `socket`: the status and the whole body, within
/// [`DEFAULT_GET_TIMEOUT`]. Any status is returned as it is; for tests and
/// the demo.
pub async fn get(socket: &Path, path: &str) -> Result<(u16, Bytes), HealthError> {
    get_within(socket, path, DEFAULT_GET_TIMEOUT).await
}

/// [`get`] with a timeout for the whole exchange.
pub async fn get_within(
    socket: &Path,
    path: &str,
    timeout: Duration,
) -> Result<(u16, Bytes), HealthError> {
    let uri = request_uri(path)?;
    let exchange = async {
        let (status, body) = exchange(socket, &uri, true).await?;
        Ok((status.as_u16(), body))
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(result) => result,
        Err(_) => Err(Observation::Hung(timeout)),
    }
    .map_err(|last| HealthError::Request {
        socket: socket.to_path_buf(),
        path: path.to_string(),
        last,
    })
}

fn request_uri(path: &str) -> Result<Uri, HealthError> {
    let invalid = || HealthError::InvalidPath {
        path: path.to_string(),
    };
    if !path.starts_with('/') {
        return Err(invalid());
    }
    Uri::builder()
        .path_and_query(path)
        .build()
        .map_err(|_| invalid())
}

/// One try: `Ok(status)` when healthy (below 500), else what was seen.
async fn status_within(socket: &Path, uri: &Uri, limit: Duration) -> Result<u16, Observation> {
    match tokio::time::timeout(limit, exchange(socket, uri, false)).await {
        Err(_) => Err(Observation::Hung(limit)),
        Ok(Err(observation)) => Err(observation),
        Ok(Ok((status, _))) if status.is_server_error() || status.as_u16() >= 600 => {
            Err(Observation::Status(status.as_u16()))
        }
        Ok(Ok((status, _))) => Ok(status.as_u16()),
    }
}

/// Aborts the connection's driver task when the exchange ends, however it
/// ends, so a hung peer leaves no task behind.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn exchange(
    socket: &Path,
    uri: &Uri,
    read_body: bool,
) -> Result<(StatusCode, Bytes), Observation> {
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Observation::NoSocket,
            std::io::ErrorKind::ConnectionRefused => Observation::Refused,
            _ => Observation::Connect(e.to_string()),
        })?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| Observation::Http(e.to_string()))?;
    let _driver = AbortOnDrop(tokio::spawn(async move {
        // Its error surfaces through send_request below.
        let _ = connection.await;
    }));
    let request = Request::builder()
        .method(Method::GET)
        .uri(uri.clone())
        .header(header::HOST, HOST)
        .header(header::USER_AGENT, "genswap-node-agent")
        .header(header::CONNECTION, "close")
        .body(Empty::<Bytes>::new())
        .map_err(|e| Observation::Http(e.to_string()))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| Observation::Http(e.to_string()))?;
    let status = response.status();
    if !read_body {
        return Ok((status, Bytes::new()));
    }
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| Observation::Http(e.to_string()))?
        .to_bytes();
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hang_cut_short_by_the_deadline_outranks_only_tries_that_never_connected() {
        let cut = Observation::Hung(Duration::from_millis(1200));
        // Bound late, then hung: the hang is the news.
        assert!(cut.outranks(Some(&Observation::NoSocket), true));
        assert!(cut.outranks(Some(&Observation::Refused), true));
        assert!(cut.outranks(Some(&Observation::Connect("reset".into())), true));
        assert!(cut.outranks(None, true));
        // An answer, a broken exchange or a full hang before says more.
        assert!(!cut.outranks(Some(&Observation::Status(500)), true));
        assert!(!cut.outranks(Some(&Observation::Http("closed".into())), true));
        assert!(!cut.outranks(Some(&Observation::Hung(Duration::from_secs(5))), true));
        // A full-length hang, or anything else, is always the latest news.
        assert!(cut.outranks(Some(&Observation::Status(500)), false));
        assert!(Observation::NoSocket.outranks(Some(&Observation::Status(500)), true));
    }

    #[test]
    fn observations_read_as_reasons() {
        assert_eq!(
            Observation::Status(500).to_string(),
            "answered 500 Internal Server Error"
        );
        assert_eq!(Observation::Refused.to_string(), "connection refused");
        assert_eq!(
            Observation::Hung(Duration::from_secs(2)).to_string(),
            "no answer within 2s"
        );
    }

    #[test]
    fn only_absolute_paths_are_sent() {
        assert!(request_uri("/healthz?x=1").is_ok());
        for bad in ["healthz", "", "http://x/", "/a b"] {
            assert!(
                matches!(request_uri(bad), Err(HealthError::InvalidPath { .. })),
                "{bad:?}"
            );
        }
    }
}
