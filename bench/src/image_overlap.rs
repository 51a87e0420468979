//! The overlap of an image build under load, side by side with the same
//! overlap of a single-file build, on one standalone agent: two instances
//! of the test app, one whose builds are two images in a registry on
//! loopback (the test app's binary at `/bin/testapp`, the image's
//! Entrypoint), one whose builds are two files. Each swaps to its other
//! build in turn while a client per instance sends requests without pause
//! through its `current.sock`.
//!
//! The agent's overhead is its steps summed minus the successor's boot to
//! healthy (`health`) and minus the `stage` step, which for an image holds
//! the pull: what the engine adds around a build, whatever its source. The
//! first swap to the second image pulls it; the rest find it in the store.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use genswap_crds::{Mode, Outcome};
use test_cluster::registry::{Registry, Umoci};

use crate::BenchError;
use crate::agent::{Agent, AgentDirs, image_manifest, manifest};
use crate::http1::{Connection, Target};
use crate::stats::Spread;

const SWAP_DEADLINE: Duration = Duration::from_secs(120);
const FILE: &str = "file";
const IMAGE: &str = "img";

/// Requests through one `current.sock` without pause, on their own thread.
struct Client {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
    thread: Option<JoinHandle<Vec<String>>>,
}

impl Client {
    fn start(socket: &Path) -> Client {
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicU64::new(0));
        let target = Target::Unix(socket.to_path_buf());
        let thread = std::thread::spawn({
            let (stop, answered) = (stop.clone(), answered.clone());
            move || {
                let mut failures = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let response = Connection::open(&target, Duration::from_secs(10))
                        .and_then(|mut connection| connection.get(true));
                    match response {
                        Ok(r) if r.status == 200 => {
                            answered.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(r) => failures.push(format!("status {}", r.status)),
                        Err(error) => failures.push(error.to_string()),
                    }
                }
                failures
            }
        });
        Client {
            stop,
            answered,
            thread: Some(thread),
        }
    }

    /// (answered, failures).
    fn finish(mut self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        let failures = self
            .thread
            .take()
            .and_then(|thread| thread.join().ok())
            .unwrap_or_default();
        (self.answered.load(Ordering::Relaxed), failures)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// One instance's swaps: each attempt's steps (ms by step).
#[derive(Default)]
struct Swaps {
    last_rev: i64,
    steps: Vec<Vec<(String, i64)>>,
}

impl Swaps {
    /// Writes `manifest` for `name` and waits for the attempt to be done.
    async fn swap(&mut self, agent: &Agent, name: &str, text: &str) -> Result<(), BenchError> {
        agent.write_manifest(name, text)?;
        let doc = agent
            .wait_attempt_after(name, self.last_rev, SWAP_DEADLINE)
            .await?;
        let last = doc
            .last_attempt()
            .ok_or_else(|| BenchError::Agent(format!("{name}: no attempt in the status")))?;
        self.last_rev = last.sched_rev;
        if last.outcome != Outcome::Done {
            return Err(BenchError::Agent(format!(
                "{name}: the swap ended {:?}: {}",
                last.outcome, last.reason
            )));
        }
        let steps = doc
            .attempt(last.sched_rev)
            .map(|a| {
                a.status
                    .steps
                    .iter()
                    .map(|s| (s.step.clone(), s.millis))
                    .collect()
            })
            .unwrap_or_default();
        self.steps.push(steps);
        Ok(())
    }

    /// The spread over the swaps of the steps named `which`, summed per swap.
    fn of(&self, which: impl Fn(&str) -> bool) -> Spread {
        Spread::of(
            self.steps
                .iter()
                .map(|steps| {
                    steps
                        .iter()
                        .filter(|(step, _)| which(step))
                        .map(|(_, ms)| *ms as f64)
                        .sum()
                })
                .collect(),
        )
    }
}

/// An image of a distinct build of the test app, pushed as
/// `bench/testapp:<name>`: (reference, digest).
fn push_app_image(
    registry: &Registry,
    testapp: &Path,
    dir: &Path,
    name: &str,
) -> Result<(String, String), BenchError> {
    let image = Umoci::new(&dir.join(format!("image-{name}")), name);
    let bin = image.rootfs().join("bin");
    let build = testapp::make_build_from(testapp, dir, &format!("server-{name}"))
        .map_err(BenchError::Build)?;
    std::fs::create_dir_all(&bin)
        .and_then(|()| std::fs::copy(&build.path, bin.join("testapp")))
        .map_err(|source| BenchError::Setup {
            what: format!("put the test app in {}", bin.display()),
            source,
        })?;
    image.layer();
    image.config(&["--config.entrypoint", "/bin/testapp"]);
    let digest = registry.push(&image.layout, image.tag(), "bench/testapp", name, &[]);
    Ok((
        format!("{}/bench/testapp:{name}@sha256:{digest}", registry.addr),
        digest,
    ))
}

/// Runs the overlaps and prints the figures.
pub async fn run(registry: &Registry, work: &Path, swaps: usize) -> Result<(), BenchError> {
    let binaries = crate::prepare::ensure(false)?;
    let mount =
        node_agent::cgroup::discover_mount().map_err(|e| BenchError::Cgroup(e.to_string()))?;
    let sandbox = crate::sandbox::create(&mount, "image-overlap")?;
    let dirs = AgentDirs::create(&sandbox)?;
    let mut agent = Agent::start_with(
        &binaries.agent,
        &dirs,
        true,
        &["--insecure-registry", &registry.addr],
    )?;
    let files: Vec<testapp::Build> = (0..2)
        .map(|i| testapp::make_build(&dirs.staging, &format!("file-{i}")))
        .collect::<Result<_, _>>()
        .map_err(BenchError::Build)?;
    let mut images = Vec::new();
    for name in ["a", "b"] {
        images.push(push_app_image(registry, &binaries.testapp, work, name)?);
    }
    let file_manifest = |i: usize| manifest(FILE, &format!("file-{i}"), &files[i], Mode::Overlap);
    let image_manifest_of =
        |i: usize| image_manifest(IMAGE, &format!("image-{i}"), &images[i].0, &images[i].1);

    let (mut file_swaps, mut image_swaps) = (Swaps::default(), Swaps::default());
    file_swaps.swap(&agent, FILE, &file_manifest(0)).await?;
    image_swaps
        .swap(&agent, IMAGE, &image_manifest_of(0))
        .await?;
    // The installs start nothing beside: not overlaps.
    file_swaps.steps.clear();
    image_swaps.steps.clear();
    let file_client = Client::start(&dirs.current_sock(FILE));
    let image_client = Client::start(&dirs.current_sock(IMAGE));
    for round in 1..=swaps {
        file_swaps
            .swap(&agent, FILE, &file_manifest(round % 2))
            .await?;
        image_swaps
            .swap(&agent, IMAGE, &image_manifest_of(round % 2))
            .await?;
    }
    let file_load = file_client.finish();
    let image_load = image_client.finish();
    agent.check_alive()?;
    agent.stop()?;

    println!(
        "\n== overlaps under load, {swaps} per instance, one agent: an image build against a file build"
    );
    println!(
        "{:<12} {:>9} {:>7} {:>22} {:>22} {:>26}",
        "build",
        "answered",
        "failed",
        "stage p50 / max (ms)",
        "swap p50 / p99 (ms)",
        "overhead p50 / p99 (ms)"
    );
    for (label, swaps, (answered, failures)) in [
        ("file", &file_swaps, &file_load),
        ("image", &image_swaps, &image_load),
    ] {
        let stage = swaps.of(|s| s == "stage");
        let all = swaps.of(|_| true);
        let overhead = swaps.of(|s| s != "stage" && s != "health");
        println!(
            "{label:<12} {answered:>9} {:>7} {:>22} {:>22} {:>26}",
            failures.len(),
            format!("{:.1} / {:.1}", stage.p50, stage.max),
            format!("{:.1} / {:.1}", all.p50, all.p99),
            format!("{:.1} / {:.1}", overhead.p50, overhead.p99),
        );
        if !failures.is_empty() {
            return Err(BenchError::Agent(format!(
                "{label}: {} requests failed during the overlaps, first: {}",
                failures.len(),
                failures[0]
            )));
        }
    }
    println!(
        "(overhead: the agent's steps summed minus the successor's boot to healthy and minus stage, which holds an image's pull; the first swap to the second image pulls it, the rest find it stored)"
    );
    Ok(())
}
