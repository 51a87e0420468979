//! A canary judged by its metrics (SPEC 4.3, `rollout.analysis`) with
//! everything real but the load: the suite's control plane, the
//! controller and two agents as processes (two Nodes, one canary), the
//! test app as the instance, and Debian's Prometheus on loopback scraping
//! each node's instance. The queries are the ones `examples/canary-analysis.yaml`
//! documents, run as they are written there.
//!
//! 1. b1 installs: the canary's analysis passes on real samples (no 5xx
//!    series at all: the example's `or vector(0)`), then the other node.
//! 2. b2 answers 5 % of requests with a 500 while `/healthz` passes: the
//!    canary takes it, its analysis fails, the rollout is `Stalled` with
//!    `AnalysisFailed` naming the query, value and bound, an Event says
//!    so, `onFailure: restore` gives the canary b1 back, and the other
//!    node never runs b2. The time from the canary's health to the halt is
//!    printed (docs/BENCHMARKS.md).
//!
//! What stands in: the load is this test's requests over each instance's
//! socket, and the scrape goes through a TCP forwarder to that socket (in
//! a cluster Prometheus scrapes a held listener; the answer is the same
//! generation's). Needs root, cgroup v2 and `prometheus` on PATH
//! (`GENSWAP_PROMETHEUS=required` makes a missing one fail, as CI does).

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use genswap_crds::{AnalysisPhase, InstanceGeneration, SwapAttempt};
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::{Value, json};
use support::{Cluster, INSTANCE_ID, Stack, apply_crds, get_over, path_str};
use test_cluster::prometheus::{Forwarder, Server, erroring_build};

