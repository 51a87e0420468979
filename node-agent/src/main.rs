//! genswap node agent: `run` (Kubernetes mode, what the DaemonSet runs),
//! `standalone --dir DIR` (one host, a directory of InstanceGeneration
//! files) and `demo` (a guided run of standalone mode on this machine).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use genswap_runtime::prometheus::{Prometheus, PrometheusError};
use node_agent::demo::{self, DemoError, DemoOptions};
use node_agent::host::{self, Host, HostArgs, HostError};
use node_agent::kube::{self, KubeAgentError, KubeArgs};
use node_agent::ownership::{self, NodeLock, OwnershipError};
use node_agent::standalone::{self, NodeIdentity, StandaloneConfig, StandaloneError};

/// Longest wait for one `rollout.analysis` query in standalone mode.
const PROMETHEUS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
use thiserror::Error;
use tracing::{error, info};

/// The genswap node agent: swaps host processes between generations under
/// cgroup v2.
#[derive(Parser, Debug)]
#[command(name = "node-agent", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Kubernetes mode: run the SwapAttempts of this node (what the
    /// DaemonSet runs).
    Run(RunArgs),
    /// Standalone mode: one host, no cluster; the desired state is a
    /// directory of InstanceGeneration YAML files, status is written beside
    /// them.
    Standalone(StandaloneArgs),
    /// A guided run of standalone mode on this machine (root, cgroup v2):
    /// install, overlap release, a failing build, its retry, a hold
    /// release, with a client sending requests throughout. Cleans up after
    /// itself.
    Demo(DemoArgs),
    /// Prints an instance's log: the stdout and stderr of one of its
    /// generations, as written under the log dir.
    Logs(node_agent::logs::read::LogsArgs),
    /// Prints where an instance's sockets, cgroup, journal, state and logs
    /// are under the given flags (a long name's are under a cut name).
    Paths(node_agent::paths::PathsArgs),
    /// Prints the sandbox an InstanceGeneration's processes get on this
    /// host, as the equivalent systemd unit (score it with
    /// `systemd-analyze security --offline=yes`).
    Sandbox(node_agent::confine::unit::SandboxArgs),
    /// The log shim the agent starts for each generation (not for people).
    #[command(hide = true)]
    LogShim(node_agent::logs::shim::ShimArgs),
    /// The keeper of an instance's listeners; started by the agent.
    #[command(hide = true, name = "listener-keeper")]
    ListenerKeeper,
}

#[derive(Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    kube: KubeArgs,
    #[command(flatten)]
    host: HostArgs,
}

#[derive(Args, Debug)]
struct StandaloneArgs {
    /// The directory of InstanceGeneration files (`*.yaml`, `*.yml`), one
    /// object per file. Status goes to `<dir>/status/<file name>`.
    #[arg(long, env = "GENSWAP_STANDALONE_DIR", value_name = "DIR")]
    dir: PathBuf,
    /// This host's node name. Default: the host name.
    #[arg(long, env = "GENSWAP_NODE_NAME")]
    node_name: Option<String>,
    /// A node label, `key=value`, matched against `spec.nodeSelector`;
    /// repeat for more (the environment variable takes a comma-separated
    /// list). `kubernetes.io/hostname=<node name>` is always set.
    #[arg(
        long = "node-label",
        env = "GENSWAP_NODE_LABELS",
        value_name = "KEY=VALUE",
        value_delimiter = ',',
        value_parser = parse_label
    )]
    node_labels: Vec<(String, String)>,
    /// On exit, stop every instance and forget it (state and status files
    /// removed). Without it, serving generations keep running, as the
    /// agent leaves them.
    #[arg(long, env = "GENSWAP_STOP_ON_EXIT")]
    stop_on_exit: bool,
    /// The Prometheus `rollout.analysis` queries run against (its root
    /// URL). Without it an analysis is inconclusive.
    #[arg(long, env = "GENSWAP_PROMETHEUS_URL", value_name = "URL")]
    prometheus_url: Option<String>,
    /// Join PID 1's mount and cgroup namespaces at start, as `run` does:
    /// for standalone mode in a pod (hostPID, CAP_SYS_ADMIN) rather than on
    /// the host.
    #[arg(long, env = "GENSWAP_JOIN_HOST_NAMESPACES")]
    join_host_namespaces: bool,
    #[command(flatten)]
    host: HostArgs,
}

#[derive(Args, Debug)]
struct DemoArgs {
    /// The demo keeps its run dir, state dir, staging root and store in a
    /// fresh temp dir, whatever the path flags say; `--cgroup-root` is the
    /// directory its fresh cgroup subtree is created under.
    #[command(flatten)]
    host: HostArgs,
}

impl Command {
    fn host_mut(&mut self) -> Option<&mut HostArgs> {
        match self {
            Command::Run(args) => Some(&mut args.host),
            Command::Standalone(args) => Some(&mut args.host),
            Command::Demo(args) => Some(&mut args.host),
            Command::Logs(_)
            | Command::Paths(_)
            | Command::Sandbox(_)
            | Command::LogShim(_)
            | Command::ListenerKeeper => None,
        }
    }

