//! Watch fan-out on a real API server: what fleet size costs the server
//! when every node agent watches SwapAttempts with a field selector on
//! `spec.nodeName`. The watch cache indexes `spec.nodeName` for Pods only;
//! for a custom resource every event is matched against every watch. The
//! same fleet is measured with the design that replaced it, the node inbox,
//! run by the controller's and the agent's own code.
//!
//! For each fleet size N, on a control plane of its own: this process
//! opens N watches (one HTTP connection each, as N agents would), each
//! selecting its own node `fan-<i>`, then creates attempts for three of
//! those nodes. It reports the API server's CPU while the attempts are
//! created and delivered and while the watches sit idle, its memory
//! before and with the watches, and the delay from each create being sent
//! to its event reaching the watch of its node.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use genswap_controller::inbox::{InboxIndex, Scope as InboxScope, keep_inboxes};
use genswap_controller::leader::Leadership;
use genswap_controller::metrics::Metrics;
use genswap_crds::SwapAttempt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::core::DeserializeGuard;
use kube::runtime::watcher;
use node_agent::kube::inbox::{InboxSource, attempts_from_inbox};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::BenchError;
use crate::cluster::process_cpu_ms;
use crate::stats::Spread;

const NAMESPACE: &str = "fanout";
/// Nodes that get attempts (the others' watches only filter).
const BUSY_NODES: usize = 3;
/// Watches being listed at once.
const OPENING: usize = 64;
/// Creates in flight at once (the controller's default concurrency).
const WRITERS: usize = 16;
/// How long the idle watches are watched for the server's idle CPU.
const IDLE_WINDOW: Duration = Duration::from_secs(10);
const DELIVERY_DEADLINE: Duration = Duration::from_secs(300);

/// How each agent's watch is scoped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum Scope {
    /// Today's design: a SwapAttempt per attempt, each agent watching with
    /// `spec.nodeName=<node>` (the watch cache matches every event against
    /// every such watch).
    NodeField,
    /// The alternative measured against it: one object per node, named
    /// after it, each agent watching with `metadata.name=<node>` (the
    /// watch cache keeps those watches by namespace and name), an attempt
    /// being a write to that object.
    ObjectName,
    /// What the chart runs: a SwapAttempt per attempt, seen by one watch
    /// (the controller's), which files it in its node's inbox ConfigMap
    /// (`genswap_controller::inbox`); each agent watches its inbox by name
    /// and reads each attempt it names (`node_agent::kube::inbox`).
    Inbox,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct FanoutOptions {
    /// How the watches are scoped.
    pub scopes: Vec<Scope>,
    /// Fleet sizes, one run each.
    pub watches: Vec<usize>,
    /// Attempts created for each of the three busy nodes.
    pub attempts_per_node: usize,
}

/// One fleet size.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FanoutRun {
    pub scope: Option<Scope>,
    pub watches: usize,
    /// Opening every watch, ms.
    pub open_ms: f64,
    /// Attempts created (and delivered).
    pub attempts: usize,
    /// From the first create sent to the last event delivered, ms.
    pub window_ms: f64,
    /// The API server's CPU over that window, ms and percent of one core.
    pub server_cpu_ms: f64,
    pub server_cpu_percent: f64,
    /// Its CPU per attempt, ms.
    pub server_cpu_per_attempt_ms: f64,
    /// Its CPU with every watch open and nothing written, percent of one core.
    pub server_idle_cpu_percent: f64,
    /// etcd's CPU over the window, ms.
    pub etcd_cpu_ms: f64,
    /// From a create sent to its event at its node's watch, ms.
    pub delivery: Spread,
    /// Events that reached a watch of another node (must be 0).
    pub misdelivered: usize,
    /// Errors the watches met (each retried after 1 s).
    pub watch_errors: usize,
    /// The API server's VmRSS before the watches, with them, and after
    /// the attempts, KiB.
    pub server_rss_before_kib: u64,
    pub server_rss_watching_kib: u64,
    pub server_rss_after_kib: u64,
    /// This process (holding every watch) at the end, KiB.
    pub watcher_rss_kib: u64,
}

