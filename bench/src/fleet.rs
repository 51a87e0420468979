//! The controller against a fleet on a real API server (issue 49): N Node
//! objects (no kubelets), M InstanceGenerations selecting all of them with
//! `maxParallel` covering the fleet, the release build of
//! `genswap-controller` under the chart's ServiceAccount, and the agents
//! simulated by this process: each attempt is answered `done` about a
//! second after it appears, with the status a real agent writes for a
//! `done` (one status write per attempt; a real agent's own requests are in
//! the cluster bench); an ask to stage ahead (`rollout.prestage`, the
//! default) as a real agent answers one whose store holds the build. An install of all M, then a release of all M; for
//! each, the time from the last write to every IG Ready, the controller's
//! requests per attempt, its RSS at the peak and at rest, the API server's
//! RSS and CPU, etcd's database size, the largest object written, and the
//! attempts per (IG, node) at rest, which must not pass one per desired
//! state: more is an attempt issued twice.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt;
use genswap_crds::{InstanceGeneration, SwapAttempt};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde::{Deserialize, Serialize};
use serde_json::json;
use test_cluster::chart::ChartRelease;

use crate::audit::{self, Tally};
use crate::cluster::{
    Logged, ReadyWatch, Write, counter, free_port, ig_manifest, plane_pid, plane_with_crds_from,
    process_cpu_ms, scrape, signed_ms, spawn_logged, write_all,
};
use crate::{BenchError, Binaries};

const NAMESPACE: &str = "fleet";
const CHART_NAMESPACE: &str = "genswap-system";
const POOL_LABEL: &str = "genswap.dev/fleet-pool";
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// Nodes created at once.
const NODE_WRITERS: usize = 32;
/// Status writes of the simulated agents in flight at once.
const AGENT_WRITERS: usize = 32;
/// How long one phase may take to reach every IG Ready: 30 minutes, or
/// 40 ms an attempt on a larger fleet. A 5,000 × 20 release took 1,375 s
/// on one run of this machine and passed 1,800 s on a slower one, 18 of its
/// 20 IGs Ready by then.
fn phase_deadline(attempts: usize) -> Duration {
    Duration::from_secs(1800)
        .max(Duration::from_millis(40).saturating_mul(u32::try_from(attempts).unwrap_or(u32::MAX)))
}
/// Once the attempts are down to one per (IG, node): the controller's
/// folded Events go out and its allocator returns what the burst freed,
/// and what it holds then is what it holds at rest.
const REST: Duration = Duration::from_secs(15);
/// How long the deletes after a phase may take to leave one attempt per
/// (IG, node) in the controller's cache.
const SETTLE_DEADLINE: Duration = Duration::from_secs(600);

/// What to run.
#[derive(Clone, Debug)]
pub struct FleetOptions {
    /// Fleet sizes, each on a control plane of its own.
    pub nodes: Vec<usize>,
    pub igs: usize,
    /// How long a simulated agent takes to answer an attempt.
    pub answer_after: Duration,
    /// Zones the Nodes are spread over round robin, each a wave of every
    /// IG's rollout (`rollout.waves`); 0: no waves.
    pub zones: usize,
    /// Every IG's `rollout.maxParallel` (`10%`, `50`); the fleet when `None`.
    pub max_parallel: Option<String>,
    /// Every IG's `rollout.prestage` (the default: true).
    pub prestage: bool,
    /// Another `genswap-controller` run on the same fleet first (an older
    /// build), so before and after come from one run.
    pub compare: Option<PathBuf>,
    /// The CRDs that build shipped; this tree's when not given.
    pub compare_crds: Option<PathBuf>,
}

/// One fleet size's figures.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FleetReport {
    /// `this build`, or the path of the compared binary.
    pub controller: String,
    pub nodes: usize,
    pub igs: usize,
    pub phases: Vec<FleetPhase>,
    /// `leadership changed` lines in the controller's log (the first is
    /// its start), and Lease errors it stepped down on.
    pub leadership_changes: usize,
    pub step_downs: usize,
    /// The controller's RSS once it leads with the fleet's Nodes cached and
    /// no InstanceGeneration yet, KiB: what it costs before any attempt.
    #[serde(default)]
    pub controller_idle_kib: Option<u64>,
    /// The IGs' rollout when not the default one (`maxParallel` covering
    /// the fleet, no waves).
    #[serde(default)]
    pub rollout: String,
}

