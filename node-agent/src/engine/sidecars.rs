//! Sidecars (SPEC 5.13): processes that follow the serving generation.
//!
//! A generation's sidecars start once it is healthy and switched to, each
//! in its own cgroup `sidecar-<name>` below the generation's, and stop
//! before it when it retires, exits or is stopped: the kill of each
//! sidecar's cgroup proves it gone, and nothing of it outlives its
//! generation. During an overlap's drain the retiring generation keeps its
//! sidecars while the new one already has its own.
//!
//! A sidecar never fails a swap or stops its generation. Each runs under a
//! task of its own that stages its build (when it has one), starts it,
//! awaits its exit and restarts it as its `restartPolicy` says, backing
//! off as a generation's restarts do (SPEC 5.10). Its state is posted on
//! the engine's [`Board`], which status reports read; the supervisor is
//! told of each change.
//!
//! After an agent restart, recovery kills the sidecars an earlier agent
//! left (like its commands) and starts the kept generation's anew: their
//! restart counts begin again at 0.

use std::collections::HashMap;
use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use futures::future::join_all;
use genswap_crds::{
    SidecarExit, SidecarSpec, SidecarState, SidecarStatus, StopSpec, SwapAttemptSpec,
};
use tokio::sync::mpsc;

use super::supervise::{Notice, RestartBackoff};
use super::{Engine, Running};
use crate::cgroup::{Cgroup, CgroupError, stop_signal};
use crate::gate::InstanceKey;
use crate::logs::LogSink;
use crate::spawn::{ActivatedSocket, Output, SpawnSpec};
use genswap_store::Stager;

/// The prefix of a sidecar's cgroup, below its generation's.
pub const SIDECAR_CGROUP_PREFIX: &str = "sidecar-";
/// How long a sidecar's cgroup may take to empty after `cgroup.kill`.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// The sidecars of one running generation.
#[derive(Debug)]
pub(crate) struct Sidecars {
    instance: InstanceKey,
    generation: u64,
    members: Vec<Member>,
    board: Board,
}

#[derive(Debug)]
struct Member {
    cgroup: Cgroup,
    task: tokio::task::JoinHandle<()>,
}

/// What each sidecar of one generation is started with.
struct Target {
    instance: InstanceKey,
    generation: u64,
    build: String,
    /// The generation's executable: a sidecar without a build of its own
    /// runs it.
    store_path: Option<PathBuf>,
    socket: PathBuf,
    pid: u32,
    /// The instance's process: a sidecar's unset user and group are its.
    instance_process: genswap_crds::ProcessSpec,
    run_dir: PathBuf,
    /// The instance's managed directories, which its sidecars share.
    managed: crate::confine::directories::ManagedDirs,
    allow_root: bool,
    backoff: RestartBackoff,
    stager: Stager,
    logs: LogSink,
    board: Board,
    notices: mpsc::UnboundedSender<Notice>,
}

impl Sidecars {
    /// Starts `spec`'s sidecars of `running`, which is healthy and serves
    /// `instance` now; `None` when the spec has none.
    pub(super) fn start(
        engine: &Engine,
        instance: &InstanceKey,
        spec: &SwapAttemptSpec,
        running: &Running,
    ) -> Option<Sidecars> {
        if spec.sidecars.is_empty() {
            return None;
        }
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let generation = running.record.n;
        let target = Arc::new(Target {
            instance: instance.clone(),
            generation,
            build: running.record.build.clone(),
            store_path: running.record.store_path.clone(),
            socket: running.record.socket.clone(),
            pid: running.process.pid(),
            instance_process: spec.process.clone(),
            run_dir: engine.layout.instance_dir(instance),
            managed: super::parts::managed_dirs(engine, instance, &spec.process),
            allow_root: engine.config.allow_root,
            backoff: engine.config.restart_backoff,
            stager: engine.stager.clone(),
            logs: engine.logs.clone(),
            board: engine.sidecar_board.clone(),
            notices: engine.notices.sender(),
        });
        engine.sidecar_board.post(
            instance,
            generation,
            spec.sidecars
                .iter()
                .map(|sidecar| SidecarStatus {
                    name: sidecar.name.clone(),
                    state: SidecarState::Starting,
                    generation: i64::try_from(generation).unwrap_or(i64::MAX),
                    restarts: 0,
                    last_exit: None,
                    restart_at: None,
                    message: None,
                })
                .collect(),
        );
        let members = spec
            .sidecars
            .iter()
            .map(|sidecar| {
                let cgroup = sidecar_cgroup(&running.cgroup, &sidecar.name);
                let named: Vec<genswap_crds::ListenerSpec> = spec
                    .listeners
                    .iter()
                    .filter(|l| sidecar.listeners.contains(&l.name))
                    .cloned()
                    .collect();
                let listeners = engine.listeners.activated(instance, &named);
                let task = runtime.spawn(supervise(
                    Arc::clone(&target),
                    sidecar.clone(),
                    cgroup.clone(),
                    listeners,
                ));
                Member { cgroup, task }
            })
            .collect();
        tracing::info!(instance = %instance, generation, sidecars = spec.sidecars.len(), "starting the generation's sidecars");
        let _ = target
            .notices
            .send(Notice::Sidecars(instance.clone(), generation));
        Some(Sidecars {
            instance: instance.clone(),
            generation,
            members,
            board: engine.sidecar_board.clone(),
        })
    }

