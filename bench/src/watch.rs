//! Switch instants seen from outside the agent: inotify on a directory,
//! stamped on the shared clock when a named entry is renamed in
//! (`current.sock` replaced by the switch) or created (a naive restart's
//! new process binding its socket).

use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};

use crate::BenchError;
use crate::clock::mono_ns;

/// Watches one directory for one name until dropped.
pub struct SwitchWatch {
    instants: Arc<Mutex<Vec<u64>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl SwitchWatch {
    /// Stamps every rename onto, or creation of, `dir/name`.
    pub fn start(dir: &Path, name: &str) -> Result<SwitchWatch, BenchError> {
        let watch_error = |e: nix::Error| BenchError::Setup {
            what: format!("watch {}", dir.display()),
            source: e.into(),
        };
        let inotify =
            Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).map_err(watch_error)?;
        inotify
            .add_watch(dir, AddWatchFlags::IN_MOVED_TO | AddWatchFlags::IN_CREATE)
            .map_err(watch_error)?;
        let instants = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let name = name.to_string();
        let thread = std::thread::Builder::new()
            .name("switch-watch".into())
            .spawn({
                let instants = Arc::clone(&instants);
                let stop = Arc::clone(&stop);
                move || watch(&inotify, &name, &instants, &stop)
            })
            .map_err(|source| BenchError::Setup {
                what: "start the switch watch".into(),
                source,
            })?;
        Ok(SwitchWatch {
            instants,
            stop,
            thread: Some(thread),
        })
    }

    /// The last instant in `[from, to]`, if any.
    pub fn last_between(&self, from: u64, to: u64) -> Option<u64> {
        let instants = self.instants.lock().unwrap_or_else(|p| p.into_inner());
        instants
            .iter()
            .rev()
            .copied()
            .find(|t| (from..=to).contains(t))
    }
}

impl Drop for SwitchWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn watch(inotify: &Inotify, name: &str, instants: &Mutex<Vec<u64>>, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        let mut fds = [PollFd::new(inotify.as_fd(), PollFlags::POLLIN)];
        if !matches!(poll(&mut fds, PollTimeout::from(100u16)), Ok(n) if n > 0) {
            continue;
        }
        let now = mono_ns();
        let Ok(events) = inotify.read_events() else {
            continue;
        };
        let hit = events
            .iter()
            .any(|e| e.name.as_deref() == Some(OsStr::new(name)));
        if hit {
            instants.lock().unwrap_or_else(|p| p.into_inner()).push(now);
        }
    }
}
