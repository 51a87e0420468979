//! The whole Controller (watches, caches, triggers, leadership, readiness,
//! shutdown) with the real scheduler, against an in-memory API server that
//! answers lists and streams watch events, on time or late.

mod support;

use std::sync::Arc;
use std::time::Duration;

use genswap_controller::leader::Leadership;
use genswap_controller::metrics::Metrics;
use genswap_controller::run::{Settings, run_controller};
use genswap_controller::shutdown;
use genswap_runtime::http::Readiness;
use support::cluster::{Cluster, Kind, NS, Shared, client, eventually, lock, node, seeded};

const DEADLINE: Duration = Duration::from_secs(30);
/// Shorter than the default: the story below waits for it twice.
const PROGRESS_HOLD: Duration = Duration::from_secs(1);
/// Longer than any test here runs: Normal Events are written only when the
/// controller stops.
const EVENT_WINDOW: Duration = Duration::from_secs(600);

#[tokio::test]
async fn the_controller_follows_its_watches_and_writes_only_as_leader() {
    let cluster = seeded();
    let metrics = Arc::new(Metrics::new());
    let leadership = Leadership::follower(metrics.clone());
    let readiness = Readiness::default();
    let (stop, controller) = start(&cluster, &metrics, &leadership, &readiness);

    support::poll_until("caches synced", DEADLINE, || readiness.is_ready()).await;
    assert!(
        lock(&cluster).writes.is_empty(),
        "a follower with synced caches has written nothing"
    );

    // Becoming the leader re-plans everything: the canary is issued.
    leadership.set(true);
    eventually("the canary attempt on n1", &cluster, DEADLINE, |c| {
        c.get(Kind::Attempt, "web-n1-1").is_some()
    })
    .await;
    {
        let c = lock(&cluster);
        assert_eq!(
            c.writes[..2],
            [
                format!("PATCH {}/web/status", Kind::Ig.collection()),
                format!("POST {}", Kind::Attempt.collection()),
            ],
            "the reservation comes before the create"
        );
    }

    // The agent reports the canary done: its watch event re-plans the IG,
    // which issues the next node from the canary's reservation; the status
    // recording the outcome waits for the progress hold (n2 in flight).
    lock(&cluster).report_done("web-n1-1", 1);
    eventually("the attempt on n2", &cluster, DEADLINE, |c| {
        c.get(Kind::Attempt, "web-n2-2").is_some()
    })
    .await;
    eventually("n1 recorded as serving", &cluster, DEADLINE, |c| {
        c.ready_column().as_deref() == Some("1/2")
    })
    .await;

    // A node joining the pool re-plans the IG that selects it ...
    lock(&cluster).put(Kind::Node, node("n3", "a"), false);
    eventually("n3 counted", &cluster, DEADLINE, |c| {
        c.ready_column().as_deref() == Some("1/3")
    })
    .await;
    // ... and leaving it by a relabel re-plans it again.
    lock(&cluster).put(Kind::Node, node("n3", "z"), false);
    eventually("n3 no longer counted", &cluster, DEADLINE, |c| {
        c.ready_column().as_deref() == Some("1/2")
    })
    .await;

    {
        let c = lock(&cluster);
        assert!(
            c.events.is_empty(),
            "Normal Events wait for their window: {:?}",
            c.events
        );
        let revs: Vec<i64> = c
            .all(Kind::Attempt)
            .iter()
            .map(|a| a["spec"]["schedRev"].as_i64().expect("schedRev"))
            .collect();
        assert_eq!(revs, vec![1, 2]);
    }
    let text = metrics.encode().expect("metrics encode");
    assert!(
        text.contains(
            "genswap_controller_attempts_issued_total{cause=\"install\",mode=\"overlap\"} 2"
        ),
        "{text}"
    );
    assert!(
        text.contains("genswap_controller_outcomes_total{outcome=\"done\",mode=\"overlap\"} 1"),
        "{text}"
    );

    // Stopping writes what was still folding: the IG's three Normal Events
    // as one, in the order they happened, before the Lease is let go.
    stop_and_join(stop, controller).await;
    let c = lock(&cluster);
    assert_eq!(c.events.len(), 1, "{:?}", c.events);
    let event = &c.events[0];
    assert_eq!(event["reason"], "Progressing");
    assert_eq!(event["type"], "Normal");
    assert_eq!(event["regarding"]["name"], "web");
    assert_eq!(event["reportingInstance"], "replica-a");
    assert_eq!(event["series"]["count"], 3);
    let note = event["note"].as_str().unwrap_or_default();
    let entries: Vec<&str> = note.split("; ").collect();
    assert_eq!(entries.len(), 3, "{note}");
    assert!(
        entries[0].starts_with("AttemptIssued: node n1: rev 1,"),
        "{note}"
    );
    assert!(
        entries[1].starts_with("SwapDone: node n1: rev 1 done"),
        "{note}"
    );
    assert!(
        entries[2].starts_with("AttemptIssued: node n2: rev 2,"),
        "{note}"
    );
}

/// The number on `line` of the metrics text (a counter's sample), or 0.
fn sample(metrics: &Metrics, line_prefix: &str) -> f64 {
    metrics
        .encode()
        .expect("metrics encode")
        .lines()
        .find_map(|line| line.strip_prefix(line_prefix)?.trim().parse().ok())
        .unwrap_or(0.0)
}

fn attempts_on(cluster: &Cluster, node: &str) -> Vec<String> {
    cluster
        .all(Kind::Attempt)
        .iter()
        .filter(|a| a["spec"]["nodeName"] == node)
        .filter_map(|a| a["metadata"]["name"].as_str().map(str::to_string))
        .collect()
}

