//! Managed directories (SPEC 5.16, `process.directories`) on real
//! processes through the engine: made owned by the instance's user,
//! writable inside the default sandbox, named in `STATE_DIRECTORY`,
//! `CACHE_DIRECTORY` and `RUNTIME_DIRECTORY`, shared by the generations of
//! an overlap; state kept and runtime removed when the instance is stopped.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};

use genswap_crds::{DirectoriesSpec, Outcome};
use sha2::Digest;
use swap_host::SwapHost;

const NOBODY: u32 = 65534;

/// A `#!/bin/sh` build that writes its generation into each managed
/// directory, lists what it found there into `$STATE_DIRECTORY/seen-<G>`,
/// and execs the test app (given the test's temp dir as a writable path).
fn recording_build(host: &SwapHost, name: &str) -> testapp::Build {
    let app = host.build(&format!("{name}-app"));
    let path = host.staging.join(name);
    let text = format!(
        "#!/bin/sh\n\
         ls \"$STATE_DIRECTORY\" > \"$STATE_DIRECTORY/seen-$GENSWAP_GENERATION\"\n\
         for dir in \"$STATE_DIRECTORY\" \"$CACHE_DIRECTORY\" \"$RUNTIME_DIRECTORY\"; do\n\
           echo \"$GENSWAP_GENERATION\" > \"$dir/gen-$GENSWAP_GENERATION\" || exit 3\n\
         done\n\
         exec {}\n",
        app.path.display()
    );
    fs::write(&path, &text).expect("write the script");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod");
    testapp::Build {
        path,
        sha256: hex::encode(sha2::Sha256::digest(text.as_bytes())),
    }
}

#[tokio::test]
async fn managed_directories_are_the_instances_shared_by_an_overlap_and_runtime_goes_with_it() {
    let host = SwapHost::new("sandbox-dirs");
    let state_root = host
        .state_dir
        .join("instances")
        .join(node_agent::disk_name::DiskName::of(&host.instance).to_string());
    let state = state_root.join("state");
    let cache = state_root.join("cache");
    let runtime = node_agent::switch::RunLayout::new(&host.run_dir)
        .instance_dir(&host.instance)
        .join("runtime");
    // The instance owns its run dir: a link it left where its runtime
    // directory goes is replaced, never followed (root would chown /etc).
    let victim = tempfile::tempdir().expect("a directory to protect");
    fs::set_permissions(victim.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    fs::create_dir_all(runtime.parent().expect("the run dir")).expect("the run dir");
    std::os::unix::fs::symlink(victim.path(), &runtime).expect("a link");
    for (rev, name) in [(1, "b1"), (2, "b2")] {
        let build = recording_build(&host, name);
        let mut attempt = host.attempt(rev, &build, name);
        attempt.spec.process.directories = DirectoriesSpec {
            state: true,
            cache: true,
            runtime: true,
        };
        swap_host::writable(&mut attempt, &host.staging);
        let result = host.swap(&attempt).await;
        assert_eq!(result.outcome, Outcome::Done, "{name}: {result:?}");
    }
    for dir in [&state, &cache, &runtime] {
        let meta = fs::metadata(dir).expect("made");
        assert_eq!(
            (meta.uid(), meta.gid()),
            (NOBODY, NOBODY),
            "{}",
            dir.display()
        );
        assert_eq!(meta.mode() & 0o7777, 0o755, "{}", dir.display());
        for n in [1, 2] {
            assert_eq!(
                fs::read_to_string(dir.join(format!("gen-{n}")))
                    .unwrap_or_default()
                    .trim(),
                n.to_string(),
                "generation {n} wrote {}",
                dir.display()
            );
        }
    }
    let untouched = fs::metadata(victim.path()).expect("the victim");
    assert_eq!(
        (untouched.uid(), untouched.mode() & 0o7777),
        (0, 0o755),
        "the link's target is not chowned"
    );
    assert!(
        fs::symlink_metadata(&runtime).expect("runtime").is_dir(),
        "runtime is a directory, not the link"
    );
    // Generation 2 found generation 1's state: one directory for both.
    let seen = fs::read_to_string(state.join("seen-2")).expect("what generation 2 found");
    assert!(seen.lines().any(|l| l == "gen-1"), "{seen}");

    host.tear_down().await;
    assert!(!runtime.exists(), "runtime removed with the instance");
    assert!(state.join("gen-2").exists(), "state kept");
    assert!(cache.join("gen-2").exists(), "cache kept");
}
