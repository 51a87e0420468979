//! Pre-staging's figures (SPEC 5.15, docs/BENCHMARKS.md "Pre-staging"):
//! the suite's control plane, the controller and three agents as
//! processes (three Nodes), a real registry (distribution, images pushed
//! by skopeo) behind a link that carries each connection's answers at
//! [`LINK_BYTES_PER_SECOND`], and a 100 MiB image of the test app. In one
//! run, with `maxParallel: 1`:
//!
//! 1. a release of an image no node holds, without pre-staging: each swap
//!    downloads inside its stage step;
//! 2. the same release of an image every node still stores (the undo
//!    case): what a swap costs without a download;
//! 3. a release of an image no node holds, with pre-staging: every node
//!    fetches it before the canary starts;
//! 4. the same, with the registry stopped as soon as every node holds it.
//!
//! For each it prints the time from the first swap to all Ready and the
//! whole release, and what the agents wrote to the API server per attempt
//! (from its audit log). Only correctness is asserted; the times are
//! printed. What stands in: the link paces bytes but adds no latency or
//! loss; the nodes share one disk and one CPU pair.

mod support;

use std::ffi::OsString;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use genswap_crds::{InstanceGeneration, SwapAttempt};
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::{Value, json};
use support::{Cluster, INSTANCE_ID, Stack, apply_crds};
use test_cluster::registry::{Access, Registry, Umoci};
use test_cluster::slow_link::SlowLink;

const IG: &str = "big";
const FIELD_MANAGER: &str = "genswap-e2e";
const LABEL: &str = "e2e.genswap.dev/prestage";
const STEP_DEADLINE: Duration = Duration::from_secs(300);
const IMAGE_BYTES: usize = 100 * 1024 * 1024;
const LINK_BYTES_PER_SECOND: u64 = 25 * 1024 * 1024;

/// An image of the test app with `IMAGE_BYTES` of incompressible filler,
/// pushed as `apps/big:<name>`; its manifest digest (hex).
fn push_big_image(registry: &Registry, dir: &Path, name: &str) -> String {
    let image = Umoci::new(&dir.join(format!("image-{name}")), name);
    let rootfs = image.rootfs();
    std::fs::create_dir_all(rootfs.join("bin")).expect("bin");
    std::fs::create_dir_all(rootfs.join("data")).expect("data");
    let server = testapp::binary().expect("the test app is built");
    let build =
        testapp::make_build_from(&server, dir, &format!("server-{name}")).expect("the server");
    std::fs::copy(&build.path, rootfs.join("bin/testapp")).expect("copy the server");
    let mut filler = std::io::BufWriter::new(
        std::fs::File::create(rootfs.join("data/filler")).expect("the filler"),
    );
    // xorshift: fast, and gzip cannot shrink it.
    let mut state: u64 =
        0x9E37_79B9_7F4A_7C15 ^ name.len() as u64 ^ (name.as_bytes()[0] as u64) << 32;
    let mut block = vec![0u8; 1 << 20];
    for _ in 0..IMAGE_BYTES / block.len() {
        for chunk in block.chunks_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
        }
        filler.write_all(&block).expect("write the filler");
    }
    filler.flush().expect("flush the filler");
    drop(filler);
    image.layer();
    image.config(&["--config.entrypoint", "/bin/testapp"]);
    registry.push(&image.layout, image.tag(), "apps/big", name, &[])
}

/// What one release took.
struct Timing {
    first_swap_to_ready: Duration,
    whole: Duration,
    /// From the apply to every node holding the build, when pre-staged.
    prestaged_after: Option<Duration>,
    fetched_bytes: i64,
    agent_writes: usize,
    attempts: usize,
}

struct Bench {
    igs: Api<InstanceGeneration>,
    attempts: Api<SwapAttempt>,
    audit: std::path::PathBuf,
    namespace: String,
}

