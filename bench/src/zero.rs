//! Zero downtime under load: one instance under a real `node-agent
//! standalone`, a real nginx in front of its `current.sock`, the load
//! generator as its own process, and N back-to-back swaps of each kind
//! (overlap, hold, and the naive restart a recreate deployment does: stop,
//! then start, with no agent), through each path (direct to the socket,
//! nginx with an upstream keepalive pool, nginx with a connection per
//! request), at a fixed rate and at saturation.
//!
//! The listener kinds (SPEC 6.2) swap a second instance that serves a TCP
//! listener the agent holds, on a loopback port: "direct" is the load
//! generator connecting to that port, and nginx proxies to it over TCP.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::chown;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use genswap_crds::{Mode, Outcome};
use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};

use crate::agent::{Agent, AgentDirs, NOBODY, manifest, outcome_word};
use crate::clock::mono_ns;
use crate::http1::Target;
use crate::loadgen::{LoadSummary, Sample, read_samples};
use crate::nginx::{Nginx, Upstream};
use crate::sandbox::{self, Guarded, Sandbox};
use crate::stats::Spread;
use crate::watch::SwitchWatch;
use crate::{BenchError, Binaries};

/// The benchmark instance's name.
const APP: &str = "app";
/// The instance with a held TCP listener.
const APP_LISTENER: &str = "app-listener";
/// What a failing build answers to everything.
const FAILING_STATUS: u16 = 500;
/// The second agent's instance, on a shared listener.
const APP_SHARED: &str = "app-shared";
/// The instance on a UDP listener.
const APP_UDP: &str = "app-udp";
/// How long one swap may take before the run gives up.
const SWAP_DEADLINE: Duration = Duration::from_secs(120);

/// How an instance moves to the next build.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, clap::ValueEnum,
)]
pub enum Kind {
    /// genswap overlap: the successor starts beside, then takes over.
    Overlap,
    /// genswap hold: stop, then start, under the agent.
    Hold,
    /// No agent: SIGTERM the process, wait for its exit, start the next
    /// build on the same socket path.
    Naive,
    /// genswap overlap of an instance on a held TCP listener.
    OverlapListener,
    /// genswap hold of an instance on a held TCP listener.
    HoldListener,
    /// Overlaps on a steered TCP listener (SPEC 6.3) where every 10th
    /// build answers 500 and fails its health check.
    FailingSteered,
    /// The same on a shared listener: a second agent run with
    /// `--listener-handover=shared`.
    FailingShared,
    /// genswap overlap of a DNS-like instance on a steered UDP listener,
    /// under queries (direct only).
    UdpOverlap,
    /// genswap hold of the same: queries wait in the socket's buffer.
    UdpHold,
}

impl Kind {
    /// Its name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Overlap => "overlap",
            Kind::Hold => "hold",
            Kind::Naive => "naive restart",
            Kind::OverlapListener => "overlap, listener",
            Kind::HoldListener => "hold, listener",
            Kind::FailingSteered => "overlap, steered listener, every 10th fails",
            Kind::FailingShared => "overlap, shared listener, every 10th fails",
            Kind::UdpOverlap => "overlap, UDP listener",
            Kind::UdpHold => "hold, UDP listener",
        }
    }

    /// Whether it swaps an instance with a held listener.
    pub fn listener(self) -> bool {
        matches!(
            self,
            Kind::OverlapListener | Kind::HoldListener | Kind::FailingSteered | Kind::FailingShared
        )
    }

    /// Whether it swaps the instance on a UDP listener, queried directly.
    pub fn udp(self) -> bool {
        matches!(self, Kind::UdpOverlap | Kind::UdpHold)
    }

    /// Whether every 10th of its builds fails its health check.
    pub fn fails_every_10th(self) -> bool {
        matches!(self, Kind::FailingSteered | Kind::FailingShared)
    }

    fn mode(self) -> Option<Mode> {
        match self {
            Kind::Overlap
            | Kind::OverlapListener
            | Kind::FailingSteered
            | Kind::FailingShared
            | Kind::UdpOverlap => Some(Mode::Overlap),
            Kind::Hold | Kind::HoldListener | Kind::UdpHold => Some(Mode::Hold),
            Kind::Naive => None,
        }
    }

    fn file_name(self) -> String {
        self.name().replace([' ', ','], "-").replace("--", "-")
    }
}

/// How the load reaches the instance.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, clap::ValueEnum,
)]
pub enum Via {
    /// The load generator connects to the socket itself.
    Direct,
    /// nginx with an upstream keepalive pool.
    NginxPooled,
    /// nginx with a new upstream connection per request.
    NginxPerRequest,
}

impl Via {
    /// Its name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Via::Direct => "direct",
            Via::NginxPooled => "nginx, upstream keepalive",
            Via::NginxPerRequest => "nginx, connection per request",
        }
    }

    fn file_name(self) -> &'static str {
        match self {
            Via::Direct => "direct",
            Via::NginxPooled => "nginx-pooled",
            Via::NginxPerRequest => "nginx-per-request",
        }
    }
}

