//! What standalone mode keeps across restarts, one file per instance:
//! `<state dir>/standalone/<disk name>.yaml` (`<namespace>.<name>`, cut when long:
//! [`crate::disk_name`]).
//!
//! In a cluster the API server keeps the InstanceGeneration's status (the
//! issued `schedRev`, the failure book, the node's generation) and the
//! SwapAttempts. Here this file does: the spec in force and the generation
//! number standalone mode gave it, the status the scheduler wrote, and the
//! attempts it issued with what the engine reported. A restart continues
//! with the same revisions and the same held-down builds.

use std::fs;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use genswap_crds::{InstanceGenerationSpec, InstanceGenerationStatus, SwapAttempt};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::files::{remove_if_exists, write_durably};
use super::status::AttemptReport;
use crate::disk_name::DiskName;
use crate::gate::InstanceKey;

/// The state directory's subdirectory standalone mode uses.
pub const STATE_SUBDIR: &str = "standalone";

/// One instance's state.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InstanceState {
    /// The instance.
    pub instance: InstanceKey,
    /// The manifest file (a name in the manifest directory) it comes from.
    pub file: String,
    /// `metadata.generation`: 1 for the first spec, +1 for every change.
    pub generation: i64,
    /// The spec in force.
    pub spec: InstanceGenerationSpec,
    /// The status the scheduler wrote last.
    #[serde(default)]
    pub status: InstanceGenerationStatus,
    /// The attempts the scheduler issued and has not deleted, oldest first.
    #[serde(default)]
    pub attempts: Vec<SwapAttempt>,
    /// The newest finished attempts the scheduler deleted, oldest first, at
    /// most [`HISTORY_KEPT`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<AttemptReport>,
}

/// How many deleted attempts an instance's state and status file keep. In a
/// cluster the Events and the agent's logs tell of an attempt once it is
/// deleted; here the status file is where an operator looks, so the last
/// few stay readable there (a crash's recovery, an abandoned release).
pub const HISTORY_KEPT: usize = 16;

/// Why state could not be read or written.
#[derive(Debug, Error)]
pub enum StateError {
    /// The state directory could not be created or listed.
    #[error("cannot use the standalone state directory {path}: {source}")]
    Dir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A state file could not be read.
    #[error("cannot read the standalone state file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A state file is not what this code writes.
    #[error("the standalone state file {path} is corrupt: {error}")]
    Corrupt { path: PathBuf, error: String },
    /// A state file could not be written or removed.
    #[error("cannot write the standalone state file {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The state could not be encoded.
    #[error("cannot encode the standalone state of {instance}: {error}")]
    Encode {
        instance: InstanceKey,
        error: String,
    },
}

/// The per-instance state files.
#[derive(Clone, Debug)]
pub struct StateStore {
    dir: PathBuf,
}

impl StateStore {
    /// The store under `<state_dir>/standalone`, created mode 0700.
    pub fn open(state_dir: &Path) -> Result<StateStore, StateError> {
        let dir = state_dir.join(STATE_SUBDIR);
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|source| StateError::Dir {
                path: dir.clone(),
                source,
            })?;
        Ok(StateStore { dir })
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `<dir>/<disk name>.yaml`.
    pub fn path_of(&self, instance: &InstanceKey) -> PathBuf {
        self.dir.join(file_name(instance))
    }

    /// [`StateStore::path_of`] for the store of `state_dir`, without opening
    /// it.
    pub fn path_in(state_dir: &Path, instance: &InstanceKey) -> PathBuf {
        state_dir.join(STATE_SUBDIR).join(file_name(instance))
    }

    /// Every instance's state. A corrupt file is reported beside the others
    /// and hides none of them.
    pub fn load_all(&self) -> Result<(Vec<InstanceState>, Vec<StateError>), StateError> {
        let listing = fs::read_dir(&self.dir).map_err(|source| StateError::Dir {
            path: self.dir.clone(),
            source,
        })?;
        let mut states = Vec::new();
        let mut broken = Vec::new();
        for entry in listing {
            let entry = entry.map_err(|source| StateError::Dir {
                path: self.dir.clone(),
                source,
            })?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name.starts_with('.') || !name.ends_with(".yaml") {
                continue;
            }
            match read_state(&entry.path()) {
                Ok(state) => states.push(state),
                Err(error) => broken.push(error),
            }
        }
        states.sort_by(|a, b| a.instance.cmp(&b.instance));
        Ok((states, broken))
    }

