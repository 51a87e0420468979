//! Probes (SPEC 5.12): one try at judging one generation, of the kind its
//! spec asks for. [`crate::health`] retries them for the readiness window;
//! [`crate::engine`]'s supervisor runs them for liveness.
//!
//! | kind | healthy | where |
//! | --- | --- | --- |
//! | `httpGet` | a status from 200 to 399 | [`http_get`] |
//! | `tcpSocket` | a connect | here |
//! | `grpc` | `SERVING` | [`grpc`] |
//! | `exec` | exit 0 | [`crate::command`] |
//! | `notify` | `READY=1` from the generation's cgroup | [`crate::notify`] |
//! | `watchdog` (liveness) | a new `WATCHDOG=1` since the last try | [`crate::notify`] |
//!
//! A probe judges exactly one generation: the network kinds connect to the
//! generation's own socket, a port on 127.0.0.1 or a named listener (which
//! the schema allows only where one generation runs at a time), and exec
//! runs in the generation's own cgroup.

pub mod grpc;
pub mod http_get;

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use genswap_crds::{ListenerSpec, ProbeAction};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

use crate::command::{CommandSpec, GenerationCommands};
use crate::notify::NotifyWatch;
use crate::observation::Observation;

/// Where a network probe connects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// A unix stream socket: the generation's own, or a unix listener.
    Unix(PathBuf),
    /// A TCP address.
    Tcp(SocketAddr),
    /// A steered listener's address, reached from a source the map sends to
    /// the probed generation's socket (SPEC 6.3).
    Steered(SocketAddr, crate::steering::ProbeRoute),
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Unix(path) => write!(f, "{}", path.display()),
            Endpoint::Tcp(addr) | Endpoint::Steered(addr, _) => write!(f, "{addr}"),
        }
    }
}

/// A connected stream of either family.
pub(crate) enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
    /// Held with its steered source, which is forgotten when it drops.
    Steered {
        stream: TcpStream,
        _source: crate::steering::SteeredSource,
    },
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Unix(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tcp(s) | Stream::Steered { stream: s, .. } => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Stream::Unix(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tcp(s) | Stream::Steered { stream: s, .. } => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Unix(s) => Pin::new(s).poll_flush(cx),
            Stream::Tcp(s) | Stream::Steered { stream: s, .. } => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tcp(s) | Stream::Steered { stream: s, .. } => Pin::new(s).poll_shutdown(cx),
        }
    }
}

impl Endpoint {
    /// A listener's address as a probe reaches it: an unspecified address
    /// (`0.0.0.0`, `[::]`) is reached on loopback.
    pub fn of_listener(listener: &ListenerSpec) -> Option<Endpoint> {
        if let Some(path) = &listener.unix {
            return Some(Endpoint::Unix(PathBuf::from(path)));
        }
        let mut addr: SocketAddr = listener.tcp.as_deref()?.parse().ok()?;
        if addr.ip().is_unspecified() {
            addr.set_ip(match addr.ip() {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
            });
        }
        Some(Endpoint::Tcp(addr))
    }

    pub(crate) async fn connect(&self) -> Result<Stream, Observation> {
        let seen = |e: std::io::Error| match e.kind() {
            std::io::ErrorKind::NotFound => Observation::NoSocket,
            std::io::ErrorKind::ConnectionRefused => Observation::Refused,
            _ => Observation::Connect(e.to_string()),
        };
        match self {
            Endpoint::Unix(path) => UnixStream::connect(path)
                .await
                .map(Stream::Unix)
                .map_err(seen),
            Endpoint::Tcp(addr) => TcpStream::connect(addr)
                .await
                .map(Stream::Tcp)
                .map_err(seen),
            Endpoint::Steered(addr, route) => route
                .connect(*addr)
                .await
                .map(|(stream, source)| Stream::Steered {
                    stream,
                    _source: source,
                })
                .map_err(seen),
        }
    }
}

/// What a probe needs to know of the generation it judges.
#[derive(Clone, Debug)]
pub struct Generation {
    /// Its own socket (`GENSWAP_SOCKET`).
    pub socket: PathBuf,
    /// The instance's listeners, by name.
    pub listeners: BTreeMap<String, Endpoint>,
    /// How its commands run (exec probes), when it can run any.
    pub commands: Option<GenerationCommands>,
    /// Its `NOTIFY_SOCKET`'s messages, when it was given one.
    pub notify: Option<NotifyWatch>,
}

