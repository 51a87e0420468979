//! Every probe kind (SPEC 5.12) against real servers and real processes:
//! healthy, unhealthy, hanging and refused. HTTP and TCP probes ask the
//! test app bound to its own port, as a program that knows nothing of
//! genswap; gRPC asks tonic-health's own server; exec commands and notify
//! senders run in a real generation cgroup of a test subtree.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/test_app.rs"]
mod test_app;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cgroup_guard::{TestCgroupTree, eventually};
use genswap_crds::{ExecProbe, GrpcProbe, HttpGetProbe, ProbeAction, TcpSocketProbe};
use node_agent::cgroup::{Cgroup, Tier};
use node_agent::command::{CommandIdentity, GenerationCommands, command_cgroups};
use node_agent::gate::InstanceKey;
use node_agent::health::{HealthError, HealthPolicy, wait_for};
use node_agent::notify::{ENV_NOTIFY_SOCKET, NotifyWatch};
use node_agent::observation::Observation;
use node_agent::probe::{Endpoint, Generation, Healthy, Probe, ProbeError};
use node_agent::spawn::{Output, SpawnSpec, spawn};
use test_app::TestApp;

/// Generous: only failures wait this long.
const PATIENCE: Duration = Duration::from_secs(30);
/// A readiness window meant to run out.
const SHORT: Duration = Duration::from_millis(900);

/// A port nothing listens on now (bound, then released).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("its address").port()
}

fn window(timeout: Duration) -> HealthPolicy {
    HealthPolicy::with_timeout(timeout)
}

fn http_on_port(port: u16, path: &str) -> Probe {
    let action = ProbeAction::HttpGet(HttpGetProbe {
        path: path.into(),
        port: Some(i32::from(port)),
        listener: None,
    });
    Probe::new(&action, &Generation::on_socket("/nonexistent/gen-1.sock")).expect("a probe")
}

async fn last_observation(probe: &Probe, timeout: Duration) -> Observation {
    match wait_for(probe, &window(timeout), std::future::pending()).await {
        Err(HealthError::Timeout { last, .. }) => last,
        other => panic!(
            "{} was not meant to be healthy: {other:?}",
            probe.describe()
        ),
    }
}

#[tokio::test]
async fn http_get_on_a_port_the_program_binds_itself() {
    let dir = tempfile::tempdir().expect("temp dir");
    let port = free_port();
    let probe = http_on_port(port, "/healthz");
    // Refused while nothing listens.
    assert_eq!(last_observation(&probe, SHORT).await, Observation::Refused);

    let _app = TestApp::on_port(port, &[], dir.path());
    let report = wait_for(&probe, &window(PATIENCE), std::future::pending())
        .await
        .expect("healthy once it binds its port");
    assert_eq!(report.healthy, Healthy::Status(200));
}

#[tokio::test]
async fn http_get_of_a_failing_or_hanging_program_is_unhealthy() {
    let dir = tempfile::tempdir().expect("temp dir");
    let failing = free_port();
    let _failing = TestApp::on_port(failing, &[(testapp::knob::STATUS, "503")], dir.path());
    let probe = http_on_port(failing, "/");
    assert_eq!(
        last_observation(&probe, Duration::from_secs(3)).await,
        Observation::Status(503)
    );

    let hanging = free_port();
    let _hanging = TestApp::on_port(hanging, &[(testapp::knob::HANG, "1")], dir.path());
    let probe = http_on_port(hanging, "/");
    let mut policy = window(Duration::from_secs(3));
    policy.request_timeout = Duration::from_millis(400);
    match wait_for(&probe, &policy, std::future::pending()).await {
        Err(HealthError::Timeout { last, probe, .. }) => {
            assert_eq!(last, Observation::Hung(Duration::from_millis(400)));
            assert!(probe.contains(&format!("127.0.0.1:{hanging}")), "{probe}");
        }
        other => panic!("a hanging server is not healthy: {other:?}"),
    }
}

#[tokio::test]
async fn tcp_socket_is_a_connect_and_refused_without_a_listener() {
    let dir = tempfile::tempdir().expect("temp dir");
    let port = free_port();
    let action = ProbeAction::TcpSocket(TcpSocketProbe {
        port: Some(i32::from(port)),
        listener: None,
    });
    let probe = Probe::new(&action, &Generation::on_socket("/nonexistent")).expect("a probe");
    assert_eq!(last_observation(&probe, SHORT).await, Observation::Refused);
    let _app = TestApp::on_port(port, &[], dir.path());
    let report = wait_for(&probe, &window(PATIENCE), std::future::pending())
        .await
        .expect("a connect once bound");
    assert_eq!(report.healthy, Healthy::Connected);
}

