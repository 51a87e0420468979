//! The real scheduler through the adapter, against an in-memory API server:
//! a revision is never issued twice, even when a create fails after its
//! reservation, when a stale replica writes, and across controller restarts.

mod support;

use std::sync::Arc;

use genswap_controller::context::Planner;
use genswap_controller::reconciler::reconcile;
use genswap_core::scheduler;
use genswap_crds::InstanceGeneration;
use support::fake_api::FakeCluster;
use support::*;

/// A controller process: fresh caches, fresh client, the real planner
/// reserving exactly what each plan issues (every reservation a write, so
/// each failure below meets one).
fn start(cluster: &FakeCluster) -> (Harness, tokio::task::JoinHandle<()>) {
    let dense: Planner =
        Arc::new(|ig, attempts, nodes, now, _| scheduler::plan(ig, attempts, nodes, now));
    start_with(cluster, dense)
}

/// A controller process with `planner`.
fn start_with(cluster: &FakeCluster, planner: Planner) -> (Harness, tokio::task::JoinHandle<()>) {
    let (mut h, verifier) = harness(planner, true);
    h.add_node(node("n1", &[("pool", "a")]));
    h.add_node(node("n2", &[("pool", "a")]));
    let server = cluster.serve(verifier);
    (h, server)
}

async fn stop(h: Harness, server: tokio::task::JoinHandle<()>) {
    drop(h);
    tokio::time::timeout(DEADLINE, server)
        .await
        .expect("the fake API server saw the client go")
        .expect("the fake API server's assertions held");
}

async fn reconcile_once(h: &mut Harness, cluster: &FakeCluster) -> Result<(), String> {
    let ig: InstanceGeneration = cluster.sync(h);
    reconcile(watched(ig), h.ctx.clone())
        .await
        .map(|_| ())
        .map_err(|error| error.to_string())
}

#[tokio::test]
async fn a_revision_is_never_issued_twice_across_failed_creates_stale_writers_and_restarts() {
    let cluster = FakeCluster::new(ig("1", None));

    // Process A. The first attempt (canary n1, rev 1) is reserved, then its
    // create fails: rev 1 is burned.
    let (mut a, server) = start(&cluster);
    cluster.with(|s| s.fail_next_creates = 1);
    let failed = reconcile_once(&mut a, &cluster)
        .await
        .expect_err("the failed create fails the reconcile");
    assert!(failed.contains("burned"), "{failed}");
    assert_eq!(cluster.ig().status.as_ref().map(|s| s.sched_rev), Some(1));
    assert!(cluster.with(|s| s.attempts.is_empty()));

    // A former leader whose cache still holds the object from before the
    // last reservation cannot issue anything: its write conflicts.
    let stale = cluster.ig();
    reconcile_once(&mut a, &cluster)
        .await
        .expect("the retry issues a fresh revision");
    assert_eq!(cluster.with(|s| s.create_requests.clone()), vec![1, 2]);
    let (mut former, former_server) = start(&cluster);
    cluster.sync(&mut former);
    let error = reconcile(watched(stale.clone()), former.ctx.clone())
        .await
        .expect_err("a stale writer loses");
    assert_eq!(error.metric_label(), "conflict");
    assert_eq!(cluster.with(|s| s.conflicts), 1);
    stop(former, former_server).await;
    // The writer itself, handed its own stale copy, waits for its cache to
    // catch up instead of racing its own write.
    reconcile(watched(stale), a.ctx.clone())
        .await
        .expect("waiting is not an error");
    assert_eq!(cluster.with(|s| s.conflicts), 1);
    assert_eq!(
        cluster.with(|s| s.create_requests.clone()),
        vec![1, 2],
        "the stale copies created nothing"
    );
    stop(a, server).await;

    // Process B starts from what the API server holds. The canary is done;
    // the next node is issued, and its create fails too: rev 3 is burned.
    cluster.report("web-n1-2", "done", 1);
    let (mut b, server) = start(&cluster);
    cluster.with(|s| s.fail_next_creates = 1);
    reconcile_once(&mut b, &cluster)
        .await
        .expect_err("the failed create fails the reconcile");
    stop(b, server).await;

    // Process C: the burned revision is not reused.
    let (mut c, server) = start(&cluster);
    reconcile_once(&mut c, &cluster)
        .await
        .expect("the retry after the restart issues a fresh revision");
    // Nothing more to issue while n2 is in flight: a further reconcile
    // writes nothing new.
    reconcile_once(&mut c, &cluster)
        .await
        .expect("an idle reconcile succeeds");
    stop(c, server).await;

    let (requested, stored, sched_rev, reasons) = cluster.with(|s| {
        (
            s.create_requests.clone(),
            s.attempts
                .values()
                .map(|a| (a.spec.node_name.clone(), a.spec.sched_rev))
                .collect::<Vec<_>>(),
            s.ig.status.as_ref().map(|st| st.sched_rev),
            s.event_reasons.clone(),
        )
    });
    assert_eq!(
        requested,
        vec![1, 2, 3, 4],
        "every revision was handed out once, in order"
    );
    assert_eq!(
        stored,
        vec![("n1".into(), 2), ("n2".into(), 4)],
        "burned revisions 1 and 3 exist nowhere"
    );
    assert_eq!(sched_rev, Some(4));
    for reason in ["AttemptIssued", "AttemptCreateFailed", "SwapDone"] {
        assert!(
            reasons.iter().any(|r| r == reason),
            "{reason} recorded: {reasons:?}"
        );
    }
    assert_eq!(
        reasons.iter().filter(|r| *r == "SwapDone").count(),
        1,
        "an outcome is recorded once, even across a restart: {reasons:?}"
    );
}

