//! The kill matrix (SPEC 5.7, issue 7): for every crash point of overlap
//! and hold (`node_agent::failpoint::POINTS`), a real `node-agent standalone`
//! process installs build v1, a second one starts the release to v2 and is
//! stopped dead at the point (the point pauses the engine's thread, the
//! test waits until standalone mode's state lists the attempt, then
//! SIGKILLs the process), and a third one, started without the crash
//! point, recovers. Each case asserts:
//!
//! - the release's outcome in the status file is the one SPEC 5.7 gives
//!   that point, with `executed` as proven, and the third agent logged the
//!   recovery of that attempt exactly once (none when the outcome was
//!   journaled before the kill);
//! - the end state: exactly one generation (v2) answering through
//!   `current.sock`, or none after `down`; only its cgroup, socket and
//!   processes left; the journal with no pending outcome, no attempt in
//!   flight and no temp or quarantined file (the outcome was delivered, so
//!   it is recorded once);
//! - for overlap, a client sending requests through `current.sock` from
//!   before the release to the end saw every one answered.
//!
//! An abandoned release is re-issued by the scheduler (after its 5 s
//! backoff) and runs to `done`: the end state is the same as for a release
//! that was never cut.
//!
//! The same matrix runs again with a TCP listener (SPEC 6.2) on a free
//! 127.0.0.1 port (`with_listener::*`): a client sends requests straight to
//! the port from before the release to the end, and every one is answered,
//! through holds too, even when the agent dies in a hold's gap, when only
//! the listener keeper holds the socket. After `down` the listener is still
//! open (connections wait for a build that serves). One keeper is left.
//!
//! And again with a UDP listener (`with_udp_listener::*`): a DNS-like
//! client queries the port from before the release to the end, and every
//! query is answered (in a hold's gap they wait in the socket's buffer).
//! After `down` the port is still bound.
//!
//! And again with a sidecar (`with_sidecar::*`, SPEC 5.13): the serving
//! generation ends with exactly its one sidecar, in its cgroup, reaching
//! it; every other sidecar any agent started is gone, and none ever
//! reached another generation than its own.
//!
//! A bounded subset runs in `cargo test`; the whole matrix is
//! `cargo test -p node-agent --test crash_matrix -- --ignored`.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "crash_support/mod.rs"]
mod crash_support;
#[path = "support/sidecar_report.rs"]
mod sidecar_report;
#[path = "support/swap_host.rs"]
mod swap_host;
#[path = "support/tcp_client.rs"]
mod tcp_client;
#[path = "support/udp_client.rs"]
mod udp_client;

use std::os::unix::process::ExitStatusExt;

use crash_support::{Agent, Client, Crash, Manifest, Node, quiet};
use genswap_crds::Outcome;
use node_agent::failpoint::POINTS;
use tcp_client::{Load, free_port, get};

/// What SPEC 5.7 makes of a release cut at a point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Expected {
    outcome: Outcome,
    executed: bool,
    /// The build serving in the end (an abandoned release is retried).
    serving: Option<&'static str>,
    /// Recovery (rather than the engine before the kill) decided it.
    recovered: bool,
}

fn expected(point: &str) -> Expected {
    let (outcome, executed, recovered) = match point {
        // Nothing of the build ran; the incumbent never stopped serving.
        "overlap.admitted" | "overlap.staged" | "overlap.after_admit" | "overlap.after_raise" => {
            (Outcome::Abandoned, false, true)
        }
        // The journal reached spawning: the successor may have run, and is
        // stopped; the switch never happened.
        "overlap.after_journal"
        | "overlap.after_spawn"
        | "overlap.before_health"
        | "overlap.after_health"
        | "overlap.after_settle"
        | "overlap.before_switch" => (Outcome::Abandoned, true, true),
        // The switch happened (`current.sock` first, then the steered
        // listeners): the retirement is completed, and the next agent steers
        // the listeners to the generation the link names.
        "overlap.after_link_switch"
        | "overlap.after_switch"
        | "overlap.before_retire"
        | "overlap.after_retire"
        | "overlap.before_finish" => (Outcome::Done, true, true),
        // Before the hold's stop began, or during it (the new build never
        // ran): the stop is completed and the attempt retried.
        "hold.admitted" | "hold.staged" | "hold.after_admit" | "hold.before_stop"
        | "hold.after_stop" | "hold.after_raise" => (Outcome::Abandoned, false, true),
        // The old generation is gone and the new one may have run without
        // being proven healthy.
        "hold.after_journal" | "hold.after_spawn" | "hold.before_health" => {
            (Outcome::Down, true, true)
        }
        // Proven healthy and still running.
        "hold.after_health" | "hold.after_settle" | "hold.before_switch" | "hold.after_switch"
        | "hold.before_finish" => (Outcome::Done, true, true),
        // The outcome was journaled before the kill and is delivered from
        // the journal.
        "overlap.after_finish" | "hold.after_finish" => (Outcome::Done, true, false),
        other => panic!("no expectation for crash point {other}"),
    };
    Expected {
        outcome,
        executed,
        serving: (outcome != Outcome::Down).then_some("v2"),
        recovered,
    }
}

