//! A generation's life beyond its exec and its stop signal (SPEC 5.5 steps
//! 6 and 9): the `lifecycle.preStop` hook, run before the stop signal as
//! systemd's `ExecStop` or a pod's `preStop` is, and the start of a
//! program that daemonizes, handed over to the process its
//! `process.pidFile` names (systemd's `Type=forking`).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use genswap_crds::SwapAttemptSpec;
use tokio::time::Instant;

use super::{Engine, Process, Running, parts};
use crate::cgroup::Cgroup;
use crate::classify::StepError;
use crate::command::{CommandEnd, CommandSpec, GenerationCommands};
use crate::gate::InstanceKey;

/// What the stop signal still gets after a hook that used the whole stop
/// timeout: the kubelet's two seconds.
pub(super) const OVERRUN_GRACE: Duration = Duration::from_secs(2);
/// How often the pid file is looked at while it names no process yet.
const PID_FILE_POLL: Duration = Duration::from_millis(20);

/// A generation's `preStop` command, ready to run against it.
#[derive(Clone, Debug)]
pub(crate) struct PreStop {
    commands: GenerationCommands,
    command: CommandSpec,
}

impl PreStop {
    /// `running`'s hook as `spec` asks for it; none without one.
    pub(super) fn of(
        engine: &Engine,
        instance: &InstanceKey,
        spec: &SwapAttemptSpec,
        running: &Running,
    ) -> Option<PreStop> {
        let command = spec.lifecycle.as_ref()?.pre_stop_command()?;
        Some(PreStop {
            commands: parts::generation_commands(engine, instance, spec, running),
            command: CommandSpec::new(command)?,
        })
    }

    /// Runs the hook against the generation whose main process is
    /// `main_pid` (its `MAINPID`), killed with proof past `limit`. A hook
    /// that fails does not keep the generation from stopping: what went
    /// wrong is returned for the log.
    pub(super) async fn run(&self, main_pid: u32, limit: Duration) -> Result<(), String> {
        use std::os::unix::process::ExitStatusExt;
        let commands = self
            .commands
            .clone()
            .with_var("MAINPID", main_pid.to_string());
        match commands.run(&self.command, limit).await {
            Ok(CommandEnd::Exited { status, .. }) if status.success() => Ok(()),
            Ok(CommandEnd::Exited { status, output }) => Err(format!(
                "preStop {} ended with {}{}",
                self.command,
                genswap_crds::exit_text(status.code(), status.signal()),
                quoted(&output)
            )),
            Ok(CommandEnd::TimedOut { after, output }) => Err(format!(
                "preStop {} did not finish within {after:.1?} (stop.timeoutSeconds); it was killed{}",
                self.command,
                quoted(&output)
            )),
            Err(error) => Err(format!("preStop could not run: {error}")),
        }
    }
}

fn quoted(output: &str) -> String {
    if output.is_empty() {
        String::new()
    } else {
        format!("; it wrote: {output}")
    }
}

/// systemd's `Type=forking` start: waits, until `deadline`, for the
/// started process to exit 0 and for `pid_file` to name a process of the
/// generation's own cgroup, which then is the generation's main process.
pub(super) async fn hand_over(
    running: &mut Running,
    pid_file: &Path,
    deadline: Instant,
) -> Result<(), StepError> {
    let generation = running.record.n;
    let problem = |problem: String| StepError::PidFile {
        generation,
        path: pid_file.to_path_buf(),
        problem,
    };
    let Process::Spawned(child) = &mut running.process else {
        return Ok(());
    };
    let started_pid = child.pid();
    let status = match tokio::time::timeout_at(deadline, child.wait()).await {
        Ok(status) => status.map_err(StepError::Spawn)?,
        Err(_) => {
            return Err(problem(format!(
                "the started process (pid {started_pid}) did not exit within health.timeoutSeconds: with process.pidFile it must start the daemon and exit 0 (systemd's Type=forking); a program that stays in the foreground needs no pidFile"
            )));
        }
    };
    if !status.success() {
        return Err(StepError::Exited {
            generation,
            when: "before it was healthy",
            status,
            oom_killed: running.cgroup.oom_killed(),
        });
    }
    loop {
        match named_process(pid_file, &running.cgroup) {
            Ok(pid) => {
                tracing::info!(generation, started_pid, pid, pid_file = %pid_file.display(), "the start exited 0; the pid file names the generation's main process");
                running.process = Process::Forked { pid };
                return Ok(());
            }
            Err(PidFileProblem::Final(text)) => return Err(problem(text)),
            Err(PidFileProblem::NotYet(text)) => {
                if Instant::now() + PID_FILE_POLL > deadline {
                    return Err(problem(format!("{text} within health.timeoutSeconds")));
                }
                tokio::time::sleep(PID_FILE_POLL).await;
            }
        }
    }
}

/// Why a pid file names no process of the generation: `NotYet` may change
/// (a daemon writes it a moment after its start exits), `Final` will not.
#[derive(Debug)]
pub(super) enum PidFileProblem {
    NotYet(String),
    Final(String),
}

/// The pid `pid_file` names, when that process is in `cgroup` itself (not
/// a command's cgroup below it, nor anywhere else on the host).
pub(super) fn named_process(pid_file: &Path, cgroup: &Cgroup) -> Result<u32, PidFileProblem> {
    let members = cgroup.pids().map_err(|error| {
        PidFileProblem::Final(format!("the generation's cgroup cannot be read: {error}"))
    })?;
    if members.is_empty() {
        return Err(PidFileProblem::Final(
            "the started process exited 0 and left nothing running in the generation's cgroup: the daemon it started exited too (its own log says why)".into(),
        ));
    }
    let text = match fs::read_to_string(pid_file) {
        Ok(text) => text,
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            return Err(PidFileProblem::NotYet("was not written".into()));
        }
        Err(error) => return Err(PidFileProblem::NotYet(format!("cannot be read: {error}"))),
    };
    let Some(pid) = text.trim().parse::<u32>().ok().filter(|pid| *pid > 0) else {
        return Err(PidFileProblem::NotYet(format!(
            "holds {:?}, not a pid",
            text.chars().take(64).collect::<String>()
        )));
    };
    if members.contains(&pid) {
        Ok(pid)
    } else {
        let listed: Vec<String> = members.iter().map(u32::to_string).collect();
        Err(PidFileProblem::NotYet(format!(
            "names pid {pid}, which is not in the generation's cgroup (it holds pids {})",
            listed.join(", ")
        )))
    }
}

/// `pid_file` as a path, from a spec's `process.pidFile`.
pub(super) fn pid_file_of(spec: &SwapAttemptSpec) -> Option<PathBuf> {
    spec.process.pid_file.as_deref().map(PathBuf::from)
}
