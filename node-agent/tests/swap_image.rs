//! Image builds through the whole engine (SPEC 5.14): two images built by
//! umoci (the test app's server in a tree, its config's Entrypoint) and
//! pushed by skopeo to a real registry with TLS and basic auth; the first
//! is installed, the second overlaps it while a client sends requests
//! through `current.sock` without a pause, and no request fails. A
//! registry that is down is the source's fault: the attempt is abandoned
//! with nothing run, and the incumbent serves.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use genswap_crds::{Artifact, BuildSpec, Outcome};
use genswap_store::RegistrySettings;
use node_agent::classify::StepOutcome;
use node_agent::engine::{Attempt, Step};
use swap_host::SwapHost;
use test_cluster::registry::{self, Access, Registry, Umoci};

/// An image of the test app's server at `/bin/testapp`, with a marker file
/// naming `name`, built by umoci in `dir` and pushed as `app:<name>`.
fn push_testapp_image(host: &SwapHost, registry: &Registry, name: &str) -> String {
    let dir = host
        .staging
        .parent()
        .expect("temp dir")
        .join(format!("image-{name}"));
    fs::create_dir_all(&dir).expect("image dir");
    let image = Umoci::new(&dir, name);
    let rootfs = image.rootfs();
    fs::create_dir_all(rootfs.join("bin")).expect("bin");
    fs::create_dir_all(rootfs.join("share")).expect("share");
    let server = host.build(&format!("server-{name}"));
    fs::copy(&server.path, rootfs.join("bin/testapp")).expect("the server");
    fs::set_permissions(
        rootfs.join("bin/testapp"),
        fs::Permissions::from_mode(0o755),
    )
    .expect("chmod");
    image.layer();
    fs::write(rootfs.join("share/name"), name).expect("marker");
    image.layer();
    image.config(&["--config.entrypoint", "/bin/testapp"]);
    registry.push(&image.layout, image.tag(), "apps/testapp", name, &[])
}

fn image_attempt(host: &SwapHost, rev: i64, id: &str, image: String, digest: &str) -> Attempt {
    host.attempt_of(
        rev,
        BuildSpec {
            signed_by: None,
            signature: None,
            id: id.into(),
            artifact: Artifact {
                path: None,
                url: None,
                image: Some(image),
                unpack: None,
            },
            sha256: digest.into(),
            entrypoint: None,
        },
    )
}

/// Requests through `socket`, a new connection each, until `stop`: how
/// many were answered 200 (also counted in `answered` as they come) and
/// what failed.
async fn load(
    socket: PathBuf,
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
) -> (u64, Vec<String>) {
    let mut failures = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        match node_agent::health::get_within(&socket, "/", Duration::from_secs(10)).await {
            Ok((200, _)) => {
                answered.fetch_add(1, Ordering::SeqCst);
            }
            Ok((status, body)) => {
                failures.push(format!("{status}: {}", String::from_utf8_lossy(&body)))
            }
            Err(error) => failures.push(error.to_string()),
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    (answered.load(Ordering::SeqCst), failures)
}

/// Waits until the client has had `more` answers beyond `from`.
async fn answers_beyond(answered: &AtomicU64, from: u64, more: u64) {
    let deadline = tokio::time::Instant::now() + swap_host::DEADLINE;
    while answered.load(Ordering::SeqCst) < from + more {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the client got no answers"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_overlaps_another_under_load_without_a_failed_request() {
    let Some(mut registry) = Registry::start(Access::TlsWithAuth) else {
        return;
    };
    let credentials = tempfile::NamedTempFile::new().expect("config file");
    registry.write_docker_config(credentials.path(), registry::USER, registry::PASSWORD);
    let settings = RegistrySettings {
        config: Some(credentials.path().to_path_buf()),
        ca: Some(registry.ca.clone()),
        insecure: Vec::new(),
    };
    let host = SwapHost::with_stager("image-overlap", |config| config.registries = settings);
    let first = push_testapp_image(&host, &registry, "one");
    let second = push_testapp_image(&host, &registry, "two");
    let addr = registry.addr.clone();
    let reference =
        |name: &str, digest: &str| format!("{addr}/apps/testapp:{name}@sha256:{digest}");

    let result = host
        .swap(&image_attempt(
            &host,
            1,
            "image-one",
            reference("one", &first),
            &first,
        ))
        .await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert_eq!(host.who_serves().await.expect("serves").build, "image-one");

    let stop = Arc::new(AtomicBool::new(false));
    let counted = Arc::new(AtomicU64::new(0));
    let client = tokio::spawn(load(host.current_sock(), stop.clone(), counted.clone()));
    // The client runs against the incumbent before the swap starts ...
    answers_beyond(&counted, 0, 20).await;
    let result = host
        .swap(&image_attempt(
            &host,
            2,
            "image-two",
            reference("two", &second),
            &second,
        ))
        .await;
    // ... and against the successor after it.
    answers_beyond(&counted, counted.load(Ordering::SeqCst), 20).await;
    stop.store(true, Ordering::SeqCst);
    let (answered, failures) = client.await.expect("the client");
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    let serving = host.who_serves().await.expect("serves");
    assert_eq!(
        (serving.build.as_str(), serving.generation),
        ("image-two", 2)
    );
    eprintln!(
        "image overlap under load: {answered} requests answered, {} failed",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} failed: {failures:?}",
        failures.len()
    );
    assert!(answered > 50, "the client ran across the swap: {answered}");
    // What runs is the image's server, from its tree.
    let exe = fs::read_link(format!("/proc/{}/exe", serving.pid)).expect("exe");
    assert!(
        exe.to_string_lossy()
            .contains(&format!("tree-sha256-{second}/rootfs/bin/testapp")),
        "{}",
        exe.display()
    );

    // The registry down: a third image cannot be had; nothing runs, the
    // attempt is abandoned, the second image serves on.
    let third = push_testapp_image(&host, &registry, "three");
    registry.kill();
    let result = host
        .swap(&image_attempt(
            &host,
            3,
            "image-three",
            reference("three", &third),
            &third,
        ))
        .await;
    assert_eq!(result.outcome, Outcome::Abandoned, "{result:?}");
    assert!(!result.executed);
    let last = result.steps.last().expect("a step");
    assert_eq!((last.step, last.result), (Step::Stage, StepOutcome::Stale));
    swap_host::assert_says(
        &result.reason,
        &[&registry.addr, "could not be connected to"],
    );
    assert_eq!(host.who_serves().await.expect("serves").build, "image-two");
    host.assert_only(Some(2));
    host.tear_down().await;
}
