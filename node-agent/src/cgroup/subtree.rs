//! Removing a whole cgroup subtree from code that cannot await: the `Drop`
//! of a sandbox (the demo, the benchmarks) and of the tests' cgroup guards.
//!
//! `cgroup.kill` on the top, a wait for its `populated 0`, then `rmdir`
//! bottom-up. The wait blocks on inotify (IN_MODIFY on `cgroup.events`,
//! with `poll(2)` for the deadline), so it costs nothing while the kernel
//! reaps.

use std::fs;
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};

use super::fs_util;

/// Kills every process under `path`, waits up to `wait` for the subtree to
/// empty and removes it with its descendants. Returns how many processes
/// were still in it. A missing `path` is already removed.
pub fn remove_subtree(path: &Path, wait: Duration) -> io::Result<usize> {
    if !path.exists() {
        return Ok(0);
    }
    let deadline = Instant::now() + wait;
    let processes = processes_in(path);
    if populated(path) {
        fs::OpenOptions::new()
            .write(true)
            .open(path.join("cgroup.kill"))?
            .write_all(b"1")?;
        wait_unpopulated(path, deadline, wait)?;
    }
    remove_bottom_up(path, deadline)?;
    Ok(processes)
}

/// How many processes the subtree at `path` holds, its descendants included.
pub fn processes_in(path: &Path) -> usize {
    let own = fs::read_to_string(path.join("cgroup.procs"))
        .map(|procs| procs.lines().count())
        .unwrap_or(0);
    let children: usize = fs::read_dir(path)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| processes_in(&e.path()))
                .sum()
        })
        .unwrap_or(0);
    own + children
}

fn populated(path: &Path) -> bool {
    fs::read_to_string(path.join("cgroup.events"))
        .ok()
        .and_then(|events| fs_util::populated_in(&events))
        .unwrap_or(false)
}

fn wait_unpopulated(path: &Path, deadline: Instant, wait: Duration) -> io::Result<()> {
    let inotify = Inotify::init(InitFlags::IN_CLOEXEC)?;
    inotify.add_watch(&path.join("cgroup.events"), AddWatchFlags::IN_MODIFY)?;
    // Checked after the watch is in place, so no change can slip between.
    while populated(path) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "{} still holds processes {wait:?} after cgroup.kill",
                    path.display()
                ),
            ));
        }
        let millis = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
        let mut fds = [PollFd::new(inotify.as_fd(), PollFlags::POLLIN)];
        // A signal to the process (SIGCHLD of the very processes killed)
        // interrupts the wait; it goes on.
        match poll(&mut fds, PollTimeout::from(millis)) {
            Ok(0) | Err(Errno::EINTR) => {}
            Ok(_) => match inotify.read_events() {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(error) => return Err(error.into()),
            },
            Err(error) => return Err(error.into()),
        }
    }
    Ok(())
}

fn remove_bottom_up(path: &Path, deadline: Instant) -> io::Result<()> {
    for entry in fs::read_dir(path)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            remove_bottom_up(&entry.path(), deadline)?;
        }
    }
    // rmdir can still be refused with EBUSY for a moment after
    // `populated 0` while the last task finishes exiting (seen under load);
    // nothing signals the end of that, so it is retried until the deadline.
    loop {
        match fs::remove_dir(path) {
            Err(error)
                if error.raw_os_error() == Some(Errno::EBUSY as i32)
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
            result => return result,
        }
    }
}
