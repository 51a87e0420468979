//! Leader election on a `coordination.k8s.io` Lease.
//!
//! Every replica watches and plans; only the one holding the Lease writes.
//! [`Leadership`] is the flag the writer checks right before each write, so a
//! replica that loses the Lease stops writing at the next request it would
//! have sent, not at the next reconcile.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::watcher;
use kube::{Api, Client};
use kube_lease_manager::{LeaseCreateMode, LeaseManager, LeaseManagerError, LeaseParams};
use thiserror::Error;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::metrics::Metrics;
use genswap_runtime::watch_backoff::reconnecting;

/// Whether this replica may write, shared by the lease task and the reconciler.
#[derive(Clone, Debug)]
pub struct Leadership {
    state: Arc<watch::Sender<bool>>,
    term: Arc<Mutex<Term>>,
    metrics: Arc<Metrics>,
}

/// One stretch of holding the Lease, and whether this replica has learned
/// what its caches may lack from the one before ([`crate::term`]).
#[derive(Debug, Default)]
struct Term {
    number: u64,
    seeded: bool,
    /// Terms must be seeded before planning: off unless the controller runs
    /// the seeding task ([`Leadership::require_seeding`]).
    required: bool,
}

impl Leadership {
    /// A replica that does not hold the Lease (yet).
    pub fn follower(metrics: Arc<Metrics>) -> Self {
        metrics.set_leader(false);
        Self {
            state: Arc::new(watch::Sender::new(false)),
            term: Arc::default(),
            metrics,
        }
    }

    /// Whether this replica holds the Lease now.
    pub fn is_leader(&self) -> bool {
        *self.state.borrow()
    }

    /// Records a change of leadership (the lease task calls this). Becoming
    /// the leader starts a term that is not seeded yet; it is marked so
    /// before any reconcile can see this replica lead.
    pub fn set(&self, leader: bool) {
        if leader && !self.is_leader() {
            let mut term = self.term();
            term.number += 1;
            term.seeded = false;
        }
        let was = self.state.send_replace(leader);
        self.metrics.set_leader(leader);
        if was != leader {
            info!(leader, "leadership changed");
        }
    }

    /// From now on each term must be seeded ([`Leadership::mark_seeded`])
    /// before this replica plans, the current one included.
    pub fn require_seeding(&self) {
        let mut term = self.term();
        term.required = true;
        term.seeded = false;
    }

    /// The current term's number: it grows each time this replica becomes
    /// the leader.
    pub fn term_number(&self) -> u64 {
        self.term().number
    }

    /// Whether planning may begin in this term: it is seeded, or seeding is
    /// not required.
    pub fn term_seeded(&self) -> bool {
        let term = self.term();
        term.seeded || !term.required
    }

    /// Marks term `number` seeded, unless a newer term began meanwhile.
    pub fn mark_seeded(&self, number: u64) {
        let mut term = self.term();
        if term.number == number {
            term.seeded = true;
        }
    }

    fn term(&self) -> std::sync::MutexGuard<'_, Term> {
        self.term.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Resolves once this replica leads (`true`) or follows (`false`), at
    /// once when it already does.
    pub async fn until(&self, leading: bool) {
        let mut receiver = self.state.subscribe();
        // The sender lives in `self`, so the wait cannot end in an error.
        let _ = receiver.wait_for(|leader| *leader == leading).await;
    }

    /// Yields once each time this replica becomes the leader, so the
    /// controller can re-plan everything it skipped as a follower; and once
    /// at once if it already leads when subscribing, since the lease task
    /// may win before the controller subscribes.
    pub fn acquisitions(&self) -> impl Stream<Item = ()> + Send + 'static {
        let mut receiver = self.state.subscribe();
        if *receiver.borrow() {
            receiver.mark_changed();
        }
        futures::stream::unfold(receiver, |mut receiver| async move {
            loop {
                receiver.changed().await.ok()?;
                if *receiver.borrow_and_update() {
                    return Some(((), receiver));
                }
            }
        })
    }
}

/// Where and how to hold the Lease.
#[derive(Clone, Debug)]
pub struct LeaseSettings {
    pub name: String,
    pub namespace: String,
    /// Unique among the replicas (the pod name in a cluster).
    pub identity: String,
    /// How long a holder's claim lasts without renewal.
    pub duration_seconds: u64,
    /// The holder renews this long before its claim expires.
    pub grace_seconds: u64,
}

/// Why the Lease settings were refused.
#[derive(Debug, Error)]
pub enum LeaseError {
    #[error(
        "lease grace ({grace}s) must be at least 1s and shorter than the lease duration ({duration}s)"
    )]
    BadTiming { duration: u64, grace: u64 },
}

/// How long to wait before building a new manager after a Lease error.
const RETRY_AFTER_ERROR: Duration = Duration::from_secs(2);

impl LeaseSettings {
    /// Refuses timings `LeaseParams` would panic on.
    pub fn validate(&self) -> Result<(), LeaseError> {
        validate_timing(self.duration_seconds, self.grace_seconds)
    }
}

/// Refuses a grace of zero or one not shorter than the duration.
pub fn validate_timing(duration_seconds: u64, grace_seconds: u64) -> Result<(), LeaseError> {
    if grace_seconds == 0 || grace_seconds >= duration_seconds {
        return Err(LeaseError::BadTiming {
            duration: duration_seconds,
            grace: grace_seconds,
        });
    }
    Ok(())
}

