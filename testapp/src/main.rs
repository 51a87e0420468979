//! `genswap-testapp`: an HTTP/1.1 server on `GENSWAP_SOCKET` with failure
//! knobs. The exact behaviour is documented in the `testapp` crate docs.

mod forbidden;

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::convert::Infallible;
use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{CONNECTION, CONTENT_TYPE, HeaderName, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use nix::sys::signal::{SigHandler, Signal, signal};
use nix::unistd::{ForkResult, dup2_stderr, dup2_stdin, dup2_stdout, fork, pause};
use testapp::{BINARY_NAME, env, identity_body, knob};
use tokio::net::{TcpListener, TcpStream, UdpSocket, UnixListener, UnixStream};
use tokio::signal::unix::{SignalKind, signal as tokio_signal};
use tokio::sync::watch;
use tokio::time::{Instant, sleep, sleep_until, timeout};

const DEFAULT_DRAIN: Duration = Duration::from_millis(2000);
const DEFAULT_EXIT_CODE: i32 = 1;
/// Pause after a failed accept, so a persistent failure (EMFILE) neither
/// spins nor floods the log.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// Answers with the request counters, never counted nor failed.
const METRICS_PATH: &str = "/metrics";
/// Never answered with `TESTAPP_ERROR_PERCENT`'s 500: the health check's.
const HEALTH_PATH: &str = "/healthz";
const X_GENSWAP_BUILD: HeaderName = HeaderName::from_static("x-genswap-build");
const X_GENSWAP_GENERATION: HeaderName = HeaderName::from_static("x-genswap-generation");
const TEXT_PLAIN: HeaderValue = HeaderValue::from_static("text/plain; charset=utf-8");
const CLOSE: HeaderValue = HeaderValue::from_static("close");
/// How long a connection may sit idle after SIGTERM before it is closed.
const IDLE_GRACE: Duration = Duration::from_millis(500);

/// One lifecycle line on stderr.
macro_rules! event {
    ($($arg:tt)*) => {
        eprintln!("{}[{}]: {}", BINARY_NAME, std::process::id(), format_args!($($arg)*))
    };
}

#[derive(Debug, thiserror::Error)]
enum ConfigError {
    #[error("{name} is not set")]
    Missing { name: &'static str },
    #[error("{name}={value:?} is not {expected}")]
    Invalid {
        name: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("unknown argument {arg:?}: flags are --<knob>[=value] for the knobs {}", knob::ALL.join(", "))]
    UnknownFlag { arg: String },
}

#[derive(Debug, thiserror::Error)]
enum RunError {
    #[error("ignoring SIGTERM")]
    IgnoreSigterm(#[source] nix::Error),
    #[error("forking child {index}")]
    Fork {
        index: u32,
        #[source]
        source: nix::Error,
    },
    #[error("starting the runtime")]
    Runtime(#[source] io::Error),
    #[error("installing the SIGTERM handler")]
    SigtermHandler(#[source] io::Error),
    #[error("removing the stale file at {path}")]
    RemoveStale {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("taking the activated socket fd {fd}")]
    Activated {
        fd: i32,
        #[source]
        source: io::Error,
    },
    #[error("binding {path}")]
    Bind {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Knob values from `--flag[=value]` arguments, falling back to the environment.
struct Knobs {
    flags: HashMap<&'static str, String>,
}

impl Knobs {
    fn from_args(args: impl Iterator<Item = OsString>) -> Result<Self, ConfigError> {
        let mut flags = HashMap::new();
        for arg in args {
            let unknown = || ConfigError::UnknownFlag {
                arg: arg.to_string_lossy().into_owned(),
            };
            let text = arg.to_str().ok_or_else(unknown)?;
            let flag = text.strip_prefix("--").ok_or_else(unknown)?;
            let (flag, value) = flag.split_once('=').unwrap_or((flag, "1"));
            let name = format!("TESTAPP_{}", flag.to_ascii_uppercase().replace('-', "_"));
            let name = knob::ALL
                .into_iter()
                .find(|known| *known == name)
                .ok_or_else(unknown)?;
            flags.insert(name, value.to_string());
        }
        Ok(Knobs { flags })
    }

    /// The value of a knob; empty counts as absent.
    fn raw(&self, name: &'static str) -> Option<String> {
        self.flags
            .get(name)
            .cloned()
            .or_else(|| std::env::var(name).ok())
            .filter(|value| !value.is_empty())
    }

    fn parsed<T: FromStr>(
        &self,
        name: &'static str,
        expected: &'static str,
    ) -> Result<Option<T>, ConfigError> {
        self.raw(name)
            .map(|value| {
                value.parse().map_err(|_| ConfigError::Invalid {
                    name,
                    value,
                    expected,
                })
            })
            .transpose()
    }

    fn millis(&self, name: &'static str) -> Result<Option<Duration>, ConfigError> {
        Ok(self
            .parsed(name, "a whole number of milliseconds")?
            .map(Duration::from_millis))
    }

    fn switch(&self, name: &'static str) -> Result<bool, ConfigError> {
        match self.raw(name).as_deref() {
            None | Some("0" | "false") => Ok(false),
            Some("1" | "true") => Ok(true),
            Some(other) => Err(ConfigError::Invalid {
                name,
                value: other.to_string(),
                expected: "1, true, 0 or false",
            }),
        }
    }
}

struct Config {
    socket: PathBuf,
    build: String,
    generation: String,
    boot_delay: Option<Duration>,
    status: StatusCode,
    exit_after: Option<Duration>,
    exit_code: i32,
    exit_once: Option<std::path::PathBuf>,
    ignore_sigterm: bool,
    drain: Duration,
    fork_children: u32,
    slow: Option<Duration>,
    never_bind: bool,
    hang: bool,
    stop_after_bind: bool,
    alloc_mib: u32,
    alloc_after: Option<Duration>,
    alloc_once: Option<PathBuf>,
    port: Option<u16>,
    notify: Notify,
    daemonize: bool,
    /// The pid it was started as: a daemon's child keeps the listeners
    /// handed to its start (`LISTEN_PID` names the start).
    started_as: u32,
    pid_file: Option<PathBuf>,
    watchdog: bool,
    term_log: Option<PathBuf>,
    error_percent: u8,
}

/// What the process says on `NOTIFY_SOCKET`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Notify {
    Off,
    Ready,
    Never,
}

impl Config {
    fn load(knobs: &Knobs) -> Result<Self, ConfigError> {
        let socket = std::env::var_os(env::SOCKET)
            .filter(|value| !value.is_empty())
            .ok_or(ConfigError::Missing { name: env::SOCKET })?;
        let status = match knobs.parsed::<u16>(knob::STATUS, "an HTTP status code")? {
            None => StatusCode::OK,
            Some(code) => StatusCode::from_u16(code).map_err(|_| ConfigError::Invalid {
                name: knob::STATUS,
                value: code.to_string(),
                expected: "an HTTP status code",
            })?,
        };
        Ok(Config {
            socket: PathBuf::from(socket),
            build: identity_var(env::BUILD)?,
            generation: identity_var(env::GENERATION)?,
            boot_delay: knobs.millis(knob::BOOT_DELAY_MS)?,
            status,
            exit_after: knobs.millis(knob::EXIT_AFTER_MS)?,
            exit_code: knobs
                .parsed(knob::EXIT_CODE, "an exit code")?
                .unwrap_or(DEFAULT_EXIT_CODE),
            exit_once: knobs.raw(knob::EXIT_ONCE).map(std::path::PathBuf::from),
            ignore_sigterm: knobs.switch(knob::IGNORE_SIGTERM)?,
            drain: knobs.millis(knob::DRAIN_MS)?.unwrap_or(DEFAULT_DRAIN),
            fork_children: knobs
                .parsed(knob::FORK_CHILDREN, "a number of children")?
                .unwrap_or(0),
            slow: knobs.millis(knob::SLOW_MS)?,
            never_bind: knobs.switch(knob::NEVER_BIND)?,
            hang: knobs.switch(knob::HANG)?,
            stop_after_bind: knobs.switch(knob::STOP_AFTER_BIND)?,
            alloc_mib: knobs
                .parsed(knob::ALLOC_MB, "a number of MiB")?
                .unwrap_or(0),
            alloc_after: knobs.millis(knob::ALLOC_AFTER_MS)?,
            alloc_once: knobs.raw(knob::ALLOC_ONCE).map(PathBuf::from),
            port: knobs.parsed(knob::PORT, "a TCP port")?,
            daemonize: knobs.switch(knob::DAEMONIZE)?,
            started_as: std::process::id(),
            pid_file: knobs.raw(knob::PID_FILE).map(PathBuf::from),
            watchdog: knobs.switch(knob::WATCHDOG)?,
            term_log: knobs.raw(knob::TERM_LOG).map(PathBuf::from),
            error_percent: match knobs
                .parsed::<u8>(knob::ERROR_PERCENT, "a percentage from 0 to 100")?
            {
                None => 0,
                Some(percent) if percent <= 100 => percent,
                Some(percent) => {
                    return Err(ConfigError::Invalid {
                        name: knob::ERROR_PERCENT,
                        value: percent.to_string(),
                        expected: "a percentage from 0 to 100",
                    });
                }
            },
            notify: match knobs.raw(knob::NOTIFY).as_deref() {
                None | Some("") => Notify::Off,
                Some("ready") => Notify::Ready,
                Some("never") => Notify::Never,
                Some(other) => {
                    return Err(ConfigError::Invalid {
                        name: knob::NOTIFY,
                        value: other.to_string(),
                        expected: "ready or never",
                    });
                }
            },
        })
    }
}

/// `GENSWAP_BUILD` or `GENSWAP_GENERATION`; [`Responder::new`] checks it fits in a header.
fn identity_var(name: &'static str) -> Result<String, ConfigError> {
    let Some(value) = std::env::var_os(name) else {
        return Ok("unknown".to_string());
    };
    value.into_string().map_err(|value| ConfigError::Invalid {
        name,
        value: value.to_string_lossy().into_owned(),
        expected: "UTF-8",
    })
}

/// Everything a response needs, built once.
struct Responder {
    status: StatusCode,
    body: Bytes,
    build: HeaderValue,
    generation: HeaderValue,
    slow: Option<Duration>,
    hang: bool,
    error_percent: u64,
    /// Requests answered (`/metrics` aside), and how many with each status.
    answered: AtomicU64,
    by_status: Mutex<BTreeMap<u16, u64>>,
}

impl Responder {
    fn new(config: &Config) -> Result<Self, ConfigError> {
        let header = |name, value: &str| {
            HeaderValue::from_str(value).map_err(|_| ConfigError::Invalid {
                name,
                value: value.to_string(),
                expected: "printable ASCII",
            })
        };
        Ok(Responder {
            status: config.status,
            body: Bytes::from(identity_body(
                &config.build,
                &config.generation,
                std::process::id(),
            )),
            build: header(env::BUILD, &config.build)?,
            generation: header(env::GENERATION, &config.generation)?,
            slow: config.slow,
            hang: config.hang,
            error_percent: u64::from(config.error_percent),
            answered: AtomicU64::new(0),
            by_status: Mutex::new(BTreeMap::new()),
        })
    }

    async fn respond(&self, path: &str) -> Response<Full<Bytes>> {
        if path == METRICS_PATH {
            return self.metrics();
        }
        if self.hang {
            std::future::pending::<()>().await;
        }
        if let Some(delay) = self.slow {
            sleep(delay).await;
        }
        // N of every 100 requests, evenly spread; never the health path.
        let n = self.answered.fetch_add(1, Ordering::Relaxed);
        let fails = path != HEALTH_PATH
            && (n + 1) * self.error_percent / 100 > n * self.error_percent / 100;
        let status = if fails {
            StatusCode::INTERNAL_SERVER_ERROR
        } else {
            self.status
        };
        *self
            .by_status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(status.as_u16())
            .or_default() += 1;
        let mut response = Response::new(Full::new(self.body.clone()));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, TEXT_PLAIN);
        headers.insert(X_GENSWAP_BUILD, self.build.clone());
        headers.insert(X_GENSWAP_GENERATION, self.generation.clone());
        response
    }
}

impl Responder {
    /// Prometheus's text format: the requests answered by status code,
    /// labelled with this generation's build and number.
    fn metrics(&self) -> Response<Full<Bytes>> {
        let mut text = String::from(
            "# HELP http_requests_total Requests answered, by status code.\n# TYPE http_requests_total counter\n",
        );
        let counts = self
            .by_status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let build = self.build.to_str().unwrap_or_default();
        let generation = self.generation.to_str().unwrap_or_default();
        for (code, count) in counts {
            text.push_str(&format!(
                "http_requests_total{{build=\"{build}\",generation=\"{generation}\",code=\"{code}\"}} {count}\n"
            ));
        }
        let mut response = Response::new(Full::new(Bytes::from(text)));
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        );
        response
    }
}

fn main() {
    let started = Instant::now();
    if let Some(things) = std::env::var_os(testapp::knob::TRY) {
        forbidden::try_each(&things.to_string_lossy());
        std::process::exit(0);
    }
    if let Some(target) = std::env::var_os("GENSWAP_TARGET_SOCKET") {
        match Knobs::from_args(std::env::args_os().skip(1)) {
            Ok(knobs) => sidecar(PathBuf::from(target), &knobs, started),
            Err(err) => {
                event!("error {}", chain(&err));
                std::process::exit(2);
            }
        }
    }
    let loaded = Knobs::from_args(std::env::args_os().skip(1)).and_then(|knobs| {
        let config = Config::load(&knobs)?;
        let responder = Responder::new(&config)?;
        Ok((config, responder))
    });
    let (config, responder) = match loaded {
        Ok(loaded) => loaded,
        Err(err) => {
            event!("error {}", chain(&err));
            event!("exit code=2");
            std::process::exit(2);
        }
    };
    event!(
        "start build={} generation={} socket={}",
        config.build,
        config.generation,
        config.socket.display()
    );
    match start(config, responder, started) {
        Ok(()) => event!("exit code=0"),
        Err(err) => {
            event!("error {}", chain(&err));
            event!("exit code=1");
            std::process::exit(1);
        }
    }
}

/// The sidecar mode (see the crate docs): asks the target what it is until
/// stopped, and reports each new answer.
fn sidecar(target: PathBuf, knobs: &Knobs, started: Instant) -> ! {
    use std::io::{Read, Write as _};
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| "unset".into());
    let generation = var(env::GENERATION);
    let pid = std::process::id();
    let report = knobs.raw(knob::SIDECAR_REPORT).map(PathBuf::from);
    let exit_after = knobs.millis(knob::EXIT_AFTER_MS).ok().flatten();
    let exit_code = knobs
        .parsed::<i32>(knob::EXIT_CODE, "an exit code")
        .ok()
        .flatten()
        .unwrap_or(DEFAULT_EXIT_CODE);
    let say = |line: String| {
        println!("{line}");
        if let Some(path) = &report
            && let Ok(mut file) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
        {
            let _ = writeln!(file, "{line}");
        }
    };
    say(format!(
        "start generation={generation} target_pid={} pid={pid} socket={} listen_fds={}",
        var("GENSWAP_TARGET_PID"),
        var(env::SOCKET),
        std::env::var("LISTEN_FDS").unwrap_or_else(|_| "0".into()),
    ));
    let mut last = String::new();
    loop {
        if exit_after.is_some_and(|after| started.elapsed() >= after) {
            say(format!(
                "exit generation={generation} pid={pid} code={exit_code}"
            ));
            std::process::exit(exit_code);
        }
        if let Ok(mut stream) = std::os::unix::net::UnixStream::connect(&target) {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
            let _ =
                stream.write_all(b"GET / HTTP/1.1\r\nhost: sidecar\r\nconnection: close\r\n\r\n");
            let mut answer = String::new();
            let _ = stream.read_to_string(&mut answer);
            let body = answer
                .split_once("\r\n\r\n")
                .map(|(_, body)| body.trim().to_string())
                .unwrap_or_default();
            if !body.is_empty() && body != last {
                say(format!(
                    "saw generation={generation} pid={pid} answer={body}"
                ));
                last = body;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn start(config: Config, responder: Responder, started: Instant) -> Result<(), RunError> {
    if config.ignore_sigterm {
        ignore_sigterm().map_err(RunError::IgnoreSigterm)?;
    }
    // Before the runtime exists, so this process is single-threaded for fork.
    let mut responder = responder;
    if config.daemonize {
        daemonize()?;
        // The body names the serving process: the child now.
        responder.body = Bytes::from(identity_body(
            &config.build,
            &config.generation,
            std::process::id(),
        ));
    }
    fork_children(config.fork_children)?;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(RunError::Runtime)?
        .block_on(run(config, responder, started))
}

fn ignore_sigterm() -> nix::Result<()> {
    // SAFETY: SIG_IGN installs no handler code, so no code runs in signal context.
    unsafe { signal(Signal::SIGTERM, SigHandler::SigIgn) }.map(drop)
}

/// A classic daemon's start: the started process forks and exits 0; the
/// child leaves its session and goes on.
fn daemonize() -> Result<(), RunError> {
    // SAFETY: called before any thread or runtime exists, so the child is a
    // complete single-threaded copy in which any code may run.
    match unsafe { fork() } {
        Ok(ForkResult::Parent { child }) => {
            event!("daemonized child pid={child}");
            event!("exit code=0");
            std::process::exit(0);
        }
        Ok(ForkResult::Child) => {
            let _ = nix::unistd::setsid();
            Ok(())
        }
        Err(source) => Err(RunError::Fork { index: 0, source }),
    }
}

fn fork_children(count: u32) -> Result<(), RunError> {
    for index in 0..count {
        // SAFETY: called before any thread or runtime exists, so the child is a
        // complete single-threaded copy in which any code may run.
        match unsafe { fork() } {
            Ok(ForkResult::Parent { child }) => event!("forked child pid={child}"),
            Ok(ForkResult::Child) => sleep_forever_ignoring_sigterm(),
            Err(source) => return Err(RunError::Fork { index, source }),
        }
    }
    Ok(())
}

fn sleep_forever_ignoring_sigterm() -> ! {
    if let Err(err) = ignore_sigterm() {
        event!("error child ignoring SIGTERM: {err}");
        std::process::exit(1);
    }
    // A reader waiting for EOF on the app's stderr must not wait for these.
    if let Ok(null) = File::options().read(true).write(true).open("/dev/null") {
        let _ = dup2_stdin(&null)
            .and(dup2_stdout(&null))
            .and(dup2_stderr(&null));
    }
    loop {
        pause();
    }
}

/// Whether this process created `path` (it did not exist before).
fn first_to_create(path: &Path) -> bool {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .is_ok()
}

/// Allocates `mib` MiB, writes every byte so each page is charged to the
/// cgroup, and keeps them for the process's life.
fn allocate(mib: u32) {
    event!("allocating {mib} MiB");
    for _ in 0..mib {
        std::hint::black_box(Box::leak(vec![1u8; 1 << 20].into_boxed_slice()));
    }
    event!("allocated {mib} MiB");
}

/// Resolves on SIGTERM, or never when SIGTERM is ignored.
async fn terminated(sigterm: &mut Option<tokio::signal::unix::Signal>) {
    match sigterm {
        Some(sigterm) => {
            sigterm.recv().await;
        }
        None => std::future::pending().await,
    }
}

async fn run(config: Config, responder: Responder, started: Instant) -> Result<(), RunError> {
    let mut sigterm = if config.ignore_sigterm {
        None
    } else {
        Some(tokio_signal(SignalKind::terminate()).map_err(RunError::SigtermHandler)?)
    };
    let first_to_exit = config.exit_once.as_deref().is_none_or(first_to_create);
    if config.alloc_mib > 0 && config.alloc_once.as_deref().is_none_or(first_to_create) {
        let mib = config.alloc_mib;
        match config.alloc_after {
            None => allocate(mib),
            Some(after) => {
                tokio::spawn(async move {
                    sleep_until(started + after).await;
                    allocate(mib);
                });
            }
        }
    }
    if let Some(after) = config.exit_after.filter(|_| first_to_exit) {
        let code = config.exit_code;
        tokio::spawn(async move {
            sleep_until(started + after).await;
            event!("exit code={code} after_ms={}", after.as_millis());
            std::process::exit(code);
        });
    }
    if config.notify != Notify::Off {
        notify("STATUS=starting");
    }
    if let Some(delay) = config.boot_delay {
        tokio::select! {
            () = sleep(delay) => {}
            () = terminated(&mut sigterm) => return Ok(()),
        }
    }
    let (mut listeners, datagrams) = activated_listeners(config.started_as)?;
    if let Some(port) = config.port {
        let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let listener = TcpListener::bind(address)
            .await
            .map_err(|source| RunError::Bind {
                path: PathBuf::from(address.to_string()),
                source,
            })?;
        event!("bound port={port}");
        listeners.push(Listener::Tcp(listener));
    }
    if config.never_bind {
        event!("not binding ({})", knob::NEVER_BIND);
        if listeners.is_empty() {
            terminated(&mut sigterm).await;
            return Ok(());
        }
    } else {
        listeners.push(Listener::Unix(bind(&config.socket)?));
        event!("bound socket={}", config.socket.display());
    }
    if config.notify == Notify::Ready {
        notify("READY=1\nSTATUS=serving");
    }
    if let Some(path) = &config.pid_file {
        match std::fs::write(path, format!("{}\n", std::process::id())) {
            Ok(()) => event!("wrote pid file={}", path.display()),
            Err(error) => event!("error pid file {}: {error}", path.display()),
        }
    }
    if config.watchdog {
        start_watchdog();
    }
    if config.stop_after_bind {
        event!("stopping itself ({})", knob::STOP_AFTER_BIND);
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP);
    }
    let responder = Arc::new(responder);
    // Each connection holds a receiver: a change asks it to shut down
    // gracefully, and all receivers gone means every connection has ended.
    let (shutdown, _) = watch::channel(());
    // One accept loop per listener, all stopped together at SIGTERM.
    let (stop_accepting, _) = watch::channel(());
    let mut loops = tokio::task::JoinSet::new();
    for listener in listeners {
        loops.spawn(accept_until_stopped(
            listener,
            Arc::clone(&responder),
            shutdown.clone(),
            stop_accepting.subscribe(),
        ));
    }
    for socket in datagrams {
        loops.spawn(answer_until_stopped(
            socket,
            Arc::clone(&responder),
            stop_accepting.subscribe(),
        ));
    }
    terminated(&mut sigterm).await;
    if let Some(path) = &config.term_log {
        let logged = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|mut file| std::io::Write::write_all(&mut file, b"SIGTERM\n"));
        if let Err(error) = logged {
            event!("error term log {}: {error}", path.display());
        }
    }
    stop_accepting.send_replace(());
    while loops.join_next().await.is_some() {}
    event!("draining drain_ms={}", config.drain.as_millis());
    shutdown.send_replace(());
    let drained = timeout(config.drain, shutdown.closed()).await.is_ok();
    event!("drain finished timed_out={}", !drained);
    Ok(())
}

/// A socket this process accepts on: its own `GENSWAP_SOCKET`, or one
/// handed to it by socket activation.
enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

/// An accepted connection of either kind.
enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Listener {
    async fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Unix(listener) => listener.accept().await.map(|(s, _)| Stream::Unix(s)),
            Listener::Tcp(listener) => listener.accept().await.map(|(s, _)| Stream::Tcp(s)),
        }
    }

    /// Accepts every connection waiting on the listener without waiting for
    /// more, then closes this process's copy of it.
    fn queued(self) -> Vec<Stream> {
        // into_std keeps the listener non-blocking: accept stops at WouldBlock.
        let taken = match self {
            Listener::Unix(listener) => listener.into_std().map(|listener| {
                accept_waiting(|| {
                    let (stream, _) = listener.accept()?;
                    stream.set_nonblocking(true)?;
                    UnixStream::from_std(stream).map(Stream::Unix)
                })
            }),
            Listener::Tcp(listener) => listener.into_std().map(|listener| {
                accept_waiting(|| {
                    let (stream, _) = listener.accept()?;
                    stream.set_nonblocking(true)?;
                    TcpStream::from_std(stream).map(Stream::Tcp)
                })
            }),
        };
        taken.unwrap_or_else(|err| {
            event!("error taking the queued connections: {err}");
            Vec::new()
        })
    }
}

/// Calls `accept` until it would block: every connection waiting now.
fn accept_waiting(accept: impl Fn() -> io::Result<Stream>) -> Vec<Stream> {
    let mut queued = Vec::new();
    loop {
        match accept() {
            Ok(stream) => queued.push(stream),
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => {
                if err.kind() != io::ErrorKind::WouldBlock {
                    event!("error accepting: {err}");
                }
                return queued;
            }
        }
    }
}

/// Serves what `listener` accepts until `stop` changes, then the
/// connections already queued on it: they were made before SIGTERM (the
/// agent signals only after current.sock has moved on, and a listener it
/// holds stays open for the next generation), so they are served rather
/// than reset.
async fn accept_until_stopped(
    listener: Listener,
    responder: Arc<Responder>,
    shutdown: watch::Sender<()>,
    mut stop: watch::Receiver<()>,
) {
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(stream) => {
                    tokio::spawn(serve(stream, Arc::clone(&responder), shutdown.subscribe()));
                }
                Err(err) => {
                    event!("error accepting: {err}");
                    sleep(ACCEPT_BACKOFF).await;
                }
            },
            _ = stop.changed() => break,
        }
    }
    for stream in listener.queued() {
        tokio::spawn(serve(stream, Arc::clone(&responder), shutdown.subscribe()));
    }
}