    /// Writes one instance's state durably.
    pub fn save(&self, state: &InstanceState) -> Result<(), StateError> {
        let text = serde_saphyr::to_string(state).map_err(|error| StateError::Encode {
            instance: state.instance.clone(),
            error: error.to_string(),
        })?;
        let path = self.path_of(&state.instance);
        write_durably(&path, text.as_bytes(), 0o600)
            .map_err(|source| StateError::Write { path, source })
    }

    /// Forgets an instance.
    pub fn remove(&self, instance: &InstanceKey) -> Result<(), StateError> {
        let path = self.path_of(instance);
        remove_if_exists(&path).map_err(|source| StateError::Write { path, source })
    }
}

/// `<disk name>.yaml`.
fn file_name(instance: &InstanceKey) -> String {
    format!("{}.yaml", DiskName::of(instance))
}

fn read_state(path: &Path) -> Result<InstanceState, StateError> {
    let text = fs::read_to_string(path).map_err(|source| StateError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let state: InstanceState =
        serde_saphyr::from_str(&text).map_err(|error| StateError::Corrupt {
            path: path.to_path_buf(),
            error: error.to_string(),
        })?;
    let expected = file_name(&state.instance);
    if path.file_name().and_then(|n| n.to_str()) != Some(expected.as_str()) {
        return Err(StateError::Corrupt {
            path: path.to_path_buf(),
            error: format!(
                "it holds {}, not the instance its name says",
                state.instance
            ),
        });
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use genswap_crds::InstanceGeneration;

    fn spec() -> InstanceGenerationSpec {
        let ig: InstanceGeneration = serde_json::from_value(serde_json::json!({
            "apiVersion": "genswap.dev/v1alpha1",
            "kind": "InstanceGeneration",
            "metadata": {"name": "hello"},
            "spec": {
                "build": {
                    "id": "1",
                    "artifact": {"path": "/staging/yes"},
                    "sha256": "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"
                },
                "configRev": "no",
                "restartID": "null",
                "retry": "0x10",
                "process": {"args": ["--greeting", "on", "1.5"], "env": [{"name": "A", "value": "true"}]}
            }
        }))
        .expect("a valid object");
        ig.spec
    }

    #[test]
    fn state_round_trips_even_with_strings_that_look_like_other_scalars() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = StateStore::open(dir.path()).expect("open");
        let state = InstanceState {
            instance: InstanceKey::new("default", "hello").expect("key"),
            file: "hello.yaml".into(),
            generation: 3,
            spec: spec(),
            status: InstanceGenerationStatus {
                sched_rev: 7,
                ..InstanceGenerationStatus::default()
            },
            attempts: Vec::new(),
            history: vec![AttemptReport {
                name: "hello-node-6".into(),
                sched_rev: 6,
                cause: genswap_crds::Cause::Release,
                build: "0x10".into(),
                mode: genswap_crds::Mode::Hold,
                canary: false,
                stage_only: false,
                status: genswap_crds::SwapAttemptStatus {
                    outcome: Some(genswap_crds::Outcome::Abandoned),
                    reason: Some("true".into()),
                    ..Default::default()
                },
            }],
        };
        store.save(&state).expect("save");
        let (loaded, broken) = store.load_all().expect("load");
        assert!(broken.is_empty(), "{broken:?}");
        assert_eq!(loaded, vec![state.clone()]);
        store.remove(&state.instance).expect("remove");
        assert!(store.load_all().expect("load").0.is_empty());
    }

    #[test]
    fn a_corrupt_file_hides_no_other_instance() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = StateStore::open(dir.path()).expect("open");
        fs::write(store.dir().join("default.broken.yaml"), "{{{").expect("write");
        let state = InstanceState {
            instance: InstanceKey::new("default", "ok").expect("key"),
            file: "ok.yaml".into(),
            generation: 1,
            spec: spec(),
            status: InstanceGenerationStatus::default(),
            attempts: Vec::new(),
            history: Vec::new(),
        };
        store.save(&state).expect("save");
        let (loaded, broken) = store.load_all().expect("load");
        assert_eq!(loaded.len(), 1);
        assert_eq!(broken.len(), 1);
        assert!(broken[0].to_string().contains("default.broken.yaml"));
    }
}