/// Holds the Lease until `shutdown` resolves, keeping `leadership` current.
///
/// Any Lease error steps down at once: the replica can no longer prove it
/// holds the Lease, so it must stop writing. A fresh manager re-reads the
/// Lease and reports leadership again if it is still ours. `client` should
/// time out requests well inside the grace period, so a renewal that hangs
/// surfaces as an error before the claim expires; `watch_client` must not
/// (a watch is one long request: under `client`'s timeout it would end
/// every few seconds and be opened again, for nothing).
///
/// On shutdown it steps down first and releases the Lease after, so no write
/// can follow the release.
///
/// A follower also watches the Lease: kube-lease-manager sleeps until the
/// expiry it last read, so a Lease released by a leader that shut down
/// would otherwise sit free for up to a lease duration. Seeing it free, the
/// follower reads it again and takes it at once.
pub async fn hold_lease(
    client: Client,
    watch_client: Client,
    settings: LeaseSettings,
    leadership: Leadership,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), LeaseError> {
    settings.validate()?;
    tokio::pin!(shutdown);
    let mut released = Box::pin(releases(&watch_client, &settings));
    loop {
        let manager = tokio::select! {
            () = &mut shutdown => return Ok(()),
            built = build_manager(&client, &settings) => built,
        };
        let manager = match manager {
            Ok(manager) => manager,
            Err(error) => {
                warn!(%error, lease = %settings.name, "cannot read the leader Lease; retrying");
                tokio::select! {
                    () = &mut shutdown => return Ok(()),
                    () = tokio::time::sleep(RETRY_AFTER_ERROR) => continue,
                }
            }
        };
        let freed = loop {
            tokio::select! {
                () = &mut shutdown => {
                    leadership.set(false);
                    if let Err(error) = manager.release().await {
                        warn!(%error, "releasing the leader Lease failed; it expires on its own");
                    }
                    return Ok(());
                }
                changed = manager.changed() => match changed {
                    Ok(leader) => leadership.set(leader),
                    Err(error) => {
                        leadership.set(false);
                        warn!(%error, "leader Lease error; stepped down");
                        break false;
                    }
                },
                Some(()) = released.next(), if !leadership.is_leader() => break true,
            }
        };
        if freed {
            info!(lease = %settings.name, "the leader Lease was released; campaigning now");
            continue;
        }
        // Best effort: if the Lease is still ours, free it for the other
        // replica rather than make it wait for expiry.
        let _ = manager.release().await;
        tokio::select! {
            () = &mut shutdown => return Ok(()),
            () = tokio::time::sleep(RETRY_AFTER_ERROR) => {}
        }
    }
}

/// Yields each time the Lease is seen with no holder (released, or deleted).
fn releases(client: &Client, settings: &LeaseSettings) -> impl Stream<Item = ()> + Send + 'static {
    let api: Api<Lease> = Api::namespaced(client.clone(), &settings.namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={}", settings.name));
    reconnecting(watcher(api, config)).filter_map(|event| async move {
        match event {
            Ok(watcher::Event::Apply(lease) | watcher::Event::InitApply(lease)) => {
                is_free(&lease).then_some(())
            }
            Ok(watcher::Event::Delete(_)) => Some(()),
            Ok(watcher::Event::Init | watcher::Event::InitDone) => None,
            Err(error) => {
                debug!(%error, "watching the leader Lease failed; retrying with backoff");
                None
            }
        }
    })
}

fn is_free(lease: &Lease) -> bool {
    lease
        .spec
        .as_ref()
        .and_then(|spec| spec.holder_identity.as_deref())
        .is_none_or(str::is_empty)
}

async fn build_manager(
    client: &Client,
    settings: &LeaseSettings,
) -> Result<LeaseManager, LeaseManagerError> {
    let params = LeaseParams::new(
        settings.identity.clone(),
        settings.duration_seconds,
        settings.grace_seconds,
    );
    LeaseManager::new(
        client.clone(),
        settings.name.clone(),
        settings.namespace.clone(),
        params,
        LeaseCreateMode::AutoCreate,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    #[tokio::test]
    async fn acquisitions_yield_only_on_becoming_leader() {
        let leadership = Leadership::follower(Arc::new(Metrics::new()));
        let mut acquisitions = Box::pin(leadership.acquisitions());
        leadership.set(false);
        leadership.set(true);
        tokio::time::timeout(Duration::from_secs(10), acquisitions.next())
            .await
            .expect("an acquisition within the deadline")
            .expect("stream open");
        assert!(leadership.is_leader());
        leadership.set(false);
        leadership.set(true);
        tokio::time::timeout(Duration::from_secs(10), acquisitions.next())
            .await
            .expect("a second acquisition within the deadline")
            .expect("stream open");
    }

    #[tokio::test]
    async fn an_acquisition_before_subscribing_is_not_lost() {
        let leadership = Leadership::follower(Arc::new(Metrics::new()));
        leadership.set(true);
        let mut acquisitions = Box::pin(leadership.acquisitions());
        tokio::time::timeout(Duration::from_secs(10), acquisitions.next())
            .await
            .expect("the standing leadership yields within the deadline")
            .expect("stream open");
    }

    #[test]
    fn refuses_grace_not_shorter_than_duration() {
        let settings = LeaseSettings {
            name: "l".into(),
            namespace: "n".into(),
            identity: "i".into(),
            duration_seconds: 5,
            grace_seconds: 5,
        };
        assert!(matches!(
            settings.validate(),
            Err(LeaseError::BadTiming { .. })
        ));
    }
}
