//! Standalone mode's intake: from a manifest renamed into the directory to
//! its status file saying the attempt ended `done`, against the engine's
//! own swap on the same host, in the same minute.
//!
//! Each round runs one overlap swap straight through the engine (instance
//! `direct`, a gate that always passes) and one through standalone mode
//! (instance `intake`: inotify, parse, plan, state file, engine, status
//! file). Both use the same engine, store and cgroup subtree. Prints the
//! median and 99th percentile of both and of their difference per round.
//! It asserts nothing on time.
//!
//! `cargo bench -p node-agent --bench intake` (root, cgroup v2).
//! `ROUNDS=n` changes the count.

#[path = "../tests/support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/figures.rs"]
mod figures;
#[path = "../tests/standalone_support/mod.rs"]
mod standalone_support;
#[path = "../tests/support/swap_host.rs"]
mod swap_host;

use std::time::Instant;

use figures::print_row;
use genswap_crds::Outcome;
use node_agent::engine::{Attempt, Cancel};
use standalone_support::{Manifest, StandaloneHost, key};
use swap_host::{OpenGate, spec};

const DEFAULT_ROUNDS: usize = 50;
const FILE: &str = "intake.yaml";

fn main() {
    figures::run_counted("ROUNDS", DEFAULT_ROUNDS, run);
}

async fn run(rounds: usize) {
    let host = StandaloneHost::start("bench-intake");
    let builds = [host.build("bench-even"), host.build("bench-odd")];
    let names = ["bench-even", "bench-odd"];
    let direct = key("direct");
    let engine = &host.host.engine;

    let install = engine
        .swap(
            &direct_attempt(&direct, 1, &builds[1], names[1]),
            &OpenGate,
            &Cancel::new(),
        )
        .await;
    assert_eq!(install.outcome, Outcome::Done, "install: {install:?}");
    acknowledge(&host, &direct, 1);
    host.write(FILE, &Manifest::new("intake", names[1], &builds[1]).yaml());
    let mut last_rev = host
        .settled_after(FILE, 0)
        .await
        .last_attempt()
        .map_or(0, |a| a.sched_rev);

    let mut engine_swaps = Vec::with_capacity(rounds);
    let mut intake_swaps = Vec::with_capacity(rounds);
    let mut differences = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let which = round % 2;
        let rev = i64::try_from(round).expect("a small count") + 2;
        let began = Instant::now();
        let result = engine
            .swap(
                &direct_attempt(&direct, rev, &builds[which], names[which]),
                &OpenGate,
                &Cancel::new(),
            )
            .await;
        let engine_swap = began.elapsed();
        assert_eq!(
            result.outcome,
            Outcome::Done,
            "direct swap {rev}: {result:?}"
        );
        acknowledge(&host, &direct, rev);

        let began = Instant::now();
        host.write(
            FILE,
            &Manifest::new("intake", names[which], &builds[which]).yaml(),
        );
        let status = host.settled_after(FILE, last_rev).await;
        let intake_swap = began.elapsed();
        let last = status.last_attempt().expect("a last attempt");
        assert_eq!(last.outcome, Outcome::Done, "standalone swap: {status:?}");
        last_rev = last.sched_rev;

        engine_swaps.push(engine_swap);
        intake_swaps.push(intake_swap);
        differences.push(intake_swap.saturating_sub(engine_swap));
    }

    println!(
        "{rounds} rounds of one engine swap and one standalone swap ({})",
        figures::build_and_mount()
    );
    println!("{:<28} {:>10} {:>10} {:>10}", "", "p50", "p99", "max");
    print_row("engine's whole swap", engine_swaps);
    print_row("manifest to status done", intake_swaps);
    print_row("intake's part (per round)", differences);
    engine
        .stop_instance(&direct, &spec(1, &builds[0], names[0]).stop)
        .await
        .expect("stop the direct instance");
    host.stop().await;
}

fn direct_attempt(
    instance: &node_agent::gate::InstanceKey,
    rev: i64,
    build: &testapp::Build,
    id: &str,
) -> Attempt {
    Attempt {
        instance: instance.clone(),
        name: format!("direct-node-a-{rev}"),
        spec: spec(rev, build, id),
        restart: None,
    }
}

fn acknowledge(host: &StandaloneHost, instance: &node_agent::gate::InstanceKey, rev: i64) {
    host.host
        .engine
        .journal()
        .acknowledge(instance, rev)
        .expect("acknowledge the outcome");
}
