//! The attempt's lifetime: a token the adapter ends on shutdown or an
//! intentional stop.

use std::sync::Arc;

use tokio::sync::watch;

/// Ends an attempt's lifetime. Clones share one state; once cancelled it
/// stays cancelled.
#[derive(Clone, Debug)]
pub struct Cancel {
    state: Arc<watch::Sender<Option<String>>>,
}

impl Default for Cancel {
    fn default() -> Self {
        Self::new()
    }
}

impl Cancel {
    /// A token that has not been cancelled.
    pub fn new() -> Self {
        Self {
            state: Arc::new(watch::Sender::new(None)),
        }
    }

    /// Ends the lifetime, saying why (the first reason wins).
    pub fn cancel(&self, why: impl Into<String>) {
        let why = why.into();
        self.state.send_if_modified(|state| {
            if state.is_some() {
                return false;
            }
            *state = Some(why);
            true
        });
    }

    /// Whether the lifetime has ended.
    pub fn is_cancelled(&self) -> bool {
        self.state.borrow().is_some()
    }

    /// Why it ended, once it has.
    pub fn reason(&self) -> Option<String> {
        self.state.borrow().clone()
    }

    /// Resolves when the lifetime ends (at once if it already has).
    pub async fn cancelled(&self) {
        let mut receiver = self.state.subscribe();
        // The sender lives in `self`, so the channel cannot close while this waits.
        let _ = receiver.wait_for(Option::is_some).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn cancel_wakes_waiters_and_keeps_the_first_reason() {
        let cancel = Cancel::new();
        assert!(!cancel.is_cancelled());
        let waiter = tokio::spawn({
            let cancel = cancel.clone();
            async move { cancel.cancelled().await }
        });
        cancel.cancel("agent shutting down");
        cancel.cancel("second reason");
        tokio::time::timeout(std::time::Duration::from_secs(10), waiter)
            .await
            .expect("the waiter wakes")
            .expect("the waiter does not panic");
        assert!(cancel.is_cancelled());
        assert_eq!(cancel.reason().as_deref(), Some("agent shutting down"));
        cancel.cancelled().await;
    }
}