    /// Stops every sidecar with proof of exit: their tasks end first (no
    /// restart follows), then each cgroup gets `stop`'s signal and, past
    /// its timeout, `cgroup.kill`; then it is removed.
    pub(super) async fn stop(self, stop: &StopSpec) -> Result<(), CgroupError> {
        let timeout = Duration::from_secs(u64::try_from(stop.timeout_seconds).unwrap_or(0));
        for member in &self.members {
            member.task.abort();
        }
        let mut cgroups = Vec::with_capacity(self.members.len());
        for member in self.members {
            // Awaited, so no start of it can land after the stop below.
            let _ = member.task.await;
            cgroups.push(member.cgroup);
        }
        let stopped = join_all(
            cgroups
                .iter()
                .map(|cgroup| cgroup.stop(stop_signal(stop.signal), timeout)),
        )
        .await;
        self.board.withdraw(&self.instance, self.generation);
        for (cgroup, result) in cgroups.iter().zip(stopped) {
            result?;
            cgroup.remove()?;
        }
        Ok(())
    }
}

/// The cgroup of sidecar `name` of the generation in `generation`.
pub(crate) fn sidecar_cgroup(generation: &Cgroup, name: &str) -> Cgroup {
    Cgroup::at(
        generation
            .path()
            .join(format!("{SIDECAR_CGROUP_PREFIX}{name}")),
        None,
    )
}

/// Kills every sidecar below `generation` with proof and removes their
/// cgroups (what an earlier agent left). Returns how many there were.
pub(crate) async fn kill_sidecars(generation: &Cgroup) -> Result<usize, CgroupError> {
    let found = crate::command::child_cgroups(generation.path(), SIDECAR_CGROUP_PREFIX);
    for path in &found {
        kill_and_remove(&Cgroup::at(path, None)).await?;
    }
    Ok(found.len())
}

/// One sidecar's life beside its generation: stage, start, await the exit,
/// and again as its policy says. Ends when its policy leaves it down, or
/// when [`Sidecars::stop`] aborts it.
async fn supervise(
    target: Arc<Target>,
    sidecar: SidecarSpec,
    cgroup: Cgroup,
    listeners: Vec<ActivatedSocket>,
) {
    let policy = sidecar.effective_restart_policy();
    let mut exits_in_a_row: u32 = 0;
    let mut restarts: i32 = 0;
    loop {
        let started = Instant::now();
        let ended = run_once(&target, &sidecar, &cgroup, &listeners).await;
        // Whatever it forked goes with it, and the next start gets a fresh
        // cgroup: a start into one just killed was seen killed at once.
        if let Err(error) = kill_and_remove(&cgroup).await {
            tracing::error!(instance = %target.instance, sidecar = %sidecar.name, error = %super::flow::reason_of(&error), "what an exited sidecar left is not proven gone; it is not started again");
            return;
        }
        exits_in_a_row = if started.elapsed() >= target.backoff.reset_after {
            1
        } else {
            exits_in_a_row.saturating_add(1)
        };
        let (exit, message, clean) = match ended {
            RunEnd::Exited { code, signal } => (
                Some(SidecarExit {
                    exit_code: code,
                    signal,
                    at: crate::attempt_status::time_of(std::time::SystemTime::now()),
                }),
                None,
                code == Some(0) && signal.is_none(),
            ),
            RunEnd::NotStarted(why) => (None, Some(why), false),
        };
        let how = exit.as_ref().map_or_else(
            || message.clone().unwrap_or_default(),
            |e| genswap_crds::exit_text(e.exit_code, e.signal),
        );
        if !policy.restarts_after(clean) {
            tracing::warn!(instance = %target.instance, generation = target.generation, sidecar = %sidecar.name, how, "a sidecar ended; its restartPolicy leaves it down");
            target.update(&sidecar.name, |status| {
                status.state = SidecarState::Exited;
                status.last_exit = exit.clone();
                status.restart_at = None;
                status.message = Some(format!(
                    "{how}; restartPolicy {} does not start it again",
                    policy.as_str()
                ));
            });
            return;
        }
        let delay = target.backoff.delay(exits_in_a_row);
        restarts = restarts.saturating_add(1);
        tracing::warn!(instance = %target.instance, generation = target.generation, sidecar = %sidecar.name, how, delay_s = delay.as_secs(), "a sidecar ended; starting it again");
        target.update(&sidecar.name, |status| {
            status.state = if delay.is_zero() {
                SidecarState::Starting
            } else {
                SidecarState::BackOff
            };
            status.restarts = restarts;
            status.last_exit = exit.clone();
            status.restart_at = (!delay.is_zero())
                .then(|| crate::attempt_status::time_of(std::time::SystemTime::now() + delay));
            status.message = Some(if delay.is_zero() {
                format!("{how}; starting it again")
            } else {
                format!(
                    "{how}, {exits_in_a_row} in a row; starting it again in {:.1}s",
                    delay.as_secs_f64()
                )
            });
        });
        tokio::time::sleep(delay).await;
    }
}