/// One phase (install, release) of one fleet size.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FleetPhase {
    pub name: String,
    pub writing_ms: f64,
    /// From the last IG write to every IG Ready.
    pub all_ready_ms: f64,
    /// SwapAttempts the controller created (answered 201), and its create
    /// requests that were refused or failed (by HTTP status).
    pub attempts_created: usize,
    pub creates_refused: std::collections::BTreeMap<u16, usize>,
    /// The controller's deletes of SwapAttempts by HTTP status: a 404 is
    /// one of an attempt already gone.
    #[serde(default)]
    pub deletes_by_status: std::collections::BTreeMap<u16, usize>,
    pub controller: Tally,
    pub controller_cpu_ms: f64,
    pub api_server_cpu_ms: f64,
    pub etcd_cpu_ms: f64,
    /// The controller's RSS: the highest sampled during the phase, and at
    /// rest after it, KiB.
    pub controller_peak_kib: u64,
    pub controller_rest_kib: u64,
    /// The controller's heap at rest as glibc counts it: in use, and freed
    /// but held by its arenas (KiB); absent for a build without the gauges.
    #[serde(default)]
    pub heap_in_use_kib: Option<u64>,
    #[serde(default)]
    pub heap_held_free_kib: Option<u64>,
    pub api_server_rest_kib: u64,
    pub etcd_db_bytes: u64,
    /// The largest InstanceGeneration and SwapAttempt as JSON, bytes.
    pub largest_ig_bytes: usize,
    pub largest_attempt_bytes: usize,
    /// SwapAttempts in the namespace at rest, and the most any (IG, node)
    /// pair has.
    pub attempts_at_rest: usize,
    pub most_per_ig_node: usize,
    /// Attempts this phase issued for an (IG, node, build) beyond the
    /// first, as the simulated agents saw them: each is a node issued twice
    /// for the same desired state.
    pub issued_twice: usize,
}

impl FleetPhase {
    pub fn controller_per_attempt(&self) -> f64 {
        self.controller.per(self.attempts_created)
    }
}

pub async fn run(
    binaries: &Binaries,
    options: &FleetOptions,
) -> Result<Vec<FleetReport>, BenchError> {
    let mut reports = Vec::new();
    let mut controllers = Vec::new();
    let own_crds = test_cluster::workspace().join("crds");
    if let Some(other) = &options.compare {
        let crds = options
            .compare_crds
            .clone()
            .unwrap_or_else(|| own_crds.clone());
        controllers.push((other.display().to_string(), other.clone(), crds));
    }
    controllers.push((
        THIS_BUILD.to_string(),
        binaries.controller.clone(),
        own_crds,
    ));
    for &nodes in &options.nodes {
        for (label, controller, crds) in &controllers {
            println!(
                "\n{label}: the controller and a fleet of {nodes} Nodes, {} InstanceGenerations ...",
                options.igs
            );
            reports.push(run_one(label, controller, crds, nodes, options).await?);
        }
    }
    Ok(reports)
}

/// What this build issued twice, if it did: the fleet bench fails on it.
pub fn issued_twice_by_this_build(reports: &[FleetReport]) -> Option<String> {
    let found: Vec<String> = reports
        .iter()
        .filter(|report| report.controller == THIS_BUILD)
        .flat_map(|report| {
            report
                .phases
                .iter()
                .filter(|phase| phase.issued_twice > 0)
                .map(move |phase| {
                    format!(
                        "{} nodes, {}: {} attempts for a node that had one for the same build",
                        report.nodes, phase.name, phase.issued_twice
                    )
                })
        })
        .collect();
    (!found.is_empty()).then(|| found.join("; "))
}

/// How the run names the controller built from this tree.
const THIS_BUILD: &str = "this build";