const IG: &str = "web";
const FIELD_MANAGER: &str = "genswap-e2e";
const STEP_DEADLINE: Duration = Duration::from_secs(180);
const GROUP_LABEL: &str = "e2e.genswap.dev/analysis";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_that_fails_its_users_is_halted_by_its_metrics_and_restored() {
    let Some(prometheus_binary) = test_cluster::prometheus::binary() else {
        return;
    };
    let Some(cluster) = Cluster::find().await else {
        return;
    };
    if cluster.own().is_none() {
        println!("skipped: two labelled Nodes need the suite's own control plane");
        return;
    }
    apply_crds(&cluster);

    let port = test_cluster::prometheus::free_port();
    let url = format!("http://127.0.0.1:{port}");
    let group = support::unique();
    let labels = [(GROUP_LABEL, group.as_str())];
    let stack = Stack::start_full(
        &cluster,
        "analysis-a",
        Vec::new(),
        vec!["--prometheus-url".into(), url.clone().into()],
        &labels,
    )
    .await;
    let second = stack.second_agent(&cluster, "analysis-b", &labels).await;
    let canary = stack.node_name.clone();
    assert!(
        canary < second.node_name,
        "the canary is the first node by name"
    );
    let sockets = [
        (canary.clone(), stack.current_sock(IG)),
        (
            second.node_name.clone(),
            second
                .run_dir
                .join(format!("{}.{IG}", stack.namespace.name))
                .join("current.sock"),
        ),
    ];

    // Prometheus scrapes each node's instance every second, labelled with
    // the node's name, as a cluster's relabelling would.
    let mut forwarders = Vec::new();
    let mut targets = Vec::new();
    for (node, socket) in &sockets {
        let forwarder = Forwarder::start(socket.clone()).await;
        targets.push((forwarder.address.clone(), vec![("node", node.as_str())]));
        forwarders.push(forwarder);
    }
    let mut prometheus = Server::start(&prometheus_binary, port, &targets).await;

    // Requests to both nodes all along; a body not naming the build a node
    // should serve is counted.
    let load = Load::start(&sockets);

    let igs: Api<InstanceGeneration> =
        Api::namespaced(cluster.client().await, &stack.namespace.name);
    let good = testapp::make_build(&stack.staging, "b1").expect("stage b1");
    let bad = erroring_build(&stack.staging, &good.path, "b2", 5);
    let analysis = example_analysis();

    // 1. The install: the canary passes on real samples.
    apply(
        &igs,
        &stack,
        &group,
        ("b1", &good.path, &good.sha256),
        &analysis,
    )
    .await;
    let ig = wait_ig(&igs, &mut prometheus, "b1 ready on both nodes", |ig| {
        condition(ig, "Ready").is_some_and(|(status, _, _)| status == "True")
    })
    .await;
    let record = analysis_record(&ig);
    assert_eq!(
        (record.build.as_str(), record.phase, record.inconclusive),
        ("b1", AnalysisPhase::Passed, 0),
        "the canary's analysis passed on samples: {record:?}"
    );
    load.expect_only("b1");

    // 2. The release of a build that fails 5 % of its requests.
    apply(&igs, &stack, &group, ("b2", &bad.0, &bad.1), &analysis).await;
    let ig = wait_ig(&igs, &mut prometheus, "b2 halted by its analysis", |ig| {
        condition(ig, "Stalled")
            .is_some_and(|(status, reason, _)| status == "True" && reason == "AnalysisFailed")
    })
    .await;
    let (_, _, message) = condition(&ig, "Stalled").expect("Stalled");
    assert!(
        message.contains("query error-rate gave") && message.contains("above its max 0.01"),
        "{message}"
    );
    let halted_at = condition_time(&ig, "Stalled");

    let attempts: Api<SwapAttempt> = Api::namespaced(cluster.client().await, &stack.namespace.name);
    let canary_b2_done = wait_for(&mut prometheus, "the canary's b2 attempt", || async {
        attempts
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .into_iter()
            .find(|a| a.spec.node_name == canary && a.spec.build.id == "b2" && !a.spec.stage_only)
            .and_then(|a| a.status?.finished_at)
    })
    .await;
    let seconds = halted_at.0.duration_since(canary_b2_done.0).as_secs_f64();
    println!(
        "analysis: the canary took over with b2 at {}, the rollout halted at {} ({seconds} s; intervalSeconds {}, failureLimit 0)",
        canary_b2_done.0, halted_at.0, analysis["intervalSeconds"]
    );

    // The canary gets b1 back; b2 stays held; the other node never ran it.
    let canary_socket = sockets[0].1.clone();
    wait_for(&mut prometheus, "the canary restored to b1", || {
        let socket = canary_socket.clone();
        async move {
            get_over(&socket)
                .ok()
                .filter(|body| body.contains("build=b1 "))
        }
    })
    .await;
    let all = attempts
        .list(&ListParams::default())
        .await
        .expect("list attempts");
    assert!(
        all.items.iter().any(|a| a.spec.node_name == canary
            && a.spec.build.id == "b1"
            && a.spec.cause.as_str() == "rollback"),
        "a rollback attempt restored the canary"
    );
    assert!(
        !all.items
            .iter()
            .any(|a| a.spec.node_name == second.node_name
                && a.spec.build.id == "b2"
                && !a.spec.stage_only),
        "the second node never swapped to b2 (it only staged it ahead)"
    );
    let events: Api<Event> = Api::namespaced(cluster.client().await, &stack.namespace.name);
    let event = wait_for(&mut prometheus, "the AnalysisFailed Event", || async {
        events
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("AnalysisFailed"))
    })
    .await;
    assert!(
        event
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("error-rate"),
        "{event:?}"
    );
    let ig = igs.get(IG).await.expect("the IG");
    assert!(
        condition(&ig, "Stalled")
            .is_some_and(|(status, reason, _)| status == "True" && reason == "AnalysisFailed"),
        "still halted after the restore"
    );
    load.stop();
    assert_eq!(
        load.wrong_on(&second.node_name),
        0,
        "the second node answered with b1 throughout"
    );
    drop(forwarders);
    drop(second);
    drop(stack);
}

