//! Where a benchmark runs: a fresh temp dir and a fresh cgroup subtree, and
//! the child processes it starts, all removed or stopped when it ends,
//! however it ends.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tempfile::TempDir;

use crate::BenchError;

/// How long a stopped child or a killed subtree may take to go.
const STOP_WAIT: Duration = Duration::from_secs(30);

/// A temp dir (mode 0755, so instances running as nobody reach their run
/// dir and the store) and a cgroup subtree under the cgroup v2 mount.
pub struct Sandbox {
    temp: Option<TempDir>,
    cgroup: PathBuf,
}

impl Sandbox {
    /// `<tmp>/genswap-bench-<random>` and `<cgroup parent>/genswap-bench-<pid>-<label>`.
    pub fn create(cgroup_parent: &Path, label: &str) -> Result<Sandbox, BenchError> {
        let setup = |what: String| move |source| BenchError::Setup { what, source };
        let temp = tempfile::Builder::new()
            .prefix(&format!("genswap-bench-{label}-"))
            .tempdir()
            .map_err(setup("create a temp dir".into()))?;
        fs::set_permissions(temp.path(), fs::Permissions::from_mode(0o755))
            .map_err(setup(format!("chmod {}", temp.path().display())))?;
        let cgroup = cgroup_parent.join(format!("genswap-bench-{}-{label}", std::process::id()));
        if cgroup.exists() {
            remove_cgroup_tree(&cgroup)
                .map_err(setup(format!("remove stale {}", cgroup.display())))?;
        }
        fs::create_dir(&cgroup).map_err(setup(format!("create {}", cgroup.display())))?;
        Ok(Sandbox {
            temp: Some(temp),
            cgroup,
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

    /// Processes still in the subtree.
    pub fn processes(&self) -> usize {
        count_processes(&self.cgroup)
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if self.cgroup.exists()
            && let Err(error) = remove_cgroup_tree(&self.cgroup)
        {
            eprintln!("genswap-bench: removing {}: {error}", self.cgroup.display());
        }
        if let Some(temp) = self.temp.take()
            && let Err(error) = temp.close()
        {
            eprintln!("genswap-bench: removing the temp dir: {error}");
        }
    }
}

/// `cgroup.kill`, a wait for `populated 0`, then rmdir bottom-up.
pub fn remove_cgroup_tree(path: &Path) -> io::Result<()> {
    if populated(path) {
        fs::OpenOptions::new()
            .write(true)
            .open(path.join("cgroup.kill"))?
            .write_all(b"1")?;
        let deadline = Instant::now() + STOP_WAIT;
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
    match fs::remove_dir(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// A child process stopped by its pid when dropped: the stop signal, then
/// SIGKILL if it has not exited within the wait.
pub struct Guarded {
    child: Option<Child>,
    signal: Signal,
}

impl Guarded {
    /// Guards `child`, stopped with `signal`.
    pub fn new(child: Child, signal: Signal) -> Guarded {
        Guarded {
            child: Some(child),
            signal,
        }
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// The child, to reach its stdin or stdout.
    pub fn child_mut(&mut self) -> Option<&mut Child> {
        self.child.as_mut()
    }

    /// Whether it has exited already.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Sends the stop signal and waits for the exit (SIGKILL after the
    /// wait), returning the exit status.
    pub fn stop(&mut self) -> io::Result<ExitStatus> {
        let Some(mut child) = self.child.take() else {
            return Err(io::Error::other("already stopped"));
        };
        stop_child(&mut child, self.signal)
    }

    /// Waits for the exit without signalling, up to the stop wait.
    pub fn wait(&mut self) -> io::Result<ExitStatus> {
        let Some(mut child) = self.child.take() else {
            return Err(io::Error::other("already stopped"));
        };
        let deadline = Instant::now() + STOP_WAIT;
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                return stop_child(&mut child, Signal::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = stop_child(&mut child, self.signal);
        }
    }
}

fn stop_child(child: &mut Child, signal: Signal) -> io::Result<ExitStatus> {
    if let Some(status) = child.try_wait()? {
        return Ok(status);
    }
    let pid = Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
    kill(pid, signal).map_err(io::Error::from)?;
    let deadline = Instant::now() + STOP_WAIT;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() > deadline {
            child.kill()?;
            return child.wait();
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}
