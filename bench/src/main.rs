//! `genswap-bench`: genswap's benchmarks on this machine (root, cgroup v2).
//!
//! ```sh
//! cargo run --release -p genswap-bench -- all            # everything, N = 200 swaps per run
//! cargo run --release -p genswap-bench -- all --quick    # the same in under ~3 minutes
//! cargo run --release -p genswap-bench -- zero-downtime  # one part
//! cargo run --release -p genswap-bench -- scale
//! cargo run --release -p genswap-bench -- cluster        # the controller on a real API server
//! ```
//!
//! It builds the release `node-agent` and `genswap-testapp` beside itself
//! when needed, installs nginx from Debian packages when absent, runs in a
//! temp dir and a cgroup subtree of its own (both removed at the end), and
//! writes `results.md`, `results.json` and `latency.png` to `--out`
//! (default `docs/bench/` of the workspace). See `docs/BENCHMARKS.md`.

mod agent;
mod audit;
mod clock;
mod cluster;
mod cluster_report;
mod datagram;
mod fanout;
mod fleet;
mod http1;
mod image_overlap;
mod loadgen;
mod nginx;
mod plot;
mod prepare;
mod report;
mod sandbox;
mod scale;
mod stats;
mod store;
mod watch;
mod write_cost;
mod zero;

use std::io;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use thiserror::Error;

