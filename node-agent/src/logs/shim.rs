//! The log shim: one small process per generation, the reader of its stdout
//! and stderr pipes, as a container runtime's shim is for a container.
//!
//! It is the agent's own binary (`node-agent log-shim`, started through
//! `/proc/self/exe`), in its own session and outside the agent's cgroup, so
//! it lives on when the agent (or its pod) is killed: the instance never
//! writes to a pipe without a reader, and never gets `EPIPE` or `SIGPIPE`
//! from the agent going away. It ignores the signals a terminal, a pod stop
//! or a generation's stop would send it, and exits once both pipes reach
//! end-of-file: when every process of the generation has closed them.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use jiff::Timestamp;
use nix::sys::signal::{SigHandler, Signal, signal};

use super::cri::{self, LineSplitter, Stream};
use super::file::RotatingFile;

/// Where the agent places the read end of the generation's stdout pipe.
pub const STDOUT_FD: i32 = 3;
/// ... and of its stderr pipe.
pub const STDERR_FD: i32 = 4;
/// Where the shim writes [`READY`] once it runs, then closes it.
pub const READY_FD: i32 = 5;
/// The ready byte: the log file is open.
pub const READY: u8 = b'r';
/// The ready byte when the log file could not be opened: the shim still
/// reads (the writer never blocks) and drops what it reads.
pub const READY_WITHOUT_FILE: u8 = b'n';

/// `node-agent log-shim`: not for people; the agent starts it.
#[derive(clap::Args, Debug, Clone)]
pub struct ShimArgs {
    /// The instance's log directory.
    #[arg(long)]
    pub dir: PathBuf,
    /// The generation N whose output this is.
    #[arg(long)]
    pub generation: u64,
    /// The sidecar of generation N whose output this is, if not N's own.
    #[arg(long)]
    pub sidecar: Option<String>,
    /// Bytes after which the file is rotated.
    #[arg(long)]
    pub max_size: u64,
    /// Files kept, the current one included.
    #[arg(long)]
    pub max_files: u32,
}

/// Runs the shim until both pipes end.
pub fn run(args: &ShimArgs) {
    detach();
    let stem = super::file::stem(args.generation, args.sidecar.as_deref());
    let log = RotatingFile::open(&args.dir, &stem, args.max_size, args.max_files).ok();
    // SAFETY: as for the pipes below, the agent put this descriptor here.
    let ready = File::from(unsafe { OwnedFd::from_raw_fd(READY_FD) });
    let _ = (&ready).write_all(&[if log.is_some() {
        READY
    } else {
        READY_WITHOUT_FILE
    }]);
    drop(ready);
    let log = Arc::new(Mutex::new(log));
    let readers: Vec<_> = [(STDOUT_FD, Stream::Stdout), (STDERR_FD, Stream::Stderr)]
        .into_iter()
        .map(|(fd, stream)| {
            // SAFETY: the agent put the pipe's read end at this descriptor
            // before exec (and no other code of this process opened it), so
            // it is open and this is its only owner.
            let pipe = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
            let log = Arc::clone(&log);
            std::thread::spawn(move || copy(pipe, stream, &log))
        })
        .collect();
    for reader in readers {
        let _ = reader.join();
    }
}

/// Its own session, and deaf to the signals meant for others: a terminal's
/// hang-up and interrupt, the stop signal sent to a generation's cgroup
/// (the shim is not in it, but an operator may signal the whole session),
/// and SIGPIPE (it writes only files).
fn detach() {
    let _ = nix::unistd::setsid();
    for sig in [
        Signal::SIGHUP,
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGQUIT,
        Signal::SIGPIPE,
    ] {
        // SAFETY: SIG_IGN installs no handler code, so nothing can run in
        // signal context; it only changes the signal's disposition.
        let _ = unsafe { signal(sig, SigHandler::SigIgn) };
    }
}

/// Reads one stream to its end and writes its records. Without a log file
/// (it could not be opened) it still reads, so the writer never blocks.
fn copy(mut pipe: File, stream: Stream, log: &Mutex<Option<RotatingFile>>) {
    let mut splitter = LineSplitter::default();
    let mut buffer = vec![0u8; 64 * 1024];
    let mut record = Vec::new();
    let mut write = |full: bool, text: &[u8]| {
        record.clear();
        cri::encode(&mut record, Timestamp::now(), stream, full, text);
        if let Some(file) = log.lock().unwrap_or_else(PoisonError::into_inner).as_mut() {
            file.write_record(&record);
        }
    };
    loop {
        match pipe.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => splitter.feed(&buffer[..n], &mut write),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
    }
    splitter.finish(&mut write);
}
