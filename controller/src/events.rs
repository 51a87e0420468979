//! Events recorded off the reconcile's critical path, folded per object.
//!
//! Events were 46 % of the controller's writes, sent one after another
//! inside the reconcile at 100-300 ms each on a busy API server. A reconcile
//! now queues its Events and returns; one task per replica folds them
//! ([`crate::event_fold`]: an object's Normal Events of one window become
//! one Event, a Warning goes at once) and writes them, a few at a time,
//! started in the order they are due. A replica that is not the leader when
//! an Event's turn comes drops it: only the leader writes. When the queue
//! is full an Event is dropped and counted, never waited for.
//!
//! The Events are created directly (events.k8s.io/v1) rather than through
//! kube-runtime's `Recorder`: a folded Event carries the time its first
//! entry happened and a series of its own, which `Recorder` cannot set, and
//! `Recorder` turns a repeated reason into a patch of one object per
//! repeat, a write each.
//!
//! When the last queue handle is dropped the task sends what is still
//! folding at once and ends; [`EventSender::finish`] waits for that.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};
use kube::runtime::events::Reporter;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{info, warn};

pub use crate::event_fold::Queued;
use crate::event_fold::{Folded, Folds, Stamped};
use crate::leader::Leadership;
use crate::metrics::Metrics;

/// The `action` of every Event the controller records.
pub const EVENT_ACTION: &str = "Reconcile";

/// Events waiting to be folded; beyond this they are dropped.
pub const QUEUE_CAPACITY: usize = 4096;

/// How long an object's Normal Events are held to go out as one, unless
/// `--event-window-seconds` says otherwise.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(10);

/// Events written at once. One at a time, at 100 ms per write, a burst of
/// 200 IGs took two minutes to drain.
const IN_FLIGHT: usize = 16;

/// Where a reconcile puts its Events.
#[derive(Clone, Debug)]
pub struct EventQueue {
    tx: mpsc::Sender<Stamped>,
}

/// The task that folds and writes the queued Events.
#[derive(Debug)]
pub struct EventSender {
    task: JoinHandle<()>,
}

/// Who writes the Events, and as whom.
struct Sink {
    client: Client,
    reporter: Reporter,
    leadership: Leadership,
    metrics: Arc<Metrics>,
}

impl EventQueue {
    /// Starts the task that folds over `window` and writes (needs a tokio
    /// runtime).
    pub fn start(
        client: Client,
        reporter: Reporter,
        leadership: Leadership,
        metrics: Arc<Metrics>,
        window: Duration,
    ) -> (EventQueue, EventSender) {
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let sink = Sink {
            client,
            reporter,
            leadership,
            metrics,
        };
        let task = tokio::spawn(send_all(rx, sink, Folds::new(window)));
        (EventQueue { tx }, EventSender { task })
    }

    /// Queues `event`, stamped now; `false` when the queue was full and it
    /// was dropped.
    pub fn record(&self, event: Queued) -> bool {
        let stamped = Stamped {
            event,
            at: Timestamp::now(),
        };
        self.tx.try_send(stamped).is_ok()
    }
}

impl EventSender {
    /// Once every [`EventQueue`] handle is gone: waits, at most `limit`,
    /// for what was queued to be written.
    pub async fn finish(self, limit: Duration) {
        let abort = self.task.abort_handle();
        match tokio::time::timeout(limit, self.task).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => warn!(%error, "the Event sender failed"),
            Err(_) => {
                abort.abort();
                warn!(?limit, "Events still unsent at shutdown were dropped");
            }
        }
    }
}

async fn send_all(mut rx: mpsc::Receiver<Stamped>, sink: Sink, mut folds: Folds) {
    let mut ready: VecDeque<Folded> = VecDeque::new();
    let mut in_flight = FuturesUnordered::new();
    let mut receiving = true;
    let mut names = EventNames::default();
    loop {
        while in_flight.len() < IN_FLIGHT
            && let Some(folded) = ready.pop_front()
        {
            let name = names.next(&folded);
            in_flight.push(sink.write(folded, name));
        }
        if !receiving && ready.is_empty() && in_flight.is_empty() && folds.is_empty() {
            return;
        }
        let due = folds.next_due();
        tokio::select! {
            received = rx.recv(), if receiving && ready.len() < QUEUE_CAPACITY => match received {
                Some(stamped) => ready.extend(folds.push(stamped, Instant::now())),
                None => {
                    receiving = false;
                    ready.extend(folds.drain());
                }
            },
            () = sleep_until(due), if due.is_some() => ready.extend(folds.due(Instant::now())),
            Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
        }
    }
}

