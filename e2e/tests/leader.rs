//! Two controller replicas on a real API server, under the chart's
//! ServiceAccount: the follower keeps one watch of the Lease open (counted
//! in the API server's audit log), and when the leader shuts down
//! gracefully the follower takes the Lease within 2 s (a follower that
//! waited for the claim to expire would take up to the lease duration,
//! 15 s). Needs the suite's own control plane (its audit log); elsewhere it
//! says so and passes.

mod support;

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use support::{ChildGuard, Cluster};

const LEASE: &str = "genswap-e2e-leader";
/// How long the follower is watched for Lease watches it opens again.
const QUIET_WINDOW: Duration = Duration::from_secs(15);
/// The bound for a graceful hand-over.
const HAND_OVER: Duration = Duration::from_secs(2);

fn holder(lease: &Lease) -> Option<String> {
    lease
        .spec
        .as_ref()?
        .holder_identity
        .clone()
        .filter(|h| !h.is_empty())
}

/// Polls the Lease every 10 ms until `done` holds its holder; returns it.
async fn wait_holder(
    leases: &Api<Lease>,
    what: &str,
    done: impl Fn(Option<&str>) -> bool,
) -> Option<String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = leases.get_opt(LEASE).await.ok().flatten();
        let holder = now.as_ref().and_then(holder);
        if done(holder.as_deref()) {
            return holder;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the Lease is held by {holder:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Lease watches the API server started, from its audit log.
fn lease_watches(audit_log: &std::path::Path) -> usize {
    std::fs::read_to_string(audit_log)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|event| {
            event["verb"] == "watch"
                && event["stage"] == "ResponseStarted"
                && event["objectRef"]["resource"] == "leases"
                && event["requestURI"]
                    .as_str()
                    .is_some_and(|uri| uri.contains(LEASE))
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_follower_watches_the_lease_quietly_and_takes_it_at_once_on_a_graceful_stop() {
    let Some(cluster) = Cluster::find().await else {
        return;
    };
    let Some(plane) = cluster.own() else {
        println!("leader: skipped: it reads the audit log of the suite's own control plane");
        return;
    };
    let namespace = cluster.namespace("leader").await;
    let dir = support::host_dir();
    let start = |identity: &str| {
        ChildGuard::spawn(
            identity.to_string(),
            cluster.controller_command(&namespace.name, LEASE, identity),
            dir.path().join(format!("{identity}.log")),
        )
    };
    let mut one = start("replica-1");
    let mut two = start("replica-2");
    let leases: Api<Lease> = Api::namespaced(
        cluster.client().await,
        cluster.lease_namespace(&namespace.name),
    );
    let leader = wait_holder(&leases, "a leader", |h| h.is_some())
        .await
        .unwrap_or_default();

    // The follower's watch of the Lease is open once it has seen the
    // leader's claim; from then on it stays open: no watch is started
    // again in the window (a watch under the lease client's 4 s request
    // timeout was started every ~4.5 s).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = lease_watches(&plane.audit_log());
    tokio::time::sleep(QUIET_WINDOW).await;
    let again = lease_watches(&plane.audit_log()) - before;
    println!("leader: {again} Lease watch(es) started in {QUIET_WINDOW:?} while following");
    assert_eq!(again, 0, "the follower opened its Lease watch again");

    let (stopping, following, follower) = if leader == "replica-1" {
        (&mut one, &mut two, "replica-2")
    } else {
        (&mut two, &mut one, "replica-1")
    };
    let stopped_at = Instant::now();
    let status = stopping.stop();
    assert!(status.success(), "the leader exits cleanly: {status}");
    wait_holder(&leases, "the hand-over", |h| h == Some(follower)).await;
    let took = stopped_at.elapsed();
    println!(
        "leader: graceful hand-over {} ms (SIGTERM to the follower holding the Lease)",
        took.as_millis()
    );
    assert!(took <= HAND_OVER, "the hand-over took {took:?}");
    following.assert_running();
}