impl Generation {
    /// A generation known only by its own socket.
    pub fn on_socket(socket: impl Into<PathBuf>) -> Generation {
        Generation {
            socket: socket.into(),
            listeners: BTreeMap::new(),
            commands: None,
            notify: None,
        }
    }

    /// The listeners of `specs` by name, as probes reach them.
    pub fn listener_endpoints(specs: &[ListenerSpec]) -> BTreeMap<String, Endpoint> {
        specs
            .iter()
            .filter_map(|spec| Some((spec.name.clone(), Endpoint::of_listener(spec)?)))
            .collect()
    }
}

/// Why a probe cannot be made from its spec: nothing is known about the
/// build (the classifier's `stale`).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ProbeError {
    #[error("health path {path:?} is not an absolute HTTP path")]
    InvalidPath { path: String },
    #[error(
        "the probe names listener {name:?}, which the instance does not hold as a TCP or unix listener (a probe connects; a UDP listener takes none)"
    )]
    UnknownListener { name: String },
    #[error("the probe's port {port} is not from 1 to 65535")]
    InvalidPort { port: i32 },
    #[error("an exec probe needs a command")]
    EmptyCommand,
    #[error("a notify probe needs a NOTIFY_SOCKET, and the generation was given none")]
    NoNotifySocket,
    #[error("an exec probe cannot run here: the generation's commands have no cgroup")]
    NoCommandCgroup,
    #[error(
        "liveness.watchdog needs health.notify: WATCHDOG=1 arrives on the NOTIFY_SOCKET only a notify health probe gives"
    )]
    WatchdogWithoutNotify,
    #[error(
        "the health probe goes through listener {name:?}, which this node shares between generations (listenerHandover: shared): during an overlap it may reach the old generation, so it cannot judge the new one; use mode: hold, or exec, notify, the generation socket or a port only the new generation binds"
    )]
    SharedListenerInOverlap { name: String },
}

/// One probe of one generation, ready to try.
#[derive(Clone, Debug)]
pub enum Probe {
    HttpGet {
        endpoint: Endpoint,
        uri: ::http::Uri,
    },
    TcpSocket {
        addr: SocketAddr,
    },
    Grpc {
        endpoint: Endpoint,
        service: String,
    },
    Exec {
        commands: GenerationCommands,
        command: CommandSpec,
    },
    Notify(NotifyWatch),
    /// Counts as healthy once a `WATCHDOG=1` arrived after the pings the
    /// last try saw (shared by clones: one liveness loop's memory).
    Watchdog {
        watch: NotifyWatch,
        seen: std::sync::Arc<std::sync::atomic::AtomicU64>,
    },
}

impl Probe {
    /// `GET path` over a unix socket (the generation's own).
    pub fn http_on_socket(socket: &Path, path: &str) -> Result<Probe, ProbeError> {
        Ok(Probe::HttpGet {
            endpoint: Endpoint::Unix(socket.to_path_buf()),
            uri: http_get::request_uri(path)?,
        })
    }

    /// The probe `action` asks for, of `generation`.
    pub fn new(action: &ProbeAction, generation: &Generation) -> Result<Probe, ProbeError> {
        let endpoint =
            |port: Option<i32>, listener: &Option<String>| -> Result<Endpoint, ProbeError> {
                if let Some(name) = listener {
                    return generation
                        .listeners
                        .get(name)
                        .cloned()
                        .ok_or_else(|| ProbeError::UnknownListener { name: name.clone() });
                }
                match port {
                    Some(port) => Ok(Endpoint::Tcp(loopback(port)?)),
                    None => Ok(Endpoint::Unix(generation.socket.clone())),
                }
            };
        match action {
            ProbeAction::HttpGet(get) => Ok(Probe::HttpGet {
                endpoint: endpoint(get.port, &get.listener)?,
                uri: http_get::request_uri(&get.path)?,
            }),
            ProbeAction::TcpSocket(tcp) => match (tcp.port, &tcp.listener) {
                (Some(port), None) => Ok(Probe::TcpSocket {
                    addr: loopback(port)?,
                }),
                // The schema refuses it; through a listener a connect proves
                // nothing, so it is never tried.
                (_, Some(name)) => Err(ProbeError::UnknownListener { name: name.clone() }),
                (None, None) => Err(ProbeError::InvalidPort { port: 0 }),
            },
            ProbeAction::Grpc(grpc) => Ok(Probe::Grpc {
                endpoint: endpoint(grpc.port, &grpc.listener)?,
                service: grpc.service.clone(),
            }),
            ProbeAction::Exec(exec) => {
                let command = CommandSpec::new(&exec.command).ok_or(ProbeError::EmptyCommand)?;
                let commands = generation
                    .commands
                    .clone()
                    .ok_or(ProbeError::NoCommandCgroup)?;
                Ok(Probe::Exec { commands, command })
            }
            ProbeAction::Notify => generation
                .notify
                .clone()
                .map(Probe::Notify)
                .ok_or(ProbeError::NoNotifySocket),
            ProbeAction::Watchdog => generation
                .notify
                .clone()
                .map(|watch| Probe::Watchdog {
                    watch,
                    seen: Default::default(),
                })
                .ok_or(ProbeError::WatchdogWithoutNotify),
        }
    }

