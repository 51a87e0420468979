//! What one write costs the API server, by what is written: a ConfigMap,
//! a SwapAttempt's status by server-side apply (as the agent writes it)
//! and by merge patch, and the same status of a copy of the SwapAttempt
//! CRD with its CEL rules removed. One write at a time on a control plane
//! of its own, so the server's CPU over the writes is theirs.

use std::time::Instant;

use genswap_crds::SwapAttempt;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::BenchError;
use crate::cluster::{plane_pid, process_cpu_ms};

const NAMESPACE: &str = "writes";
/// The group of the copy without CEL rules.
const BARE_GROUP: &str = "bare.genswap.dev";

/// One kind of write.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct WriteCost {
    pub kind: String,
    pub writes: usize,
    /// The API server's CPU per write, ms.
    pub server_cpu_ms: f64,
    /// Wall time per write, one at a time, ms.
    pub wall_ms: f64,
}

/// Runs `writes` writes of each kind.
pub async fn run(writes: usize) -> Result<Vec<WriteCost>, BenchError> {
    let (plane, client) = crate::cluster::plane_with_crds(NAMESPACE).await?;
    let failed = |what: &str| {
        let what = what.to_string();
        move |e: kube::Error| BenchError::Agent(format!("{what}: {e}"))
    };
    create_bare_copy(&client).await?;
    plane.kubectl_ok(&[
        "wait",
        "--for=condition=Established",
        &format!("crd/swapattempts.{BARE_GROUP}"),
        "--timeout=60s",
    ]);
    let attempt = test_cluster::objects::swap_attempt("s1", "n1", 1);
    let attempts: Api<SwapAttempt> = Api::namespaced(client.clone(), NAMESPACE);
    let typed: SwapAttempt = serde_json::from_value(attempt.clone())
        .map_err(|e| BenchError::Agent(format!("a SwapAttempt: {e}")))?;
    attempts
        .create(&PostParams::default(), &typed)
        .await
        .map_err(failed("create the SwapAttempt"))?;
    let bare_resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(BARE_GROUP, "v1alpha1", "SwapAttempt"),
        "swapattempts",
    );
    let bare: Api<DynamicObject> = Api::namespaced_with(client.clone(), NAMESPACE, &bare_resource);
    let mut bare_attempt = attempt.clone();
    bare_attempt["apiVersion"] = json!(format!("{BARE_GROUP}/v1alpha1"));
    let bare_object: DynamicObject = serde_json::from_value(bare_attempt)
        .map_err(|e| BenchError::Agent(format!("a bare SwapAttempt: {e}")))?;
    bare.create(&PostParams::default(), &bare_object)
        .await
        .map_err(failed("create the bare SwapAttempt"))?;
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), NAMESPACE);
    let config_map: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "c1"}, "data": {"a": "b"}}))
            .map_err(|e| BenchError::Agent(format!("a ConfigMap: {e}")))?;
    config_maps
        .create(&PostParams::default(), &config_map)
        .await
        .map_err(failed("create the ConfigMap"))?;

    let server = plane_pid(&plane, "kube-apiserver")?;
    let apply = PatchParams::apply("genswap-bench").force();
    let merge = PatchParams::default();
    let mut costs = Vec::new();
    let mut measure = async |kind: &str, write: &dyn Fn(usize) -> Patch<Value>, target: Target| {
        let cpu = process_cpu_ms(server);
        let began = Instant::now();
        for i in 0..writes {
            let patch = write(i);
            let result = match target {
                Target::ConfigMap => config_maps.patch("c1", &merge, &patch).await.map(|_| ()),
                Target::Status(params) => attempts
                    .patch_status("s1", params, &patch)
                    .await
                    .map(|_| ()),
                Target::BareStatus => bare.patch_status("s1", &merge, &patch).await.map(|_| ()),
            };
            result.map_err(failed(kind))?;
        }
        let cost = WriteCost {
            kind: kind.to_string(),
            writes,
            server_cpu_ms: (process_cpu_ms(server) - cpu) / writes.max(1) as f64,
            wall_ms: began.elapsed().as_secs_f64() * 1000.0 / writes.max(1) as f64,
        };
        println!(
            "  {kind}: {:.2} ms of API server CPU per write ({:.2} ms wall)",
            cost.server_cpu_ms, cost.wall_ms
        );
        costs.push(cost);
        Ok::<(), BenchError>(())
    };
    measure(
        "ConfigMap, merge patch",
        &|i| Patch::Merge(json!({"data": {"a": format!("v{i}"), "status": status(i).to_string()}})),
        Target::ConfigMap,
    )
    .await?;
    measure(
        "SwapAttempt status, server-side apply",
        &|i| {
            Patch::Apply(json!({
                "apiVersion": "genswap.dev/v1alpha1", "kind": "SwapAttempt",
                "metadata": {"name": "s1"}, "status": status(i),
            }))
        },
        Target::Status(&apply),
    )
    .await?;
    measure(
        "SwapAttempt status, merge patch",
        &|i| Patch::Merge(json!({"status": status(i)})),
        Target::Status(&merge),
    )
    .await?;
    measure(
        "SwapAttempt status, merge patch, the CRD without its CEL rules",
        &|i| Patch::Merge(json!({"status": status(i)})),
        Target::BareStatus,
    )
    .await?;
    Ok(costs)
}

#[derive(Clone, Copy)]
enum Target<'a> {
    ConfigMap,
    Status(&'a PatchParams),
    BareStatus,
}

/// An outcome as the agent reports one, different for each `i`.
fn status(i: usize) -> Value {
    let steps: Vec<Value> = [
        "stage", "journal", "spawn", "health", "switch", "retire", "drain",
    ]
    .iter()
    .enumerate()
    .map(|(k, step)| json!({"step": step, "millis": (i + k) % 97, "result": "ok"}))
    .collect();
    json!({
        "outcome": "done", "executed": true, "effectiveMode": "overlap",
        "generation": i + 1, "drainMs": 5,
        "reason": format!("generation {} serves", i + 1),
        "startedAt": "2026-12-03T16:00:00Z", "finishedAt": "2026-12-03T16:00:01Z",
        "steps": steps,
    })
}

/// A copy of the SwapAttempt CRD in [`BARE_GROUP`] with every
/// `x-kubernetes-validations` removed.
async fn create_bare_copy(client: &kube::Client) -> Result<(), BenchError> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let original = crds
        .get("swapattempts.genswap.dev")
        .await
        .map_err(|e| BenchError::Agent(format!("read the SwapAttempt CRD: {e}")))?;
    let mut spec = serde_json::to_value(&original.spec)
        .map_err(|e| BenchError::Agent(format!("the CRD's spec: {e}")))?;
    strip_rules(&mut spec);
    spec["group"] = json!(BARE_GROUP);
    let copy: CustomResourceDefinition = serde_json::from_value(json!({
        "metadata": {"name": format!("swapattempts.{BARE_GROUP}")},
        "spec": spec,
    }))
    .map_err(|e| BenchError::Agent(format!("the bare CRD: {e}")))?;
    crds.create(&PostParams::default(), &copy)
        .await
        .map_err(|e| BenchError::Agent(format!("create the bare CRD: {e}")))?;
    Ok(())
}

fn strip_rules(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.remove("x-kubernetes-validations");
            map.values_mut().for_each(strip_rules);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_rules),
        _ => {}
    }
}
