//! Probes (SPEC 3.1, 5.12): how the agent judges a new generation ready
//! before the switch (`health`) and the serving one alive between attempts
//! (`liveness`), named as the kubelet names them so that a pod's probe
//! reads the same here.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// At most one probe kind in `health`; `path` counts as `httpGet`.
const HEALTH_KINDS_RULE: &str = "(has(self.path) ? 1 : 0) + (has(self.httpGet) ? 1 : 0) + (has(self.tcpSocket) ? 1 : 0) + (has(self.grpc) ? 1 : 0) + (has(self.exec) ? 1 : 0) + (has(self.notify) ? 1 : 0) <= 1";
const LIVENESS_KINDS_RULE: &str = "(has(self.httpGet) ? 1 : 0) + (has(self.tcpSocket) ? 1 : 0) + (has(self.grpc) ? 1 : 0) + (has(self.exec) ? 1 : 0) + (has(self.watchdog) && self.watchdog ? 1 : 0) == 1";
const PORT_RULE: &str = "self >= 1 && self <= 65535";

/// The readiness gate of a new generation (SPEC 5.5 step 6): at most one
/// probe kind; none at all is `httpGet` of `/` over the generation's own
/// socket.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(HEALTH_KINDS_RULE).message("health takes at most one of path, httpGet, tcpSocket, grpc, exec and notify (path is the shorthand for httpGet over the generation socket)"))]
pub struct HealthSpec {
    /// Shorthand for `httpGet: {path: ...}` over the generation's own socket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 2048))]
    #[x_kube(validation = Rule::new("self.startsWith('/')").message("health.path must start with /"))]
    pub path: Option<String>,
    /// The whole readiness window, from the exec; each try inside it is
    /// bounded too.
    #[serde(default = "thirty")]
    #[x_kube(validation = Rule::new("self > 0").message("health.timeoutSeconds must be greater than 0"))]
    pub timeout_seconds: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_get: Option<HttpGetProbe>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_socket: Option<TcpSocketProbe>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc: Option<GrpcProbe>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec: Option<ExecProbe>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notify: Option<NotifyProbe>,
}

impl Default for HealthSpec {
    fn default() -> Self {
        Self {
            path: None,
            timeout_seconds: thirty(),
            http_get: None,
            tcp_socket: None,
            grpc: None,
            exec: None,
            notify: None,
        }
    }
}

/// Which probe a `health` or `liveness` block asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbeAction {
    HttpGet(HttpGetProbe),
    TcpSocket(TcpSocketProbe),
    Grpc(GrpcProbe),
    Exec(ExecProbe),
    /// systemd's `READY=1` (health only).
    Notify,
    /// systemd's `WATCHDOG=1` within every period (liveness only).
    Watchdog,
}

impl HealthSpec {
    /// The one probe asked for; `path`, or nothing, is `httpGet` over the
    /// generation's own socket. Where the schema was bypassed and more than
    /// one is given, the first in the order of the fields wins.
    pub fn action(&self) -> ProbeAction {
        if let Some(path) = &self.path {
            return ProbeAction::HttpGet(HttpGetProbe {
                path: path.clone(),
                port: None,
                listener: None,
            });
        }
        first_action(&self.http_get, &self.tcp_socket, &self.grpc, &self.exec)
            .or(self.notify.as_ref().map(|_| ProbeAction::Notify))
            .unwrap_or_else(|| ProbeAction::HttpGet(HttpGetProbe::default()))
    }
}

impl HealthSpec {
    /// Whether the probe asks the generation's own socket (`GENSWAP_SOCKET`),
    /// which a generation healthy by it has then bound.
    pub fn asks_generation_socket(&self) -> bool {
        match self.action() {
            ProbeAction::HttpGet(get) => get.port.is_none() && get.listener.is_none(),
            ProbeAction::Grpc(grpc) => grpc.port.is_none() && grpc.listener.is_none(),
            _ => false,
        }
    }
}

fn first_action(
    http_get: &Option<HttpGetProbe>,
    tcp_socket: &Option<TcpSocketProbe>,
    grpc: &Option<GrpcProbe>,
    exec: &Option<ExecProbe>,
) -> Option<ProbeAction> {
    http_get
        .clone()
        .map(ProbeAction::HttpGet)
        .or_else(|| tcp_socket.clone().map(ProbeAction::TcpSocket))
        .or_else(|| grpc.clone().map(ProbeAction::Grpc))
        .or_else(|| exec.clone().map(ProbeAction::Exec))
}

/// HTTP/1.1 `GET`; a status from 200 to 399 is healthy (the kubelet's
/// rule). With neither `port` nor `listener` it goes over the generation's
/// own socket.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.port) && has(self.listener))").message("httpGet takes at most one of port and listener"))]
pub struct HttpGetProbe {
    #[serde(default = "root_path")]
    #[schemars(length(max = 2048))]
    #[x_kube(validation = Rule::new("self.startsWith('/')").message("httpGet.path must start with /"))]
    pub path: String,
    /// A port on 127.0.0.1 that the generation binds itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(PORT_RULE).message("a probe's port must be from 1 to 65535"))]
    pub port: Option<i32>,
    /// The name of one of `spec.listeners`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    pub listener: Option<String>,
}

