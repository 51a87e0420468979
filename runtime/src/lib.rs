//! What the controller and the node agent share around the pure core, in
//! the manner of kubert: [`http`], the `/metrics`, `/healthz` and `/readyz`
//! endpoints over any metrics registry and readiness check;
//! [`watch_backoff`], how a watch reconnects after an error; and [`heap`],
//! what the allocator holds; and [`prometheus`], the instant queries
//! `rollout.analysis` is measured with.
#![deny(rust_2018_idioms)]
#![deny(unsafe_code)]

pub mod heap;
pub mod http;
pub mod prometheus;
pub mod watch_backoff;
