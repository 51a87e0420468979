//! Shared harness: the server as a real child process on a real unix socket
//! in its own temp dir, killed by PID when the test ends, and a minimal
//! HTTP/1.1 client that shows exactly what is on the wire.

// Each test binary uses a different part of this module.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Generous: the machine is shared and may be slow.
pub const DEADLINE: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(20);
pub const BUILD: &str = "b-test";
pub const GENERATION: &str = "7";

/// Polls `check` until it returns `Some`, or panics with `what` at the deadline.
pub fn poll_until<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(POLL);
    }
}

/// What to start: the server binary, its identity, knobs and flags.
pub struct AppSpec {
    dir: tempfile::TempDir,
    binary: PathBuf,
    build: String,
    envs: Vec<(String, String)>,
    args: Vec<String>,
}

impl AppSpec {
    pub fn new() -> Self {
        AppSpec {
            dir: tempfile::tempdir().expect("temp dir"),
            binary: PathBuf::from(env!("CARGO_BIN_EXE_genswap-testapp")),
            build: BUILD.to_string(),
            envs: Vec::new(),
            args: Vec::new(),
        }
    }

    pub fn binary(mut self, binary: &Path, build: &str) -> Self {
        self.binary = binary.to_path_buf();
        self.build = build.to_string();
        self
    }

    pub fn knob(mut self, name: &str, value: &str) -> Self {
        self.envs.push((name.to_string(), value.to_string()));
        self
    }

    pub fn arg(mut self, arg: &str) -> Self {
        self.args.push(arg.to_string());
        self
    }

    /// Where the server will bind.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("gen-7.sock")
    }

    pub fn spawn(self) -> App {
        let socket = self.socket();
        let mut child = Command::new(&self.binary)
            .args(&self.args)
            .env_clear()
            .env(testapp::env::SOCKET, &socket)
            .env(testapp::env::BUILD, &self.build)
            .env(testapp::env::GENERATION, GENERATION)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn genswap-testapp");
        let stderr = child.stderr.take().expect("piped stderr");
        let (lines_tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("app: {line}");
                if lines_tx.send(line).is_err() {
                    break;
                }
            }
        });
        App {
            pid: Pid::from_raw(i32::try_from(child.id()).expect("pid fits i32")),
            child,
            socket,
            lines,
            log: Vec::new(),
            build: self.build,
            _dir: self.dir,
        }
    }
}

/// A running server; SIGKILLed with its direct children (by PID) on drop.
pub struct App {
    pub pid: Pid,
    pub socket: PathBuf,
    pub build: String,
    child: Child,
    lines: Receiver<String>,
    /// Every stderr line received so far.
    pub log: Vec<String>,
    _dir: tempfile::TempDir,
}

impl App {
    /// Waits for a stderr line containing `needle` and returns it.
    pub fn wait_for_log(&mut self, needle: &str) -> String {
        if let Some(line) = self.log.iter().find(|line| line.contains(needle)) {
            return line.clone();
        }
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.log.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!("no log line with {needle:?}; log: {:?}", self.log)
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("stderr closed before {needle:?}; log: {:?}", self.log)
                }
            }
        }
    }

    /// Collects the stderr lines already written.
    pub fn drain_log(&mut self) -> &[String] {
        self.log.extend(self.lines.try_iter());
        &self.log
    }

    /// Waits until the socket accepts connections.
    pub fn wait_for_socket(&mut self) {
        let socket = self.socket.clone();
        poll_until("the socket to accept", || {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                panic!("exited with {status} before binding");
            }
            UnixStream::connect(&socket).ok()
        });
    }

    /// A new connection with a read timeout, so a missing answer fails the test.
    pub fn connect(&self) -> UnixStream {
        let stream = UnixStream::connect(&self.socket).expect("connect to the app");
        stream
            .set_read_timeout(Some(DEADLINE))
            .expect("set read timeout");
        stream
    }

    pub fn signal(&self, signal: Signal) {
        kill(self.pid, signal).expect("signal the app");
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    pub fn wait_exit(&mut self) -> ExitStatus {
        poll_until("the app to exit", || {
            self.child.try_wait().expect("try_wait")
        })
    }

    /// The body this app answers with.
    pub fn identity(&self) -> String {
        testapp::identity_body(&self.build, GENERATION, self.child.id())
    }
}

