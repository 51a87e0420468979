//! The genswap API, group `genswap.dev`, version `v1alpha1`.
//!
//! - [`InstanceGeneration`] (short name `ig`): the build a user wants running on
//!   the nodes its selector picks.
//! - [`SwapAttempt`] (short name `swa`): one try at moving one instance on one
//!   node to a new generation; created by the controller, reported on by the
//!   node agent.
//!
//! The CRD YAML under `crds/` is generated from these types by the `crdgen`
//! binary and is never edited by hand.
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod analysis;
pub mod conditions;
pub mod crdgen;
pub mod instance_generation;
pub mod manifest;
pub mod probes;
pub mod sandbox;
pub mod settings;
pub mod sidecars;
pub mod swap_attempt;

pub use analysis::{
    AnalysisPhase, AnalysisQuery, AnalysisSpec, AnalysisStatus, Inconclusive, OnFailure,
};
pub use conditions::{ConditionType, set_condition};
pub use instance_generation::{
    ANNOTATION_RECORD, DesiredState, HeldDown, HistoryArtifact, HistoryEntry, InstanceGeneration,
    InstanceGenerationSpec, InstanceGenerationStatus, LastAttempt, NODES_LISTED, NodeCounts,
    NodeGeneration, NodeRecord, PrestageStatus, RolloutSpec, RolloutStatus, StagingNode,
    StagingState, WavesSpec, scaled_count,
};
pub use probes::*;
pub use sandbox::{
    CapabilitiesSpec, Capability, DirectoriesSpec, FilesystemProfile, Limit, LimitsSpec,
    RootProfile, SeccompProfile,
};
pub use settings::*;
pub use sidecars::{
    SIDECAR_LISTENERS_RULE, SidecarExit, SidecarSpec, SidecarState, SidecarStatus, Sidecars,
};
pub use swap_attempt::{
    HeldListener, LastExit, ListenerHandover, ServingState, ServingStatus, StageProgress,
    StepTiming, SwapAttempt, SwapAttemptSpec, SwapAttemptStatus, describe_exit, exit_text,
    exited_clean, signal_name,
};

/// The API group of every genswap resource.
pub const GROUP: &str = "genswap.dev";
/// The one served and stored version.
pub const VERSION: &str = "v1alpha1";
