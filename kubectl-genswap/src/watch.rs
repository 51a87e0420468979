//! `get --watch`: the InstanceGeneration and its attempts kept in reflector
//! stores by two watches, and the tree drawn again after every change the
//! API server reports. Nothing polls: between changes the command waits.

use futures::{StreamExt, TryStreamExt, stream};
use genswap_crds::{InstanceGeneration, SwapAttempt};
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt, reflector};

use crate::api::Target;
use crate::error::PluginError;
use crate::{Output, Terminal, print_tree, tree};

/// Which watch reported a change.
enum Change {
    Instance(bool),
    Attempts(bool),
}

/// Draws a frame after both initial lists and after every change; returns
/// after `frames` frames when given (tests). A watch that fails before the
/// first frame ends the command with the reason; later failures are
/// retried with kube's default backoff and the tree stays on screen.
pub async fn run(
    target: &Target,
    output: Output,
    terminal: &mut Terminal<'_>,
    frames: Option<usize>,
) -> Result<(), PluginError> {
    let (igs, ig_writer) = reflector::store::<InstanceGeneration>();
    let (attempts, attempt_writer) = reflector::store::<SwapAttempt>();
    let ig_events = reflector::reflector(
        ig_writer,
        watcher::watcher(
            target.igs.clone(),
            watcher::Config::default().fields(&format!("metadata.name={}", target.name)),
        )
        .default_backoff(),
    )
    .map_ok(|event| Change::Instance(settled(&event)))
    .map_err(|error| watch_error(target, error, "instancegenerations"));
    let attempt_events = reflector::reflector(
        attempt_writer,
        watcher::watcher(
            target.attempts.clone(),
            watcher::Config::default().labels(&target.attempt_selector()),
        )
        .default_backoff(),
    )
    .map_ok(|event| Change::Attempts(settled(&event)))
    .map_err(|error| watch_error(target, error, "swapattempts"));
    let mut changes = stream::select(ig_events.boxed(), attempt_events.boxed());

    let (mut ig_listed, mut attempts_listed) = (false, false);
    let mut drawn = 0;
    while let Some(change) = changes.next().await {
        match change {
            Ok(Change::Instance(settled)) => ig_listed |= settled,
            Ok(Change::Attempts(settled)) => attempts_listed |= settled,
            // Before the first frame an error is the answer (not found,
            // forbidden); after it the watch retries with backoff.
            Err(error) if drawn == 0 => return Err(error),
            Err(_) => continue,
        }
        if !(ig_listed && attempts_listed) {
            continue;
        }
        let Some(ig) = igs.state().into_iter().next() else {
            return Err(PluginError::NotFound {
                object: target.object(),
            });
        };
        let attempts: Vec<SwapAttempt> = attempts.state().iter().map(|a| (**a).clone()).collect();
        let tree = tree::build(&ig, &attempts, target.node.as_deref(), (terminal.now)());
        if terminal.redraw {
            terminal.out.write_all(b"\x1b[H\x1b[2J")?;
        }
        print_tree(terminal, &tree, output)?;
        drawn += 1;
        if frames.is_some_and(|frames| drawn >= frames) {
            return Ok(());
        }
    }
    Ok(())
}

/// Whether the store is complete after this event: an initial list is
/// complete at `InitDone`, and any later event keeps it so.
fn settled<K>(event: &Event<K>) -> bool {
    matches!(event, Event::InitDone | Event::Apply(_) | Event::Delete(_))
}

/// What a failed watch of `resource` means to a human.
fn watch_error(target: &Target, error: watcher::Error, resource: &'static str) -> PluginError {
    match error {
        watcher::Error::InitialListFailed(e) | watcher::Error::WatchStartFailed(e) => {
            target.explain(e, "watch", resource)
        }
        other => PluginError::Unreachable(other.to_string()),
    }
}
