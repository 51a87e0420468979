//! The engine's calls into its parts (stage, spawn, health, cgroup, switch,
//! journal), each turned into a [`StepError`] the one classifier reads.

use std::fs;
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Duration;

use genswap_crds::{BuildSpec, ProcessSpec, StopSpec};

use super::flow::reason_of;
use super::liveness::Liveness;
use super::types::Attempt;
use super::{Engine, Process, Running};
use crate::cgroup::{Cgroup, CgroupError, Controller, RaiseRecord, StopReport, stop_signal};
use crate::classify::StepError;
use crate::command::{CommandIdentity, GenerationCommands};
use crate::gate::InstanceKey;
use crate::journal::{GenerationRecord, SavedLimits};
use crate::logs::GenerationOutput;
use crate::notify::NotifyWatch;
use crate::probe::{self, Probe};
use crate::spawn::{Output, SpawnSpec, Spawned, VerifyError};
use crate::switch::{CURRENT_SOCKET, RunLayout};
use genswap_crds::ProbeAction;
use genswap_crds::SwapAttemptSpec;

pub(super) use genswap_store::Staged;
use genswap_store::Stager;

/// Runs blocking file work (the journal's fsyncs) off the async threads.
pub(super) async fn blocking<T, E>(
    work: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, E>
where
    T: Send + 'static,
    E: Send + 'static,
{
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => result,
        // The work panicked: carry the panic to the caller, as a direct
        // call would have.
        Err(join) => std::panic::resume_unwind(join.into_panic()),
    }
}

/// SPEC 5.5 step 1: the artifact into the store, verified.
pub(super) async fn stage(stager: &Stager, build: &BuildSpec) -> Result<Staged, StepError> {
    Ok(stager.stage(build).await?)
}

/// Refuses uid 0 (asked for, or inherited from a root agent when no user is
/// given) unless the agent allows root instances.
pub(super) fn check_user(process: &ProcessSpec, allow_root: bool) -> Result<(), StepError> {
    if allow_root {
        return Ok(());
    }
    let uid = match process.user {
        Some(uid) => uid,
        None => i64::from(nix::unistd::geteuid().as_raw()),
    };
    if uid == 0 {
        return Err(StepError::RootRefused {
            asked: process.user.is_some(),
        });
    }
    Ok(())
}

/// The instance's run dir, made usable by the process's uid/gid (it binds
/// its socket there).
pub(super) fn prepare_run_dir(
    layout: &RunLayout,
    instance: &InstanceKey,
    process: &ProcessSpec,
) -> Result<PathBuf, StepError> {
    let dir = layout
        .create_instance_dir(instance)
        .map_err(|source| StepError::RunDir {
            path: layout.instance_dir(instance),
            source,
        })?;
    let (uid, gid) = owner_of(process);
    if uid.is_some() || gid.is_some() {
        std::os::unix::fs::chown(&dir, uid, gid).map_err(|source| StepError::RunDir {
            path: dir.clone(),
            source,
        })?;
    }
    Ok(dir)
}

/// The uid and gid a process of `process` runs as (`None`: the agent's).
fn owner_of(process: &ProcessSpec) -> (Option<u32>, Option<u32>) {
    (
        process.user.and_then(|uid| u32::try_from(uid).ok()),
        process.group.and_then(|gid| u32::try_from(gid).ok()),
    )
}

/// `process.env` as name-value pairs.
/// The instance's managed directories (SPEC 5.16) under this agent's
/// roots.
pub(super) fn managed_dirs(
    engine: &Engine,
    instance: &InstanceKey,
    process: &ProcessSpec,
) -> crate::confine::directories::ManagedDirs {
    let state_dir = engine
        .journal()
        .dir()
        .parent()
        .unwrap_or_else(|| engine.journal().dir());
    crate::confine::directories::ManagedDirs::of(
        &process.directories,
        instance,
        state_dir,
        &engine.layout.instance_dir(instance),
    )
}

/// Makes the instance's managed directories, owned by its user.
pub(super) fn ensure_managed_dirs(
    dirs: &crate::confine::directories::ManagedDirs,
    process: &ProcessSpec,
) -> Result<(), StepError> {
    let (uid, gid) = owner_of(process);
    dirs.ensure(uid, gid).map_err(|source| StepError::RunDir {
        path: dirs.paths().first().cloned().unwrap_or_default(),
        source,
    })
}