/// Runs every fleet size.
pub async fn run(options: &FanoutOptions) -> Result<Vec<FanoutRun>, BenchError> {
    raise_open_files(options.watches.iter().copied().max().unwrap_or(0) + 512)?;
    let mut runs = Vec::new();
    for &scope in &options.scopes {
        for &watches in &options.watches {
            println!("  {watches} watches, {scope:?} ...");
            let run = one(scope, watches.max(BUSY_NODES), options.attempts_per_node).await?;
            println!(
                "    opened in {:.1} s; {} attempts in {:.2} s; API server CPU {:.0} ms ({:.0} % of a core, {:.2} ms per attempt; idle {:.1} %); delivery p50/p99 {} ms; RSS {} -> {} -> {} MiB",
                run.open_ms / 1000.0,
                run.attempts,
                run.window_ms / 1000.0,
                run.server_cpu_ms,
                run.server_cpu_percent,
                run.server_cpu_per_attempt_ms,
                run.server_idle_cpu_percent,
                run.delivery.text2(),
                run.server_rss_before_kib / 1024,
                run.server_rss_watching_kib / 1024,
                run.server_rss_after_kib / 1024,
            );
            runs.push(run);
        }
    }
    Ok(runs)
}

/// The annotation an [`Scope::ObjectName`] write sets, naming the attempt
/// it stands for.
const KEY_ANNOTATION: &str = "bench.genswap.dev/attempt";

