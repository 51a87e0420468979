//! The swap engine: one attempt moves one instance to a new generation.
//!
//! It knows nothing of Kubernetes. An adapter hands it an [`Attempt`] (the
//! SwapAttempt's spec), an [`AttemptGate`](crate::gate::AttemptGate) and a
//! [`Cancel`] token, and gets a [`SwapResult`] back.
mod cancel;
mod types;

pub use cancel::Cancel;
pub use types::{Attempt, Step, StepRecord, SwapResult, effective_mode};
