//! What genswap's own processes cost a node per instance: N instances of
//! the testapp, each with a TCP listener on loopback, installed through the
//! engine; then the proportional set size (PSS, `/proc/PID/smaps_rollup`:
//! a shared page is split among the processes that map it) of the agent
//! (this process, before and after), of every log shim and of every
//! listener keeper. PSS, not RSS: the shims and keepers of a node share
//! their program's pages. It runs twice: with the agent's own binary as the
//! shims and keepers (what an agent without `genswap-helper` beside it
//! runs), then with `genswap-helper`. The instances' own memory is not
//! genswap's and is left out. It asserts nothing on the figures.
//!
//! `cargo bench -p node-agent --bench footprint` (root, cgroup v2).
//! `INSTANCES=n` changes the count.

#[path = "../tests/support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/figures.rs"]
mod figures;
#[path = "../tests/support/swap_host.rs"]
mod swap_host;
#[path = "../tests/support/tcp_client.rs"]
mod tcp_client;

use std::fs;

use genswap_crds::{Outcome, StopSpec};
use node_agent::gate::InstanceKey;
use swap_host::SwapHost;

const DEFAULT_INSTANCES: usize = 200;

fn main() {
    figures::run_counted("INSTANCES", DEFAULT_INSTANCES, run);
}

async fn run(instances: usize) {
    let instances = instances.max(1);
    for (helper, program) in [
        ("the agent's binary", env!("CARGO_BIN_EXE_node-agent")),
        ("genswap-helper", swap_host::HELPER),
    ] {
        run_one(instances, helper, program).await;
    }
}

async fn run_one(instances: usize, helper: &str, program: &'static str) {
    let host = SwapHost::with_options(
        "footprint",
        swap_host::HostOptions {
            run_dir_in_memory: true,
            helper: program,
        },
    );
    let build = host.build("footprint");
    let agent_before = memory_kib(std::process::id());
    let mut keys = Vec::with_capacity(instances);
    for i in 0..instances {
        let key = InstanceKey::new("default", format!("app-{i}")).expect("a key");
        let mut attempt = host.attempt(1, &build, "footprint");
        attempt.instance = key.clone();
        attempt.name = format!("app-{i}-node-a-1");
        attempt.spec.listeners = vec![tcp_client::listener(tcp_client::free_port())];
        let result = host.swap(&attempt).await;
        assert_eq!(result.outcome, Outcome::Done, "instance {i}: {result:?}");
        host.engine
            .journal()
            .acknowledge(&key, 1)
            .expect("acknowledge the install");
        keys.push(key);
    }
    let agent_after = memory_kib(std::process::id());
    let root = host
        .instance_cgroup()
        .parent()
        .expect("the agent's cgroup root")
        .to_path_buf();
    let shims = cgroup_guard::instance_pids(&root.join(node_agent::logs::SHIM_CGROUP));
    let keepers = cgroup_guard::instance_pids(&root.join(node_agent::cgroup::KEEPER_CGROUP));

    println!(
        "{instances} instances of the testapp, each with a TCP listener, shims and keepers run as {helper} ({})",
        figures::build_and_mount()
    );
    println!(
        "{:<26} {:>6} {:>14} {:>16} {:>14}",
        "process", "count", "PSS total", "PSS per instance", "RSS each p50"
    );
    let agent_pss = agent_after.pss.saturating_sub(agent_before.pss);
    println!(
        "{:<26} {:>6} {:>14} {:>16} {:>14}",
        "agent (growth)",
        1,
        kib(agent_pss),
        kib(agent_pss / instances as u64),
        format!(
            "{} -> {}",
            kib(agent_before.rss).trim(),
            kib(agent_after.rss).trim()
        ),
    );
    let mut total = agent_pss;
    for (name, pids) in [("log shims", &shims), ("listener keepers", &keepers)] {
        let each: Vec<Memory> = pids.iter().filter_map(|pid| memory_kib_of(*pid)).collect();
        let pss: u64 = each.iter().map(|m| m.pss).sum();
        let mut rss: Vec<u64> = each.iter().map(|m| m.rss).collect();
        rss.sort_unstable();
        total += pss;
        println!(
            "{:<26} {:>6} {:>14} {:>16} {:>14}",
            name,
            each.len(),
            kib(pss),
            kib(pss / instances as u64),
            kib(rss.get(rss.len() / 2).copied().unwrap_or_default()),
        );
    }
    println!(
        "{:<26} {:>6} {:>14} {:>16}",
        "genswap, per instance",
        "",
        "",
        kib(total / instances as u64)
    );

    for key in &keys {
        host.engine
            .stop_instance(key, &StopSpec::default())
            .await
            .expect("stop an instance");
    }
}

#[derive(Clone, Copy, Default)]
struct Memory {
    pss: u64,
    rss: u64,
}

fn memory_kib(pid: u32) -> Memory {
    memory_kib_of(pid).expect("this process's smaps_rollup")
}

/// `Pss:` and `Rss:` of `/proc/PID/smaps_rollup`, in KiB; `None` when the
/// process is gone.
fn memory_kib_of(pid: u32) -> Option<Memory> {
    let text = fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let field = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kb| kb.parse().ok())
            .unwrap_or(0)
    };
    Some(Memory {
        pss: field("Pss:"),
        rss: field("Rss:"),
    })
}

fn kib(value: u64) -> String {
    if value >= 10 * 1024 {
        format!("{:.1} MiB", value as f64 / 1024.0)
    } else {
        format!("{value} KiB")
    }
}