/// `env` with the managed directories' variables in place of any the spec
/// set, and `sandbox` with them writable.
pub(crate) fn with_managed_dirs(
    dirs: &crate::confine::directories::ManagedDirs,
    env: &mut Vec<(String, String)>,
    sandbox: &mut crate::confine::SandboxSpec,
) {
    for (name, value) in dirs.env() {
        env.retain(|(existing, _)| existing != &name);
        env.push((name, value));
    }
    sandbox.writable_paths.extend(dirs.paths());
}

fn env_of(process: &ProcessSpec) -> Vec<(String, String)> {
    process
        .env
        .iter()
        .map(|var| (var.name.clone(), var.value.clone()))
        .collect()
}

/// The generation's health probe for the readiness window (SPEC 5.5 step
/// 6). The caller races it with the attempt's lifetime and the process's
/// exit.
pub(super) async fn wait_healthy(probe: &Probe, timeout: Duration) -> Result<(), StepError> {
    let policy = crate::health::HealthPolicy::with_timeout(timeout);
    crate::health::wait_for(probe, &policy, std::future::pending())
        .await
        .map(|_| ())
        .map_err(StepError::Unhealthy)
}

/// What a probe of `running` reaches it by: its socket, the instance's
/// listeners, its commands' cgroup and its notify socket.
pub(super) fn probe_generation(
    engine: &Engine,
    instance: &InstanceKey,
    spec: &SwapAttemptSpec,
    running: &Running,
) -> probe::Generation {
    let mut listeners = probe::Generation::listener_endpoints(&spec.listeners);
    // A generation beside the serving one is reached through a steered
    // listener only from a source its map sends to it.
    for (name, route) in engine.listeners.probe_routes(instance, running.record.n) {
        if let Some(endpoint) = listeners.get_mut(&name)
            && let probe::Endpoint::Tcp(addr) = endpoint
        {
            *endpoint = probe::Endpoint::Steered(*addr, route);
        }
    }
    probe::Generation {
        socket: running.record.socket.clone(),
        listeners,
        commands: Some(generation_commands(engine, instance, spec, running)),
        notify: running.notify.clone(),
    }
}

/// `running`'s liveness probe as `spec` asks for it; none without a
/// `liveness` block, or for one the agent cannot make (logged).
pub(super) fn liveness_of(
    engine: &Engine,
    instance: &InstanceKey,
    spec: &SwapAttemptSpec,
    running: &Running,
) -> Option<Arc<Liveness>> {
    let wanted = spec.liveness.as_ref()?;
    let action = wanted.action()?;
    match Probe::new(&action, &probe_generation(engine, instance, spec, running)) {
        Ok(probe) => Some(Arc::new(Liveness::new(probe, wanted))),
        Err(error) => {
            tracing::error!(instance = %instance, generation = running.record.n, %error, "the liveness probe cannot be made; the generation is not probed");
            None
        }
    }
}

/// How commands against `running` run: as its user, with its environment,
/// in its working directory, below its cgroup (SPEC 5.12).
pub(super) fn generation_commands(
    engine: &Engine,
    instance: &InstanceKey,
    spec: &SwapAttemptSpec,
    running: &Running,
) -> GenerationCommands {
    let process = &spec.process;
    let (uid, gid) = owner_of(process);
    let identity = CommandIdentity {
        env: env_of(process),
        working_dir: Some(
            process
                .working_dir
                .as_deref()
                .map_or_else(|| engine.layout.instance_dir(instance), PathBuf::from),
        ),
        uid,
        gid,
        allow_root: engine.config.allow_root,
        sandbox: crate::confine::SandboxSpec {
            // Its commands see the generation's tree too.
            tree: running
                .record
                .store_path
                .as_deref()
                .and_then(genswap_store::tree::rootfs_of)
                .map(Path::to_path_buf),
            ..crate::confine::SandboxSpec::of(process)
        },
    };
    let mut identity = identity;
    with_managed_dirs(
        &managed_dirs(engine, instance, process),
        &mut identity.env,
        &mut identity.sandbox,
    );
    GenerationCommands::new(
        running.cgroup.clone(),
        engine.cgroups.mount(),
        &running.record.socket,
        running.record.n,
        &running.record.build,
        identity,
    )
}

