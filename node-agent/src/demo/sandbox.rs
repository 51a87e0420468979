//! Where the demo runs: a fresh temp dir and a fresh cgroup subtree, both
//! removed when it ends, however it ends (a failure and a panic included).

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::DemoError;

/// How long cleanup waits for a killed subtree to empty.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// The demo's temp dir and cgroup subtree.
pub struct Sandbox {
    temp: Option<TempDir>,
    cgroup: PathBuf,
    cleaned: bool,
}

/// What cleanup found and removed.
#[derive(Debug, Default)]
pub struct Cleanup {
    /// Processes still in the subtree that had to be killed (0 when the
    /// demo stopped everything itself, as it should).
    pub leftover_processes: usize,
    /// The cgroup subtree removed.
    pub cgroup: PathBuf,
    /// The temp dir removed.
    pub dir: PathBuf,
}

impl Sandbox {
    /// A temp dir (mode 0755, so instances running as nobody reach their
    /// run dir and the store) and `<cgroup parent>/genswap-demo-<pid>`.
    pub fn create(cgroup_parent: &Path) -> Result<Sandbox, DemoError> {
        let temp = tempfile::Builder::new()
            .prefix("genswap-demo-")
            .tempdir()
            .map_err(|source| DemoError::Setup {
                what: "create a temp dir".into(),
                source,
            })?;
        fs::set_permissions(temp.path(), fs::Permissions::from_mode(0o755)).map_err(|source| {
            DemoError::Setup {
                what: format!("open {} to the instances' user", temp.path().display()),
                source,
            }
        })?;
        let cgroup = cgroup_parent.join(format!("genswap-demo-{}", std::process::id()));
        // A subtree left by a demo that was killed with SIGKILL under the
        // same pid would be reused; make it fresh.
        if cgroup.exists() {
            remove_cgroup_tree(&cgroup).map_err(|source| DemoError::Setup {
                what: format!("remove the stale cgroup subtree {}", cgroup.display()),
                source,
            })?;
        }
        fs::create_dir(&cgroup).map_err(|source| DemoError::Setup {
            what: format!("create the cgroup subtree {}", cgroup.display()),
            source,
        })?;
        Ok(Sandbox {
            temp: Some(temp),
            cgroup,
            cleaned: false,
        })
    }

    /// The temp dir.
    pub fn dir(&self) -> &Path {
        self.temp.as_ref().map_or(Path::new("/"), TempDir::path)
    }

    /// The cgroup subtree.
    pub fn cgroup(&self) -> &Path {
        &self.cgroup
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
        if self.cgroup.exists() {
            cleanup.leftover_processes = count_processes(&self.cgroup);
            remove_cgroup_tree(&self.cgroup)?;
        }
        if let Some(temp) = self.temp.take() {
            temp.close()?;
        }
        Ok(cleanup)
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if self.cleaned {
            return;
        }
        if let Err(error) = self.clean_up() {
            eprintln!(
                "genswap demo: cleanup of {} and {} failed: {error}",
                self.cgroup.display(),
                self.dir().display()
            );
        }
    }
}

/// `cgroup.kill` on the subtree, a wait for `populated 0`, then rmdir
/// bottom-up.
fn remove_cgroup_tree(path: &Path) -> io::Result<()> {
    if populated(path) {
        fs::OpenOptions::new()
            .write(true)
            .open(path.join("cgroup.kill"))?
            .write_all(b"1")?;
        let deadline = Instant::now() + KILL_WAIT;
        while populated(path) {
            if Instant::now() > deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{} still holds processes after cgroup.kill", path.display()),
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    remove_bottom_up(path)
}

fn populated(path: &Path) -> bool {
    fs::read_to_string(path.join("cgroup.events"))
        .map(|events| events.lines().any(|line| line == "populated 1"))
        .unwrap_or(false)
}

fn count_processes(path: &Path) -> usize {
    let own = fs::read_to_string(path.join("cgroup.procs"))
        .map(|procs| procs.lines().count())
        .unwrap_or(0);
    let children: usize = fs::read_dir(path)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| count_processes(&e.path()))
                .sum()
        })
        .unwrap_or(0);
    own + children
}

fn remove_bottom_up(path: &Path) -> io::Result<()> {
    for entry in fs::read_dir(path)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            remove_bottom_up(&entry.path())?;
        }
    }
    fs::remove_dir(path)
}
