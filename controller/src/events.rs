//! Events recorded off the reconcile's critical path.
//!
//! Events were 46 % of the controller's writes, sent one after another
//! inside the reconcile at 100-300 ms each on a busy API server, so a burst
//! of InstanceGenerations waited on them for its work-queue slots. A
//! reconcile now queues its Events and returns; one task per controller
//! starts sending them in the order queued, a few at a time (their times
//! keep that order: an attempt issued comes before its outcome). A replica that is not the leader when
//! an Event's turn comes drops it: only the leader writes. When the queue is
//! full an Event is dropped and counted, never waited for.
//!
//! The task ends, and drops its client, when the last queue handle does.

use futures::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use std::sync::Arc;
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::leader::Leadership;
use crate::metrics::Metrics;

/// The `action` of every Event the controller records.
pub const EVENT_ACTION: &str = "Reconcile";

/// events.k8s.io/v1 refuses notes longer than this many bytes.
const MAX_NOTE_BYTES: usize = 1024;

/// Events waiting to be sent; beyond this they are dropped.
pub const QUEUE_CAPACITY: usize = 4096;

/// Events sent at once. One at a time, at 100 ms per write, a burst of 200
/// IGs (about 1,200 Events) took two minutes to drain; they are started in
/// queue order, so their times keep that order.
const IN_FLIGHT: usize = 16;

/// One Event to send.
#[derive(Clone, Debug)]
pub struct Queued {
    pub warning: bool,
    pub reason: String,
    pub note: String,
    pub regarding: ObjectReference,
}

/// Where a reconcile puts its Events.
#[derive(Clone, Debug)]
pub struct EventQueue {
    tx: mpsc::Sender<Queued>,
}

impl EventQueue {
    /// Starts the sending task (needs a tokio runtime).
    pub fn start(
        client: Client,
        reporter: Reporter,
        leadership: Leadership,
        metrics: Arc<Metrics>,
    ) -> EventQueue {
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        tokio::spawn(send_all(rx, client, reporter, leadership, metrics));
        EventQueue { tx }
    }

    /// Queues `event`; `false` when the queue was full and it was dropped.
    pub fn record(&self, event: Queued) -> bool {
        self.tx.try_send(event).is_ok()
    }
}

async fn send_all(
    mut rx: mpsc::Receiver<Queued>,
    client: Client,
    reporter: Reporter,
    leadership: Leadership,
    metrics: Arc<Metrics>,
) {
    let queued = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
    queued
        .map(|queued| send_one(queued, &client, &reporter, &leadership, &metrics))
        .buffered(IN_FLIGHT)
        .for_each(|()| async {})
        .await;
}

async fn send_one(
    queued: Queued,
    client: &Client,
    reporter: &Reporter,
    leadership: &Leadership,
    metrics: &Metrics,
) {
    if !leadership.is_leader() {
        info!(reason = %queued.reason, "not the leader any more; dropping a queued Event");
        return;
    }
    // A fresh Recorder per Event: the shared one folds Events with the
    // same reason into a series that keeps only the first note, and each
    // attempt issued or outcome seen has its own message.
    let recorder = Recorder::new(client.clone(), reporter.clone());
    let event = Event {
        type_: if queued.warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: queued.reason.clone(),
        note: Some(truncate(&queued.note, MAX_NOTE_BYTES)),
        action: EVENT_ACTION.to_string(),
        secondary: None,
    };
    if let Err(error) = recorder.publish(&event, &queued.regarding).await {
        metrics.reconcile_failed("event");
        warn!(
            object = queued.regarding.name.as_deref().unwrap_or_default(),
            reason = %queued.reason,
            %error,
            "recording an Event failed"
        );
    }
}

fn truncate(text: &str, max_bytes: usize) -> String {
    if text.len() <= max_bytes {
        return text.to_string();
    }
    let mut end = max_bytes.saturating_sub('…'.len_utf8());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncates_long_notes_on_a_char_boundary() {
        let long = "é".repeat(2000);
        let short = truncate(&long, MAX_NOTE_BYTES);
        assert!(short.len() <= MAX_NOTE_BYTES);
        assert!(short.ends_with('…'));
        assert_eq!(truncate("short", MAX_NOTE_BYTES), "short");
    }
}