/// The listener a case's instance has, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Listener {
    Tcp(u16),
    Udp(u16),
}

impl Listener {
    fn port(self) -> u16 {
        match self {
            Listener::Tcp(port) | Listener::Udp(port) => port,
        }
    }

    /// A client sending to it from now until finished.
    fn load(self) -> Traffic {
        match self {
            Listener::Tcp(port) => Traffic::Requests(Load::start(port)),
            Listener::Udp(port) => Traffic::Queries(udp_client::DatagramLoad::start(port)),
        }
    }
}

/// A case's listener, of `protocol` (`tcp` or `udp`), on a free port.
fn listener_of(protocol: Option<&str>) -> Option<Listener> {
    match protocol {
        Some("tcp") => Some(Listener::Tcp(free_port())),
        Some("udp") => Some(Listener::Udp(udp_client::free_udp_port())),
        _ => None,
    }
}

enum Traffic {
    Requests(Load),
    Queries(udp_client::DatagramLoad),
}

impl Traffic {
    /// Stops it; how many it sent and why each that failed failed.
    fn finish(self) -> (u64, Vec<String>) {
        match self {
            Traffic::Requests(load) => load.finish(),
            Traffic::Queries(load) => {
                let tally = load.finish();
                (tally.sent(), tally.lost)
            }
        }
    }
}

/// What a case's instance has beside its build.
#[derive(Clone, Debug, Default)]
struct Extras {
    listener: Option<Listener>,
    /// A sidecar reporting to this file.
    sidecar: Option<std::path::PathBuf>,
}

/// A manifest of `build`, with `extras`.
fn manifest(id: &str, build: &testapp::Build, mode: &'static str, extras: &Extras) -> Manifest {
    let mut manifest = Manifest::new(id, build, mode);
    manifest.listener_port = extras.listener.map(Listener::port);
    manifest.listener_udp = matches!(extras.listener, Some(Listener::Udp(_)));
    manifest.sidecar_report = extras.sidecar.clone();
    manifest
}

/// After recovery: the serving generation `serving` (if any) has exactly
/// its one sidecar, in its cgroup, reaching it; every other sidecar any
/// agent started is gone; none reached another generation than its own.
async fn assert_sidecar_follows(node: &Node, report: &std::path::Path, point: &str) {
    let serving = node.who_serves().await.map(|identity| identity.generation);
    if let Some(n) = serving {
        let cgroup = node
            .instance_cgroup()
            .join(format!("gen-{n}"))
            .join("sidecar-watcher");
        let follows = crash_support::poll_until(crash_support::DEADLINE, || {
            sidecar_report::saw_own(report, n)
                && std::fs::read_to_string(cgroup.join("cgroup.procs"))
                    .is_ok_and(|procs| procs.lines().count() == 1)
        })
        .await;
        assert!(
            follows,
            "cut at {point}: generation {n}'s sidecar reaches it; report: {:?}",
            sidecar_report::lines(report)
        );
        let procs = std::fs::read_to_string(cgroup.join("cgroup.procs")).unwrap_or_default();
        let running: Vec<u32> = procs
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        let mine = sidecar_report::starts(report, n);
        assert!(
            mine.iter().any(|l| running == [sidecar_report::pid_of(l)]),
            "cut at {point}: the sidecar in generation {n}'s cgroup is one it started: {mine:?} {running:?}"
        );
    }
    for line in sidecar_report::all_starts(report) {
        let pid = sidecar_report::pid_of(&line);
        let in_serving = serving.is_some_and(|n| {
            std::fs::read_to_string(
                node.instance_cgroup()
                    .join(format!("gen-{n}"))
                    .join("sidecar-watcher")
                    .join("cgroup.procs"),
            )
            .is_ok_and(|procs| procs.lines().any(|l| l.trim() == pid.to_string()))
        });
        assert!(
            in_serving || !swap_host::alive(pid),
            "cut at {point}: sidecar {pid} ({line}) outlived its generation or its agent"
        );
    }
    sidecar_report::assert_each_saw_only_its_own(report);
}

