//! `genswap-helper`: the agent's small helpers (the log shim, the listener
//! keeper) as a program of their own. Each runs once per generation or per
//! instance; the agent's own binary would cost each about 1 MiB of private
//! memory before it did anything (its relocated pointers), this one a
//! fraction of that. It takes the same arguments as `node-agent log-shim`
//! and `node-agent listener-keeper`, so the agent can run either.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match node_agent::helper::parse(&args) {
        Ok(node_agent::helper::HelperCommand::LogShim(shim)) => {
            node_agent::logs::shim::run(&shim);
            ExitCode::SUCCESS
        }
        Ok(node_agent::helper::HelperCommand::ListenerKeeper) => node_agent::listener_keeper::run(),
        Err(error) => {
            eprintln!("genswap-helper: {error}");
            ExitCode::from(2)
        }
    }
}
