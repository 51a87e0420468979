//! The genswap-controller binary as a process: flags and kubeconfig, the
//! Lease, the endpoints over HTTP, the first attempt issued through a fake
//! API server over real HTTP, and a graceful exit on SIGTERM that releases
//! the Lease.

mod support;

use std::io::Write;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::cluster::{Kind, LEASE, NS, eventually, lock, seeded, serve_http};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const DEADLINE: Duration = Duration::from_secs(30);

/// Kills the controller by PID if the test ends before it exits.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
        // A failed wait says nothing of why the binary did not answer: its
        // own log does.
        if std::thread::panicking()
            && let Some(mut stderr) = self.0.stderr.take()
        {
            let mut log = String::new();
            let _ = std::io::Read::read_to_string(&mut stderr, &mut log);
            eprintln!(
                "genswap-controller's stderr ({:?}):\n{log}",
                self.0.try_wait()
            );
        }
    }
}

/// A directory of this test's own, removed when dropped.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new() -> Self {
        let unique = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let path = std::env::temp_dir().join(format!(
            "genswap-controller-test-{}-{unique}",
            std::process::id()
        ));
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A free loopback port (bound, read, released).
fn free_port() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    listener.local_addr().expect("bound address")
}

/// Status code and body of a GET, or None while nothing listens.
async fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .ok()?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await.ok()?;
    let code = raw.split_whitespace().nth(1)?.parse().ok()?;
    let body = raw.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((code, body))
}

async fn until_get(addr: SocketAddr, path: &str, what: &str, accept: impl Fn(u16, &str) -> bool) {
    let until = tokio::time::Instant::now() + DEADLINE;
    loop {
        if let Some((code, body)) = get(addr, path).await
            && accept(code, &body)
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "timed out waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn the_binary_leads_issues_serves_and_exits_cleanly_on_sigterm() {
    let cluster = seeded();
    let (api, server) = serve_http(&cluster).await;
    let dir = TempDir::new();
    let kubeconfig = dir.0.join("kubeconfig");
    let mut file = std::fs::File::create(&kubeconfig).expect("create kubeconfig");
    write!(
        file,
        "apiVersion: v1\nkind: Config\n\
         clusters:\n- name: fake\n  cluster:\n    server: http://{api}\n\
         users:\n- name: nobody\n  user: {{}}\n\
         contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: nobody\n    namespace: {NS}\n\
         current-context: fake\n"
    )
    .expect("write kubeconfig");
    drop(file);

    let metrics = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_genswap-controller"))
        .args(["--kubeconfig".as_ref(), kubeconfig.as_os_str()])
        .args([
            "--namespace",
            NS,
            "--identity",
            "replica-bin",
            "--log-format",
            "json",
        ])
        .args([
            "--lease-duration-seconds",
            "4",
            "--lease-grace-seconds",
            "2",
        ])
        .args(["--metrics-addr", &metrics.to_string()])
        .env_remove("POD_NAMESPACE")
        .env_remove("POD_NAME")
        .env_remove("GENSWAP_NAMESPACE")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start genswap-controller");
    let mut running = Running(child);

    until_get(metrics, "/healthz", "/healthz answers", |code, _| {
        code == 200
    })
    .await;
    until_get(metrics, "/readyz", "caches synced", |code, _| code == 200).await;
    eventually("the Lease is ours", &cluster, DEADLINE, |c| {
        c.lease_holder().as_deref() == Some("replica-bin")
    })
    .await;
    eventually("the canary attempt is issued", &cluster, DEADLINE, |c| {
        c.get(Kind::Attempt, "web-n1-1").is_some()
    })
    .await;
    until_get(metrics, "/metrics", "leader gauge", |code, body| {
        code == 200
            && body.contains("genswap_controller_leader 1")
            && body.contains(
                "genswap_controller_attempts_issued_total{cause=\"install\",mode=\"overlap\"} 1",
            )
    })
    .await;

    let pid = running.0.id().to_string();
    let signalled = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("run kill");
    assert!(signalled.success(), "SIGTERM delivered to {pid}");
    let until = tokio::time::Instant::now() + DEADLINE;
    let status = loop {
        if let Some(status) = running.0.try_wait().expect("poll the child") {
            break status;
        }
        assert!(tokio::time::Instant::now() < until, "no exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut logs = String::new();
    if let Some(mut stderr) = running.0.stderr.take() {
        std::io::Read::read_to_string(&mut stderr, &mut logs).expect("read logs");
    }
    assert!(
        status.success(),
        "clean exit after SIGTERM: {status}\n{logs}"
    );
    assert!(
        logs.lines().all(|line| line.starts_with('{')),
        "--log-format json writes JSON lines only:\n{logs}"
    );
    assert!(logs.contains("SIGTERM"), "the shutdown is logged:\n{logs}");
    assert_eq!(
        lock(&cluster).lease_holder(),
        None,
        "the Lease {LEASE} is released on the way out"
    );
    assert!(
        get(metrics, "/healthz").await.is_none(),
        "the endpoints are closed"
    );
    server.abort();
}