/// Checks before anything changes that the attempt's probes can be made:
/// paths, ports, listener names and commands (SPEC 5.12).
pub(super) fn check_probes(attempt: &Attempt) -> Result<(), StepError> {
    let listeners = probe::Generation::listener_endpoints(&attempt.spec.listeners);
    let health = attempt.spec.health.action();
    probe::check(&health, &listeners)
        .and_then(
            |()| match attempt.spec.liveness.as_ref().and_then(|l| l.action()) {
                Some(ProbeAction::Watchdog) if health != ProbeAction::Notify => {
                    Err(probe::ProbeError::WatchdogWithoutNotify)
                }
                Some(action) => probe::check(&action, &listeners),
                None => Ok(()),
            },
        )
        .map_err(|e| StepError::Unhealthy(crate::health::HealthError::Invalid(e)))
}

/// An overlap's health probe through a listener judges the successor only
/// where that listener is steered (SPEC 6.3): on a shared one the kernel
/// may hand the probe to the incumbent.
pub(super) fn check_probe_listener_steered(
    engine: &Engine,
    attempt: &Attempt,
) -> Result<(), StepError> {
    let through = match attempt.spec.health.action() {
        ProbeAction::HttpGet(get) => get.listener,
        ProbeAction::Grpc(grpc) => grpc.listener,
        _ => None,
    };
    let Some(name) = through else {
        return Ok(());
    };
    let specs: Vec<_> = attempt
        .spec
        .listeners
        .iter()
        .filter(|l| l.name == name)
        .cloned()
        .collect();
    if engine.listeners.handover_of(&attempt.instance, &specs)
        == Some(crate::steering::Handover::Steered)
    {
        return Ok(());
    }
    Err(StepError::Unhealthy(crate::health::HealthError::Invalid(
        probe::ProbeError::SharedListenerInOverlap { name },
    )))
}

/// The successor's `NOTIFY_SOCKET`, bound before its exec, when its health
/// probe is `notify`.
pub(super) fn bind_notify(
    engine: &Engine,
    instance: &InstanceKey,
    spec: &SwapAttemptSpec,
    generation: u64,
    cgroup: &Cgroup,
) -> Result<Option<NotifyWatch>, StepError> {
    if spec.health.action() != ProbeAction::Notify {
        return Ok(None);
    }
    let path = engine
        .layout
        .instance_dir(instance)
        .join(crate::disk_name::notify_socket_name(generation));
    NotifyWatch::bind(&path, cgroup, owner_of(&spec.process))
        .map(Some)
        .map_err(|source| StepError::RunDir { path, source })
}

/// The journal's shape of a parent raise's previous values.
pub(super) fn saved_limits(record: &RaiseRecord) -> SavedLimits {
    let mut saved = SavedLimits::default();
    for limit in &record.saved {
        let previous = Some(limit.previous.clone());
        match limit.controller {
            Controller::Memory => saved.memory_max = previous,
            Controller::Cpu => saved.cpu_max = previous,
            Controller::Pids => saved.pids_max = previous,
        }
    }
    saved
}

/// Nothing of the instance runs after an attempt: its cgroup and run dir
/// go when they are empty, so a failed install leaves nothing behind. Each
/// removal refuses what is not empty (a generation, a socket), and the next
/// attempt makes them again.
pub(super) fn remove_empty_instance(engine: &Engine, instance: &InstanceKey) {
    let _ = engine.cgroups.instance_handle(instance).remove();
    let _ = engine.layout.remove_instance_dir(instance);
}

