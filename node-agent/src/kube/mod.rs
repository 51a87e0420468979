//! Kubernetes mode: what the DaemonSet runs (`node-agent run`).
//!
//! The agent watches the SwapAttempts of its node, runs each on the swap
//! engine, and writes each outcome back to the attempt's status. It is a thin
//! adapter: the engine decides everything about a swap; this module decides
//! *which* attempt runs *when* ([`intake`]), whether this agent may run any
//! ([`crate::ownership`]), and how outcomes reach the API server
//! ([`report`]).
//!
//! # Entry point for the binary
//!
//! ```ignore
//! #[derive(clap::Parser)]
//! struct RunArgs {
//!     /* the engine's flags: cgroup root, run dir, state dir, staging root,
//!        swaps on/off, allow root instances */
//!     #[command(flatten)]
//!     kube: node_agent::kube::KubeArgs,
//! }
//! // Build the Engine and the gate (NewestRevisionGate::new(swaps_on)), then:
//! let config = args.kube.into_config(&state_dir)?;
//! node_agent::kube::run(Arc::new(engine), Arc::new(gate), config).await?;
//! ```
//!
//! [`run`] builds the client (`--kubeconfig`, else `KUBECONFIG` or
//! `~/.kube/config`, else the in-cluster service account), serves
//! `/metrics`, `/healthz` and `/readyz` on `--metrics-addr`, and runs
//! [`KubeAgent::run_until`] until SIGTERM or SIGINT. It takes the node lock
//! itself: do not write the journal before calling it. [`KubeArgs`] owns the
//! flags `--node-name` (env `NODE_NAME`), `--namespace` (`GENSWAP_NAMESPACE`),
//! `--inbox-namespace` (`GENSWAP_INBOX_NAMESPACE`),
//! `--kubeconfig`, `--metrics-addr` (`GENSWAP_METRICS_ADDR`), `--node-lock`
//! (`GENSWAP_NODE_LOCK`), `--report-retry-initial-ms`,
//! `--report-retry-max-ms`, `--report-flush-seconds` and
//! `--shutdown-timeout-seconds`; flatten it into a command that defines none
//! of these. `docs/AGENT.md` ("Kubernetes mode") describes them for users.
//!
//! # What it does
//!
//! 1. Reads its node's SwapAttempts, in all namespaces or in `--namespace`
//!    only, from the start (warm while the agent waits for the node): with
//!    `--inbox-namespace` (the chart's way) through the node's inbox, the
//!    ConfigMap the controller keeps there ([`inbox`]: a watch by name, one
//!    GET per attempt); without it by a watch with the field selector
//!    `spec.nodeName=<node>`, which the API server matches against every
//!    attempt event once per agent in the fleet.
//! 2. Waits for the node lock (`<state dir>/node.lock`, an exclusive
//!    `flock`). Until it holds it, the gate's owner flag is false and nothing
//!    runs or is reported.
//! 3. Once owner: delivers the outcomes the journal still holds, then decides
//!    every watched attempt (see [`intake`]): at most one per instance at a
//!    time, instances in parallel, superseded ones abandoned unrun, finished
//!    ones never again. Before running one it reads it fresh from the API
//!    server, so a cache that has not yet seen another agent's outcome
//!    cannot make it run twice.
//! 4. Per attempt: writes `Reconciling=True` and `startedAt`, runs
//!    [`Engine::swap`], writes the outcome (retried until accepted, then
//!    acknowledged in the journal).
//! 5. On SIGTERM: stops taking attempts (`set_shutting_down`), cancels those
//!    in flight (they end `abandoned` and restore what they changed), waits
//!    up to `--shutdown-timeout-seconds` for them, flushes outcomes for up
//!    to `--report-flush-seconds` (what is left stays in the journal), and
//!    lets go of the node. Serving generations are never stopped: they live
//!    in the agent's cgroup subtree, outside the pod.
//! 6. An instance serving here that no attempt names any more is checked
//!    against the API server; if its InstanceGeneration is deleted, it is
//!    stopped with proof of exit ([`retire`]). Checked when an attempt is
//!    deleted or ends, after each full list, and every 30 s for lookups that
//!    failed.
//!
//! RBAC: `get`, `list`, `watch` on `swapattempts.genswap.dev`, `patch` on
//! `swapattempts/status`, and `get` on `instancegenerations.genswap.dev`;
//! with an inbox, `get`, `list`, `watch` on `configmaps` in its namespace.

