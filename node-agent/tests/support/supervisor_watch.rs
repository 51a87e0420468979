//! A real supervisor of a test engine, and what it says, in order.
//!
//! Include it with `#[path = "support/supervisor_watch.rs"] mod supervisor_watch;`
//! beside `swap_host`.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use genswap_crds::ServingState;
use node_agent::engine::{Engine, GenerationExit, ServingChange, Supervisor, SupervisorEvent};
use tokio::sync::mpsc;

use crate::swap_host::OpenGate;

/// How long any one event may take to come.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// A running supervisor and what it says, in order.
pub struct Watching {
    _supervisor: Supervisor,
    events: mpsc::UnboundedReceiver<SupervisorEvent>,
}

impl Watching {
    pub fn start(engine: &Arc<Engine>) -> Self {
        let (sender, events) = mpsc::unbounded_channel();
        let supervisor = engine.start_supervisor(Arc::new(OpenGate), move |event| {
            let _ = sender.send(event);
        });
        Watching {
            _supervisor: supervisor,
            events,
        }
    }

    /// The next event, within the deadline.
    pub async fn next(&mut self) -> SupervisorEvent {
        tokio::time::timeout(DEADLINE, self.events.recv())
            .await
            .expect("the supervisor said something in time")
            .expect("the supervisor runs")
    }

    /// The next exit, skipping other events.
    pub async fn exit(&mut self) -> GenerationExit {
        loop {
            if let SupervisorEvent::Exited(exit) = self.next().await {
                return exit;
            }
        }
    }

    /// The next state change, skipping other events.
    pub async fn state(&mut self) -> ServingChange {
        loop {
            if let SupervisorEvent::Serving(change) = self.next().await {
                return *change;
            }
        }
    }

    /// State changes up to and including the first that is `Running` with
    /// `restarts` restarts.
    pub async fn states_until_restarts(&mut self, restarts: u32) -> Vec<ServingChange> {
        let mut seen = Vec::new();
        loop {
            let change = self.state().await;
            let done = change.supervised.state == ServingState::Running
                && change.supervised.restarts == restarts;
            seen.push(change);
            if done {
                return seen;
            }
        }
    }

    /// Waits for the restart that serves as generation `generation`.
    pub async fn restarted_as(&mut self, generation: u64) {
        loop {
            let change = self.state().await;
            if change.supervised.state == ServingState::Running
                && change.supervised.generation == generation
            {
                return;
            }
        }
    }
}