/// The shape of the load.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Load {
    /// Each client group at this many requests per second.
    Fixed(f64),
    /// Every client as fast as it can.
    Saturation,
}

impl Load {
    /// Its name in tables.
    pub fn name(&self) -> String {
        match self {
            Load::Fixed(rate) => format!("fixed {rate:.0} rps per group"),
            Load::Saturation => "saturation".into(),
        }
    }

    fn file_name(&self) -> &'static str {
        match self {
            Load::Fixed(_) => "fixed",
            Load::Saturation => "saturation",
        }
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct ZeroOptions {
    /// Swaps per run.
    pub swaps: usize,
    /// Steady load before the first swap and after the last.
    pub steady: Duration,
    /// The loads.
    pub loads: Vec<Load>,
    /// The paths.
    pub vias: Vec<Via>,
    /// The kinds.
    pub kinds: Vec<Kind>,
    /// Keep-alive clients and per-request clients in the load generator.
    pub clients: (usize, usize),
    /// Distinct builds cycled through (consecutive swaps always differ).
    pub builds: usize,
    /// Where each run's raw samples (CSV) and swap records (JSON) are
    /// kept; dropped after the analysis when `None`.
    pub keep: Option<PathBuf>,
}

/// What one swap did.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SwapRecord {
    /// When the benchmark asked for it (manifest written / SIGTERM sent).
    pub begin_ns: u64,
    /// When the status said it ended (naive: the new process answered).
    pub end_ns: u64,
    /// When `current.sock` moved (naive: the new socket was bound).
    pub switch_ns: Option<u64>,
    /// The attempt's outcome.
    pub outcome: String,
    /// The new generation.
    pub generation: u64,
    /// Step timings (ms) from the status.
    pub steps: Vec<(String, i64)>,
    /// drainMs: the retiring generation's SIGTERM to proven exit.
    pub drain_ms: Option<f64>,
    /// The successor's boot-to-healthy time (the health step).
    pub health_ms: Option<f64>,
}

impl SwapRecord {
    /// The agent's own time for the swap: its steps summed.
    fn engine_ms(&self) -> Option<f64> {
        (!self.steps.is_empty()).then(|| self.steps.iter().map(|(_, ms)| *ms as f64).sum())
    }
}

/// The figures of one run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunFigures {
    /// The kind of swap.
    pub kind: Kind,
    /// The path.
    pub via: Via,
    /// The load.
    pub load: Load,
    /// Swaps done, and those not `done`.
    pub swaps: usize,
    /// Swaps whose outcome was not `done`.
    pub swaps_not_done: usize,
    /// Requests sent.
    pub sent: u64,
    /// Requests failed (non-2xx, reset, timeout, refused...), the 500s of a
    /// failing build apart.
    pub failed: u64,
    /// Requests a failing build answered (its 500): what a successor that
    /// fails its health check let through.
    #[serde(default)]
    pub answered_by_failing: u64,
    /// Failed requests by cause.
    pub failures: BTreeMap<String, u64>,
    /// Failed requests by client group (keep-alive, per-request).
    pub failed_by_group: (u64, u64),
    /// Keep-alive reconnects (server closed between requests).
    pub reconnects: u64,
    /// Latency of answered requests outside swaps.
    pub steady: Spread,
    /// Latency of answered requests that started during a swap.
    pub during: Spread,
    /// Switch instant to the first response from the new generation.
    pub gap: Spread,
    /// Per swap, the longest time without any answered request.
    pub silence: Spread,
    /// Per swap, the latency of the slowest answered request that started
    /// during it: a hold's gap with a held listener, where requests wait
    /// in the backlog instead of failing.
    #[serde(default)]
    pub slowest: Spread,
    /// Request to end, as the benchmark saw it.
    pub swap_wall: Spread,
    /// The engine's steps summed.
    pub swap_engine: Spread,
    /// The successor's boot-to-healthy (health step).
    pub boot_to_healthy: Spread,
    /// Engine time minus boot-to-healthy.
    pub overhead: Spread,
    /// The retiring generation's SIGTERM to proven exit.
    pub drain: Spread,
    /// Each engine step's time per swap (a step run twice, summed), in
    /// the order the steps first ran: where a swap's time goes.
    #[serde(default)]
    pub steps: Vec<(String, Spread)>,
    /// nginx's error-log lines about the upstream during this run, by message.
    #[serde(default)]
    pub nginx_errors: BTreeMap<String, u64>,
}

/// Everything the zero-downtime benchmark measured.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ZeroReport {
    /// One per run.
    pub runs: Vec<RunFigures>,
}

/// Runs the benchmark and returns its figures.
/// One panel of the latency plot: a run's kind and path, its samples and
/// its swaps.
pub type Panel = (Kind, Via, Vec<Sample>, Vec<SwapRecord>);

