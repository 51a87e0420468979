//! The machine, and the figures as Markdown tables (`results.md`) and JSON.

use std::fmt::Write as _;
use std::fs;
use std::path::Path;
use std::process::Command;

use serde::{Deserialize, Serialize};

use crate::scale::ScaleReport;
use crate::stats::{Spread, ms, ratio};
use crate::zero::{Kind, RunFigures, Via, ZeroReport};

/// What the figures were measured on.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Machine {
    /// CPUs available.
    pub nproc: usize,
    /// The CPU model.
    pub cpu: String,
    /// MemTotal, MiB.
    pub memory_mib: u64,
    /// The kernel release.
    pub kernel: String,
    /// The cgroup v2 mount.
    pub cgroup_mount: String,
    /// `nginx -v`.
    pub nginx: String,
    /// release or debug.
    pub profile: String,
}

impl Machine {
    /// Reads this machine.
    pub fn read(mount: &Path) -> Machine {
        let read = |path: &str| fs::read_to_string(path).unwrap_or_default();
        let meminfo = read("/proc/meminfo");
        let memory_kib: u64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0);
        let cpu = read("/proc/cpuinfo")
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .map(|v| v.trim_start_matches([' ', '\t', ':']).trim().to_string())
            .unwrap_or_default();
        let nginx = crate::nginx::binary()
            .and_then(|b| Command::new(b).arg("-v").output().ok())
            .map(|o| String::from_utf8_lossy(&o.stderr).trim().to_string())
            .unwrap_or_else(|| "not installed".into());
        Machine {
            nproc: std::thread::available_parallelism().map_or(0, usize::from),
            cpu,
            memory_mib: memory_kib / 1024,
            kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
            cgroup_mount: mount.display().to_string(),
            nginx,
            profile: if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            }
            .into(),
        }
    }

    /// One line.
    pub fn text(&self) -> String {
        format!(
            "machine: {} CPUs ({}), {} MiB, kernel {}, cgroup v2 at {}, {}, {} build",
            self.nproc,
            self.cpu,
            self.memory_mib,
            self.kernel,
            self.cgroup_mount,
            self.nginx,
            self.profile
        )
    }
}

/// Everything one run of the benchmark measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Results {
    /// The machine.
    pub machine: Machine,
    /// `--quick`.
    pub quick: bool,
    /// Zero downtime under load.
    pub zero: Option<ZeroReport>,
    /// Scale.
    pub scale: Option<ScaleReport>,
}

impl Results {
    /// The tables, in Markdown.
    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "<!-- written by genswap-bench; {} -->",
            if self.quick { "--quick" } else { "full run" }
        );
        let _ = writeln!(out, "{}\n", self.machine.text());
        if let Some(zero) = &self.zero {
            zero_tables(&mut out, zero);
        }
        if let Some(scale) = &self.scale {
            scale_tables(&mut out, scale);
        }
        out
    }
}

