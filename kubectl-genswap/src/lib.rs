//! `kubectl genswap`: an InstanceGeneration's rollout at a glance, and the
//! verbs a rollout needs (retry, undo, pause, resume).
//!
//! The tree ([`tree`]) and the writes ([`edits`]) are decided without a
//! client; [`api`] makes the requests and [`run`] ties them to the command
//! line. Every write is a JSON merge patch of the one field the verb
//! changes, under the field manager `kubectl-genswap`.

pub mod api;
pub mod edits;
pub mod error;
pub mod render;
pub mod tree;
pub mod watch;

use std::io::Write;

use clap::{Parser, Subcommand, ValueEnum};
use k8s_openapi::jiff::Timestamp;
use kube::Client;

use api::Target;
use error::PluginError;
use render::Colour;

#[derive(Debug, Parser)]
#[command(
    name = "kubectl-genswap",
    version,
    about = "genswap rollouts from kubectl"
)]
pub struct Cli {
    /// The namespace; the kubeconfig context's when not given.
    #[arg(short, long, global = true)]
    pub namespace: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// The InstanceGeneration, each selected node and its recent attempts.
    Get {
        name: String,
        /// Redraw on every change the API server reports.
        #[arg(short, long)]
        watch: bool,
        /// One node only: its record and attempts.
        #[arg(long)]
        node: Option<String>,
        #[arg(short, long, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Arms one more attempt of a held-down build (a fresh spec.retry).
    Retry { name: String },
    /// Releases a previous good build from status.history again.
    Undo {
        name: String,
        /// The build to go back to; the newest other one when not given.
        #[arg(long)]
        to_build: Option<String>,
    },
    /// No new attempts until resumed; attempts in flight finish.
    Pause { name: String },
    /// Lets a paused rollout go on.
    Resume { name: String },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Text,
    Json,
}

/// How a run prints and what time it is.
pub struct Terminal<'a> {
    pub out: &'a mut dyn Write,
    pub colour: Colour,
    /// Clear the screen before each frame of `--watch`.
    pub redraw: bool,
    pub now: fn() -> Timestamp,
    /// A fresh `spec.retry` token.
    pub token: fn() -> String,
}

/// Runs `command` against `client`; `namespace` is already resolved.
pub async fn run(
    command: Command,
    client: Client,
    namespace: &str,
    terminal: &mut Terminal<'_>,
) -> Result<(), PluginError> {
    match command {
        Command::Get {
            name,
            watch: false,
            node,
            output,
        } => {
            let target = Target::new(client, namespace, &name).on_node(node);
            let ig = target.get().await?;
            let attempts = target.list_attempts().await?;
            let tree = tree::build(&ig, &attempts, target.node.as_deref(), (terminal.now)());
            print_tree(terminal, &tree, output)
        }
        Command::Get {
            name,
            watch: true,
            node,
            output,
        } => {
            let target = Target::new(client, namespace, &name).on_node(node);
            watch::run(&target, output, terminal, None).await
        }
        Command::Retry { name } => {
            let target = Target::new(client, namespace, &name);
            let ig = target.get().await?;
            if !edits::retryable(&ig) {
                return Err(nothing_to_retry(&target, &ig));
            }
            let mut token = (terminal.token)();
            if ig.spec.retry == token {
                token.push_str("-again");
            }
            target.patch(&edits::retry(&token)).await?;
            say(
                terminal,
                &format!(
                    "{}: spec.retry is {token}: one more attempt of a held-down build is armed",
                    target.object()
                ),
            )
        }
        Command::Undo { name, to_build } => {
            let target = Target::new(client, namespace, &name);
            let ig = target.get().await?;
            let entry = edits::undo_target(&ig, to_build.as_deref())?;
            target.patch(&edits::undo(&ig, entry)).await?;
            say(
                terminal,
                &format!(
                    "{}: spec.build is {} again (sha256 {}); it rolls out as a release",
                    target.object(),
                    entry.build,
                    short(&entry.sha256)
                ),
            )
        }
        Command::Pause { name } => set_paused(client, namespace, &name, true, terminal).await,
        Command::Resume { name } => set_paused(client, namespace, &name, false, terminal).await,
    }
}

async fn set_paused(
    client: Client,
    namespace: &str,
    name: &str,
    paused: bool,
    terminal: &mut Terminal<'_>,
) -> Result<(), PluginError> {
    let target = Target::new(client, namespace, name);
    target.patch(&edits::pause(paused)).await?;
    let what = if paused {
        "paused: no new attempts; attempts in flight finish"
    } else {
        "resumed"
    };
    say(terminal, &format!("{}: {what}", target.object()))
}

fn nothing_to_retry(target: &Target, ig: &genswap_crds::InstanceGeneration) -> PluginError {
    let held: Vec<String> = ig
        .status
        .iter()
        .flat_map(|s| &s.held_down)
        .map(|h| format!("{} on {}", h.build, h.node))
        .collect();
    PluginError::NothingToRetry {
        object: target.object(),
        build: ig.spec.build.id.clone(),
        held: if held.is_empty() {
            "status.heldDown is empty".into()
        } else {
            format!("status.heldDown has {}", held.join(", "))
        },
    }
}

fn print_tree(
    terminal: &mut Terminal<'_>,
    tree: &tree::Tree,
    output: Output,
) -> Result<(), PluginError> {
    let text = match output {
        Output::Text => render::text(tree, terminal.colour),
        Output::Json => render::json(tree) + "\n",
    };
    terminal.out.write_all(text.as_bytes())?;
    terminal.out.flush()?;
    Ok(())
}

fn say(terminal: &mut Terminal<'_>, line: &str) -> Result<(), PluginError> {
    writeln!(terminal.out, "{line}")?;
    Ok(())
}

fn short(sha256: &str) -> &str {
    sha256.get(..12).unwrap_or(sha256)
}