/// Polls `check` until it gives a value; panics with Prometheus's log
/// after [`STEP_DEADLINE`] or when Prometheus exited.
async fn wait_for<T, F, Fut>(prometheus: &mut Server, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + STEP_DEADLINE;
    loop {
        prometheus.assert_running();
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn wait_ig(
    igs: &Api<InstanceGeneration>,
    prometheus: &mut Server,
    what: &str,
    done: impl Fn(&InstanceGeneration) -> bool,
) -> InstanceGeneration {
    wait_for(prometheus, what, || async {
        let ig = igs.get(IG).await.ok()?;
        done(&ig).then_some(ig)
    })
    .await
}

/// The analysis of `examples/canary-analysis.yaml`, its queries as they
/// are, measured every 5 s, twice, no crossing allowed.
fn example_analysis() -> Value {
    let path = support::workspace().join("examples/canary-analysis.yaml");
    let text = std::fs::read_to_string(&path).expect("read the example");
    let example: Value = serde_saphyr::from_str(&text).expect("the example parses");
    let mut analysis = example["spec"]["rollout"]["analysis"].clone();
    analysis["intervalSeconds"] = json!(5);
    analysis["count"] = json!(2);
    analysis["failureLimit"] = json!(0);
    analysis["everyWave"] = json!(false);
    analysis["inconclusive"] = json!("halt");
    analysis
}

async fn apply(
    igs: &Api<InstanceGeneration>,
    stack: &Stack,
    group: &str,
    (id, path, sha256): (&str, &Path, &str),
    analysis: &Value,
) {
    let object = json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "InstanceGeneration",
        "metadata": {"name": IG, "namespace": stack.namespace.name},
        "spec": {
            "nodeSelector": {GROUP_LABEL: group},
            "build": {"id": id, "artifact": {"path": path_str(path)}, "sha256": sha256},
            // The bad build is a script that runs the test app: it must see
            // the test's directories.
            "process": {"user": INSTANCE_ID, "group": INSTANCE_ID, "filesystem": "Host"},
            "health": {"path": "/healthz", "timeoutSeconds": 5},
            "settle": {"seconds": 1},
            "stop": {"timeoutSeconds": 5},
            "rollout": {
                "canaryNodes": 1,
                "maxParallel": 1,
                "onFailure": "restore",
                "analysis": analysis,
            },
        },
    });
    igs.patch(
        IG,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&object),
    )
    .await
    .unwrap_or_else(|e| panic!("apply the InstanceGeneration: {e}"));
}

fn condition(ig: &InstanceGeneration, kind: &str) -> Option<(String, String, String)> {
    ig.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == kind)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

fn condition_time(
    ig: &InstanceGeneration,
    kind: &str,
) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Time {
    ig.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == kind))
        .map(|c| c.last_transition_time.clone())
        .expect("the condition")
}

fn analysis_record(ig: &InstanceGeneration) -> genswap_crds::AnalysisStatus {
    ig.status
        .as_ref()
        .and_then(|s| s.rollout.as_ref())
        .and_then(|r| r.analysis.clone())
        .expect("status.rollout.analysis")
}

/// Requests to each node's instance, one after another per node, from a
/// thread each; bodies that do not name the expected build are counted.
struct Load {
    stop: Arc<AtomicBool>,
    expected: Arc<std::sync::Mutex<String>>,
    wrong: Vec<(String, Arc<AtomicUsize>)>,
    threads: std::sync::Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl Load {
    fn start(sockets: &[(String, PathBuf)]) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let expected = Arc::new(std::sync::Mutex::new(String::new()));
        let mut wrong = Vec::new();
        let mut threads = Vec::new();
        for (node, socket) in sockets {
            let counter = Arc::new(AtomicUsize::new(0));
            wrong.push((node.clone(), counter.clone()));
            let (stop, expected, socket) = (stop.clone(), expected.clone(), socket.clone());
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(body) = get_over(&socket) {
                        let want = expected
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .clone();
                        if !want.is_empty() && !body.contains(&format!("build={want} ")) {
                            counter.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    // A steady rate, not a wait for anything.
                    std::thread::sleep(Duration::from_millis(5));
                }
            }));
        }
        Load {
            stop,
            expected,
            wrong,
            threads: std::sync::Mutex::new(threads),
        }
    }

    /// From now on every answer must name `build` (checked on the second
    /// node, which only ever gets this build).
    fn expect_only(&self, build: &str) {
        *self
            .expected
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = build.to_string();
    }

    fn wrong_on(&self, node: &str) -> usize {
        self.wrong
            .iter()
            .find(|(name, _)| name == node)
            .map_or(0, |(_, count)| count.load(Ordering::Relaxed))
    }

    fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self
            .threads
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain(..)
        {
            let _ = thread.join();
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop();
    }
}