fn zero_tables(out: &mut String, zero: &ZeroReport) {
    let _ = writeln!(out, "### Zero downtime under load\n");
    let _ = writeln!(
        out,
        "Latencies in ms as p50 / p99 / max of answered requests. *gap*: the switch instant to the first response from the new generation. *silence*: per swap, the longest time without any answered request. *overhead*: the engine's steps summed minus the successor's boot-to-healthy (its health step). *drain*: the retiring generation's SIGTERM to proven exit (drainMs).\n"
    );
    let mut loads: Vec<String> = zero.runs.iter().map(|r| r.load.name()).collect();
    loads.dedup();
    for load in &loads {
        let _ = writeln!(out, "#### {load}\n");
        let _ = writeln!(
            out,
            "| path | swap | swaps (not done) | sent | failed | reconnects | steady | during swaps | gap p50 / p99 | silence p50 / max | swap p50 / p99 | overhead p50 / p99 | drain p50 / p99 |"
        );
        let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        for run in zero.runs.iter().filter(|r| &r.load.name() == load) {
            let _ = writeln!(
                out,
                "| {} | {} | {} ({}) | {} | {} | {} | {} | {} | {} | {} / {} | {} | {} | {} |",
                run.via.name(),
                run.kind.name(),
                run.swaps,
                run.swaps_not_done,
                run.sent,
                failed_text(run),
                run.reconnects,
                run.steady.text(),
                run.during.text(),
                run.gap.text2(),
                ms(run.silence.p50),
                ms(run.silence.max),
                run.swap_wall.text2(),
                run.overhead.text2(),
                run.drain.text2(),
            );
        }
        let _ = writeln!(out);
    }
    let mut rows = String::new();
    for load in &loads {
        for via in vias_of(zero, load, |_| true) {
            let find = |kind: Kind| find_run(zero, load, via, kind);
            let (Some(o), Some(h), Some(n)) =
                (find(Kind::Overlap), find(Kind::Hold), find(Kind::Naive))
            else {
                continue;
            };
            let _ = writeln!(
                rows,
                "| {load} | {} | {} / {} / {} | {} / {} ({}) / {} ({}) | {} / {} / {} | {} / {} ({}) / {} ({}) |",
                via.name(),
                o.failed,
                h.failed,
                n.failed,
                ms(o.during.p99),
                ms(h.during.p99),
                ratio(h.during.p99, o.during.p99),
                ms(n.during.p99),
                ratio(n.during.p99, o.during.p99),
                spread_p50(&o.gap),
                spread_p50(&h.gap),
                spread_p50(&n.gap),
                ms(o.silence.max),
                ms(h.silence.max),
                ratio(h.silence.max, o.silence.max),
                ms(n.silence.max),
                ratio(n.silence.max, o.silence.max),
            );
        }
    }
    if !rows.is_empty() {
        let _ = writeln!(
            out,
            "#### Side by side: hold and naive restart against overlap\n"
        );
        let _ = writeln!(
            out,
            "| load | path | failed: overlap / hold / naive | p99 during swaps: overlap / hold (ratio) / naive (ratio) | gap p50: overlap / hold / naive | silence max: overlap / hold (ratio) / naive (ratio) |"
        );
        let _ = writeln!(out, "|---|---|---|---|---|---|");
        let _ = writeln!(out, "{rows}");
    }
    listener_table(out, zero, &loads);
    failing_table(out, zero, &loads);
    hold_gap_table(out, zero, &loads);
    udp_table(out, zero, &loads);
    let with_errors: Vec<&RunFigures> = zero
        .runs
        .iter()
        .filter(|r| !r.nginx_errors.is_empty())
        .collect();
    if !with_errors.is_empty() {
        let _ = writeln!(
            out,
            "nginx's error log, upstream lines by run and message (count):\n"
        );
        for run in with_errors {
            let _ = writeln!(
                out,
                "- {}, {}, {}:",
                run.load.name(),
                run.via.name(),
                run.kind.name()
            );
            for (message, count) in &run.nginx_errors {
                let _ = writeln!(out, "  - {count} × `{message}`");
            }
        }
        let _ = writeln!(out);
    }
}