/// Runs every (load, path, kind); returns the report and the panels worth
/// plotting (the fixed-rate runs, direct and through the pooled nginx).
pub async fn run(
    binaries: &Binaries,
    cgroup_parent: &Path,
    options: &ZeroOptions,
) -> Result<(ZeroReport, Vec<Panel>), BenchError> {
    let sandbox = sandbox::create(cgroup_parent, "zero")?;
    let dirs = AgentDirs::create(&sandbox)?;
    let builds = make_builds(&dirs.staging, options.builds.max(2))?;
    let mut agent = Agent::start(&binaries.agent, &dirs, true)?;
    // Beside it, an agent that shares listeners, for the side-by-side rows.
    let mut shared = None;
    if options.kinds.contains(&Kind::FailingShared) {
        let shared_sandbox = sandbox::create(cgroup_parent, "zero-shared")?;
        let shared_dirs = AgentDirs::create(&shared_sandbox)?;
        let shared_agent = Agent::start_with(
            &binaries.agent,
            &shared_dirs,
            true,
            &["--listener-handover", "shared"],
        )?;
        shared = Some((shared_sandbox, shared_agent));
    }
    let result = run_with(
        &sandbox,
        &mut agent,
        shared.as_mut().map(|(_, agent)| agent),
        &builds,
        binaries,
        options,
    )
    .await;
    let stopped = agent.stop();
    let shared_stopped = shared.map_or(Ok(()), |(_, agent)| agent.stop());
    let ran = result?;
    stopped?;
    shared_stopped?;
    Ok(ran)
}

struct Setup<'a> {
    agent: &'a Agent,
    builds: &'a [testapp::Build],
    naive: NaiveApp,
    nginx: Nginx,
    /// `app`, on its `current.sock`.
    plain: Managed,
    /// `app-listener`, on its held TCP listener, when a listener kind runs.
    listening: Option<Managed>,
    /// `app-udp`, on its UDP listener, when a UDP kind runs.
    answering_udp: Option<Managed>,
    /// The agent that shares listeners and its `app-shared`, when
    /// [`Kind::FailingShared`] runs.
    shared: Option<(&'a Agent, Managed, Vec<testapp::Build>)>,
    /// The build index the naive app serves now.
    naive_serving: usize,
    binaries: &'a Binaries,
    samples_dir: PathBuf,
}

/// An instance under the agent.
struct Managed {
    name: &'static str,
    /// The loopback port of its listener.
    listener_port: Option<u16>,
    /// Whether that listener is UDP (else TCP).
    udp: bool,
    /// The build index serving now.
    serving: usize,
    last_rev: i64,
    switches: SwitchWatch,
}

impl Managed {
    /// Installs build 0 as `name`, with a listener on `listener_port`
    /// (UDP if `udp`).
    async fn install(
        agent: &mut Agent,
        name: &'static str,
        listener_port: Option<u16>,
        udp: bool,
        builds: &[testapp::Build],
    ) -> Result<Managed, BenchError> {
        agent.write_manifest(
            name,
            &with_listener(
                manifest(name, &build_id(0), &builds[0], Mode::Overlap),
                listener_port,
                udp,
            ),
        )?;
        let doc = agent.wait_attempt_after(name, 0, SWAP_DEADLINE).await?;
        let installed = doc.last_attempt().map(|a| (a.sched_rev, a.outcome));
        let Some((last_rev, Outcome::Done)) = installed else {
            return Err(BenchError::Agent(format!(
                "the install of {name} did not succeed: {doc:?}"
            )));
        };
        agent.check_alive()?;
        Ok(Managed {
            name,
            listener_port,
            udp,
            serving: 0,
            last_rev,
            switches: SwitchWatch::start(&agent.dirs.instance_run_dir(name), "current.sock")?,
        })
    }
}

/// `manifest` with a build that answers 500 to everything (so its health
/// check fails, after 2 s).
fn answering_500(manifest: &str) -> Result<String, BenchError> {
    let health = "  health:\n    path: /healthz\n    timeoutSeconds: 10\n";
    if !manifest.contains(health) {
        return Err(BenchError::Agent(
            "the manifest's health block is not the one expected".into(),
        ));
    }
    let process = format!("    group: {NOBODY}\n");
    Ok(manifest
        .replace(
            health,
            "  health:\n    path: /healthz\n    timeoutSeconds: 2\n",
        )
        .replace(
            &process,
            &format!(
                "{process}    env: [{{name: {}, value: \"{FAILING_STATUS}\"}}]\n",
                testapp::knob::STATUS
            ),
        ))
}

/// `manifest` with a listener on the loopback `port`: `dns` on UDP if
/// `udp`, else `web` on TCP.
fn with_listener(manifest: String, port: Option<u16>, udp: bool) -> String {
    let (name, protocol) = if udp { ("dns", "udp") } else { ("web", "tcp") };
    match port {
        Some(port) => {
            format!("{manifest}  listeners: [{{name: {name}, {protocol}: \"127.0.0.1:{port}\"}}]\n")
        }
        None => manifest,
    }
}

