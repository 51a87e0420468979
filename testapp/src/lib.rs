//! `genswap-testapp`: the HTTP/1.1 server that genswap's tests, demo and
//! benchmarks run as an instance, plus helpers to find and copy it.
//!
//! # The server
//!
//! The binary serves HTTP/1.1 with keep-alive on the unix socket named by
//! `GENSWAP_SOCKET` (required). A file already at that path is removed before
//! binding; parent directories are not created. `GENSWAP_BUILD` and
//! `GENSWAP_GENERATION` identify it (`unknown` when unset).
//!
//! It also serves every socket handed to it by systemd's socket activation
//! (`sd_listen_fds(3)`: fds 3.. when `LISTEN_PID` is its pid, `LISTEN_FDS`
//! of them, TCP or unix), as a service using a socket-activation library
//! would. At SIGTERM it stops accepting on all of them, serves what is
//! already queued on each, and drains; its copy of a held listener closes,
//! the listener does not.
//!
//! Every request, whatever its method or path, is answered with status `200`
//! (or `TESTAPP_STATUS`), `content-type: text/plain; charset=utf-8`, the headers
//! `x-genswap-build` and `x-genswap-generation`, and the body
//! `build=<GENSWAP_BUILD> generation=<GENSWAP_GENERATION> pid=<pid>\n`
//! (see [`identity_body`]); except `GET /metrics`, which answers the
//! requests answered so far in Prometheus's text format,
//! `http_requests_total{build="<GENSWAP_BUILD>",generation="<GENSWAP_GENERATION>",code="<status>"}`,
//! not counting itself.
//!
//! ## Knobs
//!
//! Environment variables, all off when absent. Each may also be given as a
//! flag named after it: `TESTAPP_BOOT_DELAY_MS=3000` is
//! `--boot-delay-ms=3000`, and a boolean flag without a value means `1`.
//! A flag wins over the environment. Booleans accept `1`/`true`/`0`/`false`.
//!
//! | variable | effect |
//! |---|---|
//! | `TESTAPP_BOOT_DELAY_MS=N` | sleep N ms before binding |
//! | `TESTAPP_STATUS=code` | answer every request with this status |
//! | `TESTAPP_EXIT_AFTER_MS=N` | exit N ms after the process started, with `TESTAPP_EXIT_CODE` |
//! | `TESTAPP_EXIT_CODE=c` | the code for `TESTAPP_EXIT_AFTER_MS` (default 1) |
//! | `TESTAPP_EXIT_ONCE=path` | `TESTAPP_EXIT_AFTER_MS` applies only to the process that creates `path` first: later ones (a restart) keep serving |
//! | `TESTAPP_IGNORE_SIGTERM=1` | SIGTERM is ignored (disposition `SIG_IGN`); keeps serving |
//! | `TESTAPP_DRAIN_MS=N` | how long a SIGTERM drain waits for in-flight requests (default 2000) |
//! | `TESTAPP_FORK_CHILDREN=N` | at start, fork N children that ignore SIGTERM and sleep forever |
//! | `TESTAPP_SLOW_MS=N` | delay every response by N ms |
//! | `TESTAPP_NEVER_BIND=1` | run, but never bind the socket |
//! | `TESTAPP_HANG=1` | accept connections and read requests, never answer |
//! | `TESTAPP_STOP_AFTER_BIND=1` | bind the socket, then stop itself with SIGSTOP (a process that is there and can answer nothing, nor SIGTERM) |
//! | `TESTAPP_ALLOC_MB=N` | allocate N MiB, write every page and keep it: before binding, or `TESTAPP_ALLOC_AFTER_MS` after the start (a memory limit's test) |
//! | `TESTAPP_ALLOC_AFTER_MS=N` | allocate `TESTAPP_ALLOC_MB` N ms after the process started, while serving |
//! | `TESTAPP_ALLOC_ONCE=path` | `TESTAPP_ALLOC_MB` applies only to the process that creates `path` first |
//! | `TESTAPP_PORT=N` | also bind 127.0.0.1:N itself and serve it (with `TESTAPP_NEVER_BIND`, a program that knows nothing of genswap) |
//! | `TESTAPP_NOTIFY=ready` | systemd's notify protocol: `STATUS=starting` at start, `READY=1` once bound (`never`: only the status) |
//! | `TESTAPP_DAEMONIZE=1` | fork at start: the started process exits 0, its child (a new session) goes on with the listeners handed to the start (a classic daemon) |
//! | `TESTAPP_PID_FILE=path` | write the serving process's pid to `path` once it serves (a daemon's pid file) |
//! | `TESTAPP_WATCHDOG=1` | with `WATCHDOG_USEC` set, send `WATCHDOG=1` on `NOTIFY_SOCKET` every half of it (`sd_watchdog_enabled`) |
//! | `TESTAPP_TERM_LOG=path` | append `SIGTERM` to `path` when SIGTERM arrives (to order it against a hook) |
//! | `TESTAPP_ERROR_PERCENT=N` | answer N of every 100 requests (evenly spread; never `/healthz` or `/metrics`) with `500`: a build whose health check passes while it fails its users |
//! | `TESTAPP_TRY=a,b,…` | try each forbidden thing named (`mount`, `ptrace`, `unshare-user`, `raw-socket`, `packet-socket`, `netlink-socket`, `vsock-socket`, `kexec`, `init-module`, `personality`, `realtime`, `setuid-chmod:DIR`, `setuid-create:DIR`, `write:PATH`, `read:PATH`, `list:DIR`), print `tried <thing>: ok` or `tried <thing>: <error>` for each on stdout (for `list:DIR` the sorted names instead of `ok`), and exit 0 (the sandbox's tests) |
//!
//! ## As a sidecar
//!
//! With `GENSWAP_TARGET_SOCKET` set (the agent starts it as a sidecar,
//! SPEC 5.13) it serves nothing: every 20 ms it sends `GET /` over that
//! socket, and appends to `TESTAPP_SIDECAR_REPORT` (when set) one line at
//! its start, `start generation=<G> target_pid=<P> pid=<pid>
//! socket=<GENSWAP_SOCKET or unset> listen_fds=<LISTEN_FDS or 0>`, and one
//! line per new answer, `saw generation=<G> pid=<pid> answer=<body>` (the
//! body is the generation's identity). It prints the same lines on stdout.
//! `TESTAPP_EXIT_AFTER_MS` and `TESTAPP_EXIT_CODE` apply; SIGTERM ends it.
//!
//! The forked children are created before the socket is bound, so they never
//! hold it, and their stdin/stdout/stderr point at `/dev/null`, so they keep
//! no pipe of the spawner open. They exist to prove that stopping an instance
//! (a cgroup kill) takes its grandchildren too.
//!
//! ## SIGTERM
//!
//! Unless ignored, SIGTERM starts a graceful drain: the connections already
//! queued on the listener are accepted and served, the listener is closed
//! (new connections are refused; the socket file stays, the agent owns it),
//! every response from then on carries `connection: close` (a request in
//! flight finishes), a connection idle between requests is closed once it
//! has stayed idle for 500 ms (not at once: a keep-alive client may already
//! have written its next request, which is then answered), and after all
//! connections have ended, or `TESTAPP_DRAIN_MS` has passed, the process exits
//! 0. SIGTERM before the socket is bound (boot delay, never-bind) exits 0 at
//! once.
//!
//! ## Exit codes and log
//!
//! 0 after SIGTERM; `TESTAPP_EXIT_CODE` after `TESTAPP_EXIT_AFTER_MS`; 1 when
//! the socket cannot be bound or the runtime fails; 2 for a bad knob or a
//! missing `GENSWAP_SOCKET`. It logs one line per lifecycle event to stderr,
//! never one per request, each `genswap-testapp[<pid>]: <event> key=value...`,
//! with the events `start`, `forked child`, `not binding`, `bound`,
//! `draining`, `exit` and `error`.
//!
//! A single-threaded runtime keeps many instances cheap.
//!
//! # The library
//!
//! [`binary`] finds the built server for another crate's tests and benchmarks;
//! [`make_build`] copies it into a distinct "build" with its own sha256.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// File name of the server binary in the cargo target directory.
pub const BINARY_NAME: &str = "genswap-testapp";