/// The listener kinds against the naive restart through the same path:
/// what they fail, and what a request waits at most in a swap (a hold's
/// gap is latency, not failures).
fn listener_table(out: &mut String, zero: &ZeroReport, loads: &[String]) {
    let runs_of = |kind: Kind| zero.runs.iter().filter(move |r| r.kind == kind);
    if runs_of(Kind::HoldListener)
        .chain(runs_of(Kind::OverlapListener))
        .next()
        .is_none()
    {
        return;
    }
    let _ = writeln!(
        out,
        "#### Side by side: a held TCP listener against the naive restart\n"
    );
    let _ = writeln!(
        out,
        "*slowest per swap*: per swap, the latency of the slowest answered request that started during it (p50 / max over the swaps). The naive restart's row is today's unix-socket app; its gap shows as failures, the listener's as latency.\n"
    );
    let _ = writeln!(
        out,
        "| load | path | failed: hold, listener / overlap, listener / naive | slowest per swap: hold, listener / overlap, listener / naive | silence max: hold, listener / naive |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|");
    for load in loads {
        for via in vias_of(zero, load, Kind::listener) {
            let find = |kind: Kind| find_run(zero, load, via, kind);
            let failed = |r: Option<&RunFigures>| r.map_or("-".into(), |r| r.failed.to_string());
            let slowest = |r: Option<&RunFigures>| {
                r.map_or("-".into(), |r| {
                    format!("{} / {}", spread_p50(&r.slowest), ms(r.slowest.max))
                })
            };
            let silence = |r: Option<&RunFigures>| r.map_or("-".into(), |r| ms(r.silence.max));
            let (h, o, n) = (
                find(Kind::HoldListener),
                find(Kind::OverlapListener),
                find(Kind::Naive),
            );
            let _ = writeln!(
                out,
                "| {load} | {} | {} / {} / {} | {} · {} · {} | {} / {} |",
                via.name(),
                failed(h),
                failed(o),
                failed(n),
                slowest(h),
                slowest(o),
                slowest(n),
                silence(h),
                silence(n),
            );
        }
    }
    let _ = writeln!(out);
}

/// Overlaps where every 10th build fails its health check, on a steered
/// listener and on a shared one: what the failing builds answered.
fn failing_table(out: &mut String, zero: &ZeroReport, loads: &[String]) {
    let failing = |kind: Kind| kind.fails_every_10th();
    if !zero.runs.iter().any(|r| failing(r.kind)) {
        return;
    }
    let _ = writeln!(
        out,
        "#### Side by side: failing successors on a steered and on a shared listener\n"
    );
    let _ = writeln!(
        out,
        "Every 10th build answers 500 to everything, so its health check fails within 2 s and the attempt is `failed`. *answered by a failing build*: requests that got its 500; *failed*: any other failure.\n"
    );
    let _ = writeln!(
        out,
        "| load | path | swaps (failed) | answered by a failing build: steered / shared | failed: steered / shared | sent: steered / shared |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|");
    for load in loads {
        for via in vias_of(zero, load, failing) {
            let steered = find_run(zero, load, via, Kind::FailingSteered);
            let shared = find_run(zero, load, via, Kind::FailingShared);
            let show = |r: Option<&RunFigures>, f: &dyn Fn(&RunFigures) -> String| {
                r.map_or_else(|| "-".to_string(), f)
            };
            let _ = writeln!(
                out,
                "| {load} | {} | {} | {} / {} | {} / {} | {} / {} |",
                via.name(),
                show(steered.or(shared), &|r| format!(
                    "{} ({})",
                    r.swaps, r.swaps_not_done
                )),
                show(steered, &|r| r.answered_by_failing.to_string()),
                show(shared, &|r| r.answered_by_failing.to_string()),
                show(steered, &|r| r.failed.to_string()),
                show(shared, &|r| r.failed.to_string()),
                show(steered, &|r| r.sent.to_string()),
                show(shared, &|r| r.sent.to_string()),
            );
        }
    }
    let _ = writeln!(out);
}

/// DNS-like queries through swaps of an instance on a UDP listener.
fn udp_table(out: &mut String, zero: &ZeroReport, loads: &[String]) {
    if !zero.runs.iter().any(|r| r.kind.udp()) {
        return;
    }
    let _ = writeln!(out, "#### DNS-like queries on a UDP listener\n");
    let _ = writeln!(
        out,
        "Each query is one datagram and waits up to 2 s for its answer; one without is *lost*. Half the clients send from one socket each, half from a fresh one per query. *slowest per swap*: per swap, the slowest answered query that started during it (p50 / max over the swaps).\n"
    );
    let _ = writeln!(
        out,
        "| load | swap | swaps (not done) | queries | lost | lost per swap | slowest per swap | silence p50 / max |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|");
    for load in loads {
        for run in zero
            .runs
            .iter()
            .filter(|r| &r.load.name() == load && r.kind.udp())
        {
            let per_swap = if run.swaps == 0 {
                "-".into()
            } else {
                format!("{:.2}", run.failed as f64 / run.swaps as f64)
            };
            let _ = writeln!(
                out,
                "| {load} | {} | {} ({}) | {} | {} | {per_swap} | {} / {} | {} / {} |",
                run.kind.name(),
                run.swaps,
                run.swaps_not_done,
                run.sent,
                failed_text(run),
                spread_p50(&run.slowest),
                ms(run.slowest.max),
                spread_p50(&run.silence),
                ms(run.silence.max),
            );
        }
    }
    let _ = writeln!(out);
}

