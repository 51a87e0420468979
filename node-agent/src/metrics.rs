//! The agent's operations endpoints: `/metrics`, `/healthz` and `/readyz`.
//!
//! Both intakes use this module: the Kubernetes mode ([`crate::kube`]) and
//! standalone mode. It knows nothing of Kubernetes: an intake records each
//! [`SwapResult`] with [`AgentMetrics::record_result`], keeps the gauges
//! current, flips [`Readiness`] as it gains the node and reads its source, and
//! runs [`serve`] on a listener from [`bind`]. The endpoints themselves are
//! the controller's ([`genswap_runtime::http`]), over the agent's metrics
//! and readiness.
//!
//! Metrics (OpenMetrics text, every name prefixed `genswap_agent_`):
//!
//! | name | type | labels | meaning |
//! | --- | --- | --- | --- |
//! | `genswap_agent_attempts_total` | counter | `outcome`, `mode` | attempts ended, by outcome and the mode that ran |
//! | `genswap_agent_step_duration_seconds` | histogram | `step` | time spent in each swap step |
//! | `genswap_agent_generations_running` | gauge | | instances with a serving generation on this node |
//! | `genswap_agent_journal_backlog` | gauge | | outcomes not yet accepted by the API server (or the status file) |
//! | `genswap_agent_generation_exits_total` | counter | `reason` | serving generations that exited between attempts: `exited` (by themselves, with a code), `signaled`, `oom_killed`, `unknown` (adopted after an agent restart: not this agent's child), `liveness_failed` (stopped by the agent after its liveness probe failed) |
//! | `genswap_agent_generation_restarts_total` | counter | `reason` | restarts that served, by the `reason` of the exit that caused them (the labels above) |
//! | `genswap_agent_log_records_dropped_total` | counter | `instance` | records of instances' output their log shims could not write (a full disk), read from the `<N>.dropped` files at each scrape |
//! | `genswap_agent_listener_handovers_total` | counter | `handover` | attempts with listeners that ended, by how new connections reached generations (SPEC 6.3): `steered` (a socket per generation, the BPF map picks), `shared` (one socket; the kernel refused BPF, or `--listener-handover=shared`) |
//! | `genswap_agent_listener_datagrams_dropped_total` | counter | `instance`, `listener` | datagrams the kernel dropped on a UDP listener's sockets (a full buffer: no generation read fast enough, or none ran), from `/proc/net/udp` at each scrape |
//! | `genswap_agent_stage_bytes_total` | counter | | bytes staging fetched from URLs and registries, counted as they arrive while a build is staged ahead of its rollout (`rollout.prestage`) |
//! | `genswap_agent_retirements_total` | counter | `result` | serving instances no attempt named any more, looked up: `stopped` (the InstanceGeneration was deleted or no longer selects this node), `kept` (it exists and selects this node), `failed` (the lookup or the stop failed; tried again) |
//!
//! `/healthz` answers 200 while the process serves HTTP. `/readyz` answers
//! 200 once the agent owns the node and its intake has read its source
//! (the watch synced, or the directory was read), 503 with the missing part
//! otherwise.

use std::borrow::Cow;
use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use genswap_crds::{Mode, Outcome};
use genswap_runtime::http::{self, Exposition, ReadinessCheck};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use tokio::net::TcpListener;

use crate::engine::SwapResult;

/// The prefix of every metric name.
pub const PREFIX: &str = "genswap_agent";

/// The content type `/metrics` answers with.
pub use genswap_runtime::http::CONTENT_TYPE;
pub use genswap_runtime::http::{HttpError, bind};

/// The default `--metrics-addr`: loopback only, since the agent runs with
/// host networking.
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:9090";

/// Labels of `attempts_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AttemptLabels {
    outcome: String,
    mode: String,
}

/// Labels of `step_duration_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StepLabels {
    step: String,
}

/// Labels of `generation_exits_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ExitLabels {
    reason: String,
}

/// Labels of `log_records_dropped_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InstanceLabels {
    instance: String,
}

/// Labels of `listener_datagrams_dropped_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabels {
    instance: String,
    listener: String,
}

/// One UDP listener socket's drop count, as the kernel keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatagramDrops {
    /// `namespace/name`.
    pub instance: String,
    pub listener: String,
    /// The socket's inode: a steered listener's socket changes at each
    /// overlap, and each counts from 0.
    pub socket: u64,
    pub drops: u64,
}

