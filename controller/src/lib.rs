//! genswap cluster controller.
//!
//! [`scheduler`] is the pure middle: (InstanceGeneration, its SwapAttempts,
//! Nodes, now) -> [`scheduler::Plan`]. Everything else adapts it to the API
//! server.
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod scheduler;