/// The steps inside a hold's gap, as the status names them: the stop, the
/// limits, the durable record before the exec, the spawn and the health
/// check (the successor accepts during it).
const HOLD_GAP_STEPS: [&str; 5] = ["stop", "raise", "journal 2", "spawn", "health"];

/// Holds beside the naive restart: their silence, and what the agent does
/// inside a hold's gap.
fn hold_gap_table(out: &mut String, zero: &ZeroReport, loads: &[String]) {
    let holds = |kind: Kind| matches!(kind, Kind::Hold | Kind::HoldListener);
    if !zero.runs.iter().any(|r| holds(r.kind)) {
        return;
    }
    let _ = writeln!(
        out,
        "#### Where a hold's gap goes
"
    );
    let _ = writeln!(
        out,
        "p50 per swap, in ms. The steps come from the attempt's status, in whole ms. *stop*: stop asked to the old generation proven gone (its drain inside); *journal 2*: the durable record before the exec; *health*: exec to the first good health answer (with a listener the successor accepts during it). The naive restart's *stop* is SIGTERM to `waitpid`, its *health* the exit to the first answer.\n"
    );
    let _ = writeln!(
        out,
        "| load | path | swap | silence p50 (naive + 5 ms) | {} |",
        HOLD_GAP_STEPS.join(" | ")
    );
    let _ = writeln!(
        out,
        "|---|---|---|---|{}",
        "---|".repeat(HOLD_GAP_STEPS.len())
    );
    for load in loads {
        for via in vias_of(zero, load, holds) {
            let naive = find_run(zero, load, via, Kind::Naive);
            let budget = naive.map(|n| n.silence.p50 + 5.0);
            for kind in [Kind::HoldListener, Kind::Hold, Kind::Naive] {
                let Some(run) = find_run(zero, load, via, kind) else {
                    continue;
                };
                let within = match budget {
                    Some(budget) if kind != Kind::Naive => {
                        let word = if run.silence.p50 <= budget {
                            "within"
                        } else {
                            "over"
                        };
                        format!(" ({word} {})", ms(budget))
                    }
                    _ => String::new(),
                };
                let steps: Vec<String> = HOLD_GAP_STEPS
                    .iter()
                    .map(|step| match (kind, *step) {
                        (Kind::Naive, "stop") => spread_p50(&run.drain),
                        (Kind::Naive, "health") => spread_p50(&run.boot_to_healthy),
                        (Kind::Naive, _) => "-".into(),
                        _ => run
                            .steps
                            .iter()
                            .find(|(name, _)| name == step)
                            .map_or("-".into(), |(_, spread)| spread_p50(spread)),
                    })
                    .collect();
                let _ = writeln!(
                    out,
                    "| {load} | {} | {} | {}{within} | {} |",
                    via.name(),
                    kind.name(),
                    spread_p50(&run.silence),
                    steps.join(" | ")
                );
            }
        }
    }
    let _ = writeln!(out);
}

/// The paths of the runs at `load` of a kind `wanted` takes, in run order.
fn vias_of(zero: &ZeroReport, load: &str, wanted: impl Fn(Kind) -> bool) -> Vec<Via> {
    let mut vias: Vec<Via> = zero
        .runs
        .iter()
        .filter(|r| r.load.name() == load && wanted(r.kind))
        .map(|r| r.via)
        .collect();
    vias.dedup();
    vias
}

