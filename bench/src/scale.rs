//! Scale: the controller's scheduler bench (run as it is, its table carried
//! over), and one `node-agent standalone` with many instances on this node:
//! its RSS and CPU while idle, concurrent swaps of different instances, and
//! a restart of the agent with every instance left running.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, SystemTime};

use genswap_crds::{ConditionType, Mode, Outcome};
use serde::{Deserialize, Serialize};

use crate::agent::{Agent, AgentDirs, manifest};
use crate::clock::mono_ns;
use crate::http1::{Connection, Target};
use crate::sandbox;
use crate::stats::Spread;
use crate::{BenchError, Binaries};

/// How long the installs of all instances may take.
const INSTALL_DEADLINE: Duration = Duration::from_secs(600);

/// What to run.
#[derive(Clone, Debug)]
pub struct ScaleOptions {
    /// Instances on the node.
    pub instances: usize,
    /// How long the idle agent is watched.
    pub idle: Duration,
    /// Instances swapped at once.
    pub concurrent: usize,
    /// Run the scheduler bench's smoke case instead of the full one.
    pub scheduler_smoke: bool,
}

/// The agent's resource use over a window.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Usage {
    /// The window, seconds.
    pub seconds: f64,
    /// CPU time (user + system) spent in it, ms.
    pub cpu_ms: f64,
    /// CPU as a share of one core, percent.
    pub cpu_percent: f64,
    /// VmRSS at the end, KiB.
    pub rss_kib: u64,
    /// VmHWM (peak RSS) at the end, KiB.
    pub hwm_kib: u64,
    /// Threads.
    pub threads: u64,
    /// Voluntary context switches in the window (wake-ups).
    pub wakeups: u64,
}

/// Concurrent swaps of different instances.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Concurrent {
    /// How many.
    pub swaps: usize,
    /// Those that ended `done`.
    pub done: usize,
    /// From the manifests written to the last status showing its outcome, ms.
    pub wall_ms: f64,
    /// Per swap: the engine's steps summed, ms.
    pub per_swap: Spread,
    /// Per swap: the agent's overhead (steps minus health), ms.
    pub overhead: Spread,
}

/// The agent after a restart.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Restart {
    /// From the new agent's start to every status file rewritten, ms.
    pub all_status_ms: f64,
    /// Of those, the instances whose status says Ready.
    pub ready: usize,
    /// Instances that answered through `current.sock` afterwards.
    pub answering: usize,
    /// Processes in the subtree before the restart and after it.
    pub processes_before: usize,
    /// After.
    pub processes_after: usize,
    /// Whether the engine code has crash recovery (`engine/recover.rs`).
    pub engine_recovers: bool,
    /// The concurrent swaps run after the restart.
    pub swaps_after: Concurrent,
    /// Processes after those swaps (one per instance when every serving
    /// generation was adopted; more when old ones were left beside new).
    pub processes_after_swaps: usize,
}

/// The scale figures.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ScaleReport {
    /// The scheduler bench's output, as printed.
    pub scheduler: String,
    /// Instances.
    pub instances: usize,
    /// Writing every manifest to every instance Ready, ms.
    pub install_all_ms: f64,
    /// The agent idle with every instance serving.
    pub idle: Usage,
    /// The instances' mean RSS, KiB.
    pub instance_rss_kib: u64,
    /// Concurrent swaps.
    pub concurrent: Concurrent,
    /// The restart.
    pub restart: Restart,
}

