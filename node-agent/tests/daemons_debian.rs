//! Stock daemons that nobody here wrote, installed from Debian's packages,
//! run and swapped unchanged: Prometheus' node exporter (Go,
//! `prometheus-node-exporter`, socket activation by `--web.systemd-socket`)
//! and lighttpd (C, `server.systemd-socket-activation`; in the foreground,
//! and left to daemonize with its pid file as `process.pidFile`). Each
//! takes the listener the agent holds, is judged by an `httpGet` through
//! it, and is swapped in hold mode twice while a client sends requests to
//! the port without pause, one connection each; lighttpd in overlap mode
//! too, on a steered listener (SPEC 6.3). They run as `nobody`, in
//! real cgroups.
//!
//! lighttpd stops gracefully at SIGINT (it finishes what it accepted), so
//! none of its requests may fail. The node exporter handles no signal: at
//! any stop signal the Go runtime exits at once and resets the one
//! connection it was answering, which no supervisor can save (the backlog
//! the agent holds keeps every connection not yet accepted). So each of
//! its swaps may lose at most the one request in flight.
//!
//! `.ci/run` installs both and sets `GENSWAP_DAEMONS=required`; elsewhere a
//! missing daemon skips its test with one line.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;
#[path = "support/tcp_client.rs"]
mod tcp_client;

use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use genswap_crds::{HealthSpec, HttpGetProbe, Mode, Outcome, StopSignal};
use node_agent::engine::Attempt;
use sha2::{Digest, Sha256};
use swap_host::SwapHost;
use tcp_client::{Load, free_port, get, listener};

/// The installed daemon, or `None` (after the skip line) when it is not
/// installed and not required.
fn installed(path: &str, package: &str) -> Option<PathBuf> {
    let path = PathBuf::from(path);
    if path.exists() {
        return Some(path);
    }
    if std::env::var("GENSWAP_DAEMONS").as_deref() == Ok("required") {
        panic!("{} is missing: apt-get install {package}", path.display());
    }
    eprintln!(
        "SKIP: {} is not installed (apt-get install {package})",
        path.display()
    );
    None
}

/// A distinct build of `binary` in the staging root: its bytes and the
/// build's name after them (trailing bytes an ELF loader ignores).
fn daemon_build(host: &SwapHost, binary: &Path, name: &str) -> testapp::Build {
    let mut bytes = std::fs::read(binary).expect("read the daemon");
    bytes.extend_from_slice(name.as_bytes());
    let path = host.staging.join(name);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o755)
        .open(&path)
        .and_then(|mut file| std::io::Write::write_all(&mut file, &bytes))
        .expect("write the build");
    testapp::Build {
        path,
        sha256: hex::encode(Sha256::digest(&bytes)),
    }
}

/// A hold attempt of `build` serving the `web` listener on `port`, judged
/// by `GET path` through it.
fn attempt(
    host: &SwapHost,
    rev: i64,
    build: &testapp::Build,
    id: &str,
    daemon: &Daemon,
    mode: Mode,
) -> Attempt {
    let mut attempt = host.attempt(rev, build, id);
    let Daemon {
        port,
        path,
        args,
        stop,
        pid_file,
        writable,
        ..
    } = daemon;
    attempt.spec.process.writable_paths =
        writable.iter().map(|p| p.display().to_string()).collect();
    attempt.spec.stop.signal = *stop;
    attempt.spec.process.pid_file = pid_file.as_ref().map(|p| p.display().to_string());
    attempt.spec.mode = mode;
    attempt.spec.listeners = vec![listener(*port)];
    attempt.spec.process.args = args.to_vec();
    attempt.spec.health = HealthSpec {
        http_get: Some(HttpGetProbe {
            path: path.to_string(),
            port: None,
            listener: Some("web".into()),
        }),
        timeout_seconds: 20,
        ..HealthSpec::default()
    };
    attempt
}

/// How a daemon is run and judged.
struct Daemon {
    binary: PathBuf,
    port: u16,
    /// What `httpGet` asks through the listener.
    path: &'static str,
    args: Vec<String>,
    stop: StopSignal,
    /// Words its answer on `/` contains.
    answers: &'static str,
    /// Requests each swap may lose: those in flight when it stops.
    may_lose_per_swap: usize,
    /// Where it writes its pid when it daemonizes (`process.pidFile`).
    pid_file: Option<PathBuf>,
    /// `process.writablePaths`: its site in the test's temp dir, which the
    /// default sandbox's private /tmp would hide.
    writable: Vec<PathBuf>,
}

