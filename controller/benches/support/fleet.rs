//! InstanceGenerations and their attempts as the API server would hold
//! them, made by the scheduler itself: each IG is rolled out to build b1,
//! then moved to b2 and left mid-rollout (canary done, `maxParallel`
//! attempts in flight) or settled (every node on b1). Shared by the
//! benches that plan.

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use std::collections::HashSet;

use genswap_core::scheduler::{Plan, plan};
use genswap_crds::{
    InstanceGeneration, InstanceGenerationSpec, Outcome, SwapAttempt, SwapAttemptStatus,
};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;

const T0: i64 = 1_800_000_000;

/// The one instant every fixture and plan uses.
pub fn now() -> Timestamp {
    Timestamp::from_second(T0).unwrap_or(Timestamp::UNIX_EPOCH)
}

pub fn spec(build: &str, max_parallel: i32) -> InstanceGenerationSpec {
    let hex: String = build.bytes().map(|b| format!("{b:02x}")).collect();
    let mut spec: InstanceGenerationSpec = serde_json::from_value(serde_json::json!({
        "build": {
            "id": build,
            "artifact": { "path": format!("/srv/builds/{build}") },
            "sha256": format!("{hex:0<64}"),
        },
        "nodeSelector": { "pool": "edge" },
        "process": { "args": ["--listen", "$GENSWAP_SOCKET"], "env": [{ "name": "RUST_LOG", "value": "info" }] },
    }))
    .unwrap_or_else(|e| panic!("the benchmark's spec is valid: {e}"));
    spec.rollout.max_parallel = IntOrString::Int(max_parallel);
    spec
}

/// `size` Nodes of the pool every fixture selects.
pub fn cluster(size: usize) -> Vec<Node> {
    (0..size)
        .map(|i| Node {
            metadata: ObjectMeta {
                name: Some(format!("node-{i:04}")),
                labels: Some(
                    [
                        ("pool".to_string(), "edge".to_string()),
                        ("kubernetes.io/os".to_string(), "linux".to_string()),
                    ]
                    .into(),
                ),
                ..ObjectMeta::default()
            },
            ..Node::default()
        })
        .collect()
}

/// One IG and the attempts the API server would hold for it.
pub struct Stored {
    pub ig: InstanceGeneration,
    pub attempts: Vec<SwapAttempt>,
}

impl Stored {
    fn apply(&mut self, plan: Plan) {
        let gone: HashSet<String> = plan.delete.into_iter().collect();
        self.attempts
            .retain(|a| a.metadata.name.as_ref().is_none_or(|n| !gone.contains(n)));
        // Each node's record goes onto its carrier, as the controller
        // patches it.
        for write in &plan.records {
            write.write_onto(&mut self.attempts);
        }
        self.attempts.extend(plan.create);
        self.ig.status = Some(plan.status);
    }

    fn reconcile(&mut self, nodes: &[Node]) -> usize {
        let plan = plan(&self.ig, &self.attempts, nodes, now());
        let created = plan.create.len();
        self.apply(plan);
        created
    }

    fn finish_all(&mut self) {
        for attempt in self.attempts.iter_mut().filter(|a| a.status.is_none()) {
            attempt.status = Some(SwapAttemptStatus {
                outcome: Some(Outcome::Done),
                effective_mode: Some(attempt.spec.mode),
                generation: Some(attempt.spec.sched_rev),
                executed: Some(true),
                finished_at: Some(Time(now())),
                ..SwapAttemptStatus::default()
            });
        }
    }
}

/// `count` IGs rolled out to b1; `mid_rollout` then moves them to b2 and
/// stops with the canary done and `max_parallel` attempts in flight.
pub fn fleet(count: usize, nodes: &[Node], max_parallel: i32, mid_rollout: bool) -> Vec<Stored> {
    (0..count)
        .map(|i| {
            let mut ig = InstanceGeneration::new(&format!("app-{i:05}"), spec("b1", max_parallel));
            ig.metadata.namespace = Some("prod".into());
            ig.metadata.uid = Some(format!("uid-{i}"));
            ig.metadata.generation = Some(1);
            let mut stored = Stored {
                ig,
                attempts: Vec::new(),
            };
            while stored.reconcile(nodes) > 0 {
                stored.finish_all();
            }
            stored.reconcile(nodes);
            if mid_rollout {
                stored.ig.spec.build = spec("b2", max_parallel).build;
                stored.ig.metadata.generation = Some(2);
                stored.reconcile(nodes);
                stored.finish_all();
                stored.reconcile(nodes);
            }
            stored
        })
        .collect()
}
