//! genswap's build store (SPEC 5.5 step 1, 5.14): where a build named by
//! an attempt becomes bytes on the node that the engine may execute.
//!
//! - [`stager`]: the one question the engine asks ([`Stager::stage`]): a
//!   build's source (a file by path or URL, or an archive of a tree),
//!   verified against its pinned digest, into the content-addressed store;
//! - [`unpack`]: applying an archive to a tree without ever writing outside
//!   it, within limits;
//! - [`tree`]: trees in the store, unpacked once per digest, read-only,
//!   re-verified cheaply on a hit;
//! - [`registry`]: images and OCI artifacts from a registry (oci-client),
//!   with the node's credentials;
//! - [`retention`]: what the store keeps, and the rest removed;
//! - [`trust`]: the node's trust keys, and the signatures a build must
//!   carry (sigstore's cosign verification);
//! - [`progress`]: the bytes a stage fetched, as they arrive;
//! - `archive`: one pass from the source through the hash and the
//!   decompressor into the unpacker.
//!
//! It knows nothing of generations, cgroups or Kubernetes; [`StageError`]
//! is its one error, and [`StageError::is_build_fault`] says whether the
//! build or the host is to blame.

mod archive;
mod error;
mod fs_util;
pub mod progress;
pub mod registry;
pub mod retention;
pub mod stager;
pub mod store;
pub mod tree;
pub mod trust;
pub mod unpack;

pub use archive::format_name;
pub use error::StageError;
pub use progress::FetchProgress;
pub use registry::{ImageConfig, RegistryError, RegistrySettings};
pub use retention::{RetentionPolicy, RetentionReport};
pub use stager::RunDefaults;
pub use stager::{
    DEFAULT_MAX_ARTIFACT_BYTES, Staged, Stager, StagerConfig, install_crypto_provider,
};
pub use store::{ENTRY_MODE, ENTRY_PREFIX, STORE_DIR_MODE, Store, StoreError};
pub use tree::{EntrypointProblem, TREE_PREFIX};
pub use trust::{TrustError, TrustPolicy};
pub use unpack::{DEFAULT_MAX_TREE_BYTES, DEFAULT_MAX_TREE_ENTRIES, Rule, TreeLimits, UnpackError};
