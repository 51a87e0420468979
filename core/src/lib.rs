//! genswap's pure core, shared by every adapter: the [`scheduler`], a
//! function from (InstanceGeneration, its SwapAttempts, Nodes, now) to the
//! writes that bring it closer to its desired state, and the names and
//! labels every component agrees on (`scheduler::naming`).
//!
//! No client, no async runtime, no clock, no I/O: the controller applies a
//! plan to the API server, standalone mode to its state file, and both are
//! tested against the same plans.
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod scheduler;
