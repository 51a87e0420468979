//! Which Events go out together: the pure part of [`crate::events`].
//!
//! An InstanceGeneration's Normal Events (attempts issued, swaps done,
//! restarts) come in runs: a burst install issues a canary, records it
//! done, issues the rest and records them done within seconds. Written one
//! by one they were two of the controller's four writes per attempt. So the
//! Normal Events of one object are held for a window from the first of
//! them and go out as one Event that lists each, in order:
//!
//! - one of them: the Event as it was, its own reason and note;
//! - several with one reason: that reason, and a series whose count is how
//!   many the note lists (`kubectl events` shows `(x3 over 2s)`);
//! - several reasons: reason [`REASON_FOLDED`], each entry of the note led
//!   by its own reason.
//!
//! A Warning is never held or folded: it goes out at once, right after the
//! Normal Events of its object that came before it, so the order on the
//! object stays the order things happened in. A note never grows past what
//! the API server accepts: an entry that would not fit sends the fold so
//! far and starts the next.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::jiff::Timestamp;
use tokio::time::Instant;

/// The reason of an Event that folds Normal Events of several reasons.
pub const REASON_FOLDED: &str = "Progressing";

/// events.k8s.io/v1 refuses notes longer than this many bytes.
pub const MAX_NOTE_BYTES: usize = 1024;

/// Between two entries of a folded note.
const SEPARATOR: &str = "; ";

/// One Event as a reconcile asked for it.
#[derive(Clone, Debug, PartialEq)]
pub struct Queued {
    pub warning: bool,
    pub reason: String,
    pub note: String,
    pub regarding: ObjectReference,
}

/// [`Queued`] with the time it happened.
#[derive(Clone, Debug, PartialEq)]
pub struct Stamped {
    pub event: Queued,
    pub at: Timestamp,
}

/// An Event to write: one or more [`Stamped`] of one object.
#[derive(Clone, Debug, PartialEq)]
pub struct Folded {
    pub warning: bool,
    pub reason: String,
    pub note: String,
    pub regarding: ObjectReference,
    /// When the first entry happened (the Event's `eventTime`).
    pub first: Timestamp,
    /// When the last entry happened.
    pub last: Timestamp,
    /// How many entries the note lists.
    pub count: usize,
}

impl Folded {
    fn single(stamped: Stamped) -> Folded {
        Folded {
            warning: stamped.event.warning,
            reason: stamped.event.reason,
            note: truncate(&stamped.event.note, MAX_NOTE_BYTES),
            regarding: stamped.event.regarding,
            first: stamped.at,
            last: stamped.at,
            count: 1,
        }
    }

    fn of(entries: Vec<Stamped>) -> Option<Folded> {
        let mut entries = entries.into_iter();
        let first = entries.next()?;
        let rest: Vec<Stamped> = entries.collect();
        let Some(last) = rest.last() else {
            return Some(Folded::single(first));
        };
        let one_reason = rest.iter().all(|e| e.event.reason == first.event.reason);
        let entry = |stamped: &Stamped| {
            if one_reason {
                stamped.event.note.clone()
            } else {
                labelled(stamped)
            }
        };
        let note = std::iter::once(&first)
            .chain(&rest)
            .map(entry)
            .collect::<Vec<_>>()
            .join(SEPARATOR);
        Some(Folded {
            warning: false,
            reason: if one_reason {
                first.event.reason.clone()
            } else {
                REASON_FOLDED.to_string()
            },
            note: truncate(&note, MAX_NOTE_BYTES),
            regarding: first.event.regarding.clone(),
            first: first.at,
            last: last.at,
            count: rest.len() + 1,
        })
    }
}

fn labelled(stamped: &Stamped) -> String {
    format!("{}: {}", stamped.event.reason, stamped.event.note)
}

/// An object as Events regard it.
type ObjectKey = (Option<String>, Option<String>, Option<String>);

