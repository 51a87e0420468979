//! What one cached SwapAttempt costs the controller's heap: the attempts
//! of 10 IGs × 1,000 nodes as the API server sends them (the scheduler's
//! own objects with each node's record, an agent's `done` status with its
//! step timings and conditions, and the managed fields of the two
//! writers), folded into the attempt index as the watch does: as they
//! arrive, the index keeping its compact entry of each.
//!
//! `cargo bench -p controller --bench cache_footprint` prints bytes per
//! attempt: its JSON, the heap the trimmed `SwapAttempt` alone holds (what
//! the index kept before its compact entries), the heap it holds in the
//! index, and the size of the struct alone; then the same for one of the
//! IGs, whose status lists every node and whose managed fields list every
//! node's fields again. glibc's own count of the heap in use is the
//! measure (`genswap_runtime::heap`). Nothing is asserted about the
//! figures.
//!
//! What it cannot show: the managed fields here are built from each
//! object's own fields as the API server's field sets are (`f:` per field,
//! `k:` per item of a keyed list), but not by the server's own code: they
//! can differ in detail. The fleet bench measures the
//! whole process against the real API server.

use std::hint::black_box;

use genswap_controller::attempt_index::AttemptIndex;
use genswap_controller::observe::{trim_attempt, trim_instance_generation};
use genswap_crds::{InstanceGeneration, StepTiming, SwapAttempt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    Condition, FieldsV1, ManagedFieldsEntry, Time,
};
use kube::core::DeserializeGuard;
use kube::runtime::watcher;
use serde_json::{Map, Value};

#[path = "support/fleet.rs"]
mod fleet;
use fleet::{cluster, fleet, now};

const NODES: usize = 1000;
const IGS: usize = 10;

const STEPS: [&str; 9] = [
    "stage", "admit", "raise", "journal", "spawn", "health", "switch", "retire", "stop",
];

/// The field set a manager owns, as the API server writes it: `f:` per
/// field, and `k:` per item of a list keyed by `name` or `type` (the
/// list-maps of the schema: `status.nodes`, conditions).
fn fields_of(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(key, inner)| (format!("f:{key}"), fields_of(inner)))
                .collect::<Map<String, Value>>(),
        ),
        Value::Array(items) => {
            let mut keyed = Map::new();
            for item in items {
                let key = ["name", "type"]
                    .iter()
                    .find_map(|k| Some((*k, item.get(*k)?.as_str()?)));
                let Some((field, value)) = key else {
                    return Value::Object(Map::new());
                };
                let mut fields = match fields_of(item) {
                    Value::Object(fields) => fields,
                    _ => Map::new(),
                };
                fields.insert(".".into(), Value::Object(Map::new()));
                keyed.insert(
                    format!("k:{{\"{field}\":\"{value}\"}}"),
                    Value::Object(fields),
                );
            }
            Value::Object(keyed)
        }
        _ => Value::Object(Map::new()),
    }
}

fn managed(manager: &str, subresource: Option<&str>, fields: Value) -> ManagedFieldsEntry {
    ManagedFieldsEntry {
        api_version: Some("genswap.dev/v1alpha1".into()),
        fields_type: Some("FieldsV1".into()),
        fields_v1: Some(FieldsV1(fields)),
        manager: Some(manager.into()),
        operation: Some("Update".into()),
        subresource: subresource.map(String::from),
        time: Some(Time(now())),
    }
}

/// One attempt as a watch would deliver it once its agent reported `done`.
fn as_served(mut attempt: SwapAttempt, index: usize) -> String {
    attempt.metadata.uid = Some(format!("{index:08x}-0000-4000-8000-000000000000"));
    attempt.metadata.resource_version = Some(format!("{}", 100_000 + index));
    attempt.metadata.creation_timestamp = Some(Time(now()));
    if let Some(status) = attempt.status.as_mut() {
        status.started_at = Some(Time(now()));
        status.steps = STEPS
            .iter()
            .map(|step| StepTiming {
                step: (*step).into(),
                result: "ok".into(),
                millis: 3,
            })
            .collect();
        status.conditions = ["Ready", "Reconciling", "Stalled"]
            .iter()
            .map(|kind| Condition {
                type_: (*kind).into(),
                status: if *kind == "Ready" { "True" } else { "False" }.into(),
                reason: "SwapDone".into(),
                message: "build b1 serves".into(),
                last_transition_time: Time(now()),
                observed_generation: Some(1),
            })
            .collect();
    }
    let json = serde_json::to_value(&attempt).unwrap_or_default();
    let spec_fields = serde_json::json!({
        "f:metadata": fields_of(&serde_json::json!({
            "labels": json["metadata"]["labels"],
            "ownerReferences": {},
        })),
        "f:spec": fields_of(&json["spec"]),
    });
    let status_fields = serde_json::json!({ "f:status": fields_of(&json["status"]) });
    attempt.metadata.managed_fields = Some(vec![
        managed("genswap-controller", None, spec_fields),
        managed("genswap-node-agent", Some("status"), status_fields),
    ]);
    serde_json::to_string(&attempt).unwrap_or_default()
}

fn heap_in_use() -> u64 {
    genswap_runtime::heap::usage().map_or(0, |heap| heap.in_use)
}

