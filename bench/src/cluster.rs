//! The controller at scale on a real API server: `../shared/kube/up`
//! (kube-apiserver v1.32 with etcd), the chart installed by helm for its
//! RBAC, one `genswap-controller` and N `node-agent run`s as processes
//! under the chart's ServiceAccounts (each agent's token bound to its
//! Node), all release builds. A burst of InstanceGenerations is written at
//! once (install), then every one is moved to another build (release); each
//! phase is timed from its last write to every IG Ready, and each
//! component's requests are counted from the audit log.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use genswap_crds::{ConditionType, InstanceGeneration, conditions};
use k8s_openapi::api::core::v1::{Namespace, Node};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};
use serde_json::json;
use test_cluster::ControlPlane;
use test_cluster::chart::ChartRelease;

use crate::audit::{self, Tally};
use crate::sandbox::{self, Guarded};
use crate::stats::Spread;
use crate::{BenchError, Binaries};

/// The namespace the InstanceGenerations live in.
const NAMESPACE: &str = "bench";
/// The chart's release namespace (its ServiceAccounts and the Lease).
const CHART_NAMESPACE: &str = "genswap-system";
/// The label that selects the benchmark's Nodes.
const POOL_LABEL: &str = "genswap.dev/bench-pool";
/// How long one phase may take to reach every IG Ready.
const PHASE_DEADLINE: Duration = Duration::from_secs(600);
/// Writes in flight at once while a phase writes its IGs.
const WRITERS: usize = 16;
/// How long after the last IG is Ready the phase's requests are still
/// counted: the controller's Events go out after a 10 s fold window.
const COUNT_TAIL: Duration = Duration::from_secs(12);

/// What to run.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// InstanceGenerations in the burst.
    pub igs: usize,
    /// Nodes, one agent each; every IG selects all of them.
    pub nodes: usize,
    /// The controller's `--concurrency`; `None`: its default.
    pub concurrency: Option<u16>,
}

/// One phase of the burst.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Phase {
    pub name: String,
    /// From the first write sent to the last one answered, ms.
    pub writing_ms: f64,
    /// From the last write answered to every IG Ready, ms.
    pub all_ready_ms: f64,
    /// From the last write answered to a quarter, half, three quarters of
    /// the IGs Ready, ms (negative: before the last write).
    pub quarters_ms: [f64; 3],
    /// From an IG's own write answered to it Ready, ms.
    pub per_ig: Spread,
    /// SwapAttempts the controller created in the phase.
    pub attempts: usize,
    pub controller: Tally,
    pub agents: Tally,
    /// The server's answer time for the controller's and the agents'
    /// writes, ms.
    pub controller_writes: Spread,
    pub agent_writes: Spread,
    /// CPU over the phase, from its first write to its last IG Ready.
    pub cpu: CpuUse,
    /// The controller's counters over the phase.
    pub reconciles: u64,
    pub deferrals: HashMap<String, u64>,
}

impl Phase {
    /// Controller requests per attempt.
    pub fn controller_per_attempt(&self) -> f64 {
        self.controller.per(self.attempts)
    }

    /// Agent requests per attempt.
    pub fn agents_per_attempt(&self) -> f64 {
        self.agents.per(self.attempts)
    }
}

/// CPU time by component over a window, ms; and how busy the machine was.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CpuUse {
    pub window_ms: f64,
    pub api_server_ms: f64,
    pub etcd_ms: f64,
    pub controller_ms: f64,
    pub agents_ms: f64,
    /// The instances' cgroups (`cpu.stat` usage).
    pub instances_ms: f64,
    /// Every CPU of the machine busy (not idle, not iowait), percent of all.
    pub machine_busy_percent: f64,
}

/// The processes whose CPU a phase reports.
struct Accounted {
    api_server: u32,
    etcd: u32,
    controller: u32,
    agents: Vec<u32>,
    instances: PathBuf,
}

/// One reading of every counter [`CpuUse`] reports.
struct CpuReading {
    at: Instant,
    api_server: f64,
    etcd: f64,
    controller: f64,
    agents: f64,
    instances: f64,
    machine: (u64, u64),
}

impl Accounted {
    fn read(&self) -> CpuReading {
        CpuReading {
            at: Instant::now(),
            api_server: process_cpu_ms(self.api_server),
            etcd: process_cpu_ms(self.etcd),
            controller: process_cpu_ms(self.controller),
            agents: self.agents.iter().map(|p| process_cpu_ms(*p)).sum(),
            instances: cgroup_cpu_ms(&self.instances),
            machine: machine_ticks(),
        }
    }
}

