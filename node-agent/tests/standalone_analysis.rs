//! Progressive delivery in standalone mode, where the rollout is one node:
//! the canary wave, the progress deadline, and `rollout.analysis` judged
//! by a real Prometheus (Debian's) scraping the instance, with the queries
//! of `examples/canary-analysis.yaml`; a build that fails 5 % of its
//! requests while its health check passes is halted and the good build
//! restored (`onFailure: restore`). Real processes, real cgroups.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "standalone_support/mod.rs"]
mod standalone_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use genswap_crds::{AnalysisPhase, Cause, ConditionType, Outcome};
use standalone_support::{Client, Manifest, NODE, StandaloneHost, key};
use test_cluster::prometheus::{Forwarder, Server, erroring_build, free_port};

/// The example's analysis as a YAML flow mapping: its queries as written,
/// measured every 5 s, twice, no crossing allowed.
fn example_analysis() -> String {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/canary-analysis.yaml");
    let text = std::fs::read_to_string(&path).expect("read the example");
    let example: serde_json::Value = serde_saphyr::from_str(&text).expect("the example parses");
    let mut analysis = example["spec"]["rollout"]["analysis"].clone();
    // At least a few scrapes (1 s) apart: rate() needs two samples.
    analysis["intervalSeconds"] = 5.into();
    analysis["count"] = 2.into();
    analysis["failureLimit"] = 0.into();
    analysis["everyWave"] = false.into();
    // JSON is YAML's flow style.
    format!(
        "{{onFailure: restore, analysis: {}}}",
        serde_json::to_string(&analysis).expect("serializes")
    )
}

/// A condition's status, reason and message.
fn condition(
    doc: &node_agent::standalone::status::StatusDocument,
    kind: &str,
) -> (String, String, String) {
    doc.status
        .conditions
        .iter()
        .find(|c| c.type_ == kind)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
        .unwrap_or_default()
}

fn stalled_by(doc: &node_agent::standalone::status::StatusDocument, reason: &str) -> bool {
    let (status, actual, _) = condition(doc, "Stalled");
    status == "True" && actual == reason
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_one_node_is_judged_by_its_metrics_and_a_failing_build_is_restored() {
    let Some(binary) = test_cluster::prometheus::binary() else {
        return;
    };
    let port = free_port();
    let host = StandaloneHost::start_measured("analysis", &format!("http://127.0.0.1:{port}"));
    let web = key("web");
    let forwarder = Forwarder::start(host.current_sock(&web)).await;
    let mut prometheus = Server::start(
        &binary,
        port,
        &[(forwarder.address.clone(), vec![("node", NODE)])],
    )
    .await;
    let client = Client::start(host.current_sock(&web));

    let good = host.build("b1");
    let mut manifest = Manifest::new("web", "b1", &good);
    manifest.health_path = Some("/healthz".into());
    manifest.host_filesystem = true;
    manifest.rollout = Some(example_analysis());
    host.write("web.yaml", &manifest.yaml());
    let doc = host
        .status("web.yaml", "b1 judged and Ready", |doc| {
            doc.is_true(ConditionType::Ready)
        })
        .await;
    let record = doc
        .status
        .rollout
        .as_ref()
        .and_then(|r| r.analysis.clone())
        .expect("the analysis record");
    assert_eq!(
        (record.build.as_str(), record.wave.as_str(), record.phase),
        ("b1", "canary", AnalysisPhase::Passed),
        "{record:?}"
    );
    assert_eq!(
        (record.measurements, record.inconclusive),
        (2, 0),
        "judged on samples"
    );
    prometheus.assert_running();

    let (bad_path, bad_sha) = erroring_build(&host.staging, &good.path, "b2", 5);
    manifest.build_id = "b2".into();
    manifest.path = bad_path;
    manifest.sha256 = bad_sha;
    host.write("web.yaml", &manifest.yaml());
    let doc = host
        .status("web.yaml", "b2 halted by its analysis", |doc| {
            stalled_by(doc, "AnalysisFailed")
        })
        .await;
    let message = condition(&doc, "Stalled").2;
    assert!(
        message.contains("query error-rate gave") && message.contains("above its max 0.01"),
        "{message}"
    );
    let doc = host
        .status("web.yaml", "b1 restored", |doc| {
            doc.last_attempt()
                .is_some_and(|l| l.cause == Cause::Rollback && l.outcome == Outcome::Done)
        })
        .await;
    assert_eq!(
        host.who_serves(&web).await.map(|who| who.build).as_deref(),
        Some("b1"),
        "the good build serves again"
    );
    assert_eq!(condition(&doc, "Stalled").1, "AnalysisFailed");
    let (sent, failed) = client.finish().await;
    assert!(
        failed > 0 && failed < sent / 10,
        "b2 answered some 500s, no more: {failed} of {sent}"
    );
    prometheus.assert_running();
    drop(forwarder);
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_that_does_not_move_is_stalled_at_its_deadline_then_moves_on() {
    let host = StandaloneHost::start("deadline");
    let slow = host.build("slow");
    let mut manifest = Manifest::new("slow", "slow", &slow);
    // Booting takes 4 s; the deadline is 1 s.
    manifest.env = vec![("TESTAPP_BOOT_DELAY_MS".into(), "4000".into())];
    manifest.rollout = Some("{progressDeadlineSeconds: 1}".into());
    host.write("slow.yaml", &manifest.yaml());
    let doc = host
        .status("slow.yaml", "the deadline passed", |doc| {
            stalled_by(doc, "ProgressDeadlineExceeded")
        })
        .await;
    let rollout = doc.status.rollout.clone().expect("status.rollout");
    assert_eq!(
        rollout.wave.as_deref(),
        Some("canary"),
        "the one node is the canary wave"
    );
    let message = condition(&doc, "Stalled").2;
    assert!(
        message.contains(&format!("attempts in flight on: {NODE}")),
        "{message}"
    );
    let doc = host
        .status("slow.yaml", "Ready once it booted", |doc| {
            doc.is_true(ConditionType::Ready)
        })
        .await;
    assert_eq!(condition(&doc, "Stalled").0, "False");
    host.stop().await;
}
