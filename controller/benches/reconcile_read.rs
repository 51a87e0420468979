//! A reconcile's read and plan, by the number of InstanceGenerations in the
//! cache: the IG's attempts from the owner index, against the scan of the
//! whole attempt cache that the index replaced (kept here as the baseline),
//! each followed by the plan.
//!
//! `cargo bench -p controller --bench reconcile_read` prints microseconds
//! per reconcile for 10, 100 and 1,000 IGs × 3 nodes, each IG rolled out to
//! b1 and then left mid-rollout to b2. Nothing is asserted about time.

use std::hint::black_box;
use std::time::{Duration, Instant};

use genswap_controller::attempt_index::AttemptIndex;
use genswap_core::scheduler::{LABEL_INSTANCE, label_value, plan};
use genswap_crds::{InstanceGeneration, SwapAttempt};
use k8s_openapi::api::core::v1::Node;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};

#[path = "support/fleet.rs"]
mod fleet;
use fleet::{Stored, cluster, fleet, now};

/// Nodes per IG.
const NODES: usize = 3;
/// Long enough for a steady figure on a noisy machine.
const MEASURE_FOR: Duration = Duration::from_millis(1500);

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
    let nodes = cluster(NODES);
    println!(
        "{:>6} {:>9} {:>22} {:>22}",
        "IGs", "attempts", "scan + plan (us)", "index + plan (us)"
    );
    for count in [10, 100, 1_000] {
        let (store, mut writer) = reflector::store::<DeserializeGuard<SwapAttempt>>();
        let index = AttemptIndex::new();
        let mut igs = Vec::with_capacity(count);
        let mut total = 0;
        for Stored { ig, attempts } in fleet(count, &nodes, 2, true) {
            for attempt in attempts {
                let event = watcher::Event::Apply(DeserializeGuard(Ok(attempt)));
                index.observe(&event);
                writer.apply_watcher_event(&event);
                total += 1;
            }
            igs.push(ig);
        }
        let scan = per_reconcile(&igs, &nodes, |ig| scanned(ig, &store));
        let indexed = per_reconcile::<SwapAttempt>(&igs, &nodes, |ig| index.attempts_of(ig));
        println!("{count:>6} {total:>9} {scan:>22.1} {indexed:>22.1}");
    }
}