async fn one(
    scope: Scope,
    watches: usize,
    attempts_per_node: usize,
) -> Result<FanoutRun, BenchError> {
    let (plane, client) = crate::cluster::plane_with_crds(NAMESPACE).await?;
    let server = crate::cluster::plane_pid(&plane, "kube-apiserver")?;
    let etcd = crate::cluster::plane_pid(&plane, "etcd")?;
    let attempts: Api<SwapAttempt> = Api::namespaced(client.clone(), NAMESPACE);
    if scope == Scope::ObjectName {
        for n in 0..BUSY_NODES {
            let object: SwapAttempt = serde_json::from_value(test_cluster::objects::swap_attempt(
                &node_name(n),
                &node_name(n),
                1,
            ))
            .map_err(|e| BenchError::Agent(format!("a SwapAttempt: {e}")))?;
            attempts
                .create(&PostParams::default(), &object)
                .await
                .map_err(|e| BenchError::Agent(format!("create {}: {e}", node_name(n))))?;
        }
    }
    // The controller's side of the inbox: its one attempt watch, and the
    // task that keeps every node's inbox, as leader.
    let _controller = (scope == Scope::Inbox).then(|| keep_inboxes_as_leader(client.clone()));
    // Let the server settle after its start before its memory is read.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rss_before = rss_kib(server);

    let delivered: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let misdelivered = Arc::new(AtomicUsize::new(0));
    let listed = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(AtomicUsize::new(0));
    let opened = Instant::now();
    let mut tasks = Vec::with_capacity(watches);
    for i in 0..watches {
        // As an agent watches: a list, then a watch, with this node's
        // field selector (kube-runtime's watcher, as node-agent uses).
        let node = node_name(i);
        let mut events = match scope {
            Scope::NodeField | Scope::ObjectName => {
                let selector = match scope {
                    Scope::ObjectName => format!("metadata.name={node}"),
                    _ => format!("spec.nodeName={node}"),
                };
                let config = watcher::Config::default().fields(&selector);
                watcher(attempts.clone(), config).boxed()
            }
            Scope::Inbox => attempts_from_inbox(
                client.clone(),
                InboxSource {
                    inbox_namespace: NAMESPACE.to_string(),
                    node_name: node.clone(),
                    attempts_namespace: Some(NAMESPACE.to_string()),
                },
            )
            .boxed(),
        };
        let delivered = Arc::clone(&delivered);
        let misdelivered = Arc::clone(&misdelivered);
        let listed_by_task = Arc::clone(&listed);
        let errors_by_task = Arc::clone(&errors);
        tasks.push(tokio::spawn(async move {
            let (listed, errors) = (listed_by_task, errors_by_task);
            while let Some(event) = events.next().await {
                match event {
                    Ok(watcher::Event::InitDone) => {
                        listed.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(watcher::Event::Apply(attempt)) => {
                        if attempt.spec.node_name != node {
                            misdelivered.fetch_add(1, Ordering::Relaxed);
                        }
                        let key = match scope {
                            Scope::NodeField | Scope::Inbox => attempt.metadata.name,
                            Scope::ObjectName => attempt
                                .metadata
                                .annotations
                                .and_then(|mut a| a.remove(KEY_ANNOTATION)),
                        };
                        let Some(key) = key else { continue };
                        delivered
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .entry(key)
                            .or_insert_with(Instant::now);
                    }
                    Ok(_) => {}
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        }));
        if i % OPENING == OPENING - 1 {
            // Open in waves, as a fleet's agents start over time.
            while listed.load(Ordering::Relaxed) + OPENING < i {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    while listed.load(Ordering::Relaxed) < watches {
        if opened.elapsed() > DELIVERY_DEADLINE {
            return Err(BenchError::Agent(format!(
                "{} of {watches} watches listed within {DELIVERY_DEADLINE:?} ({} errors)",
                listed.load(Ordering::Relaxed),
                errors.load(Ordering::Relaxed)
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let open_ms = opened.elapsed().as_secs_f64() * 1000.0;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_watching = rss_kib(server);
    let idle_from = (process_cpu_ms(server), Instant::now());
    tokio::time::sleep(IDLE_WINDOW).await;
    let idle_cpu = process_cpu_ms(server) - idle_from.0;
    let idle_percent = idle_cpu / (idle_from.1.elapsed().as_secs_f64() * 10.0);

    // Round-robin over the nodes, as a burst of IGs issues them.
    let names: Vec<(String, String, i64)> = (0..attempts_per_node)
        .flat_map(|k| {
            (0..BUSY_NODES).map(move |n| {
                (
                    format!("a-{n}-{k:05}"),
                    node_name(n),
                    i64::try_from(k).unwrap_or(i64::MAX - 1) + 1,
                )
            })
        })
        .collect();
    let server_cpu_from = process_cpu_ms(server);
    let etcd_cpu_from = process_cpu_ms(etcd);
    let began = Instant::now();
    // One write in flight per node object, as one controller writing it
    // would have (concurrent patches of one object only conflict).
    let object_locks: Vec<tokio::sync::Mutex<()>> = (0..BUSY_NODES)
        .map(|_| tokio::sync::Mutex::new(()))
        .collect();
    let object_locks = &object_locks;
    let sent: HashMap<String, Instant> =
        futures::stream::iter(names.iter().map(|(name, node, rev)| {
            let attempts = attempts.clone();
            async move {
                let _one_writer = match scope {
                    Scope::NodeField | Scope::Inbox => None,
                    Scope::ObjectName => {
                        let index = (0..BUSY_NODES).find(|n| node_name(*n) == *node);
                        match index {
                            Some(n) => Some(object_locks[n].lock().await),
                            None => None,
                        }
                    }
                };
                let at = Instant::now();
                match scope {
                    Scope::NodeField | Scope::Inbox => {
                        let attempt: SwapAttempt = serde_json::from_value(
                            test_cluster::objects::swap_attempt(name, node, *rev),
                        )
                        .map_err(|e| BenchError::Agent(format!("a SwapAttempt: {e}")))?;
                        attempts
                            .create(&PostParams::default(), &attempt)
                            .await
                            .map_err(|e| BenchError::Agent(format!("create {name}: {e}")))?;
                    }
                    Scope::ObjectName => {
                        let patch = json!({"metadata": {"annotations": {KEY_ANNOTATION: name}}});
                        attempts
                            .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
                            .await
                            .map_err(|e| BenchError::Agent(format!("write {node}: {e}")))?;
                    }
                }
                Ok::<_, BenchError>((name.clone(), at))
            }
        }))
        .buffer_unordered(WRITERS)
        .try_collect()
        .await?;
    let arrived = loop {
        let arrived = delivered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if arrived.len() >= names.len() {
            break arrived;
        }
        if began.elapsed() > DELIVERY_DEADLINE {
            return Err(BenchError::Agent(format!(
                "{} of {} attempt events reached their watch within {DELIVERY_DEADLINE:?}",
                arrived.len(),
                names.len()
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let window = began.elapsed();
    let server_cpu = process_cpu_ms(server) - server_cpu_from;
    let etcd_cpu = process_cpu_ms(etcd) - etcd_cpu_from;
    let delivery = Spread::of(
        sent.iter()
            .filter_map(|(name, at)| {
                Some(
                    arrived
                        .get(name)?
                        .saturating_duration_since(*at)
                        .as_secs_f64()
                        * 1000.0,
                )
            })
            .collect(),
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let run = FanoutRun {
        scope: Some(scope),
        watches,
        open_ms,
        attempts: names.len(),
        window_ms: window.as_secs_f64() * 1000.0,
        server_cpu_ms: server_cpu,
        server_cpu_percent: server_cpu / (window.as_secs_f64() * 10.0),
        server_cpu_per_attempt_ms: server_cpu / names.len().max(1) as f64,
        server_idle_cpu_percent: idle_percent,
        etcd_cpu_ms: etcd_cpu,
        delivery,
        misdelivered: misdelivered.load(Ordering::Relaxed),
        watch_errors: errors.load(Ordering::Relaxed),
        server_rss_before_kib: rss_before,
        server_rss_watching_kib: rss_watching,
        server_rss_after_kib: rss_kib(server),
        watcher_rss_kib: rss_kib(std::process::id()),
    };
    for task in tasks {
        task.abort();
    }
    Ok(run)
}

/// The controller's inbox keeping ([`genswap_controller::inbox`]) fed by
/// one watch of every attempt, as the controller runs it; stopped when the
/// returned guard drops.
fn keep_inboxes_as_leader(client: kube::Client) -> AbortOnDrop {
    let index = InboxIndex::new();
    let observed = index.clone();
    let all: Api<DeserializeGuard<SwapAttempt>> = Api::namespaced(client.clone(), NAMESPACE);
    let watch = tokio::spawn(async move {
        let mut events = watcher(all, watcher::Config::default()).boxed();
        while let Some(event) = events.next().await {
            match event {
                Ok(event) => observed.observe(&event),
                Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
            }
        }
    });
    let leadership = Leadership::follower(Arc::new(Metrics::new()));
    leadership.set(true);
    let keep = tokio::spawn(keep_inboxes(
        client,
        NAMESPACE.to_string(),
        InboxScope(None),
        index,
        leadership,
    ));
    AbortOnDrop(vec![watch, keep])
}

/// Tasks aborted when dropped.
struct AbortOnDrop(Vec<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

fn node_name(i: usize) -> String {
    format!("fan-{i:05}")
}

fn rss_kib(pid: u32) -> u64 {
    crate::scale::status_field(pid, "VmRSS:").unwrap_or(0)
}

/// One descriptor per watch connection: raises the soft limit to `needed`
/// (up to the hard limit).
fn raise_open_files(needed: usize) -> Result<(), BenchError> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(|e| BenchError::Setup {
        what: "read the open-files limit".into(),
        source: e.into(),
    })?;
    let wanted = (needed as u64).min(hard);
    if wanted > soft {
        setrlimit(Resource::RLIMIT_NOFILE, wanted, hard).map_err(|e| BenchError::Setup {
            what: format!("raise the open-files limit to {wanted}"),
            source: e.into(),
        })?;
    }
    if (needed as u64) > hard {
        return Err(BenchError::Missing(format!(
            "{needed} open files (the hard limit is {hard})"
        )));
    }
    Ok(())
}