async fn run_with<'a>(
    sandbox: &Sandbox,
    agent: &'a mut Agent,
    shared_agent: Option<&'a mut Agent>,
    builds: &'a [testapp::Build],
    binaries: &'a Binaries,
    options: &ZeroOptions,
) -> Result<(ZeroReport, Vec<Panel>), BenchError> {
    let plain = Managed::install(agent, APP, None, false, builds).await?;
    let listening = if options.kinds.iter().any(|k| k.listener()) {
        let port = crate::nginx::free_port()?;
        Some(Managed::install(agent, APP_LISTENER, Some(port), false, builds).await?)
    } else {
        None
    };
    let answering_udp = if options.kinds.iter().any(|k| k.udp()) {
        let port = free_udp_port()?;
        Some(Managed::install(agent, APP_UDP, Some(port), true, builds).await?)
    } else {
        None
    };
    let shared = match shared_agent {
        Some(shared_agent) => {
            let port = crate::nginx::free_port()?;
            // Its builds are the first agent's: both stage from their own
            // roots, so each copies them in.
            let own = make_builds(&shared_agent.dirs.staging, builds.len())?;
            let managed =
                Managed::install(shared_agent, APP_SHARED, Some(port), false, &own).await?;
            Some((&*shared_agent, managed, own))
        }
        None => None,
    };

    let naive_dir = sandbox.dir().join("naive");
    fs::create_dir(&naive_dir)
        .and_then(|()| chown(&naive_dir, Some(NOBODY), Some(NOBODY)))
        .map_err(|source| BenchError::Setup {
            what: format!("create {}", naive_dir.display()),
            source,
        })?;
    let naive = NaiveApp::start(&naive_dir, &builds[0], &build_id(0), 1, sandbox.cgroup())?;
    let mut upstreams = vec![
        Upstream::Unix(agent.dirs.current_sock(APP)),
        Upstream::Unix(naive.socket.clone()),
    ];
    upstreams.extend(
        listening
            .as_ref()
            .and_then(|l| l.listener_port)
            .map(|port| Upstream::Tcp(format!("127.0.0.1:{port}"))),
    );
    upstreams.extend(
        shared
            .as_ref()
            .and_then(|(_, managed, _)| managed.listener_port)
            .map(|port| Upstream::Tcp(format!("127.0.0.1:{port}"))),
    );
    let nginx = Nginx::start(&binaries.nginx, &sandbox.dir().join("nginx"), &upstreams)?;
    let samples_dir = sandbox.dir().join("samples");
    fs::create_dir(&samples_dir).map_err(|source| BenchError::Setup {
        what: "create the samples dir".into(),
        source,
    })?;
    let mut setup = Setup {
        agent,
        builds,
        naive,
        nginx,
        plain,
        listening,
        answering_udp,
        shared,
        naive_serving: 0,
        binaries,
        samples_dir,
    };
    let naive_switches = SwitchWatch::start(&naive_dir, "app.sock")?;

    let mut report = ZeroReport::default();
    let mut plotted: Vec<Panel> = Vec::new();
    for load in &options.loads {
        for via in &options.vias {
            for kind in &options.kinds {
                // Queries go straight to the UDP port; nginx fronts HTTP.
                if kind.udp() && *via != Via::Direct {
                    continue;
                }
                let (figures, samples, records) =
                    run_one(&mut setup, *kind, *via, *load, &naive_switches, options).await?;
                print_run(&figures);
                if matches!(load, Load::Fixed(_))
                    && matches!(via, Via::Direct | Via::NginxPooled)
                    && !kind.udp()
                {
                    plotted.push((*kind, *via, samples, records));
                }
                report.runs.push(figures);
            }
        }
    }
    let Setup { naive, nginx, .. } = setup;
    nginx.stop();
    naive.stop();
    Ok((report, plotted))
}

