//! Waiting for a cgroup to empty, driven by inotify on `cgroup.events`.
//!
//! The kernel raises IN_MODIFY on `cgroup.events` whenever one of its values
//! changes, so the wait costs nothing while it waits. The inotify fd is
//! non-blocking and registered with tokio through `AsyncFd` rather than read
//! in `spawn_blocking`: a wait may last a whole settle window or stop timeout
//! for every instance at once, and an `AsyncFd` wait holds no thread and is
//! cancelled by dropping it (a blocking read could not be interrupted when
//! the engine gives up on it).
//!
//! The kernel sends at most one notification per 10 ms for each cgroup file
//! (`CGROUP_FILE_NOTIFY_MIN_INTV` in `kernel/cgroup/cgroup.c`) and delays a
//! later change to the end of that window, while the file itself is always
//! current. Measured here: a testapp that exits 0.45 ms after SIGTERM, its
//! `cgroup.events` reading `populated 0` at 0.48 ms, and the notification
//! arriving 8 to 13 ms after the signal when the file had changed shortly
//! before. So for its first [`EAGER_READS_FOR`] a wait also reads the file
//! again every millisecond, which bounds the delay by the timer's tick.

use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;

use nix::errno::Errno;
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::time::Instant;

use super::{CgroupError, fs_util};

/// Longer than the kernel's notification window, so a change it delays is
/// read from the file first.
const EAGER_READS_FOR: std::time::Duration = std::time::Duration::from_millis(12);
/// How often the file is read again in that time.
const EAGER_READ_EVERY: std::time::Duration = std::time::Duration::from_millis(1);

/// Whether the cgroup at `dir` holds processes. A cgroup that no longer
/// exists holds none (rmdir only succeeds on an empty cgroup), so it reads
/// as not populated.
pub(super) fn populated(dir: &Path) -> Result<bool, CgroupError> {
    let path = dir.join("cgroup.events");
    let Some(events) = fs_util::read_optional(&path, "read")? else {
        return Ok(false);
    };
    match fs_util::populated_in(&events) {
        Some(populated) => Ok(populated),
        None => Err(CgroupError::Malformed {
            path,
            value: events,
        }),
    }
}

/// Waits until `dir` reports `populated 0` or `deadline` passes. Returns
/// whether it is empty. The state is read after the watch is in place, so
/// an exit between the two cannot be missed.
pub(super) async fn wait_unpopulated(dir: &Path, deadline: Instant) -> Result<bool, CgroupError> {
    let events = dir.join("cgroup.events");
    let watch = match EventsWatch::new(&events) {
        Ok(watch) => watch,
        Err(Errno::ENOENT) => return Ok(true),
        Err(source) => {
            return Err(CgroupError::Watch {
                path: events,
                source,
            });
        }
    };
    let eager_until = Instant::now() + EAGER_READS_FOR;
    loop {
        if !populated(dir)? {
            return Ok(true);
        }
        let eager = Instant::now() < eager_until;
        tokio::select! {
            changed = watch.changed() => changed.map_err(|source| CgroupError::Io {
                op: "read inotify events for",
                path: events.clone(),
                source,
            })?,
            () = tokio::time::sleep(EAGER_READ_EVERY), if eager => {}
            () = tokio::time::sleep_until(deadline) => return Ok(!populated(dir)?),
        }
    }
}

struct EventsWatch {
    /// `None` only while it is dropped.
    fd: Option<AsyncFd<OwnedFd>>,
}

impl Drop for EventsWatch {
    /// Closing an inotify instance that had a watch waits for an SRCU grace
    /// period in the kernel (the marks' reaper): measured here at 15 ms p50,
    /// 23 ms max, against 0.01 ms without a watch. On a runtime thread that
    /// would stall the wait's caller (a stop's proof, an exit's notice) and
    /// every task on that thread; the close goes to a blocking thread.
    fn drop(&mut self) {
        let Some(fd) = self.fd.take() else {
            return;
        };
        let fd = fd.into_inner();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn_blocking(move || drop(fd));
            }
            Err(_) => drop(fd),
        }
    }
}

impl EventsWatch {
    fn new(events: &Path) -> Result<EventsWatch, Errno> {
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
        // IN_DELETE_SELF wakes the wait when the cgroup is removed.
        inotify.add_watch(
            events,
            AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_DELETE_SELF,
        )?;
        let fd = OwnedFd::from(inotify);
        // SAFETY: an OwnedFd is a valid open descriptor that stays open, and
        // names the same description, until the AsyncFd that owns it drops.
        let registered = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) };
        registered
            .map(|fd| EventsWatch { fd: Some(fd) })
            .map_err(|e| {
                io::Error::from(e)
                    .raw_os_error()
                    .map_or(Errno::EINVAL, Errno::from_raw)
            })
    }

    /// Resolves once at least one event arrived; drains them all (their
    /// content does not matter, only that something changed).
    async fn changed(&self) -> io::Result<()> {
        let Some(fd) = self.fd.as_ref() else {
            return Ok(());
        };
        let mut buffer = [0u8; 4096];
        loop {
            let mut guard = fd.readable().await?;
            match guard
                .try_io(|fd| nix::unistd::read(fd.get_ref(), &mut buffer).map_err(io::Error::from))
            {
                Ok(Ok(_)) => {
                    // Drain what else is queued so the next wait starts clean.
                    while nix::unistd::read(fd.get_ref(), &mut buffer).is_ok() {}
                    return Ok(());
                }
                Ok(Err(error)) => return Err(error),
                Err(_would_block) => continue,
            }
        }
    }
}
