//! Where a run that starts real instances outside the agent's own layout
//! works (the demo, the benchmarks): a fresh temp dir, a short run dir and
//! a fresh cgroup subtree, all removed when it ends, however it ends (a
//! failure and a panic included).

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tempfile::TempDir;
use thiserror::Error;

use crate::cgroup::{processes_in, remove_subtree};

/// How long cleanup waits for a killed subtree to empty.
const KILL_WAIT: Duration = Duration::from_secs(30);

/// The temp dir or the cgroup subtree could not be set up.
#[derive(Debug, Error)]
#[error("cannot {what}: {source}")]
pub struct SandboxError {
    pub what: String,
    #[source]
    pub source: io::Error,
}

/// A temp dir, a run dir and a cgroup subtree.
pub struct Sandbox {
    temp: Option<TempDir>,
    run: Option<TempDir>,
    cgroup: PathBuf,
    cleaned: bool,
}

/// What cleanup found and removed.
#[derive(Debug, Default)]
pub struct Cleanup {
    /// Processes still in the subtree that had to be killed (0 when the run
    /// stopped everything itself, as it should).
    pub leftover_processes: usize,
    /// The cgroup subtree removed.
    pub cgroup: PathBuf,
    /// The temp dir removed.
    pub dir: PathBuf,
}

impl Sandbox {
    /// `<tmp>/<name>-<random>` (mode 0755, so instances running as nobody
    /// reach their run dir and the store) and `<cgroup parent>/<name>-<pid>`.
    pub fn create(cgroup_parent: &Path, name: &str) -> Result<Sandbox, SandboxError> {
        let setup = |what: String| move |source| SandboxError { what, source };
        let temp = tempfile::Builder::new()
            .prefix(&format!("{name}-"))
            .tempdir()
            .map_err(setup("create a temp dir".into()))?;
        fs::set_permissions(temp.path(), fs::Permissions::from_mode(0o755)).map_err(setup(
            format!("open {} to the instances' user", temp.path().display()),
        ))?;
        let run = short_dir("gs-").map_err(setup("create a run dir".into()))?;
        let cgroup = cgroup_parent.join(format!("{name}-{}", std::process::id()));
        // A subtree left by a run killed with SIGKILL under the same pid
        // would be reused; make it fresh.
        remove_subtree(&cgroup, KILL_WAIT).map_err(setup(format!(
            "remove the stale cgroup subtree {}",
            cgroup.display()
        )))?;
        fs::create_dir(&cgroup).map_err(setup(format!(
            "create the cgroup subtree {}",
            cgroup.display()
        )))?;
        Ok(Sandbox {
            temp: Some(temp),
            run: Some(run),
            cgroup,
            cleaned: false,
        })
    }

    /// The temp dir.
    pub fn dir(&self) -> &Path {
        self.temp.as_ref().map_or(Path::new("/"), TempDir::path)
    }

    /// The run dir: short, as a run dir must be
    /// ([`crate::disk_name::check_run_dir`]).
    pub fn run_dir(&self) -> &Path {
        self.run.as_ref().map_or(Path::new("/"), TempDir::path)
    }

    /// The cgroup subtree.
    pub fn cgroup(&self) -> &Path {
        &self.cgroup
    }

    /// Processes in the subtree now.
    pub fn processes(&self) -> usize {
        processes_in(&self.cgroup)
    }

    /// Kills whatever is left in the subtree (by path), removes it and the
    /// temp dir.
    pub fn clean_up(&mut self) -> io::Result<Cleanup> {
        self.cleaned = true;
        let mut cleanup = Cleanup {
            cgroup: self.cgroup.clone(),
            dir: self.dir().to_path_buf(),
            ..Cleanup::default()
        };
        cleanup.leftover_processes = remove_subtree(&self.cgroup, KILL_WAIT)?;
        for dir in [self.temp.take(), self.run.take()].into_iter().flatten() {
            dir.close()?;
        }
        Ok(cleanup)
    }
}

/// A fresh directory `/tmp/<prefix><random>`, mode 0755, removed when
/// dropped. Directly under `/tmp` whatever `TMPDIR` says, so that it is
/// short enough to be a run dir, whose sockets must fit 107 bytes.
pub fn short_dir(prefix: &str) -> io::Result<TempDir> {
    let dir = tempfile::Builder::new().prefix(prefix).tempdir_in("/tmp")?;
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755))?;
    Ok(dir)
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if self.cleaned {
            return;
        }
        if let Err(error) = self.clean_up() {
            eprintln!(
                "genswap: cleanup of {} and {} failed: {error}",
                self.cgroup.display(),
                self.dir().display()
            );
        }
    }
}
