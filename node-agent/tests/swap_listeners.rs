//! Listeners the agent holds (SPEC 6.2), with a real TCP listener on a
//! free 127.0.0.1 port and a real unix listener: every generation gets them
//! by socket activation, and a client sending requests straight to them,
//! without pause and one new connection each, sees every one answered
//! through a hold and through an overlap. Real processes, real cgroups.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;
#[path = "support/tcp_client.rs"]
mod tcp_client;
#[path = "support/udp_client.rs"]
mod udp_client;

use genswap_crds::{ListenerHandover, ListenerSpec, Mode, Outcome};
use node_agent::engine::EngineConfig;
use swap_host::SwapHost;
use tcp_client::{Load, free_port, get, listener};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_and_an_overlap_with_a_held_tcp_listener_drop_nothing() {
    let host = SwapHost::new("listen-tcp");
    let port = free_port();
    let b1 = host.build("b1");
    let mut install = host.attempt(1, &b1, "b1");
    install.spec.listeners = vec![listener(port)];
    assert_eq!(host.swap(&install).await.outcome, Outcome::Done);
    let first = get(port).expect("b1 answers on the held port");
    assert!(first.contains("build=b1"), "{first}");
    let keeper = host.keeper_pids();
    assert_eq!(keeper.len(), 1, "one keeper holds the listener");
    assert!(
        holds_a_socket(keeper[0]),
        "the keeper holds a socket at fd 3"
    );

    let load = Load::start(port);
    // A hold: b1 stops before b2 starts; the port's backlog holds what
    // arrives in between.
    let b2 = host.build("b2");
    let mut hold = host.attempt(2, &b2, "b2");
    hold.spec.mode = Mode::Hold;
    hold.spec.listeners = vec![listener(port)];
    let result = host.swap(&hold).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert!(get(port).expect("b2 answers").contains("build=b2"));
    assert_eq!(
        host.keeper_pids(),
        keeper,
        "a hold hands the same socket on: the same keeper"
    );
    // An overlap: b3 gets its own socket in the port's group, and takes
    // new connections from the switch on; then b2 drains.
    let b3 = host.build("b3");
    let mut overlap = host.attempt(3, &b3, "b3");
    overlap.spec.listeners = vec![listener(port)];
    let result = host.swap(&overlap).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert_eq!(result.listener_handover, Some(ListenerHandover::Steered));
    load.finish_with_none_failed();
    assert!(get(port).expect("b3 answers").contains("build=b3"));
    let keepers = host.keeper_pids();
    assert_eq!(keepers.len(), 1, "one keeper holds the listener");
    assert!(holds_a_socket(keepers[0]), "the keeper holds b3's socket");

    // Removed: the port is closed, the keeper is gone.
    host.tear_down().await;
    assert!(get(port).is_err(), "the port closes with the instance");
    assert!(!host.keeper_cgroup().exists(), "the keeper went with it");
}

