//! Kills at random instants (SPEC 5.7, issue 7): swap after swap, a real
//! `node-agent standalone` process is given a new desired build and
//! SIGKILLed after a random delay (anywhere from its start-up and its own
//! recovery through staging, the spawn, health, settle, the switch and the
//! retirement), then a new agent recovers and finishes the job. After every
//! swap: exactly one generation of the desired build answers through
//! `current.sock`, only its cgroup, socket and processes are left, every
//! attempt has its one outcome in the status file, and the journal holds
//! nothing more. A client sends requests through `current.sock` the whole
//! time and every one is answered: in an overlap, a cut before the switch
//! leaves the incumbent serving and one after it retires the old
//! generation with its stop signal, so no step explains a failed request.
//!
//! `cargo test` runs a few swaps; the 50-swap loop is
//! `cargo test -p node-agent --test crash_random -- --ignored`.
//! `GENSWAP_KILL_SEED=<n>` replays the delays of a run (each run prints
//! its seed).

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "crash_support/mod.rs"]
mod crash_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crash_support::{Client, Crash, Manifest, Node, quiet};
use genswap_crds::{ConditionType, Outcome};
use node_agent::journal::Journal;

/// Delays are drawn from `0..MAX_DELAY_MS`: long enough to cover a whole
/// swap of the debug build (agent start, recovery, stage, spawn, health,
/// switch, retire).
const MAX_DELAY_MS: u64 = 600;

/// A small xorshift generator: reproducible from its seed, no dependency.
struct Delays(u64);

impl Delays {
    fn next_ms(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % MAX_DELAY_MS
    }
}

fn seed() -> u64 {
    std::env::var("GENSWAP_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        })
        | 1
}

async fn kill_loop(tag: &str, swaps: usize) {
    let seed = seed();
    println!("GENSWAP_KILL_SEED={seed}");
    let mut delays = Delays(seed);
    let node = Node::new(tag);
    let builds = [node.build("a"), node.build("b")];
    let manifest = |i: usize| {
        let mut manifest = Manifest::new(&format!("b{i}"), &builds[i % 2], "overlap");
        manifest.settle_seconds = 0;
        manifest
    };

    node.write(&manifest(0));
    let mut agent = node.start(Crash::No);
    node.status("the install", |doc| {
        quiet(doc) && doc.is_true(ConditionType::Ready)
    })
    .await;
    agent.terminate().await;
    let client = Client::start(node.current_sock());

    let mut kinds: Vec<String> = Vec::new();
    let journal = Journal::open(&node.state_dir).expect("the journal");
    for i in 1..=swaps {
        let mut agent = node.start(Crash::No);
        node.write(&manifest(i));
        // Odd swaps: from the manifest's write, so the kill may land in the
        // agent's start-up and recovery too. Even swaps: from the moment the
        // engine journaled the attempt, so most kills land inside the swap.
        let delay = if i % 2 == 0 {
            let started = Instant::now();
            while started.elapsed() < crash_support::DEADLINE
                && !journal
                    .load(&node.key)
                    .is_ok_and(|r| r.is_some_and(|r| r.outcome.is_none()))
            {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            delays.next_ms() / 4
        } else {
            delays.next_ms()
        };
        tokio::time::sleep(Duration::from_millis(delay)).await;
        agent.kill();

        let mut agent = node.start(Crash::No);
        agent.wait_recovered().await;
        let build = format!("b{i}");
        let doc = node
            .status(
                &format!("swap {i} (killed after {delay} ms) to end"),
                |doc| {
                    quiet(doc)
                        && doc.is_true(ConditionType::Ready)
                        && doc
                            .status
                            .desired
                            .as_ref()
                            .is_some_and(|d| d.build == build)
                },
            )
            .await;
        // Every attempt of this swap has exactly one outcome, and only an
        // interrupted one may be anything but done.
        let outcomes: Vec<(i64, Outcome)> = doc
            .attempts
            .iter()
            .filter(|a| a.build == build)
            .filter_map(|a| a.status.outcome.map(|o| (a.sched_rev, o)))
            .collect();
        assert!(
            outcomes.last().is_some_and(|(_, o)| *o == Outcome::Done),
            "swap {i} (killed after {delay} ms, seed {seed}) ended {outcomes:?}"
        );
        assert!(
            outcomes
                .iter()
                .all(|(_, o)| matches!(o, Outcome::Done | Outcome::Abandoned)),
            "swap {i} (killed after {delay} ms, seed {seed}): an overlap cut by a kill is done or abandoned, never a build failure: {outcomes:?}"
        );
        let recovered: Vec<String> = agent
            .logged("recovered an attempt left in flight")
            .iter()
            .map(|line| {
                format!(
                    "{} {}",
                    line["fields"]["phase"].as_str().unwrap_or("?"),
                    line["fields"]["outcome"].as_str().unwrap_or("?")
                )
            })
            .collect();
        kinds.push(format!("{delay}ms {outcomes:?} recovered {recovered:?}"));
        node.assert_clean(Some(&build)).await;
        agent.terminate().await;
    }

    let mut phases: std::collections::BTreeMap<String, usize> = Default::default();
    for kind in &kinds {
        let recovered = kind.split("recovered ").nth(1).unwrap_or("[]");
        *phases.entry(recovered.to_string()).or_default() += 1;
    }
    println!("recovered (phase outcome) per swap: {phases:?}");
    let (sent, failures) = client.finish().await;
    println!("{sent} requests, {} failed", failures.len());
    for kind in &kinds {
        println!("  {kind}");
    }
    assert!(sent > 0);
    assert!(
        failures.is_empty(),
        "{} of {sent} requests through current.sock failed (seed {seed}): {failures:?}",
        failures.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_few_swaps_killed_at_random_instants_end_clean() {
    kill_loop("random-few", 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the 50-swap loop: cargo test -p node-agent --test crash_random -- --ignored"]
async fn fifty_swaps_killed_at_random_instants_end_clean() {
    kill_loop("random-fifty", 50).await;
}
