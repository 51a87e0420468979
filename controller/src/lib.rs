//! genswap cluster controller.
//!
//! [`scheduler`] is the pure middle: (InstanceGeneration, its SwapAttempts,
//! Nodes, now) -> [`scheduler::Plan`]. Everything else adapts it to the API
//! server, as a pipeline a reader can follow:
//!
//! - [`observe`] and [`attempt_index`]: the reads (watch caches, no
//!   requests; an IG's attempts by owner, not by a scan), planned from only
//!   once [`cache_sync`] says the caches have listed and [`expectations`]
//!   says they show this replica's own writes;
//! - [`scheduler`]: the plan (pure);
//! - [`apply`]: the writes, in the order that keeps revisions unique, and
//!   [`events`], which sends a reconcile's Events after it, an object's
//!   Normal Events of a few seconds as one ([`event_fold`]);
//! - [`reconciler`]: one reconcile, read → plan → apply, and its error policy;
//! - [`run`]: the kube-runtime Controller and its watches ([`node_index`]
//!   decides which IGs a Node event concerns, [`watch_backoff`] how a watch
//!   reconnects);
//! - [`inbox`]: each node's list of its attempts, the one object its
//!   agent watches (a watch by name stays cheap at fleet size);
//! - [`leader`], [`metrics`], [`http`], [`shutdown`], [`cli`]: operations.
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod apply;
pub mod attempt_index;
pub mod cache_sync;
pub mod cli;
pub mod event_fold;
pub mod events;
pub mod expectations;
pub mod http;
pub mod inbox;
pub mod leader;
pub mod metrics;
pub mod node_index;
pub mod observe;
pub mod reconciler;
pub mod run;
pub mod scheduler;
pub mod shutdown;
pub mod watch_backoff;
