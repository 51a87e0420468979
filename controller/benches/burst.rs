//! A burst install: N InstanceGenerations × 3 nodes written at once, the
//! whole controller (watches, index, work queue, writes, Events) against
//! the in-memory API server of the adapter tests with every write answered
//! after 100 ms, and agents that report each attempt done as soon as it
//! appears (the agents are not what is measured).
//!
//! Prints, per N: the time from the writes to every IG Ready, the median
//! time to an IG's canary attempt, the controller's requests per attempt by
//! kind (Events counted once written, after their fold window), and the
//! controller's CPU per reconcile: the CPU its runtime's threads used over
//! the burst, divided by the reconciles it ran. The fake API server and
//! the agents run on a runtime of their own and the bench polls from the
//! main thread, so none of theirs is counted. `cargo bench -p controller --bench burst`
//! (`BURST_SIZES=10,100,200,1000`, `WRITE_LATENCY_MS=100`,
//! `EVENT_WINDOW_SECONDS=10`). Nothing is asserted.

#[path = "../tests/support/cluster.rs"]
#[allow(dead_code)]
mod cluster;
// `cluster::eventually` polls with it, from the crate root.
#[path = "../tests/support/poll.rs"]
mod poll;
use poll::poll_until;

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cluster::{Kind, NS, Shared, client_with_latency, lock, node};
use genswap_controller::events::DEFAULT_WINDOW;
use genswap_controller::leader::Leadership;
use genswap_controller::metrics::Metrics;
use genswap_controller::run::{Settings, run_controller};
use genswap_controller::shutdown;
use genswap_runtime::http::Readiness;
use serde_json::{Value, json};

const DEADLINE: Duration = Duration::from_secs(300);
const SHA: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

fn ig(i: usize) -> Value {
    json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "InstanceGeneration",
        "metadata": { "name": format!("app-{i:04}"), "namespace": NS, "uid": format!("uid-{i}"), "generation": 1 },
        "spec": {
            "nodeSelector": { "pool": "a" },
            "build": { "id": "b1", "artifact": { "path": "/opt/app/b1" }, "sha256": SHA },
            "rollout": { "canaryNodes": 1, "maxParallel": 2 },
        },
    })
}

