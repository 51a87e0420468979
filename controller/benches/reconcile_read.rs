//! A reconcile's read and plan, by the number of InstanceGenerations in the
//! cache: the IG's attempts from the owner index, against the scan of the
//! whole attempt cache that the index replaced (kept here as the baseline),
//! each followed by the plan.
//!
//! `cargo bench -p controller --bench reconcile_read` prints microseconds
//! per reconcile for 10, 100 and 1,000 IGs × 3 nodes, each IG rolled out to
//! b1 and then left mid-rollout to b2. Nothing is asserted about time.

use std::collections::HashSet;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use genswap_controller::attempt_index::AttemptIndex;
use genswap_controller::scheduler::{LABEL_INSTANCE, Plan, label_value, plan};
use genswap_crds::{
    InstanceGeneration, InstanceGenerationSpec, Outcome, SwapAttempt, SwapAttemptStatus,
};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};

const T0: i64 = 1_800_000_000;
const NODES: usize = 3;
/// Long enough for a steady figure on a noisy machine.
const MEASURE_FOR: Duration = Duration::from_millis(1500);

fn now() -> Timestamp {
    Timestamp::from_second(T0).unwrap_or(Timestamp::UNIX_EPOCH)
}

fn spec(build: &str) -> InstanceGenerationSpec {
    let hex: String = build.bytes().map(|b| format!("{b:02x}")).collect();
    let mut spec: InstanceGenerationSpec = serde_json::from_value(serde_json::json!({
        "build": {"id": build, "artifact": {"path": format!("/srv/builds/{build}")}, "sha256": format!("{hex:0<64}")},
    }))
    .unwrap_or_else(|e| panic!("the benchmark's spec is valid: {e}"));
    spec.rollout.max_parallel = 2;
    spec
}

fn nodes() -> Vec<Node> {
    (0..NODES)
        .map(|i| Node {
            metadata: ObjectMeta {
                name: Some(format!("node-{i}")),
                ..ObjectMeta::default()
            },
            ..Node::default()
        })
        .collect()
}

/// One IG mid-rollout and the attempts the API server holds for it.
fn stored(i: usize, nodes: &[Node]) -> (InstanceGeneration, Vec<SwapAttempt>) {
    let mut ig = InstanceGeneration::new(&format!("app-{i:05}"), spec("b1"));
    ig.metadata.namespace = Some("prod".into());
    ig.metadata.uid = Some(format!("uid-{i}"));
    ig.metadata.generation = Some(1);
    let mut attempts: Vec<SwapAttempt> = Vec::new();
    let step = |ig: &mut InstanceGeneration, attempts: &mut Vec<SwapAttempt>| {
        let planned: Plan = plan(ig, attempts, nodes, now());
        let gone: HashSet<String> = planned.delete.into_iter().collect();
        attempts.retain(|a| a.metadata.name.as_ref().is_none_or(|n| !gone.contains(n)));
        let created = planned.create.len();
        attempts.extend(planned.create);
        ig.status = Some(planned.status);
        created
    };
    let finish = |attempts: &mut Vec<SwapAttempt>| {
        for attempt in attempts.iter_mut().filter(|a| a.status.is_none()) {
            attempt.status = Some(SwapAttemptStatus {
                outcome: Some(Outcome::Done),
                effective_mode: Some(attempt.spec.mode),
                generation: Some(attempt.spec.sched_rev),
                executed: Some(true),
                finished_at: Some(Time(now())),
                ..SwapAttemptStatus::default()
            });
        }
    };
    while step(&mut ig, &mut attempts) > 0 {
        finish(&mut attempts);
    }
    ig.spec.build = spec("b2").build;
    ig.metadata.generation = Some(2);
    step(&mut ig, &mut attempts);
    finish(&mut attempts);
    step(&mut ig, &mut attempts);
    (ig, attempts)
}

/// The read the index replaced: every cached attempt scanned, the IG's
/// cloned.
fn scanned(
    ig: &InstanceGeneration,
    store: &Store<DeserializeGuard<SwapAttempt>>,
) -> Vec<SwapAttempt> {
    let namespace = ig.namespace();
    let kind = InstanceGeneration::kind(&());
    let owner_uid = ig.uid();
    let name = ig.name_any();
    let mut owned: Vec<SwapAttempt> = store
        .state()
        .iter()
        .filter_map(|guard| guard.0.as_ref().ok())
        .filter(|attempt| attempt.namespace() == namespace)
        .filter(|attempt| match &owner_uid {
            Some(uid) => attempt
                .owner_references()
                .iter()
                .any(|owner| owner.kind == kind && &owner.uid == uid),
            None => attempt.labels().get(LABEL_INSTANCE) == Some(&label_value(&name)),
        })
        .cloned()
        .collect();
    owned.sort_by(|a, b| {
        (&a.spec.node_name, a.spec.sched_rev).cmp(&(&b.spec.node_name, b.spec.sched_rev))
    });
    owned
}

/// Microseconds per reconcile of `read` + plan, cycling through the IGs.
fn per_reconcile<A: std::borrow::Borrow<SwapAttempt>>(
    igs: &[InstanceGeneration],
    nodes: &[Node],
    read: impl Fn(&InstanceGeneration) -> Vec<A>,
) -> f64 {
    let started = Instant::now();
    let mut done = 0usize;
    while started.elapsed() < MEASURE_FOR {
        let ig = &igs[done % igs.len()];
        let attempts = read(ig);
        black_box(plan(ig, &attempts, nodes, now()));
        done += 1;
    }
    started.elapsed().as_secs_f64() * 1e6 / done as f64
}

fn main() {
    let nodes = nodes();
    println!(
        "{:>6} {:>9} {:>22} {:>22}",
        "IGs", "attempts", "scan + plan (us)", "index + plan (us)"
    );
    for count in [10, 100, 1_000] {
        let (store, mut writer) = reflector::store::<DeserializeGuard<SwapAttempt>>();
        let index = AttemptIndex::new();
        let mut igs = Vec::with_capacity(count);
        let mut total = 0;
        for i in 0..count {
            let (ig, attempts) = stored(i, &nodes);
            for attempt in attempts {
                let event = watcher::Event::Apply(DeserializeGuard(Ok(attempt)));
                index.observe(&event);
                writer.apply_watcher_event(&event);
                total += 1;
            }
            igs.push(ig);
        }
        let scan = per_reconcile(&igs, &nodes, |ig| scanned(ig, &store));
        let indexed = per_reconcile::<Arc<SwapAttempt>>(&igs, &nodes, |ig| index.attempts_of(ig));
        println!("{count:>6} {total:>9} {scan:>22.1} {indexed:>22.1}");
    }
}
