//! genswap end to end on a real API server: the suite's own control
//! plane (`../shared/kube`) with the chart installed, or the cluster
//! `KUBECONFIG` names (support/mod.rs says which, and under what
//! credentials the processes run).
//!
//! Without either the suite prints one line, `support::SKIP_LINE` and why, and
//! passes. With one it needs, on the machine running it: root, a cgroup v2
//! mount and kubectl (docs/INSTALL.md, "End-to-end tests"). It then:
//!
//! 1. applies the CRDs (`kubectl apply --server-side -f crds/`);
//! 2. builds and starts `genswap-controller` and one `node-agent run` as
//!    local processes, both limited to a fresh namespace; the agent acts as
//!    a Node of the cluster (`--node-name`), runs its instances here in a
//!    fresh cgroup subtree, and stages test-app builds from a temp dir;
//! 3. walks one InstanceGeneration through install, an overlap release, a
//!    failing build held down (Stalled=True), a retry that succeeds, a bad
//!    digest failed and held down without running anything, and a release waited for
//!    with `kubectl wait --for=condition=Ready`, a `kubectl genswap get` and
//!    a `kubectl genswap undo` to the previous good build, checking after each step
//!    who answers on the instance's `current.sock`; then moves its
//!    `nodeSelector` off the node (the instance stops) and back (it is
//!    installed again), and finally deletes it and waits for the instance
//!    to stop and leave nothing behind; on its own control plane it then
//!    reads in the audit log that the agent watched its node's inbox by
//!    name and no SwapAttempts by `spec.nodeName`, and that the inbox
//!    lists nothing once the attempts are gone;
//! 4. deletes a namespace with instances in it, as a user would, and waits
//!    for every instance to stop and leave nothing behind, whatever order
//!    the namespace controller deletes the objects in;
//! 5. rolls out image builds from a real registry on loopback (TLS, basic
//!    auth from a docker config.json): an overlap under load with no failed
//!    request, and credentials that stop working retried until they work.
//!
//! On a cluster of one's own, do not run it where the genswap chart runs
//! agents: they would take the suite's attempts for their node too.

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use genswap_crds::{InstanceGeneration, Mode, NodeRecord, Outcome, SwapAttempt};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use support::{Cluster, INSTANCE_ID, Stack, apply_crds, get_over, path_str};
use testapp::Build;