impl CpuReading {
    fn since(&self, before: &CpuReading) -> CpuUse {
        let (busy, total) = (
            self.machine.0.saturating_sub(before.machine.0),
            self.machine.1.saturating_sub(before.machine.1),
        );
        CpuUse {
            window_ms: (self.at - before.at).as_secs_f64() * 1000.0,
            api_server_ms: self.api_server - before.api_server,
            etcd_ms: self.etcd - before.etcd,
            controller_ms: self.controller - before.controller,
            agents_ms: self.agents - before.agents,
            instances_ms: self.instances - before.instances,
            machine_busy_percent: busy as f64 * 100.0 / total.max(1) as f64,
        }
    }
}

/// utime + stime of `pid`, ms.
pub(crate) fn process_cpu_ms(pid: u32) -> f64 {
    let ticks = crate::scale::cpu_ticks(pid).unwrap_or(0) as f64;
    ticks / ticks_per_second() * 1000.0
}

fn ticks_per_second() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64
}

/// `usage_usec` of a cgroup v2 `cpu.stat` (present without the cpu
/// controller), ms.
fn cgroup_cpu_ms(cgroup: &Path) -> f64 {
    fs::read_to_string(cgroup.join("cpu.stat"))
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .and_then(|v| v.trim().parse::<f64>().ok())
        })
        .map_or(0.0, |usec| usec / 1000.0)
}

/// (busy, total) ticks of every CPU, from the `cpu` line of /proc/stat.
fn machine_ticks() -> (u64, u64) {
    let text = fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = text.lines().find(|l| l.starts_with("cpu ")) else {
        return (0, 0);
    };
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let total: u64 = fields.iter().take(8).sum();
    // idle and iowait are the 4th and 5th.
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (total.saturating_sub(idle), total)
}

/// The burst's figures.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ClusterReport {
    pub igs: usize,
    pub nodes: usize,
    pub concurrency: String,
    pub install: Phase,
    pub release: Phase,
}

/// Runs the burst on a control plane of its own.
pub async fn run(
    binaries: &Binaries,
    cgroup_parent: &Path,
    options: &ClusterOptions,
) -> Result<ClusterReport, BenchError> {
    let (plane, client) = plane_with_crds(NAMESPACE).await?;
    let chart = ChartRelease::install(&plane, "genswap", CHART_NAMESPACE, &[]);

    let sandbox = sandbox::create(cgroup_parent, "cluster")?;
    let staging = sandbox.dir().join("staging");
    fs::create_dir_all(&staging).map_err(|source| BenchError::Setup {
        what: format!("create {}", staging.display()),
        source,
    })?;
    let builds = [
        testapp::make_build_from(&binaries.testapp, &staging, "burst-a")
            .map_err(BenchError::Build)?,
        testapp::make_build_from(&binaries.testapp, &staging, "burst-b")
            .map_err(BenchError::Build)?,
    ];

    let metrics_port = free_port()?;
    let mut controller_cmd = Command::new(&binaries.controller);
    controller_cmd
        .args(["--namespace", NAMESPACE, "--identity", "bench-controller"])
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
        .args(["--lease-namespace", CHART_NAMESPACE])
        .arg("--kubeconfig")
        .arg(chart.controller_kubeconfig());
    if let Some(concurrency) = options.concurrency {
        controller_cmd.args(["--concurrency", &concurrency.to_string()]);
    }
    let mut processes = vec![spawn_logged(
        controller_cmd,
        &sandbox.dir().join("controller.log"),
    )?];
    for i in 0..options.nodes {
        let node = plane
            .create_node(&format!("bench-{i}"), &[(POOL_LABEL, "a")])
            .await;
        processes.push(start_agent(binaries, &chart, &node, &sandbox, &staging, i)?);
    }

    let igs: Api<InstanceGeneration> = Api::namespaced(client.clone(), NAMESPACE);
    let readiness = ReadyWatch::start(igs.clone());
    println!("  warming up: one InstanceGeneration to Ready on every node ...");
    write_all(&igs, &["warmup".to_string()], |name| {
        Write::Create(instance_generation(name, &builds[0]))
    })
    .await?;
    readiness
        .wait_all(&["warmup".to_string()], PHASE_DEADLINE, &mut processes)
        .await?;

    let accounted = Accounted {
        api_server: plane_pid(&plane, "kube-apiserver")?,
        etcd: plane_pid(&plane, "etcd")?,
        controller: processes[0].guard.pid(),
        agents: processes[1..].iter().map(|p| p.guard.pid()).collect(),
        instances: sandbox.cgroup().to_path_buf(),
    };
    let names: Vec<String> = (0..options.igs).map(|i| format!("app-{i:04}")).collect();
    let bench = Bench {
        plane: &plane,
        igs: &igs,
        readiness: &readiness,
        names: &names,
        metrics_url: format!("http://127.0.0.1:{metrics_port}/metrics"),
        accounted,
    };
    let install = run_phase(&bench, "install", &mut processes, |name| {
        Write::Create(instance_generation(name, &builds[0]))
    })
    .await?;
    let release = run_phase(&bench, "release", &mut processes, |_| {
        Write::Patch(json!({"spec": {"build": build_spec(&builds[1])}}))
    })
    .await?;
    drop(processes);
    drop(sandbox);
    Ok(ClusterReport {
        igs: options.igs,
        nodes: options.nodes,
        concurrency: options
            .concurrency
            .map_or_else(|| "default".to_string(), |c| c.to_string()),
        install,
        release,
    })
}

