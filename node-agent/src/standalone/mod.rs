//! Standalone mode: one host, no cluster, the same scheduler and engine,
//! driven from a directory of InstanceGeneration YAML files (as the kubelet
//! runs static pods from a directory).
//!
//! # What happens
//!
//! - Every `*.yaml` / `*.yml` file in the directory (not hidden, not a
//!   `~` backup) holds one InstanceGeneration. It is validated as the API
//!   server would: the CRD schema, unknown fields refused, every CEL rule
//!   evaluated ([`genswap_crds::manifest::parse_instance_generation`]). The
//!   namespace is `metadata.namespace`, or `default`.
//! - The host is one implicit Node ([`NodeIdentity`]: the host name or
//!   `--node-name`, with `--node-label`s and `kubernetes.io/hostname`).
//! - The controller's own scheduler
//!   ([`genswap_core::scheduler::plan`]) plans each instance: the
//!   attempts it creates are run through the [`Engine`] (at most one per
//!   instance at a time, instances in parallel; the gate observes every
//!   revision, so a newer attempt supersedes an older one), each result
//!   becomes the attempt's status, and the instance is planned again until
//!   the plan is quiet (a backoff's `requeue_after` is honoured with a
//!   timer).
//! - Changes to the directory are noticed through inotify ([`watch`]); no
//!   restart, no polling. A spec change bumps `metadata.generation`.
//! - Status goes to `<dir>/status/<manifest file name>` ([`StatusDocument`]),
//!   written atomically, with the fields and conditions of a cluster.
//! - A file that does not validate gets a status with the error
//!   (`Stalled=True`, reason `InvalidManifest`) and disturbs nothing else;
//!   when it was valid before, its last valid spec stays in force. A second
//!   file naming the same namespace/name is refused (`DuplicateName`, the
//!   status names the file that owns it).
//! - Deleting a file cancels the instance's attempt in flight, stops its
//!   generations with proof of exit ([`Engine::stop_instance`]), and removes
//!   its cgroup and run directories, its journal and state files and its
//!   status file.
//! - A file whose `nodeSelector` does not match the node's labels has its
//!   instance stopped the same way, but keeps its file and status
//!   (`NoMatchingNodes`); it starts afresh when the selector matches again.
//! - The scheduler's status and attempts are kept in
//!   `<state dir>/standalone/<namespace>.<name>.yaml` ([`state`]), so a
//!   restart continues with the same revisions and failure book. The intent
//!   journal is acknowledged once an outcome is in the status file.
//!
//! On shutdown in-flight attempts are cancelled (they end `abandoned` and
//! restore what they changed) and serving generations keep running, as the
//! agent leaves them; [`StandaloneConfig::stop_on_exit`] stops and forgets
//! every instance instead.

pub(crate) mod files;
pub mod manifests;
mod runner;
pub mod state;
pub mod status;
pub mod wait;
pub mod watch;

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};

use genswap_runtime::prometheus::Prometheus;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use thiserror::Error;

pub use status::{AttemptReport, STATUS_SUBDIR, StatusDocument};
pub use wait::{WaitError, wait_for_no_status, wait_for_status};

use crate::engine::Engine;
use crate::host::Host;

/// The label every Kubernetes node carries with its host name.
pub const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";

/// What standalone mode runs over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StandaloneConfig {
    /// The manifest directory (it must exist).
    pub dir: PathBuf,
    /// The implicit node.
    pub node: NodeIdentity,
    /// On shutdown, stop every instance and forget it (state and status
    /// files removed), so nothing of it is left. Off: serving generations
    /// keep running, as the agent leaves them.
    pub stop_on_exit: bool,
    /// The Prometheus `rollout.analysis` asks; without one every
    /// measurement is inconclusive.
    pub prometheus: Option<Prometheus>,
}

/// The host as the scheduler sees it: one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeIdentity {
    /// The node name in attempt names and status.
    pub name: String,
    /// Its labels, matched against `spec.nodeSelector`.
    pub labels: BTreeMap<String, String>,
}

impl NodeIdentity {
    /// A node called `name` with `labels` and `kubernetes.io/hostname=name`
    /// (unless `labels` sets it).
    pub fn new(name: impl Into<String>, labels: BTreeMap<String, String>) -> NodeIdentity {
        let name = name.into();
        let mut labels = labels;
        labels
            .entry(HOSTNAME_LABEL.to_string())
            .or_insert_with(|| name.clone());
        NodeIdentity { name, labels }
    }

    /// The Node object the scheduler selects on.
    pub fn node(&self) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                labels: Some(self.labels.clone()),
                ..ObjectMeta::default()
            },
            ..Node::default()
        }
    }
}

/// Why standalone mode could not run.
#[derive(Debug, Error)]
pub enum StandaloneError {
    /// The manifest directory is missing or not a directory.
    #[error("the manifest directory {path} is not usable: {reason}")]
    Dir { path: PathBuf, reason: String },
    /// The status directory could not be created.
    #[error("cannot create the status directory {path}: {source}")]
    StatusDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The state directory could not be used.
    #[error(transparent)]
    State(#[from] state::StateError),
    /// The directory could not be watched.
    #[error("cannot watch {path} with inotify: {source}")]
    Watch {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The manifest directory was deleted or moved away while running.
    #[error(
        "the manifest directory {path} was deleted or moved away; standalone mode stopped (instances that served keep running)"
    )]
    DirectoryGone { path: PathBuf },
}

/// The status file of manifest `file` in `dir`.
pub fn status_path(dir: &Path, file: &str) -> PathBuf {
    dir.join(STATUS_SUBDIR).join(file)
}

/// Runs standalone mode until `shutdown` resolves (then cancels what is in
/// flight and returns), or until the directory goes away.
///
/// The caller holds the node lock
/// ([`crate::host`] paths: one agent per state dir): standalone mode marks
/// the gate as owning the node.
pub async fn run(
    host: &Host,
    config: StandaloneConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StandaloneError> {
    run_with(
        host.engine.clone(),
        host.gate.clone(),
        &host.settings.state_dir,
        config,
        shutdown,
    )
    .await
}

/// [`run`] over an engine and gate built elsewhere.
pub async fn run_with(
    engine: std::sync::Arc<Engine>,
    gate: std::sync::Arc<crate::gate::NewestRevisionGate>,
    state_dir: &Path,
    config: StandaloneConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StandaloneError> {
    let runner = runner::Runner::start(engine.clone(), gate.clone(), state_dir, config).await?;
    let _supervisor = engine.start_supervisor(gate, runner.supervisor_events());
    let result = runner.run(shutdown).await;
    engine.close_logs().await;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_carries_its_host_name_label_and_the_given_ones() {
        let node = NodeIdentity::new(
            "edge-1",
            BTreeMap::from([("pool".to_string(), "edge".to_string())]),
        )
        .node();
        let labels = node.metadata.labels.expect("labels");
        assert_eq!(
            labels.get(HOSTNAME_LABEL).map(String::as_str),
            Some("edge-1")
        );
        assert_eq!(labels.get("pool").map(String::as_str), Some("edge"));
        assert_eq!(node.metadata.name.as_deref(), Some("edge-1"));
    }
}