/// The run of `kind` through `via` at `load`.
fn find_run<'a>(zero: &'a ZeroReport, load: &str, via: Via, kind: Kind) -> Option<&'a RunFigures> {
    zero.runs
        .iter()
        .find(|r| r.load.name() == load && r.via == via && r.kind == kind)
}

fn spread_p50(spread: &Spread) -> String {
    if spread.count == 0 {
        "-".into()
    } else {
        ms(spread.p50)
    }
}

fn failed_text(run: &RunFigures) -> String {
    if run.failed == 0 {
        return "0".into();
    }
    let causes: Vec<String> = run
        .failures
        .iter()
        .map(|(c, n)| format!("{c} {n}"))
        .collect();
    format!(
        "{} ({}; keep-alive {}, per-request {})",
        run.failed,
        causes.join(", "),
        run.failed_by_group.0,
        run.failed_by_group.1
    )
}

fn scale_tables(out: &mut String, scale: &ScaleReport) {
    let _ = writeln!(out, "### Scale\n");
    let _ = writeln!(
        out,
        "Controller: `cargo bench -p controller --bench scheduler`, as it printed:\n"
    );
    let _ = writeln!(out, "```text\n{}\n```\n", scale.scheduler);
    let r = &scale.restart;
    let _ = writeln!(
        out,
        "Agent: {} instances under one `node-agent standalone` on this node:\n",
        scale.instances
    );
    let _ = writeln!(out, "| figure | value |");
    let _ = writeln!(out, "|---|---|");
    let rows = [
        (
            "install all (manifests written to every status Ready)",
            format!("{} ms", ms(scale.install_all_ms)),
        ),
        (
            "agent idle: CPU",
            format!(
                "{} ms over {:.0} s ({:.3} % of a core)",
                ms(scale.idle.cpu_ms),
                scale.idle.seconds,
                scale.idle.cpu_percent
            ),
        ),
        (
            "agent idle: wake-ups (voluntary context switches, all threads)",
            format!("{} over {:.0} s", scale.idle.wakeups, scale.idle.seconds),
        ),
        (
            "agent idle: RSS (VmRSS) / peak (VmHWM)",
            format!(
                "{:.1} MiB / {:.1} MiB",
                scale.idle.rss_kib as f64 / 1024.0,
                scale.idle.hwm_kib as f64 / 1024.0
            ),
        ),
        ("agent threads", scale.idle.threads.to_string()),
        (
            "instance RSS (mean, test app)",
            format!("{:.1} MiB", scale.instance_rss_kib as f64 / 1024.0),
        ),
        (
            "concurrent overlap swaps of different instances",
            format!(
                "{} ({} done), wall {} ms, per swap p50 / p99 {} ms, overhead p50 / p99 {} ms",
                scale.concurrent.swaps,
                scale.concurrent.done,
                ms(scale.concurrent.wall_ms),
                scale.concurrent.per_swap.text2(),
                scale.concurrent.overhead.text2()
            ),
        ),
        (
            "restart: new agent start to every status file rewritten",
            format!("{} ms ({} Ready)", ms(r.all_status_ms), r.ready),
        ),
        (
            "restart: instances answering through current.sock afterwards",
            format!("{} of {}", r.answering, scale.instances),
        ),
        (
            "restart: processes in the subtree before / after",
            format!("{} / {}", r.processes_before, r.processes_after),
        ),
        (
            "after the restart: concurrent swaps",
            format!(
                "{} ({} done), wall {} ms, per swap p50 / p99 {} ms",
                r.swaps_after.swaps,
                r.swaps_after.done,
                ms(r.swaps_after.wall_ms),
                r.swaps_after.per_swap.text2()
            ),
        ),
        (
            "after those swaps: processes in the subtree",
            format!(
                "{} (one per instance when every generation was adopted)",
                r.processes_after_swaps
            ),
        ),
        (
            "engine crash recovery present in this checkout",
            r.engine_recovers.to_string(),
        ),
    ];
    for (name, value) in rows {
        let _ = writeln!(out, "| {name} | {value} |");
    }
    let _ = writeln!(out);
}