/// Answers each datagram on `socket` with this process's identity (as a
/// DNS cache or a syslog relay answers or takes each alone) until `stop`
/// changes, then those already waiting in its buffer.
async fn answer_until_stopped(
    socket: UdpSocket,
    responder: Arc<Responder>,
    mut stop: watch::Receiver<()>,
) {
    let mut buf = [0u8; 512];
    loop {
        tokio::select! {
            received = socket.recv_from(&mut buf) => match received {
                Ok((_, peer)) => {
                    if let Err(err) = socket.send_to(&responder.body, peer).await {
                        event!("error answering a datagram: {err}");
                    }
                }
                Err(err) => {
                    event!("error receiving: {err}");
                    sleep(ACCEPT_BACKOFF).await;
                }
            },
            _ = stop.changed() => break,
        }
    }
    // Straight to the socket: tokio's try_recv_from answers WouldBlock
    // without asking the kernel while its reactor has not yet seen the
    // datagram arrive, and that one would be lost.
    let socket = match socket.into_std() {
        Ok(socket) => socket,
        Err(err) => {
            event!("error draining the datagrams: {err}");
            return;
        }
    };
    while let Ok((_, peer)) = socket.recv_from(&mut buf) {
        if let Err(err) = socket.send_to(&responder.body, peer) {
            event!("error answering a datagram: {err}");
        }
    }
}

