//! The cluster benchmark's tables: the burst's phases side by side, and
//! the watch fan-out by fleet size.

use serde::{Deserialize, Serialize};

use crate::cluster::{ClusterReport, Phase};
use crate::fanout::{FanoutRun, Scope};
use crate::report::Machine;
use crate::stats::ms;
use crate::write_cost::WriteCost;

/// Everything one `genswap-bench cluster` run measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClusterResults {
    pub machine: Machine,
    pub burst: Option<ClusterReport>,
    pub fanout: Vec<FanoutRun>,
    pub write_costs: Vec<WriteCost>,
}

impl ClusterResults {
    /// The report, as markdown.
    pub fn markdown(&self) -> String {
        let mut out = format!("# genswap-bench cluster\n\n{}\n", self.machine.text());
        if let Some(burst) = &self.burst {
            out.push_str(&burst_table(burst));
        }
        if !self.fanout.is_empty() {
            out.push_str(&fanout_table(&self.fanout));
        }
        if !self.write_costs.is_empty() {
            out.push_str(
                "\n## What one write costs the API server (one at a time)\n\n| write | API server CPU per write | wall per write |\n| --- | --- | --- |\n",
            );
            for cost in &self.write_costs {
                out.push_str(&format!(
                    "| {} | {:.2} ms | {:.2} ms |\n",
                    cost.kind, cost.server_cpu_ms, cost.wall_ms
                ));
            }
        }
        out
    }
}

fn seconds(millis: f64) -> String {
    format!("{:.2} s", millis / 1000.0)
}

fn burst_table(burst: &ClusterReport) -> String {
    let phases = [&burst.install, &burst.release];
    let row = |label: &str, value: &dyn Fn(&Phase) -> String| {
        let cells: Vec<String> = phases.iter().map(|p| value(p)).collect();
        format!("| {label} | {} |\n", cells.join(" | "))
    };
    let mut out = format!(
        "\n## {} InstanceGenerations x {} nodes on a real API server (controller concurrency {})\n\n| figure | install | release |\n| --- | --- | --- |\n",
        burst.igs, burst.nodes, burst.concurrency
    );
    out.push_str(&row("last write -> all Ready", &|p| {
        seconds(p.all_ready_ms)
    }));
    out.push_str(&row("25 / 50 / 75 % Ready (from the last write)", &|p| {
        format!(
            "{:.2} / {:.2} / {:.2} s",
            p.quarters_ms[0] / 1000.0,
            p.quarters_ms[1] / 1000.0,
            p.quarters_ms[2] / 1000.0
        )
    }));
    out.push_str(&row("writing the IGs (16 at a time)", &|p| {
        seconds(p.writing_ms)
    }));
    out.push_str(&row("an IG's own write -> Ready, p50 / p99", &|p| {
        p.per_ig.text2() + " ms"
    }));
    out.push_str(&row("attempts", &|p| p.attempts.to_string()));
    out.push_str(&row("controller requests per attempt", &|p| {
        format!("{:.2}", p.controller_per_attempt())
    }));
    out.push_str(&row("controller requests", &|p| p.controller.text()));
    out.push_str(&row("agent requests per attempt", &|p| {
        format!("{:.2}", p.agents_per_attempt())
    }));
    out.push_str(&row("agent requests", &|p| p.agents.text()));
    out.push_str(&row("controller writes answered in, p50 / p99", &|p| {
        p.controller_writes.text2() + " ms"
    }));
    out.push_str(&row("agent writes answered in, p50 / p99", &|p| {
        p.agent_writes.text2() + " ms"
    }));
    out.push_str(&row(
        "CPU: API server / etcd / controller / agents / instances",
        &|p| {
            format!(
                "{:.1} / {:.1} / {:.1} / {:.1} / {:.1} s",
                p.cpu.api_server_ms / 1000.0,
                p.cpu.etcd_ms / 1000.0,
                p.cpu.controller_ms / 1000.0,
                p.cpu.agents_ms / 1000.0,
                p.cpu.instances_ms / 1000.0
            )
        },
    ));
    out.push_str(&row("machine busy (2 CPUs)", &|p| {
        format!("{:.0} %", p.cpu.machine_busy_percent)
    }));
    out.push_str(&row("reconciles", &|p| p.reconciles.to_string()));
    out.push_str(&row("plans deferred", &|p| {
        let mut reasons: Vec<_> = p.deferrals.iter().filter(|(_, n)| **n > 0).collect();
        reasons.sort();
        if reasons.is_empty() {
            return "0".into();
        }
        reasons
            .iter()
            .map(|(reason, n)| format!("{reason} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }));
    out
}

fn fanout_table(runs: &[FanoutRun]) -> String {
    let mut out = String::from(
        "\n## Watch fan-out: N agent watches, attempts for 3 of the nodes\n\n*node-field*: a SwapAttempt per attempt, each watch `spec.nodeName=<node>` (the agent without `--inbox-namespace`); *inbox*: a SwapAttempt per attempt filed by the controller's inbox keeping in its node's ConfigMap, each agent watching its inbox by name and reading each attempt it names (the chart; create sent -> the agent has read the attempt); *object-name*: one object per node, each watch `metadata.name=<node>`, an attempt a write to it.\n\n| scope | watches | opened in | attempts | created and delivered in | API server CPU | per attempt | idle, watches open | etcd CPU | create sent -> event at its watch, p50 / p99 | misdelivered | API server RSS: before / watching / after | watcher RSS |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for run in runs {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.0} ms ({:.0} % of a core) | {:.2} ms | {:.1} % | {:.0} ms | {} / {} ms | {} | {} / {} / {} MiB | {} MiB |\n",
            match run.scope {
                Some(Scope::ObjectName) => "object-name",
                Some(Scope::Inbox) => "inbox",
                _ => "node-field",
            },
            run.watches,
            seconds(run.open_ms),
            run.attempts,
            seconds(run.window_ms),
            run.server_cpu_ms,
            run.server_cpu_percent,
            run.server_cpu_per_attempt_ms,
            run.server_idle_cpu_percent,
            run.etcd_cpu_ms,
            ms(run.delivery.p50),
            ms(run.delivery.p99),
            run.misdelivered,
            run.server_rss_before_kib / 1024,
            run.server_rss_watching_kib / 1024,
            run.server_rss_after_kib / 1024,
            run.watcher_rss_kib / 1024,
        ));
    }
    out
}