/// Installs v1 with a first agent and stops it gracefully.
async fn installed(
    node: &Node,
    mode: &'static str,
    extras: &Extras,
) -> (testapp::Build, testapp::Build) {
    let v1 = node.build("v1");
    let v2 = node.build("v2");
    node.write(&manifest("v1", &v1, mode, extras));
    let mut agent = node.start(Crash::No);
    let doc = node
        .status("the install to end", |doc| {
            quiet(doc) && doc.attempt(1).is_some()
        })
        .await;
    let install = doc.attempt(1).expect("the install");
    assert_eq!(install.status.outcome, Some(Outcome::Done), "{install:?}");
    agent.terminate().await;
    (v1, v2)
}

/// A restart of v1 after its SIGKILL (SPEC 5.10), cut at `point`, then
/// recovered by another agent: whatever the point, v1 serves again as a
/// newer generation, alone, and the restart is never reported as the
/// install's outcome.
async fn restart_cut_at(node: Node, point: &'static str, extras: Extras) {
    let port = extras.listener;
    let v1 = node.build("v1");
    node.write(&manifest("v1", &v1, "overlap", &extras));
    let mut agent = node.start(Crash::PauseAt(point));
    let doc = node
        .status("the install to end", |doc| {
            quiet(doc) && doc.attempt(1).is_some()
        })
        .await;
    assert_eq!(
        doc.attempt(1).and_then(|a| a.status.outcome),
        Some(Outcome::Done)
    );
    let installed = node.who_serves().await.expect("v1 serves");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(installed.pid).expect("a pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL v1");
    // From here nothing accepts until the restart: what arrives waits in
    // the listener's backlog (what v1 had accepted died with it).
    let load = port.map(Listener::load);
    agent.wait_paused(point).await;
    assert_eq!(agent.kill().signal(), Some(9), "SIGKILL ended it");

    let mut agent = node.start(Crash::No);
    agent.wait_recovered().await;
    let doc = node
        .status(
            &format!("the restart cut at {point} to be made good"),
            |doc| {
                doc.attempt(1)
                    .and_then(|a| a.status.serving.as_ref())
                    .is_some_and(|s| {
                        s.state == genswap_crds::ServingState::Running && s.restarts >= 1
                    })
            },
        )
        .await;
    let install = doc.attempt(1).expect("the install");
    assert_eq!(
        install.status.outcome,
        Some(Outcome::Done),
        "cut at {point}: {install:?}"
    );
    assert_eq!(
        doc.attempts.len(),
        1,
        "a restart is no attempt of its own: {doc:?}"
    );
    node.assert_clean(Some("v1")).await;
    let after = node.who_serves().await.expect("v1 serves again");
    assert!(
        after.generation > installed.generation,
        "cut at {point}: {after:?}"
    );
    if let Some(port) = port {
        assert_listener_served(&node, port, point, "v1", load).await;
    }
    if let Some(report) = &extras.sidecar {
        assert_sidecar_follows(&node, report, point).await;
    }
    agent.terminate().await;
}

/// Runs the release v1 → v2, cut at `point` by `crash`, then recovers with
/// a third agent and checks everything the module docs list.
async fn cut_at(point: &'static str, abort: bool, protocol: Option<&str>) {
    cut_with(point, abort, protocol, false).await;
}

