//! What a new leader learns before it plans: the SwapAttempts the API
//! server holds that its attempt cache has not shown yet.
//!
//! Every replica watches, but under a burst its attempt watch can lag the
//! creates by seconds. A replica that becomes the leader then (after
//! another one, or after its own Lease renewal failed under that load)
//! would plan from a cache without the newest attempts and issue those
//! nodes a second attempt for the same desired state. So at the start of
//! each term it lists the attempts' names from the API server (a quorum
//! read, metadata only, paged) and records each one its cache lacks as an
//! expectation of its owner ([`crate::expectations`]): that IG is planned
//! once the cache shows it, or after the patience. Until the list is in,
//! no IG is planned ([`Leadership::term_seeded`]).
//!
//! What it cannot see: a create the previous leader sent before its Lease
//! ran out that the API server stores only after this list. The Lease's
//! grace (the old leader stops writing that long before its claim ends)
//! is what covers it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use genswap_core::scheduler::{LABEL_INSTANCE, label_value};
use genswap_crds::{InstanceGeneration, SwapAttempt};
use kube::api::{ListParams, PartialObjectMeta};
use kube::{Api, Client, Resource};
use thiserror::Error;
use tracing::{info, warn};

use crate::context::Context;
use crate::leader::Leadership;

/// Names per page of the list: a page stays small at any fleet size.
pub const PAGE: u32 = 500;

/// Why a term's list failed (it is retried).
#[derive(Debug, Error)]
#[error("listing the SwapAttempts at the start of a term failed")]
pub struct SeedError(#[source] pub kube::Error);

/// Seeds each term this replica leads, until the leadership stream ends.
/// Holds the context only while it runs: abort it before waiting for the
/// context to go.
pub async fn seed_each_term(
    client: Client,
    namespace: Option<String>,
    leadership: Leadership,
    ctx: Arc<Context>,
) {
    let api: Api<SwapAttempt> = match &namespace {
        Some(namespace) => Api::namespaced(client, namespace),
        None => Api::all(client),
    };
    let mut acquisitions = std::pin::pin!(leadership.acquisitions());
    while acquisitions.next().await.is_some() {
        let term = leadership.term_number();
        // Listed against a cache that has listed too: what it lacks then is
        // lag, not its first list (which planning waits for anyway).
        ctx.caches.wait_all().await;
        let mut failures = 0u32;
        while leadership.is_leader() && leadership.term_number() == term {
            match seed(&api, &ctx, Instant::now()).await {
                Ok(unseen) => {
                    info!(term, unseen, "term seeded: planning may begin");
                    leadership.mark_seeded(term);
                    break;
                }
                Err(error) => {
                    failures = failures.saturating_add(1);
                    let delay = crate::reconciler::backoff_delay(failures);
                    warn!(%error, source = %error.0, retry_in = ?delay, "no plan until the attempts are listed");
                    tokio::time::sleep(delay.min(MAX_RETRY)).await;
                }
            }
        }
    }
}

/// A term waits at most this long between two tries of its list.
const MAX_RETRY: Duration = Duration::from_secs(10);

/// Lists every attempt's name and records those the cache lacks as
/// expectations of their owners, seen at `now`. Returns how many.
pub async fn seed(api: &Api<SwapAttempt>, ctx: &Context, now: Instant) -> Result<usize, SeedError> {
    let mut params = ListParams::default().labels(LABEL_INSTANCE).limit(PAGE);
    let mut unseen = 0;
    loop {
        let page = api.list_metadata(&params).await.map_err(SeedError)?;
        for item in &page.items {
            if let Some((ig, name)) = owner_and_name(item)
                && !ctx.attempts.contains(&ig.0, name)
            {
                ctx.expectations.created(&ig, name, now);
                unseen += 1;
            }
        }
        match page.metadata.continue_.filter(|token| !token.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(unseen),
        }
    }
}

/// Which of `names`, attempts of the InstanceGeneration `ig_name`, the API
/// server holds: a quorum list of that IG's attempts' names, metadata only,
/// paged. Asked when the cache has not shown an expected attempt for a
/// whole patience, so that a watch running minutes behind under load is
/// waited for instead of planned around.
pub async fn stored_among(
    api: &Api<SwapAttempt>,
    ig_name: &str,
    names: &[String],
) -> Result<Vec<String>, kube::Error> {
    let selector = format!("{LABEL_INSTANCE}={}", label_value(ig_name));
    let mut params = ListParams::default().labels(&selector).limit(PAGE);
    let mut stored = Vec::new();
    loop {
        let page = api.list_metadata(&params).await?;
        stored.extend(
            page.items
                .iter()
                .filter_map(|item| item.metadata.name.as_ref())
                .filter(|name| names.contains(name))
                .cloned(),
        );
        match page.metadata.continue_.filter(|token| !token.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(stored),
        }
    }
}

/// The (namespace, InstanceGeneration) that owns an attempt, and its name.
fn owner_and_name(item: &PartialObjectMeta<SwapAttempt>) -> Option<((String, String), &str)> {
    let meta = &item.metadata;
    let kind = InstanceGeneration::kind(&());
    let owner = meta
        .owner_references
        .as_ref()?
        .iter()
        .find(|owner| owner.kind == kind && owner.controller == Some(true))?;
    Some((
        (meta.namespace.clone()?, owner.name.clone()),
        meta.name.as_deref()?,
    ))
}
