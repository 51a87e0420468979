//! The readiness window (SPEC 5.5 step 6): a generation's `health` probe
//! ([`crate::probe`]) tried until it is healthy or the window closes.
//!
//! [`wait_for`] tries until healthy or the deadline passes. A missing
//! socket (the process has not bound it yet), a refused connection, an
//! unhealthy answer and a try that hangs are all retried, with a short
//! backoff (1 ms doubling to 200 ms), each try bounded by its own timeout.
//! The last observation is kept, so a timeout says what went wrong: "no
//! healthy answer on /run/genswap/default.app/gen-3.sock (GET /) within
//! 30s after 212 attempts: last attempt: connection refused".
//!
//! For the one classifier (SPEC 5.4): [`HealthError::Timeout`] is `failed`
//! (the build's own failure), [`HealthError::Cancelled`] is `cancelled`, and
//! [`HealthError::Invalid`] is `stale` (the attempt's probe is unusable;
//! nothing is known about the build). [`HealthError::Request`] comes only
//! from the one-shot [`get`].

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use thiserror::Error;

pub use crate::probe::Healthy;
pub use crate::probe::http_get::HOST;
use crate::probe::{Endpoint, Probe, ProbeError};

use crate::observation::Observation;

/// How long [`get`] waits for the whole answer.
pub const DEFAULT_GET_TIMEOUT: Duration = Duration::from_secs(10);

/// How [`wait_for`] asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthPolicy {
    /// The whole wait, from the first try (`health.timeoutSeconds`).
    pub timeout: Duration,
    /// The longest one try may take (capped by what is left of `timeout`).
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

/// A healthy try.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthReport {
    /// What made it healthy (an HTTP status, a connect, ...).
    pub healthy: Healthy,
    /// Tries made, the healthy one included.
    pub attempts: u32,
    /// From the first try to the healthy one.
    pub elapsed: Duration,
}

/// Why no healthy answer came.
#[derive(Debug, Error)]
pub enum HealthError {
    /// The deadline passed: the build's failure.
    #[error(
        "no healthy answer on {probe} within {timeout:?} after {attempts} attempts: last attempt: {last}"
    )]
    Timeout {
        /// What was asked, and of whom.
        probe: String,
        timeout: Duration,
        attempts: u32,
        last: Observation,
    },
    /// The attempt's lifetime ended first: not the build's fault.
    #[error("health check {probe} cancelled after {attempts} attempts ({elapsed:?})")]
    Cancelled {
        probe: String,
        attempts: u32,
        elapsed: Duration,
    },
    /// The probe cannot be made from the attempt's spec.
    #[error(transparent)]
    Invalid(#[from] ProbeError),
    /// [`get`]'s one try failed.
    #[error("GET {path} on {} failed: {last}", socket.display())]
    Request {
        socket: PathBuf,
        path: String,
        last: Observation,
    },
}

/// Waits until `GET path` on the unix socket `socket` answers from 200 to
/// 399, within `timeout` (with [`HealthPolicy::with_timeout`]), or `cancel`
/// resolves.
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
    let probe = Probe::http_on_socket(socket, path)?;
    wait_for(&probe, policy, cancel).await
}

/// Tries `probe` until it is healthy, `policy.timeout` passes or `cancel`
/// resolves.
pub async fn wait_for(
    probe: &Probe,
    policy: &HealthPolicy,
    cancel: impl Future<Output = ()>,
) -> Result<HealthReport, HealthError> {
    let start = Instant::now();
    let deadline = start + policy.timeout;
    let mut cancel = std::pin::pin!(cancel);
    let mut backoff = policy.initial_backoff;
    let mut attempts = 0u32;
    let mut last: Option<Observation> = None;
    let cancelled = |attempts| HealthError::Cancelled {
        probe: probe.describe(),
        attempts,
        elapsed: start.elapsed(),
    };
    let timed_out = |attempts, last: Option<Observation>| HealthError::Timeout {
        probe: probe.describe(),
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
            observed = probe.check(limit) => observed,
        };
        match observation {
            Ok(healthy) => {
                return Ok(HealthReport {
                    healthy,
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
    let uri = crate::probe::http_get::request_uri(path)?;
    let endpoint = Endpoint::Unix(socket.to_path_buf());
    let exchange = async {
        let (status, body) = crate::probe::http_get::exchange(&endpoint, &uri, true).await?;
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