async fn run_one(
    label: &str,
    controller: &std::path::Path,
    crds: &std::path::Path,
    nodes: usize,
    options: &FleetOptions,
) -> Result<FleetReport, BenchError> {
    let (plane, client) = plane_with_crds_from(NAMESPACE, crds).await?;
    // For its RBAC; the CRDs are the ones just installed (a compared
    // build's may differ from the chart's).
    let chart = ChartRelease::install(&plane, "genswap", CHART_NAMESPACE, &["--skip-crds"]);
    let dir = tempfile::Builder::new()
        .prefix("genswap-fleet-")
        .tempdir()
        .map_err(|source| BenchError::Setup {
            what: "create a temp dir".into(),
            source,
        })?;

    let began = Instant::now();
    futures::stream::iter((0..nodes).map(|i| {
        let plane = &plane;
        let zone = (options.zones > 0).then(|| format!("zone-{}", i % options.zones));
        async move {
            let mut labels = vec![(POOL_LABEL, "a")];
            if let Some(zone) = &zone {
                labels.push((ZONE_LABEL, zone.as_str()));
            }
            plane.create_node(&format!("fleet-{i:05}"), &labels).await;
        }
    }))
    .buffer_unordered(NODE_WRITERS)
    .collect::<Vec<()>>()
    .await;
    println!(
        "  {nodes} Nodes created in {:.1} s",
        began.elapsed().as_secs_f64()
    );

    let metrics_port = free_port()?;
    let mut command = Command::new(controller);
    command
        .args(["--namespace", NAMESPACE, "--identity", "fleet-controller"])
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
        .args(["--lease-namespace", CHART_NAMESPACE])
        .arg("--kubeconfig")
        .arg(chart.controller_kubeconfig());
    let mut processes = vec![spawn_logged(command, &dir.path().join("controller.log"))?];
    let controller_pid = processes[0].pid();
    let api_server = plane_pid(&plane, "kube-apiserver")?;
    let etcd = plane_pid(&plane, "etcd")?;

    let attempts: Api<SwapAttempt> = Api::namespaced(client.clone(), NAMESPACE);
    let agents = SimulatedAgents::start(attempts.clone(), options.answer_after);
    let igs: Api<InstanceGeneration> = Api::namespaced(client.clone(), NAMESPACE);
    let readiness = ReadyWatch::start(igs.clone());
    let names: Vec<String> = (0..options.igs).map(|i| format!("app-{i:02}")).collect();
    let fleet = Fleet {
        plane: &plane,
        igs: &igs,
        attempts: &attempts,
        readiness: &readiness,
        names: &names,
        nodes,
        metrics_url: format!("http://127.0.0.1:{metrics_port}/metrics"),
        controller_pid,
        api_server,
        etcd,
        agents: &agents,
    };
    let controller_idle_kib = idle_rss_kib(&fleet).await;
    println!(
        "  the controller leading, no InstanceGeneration yet: RSS {}",
        controller_idle_kib.map_or_else(|| "— (it never led)".into(), mib)
    );
    let mut report = FleetReport {
        controller: label.to_string(),
        nodes,
        igs: options.igs,
        phases: Vec::new(),
        leadership_changes: 0,
        step_downs: 0,
        controller_idle_kib,
        rollout: rollout_summary(options),
    };
    if !report.rollout.is_empty() {
        println!("  rollout: {}", report.rollout);
    }
    // Each phase's row is printed as it ends: a later phase that fails
    // must not take an earlier one's figures with it.
    let install = run_phase(&fleet, "install", &mut processes, |name| {
        Write::Create(instance_generation(name, nodes, "build-a", options))
    })
    .await?;
    print!("  {}", row(&report, &install));
    report.phases.push(install);
    let release = run_phase(&fleet, "release", &mut processes, |_| {
        Write::Patch(json!({"spec": {"build": build_spec("build-b")}}))
    })
    .await?;
    print!("  {}", row(&report, &release));
    report.phases.push(release);
    drop(agents);
    drop(processes);
    let log = fs::read_to_string(dir.path().join("controller.log")).unwrap_or_default();
    let leadership_changes = log.matches("leadership changed").count();
    let step_downs = log.matches("stepped down").count();
    println!(
        "  the controller's log: leadership changed {leadership_changes} times, stepped down on a Lease error {step_downs} times"
    );
    report.leadership_changes = leadership_changes;
    report.step_downs = step_downs;
    Ok(report)
}

/// What both phases run against.
struct Fleet<'a> {
    plane: &'a test_cluster::ControlPlane,
    igs: &'a Api<InstanceGeneration>,
    attempts: &'a Api<SwapAttempt>,
    readiness: &'a ReadyWatch,
    names: &'a [String],
    nodes: usize,
    metrics_url: String,
    controller_pid: u32,
    api_server: u32,
    etcd: u32,
    agents: &'a SimulatedAgents,
}

