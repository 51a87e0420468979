//! Flags, environment and the process-level setup they drive: logging and
//! the Kubernetes client configuration.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use genswap_runtime::prometheus::{Prometheus, PrometheusError};
use kube::Config;
use kube::config::{InferConfigError, KubeConfigOptions, Kubeconfig, KubeconfigError};
use thiserror::Error;
use tracing_subscriber::EnvFilter;

use crate::context::PROGRESS_HOLD;
use crate::events::DEFAULT_WINDOW;

/// The genswap cluster controller: turns InstanceGenerations into
/// SwapAttempts and aggregates their outcomes into status.
#[derive(Parser, Debug, Clone)]
#[command(name = "genswap-controller", version, about)]
pub struct Args {
    /// Path to a kubeconfig file. Without it the configuration is inferred:
    /// $KUBECONFIG or ~/.kube/config, else the in-cluster service account.
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// Watch InstanceGenerations and SwapAttempts in this namespace only;
    /// all namespaces when unset or empty.
    #[arg(long, env = "GENSWAP_NAMESPACE")]
    pub namespace: Option<String>,
    /// Address for /metrics, /healthz and /readyz.
    #[arg(long, env = "GENSWAP_METRICS_ADDR", default_value = "127.0.0.1:8080")]
    pub metrics_addr: SocketAddr,
    /// Name of the coordination.k8s.io Lease the replicas elect a leader on.
    #[arg(long, env = "GENSWAP_LEASE_NAME", default_value = "genswap-controller")]
    pub lease_name: String,
    /// Namespace of the Lease; defaults to the client's namespace (the
    /// kubeconfig context's, or the pod's in a cluster).
    #[arg(long, env = "POD_NAMESPACE")]
    pub lease_namespace: Option<String>,
    /// This replica's identity in the Lease and in Events; defaults to the
    /// host name (the pod name in a cluster).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// How long a leader's claim lasts without renewal.
    #[arg(long, env = "GENSWAP_LEASE_DURATION_SECONDS", default_value_t = 15)]
    pub lease_duration_seconds: u64,
    /// The leader renews this long before its claim expires; a renewal that
    /// has not succeeded by then makes it step down.
    #[arg(long, env = "GENSWAP_LEASE_GRACE_SECONDS", default_value_t = 5)]
    pub lease_grace_seconds: u64,
    /// InstanceGenerations reconciled at once.
    #[arg(long, env = "GENSWAP_CONCURRENCY", default_value_t = 16)]
    pub concurrency: u16,
    /// An InstanceGeneration's Normal Events are held this long from the
    /// first and written as one Event that lists each; 0 writes each at
    /// once. Warnings are never held.
    #[arg(long, env = "GENSWAP_EVENT_WINDOW_SECONDS", default_value_t = DEFAULT_WINDOW.as_secs())]
    pub event_window_seconds: u64,
    /// A status write that only records progress while attempts are in
    /// flight (no reservation, no condition changing) is put off up to
    /// this long, so the outcome that ends them carries it; 0 writes every
    /// status at once.
    #[arg(long, env = "GENSWAP_PROGRESS_HOLD_SECONDS", default_value_t = PROGRESS_HOLD.as_secs())]
    pub progress_hold_seconds: u64,
    /// The Prometheus `rollout.analysis` queries run against (its root
    /// URL, http or https). Without it an analysis is inconclusive: its
    /// rollout halts or proceeds as `analysis.inconclusive` says.
    #[arg(long, env = "GENSWAP_PROMETHEUS_URL", value_name = "URL")]
    pub prometheus_url: Option<String>,
    /// Longest wait for one analysis query.
    #[arg(long, env = "GENSWAP_PROMETHEUS_TIMEOUT_SECONDS", default_value_t = 10)]
    pub prometheus_timeout_seconds: u64,
    /// Log line format.
    #[arg(long, env = "GENSWAP_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// How log lines are written (to stderr; level from `RUST_LOG`, default info).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One JSON object per line, for log pipelines.
    Json,
    /// Human-readable lines.
    Text,
}