    /// One try, bounded by `limit`: `Ok` with what made it healthy, else
    /// what it saw.
    pub async fn check(&self, limit: Duration) -> Result<Healthy, Observation> {
        let bounded = async {
            match self {
                Probe::HttpGet { endpoint, uri } => http_get::status(endpoint, uri)
                    .await
                    .and_then(http_get::healthy_status)
                    .map(Healthy::Status),
                Probe::TcpSocket { addr } => Endpoint::Tcp(*addr)
                    .connect()
                    .await
                    .map(|_| Healthy::Connected),
                Probe::Grpc { endpoint, service } => grpc::check(endpoint, service)
                    .await
                    .map(|()| Healthy::Serving),
                Probe::Exec { commands, command } => commands
                    .probe(command, limit)
                    .await
                    .map(|()| Healthy::ExitZero),
                Probe::Notify(watch) => watch.ready_within(limit).await.map(|()| Healthy::Ready),
                Probe::Watchdog { watch, seen } => {
                    let after = seen.load(std::sync::atomic::Ordering::Relaxed);
                    let pings = watch.pinged_after(after, limit).await?;
                    seen.store(pings, std::sync::atomic::Ordering::Relaxed);
                    Ok(Healthy::Pinged)
                }
            }
        };
        // A command bounds itself: past its limit it is killed with proof,
        // which a timeout dropping its future could not wait for. A notify
        // wait bounds itself too, and then says the last STATUS= it saw:
        // a second timer of the same limit, set a moment earlier, could
        // fire first and report a hang instead.
        if matches!(
            self,
            Probe::Exec { .. } | Probe::Notify(_) | Probe::Watchdog { .. }
        ) {
            return bounded.await;
        }
        match tokio::time::timeout(limit, bounded).await {
            Ok(result) => result,
            Err(_) => Err(Observation::Hung(limit)),
        }
    }

    /// What the probe asks, for reasons: "GET / on /run/…/gen-3.sock".
    pub fn describe(&self) -> String {
        match self {
            Probe::HttpGet { endpoint, uri } => format!("{endpoint} (GET {uri})"),
            Probe::TcpSocket { addr } => format!("{addr} (TCP connect)"),
            Probe::Grpc { endpoint, service } if service.is_empty() => {
                format!("{endpoint} (grpc.health.v1 Check)")
            }
            Probe::Grpc { endpoint, service } => {
                format!("{endpoint} (grpc.health.v1 Check of {service:?})")
            }
            Probe::Exec { command, .. } => format!("exec {command}"),
            Probe::Notify(watch) => format!("{} (READY=1)", watch.path().display()),
            Probe::Watchdog { watch, .. } => format!("{} (WATCHDOG=1)", watch.path().display()),
        }
    }
}