/// A controller process as production runs it: the real planner through
/// the context's own revisions (reserving ahead), three nodes, canary 1.
fn start_production(cluster: &FakeCluster) -> (Harness, tokio::task::JoinHandle<()>) {
    let (mut h, server) = start_with(cluster, Arc::new(scheduler::plan_with));
    h.add_node(node("n3", &[("pool", "a")]));
    (h, server)
}

#[tokio::test]
async fn a_rollout_reserves_ahead_issues_its_later_wave_without_a_status_write_and_a_restart_skips_what_was_left()
 {
    let cluster = FakeCluster::new(ig("1", None));
    let (mut a, server) = start_production(&cluster);
    let writes = |cluster: &FakeCluster| cluster.with(|s| s.status_writes);
    let sched_rev = |cluster: &FakeCluster| cluster.ig().status.map(|s| s.sched_rev);

    // The canary's reservation covers the two nodes waiting for it.
    reconcile_once(&mut a, &cluster).await.expect("issue n1");
    assert_eq!(cluster.with(|s| s.create_requests.clone()), vec![1]);
    assert_eq!((sched_rev(&cluster), writes(&cluster)), (Some(3), 1));

    // The canary is done: n2 (maxParallel 1) gets revision 2 from that
    // reservation, with no status write; the outcome's status waits for
    // n2's, its Event does not.
    cluster.report("web-n1-1", "done", 1);
    reconcile_once(&mut a, &cluster).await.expect("issue n2");
    assert_eq!(cluster.with(|s| s.create_requests.clone()), vec![1, 2]);
    assert_eq!((sched_rev(&cluster), writes(&cluster)), (Some(3), 1));

    // n2 done: n3 gets the last reserved revision; still no write.
    cluster.report("web-n2-2", "done", 1);
    reconcile_once(&mut a, &cluster).await.expect("issue n3");
    assert_eq!(cluster.with(|s| s.create_requests.clone()), vec![1, 2, 3]);
    assert_eq!(writes(&cluster), 1, "progress waits for n3");

    // The last outcome: Ready, and the whole story in one write.
    cluster.report("web-n3-3", "done", 1);
    reconcile_once(&mut a, &cluster).await.expect("all done");
    assert_eq!(writes(&cluster), 2);
    assert_eq!(
        cluster.with(|s| s.record_writes),
        3,
        "each node's outcome is recorded once, on its attempt"
    );
    let status = cluster.ig().status.expect("a status");
    assert_eq!(status.ready.as_deref(), Some("3/3"));
    assert!(
        status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True"),
        "{:?}",
        status.conditions
    );
    stop(a, server).await;
    let reasons = cluster.with(|s| s.event_reasons.clone());
    assert_eq!(
        reasons.iter().filter(|r| *r == "SwapDone").count(),
        3,
        "each outcome's Event once, though its status waited: {reasons:?}"
    );

    // A release: its canary's reservation covers n2 and n3 again (4..6).
    // The process restarts before the next wave: revisions 5 and 6 were
    // this process's alone and are skipped, never issued; the new one
    // reserves 7..8 for n2 and the node still waiting.
    // Without pre-staging, whose asks would take revisions first: this
    // story counts the swaps' (scheduler_prestage.rs counts those).
    cluster.with(|s| {
        s.ig.spec.build.id = "b2".into();
        s.ig.spec.rollout.prestage = false;
        s.ig.metadata.generation = Some(2);
    });
    let (mut b, server) = start_production(&cluster);
    reconcile_once(&mut b, &cluster)
        .await
        .expect("issue n1's release");
    assert_eq!(sched_rev(&cluster), Some(6));
    stop(b, server).await;
    cluster.report("web-n1-4", "done", 2);
    let (mut c, server) = start_production(&cluster);
    reconcile_once(&mut c, &cluster)
        .await
        .expect("issue the rest");
    stop(c, server).await;
    assert_eq!(
        cluster.with(|s| s.create_requests.clone()),
        vec![1, 2, 3, 4, 7],
        "every revision once, in order; 5 and 6 left unissued"
    );
    assert_eq!(sched_rev(&cluster), Some(8));
}