/// Kills what is left in a sidecar's cgroup, with proof, and removes it.
async fn kill_and_remove(cgroup: &Cgroup) -> Result<(), CgroupError> {
    if cgroup.is_populated()? {
        cgroup.kill(KILL_WAIT).await?;
    }
    cgroup.remove()
}

/// How one run of a sidecar ended.
enum RunEnd {
    Exited {
        code: Option<i32>,
        signal: Option<i32>,
    },
    /// It could not be started: why, in words.
    NotStarted(String),
}

async fn run_once(
    target: &Target,
    sidecar: &SidecarSpec,
    cgroup: &Cgroup,
    listeners: &[ActivatedSocket],
) -> RunEnd {
    let (exe, staged) = match &sidecar.build {
        Some(build) => match target.stager.stage(build).await {
            Ok(staged) => (staged.path.clone(), Some(staged)),
            Err(error) => {
                return RunEnd::NotStarted(format!(
                    "its build {} could not be staged: {}",
                    build.id,
                    super::flow::reason_of(&error)
                ));
            }
        },
        None => match &target.store_path {
            Some(path) => (path.clone(), None),
            None => {
                return RunEnd::NotStarted(
                    "the generation's executable is not known to this agent".into(),
                );
            }
        },
    };
    if let Err(source) = fs::create_dir_all(cgroup.path()) {
        return RunEnd::NotStarted(format!(
            "its cgroup {} cannot be made: {source}",
            cgroup.path().display()
        ));
    }
    let logs = target.logs.clone();
    let (instance, generation, name) = (
        target.instance.clone(),
        target.generation,
        sidecar.name.clone(),
    );
    let output = match tokio::task::spawn_blocking(move || {
        logs.start_sidecar(&instance, generation, &name)
    })
    .await
    {
        Ok(Ok(output)) => (
            Output::Fd(Arc::new(output.stdout)),
            Output::Fd(Arc::new(output.stderr)),
        ),
        Ok(Err(error)) => {
            tracing::warn!(instance = %target.instance, sidecar = %sidecar.name, error = %super::flow::reason_of(&error), "no log for this sidecar: its output is discarded");
            (Output::Null, Output::Null)
        }
        Err(_) => (Output::Null, Output::Null),
    };
    let process = &sidecar.process;
    let exe_tree = genswap_store::tree::rootfs_of(&exe).map(Path::to_path_buf);
    let mut request = SpawnSpec::new(
        exe,
        cgroup.clone(),
        &target.socket,
        target.generation,
        &target.build,
    );
    request.target_pid = Some(target.pid);
    request.argv0 = staged.as_ref().and_then(|s| s.run.argv0.clone());
    request
        .readable
        .extend(staged.as_ref().and_then(|s| s.tree.clone()));
    let env = process
        .env
        .iter()
        .map(|var| (var.name.clone(), var.value.clone()))
        .collect();
    // A sidecar's own image fills in what its spec leaves out, as the
    // generation's does.
    (request.args, request.env) = match &staged {
        Some(staged) => (staged.args(&process.args), staged.env(env)),
        None => (process.args.clone(), env),
    };
    request.working_dir = Some(
        process
            .working_dir
            .as_deref()
            .map(PathBuf::from)
            .or_else(|| staged.as_ref().and_then(|s| s.run.working_dir.clone()))
            .unwrap_or_else(|| target.run_dir.clone()),
    );
    let id = |own: Option<i64>, instance: Option<i64>| {
        own.or(instance).and_then(|id| u32::try_from(id).ok())
    };
    request.uid = id(process.user, target.instance_process.user);
    request.gid = id(process.group, target.instance_process.group);
    request.allow_root = target.allow_root;
    // The generation's sandbox: a sidecar is part of it.
    let mut sandbox = crate::confine::SandboxSpec::of(&target.instance_process);
    // Under `process.root: build`, in its own build's tree, else the
    // generation's.
    sandbox.tree = match &staged {
        Some(staged) => staged.tree.clone(),
        None => exe_tree,
    };
    super::parts::with_managed_dirs(&target.managed, &mut request.env, &mut sandbox);
    request.sandbox = Some(sandbox);
    request.listeners = listeners.to_vec();
    (request.stdout, request.stderr) = output;
    let mut child = match crate::spawn::spawn(request).await {
        Ok(child) => child,
        Err(error) => return RunEnd::NotStarted(super::flow::reason_of(&error)),
    };
    tracing::info!(instance = %target.instance, generation = target.generation, sidecar = %sidecar.name, pid = child.pid(), "a sidecar started");
    target.update(&sidecar.name, |status| {
        status.state = SidecarState::Running;
        status.restart_at = None;
        status.message = None;
    });
    match child.wait().await {
        Ok(status) => RunEnd::Exited {
            code: status.code(),
            signal: status.signal(),
        },
        Err(error) => RunEnd::NotStarted(super::flow::reason_of(&error)),
    }
}

