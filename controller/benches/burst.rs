//! A burst install: N InstanceGenerations × 3 nodes written at once, the
//! whole controller (watches, index, work queue, writes, Events) against
//! the in-memory API server of the adapter tests with every write answered
//! after 100 ms, and agents that report each attempt done as soon as it
//! appears (the agents are not what is measured).
//!
//! Prints, per N: the time from the writes to every IG Ready, the median
//! time to an IG's canary attempt, and the controller's requests per
//! attempt by kind. `cargo bench -p controller --bench burst`
//! (`BURST_SIZES=10,100,200`, `WRITE_LATENCY_MS=100`). Nothing is asserted.

#[path = "../tests/support/cluster.rs"]
#[allow(dead_code)]
mod cluster;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster::{Kind, NS, Shared, client_with_latency, lock, node};
use genswap_controller::events::DEFAULT_WINDOW;
use genswap_controller::http::Readiness;
use genswap_controller::leader::Leadership;
use genswap_controller::metrics::Metrics;
use genswap_controller::run::{Settings, run_controller};
use genswap_controller::shutdown;
use serde_json::{Value, json};

const DEADLINE: Duration = Duration::from_secs(300);
const SHA: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

/// What `cluster::eventually` polls with.
pub async fn poll_until(what: &str, deadline: Duration, mut condition: impl FnMut() -> bool) {
    let until = tokio::time::Instant::now() + deadline;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < until,
            "timed out waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

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
    attempts: usize,
}

async fn burst(igs: usize, write_latency: Duration) -> Run {
    let cluster = Shared::default();
    for name in ["n1", "n2", "n3"] {
        lock(&cluster).put(Kind::Node, node(name, "a"), false);
    }
    let metrics = Arc::new(Metrics::new());
    let leadership = Leadership::follower(metrics.clone());
    leadership.set(true);
    let readiness = Readiness::default();
    let (stop, stopped) = shutdown::channel();
    let controller = tokio::spawn(run_controller(
        client_with_latency(&cluster, write_latency),
        client_with_latency(&cluster, write_latency),
        Settings {
            namespace: Some(NS.into()),
            identity: "bench".into(),
            concurrency: 16,
            event_window: DEFAULT_WINDOW,
        },
        metrics,
        leadership,
        readiness.clone(),
        stopped.wait(),
    ));
    poll_until("caches synced", DEADLINE, || readiness.is_ready()).await;

    // The agents: every attempt without a status is done at once.
    let agents = tokio::spawn({
        let cluster = cluster.clone();
        async move {
            loop {
                {
                    let mut c = lock(&cluster);
                    let fresh: Vec<(String, i64)> = c
                        .all(Kind::Attempt)
                        .iter()
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
            for attempt in c.all(Kind::Attempt) {
                if let Some(i) = attempt["metadata"]["name"]
                    .as_str()
                    .and_then(|n| n.strip_prefix("app-"))
                    .and_then(|n| n.get(..4))
                    .and_then(|n| n.parse::<usize>().ok())
                {
                    canary_at.entry(i).or_insert_with(|| started.elapsed());
                }
            }
            if c.all(Kind::Ig).iter().filter(|ig| ready(ig)).count() == igs {
                break started.elapsed();
            }
        }
        assert!(started.elapsed() < DEADLINE, "the burst did not settle");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    agents.abort();
    // Normal Events trail by up to the window: count once they stop coming.
    let quiet = DEFAULT_WINDOW + Duration::from_secs(1);
    let mut last = (lock(&cluster).writes.len(), Instant::now());
    while last.1.elapsed() < quiet && started.elapsed() < DEADLINE {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = lock(&cluster).writes.len();
        if now != last.0 {
            last = (now, Instant::now());
        }
    }
    stop.fire();
    let _ = tokio::time::timeout(Duration::from_secs(30), controller).await;

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
        attempts: c.all(Kind::Attempt).len(),
    }
}

fn main() {
    let sizes: Vec<usize> = std::env::var("BURST_SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![10, 100, 200]);
    let latency = Duration::from_millis(
        std::env::var("WRITE_LATENCY_MS")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(100),
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    println!(
        "burst install, 3 nodes per IG, canaryNodes 1, maxParallel 2, every write answered after {} ms",
        latency.as_millis()
    );
    println!(
        "{:>5} {:>9} {:>16} {:>16} {:>12} {:>8} {:>8} {:>8} {:>8}",
        "IGs",
        "attempts",
        "writes→all Ready",
        "canary median",
        "req/attempt",
        "status",
        "create",
        "event",
        "delete"
    );
    for igs in sizes {
        let run = runtime.block_on(burst(igs, latency));
        let total: usize = run.writes.values().sum();
        let per = |kind: &str| {
            run.writes.get(kind).copied().unwrap_or(0) as f64 / run.attempts.max(1) as f64
        };
        println!(
            "{:>5} {:>9} {:>14.2} s {:>14.2} s {:>12.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
            run.igs,
            run.attempts,
            run.all_ready.as_secs_f64(),
            run.canary_median.as_secs_f64(),
            total as f64 / run.attempts.max(1) as f64,
            per("status"),
            per("create"),
            per("event"),
            per("delete"),
        );
    }
}
