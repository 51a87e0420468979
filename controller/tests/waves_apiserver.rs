//! Waves on a real kube-apiserver (`../shared/kube`; the test says in one
//! line that it skipped where there is none): the controller, run as in
//! production against the API server, rolls an InstanceGeneration out over
//! nine Node objects in three zones, with agents simulated as in the fleet
//! bench (each attempt answered `done` shortly after it appears). The
//! canary goes first, then one zone at a time in the order asked for, each
//! only once the one before has run for its bake; the status names each
//! wave as it goes.
//!
//! What the simulated agents cannot catch: a real agent's swap time and
//! failures (the engine's tests and e2e/tests/cluster.rs run real ones).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt;
use genswap_controller::leader::Leadership;
use genswap_controller::metrics::Metrics;
use genswap_controller::run::{Settings, run_controller};
use genswap_controller::shutdown;
use genswap_crds::{InstanceGeneration, SwapAttempt};
use genswap_runtime::http::Readiness;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;
use test_cluster::{ControlPlane, OwnNamespace};

const ZONE: &str = "topology.kubernetes.io/zone";
const DEADLINE: Duration = Duration::from_secs(120);
const BAKE_SECONDS: i64 = 2;

/// Node objects this test created, deleted when it ends (on failure too):
/// Nodes belong to no namespace.
struct OwnNodes {
    api: Api<Node>,
    names: Vec<String>,
}

impl Drop for OwnNodes {
    fn drop(&mut self) {
        let api = self.api.clone();
        let names = std::mem::take(&mut self.names);
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(runtime) = runtime {
                runtime.block_on(async {
                    for name in names {
                        let _ = api.delete(&name, &DeleteParams::default()).await;
                    }
                });
            }
        })
        .join();
    }
}

/// When the simulated agents saw each attempt appear and finished it.
#[derive(Default)]
struct Seen {
    created: BTreeMap<String, Timestamp>,
    finished: BTreeMap<String, Timestamp>,
}

