//! The status of a 5,000-node InstanceGeneration on a real kube-apiserver
//! (`../shared/kube`; the test says in one line that it skipped where there
//! is none): the scheduler's plan for a fleet where most nodes failed is
//! written as the controller writes it (server-side apply on `/status`),
//! and stays within 64 KiB; the node records go onto attempts by the
//! controller's merge patch; and the CRD's schema refuses a status that
//! lists more nodes than the bound.
//!
//! The attempts are planned in memory, not stored (5,000 creates would only
//! slow the test): what is written is the status and one record.

use std::time::Instant;

use genswap_controller::apply::{record_patch, status_apply_patch};
use genswap_core::scheduler::{self, Plan};
use genswap_crds::{
    ANNOTATION_RECORD, InstanceGeneration, NodeGeneration, NodeRecord, Outcome, SwapAttempt,
    SwapAttemptStatus,
};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use test_cluster::ControlPlane;

const NODES: usize = 5_000;
const FAILED: usize = 4_000;
const MANAGER: &str = "genswap-controller";

fn node(name: &str) -> Node {
    serde_json::from_value(json!({"metadata": {"name": name}})).expect("a Node")
}

fn finish(attempt: &mut SwapAttempt, outcome: Outcome, reason: &str, now: Timestamp) {
    attempt.status = Some(SwapAttemptStatus {
        outcome: Some(outcome),
        executed: Some(true),
        reason: (!reason.is_empty()).then(|| reason.to_string()),
        generation: (outcome == Outcome::Done).then_some(1),
        finished_at: Some(Time(now)),
        ..SwapAttemptStatus::default()
    });
}