impl Bench {
    /// Applies `object` and waits until every node serves `build`, timing
    /// it; `on_prestaged` runs once every node holds the build.
    async fn release(
        &self,
        object: Value,
        build: &str,
        mut on_prestaged: Option<&mut dyn FnMut()>,
    ) -> Timing {
        let Bench {
            igs,
            attempts,
            audit,
            namespace,
        } = self;
        let from = audit_lines(audit);
        igs.patch(
            IG,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&object),
        )
        .await
        .expect("apply the instance");
        let applied = Instant::now();
        let deadline = applied + STEP_DEADLINE;
        let (mut first_swap, mut prestaged_after) = (None, None);
        let mut seen = std::collections::BTreeSet::new();
        loop {
            let list = attempts
                .list(&ListParams::default())
                .await
                .expect("list attempts");
            for attempt in &list.items {
                if attempt.spec.build.id == build {
                    seen.insert(attempt.metadata.name.clone().unwrap_or_default());
                    if !attempt.spec.stage_only && first_swap.is_none() {
                        first_swap = Some(Instant::now());
                    }
                }
            }
            let ig = igs.get(IG).await.expect("get the instance");
            let status = ig.status.clone().unwrap_or_default();
            let record = status.rollout.as_ref().and_then(|r| r.prestage.clone());
            if prestaged_after.is_none()
                && record
                    .as_ref()
                    .is_some_and(|p| p.build == build && p.done_at.is_some())
            {
                prestaged_after = Some(applied.elapsed());
                if let Some(hook) = on_prestaged.as_mut() {
                    hook();
                }
            }
            let ready = status.conditions.iter().any(|c| {
                c.type_ == "Ready"
                    && c.status == "True"
                    && c.observed_generation == ig.metadata.generation
            });
            if ready && status.desired.as_ref().is_some_and(|d| d.build == build) {
                let done = Instant::now();
                let first_swap = first_swap.expect("a swap was seen");
                return Timing {
                    first_swap_to_ready: done - first_swap,
                    whole: done - applied,
                    prestaged_after,
                    fetched_bytes: record
                        .filter(|p| p.build == build)
                        .map_or(0, |p| p.fetched_bytes),
                    agent_writes: agent_requests(audit, from, namespace),
                    attempts: seen.len(),
                };
            }
            assert!(
                Instant::now() < deadline,
                "{build} did not reach Ready: {status:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Lines of the audit log so far.
fn audit_lines(audit: &Path) -> usize {
    std::fs::read_to_string(audit)
        .unwrap_or_default()
        .lines()
        .count()
}

/// The agents' requests on SwapAttempts in `namespace` since line `from`:
/// their GETs (an inbox entry read) and status writes. The controller
/// lists and watches, creates and deletes, and writes annotations.
fn agent_requests(audit: &Path, from: usize, namespace: &str) -> usize {
    std::fs::read_to_string(audit)
        .unwrap_or_default()
        .lines()
        .skip(from)
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|event| event["stage"] == "ResponseComplete")
        .filter(|event| {
            event["objectRef"]["resource"] == "swapattempts"
                && event["objectRef"]["namespace"] == namespace
        })
        .filter(|event| {
            (event["verb"] == "get" && event["objectRef"]["subresource"].is_null())
                || (event["verb"] == "patch" && event["objectRef"]["subresource"] == "status")
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prestaging_takes_the_download_out_of_every_swap() {
    let Some(cluster) = Cluster::find().await else {
        return;
    };
    let Some(plane) = cluster.own() else {
        println!("prestage figures: skipped (they need the suite's own control plane's audit log)");
        return;
    };
    let Some(mut registry) = Registry::start(Access::Plain) else {
        return;
    };
    apply_crds(&cluster);
    let link = SlowLink::start(registry.addr.clone(), LINK_BYTES_PER_SECOND).await;
    let images = support::host_dir();
    let names = ["one", "two", "three", "four"];
    let digests: Vec<String> = names
        .iter()
        .map(|name| push_big_image(&registry, images.path(), name))
        .collect();

    let group = format!("g{}", support::unique());
    let labels = [(LABEL, group.as_str())];
    let extra =
        || -> Vec<OsString> { vec!["--insecure-registry".into(), link.address.clone().into()] };
    let stack = Stack::start_full(&cluster, "prestage", extra(), Vec::new(), &labels).await;
    let _second = stack
        .second_agent_with(&cluster, "prestage-b", &labels, extra())
        .await;
    let _third = stack
        .second_agent_with(&cluster, "prestage-c", &labels, extra())
        .await;
    let client = cluster.client().await;
    let namespace = stack.namespace.name.clone();
    let igs: Api<InstanceGeneration> = Api::namespaced(client.clone(), &namespace);
    let attempts: Api<SwapAttempt> = Api::namespaced(client, &namespace);
    let audit = plane.audit_log();

    let spec = |index: usize, prestage: bool| {
        json!({
            "apiVersion": "genswap.dev/v1alpha1",
            "kind": "InstanceGeneration",
            "metadata": {"name": IG, "namespace": namespace},
            "spec": {
                "nodeSelector": {LABEL: group},
                "build": {
                    "id": format!("big-{}", names[index]),
                    "artifact": {"image": format!("{}/apps/big:{}@sha256:{}", link.address, names[index], digests[index])},
                    "sha256": digests[index],
                },
                "process": {"user": INSTANCE_ID, "group": INSTANCE_ID},
                "health": {"path": "/", "timeoutSeconds": 10},
                "settle": {"seconds": 0},
                "stop": {"timeoutSeconds": 5},
                "rollout": {"canaryNodes": 1, "maxParallel": 1, "prestage": prestage,
                            "progressDeadlineSeconds": 600},
            },
        })
    };
    let bench = Bench {
        igs,
        attempts,
        audit,
        namespace: namespace.clone(),
    };
    let release =
        |index: usize, prestage: bool| (spec(index, prestage), format!("big-{}", names[index]));

    // The install (every node downloads inside its swap).
    let (object, build) = release(0, false);
    bench.release(object, &build, None).await;
    let (object, build) = release(1, false);
    let without = bench.release(object, &build, None).await;
    let (object, build) = release(0, false);
    let stored = bench.release(object, &build, None).await;
    let (object, build) = release(2, true);
    let with = bench.release(object, &build, None).await;
    let (object, build) = release(3, true);
    let mut stop_registry = || registry.stop();
    let stopped = bench
        .release(object, &build, Some(&mut stop_registry))
        .await;

    let mib = |bytes: i64| bytes as f64 / (1024.0 * 1024.0);
    println!(
        "prestage figures: 3 agents on a real API server, a {:.0} MiB image over a link of {:.0} MiB/s per connection, canaryNodes 1, maxParallel 1",
        mib(IMAGE_BYTES as i64),
        mib(LINK_BYTES_PER_SECOND as i64)
    );
    println!(
        "  release                                  first swap to all Ready   whole release   agent requests per attempt"
    );
    for (what, timing) in [
        ("an image every node stores (undo)", &stored),
        ("a new image, without pre-staging", &without),
        ("a new image, with pre-staging", &with),
        ("the same, registry stopped once staged", &stopped),
    ] {
        println!(
            "  {what:<40} {:>10.1} s {:>21.1} s   {:.2} ({} requests, {} attempts){}",
            timing.first_swap_to_ready.as_secs_f64(),
            timing.whole.as_secs_f64(),
            timing.agent_writes as f64 / timing.attempts.max(1) as f64,
            timing.agent_writes,
            timing.attempts,
            timing
                .prestaged_after
                .map(|after| format!(
                    "; every node held it {:.1} s after the apply, {:.0} MiB fetched",
                    after.as_secs_f64(),
                    mib(timing.fetched_bytes)
                ))
                .unwrap_or_default()
        );
    }
    println!(
        "  first swap to all Ready with pre-staging: {:.0} % of the stored image's",
        100.0 * with.first_swap_to_ready.as_secs_f64() / stored.first_swap_to_ready.as_secs_f64()
    );

    assert!(with.prestaged_after.is_some() && stopped.prestaged_after.is_some());
    let image_bytes = IMAGE_BYTES as i64;
    assert!(
        with.fetched_bytes >= 3 * image_bytes,
        "every node fetched the image ahead: {} bytes",
        with.fetched_bytes
    );
}
