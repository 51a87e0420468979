//! Liveness between attempts (SPEC 5.10): the serving generation's
//! `liveness` probe, every `periodSeconds` after `initialDelaySeconds`,
//! each try bounded by `timeoutSeconds`; `failureThreshold` failures in a
//! row end the watch with the last observation, and the supervisor stops
//! the generation as for an exit. Between tries only a timer waits.

use std::time::Duration;

use genswap_crds::LivenessSpec;
use tokio::time::{Instant, sleep, sleep_until};

use crate::observation::Observation;
use crate::probe::Probe;

/// Ends a generation's liveness task when the generation's handle goes.
#[derive(Debug)]
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A serving generation's liveness probe and its timing.
#[derive(Clone, Debug)]
pub(crate) struct Liveness {
    probe: Probe,
    initial_delay: Duration,
    period: Duration,
    timeout: Duration,
    failure_threshold: u32,
}

/// How a liveness watch ended: the failures in a row and what the last saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LivenessFailure {
    pub(crate) failures: u32,
    pub(crate) probe: String,
    pub(crate) last: Observation,
}

/// How much of a failure the exit record keeps.
const DESCRIBED_CHARS: usize = 1024;

impl LivenessFailure {
    /// For the exit record and the reason: what failed, how often, and what
    /// it saw last.
    pub(crate) fn describe(&self) -> String {
        let text = format!(
            "liveness probe {} failed {} times in a row: {}",
            self.probe, self.failures, self.last
        );
        // The status field holds 4096 characters; a command line may not.
        match text.char_indices().nth(DESCRIBED_CHARS) {
            Some((end, _)) => format!("{}…", &text[..end]),
            None => text,
        }
    }
}

fn seconds(value: i32, floor: u64) -> Duration {
    Duration::from_secs(u64::try_from(value).unwrap_or(floor).max(floor))
}

impl Liveness {
    pub(crate) fn new(probe: Probe, spec: &LivenessSpec) -> Liveness {
        Liveness {
            probe,
            initial_delay: seconds(spec.initial_delay_seconds, 0),
            period: seconds(spec.period_seconds, 1),
            timeout: seconds(spec.timeout_seconds, 1),
            failure_threshold: u32::try_from(spec.failure_threshold).unwrap_or(1).max(1),
        }
    }

    /// Probes until `failureThreshold` tries in a row fail; never resolves
    /// for a generation that stays alive. Cancel it by dropping it (an exec
    /// try in flight is then killed with its cgroup).
    pub(crate) async fn failed(&self) -> LivenessFailure {
        sleep(self.initial_delay).await;
        let mut failures = 0;
        loop {
            let started = Instant::now();
            match self.probe.check(self.timeout).await {
                Ok(_) => failures = 0,
                Err(last) => {
                    failures += 1;
                    tracing::debug!(probe = %self.probe.describe(), failures, %last, "a liveness probe failed");
                    if failures >= self.failure_threshold {
                        return LivenessFailure {
                            failures,
                            probe: self.probe.describe(),
                            last,
                        };
                    }
                }
            }
            sleep_until(started + self.period).await;
        }
    }
}
