//! A real Prometheus (Debian's `prometheus`) on loopback, scraping test
//! instances every second, for the `rollout.analysis` tests: the queries
//! run on the real engine, against samples it scraped itself.
//!
//! An instance serves on a unix socket; Prometheus scrapes TCP, so each
//! target is a [`Forwarder`]: a loopback port whose connections are
//! carried to the socket (in a cluster it scrapes a held listener, which
//! answers with the same generation).

use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::process::ChildGuard;

/// Where Prometheus is, or why the test is skipped: `None` (having printed
/// why) when it is not on PATH, unless `GENSWAP_PROMETHEUS=required`
/// (CI), which makes that a failure.
pub fn binary() -> Option<PathBuf> {
    let found = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|dir| dir.join("prometheus"))
        .find(|path| path.is_file());
    if found.is_none() {
        assert!(
            std::env::var("GENSWAP_PROMETHEUS").as_deref() != Ok("required"),
            "GENSWAP_PROMETHEUS=required and no prometheus on PATH (Debian's prometheus package)"
        );
        println!("skipped: no prometheus on PATH (Debian's prometheus package)");
    }
    found
}

/// A port free on loopback now (Prometheus cannot report the port it
/// took for `:0`).
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .unwrap_or_else(|e| panic!("a free loopback port: {e}"))
}

/// A loopback TCP port carried to a unix socket; stops when dropped.
pub struct Forwarder {
    pub address: String,
    task: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    /// Forwards each connection to `socket` (connected when it comes, so
    /// the socket may appear later).
    pub async fn start(socket: PathBuf) -> Forwarder {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("bind a forwarder: {e}"));
        let address = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("the forwarder's address: {e}"))
            .to_string();
        let task = tokio::spawn(async move {
            while let Ok((mut tcp, _)) = listener.accept().await {
                let socket = socket.clone();
                tokio::spawn(async move {
                    if let Ok(mut unix) = tokio::net::UnixStream::connect(&socket).await {
                        let _ = tokio::io::copy_bidirectional(&mut tcp, &mut unix).await;
                    }
                });
            }
        });
        Forwarder { address, task }
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Prometheus on `127.0.0.1:<port>`, its data in a dir of its own; stopped
/// by PID when dropped.
pub struct Server {
    pub url: String,
    process: ChildGuard,
    _dir: tempfile::TempDir,
}

impl Server {
    /// Starts `binary` on `port`, scraping each target (an address and
    /// its labels) every second, and waits until it has scraped each once
    /// (Prometheus is ready seconds before its first scrape: its service
    /// discovery sends the targets after a delay of its own, and a query
    /// before that finds no data).
    pub async fn start(
        binary: &Path,
        port: u16,
        targets: &[(String, Vec<(&str, &str)>)],
    ) -> Server {
        let dir = tempfile::Builder::new()
            .prefix("genswap-prometheus-")
            .tempdir()
            .unwrap_or_else(|e| panic!("a temp dir: {e}"));
        let static_configs: Vec<serde_json::Value> = targets
            .iter()
            .map(|(address, labels)| {
                let labels: serde_json::Map<String, serde_json::Value> = labels
                    .iter()
                    .map(|(k, v)| ((*k).to_string(), (*v).into()))
                    .collect();
                serde_json::json!({"targets": [address], "labels": labels})
            })
            .collect();
        // YAML is a superset of JSON: the targets go in as JSON.
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nscrape_configs:\n  - job_name: instances\n    static_configs: {}\n",
                serde_json::Value::Array(static_configs)
            ),
        )
        .unwrap_or_else(|e| panic!("write prometheus.yml: {e}"));
        let mut command = Command::new(binary);
        command
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"));
        let mut process =
            ChildGuard::spawn("prometheus", command, dir.path().join("prometheus.log"));
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            process.assert_running();
            if scraped(port).await >= targets.len() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "Prometheus not ready in 60 s:\n{}",
                process.tail(20)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Server {
            url,
            process,
            _dir: dir,
        }
    }

    /// Panics, with its log, when Prometheus exited.
    pub fn assert_running(&mut self) {
        self.process.assert_running();
    }
}

/// How many targets have an `up` sample (a scrape, whether or not the
/// target answered).
async fn scraped(port: u16) -> usize {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return 0;
    };
    let request =
        b"GET /api/v1/query?query=up HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    if stream.write_all(request).await.is_err() {
        return 0;
    }
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer).await;
    String::from_utf8_lossy(&answer)
        .matches("\"__name__\":\"up\"")
        .count()
}

/// A build that runs the test app at `server` answering `percent` % of its
/// requests with a 500 (its health check passes): a shell script at
/// `dir/name`, and its sha256. Its instance must see `server` (the host's
/// filesystem, `process.filesystem: Host`).
pub fn erroring_build(dir: &Path, server: &Path, name: &str, percent: u8) -> (PathBuf, String) {
    use sha2::Digest;
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    let script = format!(
        "#!/bin/sh\nexec {} --error-percent={percent} \"$@\"\n",
        server.display()
    );
    std::fs::write(&path, &script).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|e| panic!("make {} executable: {e}", path.display()));
    (path, hex::encode(sha2::Sha256::digest(script.as_bytes())))
}