/// Environment variables the agent passes to every instance.
pub mod env {
    /// Path of the unix socket to serve on.
    pub const SOCKET: &str = "GENSWAP_SOCKET";
    /// Generation number, echoed in the body and `x-genswap-generation`.
    pub const GENERATION: &str = "GENSWAP_GENERATION";
    /// Build identifier, echoed in the body and `x-genswap-build`.
    pub const BUILD: &str = "GENSWAP_BUILD";
}

/// Names of the failure knobs (environment variables); see the crate docs.
pub mod knob {
    /// Sleep this many ms before binding.
    pub const BOOT_DELAY_MS: &str = "TESTAPP_BOOT_DELAY_MS";
    /// Answer every request with this status code.
    pub const STATUS: &str = "TESTAPP_STATUS";
    /// Exit this many ms after start, with [`EXIT_CODE`].
    pub const EXIT_AFTER_MS: &str = "TESTAPP_EXIT_AFTER_MS";
    /// Exit code for [`EXIT_AFTER_MS`] (default 1).
    pub const EXIT_CODE: &str = "TESTAPP_EXIT_CODE";
    /// With [`EXIT_AFTER_MS`]: exit only if this path can be created (it
    /// did not exist), so one process of many exits.
    pub const EXIT_ONCE: &str = "TESTAPP_EXIT_ONCE";
    /// `1`: ignore SIGTERM.
    pub const IGNORE_SIGTERM: &str = "TESTAPP_IGNORE_SIGTERM";
    /// Longest wait for in-flight requests after SIGTERM, in ms (default 2000).
    pub const DRAIN_MS: &str = "TESTAPP_DRAIN_MS";
    /// Fork this many children that ignore SIGTERM and sleep forever.
    pub const FORK_CHILDREN: &str = "TESTAPP_FORK_CHILDREN";
    /// Delay every response by this many ms.
    pub const SLOW_MS: &str = "TESTAPP_SLOW_MS";
    /// `1`: never bind the socket.
    pub const NEVER_BIND: &str = "TESTAPP_NEVER_BIND";
    /// `1`: read requests but never answer.
    pub const HANG: &str = "TESTAPP_HANG";
    /// `1`: SIGSTOP itself right after binding.
    pub const STOP_AFTER_BIND: &str = "TESTAPP_STOP_AFTER_BIND";
    /// Allocate and write this many MiB, and keep them.
    pub const ALLOC_MB: &str = "TESTAPP_ALLOC_MB";
    /// With [`ALLOC_MB`]: allocate this many ms after the start, not before
    /// binding.
    pub const ALLOC_AFTER_MS: &str = "TESTAPP_ALLOC_AFTER_MS";
    /// With [`ALLOC_MB`]: allocate only if this path can be created.
    pub const ALLOC_ONCE: &str = "TESTAPP_ALLOC_ONCE";
    /// Also bind and serve 127.0.0.1 on this port itself, as a program
    /// that knows nothing of genswap does.
    pub const PORT: &str = "TESTAPP_PORT";
    /// systemd's notify protocol on `NOTIFY_SOCKET`: `ready` says
    /// `STATUS=starting` at start and `READY=1` once bound; `never` says
    /// only `STATUS=starting`.
    pub const NOTIFY: &str = "TESTAPP_NOTIFY";
    /// `1`: daemonize as a classic daemon does: fork, the started process
    /// exits 0, the child (in a new session) serves.
    pub const DAEMONIZE: &str = "TESTAPP_DAEMONIZE";
    /// Write the serving process's pid to this path once it serves.
    pub const PID_FILE: &str = "TESTAPP_PID_FILE";
    /// `1`: with `WATCHDOG_USEC` set, send `WATCHDOG=1` every half of it.
    pub const WATCHDOG: &str = "TESTAPP_WATCHDOG";
    /// Append `SIGTERM` to this file when SIGTERM arrives.
    pub const TERM_LOG: &str = "TESTAPP_TERM_LOG";
    /// As a sidecar (`GENSWAP_TARGET_SOCKET` set): where it reports what
    /// its generation answers.
    pub const SIDECAR_REPORT: &str = "TESTAPP_SIDECAR_REPORT";
    /// Forbidden things to try, comma-separated; then exit.
    pub const TRY: &str = "TESTAPP_TRY";
    /// Answer this many of every 100 requests with a 500 (never
    /// `/healthz`): a build that passes its health check and still fails
    /// its users.
    pub const ERROR_PERCENT: &str = "TESTAPP_ERROR_PERCENT";