/// Installs generation 1, then swaps to 2 and 3 in `mode` under load, and
/// checks what the load saw.
async fn swapped_under_load(host: &SwapHost, daemon: &Daemon, mode: Mode) {
    let (binary, port) = (&daemon.binary, daemon.port);
    let b1 = daemon_build(host, binary, "d1");
    let result = host.swap(&attempt(host, 1, &b1, "d1", daemon, mode)).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    let body = get(port).expect("the daemon answers on the held port");
    assert!(body.contains(daemon.answers), "{body}");

    let load = Load::start(port);
    let mut holds = Vec::new();
    for (rev, id) in [(2, "d2"), (3, "d3")] {
        let build = daemon_build(host, binary, id);
        let started = Instant::now();
        let result = host
            .swap(&attempt(host, rev, &build, id, daemon, mode))
            .await;
        holds.push(started.elapsed());
        assert_eq!(result.outcome, Outcome::Done, "{result:?}");
        if mode == Mode::Overlap {
            assert_eq!(
                result.listener_handover,
                Some(genswap_crds::ListenerHandover::Steered)
            );
        }
        assert_eq!(result.generation, Some(u64::try_from(rev).expect("rev")));
    }
    let (sent, failures) = load.finish();
    eprintln!(
        "{}: {sent} requests through two {} swaps ({:?}), {} failed",
        binary.display(),
        mode.as_str(),
        holds,
        failures.len()
    );
    assert!(sent > 10, "the load ran: {sent}");
    assert!(
        failures.len() <= daemon.may_lose_per_swap * holds.len(),
        "{} of {sent} failed: {failures:?}",
        failures.len()
    );
    // They bind no socket of their own: the cgroups say what runs.
    assert_eq!(
        host.generation_cgroups(),
        vec![3],
        "only the last generation runs"
    );
    host.tear_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_go_node_exporter_takes_the_listener_and_each_swap_loses_at_most_the_request_in_flight()
{
    let Some(binary) = installed(
        "/usr/bin/prometheus-node-exporter",
        "prometheus-node-exporter",
    ) else {
        return;
    };
    let host = SwapHost::new("daemon-go");
    let port = free_port();
    // Only the collectors that read /proc, so a scrape stays cheap.
    let args = [
        "--web.systemd-socket",
        "--collector.disable-defaults",
        "--collector.loadavg",
    ]
    .map(String::from);
    let daemon = Daemon {
        binary,
        port,
        path: "/metrics",
        args: args.to_vec(),
        stop: StopSignal::Term,
        answers: "Node Exporter",
        may_lose_per_swap: 1,
        pid_file: None,
        // Nothing: it only reads /proc, under the default sandbox.
        writable: Vec::new(),
    };
    swapped_under_load(&host, &daemon, Mode::Hold).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lighttpd_in_c_takes_the_listener_and_is_swapped_dropping_nothing() {
    let Some(binary) = installed("/usr/sbin/lighttpd", "lighttpd") else {
        return;
    };
    let host = SwapHost::new("daemon-c");
    let daemon = lighttpd(&host, binary, false);
    swapped_under_load(&host, &daemon, Mode::Hold).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lighttpd_left_to_daemonize_is_run_by_its_pid_file_and_swapped_dropping_nothing() {
    let Some(binary) = installed("/usr/sbin/lighttpd", "lighttpd") else {
        return;
    };
    let host = SwapHost::new("daemon-fork");
    let daemon = lighttpd(&host, binary, true);
    swapped_under_load(&host, &daemon, Mode::Hold).await;
}

/// An overlap of an unmodified C daemon on a steered listener (SPEC 6.3):
/// each new lighttpd gets a socket of its own, is judged by an httpGet
/// through the listener that reaches it and not the one serving, takes
/// new connections from the switch on, and the old one finishes what it
/// accepted at SIGINT; what was queued on its socket moves to the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lighttpd_is_overlapped_on_a_steered_listener_dropping_nothing() {
    let Some(binary) = installed("/usr/sbin/lighttpd", "lighttpd") else {
        return;
    };
    let host = SwapHost::new("daemon-c-overlap");
    let daemon = lighttpd(&host, binary, false);
    swapped_under_load(&host, &daemon, Mode::Overlap).await;
}

/// lighttpd on a fresh port with a page of its own; in the foreground
/// (`-D`), or daemonizing as its default is and writing `server.pid-file`.
fn lighttpd(host: &SwapHost, binary: PathBuf, daemonizes: bool) -> Daemon {
    let port = free_port();
    let site = host.staging.with_file_name("site");
    std::fs::create_dir_all(site.join("www")).expect("document root");
    std::fs::create_dir_all(site.join("run")).expect("pid file dir");
    std::fs::write(site.join("www/index.html"), "served by lighttpd\n").expect("a page");
    let pid_file = site.join("run/lighttpd.pid");
    let config = site.join("lighttpd.conf");
    std::fs::write(
        &config,
        format!(
            "server.document-root = \"{}\"\n\
             server.bind = \"127.0.0.1\"\n\
             server.port = {port}\n\
             server.systemd-socket-activation = \"enable\"\n\
             server.pid-file = \"{}\"\n\
             index-file.names = (\"index.html\")\n",
            site.join("www").display(),
            pid_file.display()
        ),
    )
    .expect("write the config");
    for path in [&site, &site.join("www")] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("readable");
    }
    // The daemon, as nobody, writes its pid file there.
    std::fs::set_permissions(site.join("run"), std::fs::Permissions::from_mode(0o777))
        .expect("writable");
    let mut args = vec!["-f".to_string(), config.display().to_string()];
    if !daemonizes {
        args.insert(0, "-D".into());
    }
    Daemon {
        binary,
        port,
        path: "/",
        args,
        // lighttpd's graceful shutdown; SIGTERM is its immediate one.
        stop: StopSignal::Int,
        answers: "served by lighttpd",
        may_lose_per_swap: 0,
        pid_file: daemonizes.then_some(pid_file),
        writable: vec![site],
    }
}
