//! The demo's client: requests through `current.sock` without a pause, one
//! new connection each (what a front proxy does for each new client), so
//! every switch and every gap in service is crossed by requests.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::task::JoinHandle;

/// A request that takes longer than this counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Between two requests: keeps the machine usable while still crossing
/// every switch with requests.
const PAUSE: Duration = Duration::from_millis(2);

/// Counts so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Requests sent.
    pub sent: u64,
    /// Requests without a 200 answer (refused, reset, timed out, or 5xx).
    pub failed: u64,
}

impl std::ops::Sub for Tally {
    type Output = Tally;

    fn sub(self, earlier: Tally) -> Tally {
        Tally {
            sent: self.sent.saturating_sub(earlier.sent),
            failed: self.failed.saturating_sub(earlier.failed),
        }
    }
}

#[derive(Default)]
struct Shared {
    sent: AtomicU64,
    failed: AtomicU64,
    /// The build of the last answer.
    last_build: Mutex<Option<String>>,
}

/// The running client; stopped when dropped.
pub struct Client {
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Client {
    /// Starts sending to `socket`.
    pub fn start(socket: PathBuf) -> Client {
        let shared = Arc::new(Shared::default());
        let task = tokio::spawn(send_forever(socket, shared.clone()));
        Client { shared, task }
    }

    /// The counts so far.
    pub fn tally(&self) -> Tally {
        Tally {
            sent: self.shared.sent.load(Ordering::SeqCst),
            failed: self.shared.failed.load(Ordering::SeqCst),
        }
    }

    /// The build that answered last.
    pub fn last_build(&self) -> Option<String> {
        self.shared
            .last_build
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn send_forever(socket: PathBuf, shared: Arc<Shared>) {
    loop {
        shared.sent.fetch_add(1, Ordering::SeqCst);
        match crate::health::get_within(&socket, "/", REQUEST_TIMEOUT).await {
            Ok((200, body)) => {
                let build = String::from_utf8_lossy(&body)
                    .split_whitespace()
                    .find_map(|field| field.strip_prefix("build=").map(str::to_string));
                *shared
                    .last_build
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = build;
            }
            Ok(_) | Err(_) => {
                shared.failed.fetch_add(1, Ordering::SeqCst);
            }
        }
        tokio::time::sleep(PAUSE).await;
    }
}