async fn run_one(
    setup: &mut Setup<'_>,
    kind: Kind,
    via: Via,
    load: Load,
    naive_switches: &SwitchWatch,
    options: &ZeroOptions,
) -> Result<(RunFigures, Vec<Sample>, Vec<SwapRecord>), BenchError> {
    // The nginx fronts are in the order of the upstreams: app, naive,
    // listener, shared listener.
    let front = &setup.nginx.fronts[match kind {
        Kind::Naive => 1,
        Kind::FailingShared => 3,
        k if k.listener() => 2,
        _ => 0,
    }];
    let listener_port = if kind == Kind::FailingShared {
        setup.shared.as_ref().and_then(|(_, m, _)| m.listener_port)
    } else {
        setup.listening.as_ref().and_then(|l| l.listener_port)
    };
    let udp_port = setup.answering_udp.as_ref().and_then(|u| u.listener_port);
    let target = match via {
        Via::Direct if kind.udp() => {
            Target::Udp(format!("127.0.0.1:{}", udp_port.unwrap_or_default()))
        }
        Via::Direct if kind == Kind::Naive => Target::Unix(setup.naive.socket.clone()),
        Via::Direct if kind.listener() => {
            Target::Tcp(format!("127.0.0.1:{}", listener_port.unwrap_or_default()))
        }
        Via::Direct => Target::Unix(setup.agent.dirs.current_sock(APP)),
        Via::NginxPooled => Target::Tcp(format!("127.0.0.1:{}", front.pooled)),
        Via::NginxPerRequest => Target::Tcp(format!("127.0.0.1:{}", front.per_request)),
    };
    let samples_path = setup.samples_dir.join(format!(
        "{}-{}-{}.csv",
        load.file_name(),
        via.file_name(),
        kind.file_name()
    ));
    let rate = match load {
        Load::Fixed(rate) => rate,
        Load::Saturation => 0.0,
    };
    let mut loadgen = Guarded::new(
        Command::new(&setup.binaries.bench)
            .arg("loadgen")
            .arg("--target")
            .arg(target.to_string())
            .arg("--keepalive")
            .arg(options.clients.0.to_string())
            .arg("--per-request")
            .arg(options.clients.1.to_string())
            .arg("--rate")
            .arg(rate.to_string())
            .arg("--out")
            .arg(&samples_path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|source| BenchError::Setup {
                what: "start the load generator".into(),
                source,
            })?,
        Signal::SIGTERM,
    );
    let nginx_lines_before = setup.nginx.upstream_errors().len();
    tokio::time::sleep(options.steady).await;
    let mut records = Vec::with_capacity(options.swaps);
    for i in 0..options.swaps {
        let failing = kind.fails_every_10th() && i % 10 == 9;
        let record = match (kind.mode(), kind.listener()) {
            (None, _) => naive_swap(setup, naive_switches).await?,
            (Some(mode), _) if kind.udp() => {
                let Some(answering) = setup.answering_udp.as_mut() else {
                    return Err(BenchError::Agent("no instance on a UDP listener".into()));
                };
                agent_swap(setup.agent, setup.builds, answering, mode, false).await?
            }
            (Some(mode), false) => {
                agent_swap(setup.agent, setup.builds, &mut setup.plain, mode, false).await?
            }
            (Some(mode), true) if kind == Kind::FailingShared => {
                let Some((agent, shared, builds)) = setup.shared.as_mut() else {
                    return Err(BenchError::Agent("no agent sharing listeners".into()));
                };
                agent_swap(agent, builds, shared, mode, failing).await?
            }
            (Some(mode), true) => {
                let Some(listening) = setup.listening.as_mut() else {
                    return Err(BenchError::Agent("no instance with a listener".into()));
                };
                agent_swap(setup.agent, setup.builds, listening, mode, failing).await?
            }
        };
        records.push(record);
    }
    tokio::time::sleep(options.steady).await;
    // Closing stdin ends the load; it then writes its samples.
    let mut stdout = String::new();
    if let Some(child) = loadgen.child_mut() {
        drop(child.stdin.take());
        if let Some(mut out) = child.stdout.take() {
            let _ = out.read_to_string(&mut stdout);
        }
    }
    let status = loadgen.wait().map_err(|source| BenchError::Setup {
        what: "wait for the load generator".into(),
        source,
    })?;
    if !status.success() {
        return Err(BenchError::Load(format!(
            "the load generator exited with {status}"
        )));
    }
    let summary: LoadSummary = serde_json::from_str(stdout.trim())
        .map_err(|e| BenchError::Load(format!("its summary {stdout:?}: {e}")))?;
    let samples = read_samples(&samples_path).map_err(|e| BenchError::Load(e.to_string()))?;
    match &options.keep {
        Some(keep) => keep_raw(keep, &samples_path, &records)?,
        None => {
            let _ = fs::remove_file(&samples_path);
        }
    }
    let mut figures = analyse(kind, via, load, &samples, &records, summary.reconnects);
    for line in setup
        .nginx
        .upstream_errors()
        .iter()
        .skip(nginx_lines_before)
    {
        *figures.nginx_errors.entry(nginx_message(line)).or_default() += 1;
    }
    Ok((figures, samples, records))
}

/// A UDP port on 127.0.0.1 free a moment ago.
fn free_udp_port() -> Result<u16, BenchError> {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|socket| socket.local_addr())
        .map(|address| address.port())
        .map_err(|source| BenchError::Setup {
            what: "find a free UDP port".into(),
            source,
        })
}

/// Copies a run's samples into `keep` and writes its swap records beside
/// them as `<run>.swaps.json`.
fn keep_raw(keep: &Path, samples: &Path, records: &[SwapRecord]) -> Result<(), BenchError> {
    let keep_error = |what: String| move |source| BenchError::Setup { what, source };
    fs::create_dir_all(keep).map_err(keep_error(format!("create {}", keep.display())))?;
    let name = samples.file_name().unwrap_or_default();
    let kept = keep.join(name);
    fs::copy(samples, &kept).map_err(keep_error(format!("copy to {}", kept.display())))?;
    let swaps = kept.with_extension("swaps.json");
    fs::write(&swaps, serde_json::to_string(records).unwrap_or_default())
        .map_err(keep_error(format!("write {}", swaps.display())))?;
    let _ = fs::remove_file(samples);
    Ok(())
}

/// The next build after `current`, cycling through the pool.
fn next_build(current: usize, pool: usize) -> usize {
    (current + 1) % pool
}

fn build_id(index: usize) -> String {
    format!("bench-{index}")
}

