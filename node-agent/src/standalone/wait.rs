//! Waiting for a status file to say something, woken by inotify on the
//! status directory (every status write is a rename into it), for the demo,
//! the tests and anyone scripting standalone mode. A wait may start before
//! standalone mode has made that directory; it then waits for it too.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;
use tokio::time::Instant;

use nix::sys::inotify::AddWatchFlags;

use super::status::StatusDocument;
use super::watch::{DirChange, DirWatch};
use super::{STATUS_SUBDIR, status_path};
use crate::inotify::AsyncInotify;

/// Why a wait for a status ended without what it waited for.
#[derive(Debug, Error)]
pub enum WaitError {
    /// The deadline passed; the status as last read (if any) says why.
    #[error("{path} did not reach the expected state within {timeout:?}; last seen: {last}")]
    Timeout {
        path: PathBuf,
        timeout: Duration,
        last: String,
    },
    /// The status directory could not be watched.
    #[error("cannot watch the status directory {path}: {source}")]
    Watch {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Waits until the status file of manifest `file` in `dir` exists and
/// `accept` holds for it, or `timeout` passes.
pub async fn wait_for_status(
    dir: &Path,
    file: &str,
    timeout: Duration,
    mut accept: impl FnMut(&StatusDocument) -> bool,
) -> Result<StatusDocument, WaitError> {
    let path = status_path(dir, file);
    wait_until(dir, &path, timeout, |read| match read {
        Ok(document) if accept(&document) => Ok(document),
        Ok(document) => Err(format!("{document:?}")),
        Err(error) => Err(error),
    })
    .await
}

/// Waits until the status file of manifest `file` in `dir` is gone.
pub async fn wait_for_no_status(
    dir: &Path,
    file: &str,
    timeout: Duration,
) -> Result<(), WaitError> {
    let path = status_path(dir, file);
    let probe = path.clone();
    wait_until(dir, &path, timeout, |read| {
        if probe.exists() {
            Err(format!("{read:?}"))
        } else {
            Ok(())
        }
    })
    .await
}

/// Reads the status at `path` until `check` takes it, each read after a
/// change in the status directory.
async fn wait_until<T>(
    dir: &Path,
    path: &Path,
    timeout: Duration,
    mut check: impl FnMut(Result<StatusDocument, String>) -> Result<T, String>,
) -> Result<T, WaitError> {
    let status_dir = dir.join(STATUS_SUBDIR);
    let deadline = Instant::now() + timeout;
    status_dir_made(dir, &status_dir, deadline, timeout).await?;
    // In place before the first read, so a write between the two wakes us.
    let watch = DirWatch::new(&status_dir).map_err(|source| WaitError::Watch {
        path: status_dir.clone(),
        source,
    })?;
    loop {
        let last = match check(StatusDocument::read(path)) {
            Ok(found) => return Ok(found),
            Err(last) => last,
        };
        match tokio::time::timeout_at(deadline, watch.changed()).await {
            Ok(Ok(DirChange::Entries)) => {}
            Ok(Ok(DirChange::DirectoryGone)) | Ok(Err(_)) | Err(_) => {
                // One last look: the change may have landed with the deadline.
                return check(StatusDocument::read(path)).map_err(|_| WaitError::Timeout {
                    path: path.to_path_buf(),
                    timeout,
                    last,
                });
            }
        }
    }
}

/// Waits until `status_dir` exists. Standalone mode makes it when it
/// starts, so a wait begun beside a starting agent may come first; that is
/// "not yet", not an error.
async fn status_dir_made(
    dir: &Path,
    status_dir: &Path,
    deadline: Instant,
    timeout: Duration,
) -> Result<(), WaitError> {
    if status_dir.is_dir() {
        return Ok(());
    }
    // In place before the next look, as above. A directory made in it is
    // a create, which the manifest watch does not wake on.
    let watch = AsyncInotify::watch(
        dir,
        AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO | AddWatchFlags::IN_ONLYDIR,
    )
    .map_err(|errno| WaitError::Watch {
        path: dir.to_path_buf(),
        source: errno.into(),
    })?;
    while !status_dir.is_dir() {
        let woken = tokio::time::timeout_at(deadline, watch.events()).await;
        if !matches!(woken, Ok(Ok(_))) && !status_dir.is_dir() {
            return Err(WaitError::Timeout {
                path: status_dir.to_path_buf(),
                timeout,
                last: "no status directory: is standalone mode running on this directory?"
                    .to_string(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::standalone::status::{STATUS_SUBDIR, render};

    fn doc() -> StatusDocument {
        let now = crate::attempt_status::time_of(std::time::SystemTime::now());
        crate::standalone::status::for_refused(
            "app.yaml",
            None,
            "InvalidManifest",
            "unknown field(s): spec.bogus",
            &now,
        )
    }

    #[tokio::test]
    async fn a_wait_begun_before_the_agent_made_the_status_directory_waits_for_it() {
        let dir = tempfile::tempdir().expect("temp dir");
        let waiting = tokio::spawn({
            let dir = dir.path().to_path_buf();
            // Its own deadline far off: only a wake can end it in time.
            async move { wait_for_status(&dir, "app.yaml", Duration::from_secs(3600), |_| true).await }
        });
        // One thread: the yield runs the wait until it sleeps on its watch,
        // so the directory appears after the wait began, as it does beside
        // a starting agent.
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        let status_dir = dir.path().join(STATUS_SUBDIR);
        std::fs::create_dir(&status_dir).expect("status dir");
        let written = doc();
        std::fs::write(
            status_dir.join("app.yaml"),
            render(&written).expect("render"),
        )
        .expect("status file");
        let found = tokio::time::timeout(Duration::from_secs(20), waiting)
            .await
            .expect("woken by the directory and the file, not by a deadline")
            .expect("the wait ran")
            .expect("the status is found once the directory appears");
        assert_eq!(found, written);
    }

    #[tokio::test]
    async fn a_directory_no_agent_ever_serves_times_out_and_says_so() {
        let dir = tempfile::tempdir().expect("temp dir");
        let error = wait_for_status(dir.path(), "app.yaml", Duration::from_millis(200), |_| true)
            .await
            .expect_err("nothing makes the status directory");
        assert!(error.to_string().contains("no status directory"), "{error}");
        assert!(
            !dir.path().join(STATUS_SUBDIR).exists(),
            "a wait creates nothing"
        );
    }
}
