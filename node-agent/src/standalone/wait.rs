//! Waiting for a status file to say something, woken by inotify on the
//! status directory (every status write is a rename into it), for the demo,
//! the tests and anyone scripting standalone mode.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;
use tokio::time::Instant;

use super::status::StatusDocument;
use super::watch::{DirChange, DirWatch};
use super::{STATUS_SUBDIR, status_path};

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
    // In place before the first read, so a write between the two wakes us.
    let watch = DirWatch::new(&status_dir).map_err(|source| WaitError::Watch {
        path: status_dir.clone(),
        source,
    })?;
    let deadline = Instant::now() + timeout;
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