/// What can stop a benchmark.
#[derive(Debug, Error)]
pub enum BenchError {
    /// Something on this machine could not be set up.
    #[error("cannot {what}: {source}")]
    Setup {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
    /// A tool the benchmark needs is missing.
    #[error("missing: {0}")]
    Missing(String),
    /// The agent did not do what was asked.
    #[error("agent: {0}")]
    Agent(String),
    /// nginx did not start.
    #[error("nginx: {0}")]
    Nginx(String),
    /// The load generator failed.
    #[error("load generator: {0}")]
    Load(String),
    /// A test-app build could not be made.
    #[error("making a test-app build: {0}")]
    Build(#[source] testapp::Error),
    /// The plot could not be drawn.
    #[error("plot: {0}")]
    Plot(String),
    /// No cgroup v2 hierarchy.
    #[error("needs a writable cgroup v2 hierarchy (root, Linux): {0}")]
    Cgroup(String),
    /// A signal ended the run; its processes were stopped on the way out.
    #[error("stopped by {0}")]
    Interrupted(&'static str),
    /// A controller issued a node a second attempt for one desired state.
    #[error("issued twice: {0}")]
    IssuedTwice(String),
}

/// The programs a run starts.
#[derive(Clone, Debug)]
pub struct Binaries {
    /// `node-agent`, release build.
    pub agent: PathBuf,
    /// `genswap-controller`, release build.
    pub controller: PathBuf,
    /// `genswap-testapp`, release build.
    pub testapp: PathBuf,
    /// This program, for the load generator process.
    pub bench: PathBuf,
    /// nginx.
    pub nginx: PathBuf,
}

#[derive(Parser)]
#[command(
    name = "genswap-bench",
    about = "genswap's benchmarks: zero downtime under load, and scale"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Zero downtime under load, then scale; writes the report files.
    All(RunArgs),
    /// Zero downtime under load only.
    ZeroDowntime(RunArgs),
    /// Scale only: the controller's scheduler bench and the agent with many instances.
    Scale(RunArgs),
    /// The controller at scale on a real API server (`../shared/kube`): a
    /// burst install and release with real agents, and the watch fan-out
    /// by fleet size.
    Cluster(ClusterArgs),
    /// The load generator (started by the benchmark as its own process).
    Loadgen(loadgen::LoadArgs),
    /// The controller against a fleet of Node objects with simulated
    /// agents on a real API server: status size, objects, memory (issue 49).
    Fleet(FleetArgs),
    /// Staging an image from a registry on loopback against skopeo and
    /// tar by hand; memory; staging a stored digest again.
    Store(store::StoreArgs),
    /// One stager pulling one image (started by `store` as its own process).
    #[command(hide = true)]
    StageImage(store::StageImageArgs),
}

#[derive(Clone, Debug, clap::Args)]
struct ClusterArgs {
    /// InstanceGenerations in the burst (at least 1: the phase reports
    /// quarters of them).
    #[arg(long, default_value_t = 200, value_parser = at_least_one())]
    igs: usize,
    /// Nodes, one agent process each (at least 1).
    #[arg(long, default_value_t = 3, value_parser = at_least_one())]
    nodes: usize,
    /// The controller's `--concurrency` (default: its own default).
    #[arg(long)]
    concurrency: Option<u16>,
    /// Fleet sizes of the watch fan-out.
    #[arg(long, value_delimiter = ',', default_values_t = [10, 1000, 5000])]
    watches: Vec<usize>,
    /// How the fan-out's watches are scoped: `node-field` (the agent
    /// without `--inbox-namespace`), `inbox` (what the chart runs) and
    /// `object-name` (one object per node, the probe that led to the inbox).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [fanout::Scope::NodeField, fanout::Scope::Inbox])]
    scopes: Vec<fanout::Scope>,
    /// Only the burst, the fan-out, or the cost of one write.
    #[arg(long, value_enum)]
    only: Option<ClusterPart>,
    /// Where cluster.md and cluster.json go.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Clone, Debug, clap::Args)]
struct FleetArgs {
    /// Fleet sizes (Node objects), each on a control plane of its own.
    #[arg(long, value_delimiter = ',', default_values_t = [1000, 5000])]
    nodes: Vec<usize>,
    /// InstanceGenerations, each selecting every node.
    #[arg(long, default_value_t = 20, value_parser = at_least_one())]
    igs: usize,
    /// How long a simulated agent takes to answer an attempt, ms.
    #[arg(long, default_value_t = 1000)]
    answer_ms: u64,
    /// Zones: the Nodes get `topology.kubernetes.io/zone` values round
    /// robin, and the IGs go one zone at a time (`rollout.waves`). 0: no
    /// waves.
    #[arg(long, default_value_t = 0)]
    zones: usize,
    /// `rollout.maxParallel` of every IG, a number or a percentage
    /// (`10%`); the whole fleet when not given.
    #[arg(long)]
    max_parallel: Option<String>,
    /// `rollout.prestage: false` on every IG: a release's swaps go without
    /// first asking each node to stage the build.
    #[arg(long)]
    no_prestage: bool,
    /// Another genswap-controller binary (an older build) to run on each
    /// fleet first, for before and after in one run.
    #[arg(long)]
    compare: Option<PathBuf>,
    /// The CRDs the compared build shipped (its `crds/`): its controller
    /// writes what its own schema allows. This tree's when not given.
    #[arg(long, requires = "compare")]
    compare_crds: Option<PathBuf>,
    /// Where fleet.md and fleet.json go.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// A part of the cluster benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ClusterPart {
    Burst,
    Fanout,
    Writes,
}

#[derive(Clone, Debug, clap::Args)]
struct RunArgs {
    /// Fewer swaps, shorter windows, fewer instances: under ~3 minutes.
    #[arg(long)]
    quick: bool,
    /// Swaps per run (default 200, quick 10).
    #[arg(long)]
    swaps: Option<usize>,
    /// Instances for the agent's scale figures (default 200, quick 40).
    #[arg(long)]
    instances: Option<usize>,
    /// Seconds the agent's idle CPU and RSS are watched (default 30, quick 5).
    #[arg(long)]
    idle_seconds: Option<u64>,
    /// Requests per second per client group at the fixed rate.
    #[arg(long, default_value_t = 200.0)]
    rate: f64,
    /// Where results.md, results.json and latency.png go.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Keep each run's raw samples (CSV: start_ns, latency_ns, group,
    /// result, generation) and swap records (JSON) in this directory.
    #[arg(long)]
    keep_samples: Option<PathBuf>,
    /// Only these swap kinds.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [zero::Kind::Overlap, zero::Kind::Hold, zero::Kind::Naive, zero::Kind::OverlapListener, zero::Kind::HoldListener, zero::Kind::FailingSteered, zero::Kind::FailingShared, zero::Kind::UdpOverlap, zero::Kind::UdpHold])]
    kinds: Vec<zero::Kind>,
    /// Only these paths.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [zero::Via::Direct, zero::Via::NginxPooled, zero::Via::NginxPerRequest])]
    vias: Vec<zero::Via>,
    /// Only these loads.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [LoadKind::Fixed, LoadKind::Saturation])]
    loads: Vec<LoadKind>,
}

/// A load by name on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LoadKind {
    /// `--rate` requests per second per client group.
    Fixed,
    /// Every client as fast as it can.
    Saturation,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Loadgen(args) = &cli.command {
        return match loadgen::run(args) {
            Ok(summary) => {
                println!("{}", serde_json::to_string(&summary).unwrap_or_default());
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("genswap-bench loadgen: {error}");
                ExitCode::FAILURE
            }
        };
    }
    if matches!(cli.command, Command::Cluster(_) | Command::Fleet(_))
        && let Err(error) = cluster::ensure_helm()
    {
        eprintln!("genswap-bench: {error}");
        return ExitCode::FAILURE;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("genswap-bench: cannot start a runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    // Ending the run by a signal drops it, and with it every guard of a
    // process it started (controllers, agents, the control plane): they are
    // stopped by pid rather than left running after the benchmark.
    let outcome = runtime.block_on(async {
        tokio::select! {
            result = run(cli.command) => result,
            signal = stop_signal() => Err(BenchError::Interrupted(signal)),
        }
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("genswap-bench: {error}");
            ExitCode::FAILURE
        }
    }
}

/// The first SIGINT or SIGTERM; never, when they cannot be caught.
async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut interrupt), Ok(mut terminate)) => tokio::select! {
            _ = interrupt.recv() => "SIGINT",
            _ = terminate.recv() => "SIGTERM",
        },
        _ => std::future::pending().await,
    }
}

