//! The kube-runtime wiring: one watch per resource, each feeding both a
//! cache the reconciler reads and the triggers that wake it.
//!
//! - InstanceGenerations: the Controller's trigger stream and store.
//! - SwapAttempts (label [`LABEL_INSTANCE`]): a reflector whose events map to
//!   their owner IG (`owns`), so an agent's outcome re-plans its IG.
//! - Nodes: a reflector of trimmed Nodes; a label change, add or delete
//!   re-plans the IGs selecting the Node before or after it.
//! - Becoming the leader re-plans every IG.
//! - The same SwapAttempt events keep the per-node inboxes
//!   ([`crate::inbox`]), written while this replica leads.
//!
//! Sharing one watch between cache and trigger means the reconcile an event
//! wakes already sees that event in the cache. Each stream also reports its
//! first full list to [`CacheSync`], which gates planning and `/readyz`.

use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt, TryStreamExt};
use genswap_crds::SwapAttempt;
use k8s_openapi::api::core::v1::Node;
use kube::core::DeserializeGuard;
use kube::runtime::controller::{self, Controller};
use kube::runtime::events::Reporter;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tracing::{debug, info, warn};

use crate::attempt_index::AttemptIndex;
use crate::cache_sync::{Cache, CacheSync};
use crate::cli::WRITE_TIMEOUT;
use crate::context::Context;
use crate::events::EventQueue;
use crate::inbox::{InboxIndex, Scope, keep_inboxes};
use crate::leader::Leadership;
use crate::metrics::Metrics;
use crate::node_index::{NodeLabelIndex, affected};
use crate::observe::WatchedIg;
use crate::observe::{trim_instance_generation, trim_node};
use crate::reconciler::{error_policy, reconcile};
use genswap_core::scheduler::LABEL_INSTANCE;
use genswap_runtime::http::Readiness;
use genswap_runtime::prometheus::Prometheus;
use genswap_runtime::watch_backoff::{reconnecting, watch_backoff};

/// The name this controller records Events under.
pub const CONTROLLER_NAME: &str = "genswap-controller";

/// What [`run_controller`] needs besides the clients.
pub struct Settings {
    /// One namespace, or every namespace when `None`.
    pub namespace: Option<String>,
    /// This replica's identity (in Events).
    pub identity: String,
    /// InstanceGenerations reconciled at once.
    pub concurrency: u16,
    /// How long an IG's Normal Events are held to go out as one Event
    /// ([`crate::event_fold`]); zero writes each alone at once.
    pub event_window: Duration,
    /// How long a status write that only records progress may be put off
    /// ([`crate::context::PROGRESS_HOLD`]); zero writes every one at once.
    pub progress_hold: Duration,
    /// Where the per-node inboxes are kept ([`crate::inbox`]); none are
    /// written when `None`.
    pub inbox_namespace: Option<String>,
    /// The Prometheus `rollout.analysis` asks; without one every
    /// measurement is inconclusive.
    pub prometheus: Option<Prometheus>,
}