async fn run_phase(
    fleet: &Fleet<'_>,
    name: &str,
    processes: &mut [Logged],
    write: impl Fn(&str) -> Write,
) -> Result<FleetPhase, BenchError> {
    println!("  {name}: {} InstanceGenerations ...", fleet.names.len());
    fleet.readiness.forget(fleet.names);
    let from = Timestamp::now();
    let before = scrape(&fleet.metrics_url).await;
    let cpu = |pid| process_cpu_ms(pid);
    let cpu_before = [fleet.controller_pid, fleet.api_server, fleet.etcd].map(cpu);
    let peak = RssSampler::start(fleet.controller_pid);
    let twice_before = fleet.agents.issued_twice();
    let began = Instant::now();
    let written = write_all(fleet.igs, fleet.names, write).await?;
    let last_write = written.values().copied().max().unwrap_or(began);
    let ready = fleet
        .readiness
        .wait_all(
            fleet.names,
            phase_deadline(fleet.nodes * fleet.names.len()),
            processes,
        )
        .await?;
    let all_ready_ms = ready
        .values()
        .map(|t| signed_ms(*t, last_write))
        .fold(0.0, f64::max);
    let settled = settle(fleet, fleet.names.len() * fleet.nodes).await;
    println!(
        "    last write -> all Ready {:.1} s; {} status writes by the simulated agents; one attempt per (IG, node) cached {}; resting {} s ...",
        all_ready_ms / 1000.0,
        fleet.agents.answered(),
        settled.map_or_else(
            || format!("not within {} s", SETTLE_DEADLINE.as_secs()),
            |after| format!("{:.1} s after all Ready", after.as_secs_f64())
        ),
        REST.as_secs()
    );
    tokio::time::sleep(REST).await;
    let controller_peak_kib = peak.stop();
    let cpu_after = [fleet.controller_pid, fleet.api_server, fleet.etcd].map(cpu);
    let requests = audit::read(&fleet.plane.audit_log(), from, Timestamp::now());
    let controller_user =
        |u: &str| u.starts_with("system:serviceaccount:") && u.contains("controller");
    let controller = Tally::of(&requests, controller_user);
    let after = scrape(&fleet.metrics_url).await;
    let mut creates = std::collections::BTreeMap::new();
    for request in requests
        .iter()
        .filter(|r| r.verb == "create" && r.resource == "swapattempts" && controller_user(&r.user))
    {
        *creates.entry(request.code.unwrap_or(0)).or_insert(0) += 1;
    }
    let mut deletes_by_status = std::collections::BTreeMap::new();
    for request in requests
        .iter()
        .filter(|r| r.verb == "delete" && r.resource == "swapattempts" && controller_user(&r.user))
    {
        *deletes_by_status
            .entry(request.code.unwrap_or(0))
            .or_insert(0) += 1;
    }

    let listed = fleet
        .attempts
        .list(&ListParams::default())
        .await
        .map_err(|e| BenchError::Agent(format!("list the SwapAttempts: {e}")))?;
    let mut per_pair: HashMap<(String, String), usize> = HashMap::new();
    let mut largest_attempt_bytes = 0;
    for attempt in &listed.items {
        *per_pair
            .entry((
                attempt.spec.instance.clone(),
                attempt.spec.node_name.clone(),
            ))
            .or_default() += 1;
        largest_attempt_bytes = largest_attempt_bytes.max(json_len(attempt));
    }
    let largest_ig_bytes = fleet
        .igs
        .list(&ListParams::default())
        .await
        .map_err(|e| BenchError::Agent(format!("list the InstanceGenerations: {e}")))?
        .items
        .iter()
        .map(json_len)
        .max()
        .unwrap_or(0);
    let phase = FleetPhase {
        name: name.to_string(),
        writing_ms: (last_write - began).as_secs_f64() * 1000.0,
        all_ready_ms,
        attempts_created: creates.get(&201).copied().unwrap_or(0),
        creates_refused: creates
            .into_iter()
            .filter(|(code, _)| *code != 201)
            .collect(),
        deletes_by_status,
        issued_twice: fleet.agents.issued_twice().saturating_sub(twice_before),
        controller_cpu_ms: cpu_after[0] - cpu_before[0],
        api_server_cpu_ms: cpu_after[1] - cpu_before[1],
        etcd_cpu_ms: cpu_after[2] - cpu_before[2],
        controller_peak_kib,
        controller_rest_kib: rss_kib(fleet.controller_pid),
        heap_in_use_kib: gauge(&after, "genswap_controller_heap_in_use_bytes").map(|b| b / 1024),
        heap_held_free_kib: gauge(&after, "genswap_controller_heap_held_free_bytes")
            .map(|b| b / 1024),
        api_server_rest_kib: rss_kib(fleet.api_server),
        etcd_db_bytes: etcd_db_bytes(fleet.plane),
        largest_ig_bytes,
        largest_attempt_bytes,
        attempts_at_rest: listed.items.len(),
        most_per_ig_node: per_pair.values().copied().max().unwrap_or(0),
        controller,
    };
    println!(
        "    controller at rest: RSS {}, heap in use {}, held free {}; {} attempts cached",
        mib(phase.controller_rest_kib),
        phase.heap_in_use_kib.map_or_else(|| "—".into(), mib),
        phase.heap_held_free_kib.map_or_else(|| "—".into(), mib),
        gauge(&after, "genswap_controller_attempts_cached")
            .map_or_else(|| "—".into(), |n| n.to_string()),
    );
    println!(
        "    {} attempts created, creates refused by status {:?} ({} issued twice); controller {:.2} requests per attempt ({}); {} reconciles, {} Events dropped",
        phase.attempts_created,
        phase.creates_refused,
        phase.issued_twice,
        phase.controller_per_attempt(),
        phase.controller.text(),
        counter(&after, "genswap_controller_reconciles_total")
            .saturating_sub(counter(&before, "genswap_controller_reconciles_total")),
        dropped_events(&after).saturating_sub(dropped_events(&before)),
    );
    println!(
        "    controller deletes of attempts by status: {:?}",
        phase.deletes_by_status
    );
    Ok(phase)
}