/// Stops a generation with proof of exit (SPEC 5.5 step 9): the stop signal,
/// `populated 0` within the stop timeout, else `cgroup.kill` and
/// `populated 0` again. Then its process is reaped and its cgroup and socket
/// removed. On an error the generation is handed back, maybe still running.
pub(super) async fn stop_generation(
    mut running: Running,
    stop: &StopSpec,
) -> Result<StopReport, (Running, CgroupError)> {
    let timeout = Duration::from_secs(u64::try_from(stop.timeout_seconds).unwrap_or(0));
    let asked = tokio::time::Instant::now();
    // Its probing ends first, then the agent's own commands against it go,
    // with proof: none outlives its generation, and none holds its cgroup
    // populated.
    running.liveness_task = None;
    if let Err(error) = crate::command::kill_commands(&running.cgroup).await {
        return Err((running, error));
    }
    // Its sidecars stop first: they follow it and must not outlive it, and
    // the generation's drain is then its own (SPEC 5.13).
    if let Some(sidecars) = running.sidecars.take()
        && let Err(error) = sidecars.stop(stop).await
    {
        return Err((running, error));
    }
    let mut signal_timeout = timeout;
    if let Some(hook) = running.pre_stop.take()
        && still_runs(&mut running)
    {
        if let Err(problem) = hook.run(running.process.pid(), timeout).await {
            tracing::warn!(cgroup = %running.cgroup.path().display(), %problem, "the preStop hook failed; the generation is stopped all the same");
        }
        signal_timeout = timeout
            .saturating_sub(asked.elapsed())
            .max(super::lifecycle::OVERRUN_GRACE);
    }
    let report = match running
        .cgroup
        .stop(stop_signal(stop.signal), signal_timeout)
        .await
    {
        Ok(report) => report,
        Err(error) => return Err((running, error)),
    };
    // Proven empty, so the main process has exited: this only reaps it (an
    // adopted one is not this agent's child to reap).
    if let Process::Spawned(child) = &mut running.process {
        let _ = child.wait().await;
    }
    remove_cgroup(&running.cgroup);
    remove_generation_files(&running.record.socket);
    // A watched one goes with its watch; an adopted one's is left on disk.
    running.notify = None;
    remove_socket(
        &running
            .record
            .socket
            .with_file_name(crate::disk_name::notify_socket_name(running.record.n)),
    );
    Ok(report)
}

/// Whether the generation's main process still runs, so a hook has
/// something to act on.
fn still_runs(running: &mut Running) -> bool {
    has_exited(running).is_none() && running.cgroup.is_populated().unwrap_or(false)
}

/// Removes an empty generation cgroup; a failure is logged (it holds
/// nothing, recovery removes it).
pub(super) fn remove_cgroup(cgroup: &Cgroup) {
    if let Err(error) = cgroup.remove() {
        tracing::warn!(
            cgroup = %cgroup.path().display(),
            error = %reason_of(&error),
            "an empty generation cgroup could not be removed"
        );
    }
}

/// Removes a stopped generation's socket and its private directory (its
/// `/tmp`, SPEC 5.16).
pub(super) fn remove_generation_files(socket: &Path) {
    remove_socket(socket);
    if let Err(error) = crate::confine::filesystem::remove_private_dir(socket) {
        tracing::warn!(socket = %socket.display(), %error, "a stopped generation's private directory could not be removed");
    }
}