    fn host(&self) -> Option<&HostArgs> {
        match self {
            Command::Run(args) => Some(&args.host),
            Command::Standalone(args) => Some(&args.host),
            Command::Demo(args) => Some(&args.host),
            Command::Logs(_)
            | Command::Paths(_)
            | Command::Sandbox(_)
            | Command::LogShim(_)
            | Command::ListenerKeeper => None,
        }
    }
}

/// `key=value`, with a key and a value that a Kubernetes label allows.
fn parse_label(text: &str) -> Result<(String, String), String> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not key=value"))?;
    let key_ok = !key.is_empty()
        && key.len() <= 317
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
    let value_ok = value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !key_ok {
        return Err(format!("{key:?} is not a label key"));
    }
    if !value_ok {
        return Err(format!("{value:?} is not a label value"));
    }
    Ok((key.to_string(), value.to_string()))
}

#[derive(Debug, Error)]
enum MainError {
    #[error(transparent)]
    Host(#[from] HostError),
    #[error(transparent)]
    Standalone(#[from] StandaloneError),
    #[error(transparent)]
    Prometheus(#[from] PrometheusError),
    #[error(transparent)]
    Demo(#[from] DemoError),
    #[error("cannot take the node lock: {0}")]
    Lock(#[from] OwnershipError),
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error(transparent)]
    Kube(#[from] KubeAgentError),
    #[error("the demo did not go as its story says (see the table above)")]
    DemoUnexpected,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Neither needs the runtime, the log subscriber or the host parts; the
    // shim must not write to the output it was given (it is /dev/null).
    match &cli.command {
        Command::LogShim(args) => {
            node_agent::logs::shim::run(args);
            return ExitCode::SUCCESS;
        }
        Command::ListenerKeeper => node_agent::listener_keeper::run(),
        Command::Logs(args) => {
            let mut out = std::io::stdout().lock();
            return match node_agent::logs::read::print(args, &mut out) {
                Ok(()) => ExitCode::SUCCESS,
                // A closed reader (`| head`) is the end, not an error.
                Err(node_agent::logs::read::ReadError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::BrokenPipe =>
                {
                    ExitCode::SUCCESS
                }
                Err(error) => {
                    eprintln!("node-agent logs: {error}");
                    ExitCode::FAILURE
                }
            };
        }
        Command::Paths(args) => {
            return match node_agent::paths::render(args) {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(error) => {
                    eprintln!("node-agent paths: {error}");
                    ExitCode::FAILURE
                }
            };
        }
        Command::Sandbox(args) => {
            return match node_agent::confine::unit::render(args) {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(error) => {
                    eprintln!("node-agent sandbox: {error}");
                    ExitCode::FAILURE
                }
            };
        }
        _ => {}
    }
    // The demo talks to a human on stdout and its failing builds are part
    // of the story: only the agent's own errors go to the log.
    let default_level = match cli.command {
        Command::Demo(_) => "error",
        _ => "info",
    };
    let log_format = cli
        .command
        .host()
        .map_or(host::LogFormat::Text, |host| host.log_format);
    if let Err(error) = host::init_tracing(log_format, default_level) {
        eprintln!("node-agent: {error}");
        return ExitCode::FAILURE;
    }
    let talks_to_a_human = matches!(cli.command, Command::Demo(_));
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if talks_to_a_human => {
            eprintln!("node-agent: {}", chain(&error));
            ExitCode::FAILURE
        }
        Err(error) => {
            error!(error = %chain(&error), "node-agent failed");
            ExitCode::FAILURE
        }
    }
}

fn run(mut command: Command) -> Result<(), MainError> {
    let join = match &command {
        Command::Run(args) => !args.host.no_host_namespaces,
        Command::Standalone(args) => args.join_host_namespaces,
        _ => false,
    };
    // Found before any namespace is joined: the helper lies beside the
    // agent's binary, in the image.
    if let Some(host) = command.host_mut() {
        host.helper_program = Some(host::locate_helper(host.helper.as_deref())?);
    }
    if join {
        // What the pod mounts (its service account, a registry Secret) is
        // gone from view once the agent is in the host's mount namespace:
        // keep each directory open and read through it.
        if matches!(command, Command::Run(_)) {
            node_agent::kube::pin_in_cluster_config()?;
        }
        if let Some(host) = command.host_mut() {
            for path in [
                &mut host.registry_config,
                &mut host.registry_ca,
                &mut host.trust_keys,
            ]
            .into_iter()
            .flatten()
            {
                *path = host::pin_through_fd(path)?;
            }
        }
        // Before the runtime starts any thread: setns into a mount
        // namespace needs a single-threaded process.
        let joined = host::join_host_namespaces()?;
        info!(joined = ?joined.joined, "joined the host's namespaces");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(MainError::Runtime)?;
    runtime.block_on(async move {
        match command {
            Command::Run(args) => run_kube(args).await,
            Command::Standalone(args) => run_standalone(args).await,
            Command::Demo(args) => {
                let report = demo::run(DemoOptions {
                    cgroup_parent: args.host.cgroup_root.clone(),
                    helper: args.host.helper_program.clone().unwrap_or_default(),
                })
                .await?;
                if report.as_expected() {
                    Ok(())
                } else {
                    Err(MainError::DemoUnexpected)
                }
            }
            Command::Logs(_)
            | Command::Paths(_)
            | Command::Sandbox(_)
            | Command::LogShim(_)
            | Command::ListenerKeeper => Ok(()),
        }
    })
}

/// Kubernetes mode: the agent waits for the node lock itself, and stops
/// on SIGTERM or SIGINT.
async fn run_kube(args: RunArgs) -> Result<(), MainError> {
    let settings = args.host.settings();
    let config = args.kube.into_config(&settings.state_dir)?;
    let host = Host::build(&settings)?;
    info!(
        cgroup_root = ?host.settings.cgroup_root,
        run_dir = %settings.run_dir.display(),
        state_dir = %settings.state_dir.display(),
        "host parts ready"
    );
    kube::run(host.engine, host.gate, config).await?;
    Ok(())
}

async fn run_standalone(args: StandaloneArgs) -> Result<(), MainError> {
    let settings = args.host.settings();
    // One agent per node (state dir): a Kubernetes-mode agent or another
    // standalone run holding it is waited for, as during a rolling update.
    let lock_path = ownership::default_lock_path(&settings.state_dir);
    let _node_lock = match NodeLock::try_acquire(&lock_path)? {
        Some(lock) => lock,
        None => {
            info!(lock = %lock_path.display(), "another agent owns this node; waiting for it to exit");
            NodeLock::acquire(&lock_path).await?
        }
    };
    let host = Host::build(&settings)?;
    // Holding the node: adopt what serves and finish what a killed agent
    // left in flight (SPEC 5.7) before standalone mode reads the journal.
    host.engine.recover().await;
    let name = args
        .node_name
        .clone()
        .filter(|n| !n.is_empty())
        .or_else(host::host_name)
        .unwrap_or_else(|| "localhost".into());
    let labels: BTreeMap<String, String> = args.node_labels.iter().cloned().collect();
    let prometheus = args
        .prometheus_url
        .as_deref()
        .filter(|url| !url.is_empty())
        .map(|url| Prometheus::new(url, PROMETHEUS_TIMEOUT))
        .transpose()?;
    let config = StandaloneConfig {
        dir: args.dir.clone(),
        node: NodeIdentity::new(name, labels),
        stop_on_exit: args.stop_on_exit,
        prometheus,
    };
    info!(
        dir = %config.dir.display(),
        node = %config.node.name,
        cgroup_root = ?host.settings.cgroup_root,
        run_dir = %settings.run_dir.display(),
        state_dir = %settings.state_dir.display(),
        "standalone mode"
    );
    standalone::run(&host, config, shutdown_signal()).await?;
    Ok(())
}

/// SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
}

/// The error and its sources, `a: b: c`.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subcommands_take_the_shared_host_flags() {
        let cli = Cli::try_parse_from([
            "node-agent",
            "standalone",
            "--dir",
            "/etc/genswap/instances",
            "--node-label",
            "pool=edge",
            "--node-label",
            "zone=a",
            "--swap=off",
        ])
        .expect("standalone flags parse");
        let Command::Standalone(args) = cli.command else {
            panic!("not standalone");
        };
        assert_eq!(args.dir, PathBuf::from("/etc/genswap/instances"));
        assert_eq!(
            args.node_labels,
            vec![
                ("pool".to_string(), "edge".to_string()),
                ("zone".to_string(), "a".to_string())
            ]
        );
        assert!(!args.host.settings().engine.swaps_on);

        let cli = Cli::try_parse_from([
            "node-agent",
            "run",
            "--node-name",
            "node-a",
            "--no-host-namespaces",
            "--cgroup-root",
            "/sys/fs/cgroup/genswap",
        ])
        .expect("run flags parse");
        assert!(cli.command.host().is_some_and(|h| h.no_host_namespaces));
        let Command::Run(args) = cli.command else {
            panic!("not run");
        };
        assert_eq!(args.kube.node_name, "node-a");
        assert_eq!(
            args.host.cgroup_root,
            Some(PathBuf::from("/sys/fs/cgroup/genswap"))
        );
        Cli::try_parse_from(["node-agent", "demo"]).expect("demo parses");
    }

    #[test]
    fn a_label_must_be_key_equals_value() {
        assert!(parse_label("pool").is_err());
        assert!(parse_label("=x").is_err());
        assert!(parse_label("a=b c").is_err());
        assert_eq!(
            parse_label("topology.kubernetes.io/zone=eu-1a"),
            Ok(("topology.kubernetes.io/zone".into(), "eu-1a".into()))
        );
    }

    #[test]
    fn standalone_needs_a_directory() {
        assert!(Cli::try_parse_from(["node-agent", "standalone"]).is_err());
    }
}