/// Polls `condition` on the metrics until it holds or the deadline passes.
async fn until_metrics(what: &str, metrics: &Metrics, condition: impl Fn(&Metrics) -> bool) {
    support::poll_until(what, DEADLINE, || condition(metrics)).await;
}

/// The controller running as `replica-a` against `cluster`, until the
/// returned switch is fired.
fn start(
    cluster: &Shared,
    metrics: &Arc<Metrics>,
    leadership: &Leadership,
    readiness: &Readiness,
) -> (shutdown::Trigger, tokio::task::JoinHandle<()>) {
    let (stop, stopped) = shutdown::channel();
    let controller = tokio::spawn(run_controller(
        client(cluster),
        client(cluster),
        Settings {
            namespace: Some(NS.into()),
            identity: "replica-a".into(),
            concurrency: 4,
            event_window: EVENT_WINDOW,
            progress_hold: PROGRESS_HOLD,
            // The fake serves genswap objects only; the inboxes are
            // tested against the real API server (tests/inbox_apiserver.rs).
            inbox_namespace: None,
            prometheus: None,
        },
        metrics.clone(),
        leadership.clone(),
        readiness.clone(),
        stopped.wait(),
    ));
    (stop, controller)
}

/// Fires `stop` and waits for the controller to return.
async fn stop_and_join(stop: shutdown::Trigger, controller: tokio::task::JoinHandle<()>) {
    stop.fire();
    tokio::time::timeout(DEADLINE, controller)
        .await
        .expect("the controller stops on shutdown")
        .expect("controller task joined");
}

#[tokio::test]
async fn a_lagging_attempt_watch_never_gets_a_node_a_second_attempt() {
    let cluster: Shared = seeded();
    let metrics = Arc::new(Metrics::new());
    let leadership = Leadership::follower(metrics.clone());
    leadership.set(true);
    // The attempt watch lags from the start: the controller's create comes
    // back on the IG watch (its status write) long before on this one.
    lock(&cluster).hold_watch(Kind::Attempt);
    let (stop, controller) = start(&cluster, &metrics, &leadership, &Readiness::default());

    eventually("the canary attempt on n1", &cluster, DEADLINE, |c| {
        c.get(Kind::Attempt, "web-n1-1").is_some()
    })
    .await;
    // The status event of that write woke the IG again; it must wait for
    // its own create instead of planning from a cache without it, which
    // would issue n1 another attempt.
    until_metrics("a plan put off, or a second attempt", &metrics, |m| {
        sample(
            m,
            "genswap_controller_plans_deferred_total{reason=\"own_create_unseen\"}",
        ) >= 1.0
            || attempts_on(&lock(&cluster), "n1").len() > 1
    })
    .await;
    assert_eq!(attempts_on(&lock(&cluster), "n1"), ["web-n1-1"]);

    // The watch catches up and the canary reports done: the next revision
    // goes to n2, and n1 still has exactly the one attempt.
    lock(&cluster).release_watch(Kind::Attempt);
    lock(&cluster).report_done("web-n1-1", 1);
    eventually("the attempt on n2", &cluster, DEADLINE, |c| {
        c.get(Kind::Attempt, "web-n2-2").is_some()
    })
    .await;
    {
        let c = lock(&cluster);
        assert_eq!(attempts_on(&c, "n1"), ["web-n1-1"]);
        assert_eq!(attempts_on(&c, "n2"), ["web-n2-2"]);
        assert_eq!(
            c.get(Kind::Ig, "web").expect("the IG")["status"]["schedRev"],
            2,
            "one revision per attempt, none for a duplicate"
        );
    }

    stop_and_join(stop, controller).await;
}

/// How long the API server is away in the outage test.
const OUTAGE: Duration = Duration::from_secs(5 * 60);
/// How soon after its return everything must have converged.
const CONVERGENCE: Duration = Duration::from_secs(10);

// Virtual time: the minutes of outage and every backoff sleep pass at once,
// and the convergence time measured is the controller's own.
#[tokio::test(start_paused = true)]
async fn after_a_long_outage_the_controller_converges_within_seconds_of_the_server_returning() {
    let cluster = seeded();
    let metrics = Arc::new(Metrics::new());
    let leadership = Leadership::follower(metrics.clone());
    leadership.set(true);
    let (stop, controller) = start(&cluster, &metrics, &leadership, &Readiness::default());
    eventually("the canary attempt on n1", &cluster, DEADLINE, |c| {
        c.get(Kind::Attempt, "web-n1-1").is_some()
    })
    .await;

    lock(&cluster).go_down();
    tokio::time::sleep(OUTAGE).await;
    // The agent's outcome, written the moment the server is back.
    let back = tokio::time::Instant::now();
    {
        let mut c = lock(&cluster);
        c.come_back();
        c.report_done("web-n1-1", 1);
    }
    eventually(
        "the attempt on n2 after the outage",
        &cluster,
        OUTAGE,
        |c| c.get(Kind::Attempt, "web-n2-2").is_some(),
    )
    .await;
    let converged = back.elapsed();
    let requests_while_down = lock(&cluster).requests_while_down;
    eprintln!(
        "after a {OUTAGE:?} outage: next attempt issued {converged:?} after the server came back; {requests_while_down} requests while down"
    );
    assert!(
        converged <= CONVERGENCE,
        "the controller took {converged:?} to act after the server came back"
    );
    // Three watches, each trying at most once per backoff ceiling once it
    // has doubled up to it: the down server was not hammered.
    let per_watch = OUTAGE.as_millis() / genswap_runtime::watch_backoff::CEILING.as_millis() + 4;
    assert!(
        requests_while_down as u128 <= 3 * per_watch,
        "{requests_while_down} requests in {OUTAGE:?}"
    );

    stop_and_join(stop, controller).await;
}
