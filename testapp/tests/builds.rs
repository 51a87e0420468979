//! Finding the built server and making distinct builds of it.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use common::{AppSpec, get};
use sha2::{Digest, Sha256};

#[test]
fn binary_finds_the_server_cargo_built() {
    let found = testapp::binary().expect("binary() finds the server");
    let built = PathBuf::from(env!("CARGO_BIN_EXE_genswap-testapp"));
    assert_eq!(
        found.canonicalize().expect("found exists"),
        built.canonicalize().expect("built exists")
    );
}

#[test]
fn builds_differ_by_sha256_and_both_run() {
    let dir = tempfile::tempdir().expect("temp dir");
    let original = std::fs::read(testapp::binary().expect("binary")).expect("read binary");
    let builds: Vec<_> = ["build-a", "build-b"]
        .into_iter()
        .map(|name| testapp::make_build(dir.path(), name).expect("make_build"))
        .collect();
    assert_ne!(builds[0].sha256, builds[1].sha256);

    for (build, name) in builds.iter().zip(["build-a", "build-b"]) {
        assert_eq!(build.path, dir.path().join(name));
        let bytes = std::fs::read(&build.path).expect("read build");
        assert_eq!(build.sha256, hex::encode(Sha256::digest(&bytes)));
        assert_eq!(build.sha256, build.sha256.to_lowercase());
        assert_eq!(bytes, [original.as_slice(), name.as_bytes()].concat());
        let mode = std::fs::metadata(&build.path)
            .expect("metadata")
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o755);

        let mut app = AppSpec::new().binary(&build.path, name).spawn();
        app.wait_for_socket();
        let reply = get(&mut app.connect(), "/");
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-genswap-build"), Some(name));
        assert_eq!(reply.body, app.identity());
    }
}

#[test]
fn replacing_a_build_resets_its_mode() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("build-c");
    std::fs::write(&path, b"old").expect("old file");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let build = testapp::make_build(dir.path(), "build-c").expect("make_build");
    let mode = std::fs::metadata(&build.path)
        .expect("metadata")
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o755);
}