/// Whether `pid`'s fd 3 is a socket.
fn holds_a_socket(pid: u32) -> bool {
    std::fs::read_link(format!("/proc/{pid}/fd/3"))
        .is_ok_and(|target| target.to_string_lossy().starts_with("socket:"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_listener_is_held_across_generations_and_a_taken_port_refuses_the_attempt() {
    let host = SwapHost::new("listen-unix");
    let path = host.staging.with_file_name("app.sock");
    let spec = ListenerSpec {
        name: "local".into(),
        tcp: None,
        udp: None,
        unix: Some(path.display().to_string()),
        backlog: 64,
    };
    let b1 = host.build("b1");
    let mut install = host.attempt(1, &b1, "b1");
    install.spec.listeners = vec![spec.clone()];
    assert_eq!(host.swap(&install).await.outcome, Outcome::Done);
    let ask = || async { swap_host::ask(&path).await };
    assert_eq!(ask().await.map(|i| i.build), Some("b1".to_string()));
    let first_keeper = host.keeper_pids();
    // A release that adds a TCP listener: a new keeper holds both.
    let port = free_port();
    let b2 = host.build("b2");
    let mut release = host.attempt(2, &b2, "b2");
    release.spec.mode = Mode::Hold;
    release.spec.listeners = vec![spec, listener(port)];
    assert_eq!(host.swap(&release).await.outcome, Outcome::Done);
    assert_eq!(ask().await.map(|i| i.build), Some("b2".to_string()));
    assert!(get(port).is_ok_and(|body| body.contains("build=b2")));
    let second_keeper = host.keeper_pids();
    assert_eq!(second_keeper.len(), 1, "one keeper: {second_keeper:?}");
    assert_ne!(second_keeper, first_keeper, "replaced for the new set");

    // A port someone else holds: refused before the incumbent is touched.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("taken");
    let taken_port = taken.local_addr().expect("address").port();
    let before = host.who_serves().await.expect("b2 serves");
    let b3 = host.build("b3");
    let mut refused = host.attempt(3, &b3, "b3");
    refused.spec.mode = Mode::Hold;
    refused.spec.listeners = vec![listener(taken_port)];
    let result = host.swap(&refused).await;
    assert_eq!(result.outcome, Outcome::Abandoned, "{result:?}");
    assert!(!result.executed);
    swap_host::assert_says(&result.reason, &["listener web", "cannot bind"]);
    host.assert_still_serves(&before).await;
    host.tear_down().await;
    assert!(!path.exists(), "the socket file goes with the instance");
}

/// A restarted agent takes the listener back from the serving generation
/// (`pidfd_getfd`) instead of binding it again, which the kernel would
/// refuse while that generation holds it; its next hold drops nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_takes_the_listener_back_and_its_hold_drops_nothing() {
    let host = SwapHost::new("listen-restart");
    let port = free_port();
    let b1 = host.build("b1");
    let mut install = host.attempt(1, &b1, "b1");
    install.spec.listeners = vec![listener(port)];
    assert_eq!(host.swap(&install).await.outcome, Outcome::Done);
    host.engine
        .journal()
        .acknowledge(&host.instance, 1)
        .expect("acknowledge");

    let next = host.next_agent(node_agent::engine::EngineConfig::default());
    let report = next.recover().await;
    assert!(report.is_clean(), "{:?}", report.errors);
    let load = Load::start(port);
    let b2 = host.build("b2");
    let mut hold = host.attempt(2, &b2, "b2");
    hold.spec.mode = Mode::Hold;
    hold.spec.listeners = vec![listener(port)];
    let result = next
        .swap(
            &hold,
            &swap_host::OpenGate,
            &node_agent::engine::Cancel::new(),
        )
        .await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    load.finish_with_none_failed();
    assert!(get(port).expect("b2 answers").contains("build=b2"));
    // The first engine stands for an agent that died: its copy of the
    // socket stays open in this process, so closing is checked elsewhere.
    next.stop_instance(&host.instance, &genswap_crds::StopSpec::default())
        .await
        .expect("stop");
}

/// The overlap caveat (SPEC 6.2), measured: a successor shares the
/// listener from its exec, so until its health check gives up and it is
/// stopped it accepts a share of the connections and answers them as it
/// answers (here 500, for the 2 s the health check takes). Nothing is
/// refused or reset, and once the attempt has failed only the incumbent
/// answers.
/// Makes `attempt`'s build answer 500 to everything, and its health check
/// give up after 2 s.
fn answers_500_within_2s(attempt: &mut node_agent::engine::Attempt) {
    attempt.spec.health.timeout_seconds = 2;
    attempt.spec.process.env.push(genswap_crds::EnvVar {
        name: testapp::knob::STATUS.into(),
        value: "500".into(),
    });
}

/// Installs b1 on a listener, then overlaps a build that answers 500 (its
/// health check fails within 2 s) under a client's steady load. Returns
/// the release's handover, how many requests were sent, and how many the
/// failing build answered; asserts that none was refused or reset, and
/// that b1 alone answers afterwards.
async fn failing_successor_under_load(
    tag: &str,
    handover: ListenerHandover,
) -> (Option<ListenerHandover>, u64, usize) {
    let config = EngineConfig {
        listener_handover: handover,
        ..EngineConfig::default()
    };
    let host = SwapHost::with_config(tag, config);
    let port = free_port();
    let b1 = host.build("b1");
    let mut install = host.attempt(1, &b1, "b1");
    install.spec.listeners = vec![listener(port)];
    assert_eq!(host.swap(&install).await.outcome, Outcome::Done);

    let load = Load::start(port);
    let bad = host.build("bad");
    let mut release = host.attempt(2, &bad, "bad");
    release.spec.listeners = vec![listener(port)];
    answers_500_within_2s(&mut release);
    let result = host.swap(&release).await;
    assert_eq!(result.outcome, Outcome::Failed, "{result:?}");
    swap_host::assert_says(&result.reason, &["500"]);
    let (sent, failures) = load.finish();
    let (answered, broken): (Vec<_>, Vec<_>) = failures
        .iter()
        .partition(|f| f.starts_with("answered") && f.contains(" 500 "));
    assert!(
        broken.is_empty(),
        "refused or reset: {:?}",
        &broken[..broken.len().min(5)]
    );

    let after = Load::start(port);
    let b1_again = host.who_serves().await.expect("b1 serves");
    assert_eq!(b1_again.build, "b1");
    after.wait_sent(50);
    let (after_sent, failures) = after.finish();
    assert!(after_sent >= 50);
    assert_eq!(failures, Vec::<String>::new(), "only b1 answers now");
    host.tear_down().await;
    (result.listener_handover, sent, answered.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_overlap_successor_on_a_steered_listener_takes_no_connection() {
    let (handover, sent, answered) =
        failing_successor_under_load("listen-fail-steered", ListenerHandover::Steered).await;
    assert_eq!(handover, Some(ListenerHandover::Steered));
    assert!(sent > 0);
    assert_eq!(
        answered, 0,
        "the failing successor answered {answered} of {sent} requests"
    );
    eprintln!(
        "measured: steered, the failing successor answered 0 of {sent} requests in its 2 s health window"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_overlap_successor_on_a_shared_listener_answers_a_share_until_it_is_stopped() {
    let (handover, sent, answered) =
        failing_successor_under_load("listen-fail-shared", ListenerHandover::Shared).await;
    assert_eq!(handover, Some(ListenerHandover::Shared));
    assert!(
        answered > 0,
        "the failing successor took a share of the {sent} requests"
    );
    eprintln!(
        "measured: shared, the failing successor answered {answered} of {sent} requests (500) in its 2 s health window; none refused or reset"
    );
}

/// An overlap's release of `build` (answering `status`) health-checked by
/// an httpGet through the listener, on a node serving b1 on it.
async fn probed_through_the_listener(
    tag: &str,
    handover: ListenerHandover,
    status: &str,
) -> (
    SwapHost,
    genswap_crds::ListenerSpec,
    node_agent::engine::SwapResult,
) {
    let config = EngineConfig {
        listener_handover: handover,
        ..EngineConfig::default()
    };
    let host = SwapHost::with_config(tag, config);
    let port = free_port();
    let web = listener(port);
    let b1 = host.build("b1");
    let mut install = host.attempt(1, &b1, "b1");
    install.spec.listeners = vec![web.clone()];
    assert_eq!(host.swap(&install).await.outcome, Outcome::Done);

    let b2 = host.build("b2");
    let mut release = host.attempt(2, &b2, "b2");
    release.spec.listeners = vec![web.clone()];
    release.spec.health = genswap_crds::HealthSpec {
        http_get: Some(genswap_crds::HttpGetProbe {
            path: "/".into(),
            port: None,
            listener: Some(web.name.clone()),
        }),
        timeout_seconds: 2,
        ..genswap_crds::HealthSpec::default()
    };
    release.spec.process.env.push(genswap_crds::EnvVar {
        name: testapp::knob::STATUS.into(),
        value: status.into(),
    });
    let result = host.swap(&release).await;
    (host, web, result)
}

/// Through a steered listener the agent's probe reaches the successor, not
/// the incumbent answering 200 beside it: a successor answering 500 fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlap_probe_through_a_steered_listener_judges_the_successor() {
    let (host, _, result) =
        probed_through_the_listener("listen-probe-bad", ListenerHandover::Steered, "500").await;
    assert_eq!(result.outcome, Outcome::Failed, "{result:?}");
    swap_host::assert_says(&result.reason, &["500"]);
    assert_eq!(host.who_serves().await.expect("b1 serves").build, "b1");
    host.tear_down().await;

    let (host, web, result) =
        probed_through_the_listener("listen-probe-good", ListenerHandover::Steered, "200").await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    let port: u16 = web
        .tcp
        .as_deref()
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .expect("a port");
    assert!(get(port).expect("b2 answers").contains("build=b2"));
    host.tear_down().await;
}

/// Through a shared listener the probe could reach either generation: the
/// overlap is refused before anything starts, and b1 serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlap_probe_through_a_shared_listener_is_refused_before_anything_starts() {
    let (host, _, result) =
        probed_through_the_listener("listen-probe-shared", ListenerHandover::Shared, "200").await;
    assert_eq!(result.outcome, Outcome::Abandoned, "{result:?}");
    assert!(!result.executed, "nothing of b2 ran");
    swap_host::assert_says(&result.reason, &["listenerHandover: shared", "mode: hold"]);
    assert_eq!(host.who_serves().await.expect("b1 serves").build, "b1");
    host.tear_down().await;
}

/// A UDP listener (a DNS cache's, a syslog relay's) through a hold, an
/// overlap, and an overlap whose successor fails its health check, under
/// a client querying without pause from a fresh source port each time:
/// datagrams that arrive in a hold's gap wait in the socket's buffer, an
/// overlap's new generation answers only from the switch on, and the
/// failing one answers nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_udp_listener_loses_no_datagram_through_a_hold_and_an_overlap() {
    let host = SwapHost::new("listen-udp");
    let port = udp_client::free_udp_port();
    let dns = udp_client::udp_listener(port);
    let b1 = host.build("b1");
    let mut install = host.attempt(1, &b1, "b1");
    install.spec.listeners = vec![dns.clone()];
    assert_eq!(host.swap(&install).await.outcome, Outcome::Done);
    assert_eq!(udp_client::query(port).as_deref(), Ok("b1"));

    let load = udp_client::DatagramLoad::start(port);
    let b2 = host.build("b2");
    let mut hold = host.attempt(2, &b2, "b2");
    hold.spec.mode = Mode::Hold;
    hold.spec.listeners = vec![dns.clone()];
    let result = host.swap(&hold).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");

    let bad = host.build("bad");
    let mut failing = host.attempt(3, &bad, "bad");
    failing.spec.listeners = vec![dns.clone()];
    answers_500_within_2s(&mut failing);
    let result = host.swap(&failing).await;
    assert_eq!(result.outcome, Outcome::Failed, "{result:?}");
    assert_eq!(result.listener_handover, Some(ListenerHandover::Steered));

    let b3 = host.build("b3");
    let mut overlap = host.attempt(4, &b3, "b3");
    overlap.spec.listeners = vec![dns.clone()];
    let result = host.swap(&overlap).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert_eq!(result.listener_handover, Some(ListenerHandover::Steered));
    let tally = load.finish();
    eprintln!(
        "measured: {} queries through a hold, a failed and a done overlap: answered {:?}, lost {}",
        tally.sent(),
        tally.answered,
        tally.lost.len()
    );
    assert!(tally.sent() > 10, "the load ran: {tally:?}");
    assert_eq!(
        tally.lost,
        Vec::<String>::new(),
        "queries lost: {:?}",
        tally.answered
    );
    assert_eq!(
        tally.answered.get("bad"),
        None,
        "the failing build answered"
    );
    assert_eq!(udp_client::query(port).as_deref(), Ok("b3"));
    host.tear_down().await;
}