/// Swaps `instance` to its next build; a `failing` one answers 500 and
/// fails its health check within 2 s.
async fn agent_swap(
    agent: &Agent,
    builds: &[testapp::Build],
    instance: &mut Managed,
    mode: Mode,
    failing: bool,
) -> Result<SwapRecord, BenchError> {
    let next = next_build(instance.serving, builds.len());
    let begin_ns = mono_ns();
    // A failed build is held down (SPEC 5.4) until spec.retry: each failing
    // swap names a build of its own, so the pool's builds stay usable.
    let id = if failing {
        format!("{}-fails-{}", build_id(next), instance.last_rev + 1)
    } else {
        build_id(next)
    };
    let mut text = with_listener(
        manifest(instance.name, &id, &builds[next], mode),
        instance.listener_port,
        instance.udp,
    );
    if failing {
        text = answering_500(&text)?;
    }
    agent.write_manifest(instance.name, &text)?;
    let doc = agent
        .wait_attempt_after(instance.name, instance.last_rev, SWAP_DEADLINE)
        .await?;
    let end_ns = mono_ns();
    let last = doc
        .last_attempt()
        .ok_or_else(|| BenchError::Agent("no last attempt in the status".into()))?;
    instance.last_rev = last.sched_rev;
    if last.outcome == Outcome::Done {
        instance.serving = next;
    }
    let status = doc
        .attempt(last.sched_rev)
        .map(|a| a.status.clone())
        .unwrap_or_default();
    let steps: Vec<(String, i64)> = status
        .steps
        .iter()
        .map(|s| (s.step.clone(), s.millis))
        .collect();
    let health_ms = steps
        .iter()
        .filter(|(step, _)| step == "health")
        .map(|(_, ms)| *ms as f64)
        .reduce(|a, b| a + b);
    Ok(SwapRecord {
        begin_ns,
        end_ns,
        switch_ns: instance.switches.last_between(begin_ns, end_ns),
        outcome: outcome_word(Some(last.outcome)).into(),
        generation: status
            .generation
            .and_then(|g| u64::try_from(g).ok())
            .unwrap_or(0),
        steps,
        drain_ms: last.drain_ms.map(|d| d as f64),
        health_ms,
    })
}

async fn naive_swap(
    setup: &mut Setup<'_>,
    switches: &SwitchWatch,
) -> Result<SwapRecord, BenchError> {
    let next = next_build(setup.naive_serving, setup.builds.len());
    let generation = setup.naive.generation + 1;
    let begin_ns = mono_ns();
    let exit_ns = setup.naive.stop_current()?;
    setup
        .naive
        .spawn(&setup.builds[next], &build_id(next), generation)?;
    let healthy_ns = setup.naive.wait_healthy().await?;
    setup.naive_serving = next;
    Ok(SwapRecord {
        begin_ns,
        end_ns: healthy_ns,
        switch_ns: switches.last_between(begin_ns, healthy_ns),
        outcome: "done".into(),
        generation,
        steps: Vec::new(),
        drain_ms: Some((exit_ns - begin_ns) as f64 / 1e6),
        health_ms: Some((healthy_ns - exit_ns) as f64 / 1e6),
    })
}

/// The test app run by hand on one socket path, the way a recreate
/// deployment runs it: no agent, no second socket.
struct NaiveApp {
    socket: PathBuf,
    cgroup: PathBuf,
    log: PathBuf,
    current: Option<Guarded>,
    generation: u64,
}

