//! genswap cluster controller binary: flags, clients, the metrics server,
//! the lease task and the Controller, shut down in that order's reverse.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use genswap_controller::cli::{self, Args, SetupError, WRITE_TIMEOUT};
use genswap_controller::leader::{self, Leadership, LeaseError, LeaseSettings};
use genswap_controller::metrics::Metrics;
use genswap_controller::run::{self, Settings};
use genswap_controller::shutdown;
use genswap_runtime::http::{self, HttpError, Readiness};
use kube::Client;
use thiserror::Error;
use tracing::{error, info};

mod allocator;

#[derive(Debug, Error)]
enum MainError {
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error("cannot build a Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error(transparent)]
    Http(#[from] HttpError),
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(error) = cli::init_tracing(args.log_format) {
        eprintln!("genswap-controller: {error}");
        return ExitCode::FAILURE;
    }
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            error!(%error, "genswap-controller failed");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), MainError> {
    leader::validate_timing(args.lease_duration_seconds, args.lease_grace_seconds)?;
    let config = args.kube_config().await?;
    let lease_settings = LeaseSettings {
        name: args.lease_name.clone(),
        namespace: args
            .lease_namespace
            .clone()
            .filter(|ns| !ns.is_empty())
            .unwrap_or_else(|| config.default_namespace.clone()),
        identity: args.identity(),
        duration_seconds: args.lease_duration_seconds,
        grace_seconds: args.lease_grace_seconds,
    };
    // A renewal must fail before the claim expires, so a leader cut off from
    // the API server steps down before anyone else can take over.
    let lease_timeout = Duration::from_secs(lease_settings.grace_seconds.saturating_sub(1).max(1));
    let lease_client = client(cli::with_request_timeout(config.clone(), lease_timeout))?;
    let write_client = client(cli::with_request_timeout(config.clone(), WRITE_TIMEOUT))?;
    let watch_client = client(config)?;

    let metrics = Arc::new(Metrics::new().with_heap(allocator::usage));
    let leadership = Leadership::follower(metrics.clone());
    let readiness = Readiness::default();

    let listener = http::bind(args.metrics_addr).await?;
    match listener.local_addr() {
        Ok(addr) => info!(%addr, "serving /metrics, /healthz, /readyz"),
        Err(_) => info!(addr = %args.metrics_addr, "serving /metrics, /healthz, /readyz"),
    }
    let (stop_http, http_stopped) = shutdown::channel();
    let server = tokio::spawn(http::serve(
        listener,
        http::router(metrics.clone(), readiness.clone()),
        http_stopped.wait(),
    ));

    let (stop_lease, lease_stopped) = shutdown::channel();
    let lease = tokio::spawn(leader::hold_lease(
        lease_client,
        watch_client.clone(),
        lease_settings.clone(),
        leadership.clone(),
        lease_stopped.wait(),
    ));
    info!(lease = %lease_settings.name, namespace = %lease_settings.namespace,
          identity = %lease_settings.identity, "campaigning for leadership");

    let (stop_controller, controller_stopped) = shutdown::channel();
    tokio::spawn(async move {
        shutdown::os_signal().await;
        stop_controller.fire();
    });
    run::run_controller(
        watch_client,
        write_client,
        Settings {
            namespace: args.namespace_scope().map(str::to_string),
            identity: lease_settings.identity.clone(),
            concurrency: args.concurrency,
            event_window: args.event_window(),
            progress_hold: args.progress_hold(),
            inbox_namespace: Some(lease_settings.namespace.clone()),
            prometheus: args.prometheus()?,
        },
        metrics,
        leadership,
        readiness,
        controller_stopped.wait(),
    )
    .await;

    // In-flight reconciles are done: step down and free the Lease for the
    // other replica, then stop answering probes.
    stop_lease.fire();
    match lease.await {
        Ok(Ok(())) => info!("leader Lease released"),
        Ok(Err(error)) => error!(%error, "lease task failed"),
        Err(error) => error!(%error, "lease task panicked"),
    }
    stop_http.fire();
    match server.await {
        Ok(result) => result?,
        Err(error) => error!(%error, "metrics server panicked"),
    }
    Ok(())
}

fn client(config: kube::Config) -> Result<Client, MainError> {
    Client::try_from(config).map_err(MainError::Client)
}