/// What both phases run against.
struct Bench<'a> {
    plane: &'a ControlPlane,
    igs: &'a Api<InstanceGeneration>,
    readiness: &'a ReadyWatch,
    names: &'a [String],
    metrics_url: String,
    accounted: Accounted,
}

async fn run_phase(
    bench: &Bench<'_>,
    name: &str,
    processes: &mut [Logged],
    write: impl Fn(&str) -> Write,
) -> Result<Phase, BenchError> {
    let Bench {
        plane,
        igs,
        readiness,
        names,
        metrics_url,
        accounted,
    } = bench;
    let metrics_url = metrics_url.as_str();
    println!("  {name}: {} InstanceGenerations ...", names.len());
    readiness.forget(names);
    let counters_before = scrape(metrics_url).await;
    let from = Timestamp::now();
    let cpu_before = accounted.read();
    let began = Instant::now();
    let written = write_all(igs, names, write).await?;
    let last_write = written.values().copied().max().unwrap_or(began);
    let ready = readiness.wait_all(names, PHASE_DEADLINE, processes).await?;
    let cpu = accounted.read().since(&cpu_before);
    let mut from_last: Vec<f64> = ready.values().map(|t| signed_ms(*t, last_write)).collect();
    from_last.sort_by(f64::total_cmp);
    let quarter = |q: usize| from_last[(q * from_last.len() / 4).saturating_sub(1)];
    let per_ig = Spread::of(
        names
            .iter()
            .filter_map(|n| Some(signed_ms(*ready.get(n)?, *written.get(n)?)))
            .collect(),
    );
    println!(
        "    last write -> all Ready {:.2} s (25/50/75 % at {:.2} / {:.2} / {:.2} s); counting requests for {} s more ...",
        quarter(4) / 1000.0,
        quarter(1) / 1000.0,
        quarter(2) / 1000.0,
        quarter(3) / 1000.0,
        COUNT_TAIL.as_secs()
    );
    tokio::time::sleep(COUNT_TAIL).await;
    let requests = audit::read(&plane.audit_log(), from, Timestamp::now());
    let controller_user =
        |u: &str| u.starts_with("system:serviceaccount:") && u.contains("controller");
    let agent_user = |u: &str| u.starts_with("system:serviceaccount:") && u.contains("node-agent");
    let controller = Tally::of(&requests, controller_user);
    let counters_after = scrape(metrics_url).await;
    let phase = Phase {
        name: name.to_string(),
        writing_ms: (last_write - began).as_secs_f64() * 1000.0,
        all_ready_ms: quarter(4),
        quarters_ms: [quarter(1), quarter(2), quarter(3)],
        per_ig,
        attempts: controller.count("create swapattempts"),
        agents: Tally::of(&requests, agent_user),
        controller_writes: audit::write_latency(&requests, controller_user),
        agent_writes: audit::write_latency(&requests, agent_user),
        controller,
        cpu,
        reconciles: counter(&counters_after, "genswap_controller_reconciles_total").saturating_sub(
            counter(&counters_before, "genswap_controller_reconciles_total"),
        ),
        deferrals: deferrals(&counters_before, &counters_after),
    };
    println!(
        "    CPU over {:.1} s: API server {:.0} ms, etcd {:.0} ms, controller {:.0} ms, agents {:.0} ms, instances {:.0} ms; machine {:.0} % busy",
        phase.cpu.window_ms / 1000.0,
        phase.cpu.api_server_ms,
        phase.cpu.etcd_ms,
        phase.cpu.controller_ms,
        phase.cpu.agents_ms,
        phase.cpu.instances_ms,
        phase.cpu.machine_busy_percent
    );
    println!(
        "    {} attempts; controller {:.2} requests per attempt ({}); agents {:.2} ({}); {} reconciles, deferrals {:?}",
        phase.attempts,
        phase.controller_per_attempt(),
        phase.controller.text(),
        phase.agents_per_attempt(),
        phase.agents.text(),
        phase.reconciles,
        phase.deferrals
    );
    Ok(phase)
}

