//! Archive builds staged into trees: made by the real GNU tar, gzip and
//! zstd; unpacked read-only; staged again without the source; re-verified
//! after a restart and after tampering; made once when two stages race.

mod support;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use genswap_crds::Unpack;
use genswap_store::{EntrypointProblem, StageError};
use support::{Fixture, app_tree, gnu_tar, modes, sha256_file};

/// Makes the app tree's archive in `format` inside the staging root.
fn app_archive(fx: &Fixture, format: Unpack, name: &str) -> (std::path::PathBuf, String) {
    let src = fx.outside(&format!("src-{name}"));
    app_tree(&src);
    let archive = fx.staging.join(name);
    gnu_tar(&src, &archive, format);
    let digest = sha256_file(&archive);
    (archive, digest)
}

#[tokio::test]
async fn tar_gzip_and_zstd_archives_unpack_into_read_only_trees() {
    for (format, name) in [
        (Unpack::Tar, "app.tar"),
        (Unpack::TarGzip, "app.tar.gz"),
        (Unpack::TarZstd, "app.tar.zst"),
    ] {
        let fx = Fixture::new();
        let (archive, digest) = app_archive(&fx, format, name);
        let staged = fx
            .stage(&archive, format, &digest, "bin/app")
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let rootfs = staged.tree.clone().expect("a tree");
        assert_eq!(staged.sha256, digest);
        // The symlink was followed inside the tree to the real script.
        assert_eq!(staged.path, rootfs.join("lib/app/main.sh"), "{name}");
        assert_eq!(
            rootfs,
            fs::canonicalize(fx.store_dir.join(format!("tree-sha256-{digest}/rootfs")))
                .expect("tree")
        );
        let found = modes(&rootfs);
        let expect = [
            ("bin", 0o555, true),
            ("bin/app", 0o777, false),
            ("lib", 0o555, true),
            ("lib/app", 0o555, true),
            // 0666: no exec bit, no write for anyone.
            ("lib/app/conf", 0o444, false),
            // 6777: setuid, setgid and every write bit gone, exec kept.
            ("lib/app/data.txt", 0o555, false),
            ("lib/app/main.sh", 0o555, false),
        ];
        let expect: Vec<(String, u32, bool)> = expect
            .iter()
            .map(|(p, m, d)| (p.to_string(), *m, *d))
            .collect();
        assert_eq!(found, expect, "{name}");
        for entry in ["bin", "lib/app/main.sh", "lib/app/data.txt"] {
            let meta = fs::symlink_metadata(rootfs.join(entry)).expect("lstat");
            assert_eq!(meta.uid(), nix::unistd::geteuid().as_raw(), "{entry}");
        }
        assert_eq!(
            fs::metadata(rootfs.parent().expect("entry"))
                .expect("entry")
                .mode()
                & 0o7777,
            0o555
        );
        assert!(fx.leftovers().is_empty(), "{:?}", fx.leftovers());
        assert_eq!(
            staged.bytes,
            ("#!/bin/sh\nexec sleep 1000\n".len() + "data\n".len() + "conf\n".len()) as u64
        );
    }
}

#[tokio::test]
async fn a_stored_tree_is_staged_again_without_its_source_even_after_a_restart() {
    let fx = Fixture::new();
    let (archive, digest) = app_archive(&fx, Unpack::TarGzip, "app.tar.gz");
    let first = fx
        .stage(&archive, Unpack::TarGzip, &digest, "bin/app")
        .await
        .expect("staged");
    fs::remove_file(&archive).expect("remove the source");
    let again = fx
        .stage(&archive, Unpack::TarGzip, &digest, "bin/app")
        .await
        .expect("staged from the store");
    assert_eq!(again, first);
    let inode = fs::metadata(&first.path).expect("entry").ino();

    // A new agent remembers nothing: it hashes the tree against its listing
    // once, and needs no source either.
    let restarted = fx.restarted();
    let after_restart = restarted
        .stage(&support::archive_build(
            &archive,
            Unpack::TarGzip,
            &digest,
            "bin/app",
        ))
        .await
        .expect("staged after a restart");
    assert_eq!(after_restart, first);
    assert_eq!(
        fs::metadata(&first.path).expect("entry").ino(),
        inode,
        "the same tree"
    );
}