#[test]
fn a_tcp_socket_probe_through_a_listener_is_never_made() {
    let mut generation = Generation::on_socket("/nonexistent");
    generation
        .listeners
        .insert("web".into(), Endpoint::Tcp("127.0.0.1:1".parse().unwrap()));
    let action = ProbeAction::TcpSocket(TcpSocketProbe {
        port: None,
        listener: Some("web".into()),
    });
    assert!(matches!(
        Probe::new(&action, &generation),
        Err(ProbeError::UnknownListener { .. })
    ));
}

/// tonic-health's server on 127.0.0.1: `service` is reported `serving`.
async fn grpc_server(service: &str, serving: bool) -> (u16, tokio::task::JoinHandle<()>) {
    use tonic_health::ServingStatus;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("address").port();
    let (reporter, service_server) = tonic_health::server::health_reporter();
    let status = if serving {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    reporter.set_service_status(service, status).await;
    let server = tokio::spawn(async move {
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let _ = tonic::transport::Server::builder()
            .add_service(service_server)
            .serve_with_incoming(incoming)
            .await;
        drop(reporter);
    });
    (port, server)
}

fn grpc_probe(port: u16, service: &str) -> Probe {
    let action = ProbeAction::Grpc(GrpcProbe {
        port: Some(i32::from(port)),
        listener: None,
        service: service.into(),
    });
    Probe::new(&action, &Generation::on_socket("/nonexistent")).expect("a probe")
}

#[tokio::test]
async fn grpc_asks_the_health_service_and_only_serving_is_healthy() {
    let (port, server) = grpc_server("app.v1.Api", true).await;
    let report = wait_for(
        &grpc_probe(port, "app.v1.Api"),
        &window(PATIENCE),
        std::future::pending(),
    )
    .await
    .expect("SERVING is healthy");
    assert_eq!(report.healthy, Healthy::Serving);
    // A service the server does not know is a failed call, not healthy.
    let unknown = last_observation(&grpc_probe(port, "other.v1.Api"), SHORT).await;
    assert!(
        matches!(&unknown, Observation::Grpc(said) if said.contains("NotFound")),
        "{unknown}"
    );
    server.abort();

    let (port, server) = grpc_server("app.v1.Api", false).await;
    let not_serving = last_observation(&grpc_probe(port, "app.v1.Api"), SHORT).await;
    assert_eq!(
        not_serving,
        Observation::Grpc("answered NOT_SERVING".into())
    );
    server.abort();
}

#[tokio::test]
async fn grpc_of_a_server_that_never_answers_hangs_and_of_none_is_refused() {
    let refused = last_observation(&grpc_probe(free_port(), ""), SHORT).await;
    assert_eq!(refused, Observation::Refused);

    // Accepts and never speaks HTTP/2.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = silent.local_addr().expect("address").port();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    let mut policy = window(Duration::from_secs(2));
    policy.request_timeout = Duration::from_millis(300);
    match wait_for(&grpc_probe(port, ""), &policy, std::future::pending()).await {
        Err(HealthError::Timeout { last, .. }) => {
            assert_eq!(last, Observation::Hung(Duration::from_millis(300)));
        }
        other => panic!("a silent server is not healthy: {other:?}"),
    }
    holder.abort();
}

fn key() -> InstanceKey {
    InstanceKey::new("default", "probe").expect("a valid key")
}

async fn generation_cgroup(tree: &TestCgroupTree) -> Cgroup {
    tree.manager()
        .instance(&key())
        .expect("instance")
        .create_generation(1, &Tier::default())
        .await
        .expect("a fresh generation cgroup")
}

fn commands_of(cgroup: &Cgroup, tree: &TestCgroupTree, dir: &Path) -> GenerationCommands {
    GenerationCommands::new(
        cgroup.clone(),
        Some(tree.mount()),
        dir.join("gen-1.sock"),
        1,
        "probe-build",
        CommandIdentity {
            env: vec![("PROBE_DIR".into(), dir.display().to_string())],
            working_dir: Some(dir.to_path_buf()),
            allow_root: true,
            ..CommandIdentity::default()
        },
    )
}

fn exec_probe(commands: &GenerationCommands, script: &str) -> Probe {
    let action = ProbeAction::Exec(ExecProbe {
        command: vec!["sh".into(), "-c".into(), script.into()],
    });
    let generation = Generation {
        commands: Some(commands.clone()),
        ..Generation::on_socket("/nonexistent")
    };
    Probe::new(&action, &generation).expect("a probe")
}

/// Whether `pid` runs: a zombie has exited (it only waits for its new
/// parent, init, to reap it).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X')),
        Err(_) => false,
    }
}

