//! A rollout across an outage of the real API server: a release is issued,
//! the API server is stopped while the node swaps, and once it is back
//! the InstanceGeneration is Ready on the new build within 10 s of
//! `/readyz` answering (the agent's report retried, every watch relisted
//! after its `410 Gone`). Needs the suite's own control plane, which it
//! stops: this file holds no other test.

mod support;

use std::time::{Duration, Instant};

use genswap_crds::{InstanceGeneration, SwapAttempt};
use kube::api::{Api, ListParams, Patch, PatchParams};
use support::{Cluster, Stack, get_over};

/// How long the API server stays down: every watch fails and backs off to
/// its ceiling meanwhile.
const OUTAGE: Duration = Duration::from_secs(30);
/// The bound, from the server being ready again to Ready.
const CONVERGED: Duration = Duration::from_secs(10);
const DEADLINE: Duration = Duration::from_secs(180);

fn ready_on(ig: &InstanceGeneration, build: &str) -> bool {
    let Some(status) = ig.status.as_ref() else {
        return false;
    };
    let ready = status
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    ready
        && !status.nodes.is_empty()
        && status
            .nodes
            .iter()
            .all(|n| n.build.as_deref() == Some(build))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_outage_the_rollout_is_ready_within_ten_seconds_of_the_server() {
    let Some(cluster) = Cluster::find().await else {
        return;
    };
    let Some(plane) = cluster.own() else {
        println!("outage: skipped: it stops the API server of the suite's own control plane");
        return;
    };
    let crds = support::workspace().join("crds");
    cluster.kubectl(&[
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        &crds.to_string_lossy(),
    ]);
    let mut stack = Stack::start(&cluster, "outage").await;
    let client = cluster.client().await;
    let igs: Api<InstanceGeneration> = Api::namespaced(client.clone(), &stack.namespace.name);
    let attempts: Api<SwapAttempt> = Api::namespaced(client, &stack.namespace.name);
    let apply = |object: serde_json::Value| {
        let igs = igs.clone();
        async move {
            igs.patch(
                "web",
                &PatchParams::apply("genswap-e2e"),
                &Patch::Apply(&object),
            )
            .await
            .unwrap_or_else(|e| panic!("apply web: {e}"));
        }
    };
    let poll_ready = |build: &'static str| {
        let igs = igs.clone();
        async move {
            let deadline = Instant::now() + DEADLINE;
            loop {
                if let Ok(ig) = igs.get("web").await
                    && ready_on(&ig, build)
                {
                    return;
                }
                assert!(Instant::now() < deadline, "web is not Ready on {build}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };

    let v1 = testapp::make_build(&stack.staging, "web-1").expect("stage web-1");
    apply(stack.instance_generation("web", &v1, 0)).await;
    poll_ready("web-1").await;

    // The release, with a settle window that outlasts the stop below.
    let v2 = testapp::make_build(&stack.staging, "web-2").expect("stage web-2");
    apply(stack.instance_generation("web", &v2, 5)).await;
    let deadline = Instant::now() + DEADLINE;
    while !attempts
        .list(&ListParams::default())
        .await
        .map(|list| {
            list.items
                .iter()
                .any(|a| a.spec.build.id == "web-2" && !a.spec.stage_only)
        })
        .unwrap_or(false)
    {
        stack.assert_running();
        assert!(
            Instant::now() < deadline,
            "no attempt of web-2{}",
            stack.diagnosis()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    plane.stop_api_server();
    let down = Instant::now();
    while down.elapsed() < OUTAGE {
        stack.assert_running();
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let ready = plane.start_api_server().await;
    println!(
        "outage: the API server was down {:.1} s",
        ready.duration_since(down).as_secs_f64()
    );
    poll_ready("web-2").await;
    let took = ready.elapsed();
    println!(
        "outage: Ready on web-2 {} ms after /readyz",
        took.as_millis()
    );
    assert!(
        took <= CONVERGED,
        "converged {took:?} after the server was ready{}",
        stack.diagnosis()
    );
    assert!(
        get_over(&stack.current_sock("web")).is_ok_and(|body| body.contains("build=web-2 ")),
        "web-2 serves"
    );
    stack.assert_running();
}