mod agent;
pub mod inbox;
pub mod intake;
pub mod report;
pub mod retire;

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kube::Client;
use kube::config::{
    Config, InClusterError, InferConfigError, KubeConfigOptions, Kubeconfig, KubeconfigError,
};
use thiserror::Error;

pub use agent::KubeAgent;
pub use report::{FIELD_MANAGER, ReportBackoff};

use crate::engine::Engine;
use crate::gate::NewestRevisionGate;
use crate::journal::JournalError;
use crate::metrics::{self, AgentMetrics, HttpError, Readiness};
use crate::ownership::{self, OwnershipError};

/// The flags of Kubernetes mode. Flatten into the `run` subcommand.
#[derive(clap::Args, Clone, Debug, PartialEq, Eq)]
pub struct KubeArgs {
    /// This node's name, as `spec.nodeName` of its SwapAttempts says it (the
    /// DaemonSet sets NODE_NAME from the downward API).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,

    /// Watch SwapAttempts in this namespace only (default: all namespaces;
    /// empty means all).
    #[arg(long, env = "GENSWAP_NAMESPACE")]
    pub namespace: Option<String>,

    /// Read this node's attempts through its inbox, the ConfigMap the
    /// controller keeps in this namespace (its own; the chart passes the
    /// release namespace). Without it (or empty) the agent watches
    /// SwapAttempts with the field selector `spec.nodeName`, which costs
    /// the API server per agent in the fleet on every attempt.
    #[arg(long, env = "GENSWAP_INBOX_NAMESPACE")]
    pub inbox_namespace: Option<String>,

    /// The kubeconfig to use (default: KUBECONFIG, ~/.kube/config, then the
    /// in-cluster service account).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,

    /// Where /metrics, /healthz and /readyz listen.
    #[arg(long, env = "GENSWAP_METRICS_ADDR", default_value = metrics::DEFAULT_METRICS_ADDR)]
    pub metrics_addr: SocketAddr,

    /// The node lock file (default: <state dir>/node.lock).
    #[arg(long, env = "GENSWAP_NODE_LOCK")]
    pub node_lock: Option<PathBuf>,

    /// The first delay before a failed status write is retried, in ms.
    #[arg(long, default_value_t = 200)]
    pub report_retry_initial_ms: u64,

    /// The longest delay between retries of a status write, in ms.
    #[arg(long, default_value_t = 4_000)]
    pub report_retry_max_ms: u64,

    /// On shutdown, how long to keep writing outcomes before exiting (what
    /// is not written stays in the journal for the next start).
    #[arg(long, default_value_t = 5)]
    pub report_flush_seconds: u64,

    /// How long an attempt runs before its running status (`Reconciling`)
    /// is written, in ms; one that ends sooner reports only its outcome.
    /// 0 writes it as the attempt starts.
    #[arg(long, default_value_t = RUNNING_REPORT_DELAY.as_millis() as u64)]
    pub running_report_delay_ms: u64,

    /// On shutdown, how long to wait for cancelled attempts to restore what
    /// they changed (recovery finishes any that take longer).
    #[arg(long, default_value_t = 60)]
    pub shutdown_timeout_seconds: u64,
}

impl KubeArgs {
    /// The agent's settings; the lock defaults to `<state_dir>/node.lock`.
    pub fn into_config(self, state_dir: &Path) -> Result<KubeAgentConfig, KubeAgentError> {
        let config = KubeAgentConfig {
            node_name: self.node_name,
            namespace: self.namespace.filter(|ns| !ns.is_empty()),
            inbox_namespace: self.inbox_namespace.filter(|ns| !ns.is_empty()),
            kubeconfig: self.kubeconfig,
            metrics_addr: self.metrics_addr,
            lock_path: self
                .node_lock
                .unwrap_or_else(|| ownership::default_lock_path(state_dir)),
            report_backoff: ReportBackoff {
                initial: Duration::from_millis(self.report_retry_initial_ms.max(1)),
                max: Duration::from_millis(
                    self.report_retry_max_ms.max(self.report_retry_initial_ms),
                ),
            },
            report_flush: Duration::from_secs(self.report_flush_seconds),
            shutdown_timeout: Duration::from_secs(self.shutdown_timeout_seconds),
            look_again: LOOK_AGAIN,
            running_report_delay: Duration::from_millis(self.running_report_delay_ms),
        };
        config.validate()?;
        Ok(config)
    }
}

