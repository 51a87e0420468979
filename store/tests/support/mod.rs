//! What the store's tests share: a store and staging root in a temp dir,
//! archives made by the real GNU tar (and gzip, zstd), and the checks that
//! nothing was left behind.

#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use genswap_crds::{Artifact, BuildSpec, Unpack};
use genswap_store::{StageError, Staged, Stager, StagerConfig, Store, TreeLimits};
use sha2::{Digest, Sha256};
use tempfile::TempDir;

/// A store and a staging root in one temp dir, removed on drop.
pub struct Fixture {
    pub dir: TempDir,
    pub staging: PathBuf,
    pub store_dir: PathBuf,
    pub stager: Stager,
}

impl Fixture {
    pub fn new() -> Fixture {
        Fixture::with_limits(TreeLimits::default())
    }

    pub fn with_limits(limits: TreeLimits) -> Fixture {
        let dir = tempfile::Builder::new()
            .prefix("genswap-store-test-")
            .tempdir()
            .expect("temp dir");
        let staging = dir.path().join("staging");
        fs::create_dir(&staging).expect("staging root");
        let store_dir = dir.path().join("store");
        let stager = stager_over(&staging, &store_dir, limits);
        Fixture {
            dir,
            staging,
            store_dir,
            stager,
        }
    }

    /// A second stager over the same store, as an agent that restarted
    /// has: it remembers nothing this one verified.
    pub fn restarted(&self) -> Stager {
        stager_over(
            &self.staging,
            &self.store_dir,
            self.stager.config().tree_limits,
        )
    }

    /// A directory of the fixture outside the staging root and the store.
    pub fn outside(&self, name: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        fs::create_dir_all(&path).expect("outside dir");
        path
    }

    /// Stages the archive at `path` with `entrypoint`.
    pub async fn stage(
        &self,
        path: &Path,
        format: Unpack,
        sha256: &str,
        entrypoint: &str,
    ) -> Result<Staged, StageError> {
        self.stager
            .stage(&archive_build(path, format, sha256, entrypoint))
            .await
    }

    /// What the store holds besides finished entries: temp files and trees
    /// an unfinished stage would leave.
    pub fn leftovers(&self) -> Vec<String> {
        fs::read_dir(&self.store_dir)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|name| name.starts_with('.'))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The stored trees, by name.
    pub fn trees(&self) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(&self.store_dir)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|name| name.starts_with("tree-"))
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }
}

fn stager_over(staging: &Path, store_dir: &Path, limits: TreeLimits) -> Stager {
    let mut config = StagerConfig::new(staging);
    config.tree_limits = limits;
    Stager::new(Store::open(store_dir).expect("store"), config).expect("stager")
}

/// A build of the archive at `path`.
pub fn archive_build(path: &Path, format: Unpack, sha256: &str, entrypoint: &str) -> BuildSpec {
    BuildSpec {
        signed_by: None,
        signature: None,
        id: "tree-1".into(),
        artifact: Artifact {
            path: Some(path.display().to_string()),
            url: None,
            image: None,
            unpack: Some(format),
        },
        sha256: sha256.into(),
        entrypoint: Some(entrypoint.into()),
    }
}

pub fn sha256_file(path: &Path) -> String {
    hex::encode(Sha256::digest(fs::read(path).expect("read archive")))
}

/// Runs a command and insists it succeeds.
pub fn run(command: &mut Command) {
    let output = command.output().expect("run a tool");
    assert!(
        output.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A small application tree: an executable script, a module beside it,
/// a symlink to the script, a setuid world-writable file, a nested dir.
pub fn app_tree(dir: &Path) {
    fs::create_dir_all(dir.join("bin")).expect("bin");
    fs::create_dir_all(dir.join("lib/app")).expect("lib");
    fs::write(dir.join("lib/app/main.sh"), "#!/bin/sh\nexec sleep 1000\n").expect("main");
    fs::set_permissions(
        dir.join("lib/app/main.sh"),
        fs::Permissions::from_mode(0o755),
    )
    .expect("chmod");
    fs::write(dir.join("lib/app/data.txt"), "data\n").expect("data");
    fs::set_permissions(
        dir.join("lib/app/data.txt"),
        fs::Permissions::from_mode(0o6777),
    )
    .expect("chmod");
    fs::write(dir.join("lib/app/conf"), "conf\n").expect("conf");
    fs::set_permissions(dir.join("lib/app/conf"), fs::Permissions::from_mode(0o666))
        .expect("chmod");
    std::os::unix::fs::symlink("../lib/app/main.sh", dir.join("bin/app")).expect("symlink");
}

/// `tar -c` of `dir`'s contents (with the `./` prefix GNU tar writes),
/// compressed as `format` by the real gzip or zstd.
pub fn gnu_tar(dir: &Path, out: &Path, format: Unpack) {
    let flag = match format {
        Unpack::Tar => None,
        Unpack::TarGzip => Some("--gzip"),
        Unpack::TarZstd => Some("--zstd"),
    };
    let mut command = Command::new("tar");
    command.arg("-C").arg(dir).arg("-cf").arg(out);
    if let Some(flag) = flag {
        command.arg(flag);
    }
    command.arg(".");
    run(&mut command);
}

/// Every file below `dir` that is not a directory, with its mode.
pub fn modes(dir: &Path) -> Vec<(String, u32, bool)> {
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, u32, bool)>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .expect("read dir")
        .filter_map(|e| e.ok())
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let meta = fs::symlink_metadata(entry.path()).expect("lstat");
        let rel = entry
            .path()
            .strip_prefix(root)
            .expect("below root")
            .display()
            .to_string();
        out.push((rel, meta.permissions().mode() & 0o7777, meta.is_dir()));
        if meta.is_dir() {
            walk(root, &entry.path(), out);
        }
    }
}
