//! A real node for the Kubernetes-mode tests: a unique cgroup v2 subtree, a
//! staging root, a store, a run dir, a state dir (journal and node lock) in
//! one temp dir, the real engine over them, and testapp builds to stage.
//! Everything is removed on drop, after a panic too.
//!
//! Include after the engine tests' support:
//! `#[path = "support/cgroup_guard.rs"] mod cgroup_guard;`
//! `#[path = "support/swap_host.rs"] mod swap_host;`
//! `#[path = "kube_support/node.rs"] mod kube_node;`
#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;

use genswap_crds::{StopSpec, SwapAttemptSpec};
use genswap_store::{Stager, StagerConfig, Store};
use node_agent::engine::{Engine, EngineConfig, EngineParts};
use node_agent::gate::{InstanceKey, NewestRevisionGate};
use node_agent::journal::Journal;
use node_agent::logs::{LogSettings, LogSink};
use node_agent::ownership::default_lock_path;
use node_agent::switch::RunLayout;

use crate::cgroup_guard::TestCgroupTree;
use crate::swap_host;

/// What [`TestNode::install_web_b1`] leaves.
pub struct Installed {
    pub agent: crate::kube_support::RunningAgent,
    pub server: crate::kube_support::ApiServerVerifier,
    pub feed: crate::kube_support::WatchFeed,
    pub install: serde_json::Value,
    pub status: serde_json::Value,
}

/// One test's node.
pub struct TestNode {
    pub engine: Arc<Engine>,
    pub gate: Arc<NewestRevisionGate>,
    pub staging: PathBuf,
    pub state_dir: PathBuf,
    pub lock_path: PathBuf,
    tree: TestCgroupTree,
    // Dropped after the tree: nothing runs from it by then.
    dir: tempfile::TempDir,
}

impl TestNode {
    /// A node with swaps on, root instances refused.
    pub fn new(tag: &str) -> TestNode {
        let dir = tempfile::Builder::new()
            .prefix(&format!("genswap-kube-{tag}-"))
            .tempdir()
            .expect("temp dir");
        // Instances run as nobody: they must reach the store and the run dir.
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755))
            .expect("open the temp dir to the instance's uid");
        let staging = dir.path().join("staging");
        let state_dir = dir.path().join("state");
        fs::create_dir(&staging).expect("staging root");
        let tree = TestCgroupTree::new(tag);
        let stager = Stager::new(
            Store::open(dir.path().join("store")).expect("store"),
            StagerConfig::new(&staging),
        )
        .expect("stager");
        let cgroups = tree.manager();
        let logs = LogSink::new(
            LogSettings::in_dir(
                dir.path().join("logs"),
                env!("CARGO_BIN_EXE_genswap-helper"),
            ),
            &cgroups,
        )
        .expect("log sink");
        let parts = EngineParts {
            cgroups,
            layout: RunLayout::new(dir.path().join("run")),
            stager,
            journal: Journal::open(&state_dir).expect("journal"),
            logs,
        };
        TestNode {
            engine: Arc::new(Engine::new(parts, EngineConfig::default())),
            gate: Arc::new(NewestRevisionGate::new(true)),
            lock_path: default_lock_path(&state_dir),
            staging,
            state_dir,
            tree,
            dir,
        }
    }

    /// A distinct testapp build in the staging root.
    pub fn build(&self, name: &str) -> testapp::Build {
        swap_host::testapp_build(&self.staging, name)
    }

    /// An overlap attempt's spec of `build` for `instance` on the test node.
    pub fn spec(
        &self,
        instance: &str,
        rev: i64,
        build: &testapp::Build,
        id: &str,
    ) -> SwapAttemptSpec {
        let mut spec = swap_host::spec(rev, build, id);
        spec.instance = instance.into();
        spec.node_name = crate::kube_support::NODE.into();
        spec
    }

    /// A Kubernetes-mode agent for this node over `client`, with the test
    /// settings.
    pub fn start_agent(&self, client: kube::Client) -> crate::kube_support::RunningAgent {
        self.start_agent_with(client, |_| {})
    }

    /// [`TestNode::start_agent`], with `edit` applied to the test settings.
    pub fn start_agent_with(
        &self,
        client: kube::Client,
        edit: impl FnOnce(&mut node_agent::kube::KubeAgentConfig),
    ) -> crate::kube_support::RunningAgent {
        let mut config = crate::kube_support::test_config(&self.lock_path);
        edit(&mut config);
        crate::kube_support::start_agent(client, self.engine.clone(), self.gate.clone(), config)
    }

    /// Starts an agent over a mocked API server whose list holds one
    /// install of `b1` as `web` rev 1, and answers the install's status
    /// writes. Returns the agent, the server, the open watch,
    /// the attempt object and the outcome status it wrote.
    pub async fn install_web_b1(&self) -> Installed {
        let b1 = self.build("b1");
        let install = crate::kube_support::object(&self.spec("web", 1, &b1, "b1"));
        let (client, mut server) = crate::kube_support::mock_client();
        let agent = self.start_agent(client);
        let feed =
            crate::kube_support::list_and_watch(&mut server, std::slice::from_ref(&install)).await;
        crate::kube_support::running_status(&mut server, &install).await;
        let status = crate::kube_support::outcome_status(&mut server, &install).await;
        Installed {
            agent,
            server,
            feed,
            install,
            status,
        }
    }

    /// The instance `instance` of the test namespace.
    pub fn key(&self, instance: &str) -> InstanceKey {
        InstanceKey::new(crate::kube_support::NAMESPACE, instance).expect("instance key")
    }

    /// Who answers through the instance's `current.sock`.
    pub async fn who_serves(&self, instance: &str) -> Option<swap_host::Identity> {
        swap_host::ask(&self.engine.layout().current_socket(&self.key(instance))).await
    }

    /// The instance's `gen-<N>` cgroup directory.
    pub fn generation_cgroup(&self, instance: &str, n: u64) -> PathBuf {
        self.tree
            .path()
            .join("genswap")
            .join(self.key(instance).to_string())
            .join(format!("gen-{n}"))
    }

    /// What is left of `instance` on the node but its logs and its journal:
    /// its cgroup and its run dir, where they exist.
    pub fn leftovers(&self, instance: &str) -> Vec<PathBuf> {
        let key = self.key(instance);
        [
            self.tree.path().join("genswap").join(key.to_string()),
            self.engine.layout().instance_dir(&key),
        ]
        .into_iter()
        .filter(|path| path.exists())
        .collect()
    }

    /// Revisions whose outcomes the journal still holds.
    pub fn pending(&self) -> Vec<(String, i64)> {
        self.engine
            .journal()
            .pending_reports()
            .expect("read the journal")
            .iter()
            .map(|r| (r.instance.name().to_string(), r.attempt.sched_rev))
            .collect()
    }

    /// Stops what serves `instances`, with proof.
    pub async fn tear_down(&self, instances: &[&str]) {
        for instance in instances {
            self.engine
                .stop_instance(&self.key(instance), &StopSpec::default())
                .await
                .expect("stop the instance");
        }
    }
}
