//! From a SIGKILL of the serving generation to its restart answering
//! through `current.sock` (SPEC 5.10), on real cgroup v2, and what of that
//! is the agent's own.
//!
//! Each round SIGKILLs the serving testapp and sends requests through
//! `current.sock` until one is answered by the new generation. Prints the
//! median and 99th percentile of that time, of the successor's boot (its
//! exec to its first healthy answer, as the restart's health step measures
//! it) and of the difference: noticing the exit, reaping, cleaning up,
//! journaling, spawning and switching. The backoff is reset after every
//! exit (`reset_after` zero), so each kill is restarted at once, as a first
//! exit is. It asserts nothing on time.
//!
//! `cargo bench -p node-agent --bench restart` (root, cgroup v2).
//! `ROUNDS=n` changes the count.

#[path = "../tests/support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/figures.rs"]
mod figures;
#[path = "../tests/support/swap_host.rs"]
mod swap_host;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use figures::print_row;
use node_agent::engine::{EngineConfig, RestartBackoff, Step, StepRecord, SupervisorEvent};
use swap_host::{OpenGate, SwapHost};
use tokio::sync::mpsc;

const DEFAULT_ROUNDS: usize = 50;
const DEADLINE: Duration = Duration::from_secs(30);
const STEPS: [Step; 6] = [
    Step::Stage,
    Step::Admit,
    Step::Journal,
    Step::Spawn,
    Step::Health,
    Step::Switch,
];

fn step_time(steps: &[StepRecord], step: Step) -> Duration {
    steps
        .iter()
        .filter(|s| s.step == step)
        .map(|s| s.duration)
        .sum()
}

fn main() {
    figures::run_counted("ROUNDS", DEFAULT_ROUNDS, run);
}

async fn run(rounds: usize) {
    let config = EngineConfig {
        restart_backoff: RestartBackoff {
            reset_after: Duration::ZERO,
            ..RestartBackoff::default()
        },
        ..EngineConfig::default()
    };
    let host = SwapHost::with_config("bench-restart", config);
    host.install(1, "bench").await;
    let (sender, mut events) = mpsc::unbounded_channel();
    let supervisor = host
        .engine
        .start_supervisor(Arc::new(OpenGate), move |event| {
            let _ = sender.send(event);
        });

    let mut answered = Vec::with_capacity(rounds);
    let mut boots = Vec::with_capacity(rounds);
    let mut overhead = Vec::with_capacity(rounds);
    let mut per_step: BTreeMap<&str, Vec<Duration>> = BTreeMap::new();
    for round in 0..rounds {
        let before = host.who_serves().await.expect("a generation serves");
        let killed = Instant::now();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(before.pid).expect("a pid")),
            nix::sys::signal::Signal::SIGKILL,
        )
        .expect("SIGKILL the serving generation");
        let after = tokio::time::timeout(DEADLINE, async {
            loop {
                match host.who_serves().await {
                    Some(now) if now.generation > before.generation => return now,
                    _ => tokio::time::sleep(Duration::from_millis(1)).await,
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("round {round}: no restart answered in {DEADLINE:?}"));
        let took = killed.elapsed();
        let steps = tokio::time::timeout(DEADLINE, async {
            loop {
                if let Some(SupervisorEvent::Restarted {
                    generation, steps, ..
                }) = events.recv().await
                    && generation == after.generation
                {
                    return steps;
                }
            }
        })
        .await
        .expect("the restart was told");
        let boot = step_time(&steps, Step::Health);
        for step in STEPS {
            per_step
                .entry(step.as_str())
                .or_default()
                .push(step_time(&steps, step));
        }
        answered.push(took);
        boots.push(boot);
        overhead.push(took.saturating_sub(boot));
    }
    drop(supervisor);
    host.tear_down().await;

    println!(
        "{rounds} SIGKILLs of the serving testapp, each restarted ({})",
        figures::build_and_mount()
    );
    println!("{:<28} {:>10} {:>10} {:>10}", "", "p50", "p99", "max");
    for step in STEPS {
        if let Some(samples) = per_step.remove(step.as_str()) {
            print_row(&format!("restart's {step}"), samples);
        }
    }
    print_row("SIGKILL to answering", answered);
    print_row("successor's boot", boots);
    print_row("agent's part", overhead);
}