    /// Every knob, for flag parsing.
    pub const ALL: [&str; 24] = [
        BOOT_DELAY_MS,
        STATUS,
        EXIT_AFTER_MS,
        EXIT_CODE,
        EXIT_ONCE,
        IGNORE_SIGTERM,
        DRAIN_MS,
        FORK_CHILDREN,
        SLOW_MS,
        NEVER_BIND,
        HANG,
        STOP_AFTER_BIND,
        ALLOC_MB,
        ALLOC_AFTER_MS,
        ALLOC_ONCE,
        PORT,
        NOTIFY,
        DAEMONIZE,
        PID_FILE,
        WATCHDOG,
        TERM_LOG,
        SIDECAR_REPORT,
        TRY,
        ERROR_PERCENT,
    ];
}

/// The response body the server sends for its identity.
pub fn identity_body(build: &str, generation: &str, pid: u32) -> String {
    format!("build={build} generation={generation} pid={pid}\n")
}

/// What failed while finding or copying the server binary.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The path of the running executable is unknown.
    #[error("cannot find the running executable")]
    CurrentExe(#[source] std::io::Error),
    /// The running executable is not inside a cargo target profile directory.
    #[error("{exe} is not inside a cargo target directory")]
    NotInTarget {
        /// The running executable.
        exe: PathBuf,
    },
    /// The server is not built in the profile directory of the running executable.
    #[error("{path} does not exist: run `cargo build -p testapp` (same profile and target dir)")]
    NotBuilt {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// The build name is not one plain file name.
    #[error("build name {name:?} must be a single non-empty file name")]
    BadName {
        /// The name given.
        name: String,
    },
    /// The server binary could not be read.
    #[error("reading {path}")]
    Read {
        /// The binary.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The build could not be written.
    #[error("writing {path}")]
    Write {
        /// The build being written.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// The built `genswap-testapp` in the cargo profile directory of the running
/// executable (`target/<profile>/`, whether this runs from `deps/`,
/// `examples/` or the profile directory itself).
pub fn binary() -> Result<PathBuf, Error> {
    let exe = std::env::current_exe().map_err(Error::CurrentExe)?;
    binary_beside(&exe)
}

fn binary_beside(exe: &Path) -> Result<PathBuf, Error> {
    let not_in_target = || Error::NotInTarget {
        exe: exe.to_path_buf(),
    };
    let mut dir = exe.parent().ok_or_else(not_in_target)?;
    if matches!(
        dir.file_name().and_then(|n| n.to_str()),
        Some("deps" | "examples")
    ) {
        dir = dir.parent().ok_or_else(not_in_target)?;
    }
    let path = dir.join(BINARY_NAME);
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::NotBuilt { path })
    }
}

/// Copies the shared libraries and the loader `ldd` names for `binary`
/// into `tree`, each at its path on the node: a tree the dynamically
/// linked server runs in as its root.
pub fn copy_libraries(tree: &Path, binary: &Path) -> Result<(), Error> {
    let output = std::process::Command::new("ldd")
        .arg(binary)
        .output()
        .map_err(|source| Error::Read {
            path: binary.to_path_buf(),
            source,
        })?;
    if !output.status.success() {
        return Err(Error::Read {
            path: binary.to_path_buf(),
            source: std::io::Error::other(format!(
                "ldd: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            )),
        });
    }
    let text = String::from_utf8_lossy(&output.stdout);
    for library in text
        .split_whitespace()
        .filter_map(|word| word.strip_prefix('/'))
        .map(Path::new)
    {
        let copy = tree.join(library);
        let write_err = |source| Error::Write {
            path: copy.clone(),
            source,
        };
        if let Some(dir) = copy.parent() {
            fs::create_dir_all(dir).map_err(write_err)?;
        }
        fs::copy(Path::new("/").join(library), &copy).map_err(write_err)?;
    }
    Ok(())
}

/// A copy of the server that differs from every other build by its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Build {
    /// The executable file, mode 0755.
    pub path: PathBuf,
    /// Lowercase hex sha256 of the file.
    pub sha256: String,
}

/// Copies [`binary`] to `dir/name` with the bytes of `name` appended (an ELF
/// file ignores trailing bytes, so it still runs, with a sha256 of its own),
/// mode 0755. An existing file there is replaced.
///
/// Exec the result only after this returns: like any freshly written
/// executable, a process forked by another thread while the file was open for
/// writing can make an exec fail with `ETXTBSY` for a moment.
pub fn make_build(dir: &Path, name: &str) -> Result<Build, Error> {
    make_build_from(&binary()?, dir, name)
}

/// [`make_build`] of another build of the server at `source` (a statically
/// linked one, for a file system without the host's libraries).
pub fn make_build_from(source: &Path, dir: &Path, name: &str) -> Result<Build, Error> {
    let single_name = Path::new(name).file_name().and_then(|n| n.to_str()) == Some(name);
    if !single_name {
        return Err(Error::BadName {
            name: name.to_string(),
        });
    }
    let mut bytes = fs::read(source).map_err(|source_err| Error::Read {
        path: source.to_path_buf(),
        source: source_err,
    })?;
    bytes.extend_from_slice(name.as_bytes());

    let path = dir.join(name);
    let write_err = |source| Error::Write {
        path: path.clone(),
        source,
    };
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o755)
        .open(&path)
        .map_err(write_err)?;
    file.write_all(&bytes).map_err(write_err)?;
    // `mode` applies only to a new file; a replaced one keeps its old mode.
    file.set_permissions(fs::Permissions::from_mode(0o755))
        .map_err(write_err)?;
    drop(file);

    Ok(Build {
        sha256: hex::encode(Sha256::digest(&bytes)),
        path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target_with_binary() -> tempfile::TempDir {
        let target = tempfile::tempdir().expect("temp dir");
        let profile = target.path().join("debug");
        fs::create_dir_all(profile.join("deps")).expect("deps dir");
        fs::create_dir_all(profile.join("examples")).expect("examples dir");
        fs::write(profile.join(BINARY_NAME), b"").expect("fake binary");
        target
    }

    #[test]
    fn finds_the_binary_from_deps_examples_and_the_profile_dir() {
        let target = target_with_binary();
        let expected = target.path().join("debug").join(BINARY_NAME);
        for exe in ["debug/deps/it-0123", "debug/examples/demo", "debug/demo"] {
            let found = binary_beside(&target.path().join(exe)).expect("found");
            assert_eq!(found, expected, "from {exe}");
        }
    }

    #[test]
    fn a_missing_binary_says_how_to_build_it() {
        let target = tempfile::tempdir().expect("temp dir");
        let err = binary_beside(&target.path().join("release/deps/bench-1"))
            .expect_err("nothing is built there");
        let message = err.to_string();
        assert!(
            message.contains("cargo build -p testapp"),
            "message: {message}"
        );
        assert!(
            message.contains(
                &target
                    .path()
                    .join("release")
                    .join(BINARY_NAME)
                    .display()
                    .to_string()
            ),
            "message: {message}"
        );
    }

    #[test]
    fn build_names_that_are_not_plain_file_names_are_refused() {
        let dir = tempfile::tempdir().expect("temp dir");
        for name in ["", ".", "..", "a/b", "/abs"] {
            assert!(
                matches!(make_build(dir.path(), name), Err(Error::BadName { .. })),
                "{name:?} accepted"
            );
        }
    }
}
