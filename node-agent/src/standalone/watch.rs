//! Noticing changes to the manifest directory through inotify.
//!
//! nix's inotify (already a dependency, with the `inotify` feature) on the
//! runtime ([`crate::inotify`]): one watch on one directory needs nothing
//! more, costs nothing while nothing changes, and never falls back to
//! polling (the `notify` crate would add a thread, a dependency and a
//! polling backend we do not want).
//!
//! Only completed changes wake the scan: a file closed after writing, a file
//! moved in or out, a file deleted. A file that is still being written is
//! read once it is closed, and an atomic writer's rename is one event.

use std::io;
use std::path::Path;

use nix::sys::inotify::AddWatchFlags;

use crate::inotify::AsyncInotify;

/// What a batch of events means for the scan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirChange {
    /// Something in the directory changed (or events were lost): rescan.
    Entries,
    /// The directory itself was deleted or moved away.
    DirectoryGone,
}

/// A watch on one directory.
#[derive(Debug)]
pub struct DirWatch {
    inotify: AsyncInotify,
}

impl DirWatch {
    /// Watches `dir` (which must be a directory).
    pub fn new(dir: &Path) -> io::Result<DirWatch> {
        let inotify = AsyncInotify::watch(
            dir,
            AddWatchFlags::IN_CLOSE_WRITE
                | AddWatchFlags::IN_MOVED_TO
                | AddWatchFlags::IN_MOVED_FROM
                | AddWatchFlags::IN_DELETE
                | AddWatchFlags::IN_DELETE_SELF
                | AddWatchFlags::IN_MOVE_SELF
                | AddWatchFlags::IN_ONLYDIR,
        )
        .map_err(io::Error::from)?;
        Ok(DirWatch { inotify })
    }

    /// Resolves with the next batch of events, every queued event drained.
    pub async fn changed(&self) -> io::Result<DirChange> {
        let events = self.inotify.events().await?;
        let gone = events.iter().any(|event| {
            event.mask.intersects(
                AddWatchFlags::IN_DELETE_SELF
                    | AddWatchFlags::IN_MOVE_SELF
                    | AddWatchFlags::IN_IGNORED,
            )
        });
        Ok(if gone {
            DirChange::DirectoryGone
        } else {
            DirChange::Entries
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::time::Duration;

    const DEADLINE: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn a_written_file_and_a_rename_wake_the_watch() {
        let dir = tempfile::tempdir().expect("temp dir");
        let watch = DirWatch::new(dir.path()).expect("watch");
        fs::write(dir.path().join("a.yaml"), "x").expect("write");
        let change = tokio::time::timeout(DEADLINE, watch.changed())
            .await
            .expect("an event for the write")
            .expect("read events");
        assert_eq!(change, DirChange::Entries);
        fs::rename(dir.path().join("a.yaml"), dir.path().join("b.yaml")).expect("rename");
        let change = tokio::time::timeout(DEADLINE, watch.changed())
            .await
            .expect("an event for the rename")
            .expect("read events");
        assert_eq!(change, DirChange::Entries);
    }

    #[tokio::test]
    async fn removing_the_directory_is_reported() {
        let parent = tempfile::tempdir().expect("temp dir");
        let dir = parent.path().join("manifests");
        fs::create_dir(&dir).expect("mkdir");
        let watch = DirWatch::new(&dir).expect("watch");
        fs::remove_dir(&dir).expect("rmdir");
        let change = tokio::time::timeout(DEADLINE, watch.changed())
            .await
            .expect("an event for the removal")
            .expect("read events");
        assert_eq!(change, DirChange::DirectoryGone);
    }

    #[test]
    fn a_file_is_not_a_directory_to_watch() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("f");
        fs::write(&file, "").expect("write");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let _guard = runtime.enter();
        assert!(DirWatch::new(&file).is_err());
    }
}