/// The sockets systemd's socket activation hands this process
/// (`sd_listen_fds(3)`): fds 3.. when `LISTEN_PID` is this process and
/// `LISTEN_FDS` counts them, named by `LISTEN_FDNAMES`. Stream listeners
/// first, datagram sockets second.
fn activated_listeners(started_as: u32) -> Result<(Vec<Listener>, Vec<UdpSocket>), RunError> {
    let for_us = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|pid| pid.parse::<u32>().ok())
        == Some(started_as);
    if !for_us {
        return Ok((Vec::new(), Vec::new()));
    }
    let count: i32 = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let names = std::env::var("LISTEN_FDNAMES").unwrap_or_default();
    let mut names = names.split(':');
    let mut listeners = Vec::new();
    let mut datagrams = Vec::new();
    for fd in 3..3 + count.max(0) {
        let name = names.next().unwrap_or("unknown").to_owned();
        // SAFETY: the protocol hands fds 3 to 3 + LISTEN_FDS - 1 to this
        // process, open; from here this OwnedFd is their only owner.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        let activated = |source| RunError::Activated { fd, source };
        nix::fcntl::fcntl(
            &owned,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        )
        .map_err(|e| activated(e.into()))?;
        let address: nix::sys::socket::SockaddrStorage =
            nix::sys::socket::getsockname(owned.as_raw_fd()).map_err(|e| activated(e.into()))?;
        let kind = nix::sys::socket::getsockopt(&owned, nix::sys::socket::sockopt::SockType)
            .map_err(|e| activated(e.into()))?;
        if kind == nix::sys::socket::SockType::Datagram {
            let socket = std::net::UdpSocket::from(owned);
            socket.set_nonblocking(true).map_err(activated)?;
            event!("activated name={name} fd={fd} address={address} udp");
            datagrams.push(UdpSocket::from_std(socket).map_err(activated)?);
            continue;
        }
        let listener = if address.as_unix_addr().is_some() {
            let listener = std::os::unix::net::UnixListener::from(owned);
            listener.set_nonblocking(true).map_err(activated)?;
            Listener::Unix(UnixListener::from_std(listener).map_err(activated)?)
        } else {
            let listener = std::net::TcpListener::from(owned);
            listener.set_nonblocking(true).map_err(activated)?;
            Listener::Tcp(TcpListener::from_std(listener).map_err(activated)?)
        };
        event!("activated name={name} fd={fd} address={address}");
        listeners.push(listener);
    }
    Ok((listeners, datagrams))
}

