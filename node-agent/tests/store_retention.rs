//! The store's retention through the engine (SPEC 5.14): with a byte limit
//! the builds in use alone pass and nothing else kept (`--store-keep 0`),
//! a collection in the middle of an overlap removes neither the serving
//! nor the starting tree; after it, the previous build stays for a
//! rollback; one release later it goes.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use genswap_crds::{Outcome, Unpack};
use genswap_store::RetentionPolicy;
use node_agent::engine::{Attempt, Cancel};
use swap_host::{OpenGate, SwapHost};

/// A tree archive of the test app's server, distinct per `name`.
fn testapp_archive(host: &SwapHost, name: &str) -> (PathBuf, String) {
    let src = host
        .staging
        .parent()
        .expect("temp dir")
        .join(format!("src-{name}"));
    fs::create_dir_all(src.join("bin")).expect("bin");
    let server = host.build(&format!("server-{name}"));
    fs::copy(&server.path, src.join("bin/testapp")).expect("server");
    fs::set_permissions(src.join("bin/testapp"), fs::Permissions::from_mode(0o755)).expect("chmod");
    fs::write(src.join("name"), name).expect("name");
    let archive = host.staging.join(format!("{name}.tar.gz"));
    let digest = swap_host::tar_tree(&src, &archive, Unpack::TarGzip);
    (archive, digest)
}

fn tree_attempt(
    host: &SwapHost,
    rev: i64,
    name: &str,
    (archive, digest): &(PathBuf, String),
) -> Attempt {
    host.attempt_of(
        rev,
        swap_host::archive_build(name, archive, digest, Unpack::TarGzip, "bin/testapp"),
    )
}

fn stored(host: &SwapHost) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(host.stager.store().dir())
        .expect("store")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("tree-"))
        .collect();
    names.sort();
    names
}

/// A host whose store keeps nothing retention may remove: no count kept,
/// one byte allowed.
fn keeping_nothing(tag: &str) -> SwapHost {
    SwapHost::with_stager(tag, |config| {
        config.retention = RetentionPolicy {
            keep: 0,
            max_bytes: 1,
        };
    })
}

fn tree(digest: &str) -> String {
    format!("tree-sha256-{digest}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_never_removes_a_tree_in_use_even_past_its_limit() {
    let host = keeping_nothing("retention");
    let a = testapp_archive(&host, "a");
    let b = testapp_archive(&host, "b");
    let c = testapp_archive(&host, "c");
    let unused = testapp_archive(&host, "unused");

    let result = host.swap(&tree_attempt(&host, 1, "a", &a)).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    // A tree nothing runs: staged, then left.
    host.stager
        .stage(&tree_attempt(&host, 99, "unused", &unused).spec.build)
        .await
        .expect("staged");
    assert_eq!(stored(&host).len(), 2);

    // The overlap to b, its successor slow to bind: collect in the middle.
    let mut attempt = tree_attempt(&host, 2, "b", &b);
    swap_host::knob(&mut attempt, "TESTAPP_BOOT_DELAY_MS", "1500");
    let engine = host.engine.clone();
    let overlap =
        tokio::spawn(async move { engine.swap(&attempt, &OpenGate, &Cancel::new()).await });
    swap_host::eventually("the successor's cgroup", || {
        host.generation_cgroups().contains(&2)
    })
    .await;
    let report = host.engine.collect_store().await.expect("collected");
    assert_eq!(report.removed, vec![tree(&unused.1)], "{report:?}");
    assert_eq!(stored(&host), {
        let mut both = vec![tree(&a.1), tree(&b.1)];
        both.sort();
        both
    });
    assert!(
        report.kept_bytes > 1,
        "the limit is passed by what is in use: {report:?}"
    );
    let result = overlap.await.expect("the overlap");
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert_eq!(host.who_serves().await.expect("serves").build, "b");

    // After the overlap a stays: it is the previous build.
    let mut both = vec![tree(&a.1), tree(&b.1)];
    both.sort();
    assert_eq!(stored(&host), both);

    // One release later, a is neither serving nor previous: it goes.
    let result = host.swap(&tree_attempt(&host, 3, "c", &c)).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    let mut now = vec![tree(&b.1), tree(&c.1)];
    now.sort();
    assert_eq!(stored(&host), now);
    host.tear_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_staged_ahead_is_kept_until_its_holder_lets_go() {
    let host = keeping_nothing("retention-ahead");
    let a = testapp_archive(&host, "a");
    let ahead = testapp_archive(&host, "ahead");
    let result = host.swap(&tree_attempt(&host, 1, "a", &a)).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");

    // Staged ahead of its swap, as a stage-only attempt does, and held.
    let build = tree_attempt(&host, 2, "ahead", &ahead).spec.build;
    let status = node_agent::prestage::stage_ahead(&host.stager, &build, None, |_| {}).await;
    assert_eq!(status.outcome, Some(Outcome::Done), "{status:?}");
    assert_eq!(status.executed, Some(false));
    host.engine
        .keep_prestaged("attempt apps/web-node-a-2", vec![ahead.1.clone()]);
    let report = host.engine.collect_store().await.expect("collected");
    assert!(report.removed.is_empty(), "{report:?}");
    let mut both = vec![tree(&a.1), tree(&ahead.1)];
    both.sort();
    assert_eq!(stored(&host), both);

    // Its holder gone (no swap followed): retention may take it.
    host.engine
        .keep_prestaged("attempt apps/web-node-a-2", Vec::new());
    let report = host.engine.collect_store().await.expect("collected");
    assert_eq!(report.removed, vec![tree(&ahead.1)], "{report:?}");
    host.tear_down().await;
}