impl NaiveApp {
    fn start(
        dir: &Path,
        build: &testapp::Build,
        id: &str,
        generation: u64,
        cgroup_parent: &Path,
    ) -> Result<NaiveApp, BenchError> {
        let cgroup = cgroup_parent.join("naive");
        fs::create_dir(&cgroup).map_err(|source| BenchError::Setup {
            what: format!("create {}", cgroup.display()),
            source,
        })?;
        let mut app = NaiveApp {
            socket: dir.join("app.sock"),
            cgroup,
            log: dir.join("app.log"),
            current: None,
            generation: 0,
        };
        app.spawn(build, id, generation)?;
        let deadline = mono_ns() + 10_000_000_000;
        while UnixStream::connect(&app.socket).is_err() {
            if mono_ns() > deadline {
                return Err(BenchError::Load("the naive app did not bind".into()));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(app)
    }

    fn spawn(
        &mut self,
        build: &testapp::Build,
        id: &str,
        generation: u64,
    ) -> Result<(), BenchError> {
        let setup = |what: &str| {
            let what = what.to_string();
            move |source| BenchError::Setup { what, source }
        };
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(setup("open the naive app's log"))?;
        let child = Command::new(&build.path)
            .env(testapp::env::SOCKET, &self.socket)
            .env(testapp::env::BUILD, id)
            .env(testapp::env::GENERATION, generation.to_string())
            .uid(NOBODY)
            .gid(NOBODY)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(setup("start the naive app"))?;
        // In the sandbox's cgroup too, so cleanup by path finds it.
        let _ = fs::write(self.cgroup.join("cgroup.procs"), child.id().to_string());
        self.current = Some(Guarded::new(child, Signal::SIGTERM));
        self.generation = generation;
        Ok(())
    }

    /// SIGTERM, wait for the exit; the instant it was seen.
    fn stop_current(&mut self) -> Result<u64, BenchError> {
        if let Some(mut current) = self.current.take() {
            current.stop().map_err(|source| BenchError::Setup {
                what: "stop the naive app".into(),
                source,
            })?;
        }
        Ok(mono_ns())
    }

    /// Until `GET /healthz` is answered below 500, as the agent's check.
    async fn wait_healthy(&self) -> Result<u64, BenchError> {
        let deadline = mono_ns() + 10_000_000_000;
        let target = Target::Unix(self.socket.clone());
        loop {
            let answered = crate::http1::Connection::open(&target, Duration::from_secs(1))
                .and_then(|mut c| c.get(true))
                .is_ok_and(|r| r.status < 500);
            if answered {
                return Ok(mono_ns());
            }
            if mono_ns() > deadline {
                return Err(BenchError::Load(
                    "the naive app did not become healthy".into(),
                ));
            }
            // The agent's health check retries on a backoff too; 1 ms keeps
            // the naive baseline at its best.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    fn stop(mut self) {
        let _ = self.stop_current();
    }
}

fn make_builds(staging: &Path, count: usize) -> Result<Vec<testapp::Build>, BenchError> {
    (0..count)
        .map(|i| testapp::make_build(staging, &build_id(i)).map_err(BenchError::Build))
        .collect()
}

/// An nginx error-log line without its timestamp, pid and request details.
fn nginx_message(line: &str) -> String {
    let text = line.split_once("*").map_or(line, |(_, rest)| rest);
    let text = text.split_once(' ').map_or(text, |(_, rest)| rest);
    let text = text.split(", client:").next().unwrap_or(text).trim();
    // The socket's directory is a temp dir: keep only its file name.
    text.split(' ')
        .map(|word| match word.strip_prefix("unix:") {
            Some(path) => format!("unix:…/{}", path.rsplit('/').next().unwrap_or(path)),
            None => word.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The figures of one run from its samples and swap records.
pub fn analyse(
    kind: Kind,
    via: Via,
    load: Load,
    samples: &[Sample],
    records: &[SwapRecord],
    reconnects: u64,
) -> RunFigures {
    let windows: Vec<(u64, u64)> = records.iter().map(|r| (r.begin_ns, r.end_ns)).collect();
    let swap_of = |t: u64| {
        let index = windows.partition_point(|(begin, _)| *begin <= t);
        (index > 0 && t <= windows[index - 1].1).then(|| index - 1)
    };
    let mut slowest = vec![0.0f64; records.len()];
    let mut failures = BTreeMap::new();
    let mut failed_by_group = (0, 0);
    let mut answered_by_failing = 0;
    let mut steady = Vec::new();
    let mut during = Vec::new();
    for s in samples {
        if s.status == FAILING_STATUS {
            // Only a failing build answers 500.
            answered_by_failing += 1;
        } else if s.ok() {
            let latency = s.latency_ns as f64 / 1e6;
            match swap_of(s.start_ns) {
                Some(swap) => {
                    during.push(latency);
                    slowest[swap] = slowest[swap].max(latency);
                }
                None => steady.push(latency),
            }
        } else {
            let cause = if s.status > 0 {
                format!("http {}", s.status)
            } else {
                s.error.to_string()
            };
            *failures.entry(cause).or_insert(0) += 1;
            match s.group {
                crate::loadgen::Group::KeepAlive => failed_by_group.0 += 1,
                crate::loadgen::Group::PerRequest => failed_by_group.1 += 1,
            }
        }
    }
    let mut ok_ends: Vec<u64> = samples
        .iter()
        .filter(|s| s.ok())
        .map(Sample::end_ns)
        .collect();
    ok_ends.sort_unstable();
    // The first answer from each generation.
    let mut first_answer: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
    for s in samples.iter().filter(|s| s.ok()) {
        let end = s.end_ns();
        first_answer
            .entry(s.generation)
            .and_modify(|t| *t = (*t).min(end))
            .or_insert(end);
    }
    let mut gaps = Vec::new();
    let mut silences = Vec::new();
    for record in records {
        if let (Some(switch), Some(&first)) =
            (record.switch_ns, first_answer.get(&record.generation))
        {
            gaps.push(first.saturating_sub(switch) as f64 / 1e6);
        }
        // The longest span without an answer that overlaps the swap.
        let from = ok_ends
            .partition_point(|t| *t < record.begin_ns)
            .saturating_sub(1);
        let to = (ok_ends.partition_point(|t| *t <= record.end_ns) + 1).min(ok_ends.len());
        let longest = ok_ends[from..to]
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0);
        silences.push(longest as f64 / 1e6);
    }
    let engine: Vec<f64> = records.iter().filter_map(SwapRecord::engine_ms).collect();
    RunFigures {
        kind,
        via,
        load,
        swaps: records.len(),
        swaps_not_done: records.iter().filter(|r| r.outcome != "done").count(),
        sent: samples.len() as u64,
        failed: failures.values().sum(),
        answered_by_failing,
        failures,
        failed_by_group,
        reconnects,
        steady: Spread::of(steady),
        during: Spread::of(during),
        gap: Spread::of(gaps),
        silence: Spread::of(silences),
        slowest: Spread::of(slowest),
        swap_wall: Spread::of(
            records
                .iter()
                .map(|r| (r.end_ns - r.begin_ns) as f64 / 1e6)
                .collect(),
        ),
        swap_engine: Spread::of(engine),
        boot_to_healthy: Spread::of(records.iter().filter_map(|r| r.health_ms).collect()),
        overhead: Spread::of(
            records
                .iter()
                .filter_map(|r| Some(r.engine_ms()? - r.health_ms.unwrap_or(0.0)))
                .collect(),
        ),
        drain: Spread::of(records.iter().filter_map(|r| r.drain_ms).collect()),
        steps: step_spreads(records),
        nginx_errors: BTreeMap::new(),
    }
}

/// Per step name, the spread over `records` of its time per swap.
fn step_spreads(records: &[SwapRecord]) -> Vec<(String, Spread)> {
    let mut names: Vec<String> = Vec::new();
    let mut per_name: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for record in records {
        for (name, ms) in numbered_steps(&record.steps) {
            if !names.contains(&name) {
                names.push(name.clone());
            }
            per_name.entry(name).or_default().push(ms);
        }
    }
    names
        .into_iter()
        .map(|name| {
            let spread = Spread::of(per_name.remove(&name).unwrap_or_default());
            (name, spread)
        })
        .collect()
}

/// A swap's steps with a repeated one numbered (`journal`, then
/// `journal 2`): a hold's first record is written before the stop, its
/// second inside the gap.
fn numbered_steps(steps: &[(String, i64)]) -> Vec<(String, f64)> {
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    steps
        .iter()
        .map(|(step, ms)| {
            let n = seen.entry(step.as_str()).or_default();
            *n += 1;
            let name = if *n == 1 {
                step.clone()
            } else {
                format!("{step} {n}")
            };
            (name, *ms as f64)
        })
        .collect()
}

fn print_run(f: &RunFigures) {
    println!(
        "  {:<14} {:<30} {:<22} swaps {:>4} ({} not done)  sent {:>8}  failed {:>6} {:?}  answered by a failing build {:>6}  reconnects {:>6}  during p50/p99/max {} ms  gap p50/p99 {} ms  silence max {} ms",
        f.kind.name(),
        f.via.name(),
        f.load.name(),
        f.swaps,
        f.swaps_not_done,
        f.sent,
        f.failed,
        f.failures,
        f.answered_by_failing,
        f.reconnects,
        f.during.text(),
        f.gap.text2(),
        crate::stats::ms(f.silence.max),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loadgen::Group;

    fn answered(start_ms: u64, latency_ms: u64) -> Sample {
        Sample {
            start_ns: start_ms * 1_000_000,
            latency_ns: latency_ms * 1_000_000,
            group: Group::PerRequest,
            status: 200,
            error: "",
            generation: 1,
        }
    }

    fn swap(begin_ms: u64, end_ms: u64) -> SwapRecord {
        SwapRecord {
            begin_ns: begin_ms * 1_000_000,
            end_ns: end_ms * 1_000_000,
            outcome: "done".into(),
            ..SwapRecord::default()
        }
    }

    #[test]
    fn a_repeated_step_is_counted_apart_in_the_order_the_steps_ran() {
        let steps = |journal2: i64| {
            [
                ("journal", 1),
                ("stop", 7),
                ("journal", journal2),
                ("spawn", 3),
            ]
            .iter()
            .map(|(name, ms)| (name.to_string(), *ms))
            .collect()
        };
        let records = [
            SwapRecord {
                steps: steps(2),
                ..swap(0, 10)
            },
            SwapRecord {
                steps: steps(4),
                ..swap(20, 30)
            },
            SwapRecord {
                steps: steps(6),
                ..swap(40, 50)
            },
        ];
        let spreads = step_spreads(&records);
        let names: Vec<&str> = spreads.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, ["journal", "stop", "journal 2", "spawn"]);
        assert_eq!(spreads[0].1.p50, 1.0);
        assert_eq!(spreads[2].1.p50, 4.0);
        assert_eq!(spreads[2].1.max, 6.0);
        assert_eq!(spreads[2].1.count, 3);
    }

    #[test]
    fn the_slowest_request_is_taken_per_swap_and_failures_are_not_latency() {
        let mut refused = answered(110, 900);
        refused.status = 0;
        refused.error = "refused";
        let samples = vec![
            answered(10, 500),
            answered(100, 3),
            answered(105, 40),
            refused,
            answered(200, 7),
            answered(210, 2),
        ];
        let records = [swap(100, 150), swap(200, 250)];
        let figures = analyse(
            Kind::HoldListener,
            Via::Direct,
            Load::Saturation,
            &samples,
            &records,
            0,
        );
        // Each swap's slowest answered request: 40 and 7 ms; the 500 ms one
        // started outside every swap, the refused one is a failure.
        assert_eq!(figures.slowest.count, 2);
        assert_eq!(figures.slowest.max, 40.0);
        assert_eq!(figures.failed, 1);
    }
}