/// Runs the controller until `shutdown` resolves, in-flight reconciles
/// finish and the queued Events are written. `watch_client` serves the
/// watches (no request timeout); `write_client` the reconciler's writes
/// (bounded requests).
pub async fn run_controller(
    watch_client: Client,
    write_client: Client,
    settings: Settings,
    metrics: Arc<Metrics>,
    leadership: Leadership,
    readiness: Readiness,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let igs: Api<WatchedIg> = scoped(&watch_client, settings.namespace.as_deref());
    let attempts: Api<DeserializeGuard<SwapAttempt>> =
        scoped(&watch_client, settings.namespace.as_deref());
    let nodes: Api<Node> = Api::all(watch_client.clone());
    let caches = CacheSync::new();

    let (ig_store, ig_writer) = reflector::store();
    let ig_events = reconnecting(watcher(igs, watcher::Config::default()))
        .modify(|guard: &mut WatchedIg| {
            if let Ok(ig) = guard.0.as_mut() {
                trim_instance_generation(ig);
            }
        })
        .reflect(ig_writer);
    let ig_events = without_errors(
        "InstanceGeneration",
        caches
            .track(Cache::InstanceGenerations, ig_events)
            .applied_objects(),
    );

    // The index is the attempts' cache (no reflector store): it sees each
    // event before the reconcile it triggers is queued.
    let attempt_index = AttemptIndex::new();
    let indexed = attempt_index.clone();
    let inbox_index = InboxIndex::new();
    let inboxed = inbox_index.clone();
    let cache_metrics = metrics.clone();
    let attempt_events = reconnecting(watcher(
        attempts,
        watcher::Config::default().labels(LABEL_INSTANCE),
    ))
    .inspect_ok(move |event| {
        indexed.observe(event);
        inboxed.observe(event);
        cache_metrics.set_attempts_cached(indexed.len());
    });
    let attempt_events = without_errors(
        "SwapAttempt",
        caches
            .track(Cache::SwapAttempts, attempt_events)
            .touched_objects(),
    );

    let (node_store, node_writer) = reflector::store();
    let node_events = reconnecting(watcher(nodes, watcher::Config::default()))
        .modify(trim_node)
        .reflect(node_writer);
    let node_events = caches.track(Cache::Nodes, node_events);

    let controller = Controller::for_stream(ig_events, ig_store.clone())
        .with_config(controller::Config::default().concurrency(settings.concurrency))
        // Unused while the streams carry no errors; bounded all the same.
        .trigger_backoff(watch_backoff());
    tokio::spawn(mark_ready_when_synced(readiness, caches.clone()));
    let inboxes = settings.inbox_namespace.map(|namespace| {
        tokio::spawn(keep_inboxes(
            write_client.clone(),
            namespace,
            Scope(settings.namespace.clone()),
            inbox_index,
            leadership.clone(),
        ))
    });

    let reporter = Reporter {
        controller: CONTROLLER_NAME.to_string(),
        instance: Some(settings.identity),
    };
    let (events, event_sender) = EventQueue::start(
        write_client.clone(),
        reporter,
        leadership.clone(),
        metrics.clone(),
        settings.event_window,
    );
    let ctx = Arc::new(
        Context::new(
            write_client,
            metrics,
            leadership.clone(),
            events,
            attempt_index,
            node_store,
            caches,
        )
        .with_progress_hold(settings.progress_hold)
        .with_prometheus(settings.prometheus),
    );

    // Before the first reconcile can see this replica lead.
    leadership.require_seeding();
    let seeding = tokio::spawn(crate::term::seed_each_term(
        ctx.client.clone(),
        settings.namespace.clone(),
        leadership.clone(),
        ctx.clone(),
    ));

    info!(
        namespace = settings.namespace.as_deref().unwrap_or("<all>"),
        "controller starting"
    );
    controller
        .owns_stream(attempt_events)
        .reconcile_on(node_triggers(node_events, ig_store))
        .reconcile_all_on(leadership.acquisitions())
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            match result {
                Ok((object, _)) => debug!(%object, "reconciled"),
                // Logged and counted by error_policy.
                Err(controller::Error::ReconcilerFailed(..)) => {}
                Err(controller::Error::ObjectNotFound(object)) => {
                    debug!(%object, "gone before its reconcile")
                }
                Err(error) => warn!(%error, "controller error"),
            }
        })
        .await;
    // The seeding task's context goes with it.
    seeding.abort();
    let _ = seeding.await;
    // The Context, and with it the last queue handle, went with the
    // Controller: what is still folding is written now, while this replica
    // still holds the Lease.
    event_sender.finish(WRITE_TIMEOUT).await;
    if let Some(inboxes) = inboxes {
        // Level-triggered: the next leader writes whatever this one left.
        inboxes.abort();
    }
    info!("controller stopped");
}

fn scoped<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(namespace) => Api::namespaced(client.clone(), namespace),
        None => Api::all(client.clone()),
    }
}

/// Logs and drops a watch's errors. The watch has already slept its own
/// backoff; an error reaching the Controller would make it back off every
/// trigger stream again, with kube-runtime's default of up to a minute.
fn without_errors<K: Send + 'static>(
    watched: &'static str,
    events: impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
) -> impl Stream<Item = Result<K, watcher::Error>> + Send + 'static {
    events.filter(move |event| {
        if let Err(error) = event {
            warn!(%error, watched, "watch error; retrying with backoff");
        }
        futures::future::ready(event.is_ok())
    })
}

/// Maps Node watch events to the IGs they concern (see [`crate::node_index`]).
fn node_triggers(
    events: impl Stream<Item = Result<watcher::Event<Node>, watcher::Error>> + Send + 'static,
    igs: Store<WatchedIg>,
) -> impl Stream<Item = ObjectRef<WatchedIg>> + Send + 'static {
    let mut index = NodeLabelIndex::default();
    events
        .filter_map(|event| async move {
            match event {
                Ok(event) => Some(event),
                Err(error) => {
                    warn!(%error, "Node watch error; retrying with backoff");
                    None
                }
            }
        })
        .flat_map(move |event| {
            let changes = index.observe(&event);
            futures::stream::iter(affected(&changes, &igs))
        })
}

async fn mark_ready_when_synced(readiness: Readiness, caches: CacheSync) {
    caches.wait_all().await;
    info!("watch caches synced");
    readiness.set_ready();
}