/// Runs the scale benchmark.
pub async fn run(
    binaries: &Binaries,
    cgroup_parent: &Path,
    options: &ScaleOptions,
) -> Result<ScaleReport, BenchError> {
    println!("\nScale: the controller's scheduler bench ...");
    let scheduler = scheduler_bench(options.scheduler_smoke);
    println!("{scheduler}");
    println!(
        "Scale: {} instances under one standalone agent ...",
        options.instances
    );
    let sandbox = sandbox::create(cgroup_parent, "scale")?;
    let dirs = AgentDirs::create(&sandbox)?;
    let builds = [
        testapp::make_build(&dirs.staging, "scale-a").map_err(BenchError::Build)?,
        testapp::make_build(&dirs.staging, "scale-b").map_err(BenchError::Build)?,
        testapp::make_build(&dirs.staging, "scale-c").map_err(BenchError::Build)?,
    ];
    let names: Vec<String> = (0..options.instances).map(|i| format!("i{i:04}")).collect();
    let mut agent = Agent::start(&binaries.agent, &dirs, false)?;
    let mut report = ScaleReport {
        scheduler,
        instances: options.instances,
        ..ScaleReport::default()
    };

    let begin = mono_ns();
    for name in &names {
        agent.write_manifest(name, &manifest(name, "scale-a", &builds[0], Mode::Overlap))?;
    }
    for name in &names {
        let doc = agent.wait_attempt_after(name, 0, INSTALL_DEADLINE).await?;
        if doc.last_attempt().map(|a| a.outcome) != Some(Outcome::Done) {
            return Err(BenchError::Agent(format!(
                "{name} was not installed: {doc:?}"
            )));
        }
    }
    report.install_all_ms = (mono_ns() - begin) as f64 / 1e6;
    agent.check_alive()?;
    println!(
        "  installed {} instances in {:.0} ms",
        names.len(),
        report.install_all_ms
    );

    // Let the last writes and reaps settle before the idle window.
    tokio::time::sleep(Duration::from_secs(2)).await;
    report.idle = idle_usage(agent.pid(), options.idle).await?;
    report.instance_rss_kib = mean_rss_kib(sandbox.cgroup());
    println!(
        "  idle {:.0} s: agent CPU {:.1} ms ({:.3} %), RSS {} KiB, {} wake-ups",
        report.idle.seconds,
        report.idle.cpu_ms,
        report.idle.cpu_percent,
        report.idle.rss_kib,
        report.idle.wakeups
    );

    let swapped = &names[..options.concurrent.min(names.len())];
    report.concurrent = concurrent_swaps(&agent, swapped, "scale-b", &builds[1]).await?;
    println!(
        "  {} concurrent swaps: {} done, wall {:.0} ms, per swap p50/p99 {} ms",
        report.concurrent.swaps,
        report.concurrent.done,
        report.concurrent.wall_ms,
        report.concurrent.per_swap.text2()
    );

    // Restart: the instances keep running while no agent runs.
    let processes_before = sandbox.processes();
    agent.stop()?;
    let restarted_wall = SystemTime::now();
    let restarted = mono_ns();
    let mut agent = Agent::start(&binaries.agent, &dirs, false)?;
    let status_dir = dirs.manifests.join("status");
    loop {
        let fresh = names
            .iter()
            .filter(|n| {
                fs::metadata(status_dir.join(format!("{n}.yaml")))
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t >= restarted_wall)
            })
            .count();
        if fresh == names.len() {
            break;
        }
        agent.check_alive()?;
        if mono_ns() - restarted > INSTALL_DEADLINE.as_nanos() as u64 {
            return Err(BenchError::Agent(format!(
                "after a restart only {fresh} of {} status files were rewritten",
                names.len()
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let all_status_ms = (mono_ns() - restarted) as f64 / 1e6;
    let mut ready = 0;
    for name in &names {
        let path = status_dir.join(format!("{name}.yaml"));
        if node_agent::standalone::StatusDocument::read(&path)
            .is_ok_and(|d| d.is_true(ConditionType::Ready))
        {
            ready += 1;
        }
    }
    let answering = names
        .iter()
        .filter(|n| {
            Connection::open(&Target::Unix(dirs.current_sock(n)), Duration::from_secs(2))
                .and_then(|mut c| c.get(true))
                .is_ok_and(|r| r.status == 200)
        })
        .count();
    let processes_after = sandbox.processes();
    let later = &names[names.len() - swapped.len()..];
    let swaps_after = concurrent_swaps(&agent, later, "scale-c", &builds[2]).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    report.restart = Restart {
        all_status_ms,
        ready,
        answering,
        processes_before,
        processes_after,
        engine_recovers: engine_recovers(),
        swaps_after,
        processes_after_swaps: sandbox.processes(),
    };
    println!(
        "  restart: every status rewritten in {:.0} ms, {} Ready, {} answering, processes {} -> {} -> {} after {} swaps",
        report.restart.all_status_ms,
        report.restart.ready,
        report.restart.answering,
        report.restart.processes_before,
        report.restart.processes_after,
        report.restart.processes_after_swaps,
        report.restart.swaps_after.swaps,
    );
    agent.stop()?;
    drop(sandbox);
    Ok(report)
}

async fn concurrent_swaps(
    agent: &Agent,
    names: &[String],
    build_id: &str,
    build: &testapp::Build,
) -> Result<Concurrent, BenchError> {
    let mut revs = Vec::new();
    for name in names {
        let path = agent
            .dirs
            .manifests
            .join("status")
            .join(format!("{name}.yaml"));
        let rev = node_agent::standalone::StatusDocument::read(&path)
            .ok()
            .and_then(|d| d.last_attempt().map(|a| a.sched_rev))
            .unwrap_or(0);
        revs.push(rev);
    }
    let begin = mono_ns();
    for name in names {
        agent.write_manifest(name, &manifest(name, build_id, build, Mode::Overlap))?;
    }
    let mut per_swap = Vec::new();
    let mut overhead = Vec::new();
    let mut done = 0;
    for (name, rev) in names.iter().zip(revs) {
        let doc = agent
            .wait_attempt_after(name, rev, INSTALL_DEADLINE)
            .await?;
        let Some(last) = doc.last_attempt() else {
            continue;
        };
        if last.outcome == Outcome::Done {
            done += 1;
        }
        if let Some(attempt) = doc.attempt(last.sched_rev) {
            let total: i64 = attempt.status.steps.iter().map(|s| s.millis).sum();
            let health: i64 = attempt
                .status
                .steps
                .iter()
                .filter(|s| s.step == "health")
                .map(|s| s.millis)
                .sum();
            per_swap.push(total as f64);
            overhead.push((total - health) as f64);
        }
    }
    Ok(Concurrent {
        swaps: names.len(),
        done,
        wall_ms: (mono_ns() - begin) as f64 / 1e6,
        per_swap: Spread::of(per_swap),
        overhead: Spread::of(overhead),
    })
}

/// CPU, RSS and wake-ups of `pid` over `window`.
async fn idle_usage(pid: u32, window: Duration) -> Result<Usage, BenchError> {
    let read = || -> Result<(u64, u64), BenchError> {
        let ticks = cpu_ticks(pid)
            .ok_or_else(|| BenchError::Agent(format!("/proc/{pid}/stat is unreadable")))?;
        let switches =
            status_field(pid, "voluntary_ctxt_switches:").unwrap_or(0) + thread_switches(pid);
        Ok((ticks, switches))
    };
    let (ticks_before, switches_before) = read()?;
    let begin = mono_ns();
    tokio::time::sleep(window).await;
    let (ticks_after, switches_after) = read()?;
    let seconds = (mono_ns() - begin) as f64 / 1e9;
    let ticks_per_second = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64;
    let cpu_ms = (ticks_after - ticks_before) as f64 / ticks_per_second * 1000.0;
    Ok(Usage {
        seconds,
        cpu_ms,
        cpu_percent: cpu_ms / (seconds * 1000.0) * 100.0,
        rss_kib: status_field(pid, "VmRSS:").unwrap_or(0),
        hwm_kib: status_field(pid, "VmHWM:").unwrap_or(0),
        threads: status_field(pid, "Threads:").unwrap_or(0),
        wakeups: switches_after.saturating_sub(switches_before),
    })
}

/// utime + stime of every thread, from /proc/<pid>/stat.
pub(crate) fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which may hold spaces, in parentheses.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line; 12 and 13 after ')'.
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// A `key: value [kB]` line of /proc/<pid>/status.
pub(crate) fn status_field(pid: u32, key: &str) -> Option<u64> {
    status_field_at(&format!("/proc/{pid}/status"), key)
}

fn status_field_at(path: &str, key: &str) -> Option<u64> {
    fs::read_to_string(path)
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(key))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// Voluntary context switches of every thread but the main one (whose
/// count /proc/<pid>/status gives).
fn thread_switches(pid: u32) -> u64 {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .filter(|t| t.file_name().to_str() != Some(&pid.to_string()))
        .filter_map(|t| {
            status_field_at(
                &t.path().join("status").to_string_lossy(),
                "voluntary_ctxt_switches:",
            )
        })
        .sum()
}

/// The mean VmRSS of the processes in a cgroup subtree.
fn mean_rss_kib(cgroup: &Path) -> u64 {
    let mut pids = Vec::new();
    collect_pids(cgroup, &mut pids);
    let total: u64 = pids
        .iter()
        .filter_map(|pid| status_field(*pid, "VmRSS:"))
        .sum();
    total / (pids.len().max(1) as u64)
}

fn collect_pids(cgroup: &Path, pids: &mut Vec<u32>) {
    if let Ok(procs) = fs::read_to_string(cgroup.join("cgroup.procs")) {
        pids.extend(procs.lines().filter_map(|l| l.parse::<u32>().ok()));
    }
    if let Ok(entries) = fs::read_dir(cgroup) {
        for entry in entries.filter_map(Result::ok) {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                collect_pids(&entry.path(), pids);
            }
        }
    }
}

/// Whether this checkout's engine has crash recovery.
fn engine_recovers() -> bool {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../node-agent/src/engine/recover.rs")
        .is_file()
}

/// `cargo bench -p controller --bench scheduler` (its smoke case with
/// `-- --test`), its output as printed.
fn scheduler_bench(smoke: bool) -> String {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let mut command = Command::new(cargo);
    command
        .args(["bench", "-q", "-p", "controller", "--bench", "scheduler"])
        .arg("--manifest-path")
        .arg(&manifest);
    // The same target dir as this program, so nothing is built twice.
    if let Some(target) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent()?.parent().map(Path::to_path_buf))
    {
        command.arg("--target-dir").arg(target);
    }
    if smoke {
        command.args(["--", "--test"]);
    }
    match command.output() {
        Ok(output) if output.status.success() => String::from_utf8_lossy(&output.stdout)
            .trim_end()
            .to_string(),
        Ok(output) => format!(
            "the scheduler bench failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim_end()
        ),
        Err(error) => format!("the scheduler bench could not run (cargo: {error})"),
    }
}
