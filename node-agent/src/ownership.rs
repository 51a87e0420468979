//! Node ownership (SPEC §5.1): one agent swaps on a node at a time.
//!
//! Ownership is an exclusive `flock(2)` on a lock file in the host state dir,
//! `<state dir>/node.lock` by default. The kernel releases it when the holder
//! closes the file or dies, however it dies, so a crashed agent never leaves
//! the node locked. During a DaemonSet rolling update the new agent waits in
//! [`NodeLock::acquire`] and runs no swap until the old one has exited.
//!
//! `flock` locks belong to an *open file description*: two opens of the same
//! file conflict even inside one process, which is what makes the lock testable
//! without two processes and safe against a second agent in the same pod.
//!
//! Open the intent journal for writing only while holding this lock.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use thiserror::Error;
use tokio::sync::oneshot;

/// The lock file's name in the agent's state dir.
pub const NODE_LOCK_FILE: &str = "node.lock";

/// The default lock path for a state dir: `<state dir>/node.lock`.
pub fn default_lock_path(state_dir: &Path) -> PathBuf {
    state_dir.join(NODE_LOCK_FILE)
}

/// Why the node lock could not be taken.
#[derive(Debug, Error)]
pub enum OwnershipError {
    #[error("cannot create the directory {path} for the node lock: {source}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot open the node lock file {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot lock the node lock file {path}: {source}")]
    Lock {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the thread waiting for the node lock {path} ended without an answer")]
    WaiterLost { path: PathBuf },
}

/// The held node lock. Dropping it releases the node (the file is closed).
#[derive(Debug)]
pub struct NodeLock {
    file: File,
    path: PathBuf,
}

impl NodeLock {
    /// Takes the lock if no one holds it; `Ok(None)` when another open file
    /// description (another agent) does.
    pub fn try_acquire(path: &Path) -> Result<Option<NodeLock>, OwnershipError> {
        let file = open_lock_file(path)?;
        match file.try_lock() {
            Ok(()) => Ok(Some(NodeLock::held(file, path))),
            Err(TryLockError::WouldBlock) => Ok(None),
            Err(TryLockError::Error(source)) => Err(OwnershipError::Lock {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    /// Waits until the lock is free and takes it.
    ///
    /// The blocking `flock` runs on a thread of its own rather than tokio's
    /// blocking pool, so a runtime that shuts down while this waits is never
    /// held up by it. Dropping the returned future gives up the wait: should
    /// the thread get the lock afterwards, it releases it at once.
    pub async fn acquire(path: &Path) -> Result<NodeLock, OwnershipError> {
        if let Some(lock) = NodeLock::try_acquire(path)? {
            return Ok(lock);
        }
        let file = open_lock_file(path)?;
        let owned_path = path.to_path_buf();
        let (sender, receiver) = oneshot::channel();
        let spawned = std::thread::Builder::new()
            .name("node-lock-wait".into())
            .spawn(move || {
                let result = lock_blocking(&file, &owned_path).map(|()| file);
                // A receiver that is gone closes the file here: the lock is
                // released as soon as it was taken.
                let _ = sender.send(result);
            });
        if let Err(source) = spawned {
            return Err(OwnershipError::Lock {
                path: path.to_path_buf(),
                source,
            });
        }
        match receiver.await {
            Ok(Ok(file)) => Ok(NodeLock::held(file, path)),
            Ok(Err(error)) => Err(error),
            Err(_) => Err(OwnershipError::WaiterLost {
                path: path.to_path_buf(),
            }),
        }
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A lock just taken: the holder's pid goes into the file so a human can
    /// see who owns the node. The pid is informational; the lock is the flock.
    fn held(mut file: File, path: &Path) -> NodeLock {
        let written = file
            .set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)))
            .and_then(|_| writeln!(file, "{}", std::process::id()));
        if let Err(error) = written {
            tracing::debug!(path = %path.display(), %error, "could not write the holder's pid into the node lock file");
        }
        NodeLock {
            file,
            path: path.to_path_buf(),
        }
    }
}

impl Drop for NodeLock {
    fn drop(&mut self) {
        // Closing the file releases the flock; unlocking first makes the
        // release explicit even if the descriptor were shared with a child.
        let _ = self.file.unlock();
    }
}

/// `flock(LOCK_EX)`, retried when a signal interrupts it.
fn lock_blocking(file: &File, path: &Path) -> Result<(), OwnershipError> {
    loop {
        match file.lock() {
            Ok(()) => return Ok(()),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(source) => {
                return Err(OwnershipError::Lock {
                    path: path.to_path_buf(),
                    source,
                });
            }
        }
    }
}

/// Opens (creating, mode 0600, its directory 0700) the lock file. It is
/// opened close-on-exec, so an instance the agent spawns never inherits it.
fn open_lock_file(path: &Path) -> Result<File, OwnershipError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| OwnershipError::CreateDir {
                path: dir.to_path_buf(),
                source,
            })?;
    }
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(|source| OwnershipError::Open {
            path: path.to_path_buf(),
            source,
        })
}