/// Waits until the controller caches at most `pairs` attempts (one per
/// IG and node: the deletes a phase leads to are done); how long it took,
/// or `None` past [`SETTLE_DEADLINE`]. Its own gauge, so no list of every
/// attempt loads the API server while it deletes.
async fn settle(fleet: &Fleet<'_>, pairs: usize) -> Option<Duration> {
    let began = Instant::now();
    while began.elapsed() < SETTLE_DEADLINE {
        let cached = gauge(
            &scrape(&fleet.metrics_url).await,
            "genswap_controller_attempts_cached",
        );
        if cached.is_some_and(|n| n as usize <= pairs) {
            return Some(began.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    None
}

/// The controller's RSS once it leads; `None` if it does not within
/// [`LEAD_WITHIN`].
async fn idle_rss_kib(fleet: &Fleet<'_>) -> Option<u64> {
    let deadline = Instant::now() + LEAD_WITHIN;
    while Instant::now() < deadline {
        if gauge(
            &scrape(&fleet.metrics_url).await,
            "genswap_controller_leader",
        ) == Some(1)
        {
            return Some(rss_kib(fleet.controller_pid));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    None
}

/// How long a fresh controller may take to lead.
const LEAD_WITHIN: Duration = Duration::from_secs(120);

/// A gauge's value, when the scrape has it.
fn gauge(metrics: &str, name: &str) -> Option<u64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
        .map(|v| v as u64)
}

fn dropped_events(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("genswap_controller_reconcile_errors_total")
                && l.contains("event_queue_full")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

fn json_len<T: Serialize>(object: &T) -> usize {
    serde_json::to_vec(object).map_or(0, |bytes| bytes.len())
}

fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:")
}

fn status_kib(pid: u32, field: &str) -> u64 {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

fn mib(kib: u64) -> String {
    format!("{:.0} MiB", kib as f64 / 1024.0)
}

/// The size of etcd's database file under the control plane's directory.
fn etcd_db_bytes(plane: &test_cluster::ControlPlane) -> u64 {
    fn find(dir: &std::path::Path, depth: usize) -> Option<u64> {
        for entry in fs::read_dir(dir).ok()?.flatten() {
            let path = entry.path();
            if path.ends_with("member/snap/db") {
                return entry.metadata().ok().map(|m| m.len());
            }
            if depth > 0
                && entry.file_type().is_ok_and(|t| t.is_dir())
                && let Some(size) = find(&path, depth - 1)
            {
                return Some(size);
            }
        }
        None
    }
    find(plane.dir(), 5).unwrap_or(0)
}

/// The controller's RSS sampled every 100 ms; the highest seen.
struct RssSampler {
    peak: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl RssSampler {
    fn start(pid: u32) -> RssSampler {
        let peak = Arc::new(AtomicU64::new(rss_kib(pid)));
        let seen = Arc::clone(&peak);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tick.tick().await;
                seen.fetch_max(rss_kib(pid), Ordering::Relaxed);
            }
        });
        RssSampler { peak, task }
    }

    fn stop(self) -> u64 {
        self.task.abort();
        self.peak.load(Ordering::Relaxed)
    }
}

/// (IG, node, build id, stage-only): a build's ask to stage ahead and its
/// swap are one of each, not one issued twice.
type Issued = (String, String, String, bool);

/// The node agents, simulated: each attempt without an outcome is answered
/// `done` after `answer_after`, a swap with the generation after the
/// node's last.
struct SimulatedAgents {
    answered: Arc<AtomicU64>,
    /// Attempts seen per (IG, node, build).
    issued: Arc<Mutex<HashMap<Issued, usize>>>,
    task: tokio::task::JoinHandle<()>,
}

impl SimulatedAgents {
    fn start(attempts: Api<SwapAttempt>, answer_after: Duration) -> SimulatedAgents {
        let answered = Arc::new(AtomicU64::new(0));
        let count = Arc::clone(&answered);
        let issued: Arc<Mutex<HashMap<Issued, usize>>> = Arc::default();
        let issued_seen = Arc::clone(&issued);
        let task = tokio::spawn(async move {
            let generations: Arc<Mutex<HashMap<(String, String), i64>>> = Arc::default();
            let mut seen = HashSet::new();
            let writers = Arc::new(tokio::sync::Semaphore::new(AGENT_WRITERS));
            let mut events = watcher(attempts.clone(), watcher::Config::default())
                .default_backoff()
                .applied_objects()
                .boxed();
            while let Some(event) = events.next().await {
                let Ok(attempt) = event else { continue };
                let answered_already = attempt.status.as_ref().is_some_and(|s| s.outcome.is_some());
                let Some(name) = attempt.metadata.name.clone() else {
                    continue;
                };
                if !seen.insert(name.clone()) {
                    continue;
                }
                *issued_seen
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .entry((
                        attempt.spec.instance.clone(),
                        attempt.spec.node_name.clone(),
                        attempt.spec.build.id.clone(),
                        attempt.spec.stage_only,
                    ))
                    .or_default() += 1;
                if answered_already {
                    continue;
                }
                let (attempts, generations, writers, count) = (
                    attempts.clone(),
                    Arc::clone(&generations),
                    Arc::clone(&writers),
                    Arc::clone(&count),
                );
                tokio::spawn(async move {
                    let started = Timestamp::now();
                    tokio::time::sleep(answer_after).await;
                    let Ok(_permit) = writers.acquire().await else {
                        return;
                    };
                    let status = if attempt.spec.stage_only {
                        staged_status(started)
                    } else {
                        let generation = {
                            let mut generations =
                                generations.lock().unwrap_or_else(PoisonError::into_inner);
                            let n = generations
                                .entry((
                                    attempt.spec.instance.clone(),
                                    attempt.spec.node_name.clone(),
                                ))
                                .or_insert(0);
                            *n += 1;
                            *n
                        };
                        done_status(&attempt, generation, started)
                    };
                    if attempts
                        .patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
                        .await
                        .is_ok()
                    {
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        });
        SimulatedAgents {
            answered,
            issued,
            task,
        }
    }

    fn answered(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }

    /// Attempts beyond the first for any (IG, node, build) so far.
    fn issued_twice(&self) -> usize {
        self.issued
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .map(|n| n.saturating_sub(1))
            .sum()
    }
}

impl Drop for SimulatedAgents {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What a real agent writes for a `done` attempt.
fn done_status(attempt: &SwapAttempt, generation: i64, started: Timestamp) -> serde_json::Value {
    let now = Timestamp::now().to_string();
    json!({"status": {
        "outcome": "done",
        "effectiveMode": attempt.spec.mode,
        "generation": generation,
        "executed": true,
        "startedAt": started.to_string(),
        "finishedAt": now,
        "conditions": [{
            "type": "Ready", "status": "True", "reason": "SwapDone",
            "message": format!("generation {generation} serves"),
            "lastTransitionTime": now,
        }],
        "serving": {"state": "Running", "generation": generation, "restarts": 0},
    }})
}

/// What a real agent writes for an ask to stage ahead whose build its
/// store already holds.
fn staged_status(started: Timestamp) -> serde_json::Value {
    let now = Timestamp::now().to_string();
    json!({"status": {
        "outcome": "done",
        "reason": "the store holds it: nothing needed fetching",
        "executed": false,
        "startedAt": started.to_string(),
        "finishedAt": now,
        "stage": {"fetchedBytes": 0},
        "conditions": [{
            "type": "Ready", "status": "True", "reason": "Staged",
            "message": "the store holds it: nothing needed fetching",
            "lastTransitionTime": now,
        }],
    }})
}

fn instance_generation(
    name: &str,
    nodes: usize,
    build: &str,
    options: &FleetOptions,
) -> serde_json::Value {
    let mut ig = ig_manifest(NAMESPACE, name, POOL_LABEL, build_spec(build));
    let max_parallel = match &options.max_parallel {
        Some(value) => value
            .parse::<u64>()
            .map_or_else(|_| json!(value), |count| json!(count)),
        None => json!(nodes),
    };
    ig["spec"]["rollout"] = json!({"maxParallel": max_parallel});
    if options.zones > 0 {
        ig["spec"]["rollout"]["waves"] = json!({"byLabel": ZONE_LABEL});
    }
    if !options.prestage {
        ig["spec"]["rollout"]["prestage"] = json!(false);
    }
    ig
}

/// `maxParallel 10%, 5 zone waves, no pre-staging`, or nothing for the
/// default rollout.
fn rollout_summary(options: &FleetOptions) -> String {
    let mut parts = Vec::new();
    if let Some(value) = &options.max_parallel {
        parts.push(format!("maxParallel {value}"));
    }
    if options.zones > 0 {
        parts.push(format!("{} zone waves", options.zones));
    }
    if !options.prestage {
        parts.push("no pre-staging".into());
    }
    parts.join(", ")
}

fn build_spec(id: &str) -> serde_json::Value {
    // Never staged: the agents are simulated.
    let sha = format!("{:064x}", id.len() + usize::from(id.ends_with('b')));
    json!({"id": id, "artifact": {"path": format!("/opt/fleet/{id}")}, "sha256": sha})
}

/// The report's table.
pub fn markdown(reports: &[FleetReport]) -> String {
    let mut out = String::from(
        "| controller | nodes × IGs | phase | last write → all Ready | attempts (issued twice; creates refused) | controller requests / attempt | controller RSS peak / rest | RSS per attempt at rest, over idle | heap in use / held free at rest | API server RSS | etcd db | largest IG / attempt | attempts at rest (most per IG, node) |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for report in reports {
        for phase in &report.phases {
            out.push_str(&row(report, phase));
        }
    }
    for report in reports.iter().filter(|report| !report.rollout.is_empty()) {
        out.push_str(&format!(
            "\n{} at {} × {}: {}.\n",
            report.controller, report.nodes, report.igs, report.rollout
        ));
    }
    out
}

/// One phase as a row of [`markdown`]'s table.
fn row(report: &FleetReport, phase: &FleetPhase) -> String {
    format!(
        "| {} | {} × {} | {} | {:.1} s | {} ({}; {}) | {:.2} | {} / {} | {} | {} / {} | {} | {:.1} MiB | {} / {} B | {} ({}) |\n",
        report.controller,
        report.nodes,
        report.igs,
        phase.name,
        phase.all_ready_ms / 1000.0,
        phase.attempts_created,
        phase.issued_twice,
        phase.creates_refused.values().sum::<usize>(),
        phase.controller_per_attempt(),
        mib(phase.controller_peak_kib),
        mib(phase.controller_rest_kib),
        report.controller_idle_kib.map_or_else(
            || "—".into(),
            |idle| format!(
                "{:.1} KiB",
                phase.controller_rest_kib.saturating_sub(idle) as f64
                    / phase.attempts_at_rest.max(1) as f64
            )
        ),
        phase.heap_in_use_kib.map_or_else(|| "—".into(), mib),
        phase.heap_held_free_kib.map_or_else(|| "—".into(), mib),
        mib(phase.api_server_rest_kib),
        phase.etcd_db_bytes as f64 / 1048576.0,
        phase.largest_ig_bytes,
        phase.largest_attempt_bytes,
        phase.attempts_at_rest,
        phase.most_per_ig_node,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_larger_fleet_is_given_longer_to_reach_ready() {
        assert_eq!(phase_deadline(10_000), Duration::from_secs(1800));
        assert_eq!(phase_deadline(100_000), Duration::from_secs(4000));
    }
}