/// Where the drop counts come from at a scrape (the engine's listeners).
pub type DatagramDropSource = Arc<dyn Fn() -> Vec<DatagramDrops> + Send + Sync>;

/// A [`DatagramDropSource`] held by the metrics.
struct DropSource(DatagramDropSource);

impl std::fmt::Debug for DropSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DropSource")
    }
}

/// Labels of `listener_handovers_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HandoverLabels {
    handover: String,
}

/// Labels of `retirements_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RetirementLabels {
    result: String,
}

/// What became of a serving instance no attempt named any more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retirement {
    /// Its InstanceGeneration was deleted or no longer selects this node;
    /// it was stopped.
    Stopped,
    /// Its InstanceGeneration exists and selects this node (or an attempt
    /// took it); it serves on.
    Kept,
    /// The lookup or the stop failed; it is tried again.
    Failed,
}

impl Retirement {
    fn label(self) -> &'static str {
        match self {
            Retirement::Stopped => "stopped",
            Retirement::Kept => "kept",
            Retirement::Failed => "failed",
        }
    }
}

type StepHistograms = Family<StepLabels, Histogram, fn() -> Histogram>;

/// Steps last from a millisecond (a refused admission) to minutes (a health
/// timeout, a long drain): 1 ms doubling to about 9 minutes.
fn step_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 20))
}

/// The agent's metrics and the registry that exposes them.
#[derive(Debug)]
pub struct AgentMetrics {
    registry: Registry,
    attempts: Family<AttemptLabels, Counter>,
    step_duration: StepHistograms,
    generations_running: Gauge,
    journal_backlog: Gauge,
    retirements: Family<RetirementLabels, Counter>,
    log_drops: Family<InstanceLabels, Counter>,
    generation_exits: Family<ExitLabels, Counter>,
    generation_restarts: Family<ExitLabels, Counter>,
    listener_handovers: Family<HandoverLabels, Counter>,
    datagram_drops: Family<ListenerLabels, Counter>,
    stage_bytes: Counter,
    datagram_drop_source: Option<DropSource>,
    datagram_drops_seen: Mutex<HashMap<u64, u64>>,
    /// The log dir whose drop counters are read at each scrape, and the
    /// count last read from each file: the counter grows by the difference,
    /// so it keeps counting when old generations' files are deleted.
    log_dir: Option<PathBuf>,
    drops_seen: Mutex<HashMap<PathBuf, u64>>,
}