/// Why the process could not start.
#[derive(Debug, Error)]
pub enum SetupError {
    #[error("cannot set up logging: {0}")]
    Logging(String),
    #[error("cannot read kubeconfig {path}: {source}")]
    ReadKubeconfig {
        path: PathBuf,
        #[source]
        source: KubeconfigError,
    },
    #[error("kubeconfig {path} is unusable: {source}")]
    UseKubeconfig {
        path: PathBuf,
        #[source]
        source: KubeconfigError,
    },
    #[error("no Kubernetes configuration found (kubeconfig nor in-cluster): {0}")]
    Infer(#[source] InferConfigError),
    #[error(transparent)]
    Prometheus(#[from] PrometheusError),
}

/// Timeout of each write request (status, create, delete, Event). Without
/// one a request to an API server that stopped answering hangs forever;
/// watches use a client without it.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

impl Args {
    /// The namespace scope; `None` is every namespace.
    pub fn namespace_scope(&self) -> Option<&str> {
        self.namespace.as_deref().filter(|ns| !ns.is_empty())
    }

    /// How long an IG's Normal Events are folded.
    pub fn event_window(&self) -> Duration {
        Duration::from_secs(self.event_window_seconds)
    }

    /// How long a progress-only status write may be put off.
    pub fn progress_hold(&self) -> Duration {
        Duration::from_secs(self.progress_hold_seconds)
    }

    /// The client of --prometheus-url, if given (an empty value is none,
    /// as the chart passes an unset value).
    pub fn prometheus(&self) -> Result<Option<Prometheus>, SetupError> {
        let timeout = Duration::from_secs(self.prometheus_timeout_seconds.max(1));
        self.prometheus_url
            .as_deref()
            .filter(|url| !url.is_empty())
            .map(|url| Prometheus::new(url, timeout))
            .transpose()
            .map_err(SetupError::from)
    }

    /// The identity from the flag or POD_NAME, else the host name.
    pub fn identity(&self) -> String {
        self.identity
            .clone()
            .filter(|id| !id.is_empty())
            .or_else(host_name)
            .unwrap_or_else(|| "genswap-controller".to_string())
    }

    /// The client configuration from --kubeconfig, else inferred.
    pub async fn kube_config(&self) -> Result<Config, SetupError> {
        match &self.kubeconfig {
            Some(path) => {
                let kubeconfig =
                    Kubeconfig::read_from(path).map_err(|source| SetupError::ReadKubeconfig {
                        path: path.clone(),
                        source,
                    })?;
                Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                    .await
                    .map_err(|source| SetupError::UseKubeconfig {
                        path: path.clone(),
                        source,
                    })
            }
            None => Config::infer().await.map_err(SetupError::Infer),
        }
    }
}

/// `config` with every request bounded by `timeout` (for clients that never
/// watch).
pub fn with_request_timeout(mut config: Config, timeout: Duration) -> Config {
    config.read_timeout = Some(timeout);
    config.write_timeout = Some(timeout);
    config.connect_timeout = Some(timeout);
    config
}

/// Installs the global tracing subscriber.
pub fn init_tracing(format: LogFormat) -> Result<(), SetupError> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Escape codes only for a person at a terminal, never into log files.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    }
    .map_err(|error| SetupError::Logging(error.to_string()))
}

fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_string())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|name| !name.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_loopback_text_and_all_namespaces() {
        let args = Args::try_parse_from(["genswap-controller"]).expect("no flags parse");
        assert_eq!(args.metrics_addr, "127.0.0.1:8080".parse().expect("addr"));
        assert_eq!(args.log_format, LogFormat::Text);
        assert_eq!(args.lease_name, "genswap-controller");
    }

    #[test]
    fn an_empty_namespace_means_all() {
        let args = Args::try_parse_from(["genswap-controller", "--namespace", ""])
            .expect("empty namespace parses");
        assert_eq!(args.namespace_scope(), None);
        let args = Args::try_parse_from(["genswap-controller", "--namespace", "apps"])
            .expect("namespace parses");
        assert_eq!(args.namespace_scope(), Some("apps"));
    }

    #[test]
    fn identity_falls_back_to_a_non_empty_name() {
        let args = Args::try_parse_from(["genswap-controller", "--identity", ""])
            .expect("empty identity parses");
        assert!(!args.identity().is_empty());
        let args = Args::try_parse_from(["genswap-controller", "--identity", "pod-a"])
            .expect("identity parses");
        assert_eq!(args.identity(), "pod-a");
    }
}