#[tokio::test]
async fn an_exit_reported_by_an_agent_reaches_the_conditions_and_issues_nothing() {
    let cluster = FakeCluster::new(ig("1", None));
    let (mut h, server) = start(&cluster);
    // Both nodes installed: n1 (the canary, rev 1), then n2 (rev 2).
    reconcile_once(&mut h, &cluster).await.expect("issue n1");
    cluster.report("web-n1-1", "done", 1);
    reconcile_once(&mut h, &cluster).await.expect("issue n2");
    cluster.report("web-n2-2", "done", 1);
    reconcile_once(&mut h, &cluster).await.expect("both ready");
    let ready = |cluster: &FakeCluster| {
        cluster.ig().status.and_then(|s| {
            s.conditions
                .iter()
                .find(|c| c.type_ == "Ready")
                .map(|c| format!("{} {}", c.status, c.reason))
        })
    };
    assert_eq!(ready(&cluster).as_deref(), Some("True AllNodesReady"));

    // n1's agent: its generation was SIGKILLed and the restart waits.
    cluster.with(|s| {
        let status = s
            .attempts
            .get_mut("web-n1-1")
            .and_then(|a| a.status.as_mut())
            .expect("n1's install has a status");
        status.serving = serde_json::from_value(serde_json::json!({
            "state": "BackOff",
            "generation": 1,
            "restarts": 0,
            "lastExit": { "generation": 1, "signal": 9, "at": "2026-12-01T12:00:00Z" },
            "message": "generation 1 exited with signal 9 (SIGKILL), 2 exits in a row; restarting it in 10s",
        }))
        .expect("a serving block");
    });
    reconcile_once(&mut h, &cluster)
        .await
        .expect("the exit is read");
    assert_eq!(ready(&cluster).as_deref(), Some("False CrashLoopBackOff"));
    let status = cluster.ig().status.expect("a status");
    let n1 = status.nodes.iter().find(|n| n.name == "n1").expect("n1");
    assert_eq!(n1.serving, Some(false));
    assert_eq!(n1.last_exit.as_ref().and_then(|e| e.signal), Some(9));
    assert_eq!(status.ready.as_deref(), Some("1/2"));
    assert_eq!(
        cluster.with(|s| s.create_requests.clone()),
        vec![1, 2],
        "the agent restarts it; the controller issues nothing"
    );
    // Events are sent after the reconcile, and all of them before the
    // client goes away.
    stop(h, server).await;
    assert!(
        cluster.with(|s| s.event_reasons.iter().any(|r| r == "GenerationExited")),
        "the exit is an Event"
    );
}
