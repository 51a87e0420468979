//! `kubectl genswap get` as text (a tree, styled or plain) or JSON.

use std::fmt::Write;

use anstyle::{AnsiColor, Style};

use crate::tree::{AttemptView, NodeView, SidecarView, Tree};
use genswap_crds::{AnalysisPhase, AnalysisStatus, PrestageStatus, RolloutStatus, StagingState};

/// Whether the text carries ANSI styles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Colour {
    On,
    Off,
}

/// The tree as text, one line per condition, node and attempt.
pub fn text(tree: &Tree, colour: Colour) -> String {
    let paint = Painter(colour);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} {}/{}  build {} ({}){}",
        paint.bold("InstanceGeneration"),
        tree.namespace,
        tree.name,
        paint.bold(&tree.build),
        tree.mode,
        if tree.paused {
            format!("  {}", paint.style(AnsiColor::Yellow, "paused"))
        } else {
            String::new()
        }
    );
    let mut facts = vec![format!("ready {}", tree.ready.as_deref().unwrap_or("-"))];
    if let Some(good) = &tree.good_build {
        facts.push(format!("good build {good}"));
    }
    if !tree.history.is_empty() {
        facts.push(format!("history {}", tree.history.join(", ")));
    }
    let _ = writeln!(out, "  {}", facts.join("  "));
    if let Some(counts) = &tree.counts {
        let _ = writeln!(
            out,
            "  nodes {} selected  {} updated  {} ready  {} in flight  {} waiting  {} stalled  {} need attention  {} staged",
            counts.selected,
            counts.updated,
            counts.ready,
            counts.in_flight,
            counts.waiting,
            counts.stalled,
            counts.attention,
            counts.staged
        );
    }

    if let Some(line) = tree.rollout.as_ref().and_then(rollout_line) {
        let _ = writeln!(out, "  {line}");
    }
    if let Some(analysis) = tree.rollout.as_ref().and_then(|r| r.analysis.as_ref()) {
        let _ = writeln!(out, "  {}", analysis_line(analysis, &paint));
    }
    if let Some(prestage) = tree.rollout.as_ref().and_then(|r| r.prestage.as_ref()) {
        prestage_lines(&mut out, prestage, &paint);
    }

    let width = tree
        .conditions
        .iter()
        .map(|c| c.type_.len())
        .max()
        .unwrap_or(0);
    let last_section = tree.nodes.is_empty();
    for (index, condition) in tree.conditions.iter().enumerate() {
        let branch = branch(last_section && index + 1 == tree.conditions.len());
        let good = match condition.type_.as_str() {
            // Stalled and Reconciling are good when False.
            "Stalled" | "Reconciling" => condition.status != "True",
            _ => condition.status == "True",
        };
        let status = format!("{:<5}", condition.status);
        let status = if good {
            paint.style(AnsiColor::Green, &status)
        } else if condition.type_ == "Reconciling" {
            paint.style(AnsiColor::Cyan, &status)
        } else {
            paint.style(AnsiColor::Red, &status)
        };
        let _ = writeln!(
            out,
            "{branch}{:<width$}  {status}  {}: {}",
            condition.type_, condition.reason, condition.message
        );
    }
    for (index, node) in tree.nodes.iter().enumerate() {
        let last = index + 1 == tree.nodes.len();
        node_lines(&mut out, node, last, &paint);
    }
    if tree.nodes.is_empty() && tree.conditions.is_empty() {
        let _ = writeln!(out, "└─ no status yet: is the controller running?");
    }
    out
}

fn node_lines(out: &mut String, node: &NodeView, last: bool, paint: &Painter) {
    let serving = match (&node.build, node.generation) {
        (Some(build), Some(generation)) => format!("serving {build} as generation {generation}"),
        (Some(build), None) => format!("serving {build}"),
        _ => "nothing serving".to_string(),
    };
    let serving = match node.serving {
        Some(false) => paint.style(AnsiColor::Red, &format!("{serving} (down)")),
        _ => serving,
    };
    let mut line = format!(
        "{}{} {}  {}  {serving}",
        branch(last),
        paint.bold("node"),
        paint.bold(&node.name),
        node.cohort
    );
    if node.restarts > 0 {
        let _ = write!(line, "  restarts {}", node.restarts);
    }
    if let Some(exit) = &node.last_exit {
        let _ = write!(line, "  last exit: {exit}");
    }
    if let Some(why) = &node.attention {
        let _ = write!(line, "  {}", paint.style(AnsiColor::Red, why));
    }
    let _ = writeln!(out, "{line}");
    let indent = if last { "   " } else { "│  " };
    for sidecar in &node.sidecars {
        let _ = writeln!(out, "{indent}├─ {}", sidecar_line(sidecar, paint));
    }
    if node.attempts.is_empty() {
        let _ = writeln!(out, "{indent}└─ no attempts kept");
    }
    for (index, attempt) in node.attempts.iter().enumerate() {
        let branch = branch(index + 1 == node.attempts.len());
        let _ = writeln!(out, "{indent}{branch}{}", attempt_line(attempt, paint));
    }
}

