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
//!
//! It learns whose output it writes after it starts, from the agent over a
//! socket ([`Assignment`]), so the agent can start it ahead of the next
//! generation; a shim whose agent goes before it is assigned exits.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use jiff::Timestamp;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigHandler, Signal, signal};
use nix::sys::socket::{MsgFlags, recv, send};

use super::cri::{self, LineSplitter, Stream};
use super::file::RotatingFile;

/// The subcommand the agent's binary (or `genswap-helper`) runs as a shim.
pub const SHIM_COMMAND: &str = "log-shim";
/// Where the agent places the read end of the generation's stdout pipe.
pub const STDOUT_FD: i32 = 3;
/// ... and of its stderr pipe.
pub const STDERR_FD: i32 = 4;
/// The shim's end of a `SOCK_SEQPACKET` pair with the agent: it receives
/// its [`Assignment`] there, answers [`READY`] once its log file is open,
/// and closes it. End-of-file before an assignment ends the shim.
pub const CONTROL_FD: i32 = 5;
/// The ready byte: the log file is open.
pub const READY: u8 = b'r';
/// The ready byte when the log file could not be opened (or the assignment
/// could not be read): the shim still reads (the writer never blocks) and
/// drops what it reads.
pub const READY_WITHOUT_FILE: u8 = b'n';
/// The longest assignment (a number, a sidecar name and a path): a longer
/// message would arrive cut, so the agent refuses to send one.
pub const MAX_ASSIGNMENT: usize = 8192;

/// `node-agent log-shim`: not for people; the agent starts it. What it
/// writes comes later, as an [`Assignment`]: so a shim can be started
/// before the generation it will serve exists (see `LogSink`).
#[derive(clap::Args, Debug, Clone, PartialEq, Eq)]
pub struct ShimArgs {
    /// Bytes after which the file is rotated.
    #[arg(long)]
    pub max_size: u64,
    /// Files kept, the current one included.
    #[arg(long)]
    pub max_files: u32,
}

/// Whose output a shim writes, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// The instance's log directory.
    pub dir: PathBuf,
    /// The generation N whose output this is.
    pub generation: u64,
    /// The sidecar of generation N whose output this is, if not N's own.
    pub sidecar: Option<String>,
}

impl Assignment {
    /// `<generation> NUL <sidecar or nothing> NUL <dir>`: one message.
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = self.generation.to_string().into_bytes();
        bytes.push(0);
        bytes.extend(self.sidecar.as_deref().unwrap_or_default().as_bytes());
        bytes.push(0);
        bytes.extend(self.dir.as_os_str().as_bytes());
        bytes
    }

    /// The message [`encode`](Self::encode) wrote, or `None`.
    pub fn decode(bytes: &[u8]) -> Option<Assignment> {
        let mut parts = bytes.splitn(3, |b| *b == 0);
        let generation = std::str::from_utf8(parts.next()?).ok()?.parse().ok()?;
        let sidecar = std::str::from_utf8(parts.next()?).ok()?;
        let dir = parts.next().filter(|dir| dir.starts_with(b"/"))?;
        Some(Assignment {
            dir: PathBuf::from(std::ffi::OsStr::from_bytes(dir)),
            generation,
            sidecar: (!sidecar.is_empty()).then(|| sidecar.to_owned()),
        })
    }
}

/// Runs the shim until both pipes end.
pub fn run(args: &ShimArgs) {
    detach();
    // SAFETY: the agent put its end of the control pair at this descriptor
    // before exec (and no other code of this process opened it), so it is
    // open and this is its only owner.
    let control = unsafe { OwnedFd::from_raw_fd(CONTROL_FD) };
    let mut message = vec![0u8; MAX_ASSIGNMENT];
    let received = loop {
        match recv(control.as_raw_fd(), &mut message, MsgFlags::empty()) {
            Err(nix::errno::Errno::EINTR) => continue,
            other => break other,
        }
    };
    let assignment = match received {
        // The agent dropped this shim unused, or is gone.
        Ok(0) | Err(_) => return,
        Ok(n) => Assignment::decode(&message[..n]),
    };
    drop(message);
    let log = assignment.and_then(|a| {
        let stem = super::file::stem(a.generation, a.sidecar.as_deref());
        RotatingFile::open(&a.dir, &stem, args.max_size, args.max_files).ok()
    });
    let answer = if log.is_some() {
        READY
    } else {
        READY_WITHOUT_FILE
    };
    let _ = send(control.as_raw_fd(), &[answer], MsgFlags::MSG_NOSIGNAL);
    drop(control);
    // SAFETY: the agent put the pipes' read ends at these descriptors before
    // exec (and no other code of this process opened them), so they are
    // open and this is their only owner.
    let pipes = [STDOUT_FD, STDERR_FD].map(|fd| File::from(unsafe { OwnedFd::from_raw_fd(fd) }));
    copy(pipes, log);
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

/// Reads both streams to their ends, in one thread (a thread and a buffer
/// per stream would double what each shim costs the node), and writes their
/// records. Without a log file (it could not be opened) it still reads, so
/// the writer never blocks.
fn copy(pipes: [File; 2], mut log: Option<RotatingFile>) {
    let streams = [Stream::Stdout, Stream::Stderr];
    let mut splitters = [LineSplitter::default(), LineSplitter::default()];
    let mut open = [true, true];
    let mut buffer = vec![0u8; 64 * 1024];
    let mut record = Vec::new();
    let mut write = |stream: Stream, full: bool, text: &[u8]| {
        record.clear();
        cri::encode(&mut record, Timestamp::now(), stream, full, text);
        if let Some(file) = log.as_mut() {
            file.write_record(&record);
        }
    };
    while open.iter().any(|o| *o) {
        let mut fds: Vec<PollFd<'_>> = pipes
            .iter()
            .zip(open)
            .filter(|(_, open)| *open)
            .map(|(pipe, _)| PollFd::new(pipe.as_fd(), PollFlags::POLLIN))
            .collect();
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => break,
        }
        let ready: Vec<bool> = fds
            .iter()
            .map(|fd| fd.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        drop(fds);
        let mut ready = ready.into_iter();
        for index in 0..2 {
            if !open[index] || !ready.next().unwrap_or(false) {
                continue;
            }
            let stream = streams[index];
            match (&pipes[index]).read(&mut buffer) {
                Ok(0) => {
                    open[index] = false;
                    splitters[index]
                        .finish(&mut |full: bool, text: &[u8]| write(stream, full, text));
                }
                Ok(n) => splitters[index].feed(&buffer[..n], &mut |full: bool, text: &[u8]| {
                    write(stream, full, text)
                }),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    open[index] = false;
                    splitters[index]
                        .finish(&mut |full: bool, text: &[u8]| write(stream, full, text));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_assignment_reads_back_as_written() {
        for sidecar in [None, Some("exporter".to_owned())] {
            let assignment = Assignment {
                dir: PathBuf::from("/var/log/genswap/default_app"),
                generation: 12,
                sidecar,
            };
            assert_eq!(
                Assignment::decode(&assignment.encode()),
                Some(assignment.clone())
            );
        }
    }

    #[test]
    fn a_malformed_assignment_is_none() {
        for bytes in [
            &b""[..],
            b"12",
            b"12\0",
            b"x\0\0/var/log",
            b"12\0\0relative/dir",
            b"-1\0\0/var/log",
        ] {
            assert_eq!(Assignment::decode(bytes), None, "{bytes:?}");
        }
    }
}