impl Target {
    /// Changes sidecar `name`'s posted state and tells the supervisor.
    fn update(&self, name: &str, change: impl FnOnce(&mut SidecarStatus)) {
        if self
            .board
            .update(&self.instance, self.generation, name, change)
        {
            let _ = self
                .notices
                .send(Notice::Sidecars(self.instance.clone(), self.generation));
        }
    }
}

/// The posted state of the serving generation's sidecars, per instance.
#[derive(Clone, Debug, Default)]
pub(crate) struct Board(Arc<Mutex<HashMap<InstanceKey, Posted>>>);

#[derive(Debug)]
struct Posted {
    generation: u64,
    sidecars: Vec<SidecarStatus>,
}

impl Board {
    /// The sidecars of what serves `instance`, as posted.
    pub(crate) fn of(&self, instance: &InstanceKey) -> Vec<SidecarStatus> {
        self.lock()
            .get(instance)
            .map(|posted| posted.sidecars.clone())
            .unwrap_or_default()
    }

    /// `generation`'s sidecars take over the instance's entry.
    fn post(&self, instance: &InstanceKey, generation: u64, sidecars: Vec<SidecarStatus>) {
        self.lock().insert(
            instance.clone(),
            Posted {
                generation,
                sidecars,
            },
        );
    }

    /// Changes one sidecar of `generation`; false when another generation
    /// has taken the entry over since (a retiring one's news is not shown).
    fn update(
        &self,
        instance: &InstanceKey,
        generation: u64,
        name: &str,
        change: impl FnOnce(&mut SidecarStatus),
    ) -> bool {
        let mut board = self.lock();
        let Some(posted) = board
            .get_mut(instance)
            .filter(|posted| posted.generation == generation)
        else {
            return false;
        };
        match posted.sidecars.iter_mut().find(|s| s.name == name) {
            Some(status) => {
                change(status);
                true
            }
            None => false,
        }
    }

    /// `generation`'s entry goes, unless a later one took it over.
    fn withdraw(&self, instance: &InstanceKey, generation: u64) {
        let mut board = self.lock();
        if board
            .get(instance)
            .is_some_and(|posted| posted.generation == generation)
        {
            board.remove(instance);
        }
    }

    /// Plain data every writer leaves whole: a poisoned lock is still safe.
    fn lock(&self) -> MutexGuard<'_, HashMap<InstanceKey, Posted>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
