//! A one-shot, cloneable shutdown signal, and the OS signals that fire it.

use std::sync::Arc;

use tokio::sync::watch;

/// Fires the paired [`Signal`]s.
#[derive(Clone, Debug)]
pub struct Trigger(Arc<watch::Sender<bool>>);

/// Resolves (via [`Signal::wait`]) once its [`Trigger`] fires or is dropped.
#[derive(Clone, Debug)]
pub struct Signal(watch::Receiver<bool>);

/// A new trigger and its signal.
pub fn channel() -> (Trigger, Signal) {
    let (sender, receiver) = watch::channel(false);
    (Trigger(Arc::new(sender)), Signal(receiver))
}

impl Trigger {
    /// Fires every signal; idempotent.
    pub fn fire(&self) {
        self.0.send_replace(true);
    }
}

impl Signal {
    /// Waits for the trigger. A dropped trigger counts as fired, so nothing
    /// waits forever on a sender that is gone.
    pub async fn wait(mut self) {
        let _ = self.0.wait_for(|fired| *fired).await;
    }
}

/// Waits for SIGTERM or SIGINT. If the handlers cannot be installed it
/// returns at once, so the process shuts down instead of being unstoppable.
pub async fn os_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (mut terminate, mut interrupt) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(terminate), Ok(interrupt)) => (terminate, interrupt),
        (Err(error), _) | (_, Err(error)) => {
            tracing::error!(%error, "cannot install signal handlers; shutting down");
            return;
        }
    };
    tokio::select! {
        _ = terminate.recv() => tracing::info!("SIGTERM; shutting down"),
        _ = interrupt.recv() => tracing::info!("SIGINT; shutting down"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn every_clone_resolves_once_fired() {
        let (trigger, signal) = channel();
        let waiting = tokio::spawn(signal.clone().wait());
        trigger.fire();
        tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("the signal resolves within the deadline")
            .expect("task joined");
        tokio::time::timeout(Duration::from_secs(10), signal.wait())
            .await
            .expect("a late clone resolves at once");
    }
}