/// [`cut_at`], with a sidecar when `sidecar`.
async fn cut_with(point: &'static str, abort: bool, protocol: Option<&str>, sidecar: bool) {
    let node = Node::new(&point.replace(['.', '_'], "-"));
    let extras = Extras {
        listener: listener_of(protocol),
        sidecar: sidecar.then(|| sidecar_report::report_in(&node.sidecar_dir(), "watcher")),
    };
    let port = extras.listener;
    if point.starts_with("restart.") {
        return restart_cut_at(node, point, extras).await;
    }
    let expect = expected(point);
    let mode = if point.starts_with("overlap.") {
        "overlap"
    } else {
        "hold"
    };
    let (_, v2) = installed(&node, mode, &extras).await;
    let client = (mode == "overlap").then(|| Client::start(node.current_sock()));
    // After `down` nothing serves: requests would wait until they time out.
    let load = port
        .filter(|_| expect.serving.is_some())
        .map(Listener::load);

    // The release, stopped dead at the point.
    let mut agent = node.start(if abort {
        Crash::AbortAt(point)
    } else {
        Crash::PauseAt(point)
    });
    node.write(&manifest("v2", &v2, mode, &extras));
    if abort {
        let status = agent.exited().await;
        assert_eq!(
            status.signal(),
            Some(libc_sigabrt()),
            "the agent aborted at {point}: {status}; its log:\n{}",
            agent.log_text()
        );
    } else {
        agent.wait_paused(point).await;
        node.wait_state_lists(2).await;
        let status = agent.kill();
        assert_eq!(status.signal(), Some(9), "SIGKILL ended it");
    }

    // A new agent recovers.
    let mut agent = node.start(Crash::No);
    agent.wait_recovered().await;
    let doc = node
        .status(
            &format!("the release cut at {point} to be settled"),
            |doc| {
                quiet(doc)
                    && doc.attempt_or_past(2).is_some()
                    && (expect.outcome != Outcome::Abandoned
                        || doc
                            .attempts
                            .iter()
                            .any(|a| a.sched_rev > 2 && a.status.outcome == Some(Outcome::Done)))
            },
        )
        .await;
    // Once a later attempt is done and recorded, the scheduler deletes the
    // release; the status file's history still tells what it came to.
    let release = doc.attempt_or_past(2).expect("the release");
    if expect.outcome == Outcome::Abandoned {
        assert!(
            doc.attempt(2).is_none(),
            "cut at {point}: the abandoned release is deleted once its re-issue is done: {doc:?}"
        );
    }
    assert_eq!(
        (release.status.outcome, release.status.executed),
        (Some(expect.outcome), Some(expect.executed)),
        "cut at {point}: {release:?}\nthe agent's log:\n{}",
        agent.log_text()
    );
    assert_recovered_once(&agent, &release.name, point, expect);
    // The reason names the phase the journal proves, not an earlier one.
    if matches!(
        point,
        "overlap.after_health" | "overlap.after_settle" | "overlap.before_switch"
    ) {
        let reason = release.status.reason.clone().unwrap_or_default();
        assert!(
            reason.contains("restarted in phase healthy (generation 2 had passed its health check), before the switch"),
            "cut at {point}: {reason}"
        );
    }
    node.assert_clean(expect.serving).await;
    if let Some(client) = client {
        let (sent, failures) = client.finish().await;
        assert!(sent > 0, "the client sent requests");
        assert!(
            failures.is_empty(),
            "cut at {point}: {} of {sent} requests through current.sock failed: {failures:?}",
            failures.len()
        );
    }
    if let Some(port) = port {
        match expect.serving {
            Some(build) => assert_listener_served(&node, port, point, build, load).await,
            None => {
                let open = match port {
                    Listener::Tcp(port) => {
                        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
                    }
                    Listener::Udp(port) => std::net::UdpSocket::bind(("127.0.0.1", port))
                        .is_err_and(|e| e.kind() == std::io::ErrorKind::AddrInUse),
                };
                assert!(
                    open,
                    "cut at {point}: after down the listener is still open"
                );
                assert_eq!(node.keeper_pids().len(), 1, "cut at {point}: one keeper");
            }
        }
    }
    if let Some(report) = &extras.sidecar {
        assert_sidecar_follows(&node, report, point).await;
    }
    agent.terminate().await;
}

/// Every request of `load` was answered, `build` answers on the port, and
/// one keeper holds it.
async fn assert_listener_served(
    node: &Node,
    port: Listener,
    point: &str,
    build: &str,
    load: Option<Traffic>,
) {
    if let Some(load) = load {
        let (sent, failures) = tokio::task::spawn_blocking(move || load.finish())
            .await
            .expect("the load's thread");
        assert!(sent > 0, "cut at {point}: the load ran");
        assert!(
            failures.is_empty(),
            "cut at {point}: {} of {sent} requests to the listener failed, first: {:?}",
            failures.len(),
            &failures[..failures.len().min(5)]
        );
    }
    let answer = tokio::task::spawn_blocking(move || match port {
        Listener::Tcp(port) => get(port),
        Listener::Udp(port) => udp_client::query(port).map(|build| format!("build={build}")),
    })
    .await
    .expect("a request's thread");
    assert!(
        answer
            .as_ref()
            .is_ok_and(|body| body.contains(&format!("build={build}"))),
        "cut at {point}: {answer:?}"
    );
    assert_eq!(
        node.keeper_pids().len(),
        1,
        "cut at {point}: one keeper holds the listener"
    );
}

