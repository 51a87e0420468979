//! A real Kubernetes control plane for genswap's tests, and what a test
//! needs around it.
//!
//! The control plane is `../shared/kube/up` (kube-apiserver and
//! kube-controller-manager v1.32 with etcd, on loopback; its README says
//! what runs and what does not). A test asks for it with
//! [`ControlPlane::shared`] (one per test binary) or
//! [`ControlPlane::own`] (its own, for a test that stops the API server).
//! Where there is none to start (a user's clone has no `../shared`), both
//! print one line, [`SKIP_LINE`] and why, and return `None`: the test
//! passes having checked nothing. `GENSWAP_KUBE=required` (CI sets it)
//! turns that into a failure.
//!
//! Beside it, a real OCI registry and images pushed by real tools
//! ([`registry`]), and a real Prometheus scraping test instances
//! ([`prometheus`]).
//!
//! Around it: the credentials of a chart's ServiceAccounts
//! ([`ControlPlane::service_account_kubeconfig`]), a real helm
//! ([`helm::helm`]), and processes stopped by PID whatever happens
//! ([`process::ChildGuard`]).

#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod chart;
mod control_plane;
pub mod helm;
mod namespace;
pub mod objects;
pub mod process;
pub mod prometheus;
pub mod registry;
pub mod signing;
pub mod slow_link;

pub use control_plane::{ControlPlane, SKIP_LINE, client_for, workspace};
pub use namespace::OwnNamespace;
