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
//! lighttpd also runs from an ordinary OS image with its tree as its root
//! (`process.root: build`): a Debian tree mmdebstrap makes of Debian's
//! packages, pushed to a real registry, its own libc and all.
//!
//! `.ci/run` installs both (and mmdebstrap) and sets
//! `GENSWAP_DAEMONS=required`; elsewhere a missing daemon skips its test
//! with one line.

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

/// This machine's apt sources, for mmdebstrap to read from stdin: the
/// deb822 files where there are any, else the one-line ones. Nothing of a
/// mirror is written here.
fn apt_sources() -> String {
    let read_all = |extension: &str| -> String {
        let mut files: Vec<PathBuf> = std::fs::read_dir("/etc/apt/sources.list.d")
            .map(|dir| {
                dir.filter_map(Result::ok)
                    .map(|entry| entry.path())
                    .filter(|path| path.extension().is_some_and(|e| e == extension))
                    .collect()
            })
            .unwrap_or_default();
        files.sort();
        files
            .iter()
            .filter_map(|path| std::fs::read_to_string(path).ok())
            .collect::<Vec<_>>()
            .join("\n")
    };
    let deb822 = read_all("sources");
    if !deb822.trim().is_empty() {
        return deb822;
    }
    let mut lines = std::fs::read_to_string("/etc/apt/sources.list").unwrap_or_default();
    lines.push('\n');
    lines.push_str(&read_all("list"));
    lines
}

/// This machine's Debian release (`VERSION_CODENAME`).
fn debian_suite() -> String {
    let release = std::fs::read_to_string("/etc/os-release").expect("/etc/os-release");
    release
        .lines()
        .find_map(|line| line.strip_prefix("VERSION_CODENAME="))
        .map(|name| name.trim_matches('"').to_string())
        .expect("a VERSION_CODENAME in /etc/os-release")
}