/// The fleet planned: every node issued, 4,000 failed with a long reason,
/// the rest done; returns the plan that records it all.
fn fleet_plan(ig: &mut InstanceGeneration) -> (Plan, Vec<SwapAttempt>) {
    let nodes: Vec<Node> = (0..NODES).map(|i| node(&format!("node-{i:05}"))).collect();
    // Whole seconds, as times come back from the API server.
    let now = Timestamp::from_second(Timestamp::now().as_second()).expect("now is in range");
    let first = scheduler::plan(ig, &[] as &[SwapAttempt], &nodes, now);
    assert_eq!(first.create.len(), NODES, "every node is issued at once");
    ig.status = Some(first.status);
    let mut attempts = first.create;
    let reason = format!("health probe failed: {}", "connection refused; ".repeat(20));
    for (index, attempt) in attempts.iter_mut().enumerate() {
        if index < FAILED {
            finish(attempt, Outcome::Failed, &reason, now);
        } else {
            finish(attempt, Outcome::Done, "", now);
        }
    }
    (scheduler::plan(ig, &attempts, &nodes, now), attempts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_five_thousand_node_status_stays_within_64_kib_on_the_api_server() {
    let Some(plane) = ControlPlane::shared() else {
        return;
    };
    plane.install_crds();
    let namespace = format!("fleet-status-{}", std::process::id());
    plane.kubectl_ok(&["create", "namespace", &namespace]);
    let client = plane.client().await;
    let igs: Api<InstanceGeneration> = Api::namespaced(client.clone(), &namespace);
    let attempts_api: Api<SwapAttempt> = Api::namespaced(client.clone(), &namespace);

    let manifest = json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "InstanceGeneration",
        "metadata": {"name": "web", "namespace": namespace},
        "spec": {
            "build": {"id": "b1", "artifact": {"path": "/opt/web/b1"}, "sha256": "a".repeat(64)},
            "rollout": {"canaryNodes": 0, "maxParallel": NODES, "haltOnFailure": false},
        },
    });
    let mut ig = igs
        .patch("web", &PatchParams::apply("user"), &Patch::Apply(&manifest))
        .await
        .unwrap_or_else(|e| panic!("the user's apply: {e}"));

    let began = Instant::now();
    let (plan, attempts) = fleet_plan(&mut ig);
    let planned_in = began.elapsed();
    let counts = plan
        .status
        .counts
        .clone()
        .expect("the status counts the nodes");
    assert_eq!(
        (
            counts.selected,
            counts.ready,
            counts.stalled,
            counts.held_down
        ),
        (5_000, 1_000, 4_000, 4_000)
    );
    assert_eq!(
        plan.records.len(),
        NODES,
        "every node's outcome is recorded"
    );

    // What the status held before records: every node's entry.
    let every_entry: Vec<NodeGeneration> =
        plan.records.iter().map(|w| w.record.node.clone()).collect();
    let unbounded = serde_json::to_vec(&every_entry).expect("JSON").len();

    let written = igs
        .patch_status(
            "web",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&status_apply_patch(
                "web",
                &ig.resource_version().unwrap_or_default(),
                &plan.status,
            )),
        )
        .await
        .unwrap_or_else(|e| panic!("the API server refused the fleet's status: {e}"));
    let stored = written.status.expect("the status was stored");
    let bytes = serde_json::to_vec(&stored).expect("JSON").len();
    println!(
        "{NODES} nodes: the status is {bytes} bytes ({} nodes and {} held-down entries listed); \
         every node's entry would be {unbounded} bytes; planned in {:.0} ms",
        stored.nodes.len(),
        stored.held_down.len(),
        planned_in.as_secs_f64() * 1000.0
    );
    assert!(bytes < 64 * 1024, "the stored status is {bytes} bytes");
    assert!(stored.nodes.iter().all(|n| n.attention.is_some()));
    assert_eq!(stored.counts.map(|c| c.held_down), Some(4_000));

    // A record goes onto a real attempt by the controller's merge patch,
    // and the rest of the attempt is untouched.
    let write = &plan.records[0];
    let mut carrier = attempts
        .iter()
        .find(|a| a.metadata.name.as_deref() == Some(write.attempt.as_str()))
        .expect("the record's attempt")
        .clone();
    carrier.metadata.namespace = Some(namespace.clone());
    carrier.metadata.owner_references = None;
    carrier.status = None;
    attempts_api
        .create(&PostParams::default(), &carrier)
        .await
        .unwrap_or_else(|e| panic!("create {}: {e}", write.attempt));
    let params = PatchParams {
        field_manager: Some(MANAGER.into()),
        ..PatchParams::default()
    };
    attempts_api
        .patch_metadata(
            &write.attempt,
            &params,
            &Patch::Merge(&record_patch(&write.record.to_annotation())),
        )
        .await
        .unwrap_or_else(|e| panic!("the record patch: {e}"));
    let read = attempts_api
        .get(&write.attempt)
        .await
        .unwrap_or_else(|e| panic!("get {}: {e}", write.attempt));
    assert_eq!(
        NodeRecord::on(&read, &write.record.node.name).as_ref(),
        Some(&write.record)
    );
    assert_eq!(
        read.spec, carrier.spec,
        "the patch touched the annotation only"
    );
    assert!(
        read.metadata
            .annotations
            .is_some_and(|a| a.len() == 1 && a.contains_key(ANNOTATION_RECORD))
    );

    // The schema holds the bound: a status listing every node is refused.
    let mut unlisted = plan.status.clone();
    unlisted.nodes = every_entry;
    let current = igs.get_status("web").await.expect("the IG");
    let refused = igs
        .patch_status(
            "web",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&status_apply_patch(
                "web",
                &current.resource_version().unwrap_or_default(),
                &unlisted,
            )),
        )
        .await;
    match refused {
        Err(kube::Error::Api(status)) => assert!(
            status.code == 422 || status.code == 413,
            "refused, but with {status:?}"
        ),
        other => panic!("a status listing {NODES} nodes was accepted: {other:?}"),
    }
    plane.kubectl_ok(&["delete", "namespace", &namespace, "--wait=false"]);
}
