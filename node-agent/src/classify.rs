//! The one outcome classifier (SPEC 5.4).
//!
//! Every step of an attempt (stage, admit, raise, journal, spawn, health,
//! settle, switch, retire, stop) that does not succeed ends with a
//! [`StepError`], and [`classify`] is the only place that decides what that
//! error means:
//!
//! | error | step outcome | attempt outcome |
//! |---|---|---|
//! | the attempt's lifetime ended (shutdown, intentional stop), whatever the step met | `cancelled` | `abandoned` |
//! | the gate refused (superseded, not the node's owner, shutting down, swaps off) | `stale` | `abandoned` |
//! | the instance is mid-operation, or its serving generation cannot overlap | `stale` | `abandoned` |
//! | staging refused (missing, unreadable, not executable, outside the root, escaping symlink, too large, download failed, the store unusable) | `stale` | `abandoned` |
//! | staging found the build broken (a digest mismatch, an archive entry or limit refused, an entrypoint that cannot run) | `failed` | `failed` (nothing ran: `executed: false`) |
//! | resources that do not parse, a requested limit whose controller is not enabled, a cgroup that could not be made fresh or written | `stale` | `abandoned` |
//! | uid 0 refused, the run dir not usable, the intent journal not written before the exec | `stale` | `abandoned` |
//! | a spawn refused or failed before the exec (cgroup placement, setsid, setuid, chdir, fork) | `stale` | `abandoned` |
//! | `current.sock` could not move, a stop that could not be proven, the agent lost its child | `stale` | `abandoned` |
//! | an unusable health path | `stale` | `abandoned` |
//! | the exec failed, what started is not what the attempt chose, no healthy answer by the deadline, the process exited early | `failed` | `failed`; `down` once this attempt stopped the serving generation |
//!
//! Only `failed` is the build's fault. A stale step is a refusal or a fault
//! of the host, never of the build.

use std::fmt;
use std::path::PathBuf;
use std::process::ExitStatus;

use thiserror::Error;

use crate::cgroup::{CgroupError, QuantityError};
use crate::gate::{GatePoint, GateRefusal};
use crate::health::HealthError;
use crate::journal::JournalError;
use crate::spawn::SpawnError;
use crate::switch::SwitchError;
use genswap_store::StageError;

/// How one step of an attempt ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StepOutcome {
    /// The step did what it was for.
    Ok,
    /// The attempt's lifetime ended: agent shutdown or an intentional stop.
    Cancelled,
    /// A refusal: the gate's, or the host's before anything of the build ran.
    Stale,
    /// The build's own failure.
    Failed,
}

impl StepOutcome {
    /// `ok`, `cancelled`, `stale` or `failed`, as status reports it.
    pub fn as_str(self) -> &'static str {
        match self {
            StepOutcome::Ok => "ok",
            StepOutcome::Cancelled => "cancelled",
            StepOutcome::Stale => "stale",
            StepOutcome::Failed => "failed",
        }
    }

    /// Whether this is the build's fault (only [`StepOutcome::Failed`]).
    pub fn is_build_failure(self) -> bool {
        self == StepOutcome::Failed
    }
}

impl fmt::Display for StepOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why the instance's own state refuses an attempt at admission.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum AdmissionRefusal {
    /// Another attempt of the same instance is running.
    #[error("the instance is mid-operation: another attempt of it is running on this node")]
    Busy,
    /// An overlap of an instance whose serving generation is not a server.
    #[error("the serving generation is a worker, not a server: it cannot overlap")]
    NotAServer,
}