impl Default for HttpGetProbe {
    fn default() -> Self {
        Self {
            path: root_path(),
            port: None,
            listener: None,
        }
    }
}

/// A TCP connect to a port on 127.0.0.1 is healthy. Not through a
/// listener the agent holds: the kernel completes that connect into the
/// backlog whether or not any generation accepts it, so it proves nothing.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.port) && !has(self.listener)").message("tcpSocket needs a port the generation binds itself: a connect to an agent-held listener is completed by the kernel whether or not a generation accepts it, so it proves nothing (use httpGet, grpc or exec through a listener)"))]
pub struct TcpSocketProbe {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(PORT_RULE).message("a probe's port must be from 1 to 65535"))]
    pub port: Option<i32>,
    /// Refused; present so that the refusal can say why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    pub listener: Option<String>,
}

/// `grpc.health.v1.Health/Check` answers `SERVING`. With neither `port`
/// nor `listener` it goes over the generation's own socket.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.port) && has(self.listener))").message("grpc takes at most one of port and listener"))]
pub struct GrpcProbe {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(PORT_RULE).message("a probe's port must be from 1 to 65535"))]
    pub port: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    pub listener: Option<String>,
    /// The service asked about; empty is the server as a whole.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 256))]
    pub service: String,
}

/// A command run as the instance's user, with its environment, inside the
/// generation's cgroup; exit 0 is healthy. Past its timeout it is killed.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ExecProbe {
    /// The program (an absolute path, or a name looked up in the
    /// instance's `PATH`) and its arguments.
    #[schemars(length(max = 256), inner(length(max = 4096)))]
    #[x_kube(validation = Rule::new("self.size() >= 1").message("exec.command needs at least the program"))]
    pub command: Vec<String>,
}

/// systemd's readiness protocol: the generation gets its own
/// `NOTIFY_SOCKET`, and `READY=1` from a process in its cgroup is healthy.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NotifyProbe {}

/// Probing of the serving generation between attempts (SPEC 5.10):
/// `failureThreshold` failures in a row stop it, and `restartPolicy`
/// follows. Exactly one probe kind.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(LIVENESS_KINDS_RULE).message("liveness takes exactly one of httpGet, tcpSocket, grpc, exec and watchdog: true"))]
pub struct LivenessSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_get: Option<HttpGetProbe>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_socket: Option<TcpSocketProbe>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc: Option<GrpcProbe>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec: Option<ExecProbe>,
    /// systemd's watchdog (`WatchdogSec=`): the generation is given
    /// `WATCHDOG_USEC` of `periodSeconds`, and a period without `WATCHDOG=1`
    /// on its `NOTIFY_SOCKET` is one failure. Needs `health.notify`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub watchdog: bool,
    /// From the generation becoming the serving one to the first probe.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self >= 0").message("liveness.initialDelaySeconds must not be negative"))]
    pub initial_delay_seconds: i32,
    /// Between the starts of two probes.
    #[serde(default = "ten")]
    #[x_kube(validation = Rule::new("self >= 1").message("liveness.periodSeconds must be at least 1"))]
    pub period_seconds: i32,
    /// The longest one probe may take.
    #[serde(default = "one")]
    #[x_kube(validation = Rule::new("self >= 1").message("liveness.timeoutSeconds must be at least 1"))]
    pub timeout_seconds: i32,
    /// Failures in a row that stop the generation.
    #[serde(default = "three")]
    #[x_kube(validation = Rule::new("self >= 1").message("liveness.failureThreshold must be at least 1"))]
    pub failure_threshold: i32,
}

impl LivenessSpec {
    /// The one probe asked for (the first in field order where the schema
    /// was bypassed); `None` only for a block with no kind at all.
    pub fn action(&self) -> Option<ProbeAction> {
        first_action(&self.http_get, &self.tcp_socket, &self.grpc, &self.exec)
            .or(self.watchdog.then_some(ProbeAction::Watchdog))
    }

    /// The `WATCHDOG_USEC` a generation is given: one period.
    pub fn watchdog_usec(&self) -> Option<u64> {
        let period = u64::try_from(self.period_seconds.max(1)).unwrap_or(1);
        self.watchdog.then_some(period * 1_000_000)
    }
}

/// What runs at points of a generation's life, as a pod's `lifecycle`.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LifecycleSpec {
    /// Runs before the stop signal, inside `stop.timeoutSeconds` (as
    /// `nginx -s quit` or a drain script would), like systemd's `ExecStop`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pre_stop: Option<LifecycleHandler>,
}

/// A hook: a command run as an exec probe is, with `MAINPID` set.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LifecycleHandler {
    pub exec: ExecProbe,
}

impl LifecycleSpec {
    /// The preStop command line, when there is one.
    pub fn pre_stop_command(&self) -> Option<&[String]> {
        self.pre_stop
            .as_ref()
            .map(|hook| hook.exec.command.as_slice())
            .filter(|command| !command.is_empty())
    }
}

fn root_path() -> String {
    "/".into()
}
fn thirty() -> i32 {
    30
}
fn ten() -> i32 {
    10
}
fn three() -> i32 {
    3
}
fn one() -> i32 {
    1
}
