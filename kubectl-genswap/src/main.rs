//! The `kubectl-genswap` binary: kubectl runs it for `kubectl genswap …`.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::Parser;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kubectl_genswap::error::PluginError;
use kubectl_genswap::render::Colour;
use kubectl_genswap::{Cli, Terminal, run};

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match main_inner(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn main_inner(cli: Cli) -> Result<(), PluginError> {
    let client = Client::try_default()
        .await
        .map_err(|e| PluginError::Config(e.to_string()))?;
    let namespace = cli
        .namespace
        .unwrap_or_else(|| client.default_namespace().to_string());
    let stdout = std::io::stdout();
    let colour = match anstream::AutoStream::choice(&stdout) {
        anstream::ColorChoice::Never => Colour::Off,
        _ => Colour::On,
    };
    let redraw = stdout.is_terminal();
    let mut out = stdout.lock();
    let mut terminal = Terminal {
        out: &mut out,
        colour,
        redraw,
        now: Timestamp::now,
        token: fresh_token,
    };
    run(cli.command, client, &namespace, &mut terminal).await
}

/// A token no earlier run wrote: the time to the nanosecond.
fn fresh_token() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("kubectl-genswap-{nanos}")
}