impl Default for AgentMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl AgentMetrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix(PREFIX);
        let attempts = Family::<AttemptLabels, Counter>::default();
        let step_duration: StepHistograms = Family::new_with_constructor(step_histogram);
        let generations_running = Gauge::default();
        let journal_backlog = Gauge::default();
        let retirements = Family::<RetirementLabels, Counter>::default();
        let log_drops = Family::<InstanceLabels, Counter>::default();
        let generation_exits = Family::<ExitLabels, Counter>::default();
        registry.register(
            "generation_exits",
            "Serving generations that exited between attempts, by how",
            generation_exits.clone(),
        );
        let generation_restarts = Family::<ExitLabels, Counter>::default();
        registry.register(
            "generation_restarts",
            "Restarts of exited generations that served, by how the generation before had exited",
            generation_restarts.clone(),
        );
        registry.register(
            "log_records_dropped",
            "Records of instances' output their log shims could not write (a full disk)",
            log_drops.clone(),
        );
        registry.register(
            "attempts",
            "Swap attempts ended on this node, by outcome and the mode that ran",
            attempts.clone(),
        );
        registry.register_with_unit(
            "step_duration",
            "Time spent in each step of a swap attempt",
            Unit::Seconds,
            step_duration.clone(),
        );
        registry.register(
            "generations_running",
            "Instances with a serving generation on this node",
            generations_running.clone(),
        );
        registry.register(
            "journal_backlog",
            "Attempt outcomes not yet accepted by the API server (or written to the status file)",
            journal_backlog.clone(),
        );
        let listener_handovers = Family::<HandoverLabels, Counter>::default();
        registry.register(
            "listener_handovers",
            "Attempts with listeners that ended, by how new connections reached generations",
            listener_handovers.clone(),
        );
        let datagram_drops = Family::<ListenerLabels, Counter>::default();
        registry.register(
            "listener_datagrams_dropped",
            "Datagrams the kernel dropped on UDP listeners' sockets",
            datagram_drops.clone(),
        );
        let stage_bytes = Counter::default();
        registry.register(
            "stage_bytes",
            "Bytes fetched from URLs and registries while staging builds ahead of their rollout",
            stage_bytes.clone(),
        );
        registry.register(
            "retirements",
            "Serving instances no attempt named any more, by what their InstanceGeneration lookup led to",
            retirements.clone(),
        );
        Self {
            registry,
            attempts,
            step_duration,
            generations_running,
            journal_backlog,
            retirements,
            log_drops,
            generation_exits,
            generation_restarts,
            listener_handovers,
            datagram_drops,
            stage_bytes,
            datagram_drop_source: None,
            datagram_drops_seen: Mutex::new(HashMap::new()),
            log_dir: None,
            drops_seen: Mutex::new(HashMap::new()),
        }
    }

    /// Counts what the supervisor did: exits and restarts that served.
    pub fn record_supervisor_event(&self, event: &crate::engine::SupervisorEvent) {
        use crate::engine::SupervisorEvent;
        match event {
            SupervisorEvent::Exited(exit) => self.record_generation_exit(exit.reason()),
            SupervisorEvent::Restarted { after, .. } => {
                self.generation_restarts
                    .get_or_create(&ExitLabels {
                        reason: (*after).to_string(),
                    })
                    .inc();
            }
            SupervisorEvent::Serving(_) => {}
        }
    }

    /// Counts a serving generation's exit between attempts.
    pub fn record_generation_exit(&self, reason: &str) {
        self.generation_exits
            .get_or_create(&ExitLabels {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Also exposes the drops of UDP listeners that `source` reads.
    pub fn with_datagram_drops(mut self, source: DatagramDropSource) -> Self {
        self.datagram_drop_source = Some(DropSource(source));
        self
    }

    /// Adds what each socket's drop count grew by since the last read.
    fn observe_datagram_drops(&self, source: &DatagramDropSource) {
        let mut seen = self
            .datagram_drops_seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let samples = source();
        seen.retain(|socket, _| samples.iter().any(|s| s.socket == *socket));
        for sample in samples {
            let before = seen.insert(sample.socket, sample.drops).unwrap_or(0);
            if sample.drops > before {
                self.datagram_drops
                    .get_or_create(&ListenerLabels {
                        instance: sample.instance,
                        listener: sample.listener,
                    })
                    .inc_by(sample.drops - before);
            }
        }
    }

    /// Also exposes the drop counts of the log shims writing under `dir`.
    pub fn with_log_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.log_dir = Some(dir.into());
        self
    }

    /// Reads every `<log dir>/<instance>/<N>.dropped` and adds what
    /// each grew by since the last read.
    fn observe_log_drops(&self, dir: &Path) {
        let mut seen = self
            .drops_seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for instance_dir in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let Some(key) = crate::disk_name::resolve_log_dir(&instance_dir.path()) else {
                continue;
            };
            let name = format!("{}/{}", key.namespace(), key.name());
            for file in std::fs::read_dir(instance_dir.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let path = file.path();
                if path.extension().is_none_or(|ext| ext != "dropped") {
                    continue;
                }
                let now = crate::logs::file::read_dropped(&path);
                let before = seen.insert(path, now).unwrap_or(0);
                if now > before {
                    self.log_drops
                        .get_or_create(&InstanceLabels {
                            instance: name.clone(),
                        })
                        .inc_by(now - before);
                }
            }
        }
    }

    /// Counts an attempt the engine ran and observes each step's duration.
    pub fn record_result(&self, result: &SwapResult) {
        self.record_outcome(result.outcome, result.effective_mode);
        if let Some(handover) = result.listener_handover {
            self.listener_handovers
                .get_or_create(&HandoverLabels {
                    handover: handover.as_str().to_string(),
                })
                .inc();
        }
        for step in &result.steps {
            self.step_duration
                .get_or_create(&StepLabels {
                    step: step.step.as_str().to_string(),
                })
                .observe(step.duration.as_secs_f64());
        }
    }

    /// Counts an attempt that ended without the engine (superseded before it
    /// ran).
    pub fn record_outcome(&self, outcome: Outcome, mode: Mode) {
        self.attempts
            .get_or_create(&AttemptLabels {
                outcome: outcome.as_str().to_string(),
                mode: mode.as_str().to_string(),
            })
            .inc();
    }

    /// Counts bytes a stage fetched.
    pub fn record_stage_bytes(&self, bytes: u64) {
        self.stage_bytes.inc_by(bytes);
    }

    /// Sets how many instances have a serving generation.
    pub fn set_generations_running(&self, count: usize) {
        self.generations_running
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// Counts one looked-up instance by what became of it.
    pub fn record_retirement(&self, retirement: Retirement) {
        self.retirements
            .get_or_create(&RetirementLabels {
                result: retirement.label().to_string(),
            })
            .inc();
    }

    /// One more outcome waits to be accepted.
    pub fn backlog_added(&self) {
        self.journal_backlog.inc();
    }

    /// One outcome was accepted (or its object is gone).
    pub fn backlog_removed(&self) {
        self.journal_backlog.dec();
    }

    /// The current backlog.
    pub fn journal_backlog(&self) -> i64 {
        self.journal_backlog.get()
    }

    /// The registry in the OpenMetrics text format.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        if let Some(dir) = &self.log_dir {
            self.observe_log_drops(dir);
        }
        if let Some(DropSource(source)) = &self.datagram_drop_source {
            self.observe_datagram_drops(source);
        }
        let mut text = String::new();
        encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

/// What `/readyz` answers from: the agent owns the node, and its intake has
/// read its source once. Clones share one state.
#[derive(Clone, Debug, Default)]
pub struct Readiness {
    inner: Arc<ReadinessFlags>,
}

#[derive(Debug, Default)]
struct ReadinessFlags {
    owner: AtomicBool,
    synced: AtomicBool,
}

impl Readiness {
    /// Not ready: neither owner nor synced.
    pub fn new() -> Self {
        Self::default()
    }

    /// Set when the node lock is taken (and cleared when it is let go).
    pub fn set_owner(&self, owns_node: bool) {
        self.inner.owner.store(owns_node, Ordering::SeqCst);
    }

    /// Set once the intake has read its source (the watch's first list).
    pub fn set_synced(&self, synced: bool) {
        self.inner.synced.store(synced, Ordering::SeqCst);
    }

    /// Whether both hold.
    pub fn is_ready(&self) -> bool {
        self.not_ready_because().is_none()
    }

    /// What is missing, in words; `None` when ready.
    pub fn not_ready_because(&self) -> Option<&'static str> {
        match (
            self.inner.owner.load(Ordering::SeqCst),
            self.inner.synced.load(Ordering::SeqCst),
        ) {
            (true, true) => None,
            (false, true) => Some("waiting for the node lock: another agent owns this node"),
            (true, false) => Some("the intake has not read its attempts yet"),
            (false, false) => {
                Some("waiting for the node lock, and the intake has not read its attempts yet")
            }
        }
    }
}