fn read_pid(path: &Path) -> i32 {
    std::fs::read_to_string(path)
        .expect("the command wrote its pid")
        .trim()
        .parse()
        .expect("a pid")
}

#[tokio::test]
async fn exec_runs_in_its_generation_cgroup_with_its_environment() {
    let tree = TestCgroupTree::new("probe-exec");
    let dir = tempfile::tempdir().expect("temp dir");
    let cgroup = generation_cgroup(&tree).await;
    let commands = commands_of(&cgroup, &tree, dir.path());
    let probe = exec_probe(
        &commands,
        r#"cat /proc/self/cgroup > "$PROBE_DIR/cgroup"; echo "$GENSWAP_GENERATION $GENSWAP_SOCKET" > "$PROBE_DIR/env""#,
    );
    let report = wait_for(&probe, &window(PATIENCE), std::future::pending())
        .await
        .expect("exit 0 is healthy");
    assert_eq!(report.healthy, Healthy::ExitZero);
    let seen = std::fs::read_to_string(dir.path().join("cgroup")).expect("it wrote its cgroup");
    let v2 = seen
        .lines()
        .find(|line| line.starts_with("0::"))
        .expect("a cgroup v2 line");
    let inside = format!("0::{}/cmd-", cgroup.proc_path().expect("a /proc path"));
    assert!(v2.starts_with(&inside), "{v2} is not below {inside}");
    let env = std::fs::read_to_string(dir.path().join("env")).expect("it wrote its environment");
    assert_eq!(
        env.trim(),
        format!("1 {}", dir.path().join("gen-1.sock").display())
    );
    assert!(
        command_cgroups(cgroup.path()).is_empty(),
        "its cgroup is removed"
    );
}

#[tokio::test]
async fn exec_that_fails_says_how_and_what_it_wrote() {
    let tree = TestCgroupTree::new("probe-exec-fail");
    let dir = tempfile::tempdir().expect("temp dir");
    let cgroup = generation_cgroup(&tree).await;
    let commands = commands_of(&cgroup, &tree, dir.path());
    let probe = exec_probe(&commands, "echo database unreachable >&2; exit 3");
    let last = last_observation(&probe, SHORT).await;
    let said = last.to_string();
    assert!(said.contains("exit code 3"), "{said}");
    assert!(said.contains("database unreachable"), "{said}");
}

#[tokio::test]
async fn exec_that_hangs_is_killed_with_everything_it_forked() {
    let tree = TestCgroupTree::new("probe-exec-hang");
    let dir = tempfile::tempdir().expect("temp dir");
    let cgroup = generation_cgroup(&tree).await;
    let commands = commands_of(&cgroup, &tree, dir.path());
    let probe = exec_probe(
        &commands,
        r#"sleep 600 & echo $! > "$PROBE_DIR/child"; echo $$ > "$PROBE_DIR/main"; exec sleep 600"#,
    );
    let mut policy = window(Duration::from_secs(1));
    policy.request_timeout = Duration::from_millis(500);
    let last = match wait_for(&probe, &policy, std::future::pending()).await {
        Err(HealthError::Timeout { last, .. }) => last,
        other => panic!("a hanging command is not healthy: {other:?}"),
    };
    assert!(last.to_string().contains("it was killed"), "{last}");
    let (main, child) = (
        read_pid(&dir.path().join("main")),
        read_pid(&dir.path().join("child")),
    );
    assert!(!alive(main), "the command {main} is gone");
    assert!(!alive(child), "what it forked ({child}) is gone");
    assert!(
        command_cgroups(cgroup.path()).is_empty(),
        "no command cgroup is left"
    );
    assert!(!cgroup.is_populated().expect("cgroup.events"));
}