fn key_of(regarding: &ObjectReference) -> ObjectKey {
    (
        regarding.namespace.clone(),
        regarding.name.clone(),
        regarding.uid.clone(),
    )
}

/// The Normal Events of one object waiting for their window to close.
#[derive(Debug)]
struct Open {
    entries: Vec<Stamped>,
    due: Instant,
}

impl Open {
    /// Whether the note, with `next` added, stays within the limit whether
    /// the fold keeps one reason or turns into a [`REASON_FOLDED`] one.
    fn fits(&self, next: &Stamped) -> bool {
        let labelled_bytes: usize = self
            .entries
            .iter()
            .chain(std::iter::once(next))
            .map(|e| labelled(e).len() + SEPARATOR.len())
            .sum();
        labelled_bytes - SEPARATOR.len() <= MAX_NOTE_BYTES
    }
}

/// The open folds, by object. Time comes from the caller.
#[derive(Debug)]
pub struct Folds {
    window: Duration,
    open: HashMap<ObjectKey, Open>,
    /// When each fold opened closes, in that order (the window is the same
    /// for all). A fold sent early leaves its entry behind, skipped later.
    closing: VecDeque<(Instant, ObjectKey)>,
}

impl Folds {
    /// Folds over `window`; a zero window sends every Event alone at once.
    pub fn new(window: Duration) -> Folds {
        Folds {
            window,
            open: HashMap::new(),
            closing: VecDeque::new(),
        }
    }

    /// Takes `stamped` at `now`; returns what must go out now, in order.
    pub fn push(&mut self, stamped: Stamped, now: Instant) -> Vec<Folded> {
        let key = key_of(&stamped.event.regarding);
        if stamped.event.warning || self.window.is_zero() {
            let mut out: Vec<Folded> = self
                .open
                .remove(&key)
                .and_then(|open| Folded::of(open.entries))
                .into_iter()
                .collect();
            out.push(Folded::single(stamped));
            return out;
        }
        let mut out = Vec::new();
        if let Some(open) = self.open.get_mut(&key) {
            if open.fits(&stamped) {
                open.entries.push(stamped);
                return out;
            }
            if let Some(full) = self.open.remove(&key).and_then(|o| Folded::of(o.entries)) {
                out.push(full);
            }
        }
        let due = now + self.window;
        self.closing.push_back((due, key.clone()));
        self.open.insert(
            key,
            Open {
                entries: vec![stamped],
                due,
            },
        );
        out
    }

    /// When the next window closes.
    pub fn next_due(&mut self) -> Option<Instant> {
        while let Some((due, key)) = self.closing.front() {
            if self.open.get(key).is_some_and(|open| open.due == *due) {
                return Some(*due);
            }
            self.closing.pop_front();
        }
        None
    }

    /// The folds whose window has closed by `now`, oldest first.
    pub fn due(&mut self, now: Instant) -> Vec<Folded> {
        let mut out = Vec::new();
        while self.next_due().is_some_and(|due| due <= now) {
            if let Some((_, key)) = self.closing.pop_front()
                && let Some(open) = self.open.remove(&key)
            {
                out.extend(Folded::of(open.entries));
            }
        }
        out
    }

    /// Every open fold, at once (the sender is shutting down), oldest
    /// first.
    pub fn drain(&mut self) -> Vec<Folded> {
        let mut out = Vec::new();
        while let Some((due, key)) = self.closing.pop_front() {
            if self.open.get(&key).is_some_and(|open| open.due == due)
                && let Some(open) = self.open.remove(&key)
            {
                out.extend(Folded::of(open.entries));
            }
        }
        out
    }

    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
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

    const WINDOW: Duration = Duration::from_secs(10);