fn ready(ig: &Value) -> bool {
    ig["status"]["conditions"].as_array().is_some_and(|c| {
        c.iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

struct Run {
    igs: usize,
    all_ready: Duration,
    canary_median: Duration,
    writes: BTreeMap<String, usize>,
    /// Events as the scheduler asked for them (the entries the written
    /// Events list).
    event_entries: usize,
    attempts: usize,
    reconciles: u64,
    /// CPU time of the controller's runtime threads, from the writes to
    /// the last Event written.
    controller_cpu: Duration,
}

/// The bench's two runtimes: the controller's, whose threads' CPU is the
/// controller's, and the fake API server's with the agents, which is not
/// counted. The bench's own polling runs on the main thread.
struct Runtimes {
    controller: tokio::runtime::Runtime,
    api: tokio::runtime::Runtime,
}

/// CPU the controller's runtime threads used while awake (unparked).
static CONTROLLER_CPU_NS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static AWAKE_SINCE: Cell<Option<Duration>> = const { Cell::new(None) };
}

/// This thread's CPU time so far, to the nanosecond (clock ticks in
/// `/proc` are too coarse for a burst of ten IGs).
fn thread_cpu() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(Duration::from)
        .unwrap_or_default()
}

fn awake() {
    AWAKE_SINCE.set(Some(thread_cpu()));
}

fn asleep() {
    if let Some(since) = AWAKE_SINCE.take() {
        let used = thread_cpu().saturating_sub(since).as_nanos();
        CONTROLLER_CPU_NS.fetch_add(u64::try_from(used).unwrap_or(u64::MAX), Ordering::Relaxed);
    }
}

fn runtimes() -> Runtimes {
    let controller = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("controller")
        .on_thread_start(awake)
        .on_thread_unpark(awake)
        .on_thread_park(asleep)
        .on_thread_stop(asleep)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let api = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("api-server")
        .enable_all()
        .build()
        .expect("a tokio runtime");
    Runtimes { controller, api }
}

/// The controller's CPU so far (each worker's time awake, counted when it
/// next sleeps).
fn controller_cpu() -> Duration {
    Duration::from_nanos(CONTROLLER_CPU_NS.load(Ordering::Relaxed))
}

fn reconciles(metrics: &Metrics) -> u64 {
    metrics
        .encode()
        .unwrap_or_default()
        .lines()
        .find_map(|line| line.strip_prefix("genswap_controller_reconciles_total "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

fn burst(igs: usize, write_latency: Duration, window: Duration, rt: &Runtimes) -> Run {
    let cluster = Shared::default();
    for name in ["n1", "n2", "n3"] {
        lock(&cluster).put(Kind::Node, node(name, "a"), false);
    }
    let metrics = Arc::new(Metrics::new());
    let leadership = Leadership::follower(metrics.clone());
    leadership.set(true);
    let readiness = Readiness::default();
    let (stop, stopped) = shutdown::channel();
    // The clients' tasks (the fake's answers) run on the API server's runtime.
    let (watch_client, write_client) = {
        let _api = rt.api.enter();
        (
            client_with_latency(&cluster, write_latency),
            client_with_latency(&cluster, write_latency),
        )
    };
    let controller = rt.controller.spawn(run_controller(
        watch_client,
        write_client,
        Settings {
            namespace: Some(NS.into()),
            identity: "bench".into(),
            concurrency: 16,
            event_window: window,
            progress_hold: genswap_controller::context::PROGRESS_HOLD,
            // The in-memory server keeps genswap objects only; the real
            // server's run (genswap-bench cluster) counts inbox writes.
            inbox_namespace: None,
            prometheus: None,
        },
        metrics.clone(),
        leadership,
        readiness.clone(),
        stopped.wait(),
    ));
    rt.api.block_on(poll_until("caches synced", DEADLINE, || {
        readiness.is_ready()
    }));

    // The agents: every attempt without a status is done at once.
    let agents = rt.api.spawn({
        let cluster = cluster.clone();
        async move {
            loop {
                {
                    let mut c = lock(&cluster);
                    let fresh: Vec<(String, i64)> = c
                        .each(Kind::Attempt)
                        .filter(|a| a.get("status").is_none_or(Value::is_null))
                        .filter_map(|a| {
                            Some((
                                a["metadata"]["name"].as_str()?.to_string(),
                                a["spec"]["schedRev"].as_i64()?,
                            ))
                        })
                        .collect();
                    for (name, rev) in fresh {
                        c.report_done(&name, rev);
                    }
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    });

    let cpu_before = controller_cpu();
    let reconciles_before = reconciles(&metrics);
    let started = Instant::now();
    {
        let mut c = lock(&cluster);
        for i in 0..igs {
            c.put(Kind::Ig, ig(i), false);
        }
    }
    let mut canary_at: BTreeMap<usize, Duration> = BTreeMap::new();
    let all_ready = loop {
        {
            let c = lock(&cluster);
            for attempt in c.each(Kind::Attempt) {
                if let Some(i) = attempt["metadata"]["name"]
                    .as_str()
                    .and_then(|n| n.strip_prefix("app-"))
                    .and_then(|n| n.get(..4))
                    .and_then(|n| n.parse::<usize>().ok())
                {
                    canary_at.entry(i).or_insert_with(|| started.elapsed());
                }
            }
            if c.each(Kind::Ig).filter(|ig| ready(ig)).count() == igs {
                break started.elapsed();
            }
        }
        assert!(started.elapsed() < DEADLINE, "the burst did not settle");
        std::thread::sleep(Duration::from_millis(5));
    };
    rt.api.block_on(async { agents.abort() });
    // Normal Events trail by up to the window: count once they stop coming.
    let quiet = window + Duration::from_secs(1);
    let mut last = (lock(&cluster).writes.len(), Instant::now());
    while last.1.elapsed() < quiet && started.elapsed() < DEADLINE {
        std::thread::sleep(Duration::from_millis(20));
        let now = lock(&cluster).writes.len();
        if now != last.0 {
            last = (now, Instant::now());
        }
    }
    let controller_cpu = controller_cpu().saturating_sub(cpu_before);
    let reconciles = reconciles(&metrics) - reconciles_before;
    stop.fire();
    let _ = rt
        .controller
        .block_on(async { tokio::time::timeout(Duration::from_secs(30), controller).await });

    let c = lock(&cluster);
    let mut writes: BTreeMap<String, usize> = BTreeMap::new();
    for write in &c.writes {
        let kind = if write.contains("/events") {
            "event"
        } else if write.ends_with("/status") {
            "status"
        } else if write.starts_with("POST") {
            "create"
        } else if write.starts_with("DELETE") {
            "delete"
        } else {
            "other"
        };
        *writes.entry(kind.to_string()).or_default() += 1;
    }
    let event_entries = c
        .events
        .iter()
        .map(|e| e["series"]["count"].as_u64().unwrap_or(1) as usize)
        .sum();
    let mut canaries: Vec<Duration> = canary_at.into_values().collect();
    canaries.sort_unstable();
    Run {
        igs,
        all_ready,
        canary_median: canaries
            .get(canaries.len() / 2)
            .copied()
            .unwrap_or_default(),
        writes,
        event_entries,
        attempts: c.each(Kind::Attempt).count(),
        reconciles,
        controller_cpu,
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let sizes: Vec<usize> = std::env::var("BURST_SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![10, 100, 200, 1000]);
    let latency = Duration::from_millis(env_or("WRITE_LATENCY_MS", 100));
    let window = Duration::from_secs(env_or("EVENT_WINDOW_SECONDS", DEFAULT_WINDOW.as_secs()));
    println!(
        "burst install, 3 nodes per IG, canaryNodes 1, maxParallel 2, every write answered after {} ms, Events folded over {} s",
        latency.as_millis(),
        window.as_secs()
    );
    println!(
        "{:>5} {:>9} {:>16} {:>14} {:>11} {:>7} {:>7} {:>7} {:>7} {:>13} {:>10} {:>12}",
        "IGs",
        "attempts",
        "writes→all Ready",
        "canary median",
        "req/attempt",
        "status",
        "create",
        "event",
        "delete",
        "Event entries",
        "reconciles",
        "CPU/reconcile"
    );
    for igs in sizes {
        let rt = runtimes();
        let run = burst(igs, latency, window, &rt);
        let total: usize = run.writes.values().sum();
        let per = |kind: &str| {
            run.writes.get(kind).copied().unwrap_or(0) as f64 / run.attempts.max(1) as f64
        };
        println!(
            "{:>5} {:>9} {:>14.2} s {:>12.2} s {:>11.2} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>13} {:>10} {:>9.3} ms",
            run.igs,
            run.attempts,
            run.all_ready.as_secs_f64(),
            run.canary_median.as_secs_f64(),
            total as f64 / run.attempts.max(1) as f64,
            per("status"),
            per("create"),
            per("event"),
            per("delete"),
            run.event_entries,
            run.reconciles,
            run.controller_cpu.as_secs_f64() * 1e3 / run.reconciles.max(1) as f64,
        );
        rt.api.shutdown_background();
        rt.controller.shutdown_background();
    }
}