/// Why a step did not succeed: one variant per source, each carrying that
/// part's own error.
#[derive(Debug, Error)]
pub enum StepError {
    /// The attempt's lifetime ended.
    #[error("cancelled: {0}")]
    Cancelled(String),
    /// `--swap=off`.
    #[error("swaps are off on this node (--swap=off); nothing was started")]
    SwapsOff,
    /// The attempt gate refused.
    #[error("the attempt gate refused at {point}")]
    Gate {
        /// Where it was asked.
        point: GatePoint,
        /// Why it refused.
        #[source]
        refusal: GateRefusal,
    },
    /// The instance's own state refused the attempt.
    #[error("admission refused")]
    Admission(#[source] AdmissionRefusal),
    /// Staging refused the artifact.
    #[error("staging refused the artifact")]
    Stage(#[from] StageError),
    /// `resources` could not be read as a tier.
    #[error("the requested resources cannot be used as cgroup limits")]
    Tier(#[from] QuantityError),
    /// The cgroup manager refused or failed before anything ran (a limit
    /// whose controller is not enabled, a cgroup that cannot be made fresh).
    #[error("the generation's cgroup could not be prepared")]
    Cgroup(#[from] CgroupError),
    /// The process would run as uid 0 and the agent does not allow it.
    #[error("{}", if *asked { "process.user is 0 and this agent does not allow root instances" } else { "no process.user is set, so the instance would run as the agent's uid 0, and this agent does not allow root instances" })]
    RootRefused {
        /// `process.user: 0` was asked for (rather than inherited).
        asked: bool,
    },
    /// The instance's run dir could not be made ready.
    #[error("the instance run dir {} could not be prepared", path.display())]
    RunDir {
        /// The run dir.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The generation's socket path, which the agent chose, is longer than
    /// a unix socket path may be: the run dir's fault, never the build's.
    #[error(
        "the generation socket {} would be {} bytes, over the {} a unix socket path may have; the run dir is too long",
        path.display(),
        path.as_os_str().len(),
        crate::disk_name::SOCKET_PATH_MAX
    )]
    SocketPath {
        /// The socket path.
        path: PathBuf,
    },
    /// A listening socket the spec asks for could not be held.
    #[error("the instance's listeners could not be held")]
    Listener(#[from] crate::listeners::ListenerError),
    /// The intent journal could not be written.
    #[error("the intent journal could not be written")]
    Journal(#[from] JournalError),
    /// The spawn or the exec failed.
    #[error("the successor could not be started")]
    Spawn(#[source] SpawnError),
    /// What started is not what the attempt chose.
    #[error("what started is not what the attempt chose: {what}")]
    Identity {
        /// What differs.
        what: String,
    },
    /// No healthy answer.
    #[error("the successor did not become healthy")]
    Unhealthy(#[source] HealthError),
    /// The successor's main process exited when it should be serving.
    #[error("generation {generation} exited {when} ({status}{})", if *oom_killed { "; the kernel OOM-killed it at its memory limit: memory.events counts an oom_kill" } else { "" })]
    Exited {
        /// The generation.
        generation: u64,
        /// When: before it was healthy, inside the settle window, before
        /// the switch.
        when: &'static str,
        /// How.
        status: ExitStatus,
        /// The kernel's OOM killer killed a process of its cgroup.
        oom_killed: bool,
    },
    /// The started process exited 0 and left processes in its cgroup: it
    /// daemonized, and nothing names which one is the generation.
    #[error("generation {generation} exited 0 {when} while its cgroup still holds {} (pids {}): it daemonized; run it in the foreground (its own flag, such as nginx's `daemon off;`), or set process.pidFile to the file it writes its pid to", if pids.len() == 1 { "a process" } else { "processes" }, pids.iter().map(u32::to_string).collect::<Vec<_>>().join(", "))]
    Daemonized {
        generation: u64,
        when: &'static str,
        pids: Vec<u32>,
    },
    /// With `process.pidFile`, the start did not hand over to a process of
    /// the generation.
    #[error("generation {generation}: process.pidFile {}: {problem}", path.display())]
    PidFile {
        generation: u64,
        path: std::path::PathBuf,
        problem: String,
    },
    /// The process `process.pidFile` named exited; not the agent's child,
    /// so how is unknown.
    #[error(
        "generation {generation}'s main process (pid {pid}, named by process.pidFile) exited {when}; its exit status is unknown: it is not the agent's child"
    )]
    ForkedExited {
        generation: u64,
        pid: u32,
        when: &'static str,
    },
    /// `current.sock` could not move; nothing switched.
    #[error("current.sock could not be switched")]
    Switch(#[from] SwitchError),
    /// A generation could not be proven stopped.
    #[error("the generation could not be proven stopped")]
    Stop(#[source] CgroupError),
    /// The engine broke one of its own rules (a bug): refused, never blamed
    /// on the build.
    #[error("internal error: {0}")]
    Internal(&'static str),
}

/// THE classifier: what a step's result means (SPEC 5.4). `lifetime_ended`
/// is whether the attempt's own lifetime (its cancel token) has ended: then
/// whatever error the step met is a cancellation, never the build's fault.
pub fn classify<T>(result: &Result<T, StepError>, lifetime_ended: bool) -> StepOutcome {
    let error = match result {
        Ok(_) => return StepOutcome::Ok,
        Err(error) => error,
    };
    if lifetime_ended {
        return StepOutcome::Cancelled;
    }
    match error {
        StepError::Cancelled(_) => StepOutcome::Cancelled,
        StepError::Unhealthy(HealthError::Cancelled { .. }) => StepOutcome::Cancelled,
        // Refusals: the gate's, the instance's, and the host's before
        // anything of the build ran.
        StepError::SwapsOff
        | StepError::Gate { .. }
        | StepError::Admission(_)
        | StepError::Tier(_)
        | StepError::Cgroup(_)
        | StepError::RootRefused { .. }
        | StepError::RunDir { .. }
        | StepError::SocketPath { .. }
        | StepError::Listener(_)
        | StepError::Journal(_)
        | StepError::Internal(_) => StepOutcome::Stale,
        // Staging refused: the build's own bytes (not the pinned ones, an
        // archive that breaks a rule, an entrypoint that cannot run) are its
        // failure, though nothing of it ran; a source that is missing or
        // does not answer is a refusal that may pass.
        StepError::Stage(error) if error.is_build_fault() => StepOutcome::Failed,
        StepError::Stage(_) => StepOutcome::Stale,
        // Faults of the host after the build ran: the link that did not
        // move, a stop without proof. Not the build's doing.
        StepError::Switch(_) | StepError::Stop(_) => StepOutcome::Stale,
        StepError::Spawn(error) => match error {
            // The build's own failure: its exec failed (missing
            // interpreter, bad format). Nothing of it ran, but it cannot run.
            SpawnError::Exec { .. } | SpawnError::MissingInterpreter { .. } => StepOutcome::Failed,
            // Refused or failed before the exec: nothing of the build ran,
            // and the cause is the host's or the configuration's.
            SpawnError::RootRefused { .. }
            | SpawnError::ExecBusy { .. }
            | SpawnError::InvalidSpec { .. }
            | SpawnError::Confine { .. }
            | SpawnError::OpenCgroup { .. }
            | SpawnError::Prepare { .. }
            | SpawnError::Fork { .. }
            | SpawnError::Setup { .. }
            | SpawnError::Filesystem { .. } => StepOutcome::Stale,
            // The agent lost track of a running process: the host's fault.
            SpawnError::Wait { .. } => StepOutcome::Stale,
        },
        // An unusable health path says nothing about the build.
        StepError::Unhealthy(HealthError::Invalid(_)) => StepOutcome::Stale,
        StepError::Unhealthy(HealthError::Timeout { .. } | HealthError::Request { .. }) => {
            StepOutcome::Failed
        }
        // The build's own failures.
        StepError::Identity { .. }
        | StepError::Exited { .. }
        | StepError::Daemonized { .. }
        | StepError::PidFile { .. }
        | StepError::ForkedExited { .. } => StepOutcome::Failed,
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::os::unix::process::ExitStatusExt;
    use std::time::Duration;

    use super::*;
    use crate::cgroup::Controller;
    use crate::observation::Observation;
    use crate::spawn::SetupStep;

    fn io_error() -> io::Error {
        io::Error::other("boom")
    }

    fn outcome(error: StepError) -> StepOutcome {
        classify(&Err::<(), _>(error), false)
    }

    #[test]
    fn success_is_ok_whatever_the_lifetime() {
        assert_eq!(classify(&Ok::<(), StepError>(()), false), StepOutcome::Ok);
        assert_eq!(classify(&Ok::<(), StepError>(()), true), StepOutcome::Ok);
    }

    #[test]
    fn an_ended_lifetime_makes_any_error_a_cancellation() {
        let timeout = StepError::Unhealthy(HealthError::Timeout {
            probe: "/run/a/gen-2.sock (GET /)".into(),
            timeout: Duration::from_secs(1),
            attempts: 3,
            last: Observation::Refused,
        });
        assert_eq!(
            classify(&Err::<(), _>(timeout), true),
            StepOutcome::Cancelled
        );
        assert_eq!(
            outcome(StepError::Cancelled("shutdown".into())),
            StepOutcome::Cancelled
        );
        let cancelled_health = StepError::Unhealthy(HealthError::Cancelled {
            probe: "/run/a/gen-2.sock (GET /)".into(),
            attempts: 1,
            elapsed: Duration::ZERO,
        });
        assert_eq!(outcome(cancelled_health), StepOutcome::Cancelled);
    }

    #[test]
    fn refusals_and_host_faults_are_stale() {
        let stale = [
            StepError::SwapsOff,
            StepError::Gate {
                point: GatePoint::Exec,
                refusal: GateRefusal::Superseded { newest: 9 },
            },
            StepError::Admission(AdmissionRefusal::Busy),
            StepError::Stage(StageError::Missing {
                path: "/staging/b2".into(),
            }),
            StepError::Cgroup(CgroupError::LimitNotApplied {
                controller: Controller::Memory,
                path: "/sys/fs/cgroup/genswap/a.b/gen-2".into(),
                reason: "not enabled".into(),
                source: None,
            }),
            StepError::Cgroup(CgroupError::NotFresh {
                path: "/sys/fs/cgroup/genswap/a.b/gen-2".into(),
                reason: "still populated".into(),
            }),
            StepError::RootRefused { asked: true },
            StepError::SocketPath {
                path: format!("/{}/gen-1.sock", "r".repeat(120)).into(),
            },
            StepError::Journal(JournalError::Write {
                path: "/state/journal/a.b.json".into(),
                source: io_error(),
            }),
            StepError::Spawn(SpawnError::Setup {
                generation: 2,
                step: SetupStep::Uid,
                source: io_error(),
            }),
            StepError::Spawn(SpawnError::ExecBusy {
                generation: 2,
                exe: "/store/sha256-ab".into(),
                tries: 7,
                source: io_error(),
            }),
            StepError::Switch(SwitchError::TargetMissing {
                target: "/run/a.b/gen-2.sock".into(),
            }),
            StepError::Stop(CgroupError::NotProvenStopped {
                path: "/sys/fs/cgroup/genswap/a.b/gen-1".into(),
                waited: Duration::from_secs(30),
                pids: vec![42],
            }),
            StepError::Unhealthy(HealthError::Invalid(
                crate::probe::ProbeError::InvalidPath { path: "x".into() },
            )),
        ];
        for error in stale {
            let text = error.to_string();
            assert_eq!(outcome(error), StepOutcome::Stale, "{text}");
        }
    }

    #[test]
    fn only_the_builds_own_failures_are_failed() {
        let failed = [
            StepError::Stage(StageError::DigestMismatch {
                source_name: "/staging/b2".into(),
                expected: "a".repeat(64),
                actual: "b".repeat(64),
            }),
            StepError::Stage(StageError::Unpack {
                source_name: "/staging/b2.tar".into(),
                format: "tar",
                error: genswap_store::UnpackError::Refused {
                    layer: "the archive".into(),
                    entry: "../x".into(),
                    rule: genswap_store::Rule::ParentComponent,
                },
            }),
            StepError::Spawn(SpawnError::Exec {
                generation: 2,
                exe: "/store/sha256-ab".into(),
                source: io_error(),
            }),
            StepError::Unhealthy(HealthError::Timeout {
                probe: "/run/a.b/gen-2.sock (GET /)".into(),
                timeout: Duration::from_secs(30),
                attempts: 100,
                last: Observation::Status(500),
            }),
            StepError::Exited {
                generation: 2,
                when: "inside the settle window",
                status: ExitStatus::from_raw(256),
                oom_killed: false,
            },
            StepError::Exited {
                generation: 2,
                when: "before it was healthy",
                status: ExitStatus::from_raw(9),
                oom_killed: true,
            },
            StepError::Identity {
                what: "another executable".into(),
            },
            StepError::Daemonized {
                generation: 2,
                when: "before it was healthy",
                pids: vec![41, 42],
            },
            StepError::PidFile {
                generation: 2,
                path: "/run/app.pid".into(),
                problem: "names pid 1, which is not in the generation's cgroup".into(),
            },
            StepError::ForkedExited {
                generation: 2,
                pid: 42,
                when: "inside the settle window",
            },
        ];
        for error in failed {
            let text = error.to_string();
            let class = outcome(error);
            assert_eq!(class, StepOutcome::Failed, "{text}");
            assert!(class.is_build_failure());
        }
    }
}