async fn sleep_until(due: Option<Instant>) {
    match due {
        Some(due) => tokio::time::sleep_until(due).await,
        None => std::future::pending().await,
    }
}

impl Sink {
    async fn write(&self, folded: Folded, name: String) {
        if !self.leadership.is_leader() {
            info!(reason = %folded.reason, count = folded.count, "not the leader any more; dropping a queued Event");
            return;
        }
        let namespace = folded
            .regarding
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_string());
        let event = self.event(folded, name);
        let events: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        if let Err(error) = events.create(&PostParams::default(), &event).await {
            self.metrics.reconcile_failed("event");
            warn!(
                object = event.regarding.as_ref().and_then(|r| r.name.as_deref()).unwrap_or_default(),
                reason = event.reason.as_deref().unwrap_or_default(),
                %error,
                "recording an Event failed"
            );
        }
    }

    fn event(&self, folded: Folded, name: String) -> Event {
        let instance = self
            .reporter
            .instance
            .as_deref()
            .unwrap_or(&self.reporter.controller);
        Event {
            metadata: ObjectMeta {
                name: Some(name),
                namespace: folded.regarding.namespace.clone(),
                ..ObjectMeta::default()
            },
            action: Some(EVENT_ACTION.to_string()),
            reason: Some(folded.reason),
            note: Some(folded.note),
            type_: Some(if folded.warning { "Warning" } else { "Normal" }.to_string()),
            event_time: Some(MicroTime(folded.first)),
            // The API server wants a series of at least two.
            series: (folded.count >= 2).then(|| EventSeries {
                count: i32::try_from(folded.count).unwrap_or(i32::MAX),
                last_observed_time: MicroTime(folded.last),
            }),
            regarding: Some(folded.regarding),
            reporting_controller: Some(self.reporter.controller.clone()),
            reporting_instance: Some(cut(instance, MAX_INSTANCE_BYTES).to_string()),
            ..Event::default()
        }
    }
}

/// The longest object name an Event's name is made of: a name is at most
/// 253 bytes, and the dot and the time take up to 33.
const NAME_PREFIX_BYTES: usize = 220;

/// The API server refuses a longer `reportingInstance`; an identity is
/// cut to it rather than lose every Event.
const MAX_INSTANCE_BYTES: usize = 128;

/// `text` cut to at most `max_bytes`, on a char boundary.
fn cut(text: &str, max_bytes: usize) -> &str {
    let mut end = text.len().min(max_bytes);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Event names as client-go and kube-runtime make them (the object's name
/// and a time in hex), kept distinct within this replica even when two are
/// made in the same nanosecond.
#[derive(Default)]
struct EventNames {
    last: i128,
}

impl EventNames {
    fn next(&mut self, folded: &Folded) -> String {
        let nanos = Timestamp::now().as_nanosecond().max(self.last + 1);
        self.last = nanos;
        let object = folded.regarding.name.as_deref().unwrap_or("genswap");
        format!("{}.{nanos:x}", name_prefix(object))
    }
}

/// `object` cut to [`NAME_PREFIX_BYTES`], still ending in a letter or digit
/// as a DNS subdomain must.
fn name_prefix(object: &str) -> &str {
    let kept =
        cut(object, NAME_PREFIX_BYTES).trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
    if kept.is_empty() { "genswap" } else { kept }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_names_stay_valid_and_distinct() {
        let folded = |name: &str| Folded {
            warning: false,
            reason: "SwapDone".into(),
            note: String::new(),
            regarding: k8s_openapi::api::core::v1::ObjectReference {
                name: Some(name.into()),
                ..Default::default()
            },
            first: Timestamp::UNIX_EPOCH,
            last: Timestamp::UNIX_EPOCH,
            count: 1,
        };
        let mut names = EventNames::default();
        let a = names.next(&folded("web"));
        let b = names.next(&folded("web"));
        assert_ne!(a, b);
        assert!(a.starts_with("web."), "{a}");
        let long = format!("{}.{}", "a".repeat(219), "b".repeat(33));
        let name = names.next(&folded(&long));
        assert!(name.len() <= 253, "{}", name.len());
        assert!(
            name.starts_with(&"a".repeat(219)),
            "cut before the dot: {name}"
        );
        assert!(!name.contains(".."), "{name}");
    }
}