async fn run(command: Command) -> Result<(), BenchError> {
    let (args, zero_on, scale_on) = match command {
        Command::All(args) => (args, true, true),
        Command::ZeroDowntime(args) => (args, true, false),
        Command::Scale(args) => (args, false, true),
        Command::Cluster(args) => return run_cluster(args).await,
        Command::Fleet(args) => return run_fleet(args).await,
        Command::Loadgen(_) => return Ok(()),
        Command::Store(args) => {
            let bench = std::env::current_exe().map_err(|source| BenchError::Setup {
                what: "find this program".into(),
                source,
            })?;
            return store::run(&args, &bench).await;
        }
        Command::StageImage(args) => {
            let report = store::stage_image(&args).await?;
            println!("{}", serde_json::to_string(&report).unwrap_or_default());
            return Ok(());
        }
    };
    let out = out_dir(args.out.clone())?;
    let binaries = prepare::ensure(zero_on)?;
    let mount =
        node_agent::cgroup::discover_mount().map_err(|e| BenchError::Cgroup(e.to_string()))?;
    let machine = report::Machine::read(&mount);
    println!("{}", machine.text());

    let zero = if zero_on {
        let options = zero::ZeroOptions {
            swaps: args.swaps.unwrap_or(if args.quick { 10 } else { 200 }),
            steady: Duration::from_secs(if args.quick { 1 } else { 5 }),
            loads: args
                .loads
                .iter()
                .map(|l| match l {
                    LoadKind::Fixed => zero::Load::Fixed(args.rate),
                    LoadKind::Saturation => zero::Load::Saturation,
                })
                .collect(),
            vias: args.vias.clone(),
            kinds: args.kinds.clone(),
            clients: (4, 4),
            builds: 8,
            keep: args.keep_samples.clone(),
        };
        println!(
            "\nZero downtime under load: {} swaps per run, {} and {} ...",
            options.swaps,
            zero::Load::Fixed(args.rate).name(),
            zero::Load::Saturation.name()
        );
        let (report, panels) = zero::run(&binaries, &mount, &options).await?;
        let plot = out.join("latency.png");
        plot::render(&plot, &panels)?;
        println!("plot: {}", plot.display());
        Some(report)
    } else {
        None
    };
    let scale = if scale_on {
        let options = scale::ScaleOptions {
            instances: args.instances.unwrap_or(if args.quick { 40 } else { 200 }),
            idle: Duration::from_secs(args.idle_seconds.unwrap_or(if args.quick { 5 } else { 30 })),
            concurrent: if args.quick { 10 } else { 20 },
            scheduler_smoke: args.quick,
        };
        Some(scale::run(&binaries, &mount, &options).await?)
    } else {
        None
    };
    let results = report::Results {
        machine,
        quick: args.quick,
        zero,
        scale,
    };
    let markdown = results.markdown();
    println!("\n{markdown}");
    write_report(&out, "results", &markdown, &results)?;
    // The claims the benchmark exists to check: an overlap swap drops
    // nothing, and nor does any swap of an instance on a held listener,
    // TCP or UDP.
    let claimed_failed: u64 = results
        .zero
        .iter()
        .flat_map(|z| &z.runs)
        .filter(|r| r.kind == zero::Kind::Overlap || r.kind.listener() || r.kind.udp())
        .map(|r| r.failed)
        .sum();
    if claimed_failed > 0 {
        return Err(BenchError::Load(format!(
            "overlap swaps or swaps with a held listener failed {claimed_failed} requests; see {}/results.md",
            out.display()
        )));
    }
    // And a steered listener gives a failing successor nothing.
    let let_through: u64 = results
        .zero
        .iter()
        .flat_map(|z| &z.runs)
        .filter(|r| r.kind == zero::Kind::FailingSteered)
        .map(|r| r.answered_by_failing)
        .sum();
    if let_through > 0 {
        return Err(BenchError::Load(format!(
            "failing builds on a steered listener answered {let_through} requests; see {}/results.md",
            out.display()
        )));
    }
    Ok(())
}