/// The recovering agent decided the attempt once (or not at all when the
/// outcome was journaled before the kill), with the outcome the status
/// file shows.
fn assert_recovered_once(agent: &Agent, attempt: &str, point: &str, expect: Expected) {
    let lines = agent.logged("recovered an attempt left in flight");
    let mine: Vec<_> = lines
        .iter()
        .filter(|line| line["fields"]["attempt"] == attempt)
        .collect();
    if expect.recovered {
        assert_eq!(mine.len(), 1, "cut at {point}: recovery lines {lines:?}");
        assert_eq!(
            mine[0]["fields"]["outcome"],
            format!("{:?}", expect.outcome),
            "cut at {point}: {:?}",
            mine[0]
        );
    } else {
        assert!(
            mine.is_empty(),
            "cut at {point}: nothing to recover, yet {mine:?}"
        );
    }
}

fn libc_sigabrt() -> i32 {
    nix::sys::signal::Signal::SIGABRT as i32
}

/// One test per crash point, and one with a listener; `ignore`d ones run
/// with `-- --ignored`.
macro_rules! kill_matrix {
    ($($(#[$attr:meta])* $name:ident => $point:literal,)*) => {
        $(
            $(#[$attr])*
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                cut_at($point, false, None).await;
            }
        )*

        mod with_listener {
            $(
                $(#[$attr])*
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::cut_at($point, false, Some("tcp")).await;
                }
            )*
        }

        mod with_sidecar {
            $(
                $(#[$attr])*
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::cut_with($point, false, None, true).await;
                }
            )*
        }

        mod with_udp_listener {
            $(
                $(#[$attr])*
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::cut_at($point, false, Some("udp")).await;
                }
            )*
        }

        /// Every crash point has its case, and every case a point.
        #[test]
        fn the_matrix_covers_every_crash_point() {
            let mut listed = vec![$($point),*];
            listed.sort_unstable();
            let mut points = POINTS.to_vec();
            points.sort_unstable();
            assert_eq!(listed, points);
        }
    };
}

kill_matrix! {
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    restart_admitted => "restart.admitted",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    restart_staged => "restart.staged",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    restart_after_admit => "restart.after_admit",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    restart_after_raise => "restart.after_raise",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    restart_after_journal => "restart.after_journal",
    restart_after_spawn => "restart.after_spawn",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    restart_before_health => "restart.before_health",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    restart_after_health => "restart.after_health",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    restart_before_switch => "restart.before_switch",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    restart_after_link_switch => "restart.after_link_switch",
    restart_after_switch => "restart.after_switch",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    restart_before_finish => "restart.before_finish",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    restart_after_finish => "restart.after_finish",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    overlap_admitted => "overlap.admitted",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    overlap_staged => "overlap.staged",
    overlap_after_admit => "overlap.after_admit",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    overlap_after_raise => "overlap.after_raise",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    overlap_after_journal => "overlap.after_journal",
    overlap_after_spawn => "overlap.after_spawn",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    overlap_before_health => "overlap.before_health",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    overlap_after_health => "overlap.after_health",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    overlap_after_settle => "overlap.after_settle",
    overlap_before_switch => "overlap.before_switch",
    overlap_after_link_switch => "overlap.after_link_switch",
    overlap_after_switch => "overlap.after_switch",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    overlap_before_retire => "overlap.before_retire",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    overlap_after_retire => "overlap.after_retire",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    overlap_before_finish => "overlap.before_finish",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    overlap_after_finish => "overlap.after_finish",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    hold_admitted => "hold.admitted",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    hold_staged => "hold.staged",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    hold_after_admit => "hold.after_admit",
    hold_before_stop => "hold.before_stop",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    hold_after_stop => "hold.after_stop",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    hold_after_raise => "hold.after_raise",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    hold_after_journal => "hold.after_journal",
    hold_after_spawn => "hold.after_spawn",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    hold_before_health => "hold.before_health",
    hold_after_health => "hold.after_health",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    hold_after_settle => "hold.after_settle",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    hold_before_switch => "hold.before_switch",
    hold_after_switch => "hold.after_switch",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    hold_before_finish => "hold.before_finish",
    #[ignore = "the full matrix: cargo test -p node-agent --test crash_matrix -- --ignored"]
    hold_after_finish => "hold.after_finish",
}

/// The documented default: the crash point aborts the process by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborting_crash_point_after_the_switch_is_recovered_done() {
    cut_at("overlap.before_retire", true, None).await;
}

/// The hold's gap, which the bounded matrix leaves out: the incumbent is
/// stopped and no generation holds the listener, only the keeper does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_in_a_holds_gap_leaves_the_listener_open_and_served() {
    cut_at("hold.after_stop", false, Some("tcp")).await;
}

/// The same with a UDP listener: the queries sent in the gap wait in the
/// socket's buffer, which the keeper holds, and are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_in_a_holds_gap_leaves_the_udp_listener_bound_and_answered() {
    cut_at("hold.after_stop", false, Some("udp")).await;
}
