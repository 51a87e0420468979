//! A real nginx in front of unix sockets (and a loopback TCP listener), as
//! its own process with its own config, pid file and temp paths in the
//! sandbox, on loopback ports.
//!
//! Each upstream gets two servers:
//! - `pooled`: an `upstream` block with a `keepalive` pool (HTTP/1.1 to the
//!   upstream, `Connection` cleared), and `proxy_next_upstream error
//!   timeout` (nginx's default, written out): a request sent on a pooled
//!   connection that the upstream closed gets an error and nginx retries it
//!   on a new connection. nginx counts a failure on a *cached* connection
//!   as not a try, so it retries even with a single server.
//! - `per-request`: `proxy_pass http://unix:<socket>:`, a new upstream
//!   connection for every request, resolved through the socket path (and
//!   so through the `current.sock` symlink) at connect time.

use std::fs;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::BenchError;
use crate::sandbox::Guarded;

/// The upstream pool's idle connections kept per worker.
pub const KEEPALIVE_POOL: usize = 32;

/// Where nginx sends requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Upstream {
    /// A unix socket path.
    Unix(PathBuf),
    /// `host:port` on loopback.
    Tcp(String),
}

impl Upstream {
    /// As an `upstream` block's `server`.
    fn server(&self) -> String {
        match self {
            Upstream::Unix(path) => format!("unix:{}", path.display()),
            Upstream::Tcp(address) => address.clone(),
        }
    }

    /// As `proxy_pass`'s target without an upstream block: resolved at
    /// each connect, a new connection per request.
    fn direct(&self) -> String {
        match self {
            Upstream::Unix(path) => format!("http://unix:{}:", path.display()),
            Upstream::Tcp(address) => format!("http://{address}"),
        }
    }
}

/// One nginx front for an upstream: the port of each server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Front {
    /// Through an upstream keepalive pool.
    pub pooled: u16,
    /// A new upstream connection per request.
    pub per_request: u16,
}

/// A running nginx.
pub struct Nginx {
    process: Guarded,
    /// One front per socket given to [`Nginx::start`], in order.
    pub fronts: Vec<Front>,
    /// Its error log.
    pub error_log: PathBuf,
}

/// The nginx binary: `$NGINX`, else `nginx` on `PATH` or in `/usr/sbin`.
pub fn binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("NGINX") {
        return Some(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join("nginx"))
        .find(|candidate| candidate.is_file())
}

/// Installs nginx from Debian packages (`nginx-light`, else `nginx`) when
/// it is absent, as the benchmark's setup.
pub fn ensure_installed() -> Result<PathBuf, BenchError> {
    if let Some(found) = binary() {
        return Ok(found);
    }
    println!("nginx is not installed: apt-get install -y nginx-light");
    let install = |package: &str| {
        Command::new("apt-get")
            .args(["install", "-y", "-q", package])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|s| s.success())
    };
    let updated = || {
        Command::new("apt-get")
            .args(["update", "-q"])
            .status()
            .is_ok_and(|s| s.success())
    };
    let _ = install("nginx-light") || (updated() && (install("nginx-light") || install("nginx")));
    binary().ok_or_else(|| {
        BenchError::Missing("nginx (apt-get install -y nginx-light, or set NGINX=<path>)".into())
    })
}

impl Nginx {
    /// Starts nginx in `dir` with a front for each of `upstreams`, and
    /// waits until every port accepts.
    pub fn start(binary: &Path, dir: &Path, upstreams: &[Upstream]) -> Result<Nginx, BenchError> {
        let setup = |what: String| move |source| BenchError::Setup { what, source };
        fs::create_dir_all(dir.join("tmp")).map_err(setup(format!("create {}", dir.display())))?;
        let mut fronts = Vec::new();
        let mut blocks = String::new();
        let mut servers = String::new();
        for (index, upstream) in upstreams.iter().enumerate() {
            let front = Front {
                pooled: free_port()?,
                per_request: free_port()?,
            };
            blocks.push_str(&format!(
                "  upstream pool{index} {{ server {}; keepalive {KEEPALIVE_POOL}; }}\n",
                upstream.server()
            ));
            servers.push_str(&format!(
                "  server {{
    listen 127.0.0.1:{pooled};
    location / {{
      proxy_pass http://pool{index};
      proxy_http_version 1.1;
      proxy_set_header Connection \"\";
      proxy_next_upstream error timeout;
    }}
  }}
  server {{
    listen 127.0.0.1:{per_request};
    location / {{
      proxy_pass {direct};
    }}
  }}
",
                pooled = front.pooled,
                per_request = front.per_request,
                direct = upstream.direct(),
            ));
            fronts.push(front);
        }
        let error_log = dir.join("error.log");
        let tmp = dir.join("tmp");
        let config = format!(
            "worker_processes 1;
pid {pid};
error_log {error_log} warn;
user {user};
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_timeout 300s;
  keepalive_requests 100000000;
  client_body_temp_path {tmp}/body;
  proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fastcgi;
  uwsgi_temp_path {tmp}/uwsgi;
  scgi_temp_path {tmp}/scgi;
{blocks}{servers}}}
",
            pid = dir.join("nginx.pid").display(),
            error_log = error_log.display(),
            user = worker_user(),
            tmp = tmp.display(),
        );
        let config_path = dir.join("nginx.conf");
        fs::write(&config_path, config)
            .map_err(setup(format!("write {}", config_path.display())))?;
        let child = Command::new(binary)
            .arg("-p")
            .arg(dir)
            .arg("-c")
            .arg(&config_path)
            .args(["-g", "daemon off;"])
            .stdin(Stdio::null())
            .spawn()
            .map_err(setup(format!("start {}", binary.display())))?;
        // SIGQUIT: nginx's graceful shutdown.
        let mut process = Guarded::new(child, Signal::SIGQUIT);
        let deadline = Instant::now() + Duration::from_secs(10);
        for front in &fronts {
            for port in [front.pooled, front.per_request] {
                while TcpStream::connect(("127.0.0.1", port)).is_err() {
                    if let Some(status) = process.exited() {
                        return Err(BenchError::Nginx(format!(
                            "nginx exited with {status}; see {}",
                            error_log.display()
                        )));
                    }
                    if Instant::now() > deadline {
                        return Err(BenchError::Nginx(format!(
                            "nginx does not listen on 127.0.0.1:{port}; see {}",
                            error_log.display()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
        Ok(Nginx {
            process,
            fronts,
            error_log,
        })
    }

    /// Lines of the error log that mention the upstream (closed pooled
    /// connections, refused connects).
    pub fn upstream_errors(&self) -> Vec<String> {
        fs::read_to_string(&self.error_log)
            .map(|log| {
                log.lines()
                    .filter(|l| l.contains("upstream"))
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Stops nginx gracefully and waits for it.
    pub fn stop(mut self) {
        let _ = self.process.stop();
    }
}

/// A loopback port free right now (the kernel picks it).
pub fn free_port() -> Result<u16, BenchError> {
    TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|source| BenchError::Setup {
            what: "find a free loopback port".into(),
            source,
        })
}

/// nginx's workers run as `nobody`, the instances' user, so they may
/// connect to the instances' sockets; the group is Debian's `nogroup`
/// where it exists.
fn worker_user() -> &'static str {
    let groups = fs::read_to_string("/etc/group").unwrap_or_default();
    if groups.lines().any(|l| l.starts_with("nogroup:")) {
        "nobody nogroup"
    } else {
        "nobody"
    }
}
