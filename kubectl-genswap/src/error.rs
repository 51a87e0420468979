//! Why a command failed, in one line a human can act on.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum PluginError {
    #[error("instancegeneration {object} not found")]
    NotFound { object: String },
    #[error(
        "forbidden: you may not {verb} {resource} in namespace {namespace} (ask for that RBAC verb on genswap.dev)"
    )]
    Forbidden {
        verb: &'static str,
        resource: &'static str,
        namespace: String,
    },
    #[error("{}", no_history(.object, .wanted.as_deref(), .current, .history))]
    NoHistory {
        object: String,
        /// `--to-build`, when given.
        wanted: Option<String>,
        /// The build the spec asks for now.
        current: String,
        history: Vec<String>,
    },
    #[error("{object} changed since it was read; nothing was written: run the command again")]
    Changed { object: String },
    #[error("{object}: nothing to retry: build {build} is not held down ({held})")]
    NothingToRetry {
        object: String,
        build: String,
        /// What `status.heldDown` holds, in words.
        held: String,
    },
    #[error("the API server refused to {verb} {object}: {message}")]
    Refused {
        verb: &'static str,
        object: String,
        message: String,
    },
    #[error("cannot reach the cluster: {0}")]
    Unreachable(String),
    #[error("no kubeconfig or in-cluster config: {0}")]
    Config(String),
    #[error("cannot write the output: {0}")]
    Output(#[from] std::io::Error),
}

fn no_history(object: &str, wanted: Option<&str>, current: &str, history: &[String]) -> String {
    let has = if history.is_empty() {
        "status.history is empty (a build enters it once every selected node served it)".to_string()
    } else {
        format!("status.history has {}", history.join(", "))
    };
    match wanted {
        Some(build) => {
            format!("{object}: build {build} is not in the history to go back to; {has}")
        }
        None => format!("{object}: no build before {current} to go back to; {has}"),
    }
}