impl Exposition for AgentMetrics {
    fn encode_text(&self) -> Result<String, std::fmt::Error> {
        self.encode()
    }
}

impl ReadinessCheck for Readiness {
    fn not_ready_because(&self) -> Option<Cow<'static, str>> {
        Readiness::not_ready_because(self).map(Cow::Borrowed)
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until
/// `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<AgentMetrics>,
    readiness: Readiness,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), HttpError> {
    http::serve(listener, http::router(metrics, readiness), shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dropped_line(metrics: &AgentMetrics) -> Option<String> {
        metrics
            .encode()
            .expect("encodes")
            .lines()
            .find(|l| l.starts_with("genswap_agent_log_records_dropped_total{"))
            .map(str::to_string)
    }

    #[test]
    fn log_drops_are_counted_from_the_shims_files_and_never_go_down() {
        let dir = tempfile::tempdir().expect("temp dir");
        let instance = dir.path().join("default_app");
        std::fs::create_dir(&instance).expect("instance dir");
        let write = |n: u64, count: u64| {
            std::fs::write(
                instance.join(format!("{n}.dropped")),
                format!("{count:020}\n"),
            )
            .expect("write a counter")
        };
        let metrics = AgentMetrics::new().with_log_dir(dir.path());
        assert_eq!(dropped_line(&metrics), None, "nothing dropped, no series");
        write(1, 3);
        assert_eq!(
            dropped_line(&metrics).as_deref(),
            Some("genswap_agent_log_records_dropped_total{instance=\"default/app\"} 3")
        );
        write(1, 5);
        // Generation 1's file is pruned; generation 2 drops one.
        assert!(dropped_line(&metrics).is_some_and(|l| l.ends_with(" 5")));
        std::fs::remove_file(instance.join("1.dropped")).expect("prune");
        write(2, 1);
        assert!(
            dropped_line(&metrics).is_some_and(|l| l.ends_with(" 6")),
            "{:?}",
            dropped_line(&metrics)
        );
    }
}
