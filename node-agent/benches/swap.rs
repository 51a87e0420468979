//! 100 overlap swaps of the testapp on real cgroup v2, and what they cost,
//! under the default sandbox (SPEC 5.16) and then under the least of it a
//! spec can ask for (`filesystem: Host`, `seccomp: Unconfined`), in one run.
//!
//! Prints, per step, the median and 99th percentile of the time spent, the
//! whole swap's, and the agent's own overhead: the swap's duration minus the
//! successor's boot-to-first-healthy time (its health step: from the exec's
//! return to the first answer below 500). It asserts nothing on time.
//!
//! The run dir is a tmpfs, as a node's `/run` is; the journal and the logs
//! stay on the temp dir's filesystem, as `/var/lib` and `/var/log` do.
//!
//! `cargo bench -p node-agent --bench swap` (root, cgroup v2). `SWAPS=n`
//! changes the count.

#[path = "../tests/support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/figures.rs"]
mod figures;
#[path = "../tests/support/swap_host.rs"]
mod swap_host;

use std::time::{Duration, Instant};

use figures::print_row;
use genswap_crds::Outcome;
use node_agent::engine::{Step, SwapResult};
use swap_host::SwapHost;

const DEFAULT_SWAPS: usize = 100;
const STEPS: [Step; 9] = [
    Step::Stage,
    Step::Admit,
    Step::Raise,
    Step::Journal,
    Step::Spawn,
    Step::Health,
    Step::Settle,
    Step::Switch,
    Step::Retire,
];

fn main() {
    figures::run_counted("SWAPS", DEFAULT_SWAPS, run);
}

async fn run(swaps: usize) {
    for (name, relaxed) in [
        ("default sandbox", false),
        ("Host filesystem, Unconfined", true),
    ] {
        run_one(swaps, name, relaxed).await;
    }
}

async fn run_one(swaps: usize, name: &str, relaxed: bool) {
    let host = SwapHost::with_run_dir_in_memory("bench");
    // Two builds alternate, so every swap changes the build.
    let builds = [host.build("bench-even"), host.build("bench-odd")];
    let names = ["bench-even", "bench-odd"];
    let attempt = |rev: i64, which: usize| {
        let mut attempt = host.attempt(rev, &builds[which], names[which]);
        if relaxed {
            attempt.spec.process.filesystem = Some(genswap_crds::FilesystemProfile::Host);
            attempt.spec.process.seccomp = Some(genswap_crds::SeccompProfile::Unconfined);
        }
        attempt
    };
    let install = host.swap(&attempt(1, 1)).await;
    assert_eq!(install.outcome, Outcome::Done, "install: {install:?}");
    acknowledge(&host, 1);

    let mut results: Vec<SwapResult> = Vec::with_capacity(swaps);
    let wall = Instant::now();
    for i in 0..swaps {
        let rev = i64::try_from(i).expect("a small count") + 2;
        let result = host.swap(&attempt(rev, i % 2)).await;
        assert_eq!(result.outcome, Outcome::Done, "swap {rev}: {result:?}");
        acknowledge(&host, rev);
        results.push(result);
    }
    let wall = wall.elapsed();
    host.tear_down().await;

    println!(
        "{swaps} overlap swaps of the testapp, {name}, in {:.2?} ({})",
        wall,
        figures::build_and_mount()
    );
    println!("{:<28} {:>10} {:>10} {:>10}", "step", "p50", "p99", "max");
    for step in STEPS {
        if !results
            .iter()
            .any(|r| r.steps.iter().any(|s| s.step == step))
        {
            continue;
        }
        print_row(
            step.as_str(),
            results.iter().map(|r| r.step_duration(step)).collect(),
        );
    }
    let total: Vec<Duration> = results.iter().map(total_of).collect();
    let overhead: Vec<Duration> = results
        .iter()
        .map(|r| total_of(r).saturating_sub(r.step_duration(Step::Health)))
        .collect();
    let overhead_without_drain: Vec<Duration> = results
        .iter()
        .map(|r| {
            total_of(r)
                .saturating_sub(r.step_duration(Step::Health))
                .saturating_sub(r.drain.unwrap_or_default())
        })
        .collect();
    print_row("whole swap", total);
    print_row(
        "drain (retiring gen)",
        results.iter().filter_map(|r| r.drain).collect(),
    );
    print_row("agent overhead", overhead);
    print_row("overhead without drain", overhead_without_drain);
}

/// What an adapter does once the outcome is reported: without it every
/// outcome stays in the journal file, and each write rewrites all of them.
fn acknowledge(host: &SwapHost, rev: i64) {
    host.engine
        .journal()
        .acknowledge(&host.instance, rev)
        .expect("acknowledge the outcome");
}

fn total_of(result: &SwapResult) -> Duration {
    result
        .finished_at
        .duration_since(result.started_at)
        .unwrap_or_default()
}