/// `WATCHDOG=1` every half of `WATCHDOG_USEC`, as `sd_watchdog_enabled(3)`
/// asks; nothing without it.
fn start_watchdog() {
    let usec = std::env::var("WATCHDOG_USEC")
        .ok()
        .and_then(|value| value.parse::<u64>().ok())
        .filter(|usec| *usec > 0);
    let Some(usec) = usec else {
        event!("error no WATCHDOG_USEC for {}", knob::WATCHDOG);
        return;
    };
    let every = Duration::from_micros(usec / 2);
    tokio::spawn(async move {
        loop {
            notify("WATCHDOG=1");
            sleep(every).await;
        }
    });
}

/// One `sd_notify(3)` message to `NOTIFY_SOCKET`, from this process; a
/// missing socket is logged, as libsystemd's callers ignore it.
fn notify(message: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        event!("error no NOTIFY_SOCKET for {message:?}");
        return;
    };
    let sent = std::os::unix::net::UnixDatagram::unbound()
        .and_then(|socket| socket.send_to(message.as_bytes(), &path));
    match sent {
        Ok(_) => event!("notified {}", message.replace('\n', " ")),
        Err(error) => event!("error notify {message:?}: {error}"),
    }
}

fn bind(path: &Path) -> Result<UnixListener, RunError> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(RunError::RemoveStale {
                path: path.to_path_buf(),
                source,
            });
        }
    }
    UnixListener::bind(path).map_err(|source| RunError::Bind {
        path: path.to_path_buf(),
        source,
    })
}