/// How soon an instance left without attempts is looked up again.
const LOOK_AGAIN: Duration = Duration::from_secs(30);

/// How long an attempt runs before its running status is written. Most
/// swaps end within it, and a `Reconciling` that the outcome replaces
/// within a second tells nobody anything, while its write costs the API
/// server as much as the outcome's (docs/BENCHMARKS.md, "The controller on
/// a real API server").
pub const RUNNING_REPORT_DELAY: Duration = Duration::from_secs(1);

/// The settings of Kubernetes mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeAgentConfig {
    /// This node's name; only attempts with this `spec.nodeName` are watched.
    pub node_name: String,
    /// Watch this namespace only; `None` watches all.
    pub namespace: Option<String>,
    /// Read the attempts through the node's inbox in this namespace
    /// ([`inbox`]); `None` watches SwapAttempts by `spec.nodeName`.
    pub inbox_namespace: Option<String>,
    /// An explicit kubeconfig; `None` infers one.
    pub kubeconfig: Option<PathBuf>,
    /// Where the operations endpoints listen.
    pub metrics_addr: SocketAddr,
    /// The node lock file.
    pub lock_path: PathBuf,
    /// How failed status writes are retried.
    pub report_backoff: ReportBackoff,
    /// How long shutdown keeps writing outcomes.
    pub report_flush: Duration,
    /// How long shutdown waits for cancelled attempts.
    pub shutdown_timeout: Duration,
    /// How soon an instance left without attempts is looked up again when
    /// its last lookup failed or found it still wanted.
    pub look_again: Duration,
    /// How long an attempt runs before its running status is written; one
    /// that ends sooner reports only its outcome. Zero writes it at once.
    pub running_report_delay: Duration,
}

impl KubeAgentConfig {
    /// Settings with the defaults for everything but the node and the lock.
    pub fn new(node_name: impl Into<String>, lock_path: impl Into<PathBuf>) -> Self {
        Self {
            node_name: node_name.into(),
            namespace: None,
            inbox_namespace: None,
            kubeconfig: None,
            metrics_addr: SocketAddr::from(([127, 0, 0, 1], 9090)),
            lock_path: lock_path.into(),
            report_backoff: ReportBackoff::default(),
            report_flush: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(60),
            look_again: LOOK_AGAIN,
            running_report_delay: RUNNING_REPORT_DELAY,
        }
    }

    /// Checks the node and namespace names: they go into a field selector
    /// and a path, so they must be Kubernetes names.
    pub fn validate(&self) -> Result<(), KubeAgentError> {
        if !is_dns_subdomain(&self.node_name) {
            return Err(KubeAgentError::NodeName(self.node_name.clone()));
        }
        for namespace in [&self.namespace, &self.inbox_namespace]
            .into_iter()
            .flatten()
        {
            if namespace.contains('.') || !is_dns_subdomain(namespace) || namespace.len() > 63 {
                return Err(KubeAgentError::Namespace(namespace.clone()));
            }
        }
        Ok(())
    }
}

fn is_dns_subdomain(name: &str) -> bool {
    let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 253
        && bytes.first().is_some_and(alnum)
        && bytes.last().is_some_and(alnum)
        && bytes.iter().all(|b| alnum(b) || *b == b'-' || *b == b'.')
        && !name.contains("..")
}