/// Answers every new attempt in `namespace` `done` after `after`.
fn simulate_agents(
    attempts: Api<SwapAttempt>,
    after: Duration,
    seen: Arc<Mutex<Seen>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut events = watcher(attempts.clone(), watcher::Config::default())
            .default_backoff()
            .applied_objects()
            .boxed();
        while let Some(event) = events.next().await {
            let Ok(attempt) = event else { continue };
            let Some(name) = attempt.metadata.name.clone() else {
                continue;
            };
            if attempt.status.as_ref().is_some_and(|s| s.outcome.is_some()) {
                continue;
            }
            {
                let mut seen = seen.lock().unwrap_or_else(PoisonError::into_inner);
                if seen.created.contains_key(&attempt.spec.node_name) {
                    continue;
                }
                seen.created
                    .insert(attempt.spec.node_name.clone(), Timestamp::now());
            }
            let (attempts, seen) = (attempts.clone(), Arc::clone(&seen));
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                let finished = Timestamp::now();
                let status = json!({"status": {
                    "outcome": "done",
                    "effectiveMode": attempt.spec.mode,
                    "generation": 1,
                    "executed": true,
                    "startedAt": finished.to_string(),
                    "finishedAt": finished.to_string(),
                    "serving": {"state": "Running", "generation": 1, "restarts": 0},
                }});
                attempts
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
                    .await
                    .unwrap_or_else(|e| panic!("answer {name}: {e}"));
                seen.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .finished
                    .insert(attempt.spec.node_name.clone(), finished);
            });
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_goes_canary_first_then_one_zone_at_a_time_each_after_its_bake() {
    let Some(plane) = ControlPlane::shared() else {
        println!("skipped: no control plane can start here (../shared/kube)");
        return;
    };
    plane.install_crds();
    let client = plane.client().await;
    let home = OwnNamespace::create(&client, "waves").await;
    let pool = format!("waves-{}", std::process::id());

    // n0 (the canary) is in zone-b; the order asks for zone-c first, then
    // the rest go by name.
    let zones = ["zone-b", "zone-a", "zone-c"];
    let mut nodes = OwnNodes {
        api: Api::all(client.clone()),
        names: Vec::new(),
    };
    let mut zone_of = BTreeMap::new();
    for i in 0..9 {
        let name = format!("{pool}-n{i}");
        plane
            .create_node(&name, &[(ZONE, zones[i % 3]), ("genswap.test/pool", &pool)])
            .await;
        nodes.names.push(name.clone());
        zone_of.insert(name, zones[i % 3]);
    }

    let metrics = Arc::new(Metrics::new());
    let leadership = Leadership::follower(metrics.clone());
    leadership.set(true);
    let (stop, stopped) = shutdown::channel();
    let controller = tokio::spawn(run_controller(
        client.clone(),
        client.clone(),
        Settings {
            namespace: Some(home.name.clone()),
            identity: "waves".into(),
            concurrency: 4,
            event_window: Duration::from_secs(600),
            // Every status goes out as planned: the test reads each wave.
            progress_hold: Duration::ZERO,
            inbox_namespace: None,
            prometheus: None,
        },
        metrics,
        leadership,
        Readiness::default(),
        stopped.wait(),
    ));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let agents = simulate_agents(
        Api::namespaced(client.clone(), &home.name),
        Duration::from_millis(300),
        Arc::clone(&seen),
    );

    let igs: Api<InstanceGeneration> = Api::namespaced(client.clone(), &home.name);
    let ig: InstanceGeneration = serde_json::from_value(json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "InstanceGeneration",
        "metadata": {"name": "web", "namespace": home.name},
        "spec": {
            "nodeSelector": {"genswap.test/pool": pool},
            "build": {"id": "b1", "artifact": {"path": "/opt/waves/b1"},
                      "sha256": format!("{:064x}", 1)},
            "rollout": {
                "canaryNodes": 1,
                // 5 of 9: more than a zone, so the wave, not maxParallel,
                // is what holds the next zone back.
                "maxParallel": "50%",
                "waves": {"byLabel": ZONE, "order": ["zone-c"]},
                "bakeSeconds": BAKE_SECONDS,
            },
        },
    }))
    .expect("an InstanceGeneration");
    igs.create(&PostParams::default(), &ig)
        .await
        .unwrap_or_else(|e| panic!("create the IG: {e}"));

    // The waves the status names, in the order it named them.
    let mut waves_named: Vec<String> = Vec::new();
    let deadline = Instant::now() + DEADLINE;
    loop {
        let ig = igs
            .get("web")
            .await
            .unwrap_or_else(|e| panic!("read the IG: {e}"));
        let status = ig.status.unwrap_or_default();
        if let Some(wave) = status.rollout.as_ref().and_then(|r| r.wave.clone())
            && waves_named.last() != Some(&wave)
        {
            waves_named.push(wave);
        }
        let ready = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        if ready {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not Ready in {DEADLINE:?}; waves named so far {waves_named:?}; status {:?}",
            status.conditions
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.fire();
    let _ = tokio::time::timeout(DEADLINE, controller).await;
    agents.abort();

    assert_eq!(
        waves_named,
        ["canary", "zone-c", "zone-a", "zone-b"],
        "the status names each wave in turn"
    );
    let seen = seen.lock().unwrap_or_else(PoisonError::into_inner);
    let wave_of = |node: &str| match (node.ends_with("-n0"), zone_of[node]) {
        (true, _) => 0,
        (false, "zone-c") => 1,
        (false, "zone-a") => 2,
        (false, _) => 3,
    };
    let mut first_created = [None::<Timestamp>; 4];
    let mut last_finished = [None::<Timestamp>; 4];
    for (node, created) in &seen.created {
        let wave = wave_of(node);
        first_created[wave] = Some(first_created[wave].map_or(*created, |t| t.min(*created)));
        let finished = seen.finished[node];
        last_finished[wave] = Some(last_finished[wave].map_or(finished, |t| t.max(finished)));
    }
    assert_eq!(seen.created.len(), 9, "one attempt per node");
    for wave in 1..4 {
        let (Some(started), Some(before_done)) = (first_created[wave], last_finished[wave - 1])
        else {
            panic!("wave {wave} or the one before it never ran");
        };
        let gap = started.duration_since(before_done);
        assert!(
            gap >= SignedDuration::from_secs(BAKE_SECONDS),
            "wave {wave} started {gap:?} after the wave before it finished, within its bake of {BAKE_SECONDS} s"
        );
    }
    drop(nodes);
}