/// A tree of Debian's packages holding lighttpd and what it needs (its
/// own libc), made by Debian's mmdebstrap as a tar without device nodes
/// (no image layer may carry them).
fn debian_tree_with_lighttpd(mmdebstrap: &Path, dir: &Path) -> PathBuf {
    use std::io::Write;
    let tar = dir.join("debian.tar");
    let mut child = std::process::Command::new(mmdebstrap)
        .args([
            "--quiet",
            "--mode=root",
            "--variant=extract",
            "--aptopt=Apt::Install-Recommends \"false\"",
            "--include=lighttpd,sysvinit-utils",
            "--skip=output/dev",
        ])
        .arg(debian_suite())
        .arg(&tar)
        .arg("-")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("mmdebstrap");
    child
        .stdin
        .take()
        .expect("its stdin")
        .write_all(apt_sources().as_bytes())
        .expect("the apt sources");
    let output = child.wait_with_output().expect("mmdebstrap ends");
    assert!(
        output.status.success(),
        "mmdebstrap: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    tar
}

/// An image of the Debian tree with a site of its own on `port` that
/// names `name`, built by umoci and pushed as `debian/lighttpd:<name>`.
fn push_lighttpd_image(
    registry: &test_cluster::registry::Registry,
    debian: &Path,
    dir: &Path,
    name: &str,
    port: u16,
) -> String {
    let image = test_cluster::registry::Umoci::new(&dir.join(format!("image-{name}")), name);
    image.raw_layer(debian);
    let site = dir.join(format!("site-{name}"));
    std::fs::create_dir_all(site.join("etc/lighttpd")).expect("its config dir");
    std::fs::create_dir_all(site.join("srv/www")).expect("its document root");
    std::fs::write(
        site.join("etc/lighttpd/genswap.conf"),
        format!(
            "server.document-root = \"/srv/www\"\n\
             server.bind = \"127.0.0.1\"\n\
             server.port = {port}\n\
             server.systemd-socket-activation = \"enable\"\n\
             index-file.names = (\"index.html\")\n"
        ),
    )
    .expect("its config");
    std::fs::write(
        site.join("srv/www/index.html"),
        format!("served by {name}\n"),
    )
    .expect("its page");
    let layer = dir.join(format!("site-{name}.tar"));
    let tarred = std::process::Command::new("tar")
        .arg("-C")
        .arg(&site)
        .arg("-cf")
        .arg(&layer)
        .args(["etc", "srv"])
        .status()
        .expect("tar");
    assert!(tarred.success(), "tar of the site");
    image.raw_layer(&layer);
    image.config(&["--config.entrypoint", "/usr/sbin/lighttpd"]);
    registry.push(&image.layout, image.tag(), "debian/lighttpd", name, &[])
}

/// A daemon shipped as an ordinary OS image (SPEC 5.16, `process.root:
/// build`): Debian's lighttpd with Debian's libc, from a tree mmdebstrap
/// made of Debian's packages, pushed to a real registry, run with that
/// tree as its root under the default sandbox, and swapped in hold mode
/// twice while a client sends requests without pause: none fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lighttpd_from_a_debian_image_runs_in_its_tree_and_is_swapped_dropping_nothing() {
    let Some(mmdebstrap) = installed("/usr/bin/mmdebstrap", "mmdebstrap") else {
        return;
    };
    let Some(registry) =
        test_cluster::registry::Registry::start(test_cluster::registry::Access::Plain)
    else {
        return;
    };
    let settings = genswap_store::RegistrySettings {
        config: None,
        ca: None,
        insecure: vec![registry.addr.clone()],
    };
    let host = SwapHost::with_stager("daemon-in-tree", |config| config.registries = settings);
    let work = host.staging.with_file_name("images");
    std::fs::create_dir_all(&work).expect("a dir for the images");
    let debian = debian_tree_with_lighttpd(&mmdebstrap, &work);
    let port = free_port();
    let attempt = |rev: i64, name: &str| {
        let digest = push_lighttpd_image(&registry, &debian, &work, name, port);
        let mut attempt = host.attempt_of(
            rev,
            genswap_crds::BuildSpec {
                signed_by: None,
                signature: None,
                id: name.into(),
                artifact: genswap_crds::Artifact {
                    image: Some(format!(
                        "{}/debian/lighttpd:{name}@sha256:{digest}",
                        registry.addr
                    )),
                    ..genswap_crds::Artifact::default()
                },
                sha256: digest,
                entrypoint: None,
            },
        );
        attempt.spec.mode = Mode::Hold;
        attempt.spec.process.root = Some(genswap_crds::RootProfile::Build);
        attempt.spec.process.args = ["-D", "-f", "/etc/lighttpd/genswap.conf"]
            .map(String::from)
            .to_vec();
        attempt.spec.listeners = vec![listener(port)];
        attempt.spec.health = HealthSpec {
            http_get: Some(HttpGetProbe {
                path: "/".into(),
                port: None,
                listener: Some("web".into()),
            }),
            timeout_seconds: 20,
            ..HealthSpec::default()
        };
        attempt.spec.stop.signal = StopSignal::Int;
        attempt
    };
    let result = host.swap(&attempt(1, "debian-1")).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert!(
        get(port)
            .expect("it answers")
            .contains("served by debian-1")
    );

    let load = Load::start(port);
    for (rev, name) in [(2, "debian-2"), (3, "debian-3")] {
        let result = host.swap(&attempt(rev, name)).await;
        assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    }
    let (sent, failures) = load.finish();
    eprintln!(
        "lighttpd in its Debian tree: {sent} requests through two hold swaps, {} failed",
        failures.len()
    );
    assert!(sent > 10, "the load ran: {sent}");
    assert!(
        failures.is_empty(),
        "{} of {sent} failed: {failures:?}",
        failures.len()
    );
    assert!(
        get(port)
            .expect("it answers")
            .contains("served by debian-3")
    );

    // Its root is the image's tree: its site is there, the node's files
    // are not, and its lighttpd is the image's, not the node's.
    let procs = host.instance_cgroup().join("gen-3/cgroup.procs");
    let pid: u32 = std::fs::read_to_string(&procs)
        .expect("generation 3's processes")
        .lines()
        .next()
        .and_then(|line| line.parse().ok())
        .expect("lighttpd runs");
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    assert_eq!(
        std::fs::read_to_string(root.join("srv/www/index.html")).expect("its page"),
        "served by debian-3\n"
    );
    assert!(
        !root
            .join(host.staging.strip_prefix("/").expect("absolute"))
            .exists()
    );
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).expect("its exe");
    assert_eq!(exe, Path::new("/usr/sbin/lighttpd"));
    if let Ok(node) = std::fs::metadata("/usr/sbin/lighttpd") {
        use std::os::unix::fs::MetadataExt;
        let its = std::fs::metadata(root.join("usr/sbin/lighttpd")).expect("its lighttpd");
        assert_ne!((its.dev(), its.ino()), (node.dev(), node.ino()));
    }
    assert_eq!(
        host.generation_cgroups(),
        vec![3],
        "only the last generation runs"
    );
    host.tear_down().await;
}
