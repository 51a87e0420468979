//! Standalone mode with tree builds (SPEC 5.14): an archive of the test
//! app's server, made by the real GNU tar, installs from a manifest and a
//! second archive overlaps it; the status file says done and Ready, and
//! what serves is the server inside the stored tree. With `process.root:
//! build`, the same server and the libraries it links (its own copies in
//! the tree) run with the tree as their root, through an overlap.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "standalone_support/mod.rs"]
mod standalone_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::fs;
use std::os::unix::fs::PermissionsExt;

use genswap_crds::{ConditionType, Outcome};
use standalone_support::{Manifest, StandaloneHost, key};

/// A tar+gzip archive of a tree with the test app's server at
/// `bin/server`, in the staging root, as a build the manifest names.
fn archive(host: &StandaloneHost, name: &str) -> testapp::Build {
    archive_of(host, name, false)
}

/// [`archive`], with the libraries the server links in the tree too when
/// `with_libraries` (to run with the tree as its root).
fn archive_of(host: &StandaloneHost, name: &str, with_libraries: bool) -> testapp::Build {
    let src = host
        .staging
        .parent()
        .expect("temp dir")
        .join(format!("src-{name}"));
    fs::create_dir_all(src.join("bin")).expect("bin");
    let server = host.build(&format!("server-{name}"));
    fs::copy(&server.path, src.join("bin/server")).expect("server");
    fs::set_permissions(src.join("bin/server"), fs::Permissions::from_mode(0o755)).expect("chmod");
    if with_libraries {
        testapp::copy_libraries(&src, &server.path).expect("its libraries");
    }
    let path = host.staging.join(format!("{name}.tar.gz"));
    let sha256 = swap_host::tar_tree(&src, &path, genswap_crds::Unpack::TarGzip);
    testapp::Build { path, sha256 }
}

fn tree_manifest(name: &str, build: &testapp::Build) -> Manifest {
    let mut manifest = Manifest::new("hello", name, build);
    manifest.tree = Some(("tar+gzip", "bin/server".into()));
    manifest
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_archive_installs_and_another_overlaps_it() {
    let host = StandaloneHost::start("trees");
    let hello = key("hello");
    let one = archive(&host, "tree-1");
    let two = archive(&host, "tree-2");

    host.write("hello.yaml", &tree_manifest("tree-1", &one).yaml());
    let doc = host.settled_after("hello.yaml", 0).await;
    let install = doc.last_attempt().expect("the install");
    assert_eq!(install.outcome, Outcome::Done, "{install:?}");
    assert_eq!(
        host.who_serves(&hello).await.expect("serves").build,
        "tree-1"
    );

    host.write("hello.yaml", &tree_manifest("tree-2", &two).yaml());
    let doc = host.settled_after("hello.yaml", install.sched_rev).await;
    let release = doc.last_attempt().expect("the release");
    assert_eq!(release.outcome, Outcome::Done, "{release:?}");
    assert!(doc.is_true(ConditionType::Ready));
    let serving = host.who_serves(&hello).await.expect("serves");
    assert_eq!(serving.build, "tree-2");
    let exe = fs::read_link(format!("/proc/{}/exe", serving.pid)).expect("exe");
    assert!(
        exe.to_string_lossy()
            .contains(&format!("tree-sha256-{}/rootfs/bin/server", two.sha256)),
        "{}",
        exe.display()
    );
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_archive_runs_with_its_tree_as_root_through_an_overlap() {
    let host = StandaloneHost::start("trees-as-root");
    let hello = key("hello");
    let rooted = |name: &str| {
        let mut manifest = tree_manifest(name, &archive_of(&host, name, true));
        manifest.root_build = true;
        manifest
    };

    host.write("hello.yaml", &rooted("rooted-1").yaml());
    let doc = host.settled_after("hello.yaml", 0).await;
    let install = doc.last_attempt().expect("the install");
    assert_eq!(install.outcome, Outcome::Done, "{install:?}");

    host.write("hello.yaml", &rooted("rooted-2").yaml());
    let doc = host.settled_after("hello.yaml", install.sched_rev).await;
    let release = doc.last_attempt().expect("the release");
    assert_eq!(release.outcome, Outcome::Done, "{release:?}");
    assert!(doc.is_true(ConditionType::Ready));
    // It answers on its socket in the run dir, bound into its root, and
    // its executable is /bin/server of its own root.
    let serving = host.who_serves(&hello).await.expect("serves");
    assert_eq!(serving.build, "rooted-2");
    let exe = fs::read_link(format!("/proc/{}/exe", serving.pid)).expect("exe");
    assert_eq!(exe, std::path::Path::new("/bin/server"));
    let root = format!("/proc/{}/root", serving.pid);
    assert!(fs::metadata(format!("{root}/bin/server")).is_ok());
    assert!(
        fs::metadata(format!("{root}/usr/bin")).is_err(),
        "the node's /usr is not in its root"
    );
    host.stop().await;
}