fn sidecar_line(sidecar: &SidecarView, paint: &Painter) -> String {
    let colour = match sidecar.state {
        "Running" => AnsiColor::Green,
        "Starting" => AnsiColor::Cyan,
        _ => AnsiColor::Red,
    };
    let mut line = format!(
        "sidecar {}  {}",
        sidecar.name,
        paint.style(colour, sidecar.state)
    );
    if sidecar.restarts > 0 {
        let _ = write!(line, "  restarts {}", sidecar.restarts);
    }
    if let Some(exit) = &sidecar.last_exit {
        let _ = write!(line, "  last exit: {exit}");
    }
    if sidecar.state != "Running"
        && let Some(message) = &sidecar.message
    {
        let _ = write!(line, "  {message}");
    }
    line
}

fn attempt_line(attempt: &AttemptView, paint: &Painter) -> String {
    let colour = match attempt.outcome.as_str() {
        "done" => AnsiColor::Green,
        "failed" | "down" => AnsiColor::Red,
        "abandoned" => AnsiColor::Yellow,
        _ => AnsiColor::Cyan,
    };
    let mut line = format!(
        "rev {}  {}  {}  {}",
        attempt.sched_rev,
        attempt.cause,
        attempt.mode,
        paint.style(colour, &attempt.outcome)
    );
    match attempt.executed {
        Some(true) => line.push_str("  executed"),
        Some(false) => line.push_str("  not executed"),
        None => {}
    }
    if let Some(drain) = attempt.drain_ms {
        let _ = write!(line, "  drain {drain} ms");
    }
    let _ = write!(line, "  {}", attempt.age);
    if !attempt.reason.is_empty() {
        let _ = write!(line, "  {}", attempt.reason);
    }
    line
}

fn branch(last: bool) -> &'static str {
    if last { "└─ " } else { "├─ " }
}

/// The tree as JSON, for scripts.
pub fn json(tree: &Tree) -> String {
    serde_json::to_string_pretty(tree).unwrap_or_else(|_| "{}".into())
}

struct Painter(Colour);

impl Painter {
    fn bold(&self, text: &str) -> String {
        self.apply(Style::new().bold(), text)
    }

    fn style(&self, colour: AnsiColor, text: &str) -> String {
        self.apply(Style::new().fg_color(Some(colour.into())), text)
    }

    fn apply(&self, style: Style, text: &str) -> String {
        match self.0 {
            Colour::On => format!("{style}{text}{style:#}"),
            Colour::Off => text.to_string(),
        }
    }
}

/// `analysis of wave canary  Failed  2 measurements, 1 crossed a bound: …`.
fn analysis_line(analysis: &AnalysisStatus, painter: &Painter) -> String {
    let phase = match analysis.phase {
        AnalysisPhase::Passed => painter.style(AnsiColor::Green, analysis.phase.as_str()),
        AnalysisPhase::Running => analysis.phase.as_str().to_string(),
        AnalysisPhase::Failed | AnalysisPhase::Inconclusive => {
            painter.style(AnsiColor::Red, analysis.phase.as_str())
        }
    };
    let mut line = format!(
        "analysis of wave {}  {phase}  {} measurement{}",
        analysis.wave,
        analysis.measurements,
        if analysis.measurements == 1 { "" } else { "s" }
    );
    if analysis.failures > 0 {
        line.push_str(&format!(", {} crossed a bound", analysis.failures));
    }
    if analysis.inconclusive > 0 {
        line.push_str(&format!(", {} inconclusive", analysis.inconclusive));
    }
    if let Some(message) = &analysis.message {
        line.push_str(&format!(": {message}"));
    }
    line
}