async fn run_cluster(args: ClusterArgs) -> Result<(), BenchError> {
    let out = out_dir(args.out.clone())?;
    let binaries = prepare::ensure(false)?;
    let mount =
        node_agent::cgroup::discover_mount().map_err(|e| BenchError::Cgroup(e.to_string()))?;
    let machine = report::Machine::read(&mount);
    println!("{}", machine.text());
    let part = |p: ClusterPart| args.only.is_none_or(|only| only == p);
    let burst = if part(ClusterPart::Burst) {
        println!(
            "\nThe controller on a real API server: {} InstanceGenerations x {} nodes ...",
            args.igs, args.nodes
        );
        let options = cluster::ClusterOptions {
            igs: args.igs,
            nodes: args.nodes,
            concurrency: args.concurrency,
        };
        Some(cluster::run(&binaries, &mount, &options).await?)
    } else {
        None
    };
    let fanout = if part(ClusterPart::Fanout) {
        println!(
            "\nWatch fan-out on a real API server: {:?} watches ...",
            args.watches
        );
        let options = fanout::FanoutOptions {
            scopes: args.scopes.clone(),
            watches: args.watches.clone(),
            attempts_per_node: args.igs,
        };
        fanout::run(&options).await?
    } else {
        Vec::new()
    };
    let write_costs = if part(ClusterPart::Writes) {
        println!("\nWhat one write costs the API server ...");
        write_cost::run(300).await?
    } else {
        Vec::new()
    };
    let results = cluster_report::ClusterResults {
        machine,
        burst,
        fanout,
        write_costs,
    };
    let markdown = results.markdown();
    println!("\n{markdown}");
    write_report(&out, "cluster", &markdown, &results)
}

async fn run_fleet(args: FleetArgs) -> Result<(), BenchError> {
    let out = out_dir(args.out.clone())?;
    let binaries = prepare::ensure(false)?;
    let options = fleet::FleetOptions {
        nodes: args.nodes.clone(),
        igs: args.igs,
        answer_after: Duration::from_millis(args.answer_ms),
        zones: args.zones,
        max_parallel: args.max_parallel.clone(),
        prestage: !args.no_prestage,
        compare: args.compare.clone(),
        compare_crds: args.compare_crds.clone(),
    };
    let reports = fleet::run(&binaries, &options).await?;
    let markdown = fleet::markdown(&reports);
    println!("\n{markdown}");
    write_report(&out, "fleet", &markdown, &reports)?;
    // The figures are written first: a duplicate is a finding, and the
    // run that shows it must be kept. A compared build is not held to it.
    match fleet::issued_twice_by_this_build(&reports) {
        Some(failure) => Err(BenchError::IssuedTwice(failure)),
        None => Ok(()),
    }
}

/// A count flag that refuses 0 when the arguments are parsed.
fn at_least_one() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
}

/// `--out`, else `docs/bench/` of the workspace, created.
fn out_dir(out: Option<PathBuf>) -> Result<PathBuf, BenchError> {
    let out =
        out.unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/bench"));
    std::fs::create_dir_all(&out).map_err(|source| BenchError::Setup {
        what: format!("create {}", out.display()),
        source,
    })?;
    Ok(out)
}

/// Writes `<out>/<stem>.md` and `<stem>.json`.
fn write_report(
    out: &std::path::Path,
    stem: &str,
    markdown: &str,
    results: &impl serde::Serialize,
) -> Result<(), BenchError> {
    for (name, text) in [
        (format!("{stem}.md"), markdown.to_string()),
        (
            format!("{stem}.json"),
            serde_json::to_string_pretty(results).unwrap_or_default(),
        ),
    ] {
        let path = out.join(&name);
        std::fs::write(&path, text).map_err(|source| BenchError::Setup {
            what: format!("write {}", path.display()),
            source,
        })?;
    }
    println!("wrote {}/{stem}.md and {stem}.json", out.display());
    Ok(())
}