    fn on(name: &str) -> ObjectReference {
        ObjectReference {
            kind: Some("InstanceGeneration".into()),
            namespace: Some("apps".into()),
            name: Some(name.into()),
            uid: Some(format!("uid-{name}")),
            ..ObjectReference::default()
        }
    }

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(1_750_000_000 + second).unwrap_or(Timestamp::UNIX_EPOCH)
    }

    fn normal(object: &str, reason: &str, note: &str, second: i64) -> Stamped {
        Stamped {
            event: Queued {
                warning: false,
                reason: reason.into(),
                note: note.into(),
                regarding: on(object),
            },
            at: at(second),
        }
    }

    fn warning(object: &str, reason: &str, note: &str, second: i64) -> Stamped {
        let mut stamped = normal(object, reason, note, second);
        stamped.event.warning = true;
        stamped
    }

    fn summary(folded: &[Folded]) -> Vec<(String, String, usize)> {
        folded
            .iter()
            .map(|f| (f.reason.clone(), f.note.clone(), f.count))
            .collect()
    }

    fn owned(rows: &[(&str, &str, usize)]) -> Vec<(String, String, usize)> {
        rows.iter()
            .map(|(r, n, c)| (r.to_string(), n.to_string(), *c))
            .collect()
    }

    #[test]
    fn normal_events_of_one_object_wait_for_the_window_and_go_out_as_one() {
        let t0 = Instant::now();
        let mut folds = Folds::new(WINDOW);
        assert!(
            folds
                .push(normal("web", "AttemptIssued", "node n1: rev 1", 0), t0)
                .is_empty()
        );
        assert!(
            folds
                .push(
                    normal("web", "AttemptIssued", "node n2: rev 2", 3),
                    t0 + Duration::from_secs(3)
                )
                .is_empty()
        );
        assert_eq!(
            folds.next_due(),
            Some(t0 + WINDOW),
            "the window runs from the first"
        );
        assert!(folds.due(t0 + WINDOW - Duration::from_millis(1)).is_empty());
        let out = folds.due(t0 + WINDOW);
        assert_eq!(
            summary(&out),
            owned(&[("AttemptIssued", "node n1: rev 1; node n2: rev 2", 2)])
        );
        assert_eq!((out[0].first, out[0].last), (at(0), at(3)));
        assert!(!out[0].warning);
        assert!(folds.is_empty() && folds.next_due().is_none());
    }

    #[test]
    fn several_reasons_fold_under_one_and_each_entry_keeps_its_own() {
        let t0 = Instant::now();
        let mut folds = Folds::new(WINDOW);
        for stamped in [
            normal("web", "AttemptIssued", "node n1: rev 1", 0),
            normal("web", "SwapDone", "node n1: rev 1 done", 1),
            normal("web", "AttemptIssued", "node n2: rev 2", 2),
        ] {
            assert!(folds.push(stamped, t0).is_empty());
        }
        assert_eq!(
            summary(&folds.drain()),
            owned(&[(
                REASON_FOLDED,
                "AttemptIssued: node n1: rev 1; SwapDone: node n1: rev 1 done; AttemptIssued: node n2: rev 2",
                3
            )])
        );
    }

    #[test]
    fn a_lone_event_keeps_its_reason_and_note() {
        let t0 = Instant::now();
        let mut folds = Folds::new(WINDOW);
        assert!(
            folds
                .push(normal("web", "SwapDone", "node n1: done", 0), t0)
                .is_empty()
        );
        assert_eq!(
            summary(&folds.due(t0 + WINDOW)),
            owned(&[("SwapDone", "node n1: done", 1)])
        );
    }

    #[test]
    fn objects_fold_apart_and_close_in_the_order_they_opened() {
        let t0 = Instant::now();
        let mut folds = Folds::new(WINDOW);
        folds.push(normal("b", "SwapDone", "b first", 0), t0);
        folds.push(
            normal("a", "SwapDone", "a first", 1),
            t0 + Duration::from_secs(1),
        );
        folds.push(
            normal("b", "SwapDone", "b second", 2),
            t0 + Duration::from_secs(2),
        );
        assert_eq!(
            summary(&folds.due(t0 + WINDOW)),
            owned(&[("SwapDone", "b first; b second", 2)]),
            "a's window is still open"
        );
        assert_eq!(
            summary(&folds.due(t0 + WINDOW + Duration::from_secs(1))),
            owned(&[("SwapDone", "a first", 1)])
        );
    }

    #[test]
    fn a_warning_goes_at_once_after_what_its_object_had_waiting() {
        let t0 = Instant::now();
        let mut folds = Folds::new(WINDOW);
        folds.push(normal("web", "AttemptIssued", "node n1: rev 1", 0), t0);
        folds.push(normal("other", "SwapDone", "untouched", 0), t0);
        let out = folds.push(warning("web", "SwapFailed", "node n1: rev 1 failed", 1), t0);
        assert_eq!(
            summary(&out),
            owned(&[
                ("AttemptIssued", "node n1: rev 1", 1),
                ("SwapFailed", "node n1: rev 1 failed", 1),
            ])
        );
        assert!(out[1].warning);
        assert_eq!(
            summary(&folds.drain()),
            owned(&[("SwapDone", "untouched", 1)]),
            "another object's fold stays open"
        );
        let alone = folds.push(warning("web", "NodeDown", "down", 2), t0);
        assert_eq!(summary(&alone), owned(&[("NodeDown", "down", 1)]));
    }

    #[test]
    fn a_fold_sent_early_does_not_close_the_next_one_early() {
        let t0 = Instant::now();
        let mut folds = Folds::new(WINDOW);
        folds.push(normal("web", "AttemptIssued", "first", 0), t0);
        let early = folds.push(
            warning("web", "SwapFailed", "failed", 1),
            t0 + Duration::from_secs(1),
        );
        assert_eq!(early.len(), 2);
        let reopened = t0 + Duration::from_secs(2);
        folds.push(normal("web", "SwapDone", "second", 2), reopened);
        assert_eq!(folds.next_due(), Some(reopened + WINDOW));
        assert!(
            folds.due(t0 + WINDOW).is_empty(),
            "the first window's close is stale"
        );
        assert_eq!(
            summary(&folds.due(reopened + WINDOW)),
            owned(&[("SwapDone", "second", 1)])
        );
        assert!(folds.next_due().is_none());
    }

    #[test]
    fn a_zero_window_sends_each_event_alone_at_once() {
        let t0 = Instant::now();
        let mut folds = Folds::new(Duration::ZERO);
        let out = folds.push(normal("web", "AttemptIssued", "node n1: rev 1", 0), t0);
        assert_eq!(
            summary(&out),
            owned(&[("AttemptIssued", "node n1: rev 1", 1)])
        );
        assert!(folds.is_empty());
    }

    #[test]
    fn an_entry_that_would_overflow_the_note_starts_the_next_fold() {
        let t0 = Instant::now();
        let mut folds = Folds::new(WINDOW);
        let long = "x".repeat(400);
        let mut sent = Vec::new();
        for i in 0..5 {
            sent.extend(folds.push(normal("web", "SwapDone", &format!("{i}{long}"), i), t0));
        }
        sent.extend(folds.drain());
        assert_eq!(
            sent.iter().map(|f| f.count).collect::<Vec<_>>(),
            vec![2, 2, 1]
        );
        assert!(sent.iter().all(|f| f.note.len() <= MAX_NOTE_BYTES));
        let notes: String = sent
            .iter()
            .map(|f| f.note.as_str())
            .collect::<Vec<_>>()
            .join("; ");
        for i in 0..5 {
            assert!(
                notes.contains(&format!("{i}{long}")),
                "entry {i} is in a note"
            );
        }
    }

    #[test]
    fn a_single_note_too_long_is_cut_on_a_char_boundary() {
        let mut folds = Folds::new(Duration::ZERO);
        let out = folds.push(
            normal("web", "SwapDone", &"é".repeat(2000), 0),
            Instant::now(),
        );
        assert!(out[0].note.len() <= MAX_NOTE_BYTES);
        assert!(out[0].note.ends_with('…'));
    }
}