/// An IG as a watch delivers it: its status with every node's entry, and
/// the managed fields of the server-side applies that wrote it.
fn ig_as_served(mut ig: InstanceGeneration) -> String {
    let json = serde_json::to_value(&ig).unwrap_or_default();
    ig.metadata.managed_fields = Some(vec![
        managed(
            "kubectl",
            None,
            serde_json::json!({ "f:spec": fields_of(&json["spec"]) }),
        ),
        ManagedFieldsEntry {
            operation: Some("Apply".into()),
            ..managed(
                "genswap-controller",
                Some("status"),
                serde_json::json!({ "f:status": fields_of(&json["status"]) }),
            )
        },
    ]);
    serde_json::to_string(&ig).unwrap_or_default()
}

/// Heap bytes held per IG once each is parsed, trimmed or not.
fn held_per_ig(served: &[String], trim: bool) -> f64 {
    let before = heap_in_use();
    let held: Vec<InstanceGeneration> = served
        .iter()
        .map(|text| {
            let mut ig: InstanceGeneration = match serde_json::from_str(text) {
                Ok(ig) => ig,
                Err(error) => panic!("the benchmark's IG parses: {error}"),
            };
            if trim {
                trim_instance_generation(&mut ig);
            }
            ig
        })
        .collect();
    let per = heap_in_use().saturating_sub(before) as f64 / served.len() as f64;
    black_box(held);
    per
}

/// Heap bytes per attempt the index holds once every JSON text is folded
/// in as the watch delivers it: the index keeps a compact entry
/// ([`genswap_controller::cached_attempt::CachedAttempt`]) of each.
fn held_per_attempt(served: &[String]) -> f64 {
    let before = heap_in_use();
    let index = AttemptIndex::new();
    index.observe(&watcher::Event::Init);
    for text in served {
        let attempt: SwapAttempt = match serde_json::from_str(text) {
            Ok(attempt) => attempt,
            Err(error) => panic!("the benchmark's attempt parses: {error}"),
        };
        index.observe(&watcher::Event::InitApply(DeserializeGuard(Ok(attempt))));
    }
    index.observe(&watcher::Event::InitDone);
    let held = heap_in_use().saturating_sub(before);
    let per = held as f64 / served.len() as f64;
    black_box(index);
    per
}

/// Heap bytes per attempt when each trimmed attempt is kept whole, as the
/// index kept them before its compact entries: the figure those replace.
fn held_as_swap_attempts(served: &[String]) -> f64 {
    let before = heap_in_use();
    let held: Vec<std::sync::Arc<SwapAttempt>> = served
        .iter()
        .map(|text| {
            let mut attempt: SwapAttempt = match serde_json::from_str(text) {
                Ok(attempt) => attempt,
                Err(error) => panic!("the benchmark's attempt parses: {error}"),
            };
            trim_attempt(&mut attempt);
            std::sync::Arc::new(attempt)
        })
        .collect();
    let per = heap_in_use().saturating_sub(before) as f64 / served.len() as f64;
    black_box(held);
    per
}

fn main() {
    if genswap_runtime::heap::usage().is_none() {
        println!("cache_footprint: this C library reports no heap figures; nothing measured");
        return;
    }
    let nodes = cluster(NODES);
    let stored = fleet(IGS, &nodes, NODES as i32, false);
    let igs_served: Vec<String> = stored.iter().map(|s| ig_as_served(s.ig.clone())).collect();
    let served: Vec<String> = stored
        .into_iter()
        .flat_map(|stored| stored.attempts)
        .enumerate()
        .map(|(index, attempt)| as_served(attempt, index))
        .collect();
    let json = served.iter().map(String::len).sum::<usize>() as f64 / served.len() as f64;
    // The first fold warms the allocator's arenas; each figure is the
    // median of three.
    let _ = held_per_attempt(&served);
    let median = |fold: &dyn Fn() -> f64| {
        let mut runs: Vec<f64> = (0..3).map(|_| fold()).collect();
        runs.sort_by(f64::total_cmp);
        runs[1]
    };
    let in_index = median(&|| held_per_attempt(&served));
    let as_objects = median(&|| held_as_swap_attempts(&served));
    println!(
        "cache_footprint: {} attempts ({IGS} IGs × {NODES} nodes), bytes per attempt",
        served.len()
    );
    println!("  JSON as the API server sends it   {json:>8.0}");
    println!("  held trimmed as SwapAttempts      {as_objects:>8.0}");
    println!("  held in the index                 {in_index:>8.0}");
    println!(
        "  of which the struct itself        {:>8}",
        std::mem::size_of::<SwapAttempt>()
    );
    let ig_json = igs_served.iter().map(String::len).sum::<usize>() as f64 / IGS as f64;
    let _ = held_per_ig(&igs_served, false);
    let ig_untrimmed = held_per_ig(&igs_served, false);
    let ig_trimmed = held_per_ig(&igs_served, true);
    println!("cache_footprint: an InstanceGeneration of {NODES} nodes, bytes");
    println!("  JSON as the API server sends it   {ig_json:>8.0}");
    println!("  held, as it arrives               {ig_untrimmed:>8.0}");
    println!("  held, managed fields dropped      {ig_trimmed:>8.0}");
}
