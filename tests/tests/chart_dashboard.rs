//! The Grafana dashboard queries only metrics the binaries expose: every
//! `genswap_*` series in its expressions is one the controller's or the
//! agent's registry encodes (a counter as `<name>_total`, a histogram as
//! `<name>_bucket`/`_sum`/`_count`), and every exposed metric family is
//! shown somewhere.

mod chart_support;

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use genswap_crds::{Cause, Mode, Outcome};
use node_agent::classify::StepOutcome;
use node_agent::engine::{Step, StepRecord, SwapResult};
use serde_json::Value;

/// The series names an OpenMetrics exposition can contain, from its
/// `# TYPE <family> <type>` lines.
fn exposed_series(exposition: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut families = BTreeSet::new();
    let mut series = BTreeSet::new();
    for line in exposition.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let (Some(family), Some(kind)) = (parts.next(), parts.next()) else {
            continue;
        };
        families.insert(family.to_string());
        let suffixes: &[&str] = match kind {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            _ => &[""],
        };
        for suffix in suffixes {
            series.insert(format!("{family}{suffix}"));
        }
    }
    (families, series)
}

fn expressions(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("expr", Value::String(e)) => out.push(e.clone()),
                    _ => expressions(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| expressions(v, out)),
        _ => {}
    }
}

fn genswap_names(expression: &str) -> Vec<String> {
    let mut names = Vec::new();
    let bytes = expression.as_bytes();
    let mut i = 0;
    while let Some(found) = expression[i..].find("genswap_") {
        let start = i + found;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        names.push(expression[start..end].to_string());
        i = end;
    }
    names
}

/// The controller's exposition with one sample in every family (a labelled
/// family without samples is not encoded at all).
fn controller_exposition() -> String {
    let metrics = genswap_controller::metrics::Metrics::new();
    drop(metrics.reconcile_started());
    metrics.reconcile_failed("conflict");
    metrics.attempt_issued(Cause::Release, Mode::Overlap);
    metrics.outcome_recorded(Outcome::Done, Mode::Overlap);
    metrics.plan_deferred(genswap_controller::metrics::Deferral::OwnCreateUnseen);
    metrics.set_leader(true);
    metrics.analysis_measured(&genswap_core::scheduler::Verdict::Pass);
    metrics.encode().expect("the controller's metrics encode")
}

/// The agent's exposition after one attempt with one step, a liveness
/// failure, the restart that followed and a dropped log line.
fn agent_exposition() -> String {
    let logs = tempfile::tempdir().expect("a log dir");
    let instance = logs.path().join("default_app");
    std::fs::create_dir(&instance).expect("an instance's log dir");
    std::fs::write(instance.join("1.dropped"), "2\n").expect("a drop count");
    let metrics = node_agent::metrics::AgentMetrics::new().with_log_dir(logs.path());
    metrics.record_generation_exit("liveness_failed");
    metrics.record_supervisor_event(&node_agent::engine::SupervisorEvent::Restarted {
        instance: node_agent::gate::InstanceKey::new("default", "app").expect("a key"),
        generation: 2,
        restarts: 1,
        after: "liveness_failed",
        steps: Vec::new(),
    });
    let now = SystemTime::now();
    metrics.record_result(&SwapResult {
        outcome: Outcome::Done,
        effective_mode: Mode::Overlap,
        generation: Some(1),
        reason: String::new(),
        executed: true,
        clean_exit: false,
        drain: None,
        listener_handover: None,
        steps: vec![StepRecord {
            step: Step::Stage,
            result: StepOutcome::Ok,
            duration: Duration::from_millis(3),
        }],
        started_at: now,
        finished_at: now,
    });
    metrics.set_generations_running(1);
    metrics.record_retirement(node_agent::metrics::Retirement::Stopped);
    metrics.encode().expect("the agent's metrics encode")
}

#[test]
fn the_dashboard_shows_every_exposed_metric_and_nothing_else() {
    let controller = controller_exposition();
    let agent = agent_exposition();
    let (mut families, mut series) = exposed_series(&controller);
    let (agent_families, agent_series) = exposed_series(&agent);
    families.extend(agent_families);
    series.extend(agent_series);
    assert!(
        families
            .iter()
            .any(|f| f.starts_with("genswap_controller_"))
            && families.iter().any(|f| f.starts_with("genswap_agent_")),
        "{families:?}"
    );

    let path = chart_support::chart_dir().join("dashboards/genswap.json");
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read the dashboard"))
            .expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    expressions(&dashboard, &mut exprs);
    assert!(!exprs.is_empty(), "the dashboard has no queries");

    let used: BTreeSet<String> = exprs.iter().flat_map(|e| genswap_names(e)).collect();
    let unknown: Vec<&String> = used.difference(&series).collect();
    assert!(
        unknown.is_empty(),
        "the dashboard queries series nothing exposes: {unknown:?}"
    );
    let unshown: Vec<&String> = families
        .iter()
        .filter(|family| !used.iter().any(|name| name.starts_with(family.as_str())))
        .collect();
    assert!(
        unshown.is_empty(),
        "exposed but not on the dashboard: {unshown:?}"
    );
}