#[tokio::test]
async fn an_exec_probe_abandoned_mid_run_leaves_no_process() {
    let tree = TestCgroupTree::new("probe-exec-drop");
    let dir = tempfile::tempdir().expect("temp dir");
    let cgroup = generation_cgroup(&tree).await;
    let commands = commands_of(&cgroup, &tree, dir.path());
    let probe = exec_probe(&commands, r#"echo $$ > "$PROBE_DIR/main"; exec sleep 600"#);
    let pid_file = dir.path().join("main");
    {
        let try_once = probe.check(Duration::from_secs(600));
        tokio::pin!(try_once);
        tokio::select! {
            _ = &mut try_once => panic!("the command cannot end by itself"),
            () = eventually(PATIENCE, "the command to start", || pid_file.exists()) => {}
        }
        // Dropped here, as a cancelled attempt drops its health step.
    }
    let main = read_pid(&pid_file);
    eventually(PATIENCE, "the abandoned command to be killed", || {
        !alive(main)
    })
    .await;
    eventually(PATIENCE, "its cgroup to be removed", || {
        command_cgroups(cgroup.path()).is_empty()
    })
    .await;
}

/// The test app, spawned into `cgroup` with its own `NOTIFY_SOCKET`.
async fn notify_app(
    cgroup: &Cgroup,
    dir: &Path,
    watch: &NotifyWatch,
    notify: &str,
) -> node_agent::spawn::Spawned {
    let binary = testapp::binary().expect("the test app is built");
    let mut spec = SpawnSpec::new(binary, cgroup.clone(), dir.join("gen-1.sock"), 1, "b");
    spec.allow_root = true;
    spec.env = vec![
        (ENV_NOTIFY_SOCKET.into(), watch.path().display().to_string()),
        (testapp::knob::NOTIFY.into(), notify.into()),
    ];
    spec.stdout = Output::Null;
    spec.stderr = Output::Null;
    spawn(spec).await.expect("spawn the test app")
}

fn notify_probe(watch: &NotifyWatch) -> Probe {
    let generation = Generation {
        notify: Some(watch.clone()),
        ..Generation::on_socket("/nonexistent")
    };
    Probe::new(&ProbeAction::Notify, &generation).expect("a probe")
}

#[tokio::test]
async fn notify_is_ready_at_ready_1_from_the_generation() {
    let tree = TestCgroupTree::new("probe-notify");
    let dir = tempfile::tempdir().expect("temp dir");
    let cgroup = generation_cgroup(&tree).await;
    let path: PathBuf = dir.path().join("gen-1.notify");
    let watch = NotifyWatch::bind(&path, &cgroup, (None, None)).expect("bind");
    let _app = notify_app(&cgroup, dir.path(), &watch, "ready").await;
    let report = wait_for(
        &notify_probe(&watch),
        &window(PATIENCE),
        std::future::pending(),
    )
    .await
    .expect("READY=1 is healthy");
    assert_eq!(report.healthy, Healthy::Ready);
    assert_eq!(watch.state().status.as_deref(), Some("serving"));
    drop(watch);
    assert!(!path.exists(), "the last watch removes its socket");
}

#[tokio::test]
async fn notify_that_never_says_ready_shows_its_status() {
    let tree = TestCgroupTree::new("probe-notify-never");
    let dir = tempfile::tempdir().expect("temp dir");
    let cgroup = generation_cgroup(&tree).await;
    let watch =
        NotifyWatch::bind(&dir.path().join("gen-1.notify"), &cgroup, (None, None)).expect("bind");
    let _app = notify_app(&cgroup, dir.path(), &watch, "never").await;
    let last = last_observation(&notify_probe(&watch), Duration::from_secs(2)).await;
    assert_eq!(last, Observation::NotReady(Some("starting".into())));
}

#[tokio::test]
async fn ready_1_from_outside_the_generation_cgroup_is_ignored() {
    let tree = TestCgroupTree::new("probe-notify-outside");
    let dir = tempfile::tempdir().expect("temp dir");
    let cgroup = generation_cgroup(&tree).await;
    let watch =
        NotifyWatch::bind(&dir.path().join("gen-1.notify"), &cgroup, (None, None)).expect("bind");
    // This test process is not in the generation's cgroup.
    let sender = std::os::unix::net::UnixDatagram::unbound().expect("a datagram socket");
    sender
        .send_to(b"READY=1\nSTATUS=forged", watch.path())
        .expect("send");
    eventually(PATIENCE, "the forged message to be read", || {
        watch.state().ignored == 1
    })
    .await;
    // Long enough for a probe attempt to complete on a loaded machine: one
    // cut short by the window's end would be all a 900 ms window saw.
    let last = last_observation(&notify_probe(&watch), Duration::from_secs(3)).await;
    assert_eq!(last, Observation::NotReady(None));
    assert!(!watch.state().ready);
}

#[test]
fn probes_name_listeners_the_instance_holds() {
    let listeners: BTreeMap<String, Endpoint> = BTreeMap::new();
    let action = ProbeAction::HttpGet(HttpGetProbe {
        path: "/".into(),
        port: None,
        listener: Some("web".into()),
    });
    assert_eq!(
        node_agent::probe::check(&action, &listeners),
        Err(ProbeError::UnknownListener { name: "web".into() })
    );
}
