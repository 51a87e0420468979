//! What the controller and the node agent share around the pure core, in
//! the manner of kubert: [`http`], the `/metrics`, `/healthz` and `/readyz`
//! endpoints over any metrics registry and readiness check; and
//! [`watch_backoff`], how a watch reconnects after an error.
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod http;
pub mod watch_backoff;
