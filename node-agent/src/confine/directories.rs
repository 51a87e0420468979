//! Managed directories (SPEC 5.16, `process.directories`): what systemd's
//! `StateDirectory=`, `CacheDirectory=` and `RuntimeDirectory=` give a
//! service. The agent makes each under its own roots, owned by the
//! instance's user and group (mode 0755, as systemd's default), keeps it
//! writable inside the sandbox at the same path, and names it to every
//! process of the instance in `STATE_DIRECTORY`, `CACHE_DIRECTORY` and
//! `RUNTIME_DIRECTORY`.
//!
//! - state: `<state dir>/instances/<disk name>/state`
//! - cache: `<state dir>/instances/<disk name>/cache`
//! - runtime: `<run dir>/<disk name>/runtime`
//!
//! The path is the same for every generation, so both generations of an
//! overlap share it. State and cache are never removed by the agent;
//! runtime goes with the instance's run dir.

use std::fs;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use genswap_crds::DirectoriesSpec;

use crate::disk_name::DiskName;
use crate::gate::InstanceKey;

/// Makes `path` a directory of `uid`/`gid` with `mode`, never through a
/// link: the runtime directory and a generation's private directory lie in
/// the instance's run dir, which its user owns and could fill with a link
/// to `/etc` for the agent (root) to chown. What is there and is not a
/// directory is removed first; the owner and mode are set on a descriptor
/// opened without following links.
pub(crate) fn real_dir(
    path: &Path,
    mode: u32,
    uid: Option<u32>,
    gid: Option<u32>,
) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_dir() => fs::remove_file(path)?,
        Ok(_) => {}
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        Err(error) => return Err(error),
    }
    match fs::DirBuilder::new().mode(mode).create(path) {
        Err(error) if error.kind() != io::ErrorKind::AlreadyExists => return Err(error),
        _ => {}
    }
    let dir = nix::fcntl::open(
        path,
        nix::fcntl::OFlag::O_RDONLY
            | nix::fcntl::OFlag::O_DIRECTORY
            | nix::fcntl::OFlag::O_NOFOLLOW
            | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )?;
    nix::unistd::fchown(
        &dir,
        uid.map(nix::unistd::Uid::from_raw),
        gid.map(nix::unistd::Gid::from_raw),
    )?;
    nix::sys::stat::fchmod(&dir, nix::sys::stat::Mode::from_bits_truncate(mode))?;
    Ok(())
}

/// The runtime directory's name in the instance's run dir.
pub const RUNTIME: &str = "runtime";

/// An instance's managed directories, each with its variable.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ManagedDirs {
    pub dirs: Vec<(&'static str, PathBuf)>,
}

impl ManagedDirs {
    /// Where `spec`'s directories of `instance` are, for an agent whose
    /// state dir is `state_dir` and whose instance run dir is
    /// `instance_run_dir`.
    pub fn of(
        spec: &DirectoriesSpec,
        instance: &InstanceKey,
        state_dir: &Path,
        instance_run_dir: &Path,
    ) -> ManagedDirs {
        let kept = state_dir
            .join("instances")
            .join(DiskName::of(instance).to_string());
        let mut dirs = Vec::new();
        if spec.state {
            dirs.push(("STATE_DIRECTORY", kept.join("state")));
        }
        if spec.cache {
            dirs.push(("CACHE_DIRECTORY", kept.join("cache")));
        }
        if spec.runtime {
            dirs.push(("RUNTIME_DIRECTORY", instance_run_dir.join(RUNTIME)));
        }
        ManagedDirs { dirs }
    }

    /// Makes each directory that is missing (its parents root's, 0755) and
    /// gives each to `uid`/`gid` with mode 0755; what is in them stays.
    pub fn ensure(&self, uid: Option<u32>, gid: Option<u32>) -> io::Result<()> {
        for (_, dir) in &self.dirs {
            if let Some(parent) = dir.parent() {
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o755)
                    .create(parent)?;
            }
            real_dir(dir, 0o755, uid, gid)?;
        }
        Ok(())
    }

    /// `STATE_DIRECTORY=…` and the others.
    pub fn env(&self) -> Vec<(String, String)> {
        self.dirs
            .iter()
            .map(|(name, dir)| ((*name).to_owned(), dir.display().to_string()))
            .collect()
    }

    /// The paths, for the sandbox's writable ones.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|(_, dir)| dir.clone()).collect()
    }
}