#[tokio::test]
async fn a_tampered_tree_is_found_and_unpacked_again() {
    let fx = Fixture::new();
    let (archive, digest) = app_archive(&fx, Unpack::Tar, "app.tar");
    let first = fx
        .stage(&archive, Unpack::Tar, &digest, "bin/app")
        .await
        .expect("staged");
    let rootfs = first.tree.clone().expect("tree");
    // Root can write anyway: the store's stamps and listing must notice.
    fs::set_permissions(
        rootfs.join("lib/app/data.txt"),
        fs::Permissions::from_mode(0o644),
    )
    .expect("chmod");
    fs::write(rootfs.join("lib/app/data.txt"), "evil\n").expect("tamper");

    let again = fx
        .stage(&archive, Unpack::Tar, &digest, "bin/app")
        .await
        .expect("staged again");
    let data = again.tree.clone().expect("tree").join("lib/app/data.txt");
    assert_eq!(fs::read_to_string(&data).expect("data"), "data\n");
    assert_eq!(fs::metadata(&data).expect("data").mode() & 0o7777, 0o555);
    // The tampered copy was moved aside under a temporary name, which the
    // next start removes.
    assert_eq!(fx.leftovers().len(), 1, "{:?}", fx.leftovers());
    let removed = fx.stager.store().remove_temp_files().expect("clean");
    assert_eq!(removed, 1);
    assert!(fx.leftovers().is_empty());
}

#[tokio::test]
async fn two_stages_of_one_digest_make_one_tree() {
    let fx = Fixture::new();
    let (archive, digest) = app_archive(&fx, Unpack::TarZstd, "app.tar.zst");
    let build = support::archive_build(&archive, Unpack::TarZstd, &digest, "bin/app");
    let (a, b) = tokio::join!(fx.stager.stage(&build), fx.stager.stage(&build));
    assert_eq!(a.expect("first"), b.expect("second"));
    assert_eq!(fx.trees(), vec![format!("tree-sha256-{digest}")]);
    assert!(fx.leftovers().is_empty(), "{:?}", fx.leftovers());
}

#[tokio::test]
async fn an_entrypoint_that_cannot_run_is_the_builds_fault() {
    let fx = Fixture::new();
    let (archive, digest) = app_archive(&fx, Unpack::Tar, "app.tar");
    for (entrypoint, problem) in [
        ("bin/missing", EntrypointProblem::Missing),
        (
            "lib",
            EntrypointProblem::NotExecutable("a directory".into()),
        ),
    ] {
        let error = fx
            .stage(&archive, Unpack::Tar, &digest, entrypoint)
            .await
            .expect_err("refused");
        match &error {
            StageError::Entrypoint {
                entrypoint: named,
                problem: found,
                ..
            } => {
                assert_eq!(named, entrypoint);
                assert_eq!(found, &problem);
            }
            other => panic!("{other:?}"),
        }
        assert!(error.is_build_fault(), "{error}");
        assert!(error.to_string().contains(entrypoint), "{error}");
    }
    // A symlink that points out of the tree resolves inside it, as a
    // process rooted in the tree would see it: here, to nothing.
    let src = fx.outside("src-abs");
    fs::create_dir(src.join("bin")).expect("bin");
    std::os::unix::fs::symlink("/bin/sh", src.join("bin/escape")).expect("symlink");
    let archive = fx.staging.join("abs.tar");
    gnu_tar(&src, &archive, Unpack::Tar);
    let error = fx
        .stage(&archive, Unpack::Tar, &sha256_file(&archive), "bin/escape")
        .await
        .expect_err("no /bin/sh inside the tree");
    assert!(
        matches!(
            &error,
            StageError::Entrypoint {
                problem: EntrypointProblem::Missing,
                ..
            }
        ),
        "{error:?}"
    );
}

#[tokio::test]
async fn temp_trees_a_crash_left_are_removed_at_start() {
    let fx = Fixture::new();
    let temp = fx.store_dir.join(".incoming.tmp-1-2-3");
    fs::create_dir_all(temp.join("rootfs/a/b")).expect("temp tree");
    fs::write(temp.join("rootfs/a/b/file"), "x").expect("file");
    for dir in ["rootfs/a/b", "rootfs/a", "rootfs", ""] {
        fs::set_permissions(temp.join(dir), fs::Permissions::from_mode(0o555)).expect("chmod");
    }
    assert_eq!(fx.stager.store().remove_temp_files().expect("clean"), 1);
    assert!(!Path::new(&temp).exists());
}