impl Drop for App {
    fn drop(&mut self) {
        // Only while the PID is still ours (not reaped) can it name the app.
        if let Ok(None) = self.child.try_wait() {
            for child in children_of(self.pid) {
                let _ = kill(child, Signal::SIGKILL);
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// SIGKILLs processes that are not our children (so not reaped by us) on drop.
pub struct KillOnDrop(pub Vec<Pid>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for pid in &self.0 {
            let _ = kill(*pid, Signal::SIGKILL);
        }
    }
}

/// Processes whose parent is `parent`, from /proc/<pid>/stat.
pub fn children_of(parent: Pid) -> Vec<Pid> {
    let mut children = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return children;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        if stat_field(Pid::from_raw(pid), 1).as_deref() == Some(&parent.to_string()) {
            children.push(Pid::from_raw(pid));
        }
    }
    children
}

/// Field `index` after the command name in /proc/<pid>/stat: 0 is the state,
/// 1 the parent PID.
fn stat_field(pid: Pid, index: usize) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses; it ends at the last ')'.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(index).map(str::to_string)
}

/// Exists and is not a zombie.
pub fn is_alive(pid: Pid) -> bool {
    matches!(stat_field(pid, 0).as_deref(), Some(state) if state != "Z" && state != "X")
}

/// Whether SIGTERM's disposition is SIG_IGN, from the SigIgn mask.
pub fn ignores_sigterm(pid: Pid) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read status");
    let mask = status
        .lines()
        .find_map(|line| line.strip_prefix("SigIgn:"))
        .expect("SigIgn line");
    let mask = u64::from_str_radix(mask.trim(), 16).expect("hex SigIgn");
    mask & (1 << (Signal::SIGTERM as i32 - 1)) != 0
}

/// Waits until the peer has read everything written on `stream`: on a unix
/// socket, SIOCOUTQ counts what the peer has not consumed yet.
pub fn wait_until_peer_read(stream: &UnixStream) {
    poll_until("the server to read the request", || {
        let mut unread: nix::libc::c_int = 0;
        // SAFETY: SIOCOUTQ (= TIOCOUTQ) writes one c_int through the pointer,
        // which points at a live local.
        let rc = unsafe {
            nix::libc::ioctl(
                stream.as_raw_fd(),
                nix::libc::TIOCOUTQ,
                &mut unread as *mut nix::libc::c_int,
            )
        };
        assert_eq!(rc, 0, "SIOCOUTQ: {}", std::io::Error::last_os_error());
        (unread == 0).then_some(())
    });
}

/// One HTTP/1.1 response as it came off the wire.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

pub fn send_get(stream: &mut UnixStream, path: &str) {
    write!(stream, "GET {path} HTTP/1.1\r\nhost: testapp\r\n\r\n").expect("write request");
}

/// Reads one response; the server always sends `content-length`.
pub fn read_reply(stream: &mut UnixStream) -> Reply {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    // Byte by byte, so nothing of a following response is consumed.
    while !head.ends_with(b"\r\n\r\n") {
        let read = stream.read(&mut byte).expect("read response head");
        assert_eq!(read, 1, "connection closed mid-head: {head:?}");
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).expect("UTF-8 head");
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("status line");
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let headers: Vec<(String, String)> = lines
        .filter(|line| !line.is_empty())
        .map(|line| {
            let (key, value) = line.split_once(':').expect("header line");
            (key.trim().to_string(), value.trim().to_string())
        })
        .collect();
    let mut reply = Reply {
        status,
        headers,
        body: String::new(),
    };
    let length: usize = reply
        .header("content-length")
        .expect("content-length")
        .parse()
        .expect("numeric content-length");
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).expect("read body");
    reply.body = String::from_utf8(body).expect("UTF-8 body");
    reply
}

pub fn get(stream: &mut UnixStream, path: &str) -> Reply {
    send_get(stream, path);
    read_reply(stream)
}

/// Waits for the server to close `stream`: a read returns end of file.
pub fn assert_closed_by_server(stream: &mut UnixStream) {
    let mut buf = [0u8; 64];
    match stream.read(&mut buf) {
        Ok(0) => {}
        Ok(n) => panic!("expected EOF, got {:?}", String::from_utf8_lossy(&buf[..n])),
        Err(err) => panic!("expected EOF, got {err}"),
    }
}