const IG: &str = "hello";
const FIELD_MANAGER: &str = "genswap-e2e";
/// Longest wait for one step of the story.
const STEP_DEADLINE: Duration = Duration::from_secs(180);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn genswap_end_to_end_on_a_real_api_server() {
    let Some(cluster) = Cluster::find().await else {
        return;
    };
    // 1. The API.
    apply_crds(&cluster);
    // 2. The controller and the agent, for a namespace and a Node of their own.
    let stack = Stack::start(&cluster, "story").await;
    let client = cluster.client().await;
    let mut e2e = E2e {
        igs: Api::namespaced(client.clone(), &stack.namespace.name),
        attempts: Api::namespaced(client.clone(), &stack.namespace.name),
        cluster,
        stack,
    };

    // 3a. Install: the first generation, Ready, serving.
    let v1 = e2e.build("hello-1");
    e2e.apply(&v1, json!({})).await;
    e2e.wait_ig("install to Ready", |ig| {
        is_true(ig, "Ready") && serves(ig, "hello-1")
    })
    .await;
    e2e.expect_attempt("hello-1", Outcome::Done, |a| {
        a.spec.cause == genswap_crds::Cause::Install
    })
    .await;
    e2e.expect_serving("hello-1").await;

    // 3b. An overlap release: the successor beside the incumbent, then the
    // switch.
    let v2 = e2e.build("hello-2");
    e2e.apply(&v2, json!({})).await;
    e2e.wait_ig("the overlap release to Ready", |ig| {
        is_true(ig, "Ready") && serves(ig, "hello-2")
    })
    .await;
    let release = e2e.expect_attempt("hello-2", Outcome::Done, |_| true).await;
    assert_eq!(
        release.status.as_ref().and_then(|s| s.effective_mode),
        Some(Mode::Overlap)
    );
    e2e.expect_serving("hello-2").await;

    // 3b'. At rest the node keeps one attempt: the release, carrying the
    // node's record; the install is deleted once the record is seen.
    e2e.expect_one_attempt_at_rest("hello-2").await;

    // 3c. A failing build: unhealthy (every answer a 500). Held down, the
    // incumbent still serves.
    let v3 = e2e.build("hello-3");
    e2e.apply(
        &v3,
        json!({"env": [{"name": "TESTAPP_STATUS", "value": "500"}]}),
    )
    .await;
    let stalled = e2e
        .wait_ig("the failing build to be held down (Stalled=True)", |ig| {
            is_true(ig, "Stalled")
        })
        .await;
    assert_eq!(
        condition(&stalled, "Stalled").map(|c| c.reason.as_str()),
        Some("BuildFailed")
    );
    let held = stalled
        .status
        .as_ref()
        .map(|s| s.held_down.clone())
        .unwrap_or_default();
    assert!(held.iter().any(|h| h.build == "hello-3"), "{held:?}");
    e2e.expect_attempt("hello-3", Outcome::Failed, |_| true)
        .await;
    e2e.expect_serving("hello-2").await;

    // 3d. A retry: the cause fixed (no forced 500s) and spec.retry changed
    // arm one more attempt of the held-down build, which now succeeds.
    e2e.apply(&v3, json!({"retry": "e2e-retry-1"})).await;
    let retried = e2e
        .wait_ig("the retried build to Ready", |ig| {
            is_true(ig, "Ready") && serves(ig, "hello-3")
        })
        .await;
    assert_eq!(
        retried
            .status
            .as_ref()
            .and_then(|s| s.last_retry.as_deref()),
        Some("e2e-retry-1")
    );
    e2e.expect_attempt("hello-3", Outcome::Done, |a| {
        a.spec.cause == genswap_crds::Cause::Retry
    })
    .await;
    e2e.expect_serving("hello-3").await;

    // 3e. A bad digest, pre-staged (rollout.prestage's default): the ask
    // to stage it fails with nothing run, the swap waits (Reconciling
    // Prestaging, naming the node and why), and the incumbent serves.
    let mut v4 = e2e.build("hello-4");
    v4.sha256 = "0".repeat(64);
    e2e.apply(&v4, json!({})).await;
    let waiting = e2e
        .wait_ig("the bad digest's stage refused", |ig| {
            condition(ig, "Reconciling")
                .is_some_and(|c| c.reason == "Prestaging" && c.message.contains("cannot stage"))
        })
        .await;
    let message = condition(&waiting, "Reconciling")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        message.contains(&e2e.stack.node_name) && message.contains("sha256"),
        "{message}"
    );
    let asks = e2e
        .attempts
        .list(&ListParams::default())
        .await
        .expect("list");
    let ask = asks
        .items
        .iter()
        .find(|a| a.spec.stage_only && a.spec.build.id == "hello-4")
        .expect("the ask to stage hello-4");
    let status = ask.status.clone().unwrap_or_default();
    assert_eq!(
        (status.outcome, status.executed),
        (Some(Outcome::Failed), Some(false)),
        "{status:?}"
    );
    assert!(
        asks.items
            .iter()
            .all(|a| a.spec.stage_only || a.spec.build.id != "hello-4"),
        "no swap to hello-4 was issued"
    );
    e2e.expect_serving("hello-3").await;

    // 3e'. The same without pre-staging: refused at the swap's staging
    // with nothing run, and the build's own fault (its bytes are not the
    // pinned ones): failed, held down, Stalled; the incumbent still serves.
    e2e.apply(&v4, json!({"rollout": {"prestage": false}}))
        .await;
    let refused = e2e
        .expect_attempt("hello-4", Outcome::Failed, |_| true)
        .await;
    let status = refused.status.clone().unwrap_or_default();
    assert_eq!(status.executed, Some(false), "{status:?}");
    let reason = status.reason.clone().unwrap_or_default();
    assert!(
        reason.contains("sha256") || reason.contains("digest"),
        "the reason names the digest: {reason}"
    );
    let ig = e2e
        .wait_ig("the bad digest held down", |ig| is_true(ig, "Stalled"))
        .await;
    assert!(
        !is_true(&ig, "Ready"),
        "a build that never ran is not Ready"
    );
    assert!(
        ig.status
            .as_ref()
            .is_some_and(|s| s.held_down.iter().any(|h| h.build == "hello-4")),
        "{:?}",
        ig.status
    );
    e2e.expect_serving("hello-3").await;

    // 3f. kubectl wait on the object: a good release after the bad one.
    let v5 = e2e.build("hello-5");
    e2e.apply(&v5, json!({})).await;
    let waited = e2e
        .cluster
        .kubectl_command()
        .args([
            "wait",
            "--for=condition=Ready",
            &format!("ig/{IG}"),
            "-n",
            &e2e.stack.namespace.name,
            &format!("--timeout={}s", STEP_DEADLINE.as_secs()),
        ])
        .output()
        .expect("run kubectl wait");
    assert!(
        waited.status.success(),
        "kubectl wait --for=condition=Ready failed: {}{}",
        String::from_utf8_lossy(&waited.stderr),
        e2e.diagnosis()
    );
    let ig = e2e.igs.get(IG).await.expect("get the IG");
    assert!(serves(&ig, "hello-5"), "{:?}", ig.status);
    e2e.expect_serving("hello-5").await;

    // 3f'. The kubectl plugin: `get` shows the node serving hello-5, and
    // `undo` releases the previous good build (hello-3) from the history.
    let tree = e2e.plugin(&["get", IG]);
    assert!(tree.contains("build hello-5"), "{tree}");
    assert!(tree.contains("serving hello-5"), "{tree}");
    let said = e2e.plugin(&["undo", IG]);
    assert!(said.contains("spec.build is hello-3 again"), "{said}");
    let undone = e2e
        .wait_ig("the undo to Ready on hello-3", |ig| {
            is_true(ig, "Ready") && serves(ig, "hello-3")
        })
        .await;
    assert_eq!(
        undone
            .status
            .as_ref()
            .and_then(|s| s.history.first())
            .map(|h| h.build.as_str()),
        Some("hello-3")
    );
    e2e.expect_serving("hello-3").await;

    // 3g. A selector that no longer matches the node stops its instance:
    // the controller deletes the node's attempts, the agent reads the
    // object and its Node fresh. Selecting the node again installs it.
    let elsewhere = format!("{}-elsewhere", e2e.stack.hostname);
    e2e.apply(
        &v5,
        json!({"nodeSelector": {"kubernetes.io/hostname": elsewhere}}),
    )
    .await;
    e2e.expect_stopped("its nodeSelector left the node").await;
    e2e.apply(&v5, json!({})).await;
    e2e.expect_serving("hello-5").await;

    // 3h. Deleting the object stops its instance on the node: the garbage
    // collector takes its attempts, the agent reads the object fresh and
    // finds it gone.
    e2e.igs
        .delete(IG, &DeleteParams::default())
        .await
        .expect("delete the IG");
    e2e.expect_stopped("its InstanceGeneration was deleted")
        .await;
    expect_nothing_left(&e2e.stack, &[IG]).await;

    // 3i. How the agent found its attempts: through its node's inbox,
    // watched by name, never by a SwapAttempt watch; and the inbox lists
    // nothing once the node has no attempts left.
    if let Some(plane) = e2e.cluster.own() {
        // The documented name (docs/CONTROLLER.md, "Node inboxes").
        let inbox = format!("genswap-inbox-{}", e2e.stack.node_name);
        let inboxes: Api<ConfigMap> = Api::namespaced(client.clone(), INBOX_NAMESPACE);
        // A controller scoped to a namespace empties the inbox and leaves
        // it (another scope's controller may share it).
        let deadline = Instant::now() + STEP_DEADLINE;
        loop {
            let held = match inboxes.get_opt(&inbox).await {
                Ok(found) => found.and_then(|inbox| inbox.data).unwrap_or_default(),
                Err(error) => panic!("read the inbox {inbox}: {error}"),
            };
            if held.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the inbox {inbox} still lists {held:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let audit = watches(&plane.audit_log());
        let by_name = format!("fieldSelector=metadata.name%3D{inbox}");
        let by_node = format!("spec.nodeName%3D{}", e2e.stack.node_name);
        assert!(
            audit
                .iter()
                .any(|(resource, uri)| resource == "configmaps" && uri.contains(&by_name)),
            "no watch of {inbox} in the audit log"
        );
        assert!(
            !audit
                .iter()
                .any(|(resource, uri)| resource == "swapattempts" && uri.contains(&by_node)),
            "the agent watched SwapAttempts by spec.nodeName"
        );
    }

    e2e.stack.assert_running();
    // The stack's guards stop the agent and the controller, delete the
    // namespace, kill and remove the instances' cgroups, and remove the
    // temp dir.
}

/// Where the suite's own control plane keeps the inboxes: the chart's
/// release namespace, where the controllers' Leases are.
const INBOX_NAMESPACE: &str = "genswap-system";

/// Every watch the API server started, from its audit log: (resource,
/// request URI).
fn watches(audit_log: &std::path::Path) -> Vec<(String, String)> {
    std::fs::read_to_string(audit_log)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|event| event["verb"] == "watch" && event["stage"] == "ResponseStarted")
        .map(|event| {
            (
                event["objectRef"]["resource"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                event["requestURI"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

struct E2e {
    igs: Api<InstanceGeneration>,
    attempts: Api<SwapAttempt>,
    cluster: Cluster,
    stack: Stack,
}

impl E2e {
    /// A test-app build with distinct bytes, staged under the staging root.
    fn build(&self, id: &str) -> Build {
        testapp::make_build(&self.stack.staging, id)
            .unwrap_or_else(|e| panic!("stage the test-app build {id}: {e}"))
    }

    /// Server-side applies the IG with this build; `extra` adds `env` (to
    /// `process`) and `retry`, and may replace `nodeSelector` (this node's
    /// hostname). Fields left out are removed (one manager owns the whole
    /// spec).
    async fn apply(&self, build: &Build, extra: Value) {
        let mut process = json!({"user": INSTANCE_ID, "group": INSTANCE_ID});
        if let Some(env) = extra.get("env") {
            process["env"] = env.clone();
        }
        let mut spec = json!({
            "nodeSelector": {"kubernetes.io/hostname": self.stack.hostname},
            "build": {
                "id": build.path.file_name().and_then(|n| n.to_str()).unwrap_or_default(),
                "artifact": {"path": path_str(&build.path)},
                "sha256": build.sha256,
            },
            "process": process,
            "health": {"path": "/", "timeoutSeconds": 5},
            "settle": {"seconds": 1},
            "stop": {"timeoutSeconds": 5},
        });
        if let Some(retry) = extra.get("retry") {
            spec["retry"] = retry.clone();
        }
        if let Some(node_selector) = extra.get("nodeSelector") {
            spec["nodeSelector"] = node_selector.clone();
        }
        if let Some(rollout) = extra.get("rollout") {
            spec["rollout"] = rollout.clone();
        }
        let object = json!({
            "apiVersion": "genswap.dev/v1alpha1",
            "kind": "InstanceGeneration",
            "metadata": {"name": IG, "namespace": self.stack.namespace.name},
            "spec": spec,
        });
        self.igs
            .patch(
                IG,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&object),
            )
            .await
            .unwrap_or_else(|e| panic!("apply the InstanceGeneration: {e}"));
    }

    /// [`plugin`] in this story's namespace; panics when it fails.
    fn plugin(&self, args: &[&str]) -> String {
        plugin(&self.cluster, &self.stack.namespace.name, args)
            .unwrap_or_else(|failed| panic!("{failed}{}", self.diagnosis()))
    }

    /// Polls the IG until `done` holds, returning it.
    async fn wait_ig(
        &mut self,
        what: &str,
        done: impl Fn(&InstanceGeneration) -> bool,
    ) -> InstanceGeneration {
        let deadline = Instant::now() + STEP_DEADLINE;
        let mut last = None;
        while Instant::now() < deadline {
            self.stack.assert_running();
            if let Ok(ig) = self.igs.get(IG).await {
                if done(&ig) {
                    return ig;
                }
                last = Some(ig);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        panic!(
            "{what}: not within {STEP_DEADLINE:?}; last status: {}{}",
            last.and_then(|ig| serde_json::to_string_pretty(&ig.status).ok())
                .unwrap_or_else(|| "none".into()),
            self.diagnosis()
        );
    }

    /// Polls until an attempt of `build` ends with `outcome` and passes
    /// `check`, returning it.
    async fn expect_attempt(
        &mut self,
        build: &str,
        outcome: Outcome,
        check: impl Fn(&SwapAttempt) -> bool,
    ) -> SwapAttempt {
        let deadline = Instant::now() + STEP_DEADLINE;
        while Instant::now() < deadline {
            self.stack.assert_running();
            if let Ok(list) = self.attempts.list(&ListParams::default()).await {
                // A swap's attempt: the asks to stage ahead are not.
                let found = list.items.into_iter().find(|attempt| {
                    !attempt.spec.stage_only
                        && attempt.spec.build.id == build
                        && attempt.status.as_ref().and_then(|s| s.outcome) == Some(outcome)
                        && check(attempt)
                });
                if let Some(attempt) = found {
                    return attempt;
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        panic!(
            "no attempt of {build} ended {outcome:?} within {STEP_DEADLINE:?}{}",
            self.diagnosis()
        );
    }

    /// Polls until the node's only attempt is a `done` one of `build` that
    /// carries the node's record, naming that build: the controller deleted
    /// the attempts the record replaced.
    async fn expect_one_attempt_at_rest(&mut self, build: &str) {
        let deadline = Instant::now() + STEP_DEADLINE;
        let mut last = Vec::new();
        while Instant::now() < deadline {
            self.stack.assert_running();
            if let Ok(list) = self.attempts.list(&ListParams::default()).await {
                let at_rest = match list.items.as_slice() {
                    [only] => {
                        only.spec.build.id == build
                            && only.status.as_ref().and_then(|s| s.outcome) == Some(Outcome::Done)
                            && NodeRecord::on(only, &self.stack.node_name)
                                .is_some_and(|record| record.node.build.as_deref() == Some(build))
                    }
                    _ => false,
                };
                if at_rest {
                    return;
                }
                last = list
                    .items
                    .iter()
                    .map(|a| {
                        let outcome = a.status.as_ref().and_then(|s| s.outcome);
                        let record = NodeRecord::on(a, &self.stack.node_name).is_some();
                        format!("{} {outcome:?} record={record}", a.name_any())
                    })
                    .collect();
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        panic!(
            "the node did not come to rest with one attempt of {build} carrying its record within {STEP_DEADLINE:?}: {last:?}{}",
            self.diagnosis()
        );
    }

    /// Polls `current.sock` until the instance answers as `build`.
    async fn expect_serving(&self, build: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut last = String::new();
        while Instant::now() < deadline {
            match get_over(&self.stack.current_sock(IG)) {
                Ok(body) if body.contains(&format!("build={build} ")) => return,
                Ok(body) => last = body,
                Err(error) => last = error,
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!(
            "{} does not answer as {build}: {last}{}",
            self.stack.current_sock(IG).display(),
            self.diagnosis()
        );
    }

    /// Polls `current.sock` until nothing answers on it any more, which
    /// should follow from `why`.
    async fn expect_stopped(&self, why: &str) {
        let deadline = Instant::now() + STEP_DEADLINE;
        while Instant::now() < deadline {
            if let Err(gone) = get_over(&self.stack.current_sock(IG)) {
                println!("e2e: the instance stopped: {why} ({gone})");
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!(
            "{} still answers {STEP_DEADLINE:?} after {why}{}",
            self.stack.current_sock(IG).display(),
            self.diagnosis()
        );
    }

    /// The processes' last log lines, for a failure message.
    fn diagnosis(&self) -> String {
        self.stack.diagnosis()
    }
}

/// Runs `kubectl genswap ARGS -n <namespace>` (kubectl finds the plugin
/// on PATH) and returns what it printed, or why it failed.
fn plugin(cluster: &Cluster, namespace: &str, args: &[&str]) -> Result<String, String> {
    let binaries = support::build_binaries();
    let path = std::env::join_paths(std::iter::once(binaries.bin_dir.clone()).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))
    .expect("a PATH");
    let output = cluster
        .kubectl_command()
        .arg("genswap")
        .args(args)
        .args(["-n", namespace])
        .env("PATH", path)
        .output()
        .expect("run kubectl genswap");
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "kubectl genswap {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

fn condition<'a>(ig: &'a InstanceGeneration, kind: &str) -> Option<&'a Condition> {
    ig.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == kind)
}

fn is_true(ig: &InstanceGeneration, kind: &str) -> bool {
    condition(ig, kind).is_some_and(|c| c.status == "True")
}

/// Every node in status serves `build` (and there is one).
fn serves(ig: &InstanceGeneration, build: &str) -> bool {
    ig.status.as_ref().is_some_and(|status| {
        !status.nodes.is_empty()
            && status
                .nodes
                .iter()
                .all(|node| node.build.as_deref() == Some(build))
    })
}

/// The agent writes a SwapAttempt's status with two field managers: the
/// outcome's apply states every field but `serving`, the supervisor's
/// states `serving` alone (SPEC 5.10). The mocked API server of the agent's
/// tests can only check the requests; this checks, on a real API server,
/// that neither apply removes the other's fields.
#[tokio::test]
async fn the_outcome_and_serving_applies_keep_each_others_fields() {
    use node_agent::kube::report::{FIELD_MANAGER, SERVING_FIELD_MANAGER};
    let Some(cluster) = Cluster::find().await else {
        return;
    };
    apply_crds(&cluster);
    let namespace = cluster.namespace("managers").await;
    let client = cluster.client().await;
    let attempts: Api<SwapAttempt> = Api::namespaced(client.clone(), &namespace.name);
    let attempt: SwapAttempt =
        serde_json::from_value(test_cluster::objects::swap_attempt("web-node-1", "node", 1))
            .expect("a SwapAttempt");
    attempts
        .create(&PostParams::default(), &attempt)
        .await
        .expect("create the attempt");
    let apply = |manager: &'static str, status: Value| {
        let attempts = attempts.clone();
        async move {
            let body = json!({"apiVersion": "genswap.dev/v1alpha1", "kind": "SwapAttempt", "status": status});
            attempts
                .patch_status(
                    "web-node-1",
                    &PatchParams::apply(manager).force(),
                    &Patch::Apply(&body),
                )
                .await
                .unwrap_or_else(|e| panic!("apply as {manager}: {e}"))
        }
    };
    let outcome =
        json!({"outcome": "done", "effectiveMode": "overlap", "generation": 1, "executed": true});
    apply(FIELD_MANAGER, outcome.clone()).await;
    apply(
        SERVING_FIELD_MANAGER,
        json!({"serving": {"state": "Running", "generation": 2, "restarts": 1}}),
    )
    .await;
    // The outcome's manager states its whole status again, without serving.
    let after = apply(FIELD_MANAGER, outcome).await;
    let status = after.status.expect("a status");
    assert_eq!(status.outcome, Some(Outcome::Done), "{status:?}");
    assert_eq!(
        status.serving.map(|s| (s.generation, s.restarts)),
        Some((2, 1)),
        "the outcome's apply left the serving block alone"
    );
    // And the serving manager's apply leaves the outcome.
    let after = apply(
        SERVING_FIELD_MANAGER,
        json!({"serving": {"state": "Exited", "generation": 2, "restarts": 1}}),
    )
    .await;
    let status = after.status.expect("a status");
    assert_eq!(
        (status.outcome, status.generation),
        (Some(Outcome::Done), Some(1))
    );
}

/// Waits until nothing of `igs` is left on the node but their logs: no
/// instance cgroup, no run dir.
async fn expect_nothing_left(stack: &Stack, igs: &[&str]) {
    let deadline = Instant::now() + STEP_DEADLINE;
    loop {
        let left: Vec<PathBuf> = igs
            .iter()
            .flat_map(|ig| [stack.instance_cgroup(ig), stack.instance_run_dir(ig)])
            .filter(|path| path.exists())
            .collect();
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "left on the node after the instances stopped: {left:?}{}",
            stack.diagnosis()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A namespace's deletion stops every instance in it. The namespace
/// controller (the control plane's controller-manager runs it) deletes the
/// namespace's objects kind by kind, SwapAttempts and InstanceGenerations
/// in no promised order: an agent that looks an instance up after its
/// attempts went may still find the object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_namespace_stops_its_instances_and_leaves_nothing() {
    let Some(cluster) = Cluster::find().await else {
        return;
    };
    apply_crds(&cluster);
    let mut stack = Stack::start(&cluster, "nsdelete").await;
    let client = cluster.client().await;
    let igs: Api<InstanceGeneration> = Api::namespaced(client.clone(), &stack.namespace.name);
    let names = ["web-a", "web-b", "web-c"];
    for name in names {
        let build = testapp::make_build(&stack.staging, &format!("{name}-1"))
            .unwrap_or_else(|e| panic!("stage {name}: {e}"));
        let object = stack.instance_generation(name, &build, 0);
        igs.patch(
            name,
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(&object),
        )
        .await
        .unwrap_or_else(|e| panic!("apply {name}: {e}"));
    }
    let deadline = Instant::now() + STEP_DEADLINE;
    for name in names {
        while get_over(&stack.current_sock(name)).is_err() {
            stack.assert_running();
            assert!(
                Instant::now() < deadline,
                "{name} never served{}",
                stack.diagnosis()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    cluster.kubectl(&["delete", "namespace", &stack.namespace.name, "--wait=false"]);
    for name in names {
        while get_over(&stack.current_sock(name)).is_ok() {
            stack.assert_running();
            assert!(
                Instant::now() < deadline,
                "{name} still serves after its namespace was deleted{}",
                stack.diagnosis()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    expect_nothing_left(&stack, &names).await;
    stack.assert_running();
}

/// Sidecars on a real API server (SPEC 5.13): the schema takes
/// `spec.sidecars`, the agent runs them beside the serving generation and
/// reports them in the serving block, and the controller carries them to
/// `status.nodes[]`; a crash-looping sidecar leaves the instance
/// `Ready=True` with the reason `SidecarDown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_looping_sidecar_leaves_the_instance_ready_and_says_so() {
    let Some(cluster) = Cluster::find().await else {
        return;
    };
    apply_crds(&cluster);
    let mut stack = Stack::start(&cluster, "sidecar").await;
    let client = cluster.client().await;
    let igs: Api<InstanceGeneration> = Api::namespaced(client, &stack.namespace.name);
    let build = testapp::make_build(&stack.staging, "side-1").expect("stage side-1");
    let mut object = stack.instance_generation("side", &build, 0);
    object["spec"]["sidecars"] = json!([
        {"name": "watcher"},
        {"name": "crasher", "process": {"args": ["--exit-after-ms=50", "--exit-code=5"]}},
    ]);
    igs.patch(
        "side",
        &PatchParams::apply(FIELD_MANAGER),
        &Patch::Apply(&object),
    )
    .await
    .expect("apply the instance with its sidecars");
    let deadline = Instant::now() + STEP_DEADLINE;
    let ready = loop {
        stack.assert_running();
        let ig = igs.get("side").await.expect("get the instance");
        let node = ig.status.as_ref().and_then(|s| s.nodes.first());
        let state = |name: &str| {
            node.and_then(|n| n.sidecars.iter().find(|s| s.name == name))
                .map(|s| s.state)
        };
        if condition(&ig, "Ready").is_some_and(|c| c.status == "True" && c.reason == "SidecarDown")
            && state("watcher") == Some(genswap_crds::SidecarState::Running)
            && state("crasher") == Some(genswap_crds::SidecarState::BackOff)
        {
            break ig;
        }
        assert!(
            Instant::now() < deadline,
            "never Ready with SidecarDown: {:?}{}",
            ig.status,
            stack.diagnosis()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let message = condition(&ready, "Ready")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        message.contains("SidecarDown:") && message.contains("crasher BackOff (exit code 5"),
        "{message}"
    );
    let crasher = ready
        .status
        .as_ref()
        .and_then(|s| s.nodes.first())
        .and_then(|n| n.sidecars.iter().find(|s| s.name == "crasher"))
        .cloned()
        .expect("the crasher reported");
    assert!(crasher.restarts >= 1, "{crasher:?}");
    assert!(
        get_over(&stack.current_sock("side")).is_ok(),
        "the instance serves"
    );

    igs.delete("side", &DeleteParams::default())
        .await
        .expect("delete the instance");
    expect_nothing_left(&stack, &["side"]).await;
}

/// Image builds on a real API server (SPEC 5.14): the controller and the
/// agent as processes, the agent pulling from a real registry on loopback
/// (TLS from the test's CA, basic auth from a docker config.json). An
/// image installs and a second one overlaps it while a client sends
/// requests through `current.sock`, none failing; credentials that stop
/// working make the next attempt `abandoned` (nothing ran, the reason
/// names the registry's 401) and the controller retries it with backoff,
/// which succeeds once the file holds the right password again (read at
/// each pull, no restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_roll_out_from_a_registry_and_a_refusal_is_retried() {
    let Some(cluster) = Cluster::find().await else {
        return;
    };
    let Some(mut registry) =
        test_cluster::registry::Registry::start(test_cluster::registry::Access::TlsWithAuth)
    else {
        return;
    };
    apply_crds(&cluster);
    let images = support::host_dir();
    let credentials = images.path().join("config.json");
    let right = |registry: &test_cluster::registry::Registry| {
        registry.write_docker_config(
            &credentials,
            test_cluster::registry::USER,
            test_cluster::registry::PASSWORD,
        )
    };
    right(&registry);
    let mut stack = Stack::start_with(
        &cluster,
        "image",
        vec![
            "--registry-config".into(),
            credentials.clone().into(),
            "--registry-ca".into(),
            registry.ca.clone().into(),
        ],
    )
    .await;
    let client = cluster.client().await;
    let igs: Api<InstanceGeneration> = Api::namespaced(client.clone(), &stack.namespace.name);
    let attempts: Api<SwapAttempt> = Api::namespaced(client, &stack.namespace.name);
    let digests: Vec<String> = ["one", "two", "three"]
        .iter()
        .map(|name| {
            let server = testapp::binary().expect("the test app is built");
            support::push_testapp_image(&registry, images.path(), name, &server)
        })
        .collect();
    let (namespace, hostname) = (stack.namespace.name.clone(), stack.hostname.clone());
    let apply = |name: &str, digest: &str| {
        let mut object = json!({
            "apiVersion": "genswap.dev/v1alpha1",
            "kind": "InstanceGeneration",
            "metadata": {"name": "img", "namespace": namespace},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": hostname},
                "build": {
                    "id": format!("image-{name}"),
                    "artifact": {"image": format!("{}/apps/testapp:{name}@sha256:{digest}", registry.addr)},
                    "sha256": digest,
                },
                "process": {"user": INSTANCE_ID, "group": INSTANCE_ID},
                "health": {"path": "/", "timeoutSeconds": 10},
                "settle": {"seconds": 0},
                "stop": {"timeoutSeconds": 5},
            },
        });
        object["spec"]["build"]["id"] = json!(format!("image-{name}"));
        object
    };
    let wait_serving = |build: String| {
        let igs = igs.clone();
        async move {
            let deadline = Instant::now() + STEP_DEADLINE;
            loop {
                let ig = igs.get("img").await.expect("get the instance");
                if is_true(&ig, "Ready") && serves(&ig, &build) {
                    return ig;
                }
                assert!(
                    Instant::now() < deadline,
                    "{build} never served: {:?}",
                    ig.status
                );
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    };
    let patch = |object: Value| {
        let igs = igs.clone();
        async move {
            igs.patch(
                "img",
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&object),
            )
            .await
            .expect("apply the instance");
        }
    };

    patch(apply("one", &digests[0])).await;
    wait_serving("image-one".into()).await;
    stack.assert_running();

    // The second image overlaps the first under load.
    let socket = stack.current_sock("img");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut answered, mut failures) = (0u64, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                match get_over(&socket) {
                    Ok(_) => answered += 1,
                    Err(error) => failures.push(error),
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            (answered, failures)
        })
    };
    patch(apply("two", &digests[1])).await;
    let two = wait_serving("image-two".into()).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    // The node staged it before its swap (rollout.prestage's default),
    // fetching its layers.
    let prestaged = |ig: &InstanceGeneration| {
        ig.status
            .as_ref()
            .and_then(|s| s.rollout.as_ref())
            .and_then(|r| r.prestage.clone())
            .expect("status.rollout.prestage")
    };
    let record = prestaged(&two);
    assert_eq!(
        (record.build.as_str(), record.staged, record.needed),
        ("image-two", 1, 1),
        "{record:?}"
    );
    assert!(
        record.done_at.is_some() && record.fetched_bytes > 0,
        "{record:?}"
    );
    let (answered, failures) = load.join().expect("the client");
    eprintln!(
        "image overlap on a real API server: {answered} answered, {} failed",
        failures.len()
    );
    assert!(failures.is_empty(), "{failures:?}");
    assert!(answered > 20, "{answered}");

    // The credentials stop working: abandoned with the registry's answer,
    // then retried until they work again.
    registry.write_docker_config(&credentials, test_cluster::registry::USER, "wrong");
    patch(apply("three", &digests[2])).await;
    let deadline = Instant::now() + STEP_DEADLINE;
    let refused = loop {
        stack.assert_running();
        let list = attempts
            .list(&ListParams::default())
            .await
            .expect("list attempts");
        if let Some(found) = list.items.into_iter().find(|a| {
            a.spec.build.id == "image-three"
                && a.status.as_ref().and_then(|s| s.outcome) == Some(Outcome::Abandoned)
        }) {
            break found;
        }
        assert!(
            Instant::now() < deadline,
            "no abandoned attempt{}",
            stack.diagnosis()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let status = refused.status.clone().expect("a status");
    assert_eq!(status.executed, Some(false), "{status:?}");
    let reason = status.reason.clone().unwrap_or_default();
    assert!(
        reason.contains(&registry.addr) && reason.contains("401"),
        "{reason}"
    );
    // It was the ask to stage ahead that the registry refused: the swap
    // waits for it, and the status names the node and why.
    assert!(refused.spec.stage_only, "{:?}", refused.spec);
    // The controller plans from that outcome after the agent wrote it; the
    // node is named while it waits out the backoff before the next ask.
    let deadline = Instant::now() + STEP_DEADLINE;
    let reconciling = loop {
        let waiting = igs.get("img").await.expect("get the instance");
        let reconciling = waiting
            .status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Reconciling"))
            .map(|c| (c.reason.clone(), c.message.clone()))
            .unwrap_or_default();
        if reconciling.1.contains("cannot stage") || Instant::now() >= deadline {
            break reconciling;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(reconciling.0, "Prestaging", "{reconciling:?}");
    assert!(reconciling.1.contains(&hostname), "{reconciling:?}");
    right(&registry);
    let ig = wait_serving("image-three".into()).await;
    assert!(
        ig.status.as_ref().is_some_and(|s| s.held_down.is_empty()),
        "a registry's refusal holds nothing down: {:?}",
        ig.status
    );
    assert!(get_over(&stack.current_sock("img")).is_ok());

    // An undo with the registry stopped: the node kept image-two staged
    // (retention keeps the previous good build), so it swaps back and the
    // record says nothing needed fetching.
    registry.stop();
    let plugin = |args: &[&str]| {
        plugin(&cluster, &namespace, args).unwrap_or_else(|failed| panic!("{failed}"))
    };
    plugin(&["undo", "img"]);
    let back = wait_serving("image-two".into()).await;
    let record = prestaged(&back);
    assert_eq!(
        (record.build.as_str(), record.staged, record.fetched_bytes),
        ("image-two", 1, 0),
        "{record:?}"
    );
    let drawn = plugin(&["get", "img"]);
    assert!(
        drawn.contains("prestage image-two  done  1/1 nodes hold it  fetched 0.0 KiB"),
        "{drawn}"
    );
    assert!(get_over(&stack.current_sock("img")).is_ok());

    igs.delete("img", &DeleteParams::default())
        .await
        .expect("delete the instance");
    expect_nothing_left(&stack, &["img"]).await;
}