/// `wave zone-c (1 of 3)  bakes until …`, when a wave is under way.
/// Width of a node's progress bar, in cells.
const BAR_CELLS: usize = 24;

/// `prestage b2  2/3 nodes hold it`, then a bar per node still staging and
/// the reason of each that cannot.
fn prestage_lines(out: &mut String, prestage: &PrestageStatus, paint: &Painter) {
    let state = if prestage.done_at.is_some() {
        paint.style(AnsiColor::Green, "done")
    } else {
        paint.style(AnsiColor::Cyan, "staging")
    };
    let _ = writeln!(
        out,
        "  prestage {}  {state}  {}/{} nodes hold it  fetched {}",
        prestage.build,
        prestage.staged,
        prestage.needed,
        bytes_text(prestage.fetched_bytes)
    );
    let width = prestage
        .nodes
        .iter()
        .map(|n| n.name.len())
        .max()
        .unwrap_or(0);
    for node in &prestage.nodes {
        let detail = match node.state {
            StagingState::Failed | StagingState::Abandoned => paint.style(
                AnsiColor::Red,
                &format!(
                    "{}: {}",
                    node.state.as_str(),
                    node.reason.as_deref().unwrap_or("no reason given")
                ),
            ),
            StagingState::Waiting | StagingState::Staging => format!(
                "{}  {}",
                progress_bar(node.fetched_bytes, node.total_bytes),
                node.state.as_str()
            ),
        };
        let _ = writeln!(out, "    {:<width$}  {detail}", node.name);
    }
}

/// `[#########---------------]  38.1 MiB / 100.0 MiB`; without a total,
/// the bytes so far.
pub fn progress_bar(fetched: i64, total: Option<i64>) -> String {
    let fetched = fetched.max(0);
    match total.filter(|total| *total > 0) {
        Some(total) => {
            let done = usize::try_from(fetched.min(total).saturating_mul(BAR_CELLS as i64) / total)
                .unwrap_or(0);
            format!(
                "[{}{}]  {} / {}",
                "#".repeat(done),
                "-".repeat(BAR_CELLS - done),
                bytes_text(fetched),
                bytes_text(total)
            )
        }
        None => format!("[{}]  {}", "?".repeat(BAR_CELLS), bytes_text(fetched)),
    }
}

fn bytes_text(bytes: i64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    if bytes < 1024 * 1024 {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB)
    }
}

fn rollout_line(rollout: &RolloutStatus) -> Option<String> {
    let wave = rollout.wave.as_deref()?;
    let mut line = match (rollout.wave_index, rollout.waves) {
        (Some(index), Some(waves)) if index > 0 => format!("wave {wave} ({index} of {waves})"),
        _ => format!("wave {wave}"),
    };
    if let Some(until) = &rollout.baking_until {
        line.push_str(&format!("  bakes until {}", until.0));
    }
    Some(line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use genswap_crds::StagingNode;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;

    #[test]
    fn prestage_draws_a_bar_per_staging_node_and_the_reason_of_each_that_cannot() {
        let prestage = PrestageStatus {
            build: "b2".into(),
            sha256: None,
            since: Time(Timestamp::UNIX_EPOCH),
            done_at: None,
            staged: 1,
            needed: 4,
            fetched_bytes: 50 * 1024 * 1024,
            nodes: vec![
                StagingNode {
                    name: "node-b".into(),
                    state: StagingState::Staging,
                    fetched_bytes: 50 * 1024 * 1024,
                    total_bytes: Some(100 * 1024 * 1024),
                    reason: None,
                },
                StagingNode {
                    name: "c".into(),
                    state: StagingState::Failed,
                    reason: Some("stage: signed by another key".into()),
                    ..StagingNode::default()
                },
                StagingNode {
                    name: "d".into(),
                    state: StagingState::Waiting,
                    ..StagingNode::default()
                },
            ],
        };
        let mut out = String::new();
        prestage_lines(&mut out, &prestage, &Painter(Colour::Off));
        assert_eq!(
            out,
            "  prestage b2  staging  1/4 nodes hold it  fetched 50.0 MiB\n\
             \x20   node-b  [############------------]  50.0 MiB / 100.0 MiB  Staging\n\
             \x20   c       Failed: stage: signed by another key\n\
             \x20   d       [????????????????????????]  0.0 KiB  Waiting\n"
        );
    }
}
