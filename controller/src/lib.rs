//! genswap cluster controller.
//!
//! The scheduler is the pure middle, in its own crate
//! ([`genswap_core::scheduler`]): (InstanceGeneration, its SwapAttempts,
//! Nodes, now) -> a plan. This crate adapts it to the API server, as a
//! pipeline a reader can follow:
//!
//! - [`observe`] and [`attempt_index`] (of [`cached_attempt`]s): the reads (watch caches, no
//!   requests; an IG's attempts by owner, not by a scan), planned from only
//!   once [`cache_sync`] says the caches have listed and [`expectations`]
//!   says they show this replica's own writes (and, at the start of a
//!   term of leadership, what [`term`] listed from the API server);
//! - `genswap_core::scheduler`: the plan (pure);
//! - [`apply`]: the writes, in the order that keeps revisions unique, and
//!   [`events`], which sends a reconcile's Events after it, an object's
//!   Normal Events of a few seconds as one ([`event_fold`]);
//! - [`reconciler`]: one reconcile, read → plan → apply, and its error
//!   policy, from the [`context`] every reconcile shares;
//! - [`run`]: the kube-runtime Controller and its watches ([`node_index`]
//!   decides which IGs a Node event concerns, `genswap_runtime::watch_backoff`
//!   how a watch reconnects);
//! - [`inbox`]: each node's list of its attempts, the one object its
//!   agent watches (a watch by name stays cheap at fleet size);
//! - [`leader`], [`metrics`], [`shutdown`], [`cli`]: operations (the
//!   endpoints are `genswap_runtime::http`'s).
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod apply;
pub mod attempt_index;
pub mod cache_sync;
pub mod cached_attempt;
pub mod cli;
pub mod context;
pub mod event_fold;
pub mod events;
pub mod expectations;
pub mod inbox;
pub mod leader;
pub mod metrics;
pub mod node_index;
pub mod observe;
pub mod reconciler;
pub mod run;
pub mod shutdown;
pub mod term;
