//! The store's one error: why a build was not staged, and whose fault
//! that is.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

use crate::registry::RegistryError;
use crate::store::StoreError;
use crate::tree::EntrypointProblem;
use crate::trust::TrustError;
use crate::unpack::UnpackError;

/// Why an artifact was refused: nothing of the build ran.
/// [`StageError::is_build_fault`] says whose fault it is.
#[derive(Debug, Error)]
pub enum StageError {
    #[error(
        "the pinned digest {expected:?} is not 64 lowercase hex characters (build.sha256 must be a sha256)"
    )]
    InvalidDigest { expected: String },
    #[error("the artifact names neither a path nor a url (build.artifact needs exactly one)")]
    NoSource,
    #[error("the artifact names both a path and a url (build.artifact needs exactly one)")]
    BothSources,
    #[error("artifact {path} is not an absolute path")]
    NotAbsolute { path: String },
    #[error(
        "artifact {path} contains a '..' component; name it by its path under the staging root"
    )]
    ParentComponent { path: String },
    #[error("artifact {path} does not exist (or is a symlink to nothing)")]
    Missing { path: String },
    #[error("artifact {path} is outside the staging root {root}")]
    OutsideRoot { path: String, root: PathBuf },
    #[error(
        "artifact {path} is reached through a symlink that leaves the staging root {root} (it resolves to {resolved})"
    )]
    EscapingSymlink {
        path: String,
        resolved: PathBuf,
        root: PathBuf,
    },
    #[error("artifact {path} cannot be resolved: {source}")]
    Inaccessible {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("artifact {path} is not readable: {source}")]
    Unreadable {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("artifact {path} is a directory, not an executable file")]
    IsDirectory { path: String },
    #[error("artifact {path} is a {kind}, not a regular file")]
    NotRegularFile { path: String, kind: &'static str },
    #[error("artifact {path} is empty")]
    Empty { path: String },
    #[error("artifact {path} is not executable (mode {mode:04o} has no exec bit)")]
    NotExecutable { path: String, mode: u32 },
    #[error("artifact {source_name} is larger than the limit of {limit} bytes{}", declared_size(*.size))]
    TooLarge {
        source_name: String,
        limit: u64,
        size: Option<u64>,
    },
    #[error(
        "artifact {source_name} does not match the pinned digest: expected sha256 {expected}, got {actual}"
    )]
    DigestMismatch {
        source_name: String,
        expected: String,
        actual: String,
    },
    #[error("artifact URL {url} is not usable: {reason}")]
    UnsupportedUrl { url: String, reason: String },
    #[error("artifact URL {url} answered {status}")]
    HttpStatus { url: String, status: u16 },
    #[error("artifact URL {url} did not deliver within {after:?}")]
    Timeout { url: String, after: Duration },
    #[error("artifact URL {url} could not be downloaded: {source}")]
    Download {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("the staging root {root} is unusable: {source}")]
    StagingRoot {
        root: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the HTTP client for artifact URLs could not be built: {0}")]
    Client(#[source] reqwest::Error),
    #[error("archive {source_name} ({format}) cannot be unpacked: {error}")]
    Unpack {
        source_name: String,
        format: &'static str,
        #[source]
        error: UnpackError,
    },
    #[error("build.entrypoint {entrypoint:?} cannot run from the tree of {source_name}: {}", entrypoint_problem(.problem))]
    Entrypoint {
        source_name: String,
        entrypoint: String,
        problem: EntrypointProblem,
    },
    #[error("{source_name} names nothing to run: {why}")]
    NoEntrypoint {
        source_name: String,
        why: &'static str,
    },
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(
        "build.entrypoint names a file inside a tree, and this artifact is a single file (set artifact.unpack)"
    )]
    EntrypointWithoutTree,
    #[error("the stored tree {path} could not be made or read: {source}")]
    Tree {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Trust(#[from] TrustError),
    #[error("the staging task ended abnormally: {0}")]
    Task(String),
}

impl StageError {
    /// Whether the build itself is at fault: its bytes are not the pinned
    /// ones, its archive breaks a rule or a limit, its entrypoint cannot
    /// run. Retrying cannot help; the rest (a missing or unreadable source,
    /// a server that fails, the store's own trouble) may pass.
    pub fn is_build_fault(&self) -> bool {
        match self {
            StageError::DigestMismatch { .. }
            | StageError::Entrypoint { .. }
            | StageError::NoEntrypoint { .. }
            | StageError::EntrypointWithoutTree => true,
            StageError::Registry(error) => error.is_build_fault(),
            StageError::Trust(error) => error.is_build_fault(),
            // A read error that reaches here is the archive's format: an
            // interrupted source is reported as its own error instead.
            StageError::Unpack { error, .. } => {
                error.is_archive_fault() || matches!(error, UnpackError::Read { .. })
            }
            _ => false,
        }
    }
}

fn entrypoint_problem(problem: &EntrypointProblem) -> String {
    match problem {
        EntrypointProblem::Missing => "nothing is at that path in the tree".into(),
        EntrypointProblem::NotExecutable(what) => format!("it is {what}"),
        EntrypointProblem::NotRelative => "it is not a relative path inside the tree".into(),
    }
}

fn declared_size(size: Option<u64>) -> String {
    size.map(|n| format!(" (it is {n} bytes)"))
        .unwrap_or_default()
}