/// Removes a stopped generation's socket file (only a socket).
pub(super) fn remove_socket(socket: &Path) {
    match fs::symlink_metadata(socket) {
        Ok(meta) if meta.file_type().is_socket() => {
            if let Err(error) = fs::remove_file(socket) {
                tracing::warn!(socket = %socket.display(), %error, "a stopped generation's socket could not be removed");
            }
        }
        Ok(_) => {
            tracing::warn!(socket = %socket.display(), "not removing a generation socket path that is not a socket")
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        Err(error) => {
            tracing::warn!(socket = %socket.display(), %error, "cannot inspect a stopped generation's socket")
        }
    }
}

/// SPEC 5.5 step 8's link: `current.sock` to the successor's socket. A
/// successor judged by its own socket has bound it, and must have; one
/// judged otherwise may serve only listeners or its own port.
pub(super) fn switch_current(
    attempt: &Attempt,
    instance_dir: &Path,
    socket: &Path,
) -> Result<(), crate::switch::SwitchError> {
    if attempt.spec.health.asks_generation_socket() {
        crate::switch::point_current(instance_dir, socket)
    } else {
        crate::switch::point_current_allowing_unbound(instance_dir, socket)
    }
}

/// Removes `current.sock` when nothing serves, so it never names a dead
/// socket.
pub(super) fn remove_current_link(layout: &RunLayout, instance: &InstanceKey) {
    let link = layout.instance_dir(instance).join(CURRENT_SOCKET);
    match fs::remove_file(&link) {
        Ok(()) => {}
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        Err(error) => {
            tracing::warn!(link = %link.display(), %error, "current.sock could not be removed")
        }
    }
}

/// Whether a step's error leaves it possible that a process of the build
/// started: the `executed` evidence.
pub(super) fn may_have_run(error: &StepError) -> bool {
    match error {
        StepError::Spawn(error) => error.may_have_run(),
        StepError::Identity { .. }
        | StepError::Unhealthy(_)
        | StepError::Exited { .. }
        | StepError::Daemonized { .. }
        | StepError::PidFile { .. }
        | StepError::ForkedExited { .. } => true,
        _ => false,
    }
}

/// Resolves with the generation's main process's exit status. An adopted
/// generation's status is unknown: it resolves once its cgroup is empty,
/// with an error that says so; a forked one's once the process its pid
/// file named exited.
pub(super) async fn exited(
    running: &mut Running,
    when: &'static str,
) -> Result<ExitStatus, StepError> {
    match &mut running.process {
        Process::Spawned(child) => child.wait().await.map_err(StepError::Spawn),
        Process::Forked { pid } => {
            let pid = *pid;
            if !crate::process::pid_exited(pid).await {
                // Not watchable: its cgroup emptying says it instead.
                wait_empty(&running.cgroup).await?;
            }
            Err(StepError::ForkedExited {
                generation: running.record.n,
                pid,
                when,
            })
        }
        Process::Adopted { .. } => {
            wait_empty(&running.cgroup).await?;
            Err(StepError::Internal(
                "an adopted generation exited; its exit status is unknown",
            ))
        }
    }
}

/// Waits, without a deadline, until `cgroup` is empty.
async fn wait_empty(cgroup: &Cgroup) -> Result<(), StepError> {
    loop {
        // No deadline: a long one, renewed.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3600);
        match cgroup.wait_empty(deadline).await {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(error) => return Err(StepError::Stop(error)),
        }
    }
}

/// The exit status, when the main process has already exited (never known
/// for an adopted generation).
pub(super) fn has_exited(running: &mut Running) -> Option<ExitStatus> {
    match &mut running.process {
        Process::Spawned(child) => child.try_wait().ok().flatten(),
        Process::Adopted { .. } | Process::Forked { .. } => None,
    }
}

/// How the generation went, when it exited on its own before an attempt
/// came to stop it (SPEC 5.10: the attempt's reason says so): its main
/// process's status, or, for an adopted one, that its cgroup is empty.
pub(super) fn exited_before_stop(running: &mut Running) -> Option<String> {
    if let Some(status) = has_exited(running) {
        use std::os::unix::process::ExitStatusExt;
        return Some(exit_text(status.code(), status.signal()));
    }
    let empty = running
        .cgroup
        .is_populated()
        .is_ok_and(|populated| !populated);
    match running.process {
        Process::Adopted { .. } if empty => {
            Some("its exit status is unknown: it was adopted".into())
        }
        Process::Forked { pid } if empty => Some(format!(
            "its exit status is unknown: pid {pid}, named by process.pidFile, is not the agent's child"
        )),
        _ => None,
    }
}

pub(super) use genswap_crds::exit_text;

/// How long a process that does not look like what was started is given
/// to show it is exiting (to be reaped) before that counts as a mismatch.
const EXITING_GRACE: Duration = Duration::from_secs(1);

/// What a generation is handed at exec besides its environment: its
/// output's pipes and the instance's listening sockets.
pub(super) struct Handed {
    pub(super) output: Option<GenerationOutput>,
    pub(super) listeners: Vec<crate::spawn::ActivatedSocket>,
    /// `NOTIFY_SOCKET`, for a `notify` probe.
    pub(super) notify_socket: Option<PathBuf>,
    /// The instance's managed directories, made.
    pub(super) managed: crate::confine::directories::ManagedDirs,
}

/// SPEC 5.5 step 5: starts the successor inside its fresh cgroup, with its
/// own socket, uid/gid and environment. Its working directory is the
/// spec's, else an image's `WorkingDir` inside its tree, else the
/// instance's run dir, which its uid can use.
pub(super) async fn spawn(
    spec: &genswap_crds::SwapAttemptSpec,
    successor: &GenerationRecord,
    staged: &Staged,
    cgroup: &Cgroup,
    run_dir: &Path,
    allow_root: bool,
    handed: Handed,
) -> Result<Spawned, StepError> {
    let Handed {
        output,
        listeners,
        notify_socket,
        managed,
    } = handed;
    let mut request = SpawnSpec::new(
        &staged.path,
        cgroup.clone(),
        &successor.socket,
        successor.n,
        &successor.build,
    );
    request.readable.extend(staged.tree.iter().cloned());
    // An image's config fills in what the spec leaves out (SPEC 5.14).
    request.args = staged.args(&spec.process.args);
    request.argv0 = staged.run.argv0.clone();
    request.env = staged.env(env_of(&spec.process));
    // The agent's own, when it gives them.
    request.env.retain(|(name, _)| {
        name != crate::notify::ENV_NOTIFY_SOCKET && name != crate::notify::ENV_WATCHDOG_USEC
    });
    if let Some(path) = notify_socket {
        request.env.push((
            crate::notify::ENV_NOTIFY_SOCKET.to_string(),
            path.display().to_string(),
        ));
        if let Some(usec) = spec.liveness.as_ref().and_then(|l| l.watchdog_usec()) {
            request.env.push((
                crate::notify::ENV_WATCHDOG_USEC.to_string(),
                usec.to_string(),
            ));
        }
    }
    request.working_dir = Some(
        spec.process
            .working_dir
            .as_deref()
            .map(PathBuf::from)
            .or_else(|| staged.run.working_dir.clone())
            .unwrap_or_else(|| run_dir.to_path_buf()),
    );
    (request.uid, request.gid) = owner_of(&spec.process);
    request.allow_root = allow_root;
    let mut sandbox = crate::confine::SandboxSpec::of(&spec.process);
    sandbox.tree = staged.tree.clone();
    with_managed_dirs(&managed, &mut request.env, &mut sandbox);
    request.sandbox = Some(sandbox);
    request.listeners = listeners;
    // Never the agent's own output: an agent restart would close it under
    // the instance (SPEC 5.11). Without a log shim the output is dropped.
    (request.stdout, request.stderr) = match output {
        Some(output) => (
            Output::Fd(Arc::new(output.stdout)),
            Output::Fd(Arc::new(output.stderr)),
        ),
        None => (Output::Null, Output::Null),
    };
    crate::spawn::spawn(request).await.map_err(StepError::Spawn)
}

/// Checks that what started is exactly the generation, build and store path
/// the attempt chose, as the kernel reports it: the executable, the
/// generation's own cgroup and the `GENSWAP_*` values. A process that has
/// exited, or exits within [`EXITING_GRACE`] of a failed check, cannot be
/// inspected reliably; its exit is the health step's to report.
pub(super) async fn verify_identity(
    running: &mut Running,
    staged: &Staged,
) -> Result<(), StepError> {
    let Process::Spawned(child) = &mut running.process else {
        return Err(StepError::Internal(
            "only a generation this agent started can be checked against its start",
        ));
    };
    let chosen = &running.record;
    let mismatch = |what: String| Err(StepError::Identity { what });
    if child.exe() != staged.path || chosen.store_path.as_deref() != Some(staged.path.as_path()) {
        return mismatch(format!(
            "generation {} ran {}, the staged store file is {}",
            chosen.n,
            child.exe().display(),
            staged.path.display()
        ));
    }
    if child.generation() != chosen.n || child.build() != chosen.build {
        return mismatch(format!(
            "started generation {} of build {:?}, the attempt chose generation {} of {:?}",
            child.generation(),
            child.build(),
            chosen.n,
            chosen.build
        ));
    }
    if child.cgroup().path() != chosen.cgroup || child.socket() != chosen.socket {
        return mismatch(format!(
            "started in {} on {}, the attempt chose {} on {}",
            child.cgroup().path().display(),
            child.socket().display(),
            chosen.cgroup.display(),
            chosen.socket.display()
        ));
    }
    // A process on its way out loses `/proc/<pid>/exe`, and reads of its
    // environment come back cut short, a moment before it can be reaped;
    // one in the middle of an exec (a script's `exec` of its server) shows
    // the new exe before the kernel has written its environment. What it
    // showed then proves nothing: it is looked at again until the grace
    // ends. Once it is reaped, its exit is the health step's to report.
    let deadline = tokio::time::Instant::now() + EXITING_GRACE;
    let error = loop {
        let Err(error) = child.verify() else {
            return Ok(());
        };
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            break error;
        }
        if let Ok(Ok(_)) =
            tokio::time::timeout(left.min(Duration::from_millis(10)), child.wait()).await
        {
            return Ok(());
        }
    };
    match error {
        VerifyError::Mismatch { .. } => mismatch(error.to_string()),
        VerifyError::Unreadable { .. } => mismatch(format!("it cannot be inspected: {error}")),
    }
}