/// Why Kubernetes mode could not start or had to stop.
#[derive(Debug, Error)]
pub enum KubeAgentError {
    #[error("{0:?} is not a node name (set --node-name or NODE_NAME to the node's metadata.name)")]
    NodeName(String),
    #[error("{0:?} is not a namespace name")]
    Namespace(String),
    #[error("cannot read the kubeconfig {path}: {source}")]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: KubeconfigError,
    },
    #[error(
        "no Kubernetes client configuration: no usable KUBECONFIG or ~/.kube/config, and not in a cluster: {0}"
    )]
    InferConfig(#[source] InferConfigError),
    #[error("cannot build the Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    #[error("cannot read the pod's service account in {path}: {source}")]
    ServiceAccount {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot load the in-cluster client configuration: {0}")]
    InCluster(#[source] InClusterError),
    #[error("taking the node lock failed: {0}")]
    Ownership(#[source] OwnershipError),
    #[error("reading the intent journal's pending outcomes failed: {0}")]
    Journal(#[source] JournalError),
    #[error("reading the intent journal's pending outcomes panicked: {0}")]
    JournalTask(#[source] tokio::task::JoinError),
    #[error("the SwapAttempt watch ended; the agent cannot see its attempts any more")]
    WatchEnded,
    #[error(transparent)]
    Metrics(HttpError),
    #[error("cannot install the SIGTERM/SIGINT handler: {0}")]
    Signal(#[source] std::io::Error),
}

/// Runs Kubernetes mode until SIGTERM or SIGINT. See the module docs.
///
/// `engine` is built from the host flags; `gate` is the engine's gate
/// (`NewestRevisionGate::new(swaps_on)`), which this function drives: owner,
/// newest revisions, shutdown.
pub async fn run(
    engine: Arc<Engine>,
    gate: Arc<NewestRevisionGate>,
    config: KubeAgentConfig,
) -> Result<(), KubeAgentError> {
    config.validate()?;
    let shutdown = shutdown_signal()?;
    let client = client_for(&config).await?;
    let drops_of = Arc::clone(&engine);
    let metrics = Arc::new(
        AgentMetrics::new()
            .with_log_dir(&engine.logs().settings().dir)
            .with_datagram_drops(Arc::new(move || drops_of.datagram_drops())),
    );
    let readiness = Readiness::new();
    let listener = metrics::bind(config.metrics_addr)
        .await
        .map_err(KubeAgentError::Metrics)?;
    let (stop_endpoints, endpoints_stopped) = tokio::sync::oneshot::channel::<()>();
    let endpoints = tokio::spawn(metrics::serve(
        listener,
        metrics.clone(),
        readiness.clone(),
        async move {
            let _ = endpoints_stopped.await;
        },
    ));
    tracing::info!(
        node = %config.node_name,
        namespace = config.namespace.as_deref().unwrap_or("(all)"),
        metrics = %config.metrics_addr,
        lock = %config.lock_path.display(),
        "node agent starting in Kubernetes mode"
    );
    let agent = KubeAgent::new(client, engine, gate, config, metrics, readiness);
    let result = agent.run_until(shutdown).await;
    let _ = stop_endpoints.send(());
    match endpoints.await {
        Ok(Err(error)) => tracing::warn!(%error, "the metrics endpoints ended with an error"),
        Err(error) => tracing::warn!(%error, "the metrics endpoints task failed"),
        Ok(Ok(())) => {}
    }
    result
}

/// Where the kubelet projects the pod's service account token and CA.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The in-cluster configuration pinned by [`pin_in_cluster_config`], with
/// the open service-account directory its paths go through.
static PINNED_IN_CLUSTER: OnceLock<(std::fs::File, Config)> = OnceLock::new();

/// Pins the pod's in-cluster client configuration before the agent joins the
/// host's mount namespace (SPEC 5.9). After the join,
/// [`SERVICE_ACCOUNT_DIR`] names a host path, not the pod's projected token:
/// the directory is kept open and the token and CA are read through
/// `/proc/self/fd/<n>/`, so kube's periodic reload of a rotated token keeps
/// working. Does nothing outside a cluster (no `KUBERNETES_SERVICE_HOST`).
/// Returns whether a configuration was pinned.
pub fn pin_in_cluster_config() -> Result<bool, KubeAgentError> {
    if std::env::var_os("KUBERNETES_SERVICE_HOST").is_none() {
        return Ok(false);
    }
    let config = Config::incluster().map_err(KubeAgentError::InCluster)?;
    let (dir, config) = pinned_through_fd(Path::new(SERVICE_ACCOUNT_DIR), config)?;
    // A second call keeps the first pin; both name the same directory.
    let _ = PINNED_IN_CLUSTER.set((dir, config));
    Ok(true)
}

/// Opens `dir` and points `config`'s token and CA files through the open
/// descriptor, so they stay readable when `dir`'s path stops naming it.
pub fn pinned_through_fd(
    dir: &Path,
    mut config: Config,
) -> Result<(std::fs::File, Config), KubeAgentError> {
    let file = std::fs::File::open(dir).map_err(|source| KubeAgentError::ServiceAccount {
        path: dir.to_path_buf(),
        source,
    })?;
    let through = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
    config.auth_info.token_file = Some(through.join("token").to_string_lossy().into_owned());
    config.root_cert_file = Some(through.join("ca.crt"));
    Ok((file, config))
}

/// The client for `config`: an explicit kubeconfig, else the in-cluster
/// configuration pinned before the namespace join, else inferred.
pub async fn client_for(config: &KubeAgentConfig) -> Result<Client, KubeAgentError> {
    let client_config = match &config.kubeconfig {
        Some(path) => {
            let kubeconfig =
                Kubeconfig::read_from(path).map_err(|source| KubeAgentError::Kubeconfig {
                    path: path.clone(),
                    source,
                })?;
            Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(|source| KubeAgentError::Kubeconfig {
                    path: path.clone(),
                    source,
                })?
        }
        None => match PINNED_IN_CLUSTER.get() {
            Some((_, pinned)) => pinned.clone(),
            None => Config::infer().await.map_err(KubeAgentError::InferConfig)?,
        },
    };
    Client::try_from(client_config).map_err(KubeAgentError::Client)
}

/// Resolves on the first SIGTERM or SIGINT.
fn shutdown_signal()
-> Result<impl std::future::Future<Output = ()> + Send + 'static, KubeAgentError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate()).map_err(KubeAgentError::Signal)?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(KubeAgentError::Signal)?;
    Ok(async move {
        tokio::select! {
            _ = terminate.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = interrupt.recv() => tracing::info!("SIGINT: shutting down"),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        kube: KubeArgs,
    }

    fn parse(args: &[&str]) -> Result<KubeAgentConfig, KubeAgentError> {
        let cli = Cli::try_parse_from(std::iter::once("node-agent").chain(args.iter().copied()))
            .expect("flags parse");
        cli.kube.into_config(Path::new("/var/lib/genswap"))
    }

    #[test]
    fn defaults_put_the_lock_in_the_state_dir_and_metrics_on_loopback() {
        let config = parse(&["--node-name", "node-a"]).expect("valid");
        assert_eq!(config.node_name, "node-a");
        assert_eq!(config.lock_path, Path::new("/var/lib/genswap/node.lock"));
        assert_eq!(config.metrics_addr.to_string(), "127.0.0.1:9090");
        assert_eq!(config.report_backoff, ReportBackoff::default());
        assert_eq!(config.namespace, None);
    }

    #[test]
    fn flags_override_every_default() {
        let config = parse(&[
            "--node-name=node-b",
            "--namespace=apps",
            "--kubeconfig=/etc/kubeconfig",
            "--metrics-addr=0.0.0.0:9100",
            "--node-lock=/run/genswap/node.lock",
            "--report-retry-initial-ms=50",
            "--report-retry-max-ms=1000",
            "--report-flush-seconds=2",
            "--shutdown-timeout-seconds=9",
        ])
        .expect("valid");
        assert_eq!(config.namespace.as_deref(), Some("apps"));
        assert_eq!(config.kubeconfig, Some(PathBuf::from("/etc/kubeconfig")));
        assert_eq!(config.metrics_addr.to_string(), "0.0.0.0:9100");
        assert_eq!(config.lock_path, Path::new("/run/genswap/node.lock"));
        assert_eq!(
            config.report_backoff,
            ReportBackoff {
                initial: Duration::from_millis(50),
                max: Duration::from_secs(1),
            }
        );
        assert_eq!(config.report_flush, Duration::from_secs(2));
        assert_eq!(config.shutdown_timeout, Duration::from_secs(9));
    }

    #[test]
    fn a_name_that_would_change_the_field_selector_is_refused() {
        for bad in ["node-a,spec.instance=x", "Node-A", "", "node a"] {
            let refused = parse(&["--node-name", bad]).expect_err(bad);
            assert!(
                matches!(refused, KubeAgentError::NodeName(_)),
                "{bad}: {refused}"
            );
        }
        let refused = parse(&["--node-name", "n", "--namespace", "a.b"]).expect_err("a.b");
        assert!(matches!(refused, KubeAgentError::Namespace(_)), "{refused}");
        let all = parse(&["--node-name", "n", "--namespace", ""]).expect("empty is all");
        assert_eq!(all.namespace, None);
    }
}