async fn serve(stream: Stream, responder: Arc<Responder>, shutdown: watch::Receiver<()>) {
    match stream {
        Stream::Unix(stream) => serve_on(stream, responder, shutdown).await,
        Stream::Tcp(stream) => serve_on(stream, responder, shutdown).await,
    }
}

async fn serve_on<S>(stream: S, responder: Arc<Responder>, mut shutdown: watch::Receiver<()>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let draining = shutdown.clone();
    let service = service_fn(move |request: Request<Incoming>| {
        let responder = Arc::clone(&responder);
        let path = request.uri().path().to_string();
        // Once the drain began, every answer says the connection closes, so
        // a keep-alive client reconnects (to the next generation) after it.
        let closing = draining.has_changed().unwrap_or(true);
        async move {
            let mut response = responder.respond(&path).await;
            if closing {
                response.headers_mut().insert(CONNECTION, CLOSE);
            }
            Ok::<_, Infallible>(response)
        }
    });
    let connection = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => return,
        _ = shutdown.changed() => {}
    }
    // A connection idle at SIGTERM is not closed at once: a client may have
    // written its next request already, and closing under it would lose
    // that request. It is served (with `connection: close`) until it has
    // been left idle for IDLE_GRACE.
    tokio::select! {
        _ = connection.as_mut() => return,
        () = sleep(IDLE_GRACE) => {}
    }
    // Closes the connection now if it is between requests; otherwise the
    // request in flight finishes with `connection: close`.
    connection.as_mut().graceful_shutdown();
    // A client that went away is its own business, not a lifecycle event.
    let _ = connection.await;
    drop(shutdown);
}

/// An error and its sources, one line.
fn chain(err: &dyn std::error::Error) -> String {
    let mut line = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        line.push_str(": ");
        line.push_str(&cause.to_string());
        source = cause.source();
    }
    line
}