/// Checks that `action` can be made into a probe, before anything of an
/// attempt changes: its path, port, listener and command. What only a
/// running generation has (its cgroup, its notify socket) is not checked.
pub fn check(
    action: &ProbeAction,
    listeners: &BTreeMap<String, Endpoint>,
) -> Result<(), ProbeError> {
    let listener = |name: &Option<String>| match name {
        Some(name) if !listeners.contains_key(name) => {
            Err(ProbeError::UnknownListener { name: name.clone() })
        }
        _ => Ok(()),
    };
    let port = |port: Option<i32>| port.map_or(Ok(()), |port| loopback(port).map(|_| ()));
    match action {
        ProbeAction::HttpGet(get) => {
            http_get::request_uri(&get.path)?;
            listener(&get.listener)?;
            port(get.port)
        }
        ProbeAction::TcpSocket(tcp) => match (tcp.port, &tcp.listener) {
            (Some(p), None) => port(Some(p)),
            (_, Some(name)) => Err(ProbeError::UnknownListener { name: name.clone() }),
            (None, None) => Err(ProbeError::InvalidPort { port: 0 }),
        },
        ProbeAction::Grpc(grpc) => {
            listener(&grpc.listener)?;
            port(grpc.port)
        }
        ProbeAction::Exec(exec) => CommandSpec::new(&exec.command)
            .map(|_| ())
            .ok_or(ProbeError::EmptyCommand),
        ProbeAction::Notify | ProbeAction::Watchdog => Ok(()),
    }
}

fn loopback(port: i32) -> Result<SocketAddr, ProbeError> {
    let port = u16::try_from(port)
        .ok()
        .filter(|p| *p > 0)
        .ok_or(ProbeError::InvalidPort { port })?;
    Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
}

/// What made a try healthy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Healthy {
    /// An HTTP status from 200 to 399.
    Status(u16),
    Connected,
    Serving,
    ExitZero,
    Ready,
    /// A `WATCHDOG=1` since the last try.
    Pinged,
}

impl Healthy {
    /// The HTTP status, for an `httpGet` probe.
    pub fn status(self) -> Option<u16> {
        match self {
            Healthy::Status(status) => Some(status),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hang_cut_short_by_the_deadline_outranks_only_tries_that_never_connected() {
        let cut = Observation::Hung(Duration::from_millis(1200));
        assert!(cut.outranks(Some(&Observation::NoSocket), true));
        assert!(cut.outranks(Some(&Observation::Refused), true));
        assert!(cut.outranks(Some(&Observation::Connect("reset".into())), true));
        assert!(cut.outranks(None, true));
        assert!(!cut.outranks(Some(&Observation::Status(500)), true));
        assert!(!cut.outranks(Some(&Observation::Http("closed".into())), true));
        assert!(!cut.outranks(Some(&Observation::Hung(Duration::from_secs(5))), true));
        assert!(!cut.outranks(Some(&Observation::Command("exit status 1".into())), true));
        assert!(cut.outranks(Some(&Observation::Status(500)), false));
        assert!(Observation::NoSocket.outranks(Some(&Observation::Status(500)), true));
    }

    #[test]
    fn the_last_status_text_of_a_notify_generation_is_kept() {
        let said = Observation::NotReady(Some("loading 3/10".into()));
        assert!(!Observation::NotReady(None).outranks(Some(&said), false));
        assert!(Observation::NotReady(Some("loading 4/10".into())).outranks(Some(&said), false));
        assert_eq!(
            said.to_string(),
            "no READY=1 yet; it says STATUS=loading 3/10"
        );
    }

    #[test]
    fn observations_read_as_reasons() {
        assert_eq!(
            Observation::Status(500).to_string(),
            "answered 500 Internal Server Error"
        );
        assert_eq!(Observation::Refused.to_string(), "connection refused");
        assert_eq!(
            Observation::Hung(Duration::from_secs(2)).to_string(),
            "no answer within 2s"
        );
    }

    #[test]
    fn a_listener_on_every_address_is_probed_on_loopback() {
        let spec = |tcp: &str| ListenerSpec {
            name: "web".into(),
            tcp: Some(tcp.into()),
            udp: None,
            unix: None,
            backlog: 16,
        };
        assert_eq!(
            Endpoint::of_listener(&spec("0.0.0.0:8080")),
            Some(Endpoint::Tcp("127.0.0.1:8080".parse().unwrap()))
        );
        assert_eq!(
            Endpoint::of_listener(&spec("[::]:8080")),
            Some(Endpoint::Tcp("[::1]:8080".parse().unwrap()))
        );
        assert_eq!(
            Endpoint::of_listener(&spec("10.0.0.7:53")),
            Some(Endpoint::Tcp("10.0.0.7:53".parse().unwrap()))
        );
    }
}
