//! genswap node agent: swaps host processes between generations under cgroup v2.
//!
//! The swap engine knows nothing of Kubernetes. Its parts, each in the file
//! whose name says it:
//! - [`cgroup`]: the cgroup v2 manager (mount discovery, layout, limits,
//!   parent raise/restore, stop with proof of exit).
//! - [`spawn`]: starting a generation inside its fresh cgroup.
//! - [`stage`]: resolving, verifying and storing artifacts.
//! - [`health`]: the HTTP health check over a generation's own socket.
//! - [`journal`]: the per-instance intent journal.
//! - [`switch`]: repointing `current.sock`.
//! - [`steering`]: the BPF program and maps that pick which socket of a
//!   listener new connections reach (SPEC 6.3).
//! - [`gate`]: the attempt gate the adapters implement.
//! - [`classify`]: the one outcome classifier every step's error goes through.
//! - [`attempt_status`]: an engine result as a SwapAttempt's status, the one
//!   mapping both adapters report with.
//! - [`engine`]: the swap itself, overlap, hold and worker, step by step.
#![deny(rust_2018_idioms)]

pub mod attempt_status;
pub mod cgroup;
pub mod classify;
pub mod command;
pub mod confine;
pub mod demo;
pub mod disk_name;
pub mod engine;
pub mod failpoint;
pub mod gate;
pub mod health;
pub mod helper;
pub mod host;
mod inotify;
pub mod journal;
pub mod kube;
mod launch;
pub mod listener_keeper;
pub mod listeners;
pub mod logs;
pub mod metrics;
pub mod notify;
pub mod observation;
pub mod ownership;
pub mod paths;
pub mod prestage;
pub mod probe;
pub mod process;
pub mod sandbox;
pub mod spawn;
pub mod standalone;
pub mod steering;
pub mod switch;
