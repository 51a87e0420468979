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

use std::path::Path;

use nix::errno::Errno;
use nix::sys::inotify::AddWatchFlags;
use tokio::time::Instant;

use super::{CgroupError, fs_util};
use crate::inotify::AsyncInotify;

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
    let watch = match AsyncInotify::watch(
        &events,
        // IN_DELETE_SELF wakes the wait when the cgroup is removed.
        AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_DELETE_SELF,
    ) {
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
            changed = watch.events() => changed.map(drop).map_err(|source| CgroupError::Io {
                op: "read inotify events for",
                path: events.clone(),
                source,
            })?,
            () = tokio::time::sleep(EAGER_READ_EVERY), if eager => {}
            () = tokio::time::sleep_until(deadline) => return Ok(!populated(dir)?),
        }
    }
}