/// One IG's write in a phase.
pub(crate) enum Write {
    Create(serde_json::Value),
    Patch(serde_json::Value),
}

/// Writes every IG, [`WRITERS`] at a time; when each write was answered.
pub(crate) async fn write_all(
    igs: &Api<InstanceGeneration>,
    names: &[String],
    write: impl Fn(&str) -> Write,
) -> Result<HashMap<String, Instant>, BenchError> {
    let writes = names.iter().map(|name| {
        let body = write(name);
        async move {
            let result = match body {
                Write::Create(object) => {
                    let ig: InstanceGeneration = serde_json::from_value(object)
                        .map_err(|e| BenchError::Agent(format!("an InstanceGeneration: {e}")))?;
                    igs.create(&PostParams::default(), &ig).await.map(|_| ())
                }
                Write::Patch(patch) => igs
                    .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map(|_| ()),
            };
            result
                .map(|()| (name.clone(), Instant::now()))
                .map_err(|e| BenchError::Agent(format!("write {name}: {e}")))
        }
    });
    futures::stream::iter(writes)
        .buffer_unordered(WRITERS)
        .try_collect()
        .await
}

/// The instant each IG was first seen Ready at its current generation,
/// from a watch of the bench's own (admin credentials, not counted).
pub(crate) struct ReadyWatch {
    ready: Arc<Mutex<HashMap<String, Instant>>>,
    /// Each IG's newest counts, ready of selected: a phase that times out
    /// says whether a rollout was slow or stuck.
    progress: Arc<Mutex<HashMap<String, (i64, i64)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl ReadyWatch {
    pub(crate) fn start(igs: Api<InstanceGeneration>) -> ReadyWatch {
        let ready = Arc::new(Mutex::new(HashMap::new()));
        let progress = Arc::new(Mutex::new(HashMap::new()));
        let seen = Arc::clone(&ready);
        let counted = Arc::clone(&progress);
        let task = tokio::spawn(async move {
            let mut events = watcher(igs, watcher::Config::default())
                .default_backoff()
                .applied_objects()
                .boxed();
            while let Some(event) = events.next().await {
                let Ok(ig) = event else { continue };
                let name = ig.metadata.name.clone().unwrap_or_default();
                if let Some(counts) = ig.status.as_ref().and_then(|s| s.counts.as_ref()) {
                    counted
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(name.clone(), (counts.ready, counts.selected));
                }
                if is_ready(&ig) {
                    seen.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .entry(name)
                        .or_insert_with(Instant::now);
                }
            }
        });
        ReadyWatch {
            ready,
            progress,
            task,
        }
    }

    pub(crate) fn forget(&self, names: &[String]) {
        let mut ready = self.ready.lock().unwrap_or_else(PoisonError::into_inner);
        for name in names {
            ready.remove(name);
        }
    }

    pub(crate) async fn wait_all(
        &self,
        names: &[String],
        deadline: Duration,
        processes: &mut [Logged],
    ) -> Result<HashMap<String, Instant>, BenchError> {
        let began = Instant::now();
        loop {
            let ready = self
                .ready
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            let missing: Vec<&String> = names.iter().filter(|n| !ready.contains_key(*n)).collect();
            if missing.is_empty() {
                return Ok(ready);
            }
            if let Some(gone) = processes.iter_mut().find_map(|p| {
                let exited = p.guard.exited().is_some();
                exited.then_some(&*p)
            }) {
                return Err(BenchError::Agent(format!(
                    "{} exited; its log ends:\n{}",
                    gone.log.display(),
                    test_cluster::process::tail(&gone.log, 30)
                )));
            }
            if began.elapsed() > deadline {
                let progress = self.progress.lock().unwrap_or_else(PoisonError::into_inner);
                let how_far: Vec<String> = missing
                    .iter()
                    .map(|name| match progress.get(*name) {
                        Some((ready, selected)) => format!("{name} ({ready} of {selected} ready)"),
                        None => format!("{name} (no counts yet)"),
                    })
                    .collect();
                return Err(BenchError::Agent(format!(
                    "{} of {} InstanceGenerations not Ready after {deadline:?}: {}",
                    missing.len(),
                    names.len(),
                    how_far.join(", ")
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for ReadyWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Ready, at the generation the IG has now.
fn is_ready(ig: &InstanceGeneration) -> bool {
    let Some(status) = &ig.status else {
        return false;
    };
    status.observed_generation.is_some()
        && status.observed_generation == ig.metadata.generation
        && conditions::is_true(&status.conditions, ConditionType::Ready)
}

fn instance_generation(name: &str, build: &testapp::Build) -> serde_json::Value {
    let mut ig = ig_manifest(NAMESPACE, name, POOL_LABEL, build_spec(build));
    ig["spec"]["health"] = json!({"path": "/", "timeoutSeconds": 10});
    ig["spec"]["stop"] = json!({"timeoutSeconds": 5});
    ig
}

/// An InstanceGeneration of `build` selecting the Nodes labelled
/// `pool=a`, run as nobody, with no settle window.
pub(crate) fn ig_manifest(
    namespace: &str,
    name: &str,
    pool: &str,
    build: serde_json::Value,
) -> serde_json::Value {
    json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "InstanceGeneration",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeSelector": {pool: "a"},
            "build": build,
            "process": {"user": 65534, "group": 65534},
            "settle": {"seconds": 0},
        },
    })
}

fn build_spec(build: &testapp::Build) -> serde_json::Value {
    let id = build
        .path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    json!({"id": id, "artifact": {"path": build.path.to_string_lossy()}, "sha256": build.sha256})
}

fn start_agent(
    binaries: &Binaries,
    chart: &ChartRelease<'_>,
    node: &Node,
    sandbox: &sandbox::Sandbox,
    staging: &Path,
    index: usize,
) -> Result<Logged, BenchError> {
    let dir = sandbox.dir().join(format!("node-{index}"));
    let cgroup = sandbox.cgroup().join(format!("node-{index}"));
    // Short: its sockets' paths must fit 107 bytes.
    let run_dir = sandbox.run_dir().join(format!("n{index}"));
    for path in [&dir, &cgroup, &run_dir] {
        fs::create_dir_all(path).map_err(|source| BenchError::Setup {
            what: format!("create {}", path.display()),
            source,
        })?;
    }
    let node_name = node.metadata.name.clone().unwrap_or_default();
    let mut command = Command::new(&binaries.agent);
    command
        .args(["run", "--node-name", &node_name, "--namespace", NAMESPACE])
        .args(["--inbox-namespace", CHART_NAMESPACE])
        .args(["--no-host-namespaces", "--metrics-addr", "127.0.0.1:0"])
        .arg("--kubeconfig")
        .arg(chart.agent_kubeconfig(node))
        .arg("--cgroup-root")
        .arg(&cgroup)
        .arg("--run-dir")
        .arg(&run_dir)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--staging-root")
        .arg(staging)
        .arg("--log-dir")
        .arg(dir.join("logs"));
    spawn_logged(command, &sandbox.dir().join(format!("agent-{index}.log")))
}

/// A process of the benchmark and its log.
pub(crate) struct Logged {
    guard: Guarded,
    log: PathBuf,
}

impl Logged {
    pub(crate) fn pid(&self) -> u32 {
        self.guard.pid()
    }
}

pub(crate) fn spawn_logged(mut command: Command, log: &Path) -> Result<Logged, BenchError> {
    let setup = |source| BenchError::Setup {
        what: format!("start a process logging to {}", log.display()),
        source,
    };
    let out = File::create(log).map_err(setup)?;
    let err = out.try_clone().map_err(setup)?;
    let child = command
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(setup)?;
    Ok(Logged {
        guard: Guarded::new(child, Signal::SIGTERM),
        log: log.to_path_buf(),
    })
}

pub(crate) fn free_port() -> Result<u16, BenchError> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|source| BenchError::Setup {
            what: "pick a free port".into(),
            source,
        })
}

/// `a - b` in ms, negative when `a` came first.
pub(crate) fn signed_ms(a: Instant, b: Instant) -> f64 {
    if a >= b {
        (a - b).as_secs_f64() * 1000.0
    } else {
        -((b - a).as_secs_f64() * 1000.0)
    }
}

/// The controller's `/metrics` text, empty when it does not answer.
pub(crate) async fn scrape(url: &str) -> String {
    let url = url.to_string();
    tokio::task::spawn_blocking(move || http_get(&url).unwrap_or_default())
        .await
        .unwrap_or_default()
}

fn http_get(url: &str) -> Option<String> {
    use std::io::Write as _;
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest.split_once('/')?;
    let mut stream = std::net::TcpStream::connect(host).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    Some(text.split_once("\r\n\r\n")?.1.to_string())
}

/// The sum of every sample of `name` (all label sets).
pub(crate) fn counter(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter(|l| l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Plans deferred in the window, by reason.
fn deferrals(before: &str, after: &str) -> HashMap<String, u64> {
    let by_reason = |text: &str| -> HashMap<String, u64> {
        text.lines()
            .filter(|l| l.starts_with("genswap_controller_plans_deferred"))
            .filter_map(|l| {
                let (labels, value) = l.rsplit_once(' ')?;
                let reason = labels.split("reason=\"").nth(1)?.split('"').next()?;
                Some((reason.to_string(), value.parse::<f64>().ok()? as u64))
            })
            .collect()
    };
    let before = by_reason(before);
    by_reason(after)
        .into_iter()
        .map(|(reason, n)| {
            let was = before.get(&reason).copied().unwrap_or(0);
            (reason, n.saturating_sub(was))
        })
        .collect()
}

/// A control plane of the benchmark's own, with genswap's CRDs
/// established and `namespace` created; and its admin client.
pub(crate) async fn plane_with_crds(
    namespace: &str,
) -> Result<(ControlPlane, kube::Client), BenchError> {
    plane_with_crds_from(namespace, &workspace().join("crds")).await
}

/// [`plane_with_crds`] with the CRDs in `crds` (an older build's, whose
/// controller writes what its own schema allows).
pub(crate) async fn plane_with_crds_from(
    namespace: &str,
    crds: &std::path::Path,
) -> Result<(ControlPlane, kube::Client), BenchError> {
    let plane = ControlPlane::own().ok_or_else(|| {
        BenchError::Missing("a control plane to start (../shared/kube/up and its tools)".into())
    })?;
    plane.install_crds_from(crds);
    let client = plane.client().await;
    let object: Namespace = serde_json::from_value(json!({"metadata": {"name": namespace}}))
        .map_err(|e| BenchError::Agent(format!("a Namespace: {e}")))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &object)
        .await
        .map_err(|e| BenchError::Agent(format!("create the namespace {namespace}: {e}")))?;
    Ok((plane, client))
}

/// The pid of one of the control plane's servers, from its pid file.
pub(crate) fn plane_pid(plane: &ControlPlane, name: &str) -> Result<u32, BenchError> {
    let path = plane.dir().join("run").join(format!("{name}.pid"));
    fs::read_to_string(&path)
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .ok_or_else(|| BenchError::Missing(format!("a pid in {}", path.display())))
}

fn workspace() -> PathBuf {
    test_cluster::workspace()
}

/// `$HELM`, else a helm installed once under this program's target dir by
/// `.ci/install-helm` (the chart is installed for its RBAC). Called before
/// any thread is started: it sets `HELM` for `test_cluster::helm`.
pub fn ensure_helm() -> Result<(), BenchError> {
    if std::env::var_os("HELM").is_some_and(|h| !h.is_empty()) {
        return Ok(());
    }
    let exe = std::env::current_exe().map_err(|source| BenchError::Setup {
        what: "find this executable".into(),
        source,
    })?;
    let target = exe
        .ancestors()
        .nth(2)
        .ok_or_else(|| BenchError::Missing("the target dir".into()))?
        .join("helm");
    let output = Command::new(workspace().join(".ci/install-helm"))
        .arg(&target)
        .output()
        .map_err(|source| BenchError::Setup {
            what: "run .ci/install-helm".into(),
            source,
        })?;
    if !output.status.success() {
        return Err(BenchError::Missing(format!(
            "helm: .ci/install-helm failed: {}",
            String::from_utf8_lossy(&output.stderr)
        )));
    }
    let helm = String::from_utf8_lossy(&output.stdout).trim().to_string();
    // SAFETY: main calls this before it starts the runtime or any other
    // thread, so nothing reads the environment while it changes.
    unsafe { std::env::set_var("HELM", helm) };
    Ok(())
}
