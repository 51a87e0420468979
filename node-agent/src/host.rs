//! The host the agent runs on, from its flags: the paths, the cgroup v2
//! subtree, the engine and the attempt gate that every mode (`run`,
//! `standalone`, `demo`) builds the same way.
//!
//! [`HostArgs`] is flattened into each subcommand; [`HostSettings`] is the
//! same in plain values (what the demo and the tests fill in);
//! [`Host::build`] turns it into an [`Engine`] over real host parts and a
//! [`NewestRevisionGate`]. [`join_host_namespaces`] is SPEC 5.9's setns into
//! the host's mount and cgroup namespaces, for `run` inside a pod.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::ValueEnum;
use nix::sched::CloneFlags;
use thiserror::Error;
use tracing_subscriber::EnvFilter;

use crate::cgroup::hybrid::{self, HybridError};
use crate::cgroup::{CgroupError, CgroupManager, discover_mount};
use crate::disk_name::{self, PathLimitError};
use crate::engine::{Engine, EngineConfig, EngineParts};
use crate::gate::NewestRevisionGate;
use crate::journal::{Journal, JournalError};
use crate::logs::{HelperProgram, LogError, LogSettings, LogSink};
use crate::switch::RunLayout;
use genswap_store::{StageError, Stager, StagerConfig, Store, StoreError};

/// The cgroup subtree under the discovered v2 mount when `--cgroup-root` is
/// not given.
pub const DEFAULT_CGROUP_SUBDIR: &str = "genswap";
/// Where instance sockets and `current.sock` live by default.
pub const DEFAULT_RUN_DIR: &str = "/run/genswap";
/// Where the intent journal (and standalone mode's state) live by default.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/genswap/state";
/// Path artifacts must lie under by default.
pub const DEFAULT_STAGING_ROOT: &str = "/var/lib/genswap/staging";
/// The artifact store's directory under the state dir by default.
pub const STORE_SUBDIR: &str = "store";

/// The host flags every subcommand takes. Each has an environment variable,
/// so a DaemonSet or a systemd unit can set them without a command line.
#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct HostArgs {
    /// The cgroup v2 directory instances run under
    /// (`<root>/<namespace>.<instance>/gen-<N>`). Default:
    /// `<the cgroup v2 mount found in /proc/self/mountinfo>/genswap`.
    #[arg(long, env = "GENSWAP_CGROUP_ROOT", value_name = "DIR")]
    pub cgroup_root: Option<PathBuf>,
    /// Where generation sockets and each instance's `current.sock` live.
    #[arg(long, env = "GENSWAP_RUN_DIR", value_name = "DIR", default_value = DEFAULT_RUN_DIR)]
    pub run_dir: PathBuf,
    /// The intent journal and other state that must survive a restart.
    #[arg(long, env = "GENSWAP_STATE_DIR", value_name = "DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    /// Path artifacts (`build.artifact.path`) must lie under.
    #[arg(long, env = "GENSWAP_STAGING_ROOT", value_name = "DIR", default_value = DEFAULT_STAGING_ROOT)]
    pub staging_root: PathBuf,
    /// The content-addressed artifact store. Default: `<state-dir>/store`.
    #[arg(long, env = "GENSWAP_STORE_DIR", value_name = "DIR")]
    pub store_dir: Option<PathBuf>,
    /// The most bytes of file contents an unpacked tree (an archive build)
    /// may hold, a quantity such as `4Gi`; an archive that would pass it
    /// is refused at the entry that would, before that entry is written.
    #[arg(long, env = "GENSWAP_MAX_TREE_BYTES", value_name = "SIZE", default_value = "4Gi", value_parser = parse_tree_bytes)]
    pub max_tree_bytes: u64,
    /// The most entries (files, directories, links) an unpacked tree may
    /// hold.
    #[arg(long, env = "GENSWAP_MAX_TREE_ENTRIES", value_name = "N", default_value_t = genswap_store::DEFAULT_MAX_TREE_ENTRIES, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_tree_entries: u64,
    /// Builds the store keeps besides those in use (what serves, retires or
    /// starts, and each instance's previous build), newest first.
    #[arg(long, env = "GENSWAP_STORE_KEEP", value_name = "N", default_value_t = genswap_store::retention::DEFAULT_STORE_KEEP)]
    pub store_keep: usize,
    /// What everything the store keeps may add up to, a quantity such as
    /// `10Gi`. Builds in use are kept even past it.
    #[arg(long, env = "GENSWAP_STORE_MAX_BYTES", value_name = "SIZE", default_value = "10Gi", value_parser = parse_tree_bytes)]
    pub store_max_bytes: u64,
    /// Registry credentials for image builds: a docker `config.json`
    /// (`auths` by registry, with `auth` or `username`/`password`), the
    /// format of a `kubernetes.io/dockerconfigjson` Secret. Read at each
    /// pull, so a rotated Secret needs no restart.
    #[arg(long, env = "GENSWAP_REGISTRY_CONFIG", value_name = "FILE")]
    pub registry_config: Option<PathBuf>,
    /// PEM certificates to trust for registries besides the system's roots.
    #[arg(long, env = "GENSWAP_REGISTRY_CA", value_name = "FILE")]
    pub registry_ca: Option<PathBuf>,
    /// A registry (`host:port`) reached over plain HTTP; may be repeated.
    /// Every other registry is reached over TLS.
    #[arg(
        long,
        env = "GENSWAP_INSECURE_REGISTRY",
        value_name = "HOST:PORT",
        value_delimiter = ','
    )]
    pub insecure_registry: Vec<String>,
    /// A directory of PEM public keys (`<name>.pub` or `<name>.pem`) a build
    /// may name as `build.signedBy`: an image must then carry cosign's
    /// signature by that key, a file a `cosign sign-blob` signature. Read
    /// at each verification, so a changed ConfigMap needs no restart.
    #[arg(long, env = "GENSWAP_TRUST_KEYS", value_name = "DIR")]
    pub trust_keys: Option<PathBuf>,
    /// Refuse every build that names no `build.signedBy` key (`failed`,
    /// nothing of it fetched or run).
    #[arg(long, env = "GENSWAP_REQUIRE_SIGNATURES")]
    pub require_signatures: bool,
    /// `off` refuses every attempt (`abandoned`, nothing is spawned).
    #[arg(long, env = "GENSWAP_SWAP", value_enum, default_value_t = Swaps::On)]
    pub swap: Swaps,
    /// Let instances run as uid 0 (refused otherwise).
    #[arg(long, env = "GENSWAP_ALLOW_ROOT_INSTANCES")]
    pub allow_root_instances: bool,
    /// `steered`: a TCP listener gets a socket per generation and a BPF
    /// program picks the serving one, where the kernel allows it (SPEC
    /// 6.3); `shared`: one socket for every generation (SPEC 6.2).
    #[arg(long, env = "GENSWAP_LISTENER_HANDOVER", value_enum, default_value_t = HandoverArg::Steered)]
    pub listener_handover: HandoverArg,
    /// `run` only: do not join the host's mount and cgroup namespaces
    /// (`/proc/1/ns/mnt`, `/proc/1/ns/cgroup`) at start. Set it when the
    /// agent already runs on the host rather than in a pod. `standalone`
    /// joins them only with `--join-host-namespaces`; `demo` never does.
    /// Every mode refuses to start in a cgroup namespace other than PID 1's.
    #[arg(long, env = "GENSWAP_NO_HOST_NAMESPACES")]
    pub no_host_namespaces: bool,
    /// Where each generation's stdout and stderr are written
    /// (`<dir>/<namespace>_<name>/<N>.log`, CRI format).
    #[arg(long, env = "GENSWAP_LOG_DIR", value_name = "DIR", default_value = crate::logs::DEFAULT_LOG_DIR)]
    pub log_dir: PathBuf,
    /// A generation's log file is rotated past this size (a quantity of
    /// bytes such as `10Mi`).
    #[arg(long, env = "GENSWAP_LOG_MAX_SIZE", value_name = "SIZE", default_value = "10Mi", value_parser = parse_log_size)]
    pub log_max_size: u64,
    /// Log files kept per generation, the current one included (at least 2).
    #[arg(long, env = "GENSWAP_LOG_MAX_FILES", value_name = "N", default_value_t = crate::logs::DEFAULT_MAX_FILES, value_parser = clap::value_parser!(u32).range(2..))]
    pub log_max_files: u32,
    /// The program run as each log shim and listener keeper; default:
    /// `genswap-helper` beside the agent's binary, else the agent's binary
    /// itself (which costs about 1 MiB more per process).
    #[arg(long, env = "GENSWAP_HELPER", value_name = "FILE")]
    pub helper: Option<PathBuf>,
    /// The helper found by [`locate_helper`], before any namespace is joined.
    #[arg(skip)]
    pub helper_program: Option<HelperProgram>,
    /// The wait before the second restart in a row of an exited generation
    /// (the first is at once); each further one doubles it.
    #[arg(
        long,
        env = "GENSWAP_RESTART_BACKOFF_MS",
        value_name = "MS",
        default_value_t = 10_000
    )]
    pub restart_backoff_ms: u64,
    /// The longest wait between restarts.
    #[arg(
        long,
        env = "GENSWAP_RESTART_BACKOFF_MAX_MS",
        value_name = "MS",
        default_value_t = 300_000
    )]
    pub restart_backoff_max_ms: u64,
    /// A generation healthy this long resets the backoff.
    #[arg(
        long,
        env = "GENSWAP_RESTART_RESET_MS",
        value_name = "MS",
        default_value_t = 600_000
    )]
    pub restart_reset_ms: u64,
    /// Log line format (to stderr; the level comes from `RUST_LOG`, default
    /// info).
    #[arg(long, env = "GENSWAP_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// `--swap=on|off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Swaps {
    /// Attempts run.
    On,
    /// Every attempt is refused (`abandoned`, reason: swaps are off).
    Off,
}

/// `--listener-handover=steered|shared`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum HandoverArg {
    /// A socket per generation, steered by BPF where the kernel allows it.
    Steered,
    /// One socket shared by every generation.
    Shared,
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One JSON object per line, for log pipelines.
    Json,
    /// Human-readable lines.
    Text,
}

impl HostArgs {
    /// The flags as plain settings.
    pub fn settings(&self) -> HostSettings {
        HostSettings {
            cgroup_root: self.cgroup_root.clone(),
            run_dir: self.run_dir.clone(),
            state_dir: self.state_dir.clone(),
            staging_root: self.staging_root.clone(),
            store_dir: self.store_dir.clone(),
            tree_limits: genswap_store::TreeLimits {
                max_bytes: self.max_tree_bytes,
                max_entries: self.max_tree_entries,
            },
            retention: genswap_store::RetentionPolicy {
                keep: self.store_keep,
                max_bytes: self.store_max_bytes,
            },
            registries: genswap_store::RegistrySettings {
                config: self.registry_config.clone(),
                ca: self.registry_ca.clone(),
                insecure: self.insecure_registry.clone(),
            },
            trust: genswap_store::TrustPolicy {
                keys: self.trust_keys.clone(),
                require_signatures: self.require_signatures,
            },
            engine: EngineConfig {
                allow_root: self.allow_root_instances,
                swaps_on: self.swap == Swaps::On,
                restart_backoff: crate::engine::RestartBackoff {
                    initial: Duration::from_millis(self.restart_backoff_ms),
                    max: Duration::from_millis(
                        self.restart_backoff_max_ms.max(self.restart_backoff_ms),
                    ),
                    reset_after: Duration::from_millis(self.restart_reset_ms),
                },
                listener_handover: match self.listener_handover {
                    HandoverArg::Steered => genswap_crds::ListenerHandover::Steered,
                    HandoverArg::Shared => genswap_crds::ListenerHandover::Shared,
                },
            },
            logs: LogSettings {
                dir: self.log_dir.clone(),
                max_size: self.log_max_size,
                max_files: self.log_max_files,
                helper: self.helper_program.clone().unwrap_or_default(),
            },
        }
    }
}

/// `--max-tree-bytes`, `--store-max-bytes`: a Kubernetes quantity of
/// bytes, at least one.
fn parse_tree_bytes(text: &str) -> Result<u64, String> {
    match crate::cgroup::parse_memory_quantity(text) {
        Ok(0) => Err("the size must be at least 1 byte".into()),
        Ok(bytes) => Ok(bytes),
        Err(error) => Err(error.to_string()),
    }
}

/// `--log-max-size`: a Kubernetes quantity of bytes, at least one.
fn parse_log_size(text: &str) -> Result<u64, String> {
    match crate::cgroup::parse_memory_quantity(text) {
        Ok(0) => Err("the log size must be at least 1 byte".into()),
        Ok(bytes) => Ok(bytes),
        Err(error) => Err(error.to_string()),
    }
}

/// Where the host parts live and how the engine behaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostSettings {
    /// `None`: `<discovered cgroup v2 mount>/genswap`.
    pub cgroup_root: Option<PathBuf>,
    /// Generation sockets and `current.sock`.
    pub run_dir: PathBuf,
    /// The journal (`<state>/journal`) and standalone state.
    pub state_dir: PathBuf,
    /// Path artifacts must lie under; created when missing.
    pub staging_root: PathBuf,
    /// `None`: `<state_dir>/store`.
    pub store_dir: Option<PathBuf>,
    /// What an unpacked tree may hold.
    pub tree_limits: genswap_store::TreeLimits,
    /// Credentials, CA and plain-HTTP hosts for image builds.
    pub registries: genswap_store::RegistrySettings,
    /// `--trust-keys`, `--require-signatures`.
    pub trust: genswap_store::TrustPolicy,
    /// What the store keeps.
    pub retention: genswap_store::RetentionPolicy,
    /// Root instances and swaps on/off.
    pub engine: EngineConfig,
    /// Where generations' output is written.
    pub logs: LogSettings,
}

impl HostSettings {
    /// The store directory these settings resolve to.
    pub fn store_dir(&self) -> PathBuf {
        self.store_dir
            .clone()
            .unwrap_or_else(|| self.state_dir.join(STORE_SUBDIR))
    }
}

/// Why the host parts could not be built. Each message names the path and
/// what to do.
#[derive(Debug, Error)]
pub enum HostError {
    /// No usable cgroup v2 hierarchy (none mounted, not writable, or the
    /// given root is not in one).
    #[error(
        "no usable cgroup v2 hierarchy: {source} (genswap needs a writable cgroup v2 mount; pass --cgroup-root to choose a directory inside one)"
    )]
    Cgroup {
        #[source]
        source: CgroupError,
    },
    /// A configured directory is too long for the paths made under it.
    #[error(transparent)]
    PathTooLong(#[from] PathLimitError),
    /// `--helper` names a program that cannot be run.
    #[error("cannot use {} as the helper (--helper): {source}", path.display())]
    Helper {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A file the pod mounts could not be kept readable across the join.
    #[error("cannot keep {} readable after joining the host's mount namespace: {source}", path.display())]
    Pin {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A directory the agent needs could not be created.
    #[error("cannot create {what} {path}: {source}")]
    CreateDir {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The artifact store could not be opened.
    #[error("cannot open the artifact store: {0}")]
    Store(#[source] StoreError),
    /// The stager could not be set up (staging root, HTTP client).
    #[error("cannot set up staging: {0}")]
    Stager(#[source] StageError),
    /// The intent journal could not be opened.
    #[error("cannot open the intent journal: {0}")]
    Journal(#[source] JournalError),
    /// A host namespace could not be inspected or joined.
    #[error(
        "cannot join the host's {namespace} namespace through {path}: {source} (the agent's pod needs hostPID and CAP_SYS_ADMIN; on a host, pass --no-host-namespaces)"
    )]
    Namespace {
        namespace: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The agent is in a cgroup namespace other than PID 1's (a pod's):
    /// every cgroup it made would lie inside the pod's and die with it.
    #[error(
        "the agent's cgroup namespace is not the host's (PID 1's): it runs in a pod or container with a cgroup namespace of its own, so the instances' cgroups would lie inside its cgroup and be killed with it; let it join the host's namespaces (hostPID and CAP_SYS_ADMIN, and `run` without --no-host-namespaces, or `standalone --join-host-namespaces`)"
    )]
    PrivateCgroupNamespace,
    /// On a hybrid host, the agent's children cannot be kept out of its
    /// pod's cgroup v1 cgroups.
    #[error(transparent)]
    HybridCgroups(HybridError),
    /// The log directory or the shims' cgroup could not be set up.
    #[error("cannot set up the instances' logs: {0}")]
    Logs(#[source] LogError),
    /// The log subscriber could not be installed.
    #[error("cannot set up logging: {0}")]
    Logging(String),
}

/// The engine and gate of this host, shared by the intake and the tasks it
/// starts.
#[derive(Clone)]
pub struct Host {
    /// The swap engine over this host's parts.
    pub engine: Arc<Engine>,
    /// The attempt gate the intake observes revisions on.
    pub gate: Arc<NewestRevisionGate>,
    /// The settings it was built from, with the cgroup root resolved.
    pub settings: HostSettings,
}

impl Host {
    /// Builds the host parts: the cgroup manager (refusing to start without a
    /// writable cgroup v2 hierarchy), the run dir, the staging root, the
    /// store, the journal, the engine and a gate that does not own the node
    /// yet (the caller sets that once it holds the node).
    pub fn build(settings: &HostSettings) -> Result<Host, HostError> {
        if !shares_cgroup_namespace_with_pid_1() {
            return Err(HostError::PrivateCgroupNamespace);
        }
        for home in hybrid::leave_pod_cgroups_v1().map_err(HostError::HybridCgroups)? {
            tracing::info!(
                hierarchy = %home.hierarchy,
                pod_cgroup = %home.pod_path,
                home = %home.dir.display(),
                "hybrid host: the agent's children leave its pod's v1 cgroup"
            );
        }
        disk_name::check_run_dir(&settings.run_dir)?;
        for (what, dir) in [
            ("state dir", &settings.state_dir),
            ("log dir", &settings.logs.dir),
        ] {
            disk_name::check_dir(what, dir)?;
        }
        let cgroups = match &settings.cgroup_root {
            Some(root) => CgroupManager::open(root),
            None => discover_mount()
                .and_then(|mount| CgroupManager::open(mount.join(DEFAULT_CGROUP_SUBDIR))),
        }
        .map_err(|source| HostError::Cgroup { source })?;
        disk_name::check_dir("cgroup root", cgroups.root())?;
        let mut resolved = settings.clone();
        resolved.cgroup_root = Some(cgroups.root().to_path_buf());

        create_dir(&settings.run_dir, 0o755, "the run dir")?;
        // Traversable but not listable: instances run as their own uid and
        // must reach the store entries beneath it (the store is 0711 too);
        // the journal and standalone state below it are 0700.
        create_dir(&settings.state_dir, 0o711, "the state dir")?;
        let store_dir = settings.store_dir();
        if store_dir.starts_with(&settings.state_dir) {
            // It may exist already, made 0700 by whoever came first (the
            // node lock lives there too).
            allow_traversal(&settings.state_dir)?;
        }
        create_dir(&settings.staging_root, 0o755, "the staging root")?;
        let store = Store::open(store_dir).map_err(HostError::Store)?;
        let mut stager_config = StagerConfig::new(&settings.staging_root);
        stager_config.tree_limits = settings.tree_limits;
        stager_config.registries = settings.registries.clone();
        stager_config.retention = settings.retention;
        stager_config.trust = settings.trust.clone();
        let stager = Stager::new(store, stager_config).map_err(HostError::Stager)?;
        let journal = Journal::open(&settings.state_dir).map_err(HostError::Journal)?;
        let logs = LogSink::new(settings.logs.clone(), &cgroups).map_err(HostError::Logs)?;
        let engine = Engine::new(
            EngineParts {
                cgroups,
                layout: RunLayout::new(&settings.run_dir),
                stager,
                journal,
                logs,
            },
            settings.engine.clone(),
        );
        Ok(Host {
            engine: Arc::new(engine),
            gate: Arc::new(NewestRevisionGate::new(settings.engine.swaps_on)),
            settings: resolved,
        })
    }
}

/// Creates `path` and its parents with `mode` when missing; an existing
/// directory is left as it is.
fn create_dir(path: &Path, mode: u32, what: &'static str) -> Result<(), HostError> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(path)
        .map_err(|source| HostError::CreateDir {
            what,
            path: path.to_path_buf(),
            source,
        })
}

/// Adds search (not read) permission for group and others to `dir`, so
/// instances running as their own uid can reach the store entries below it.
fn allow_traversal(dir: &Path) -> Result<(), HostError> {
    let fail = |source| HostError::CreateDir {
        what: "open the state dir to instances (search permission)",
        path: dir.to_path_buf(),
        source,
    };
    let mode = fs::metadata(dir).map_err(fail)?.permissions().mode();
    if mode & 0o011 != 0o011 {
        fs::set_permissions(dir, fs::Permissions::from_mode(mode | 0o011)).map_err(fail)?;
    }
    Ok(())
}

/// Which host namespaces [`join_host_namespaces`] entered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JoinedNamespaces {
    /// The namespaces entered; the ones already shared with PID 1 are not
    /// listed.
    pub joined: Vec<&'static str>,
}

/// SPEC 5.9: joins PID 1's cgroup and mount namespaces, so the agent's
/// paths are host paths and its cgroup tree lies outside the pod's.
/// A namespace the agent already shares with PID 1 is left alone.
///
/// Call it before any thread starts (before the async runtime): the kernel
/// refuses to move a multi-threaded process into another mount namespace.
pub fn join_host_namespaces() -> Result<JoinedNamespaces, HostError> {
    let mut joined = JoinedNamespaces::default();
    // cgroup first: the cgroup namespace's root is resolved through the
    // caller's mounts, which the second setns replaces.
    for (namespace, flag) in [
        ("cgroup", CloneFlags::CLONE_NEWCGROUP),
        ("mnt", CloneFlags::CLONE_NEWNS),
    ] {
        let target = PathBuf::from(format!("/proc/1/ns/{namespace}"));
        let own = PathBuf::from(format!("/proc/self/ns/{namespace}"));
        let fail = |source: io::Error| HostError::Namespace {
            namespace,
            path: target.clone(),
            source,
        };
        let target_meta = fs::metadata(&target).map_err(fail)?;
        let own_meta = fs::metadata(&own).map_err(fail)?;
        if (target_meta.dev(), target_meta.ino()) == (own_meta.dev(), own_meta.ino()) {
            continue;
        }
        let file = fs::File::open(&target).map_err(fail)?;
        nix::sched::setns(&file, flag).map_err(|errno| fail(io::Error::from(errno)))?;
        joined.joined.push(namespace);
    }
    Ok(joined)
}

/// The program the agent runs as its log shims and listener keepers:
/// `explicit` (`--helper`), else `genswap-helper` beside the agent's own
/// binary, held open so that its `/proc/self/fd/N` works in any mount
/// namespace (the host's, once joined) and above every descriptor a child
/// is given. Without one beside it, the agent's own binary, with a warning:
/// it works, at about 1 MiB more per process.
pub fn locate_helper(explicit: Option<&Path>) -> Result<HelperProgram, HostError> {
    locate_helper_beside(explicit, std::env::current_exe())
}

/// [`locate_helper`] for an agent whose binary is `agent`.
fn locate_helper_beside(
    explicit: Option<&Path>,
    agent: io::Result<PathBuf>,
) -> Result<HelperProgram, HostError> {
    let candidate = match explicit {
        Some(path) => path.to_path_buf(),
        None => match agent {
            Ok(agent) => agent.with_file_name(crate::logs::HELPER_NAME),
            Err(error) => {
                tracing::warn!(%error, "cannot find the agent's own binary; its log shims and listener keepers run as {}", crate::logs::SELF_EXE);
                return Ok(HelperProgram::agent_itself());
            }
        },
    };
    match hold_executable(&candidate) {
        Ok(fd) => {
            let path = PathBuf::from(format!(
                "/proc/self/fd/{}",
                std::os::fd::AsRawFd::as_raw_fd(&fd)
            ));
            PINNED_FILES
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(fd);
            Ok(HelperProgram {
                path,
                name: HelperProgram::at(&candidate).name,
            })
        }
        Err(source) if explicit.is_some() => Err(HostError::Helper {
            path: candidate,
            source,
        }),
        Err(error) => {
            tracing::warn!(
                helper = %candidate.display(),
                %error,
                "no helper beside the agent: its log shims and listener keepers run as the agent's own binary (about 1 MiB more each)"
            );
            Ok(HelperProgram::agent_itself())
        }
    }
}

/// `path` opened for exec only, if it is an executable regular file, at a
/// descriptor no child's setup overwrites.
fn hold_executable(path: &Path) -> io::Result<std::os::fd::OwnedFd> {
    let file = fs::File::open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not an executable file",
        ));
    }
    crate::launch::fd_at_least(&file, crate::launch::SETUP_FD_FLOOR)
}

/// The helper's file, held open for the agent's life.
static PINNED_FILES: std::sync::Mutex<Vec<std::os::fd::OwnedFd>> =
    std::sync::Mutex::new(Vec::new());

/// The directories [`pin_through_fd`] keeps open for the process's life.
static PINNED_DIRS: std::sync::Mutex<Vec<fs::File>> = std::sync::Mutex::new(Vec::new());

/// A file given by a path in the agent's own mount namespace (a Secret or
/// ConfigMap the pod mounts), kept readable after the agent joins the
/// host's: its directory stays open and the file is named through
/// `/proc/self/fd/<n>/<name>`, so an update of the mount (an atomic swap
/// of its `..data` link) is still seen. Call it before
/// [`join_host_namespaces`].
pub fn pin_through_fd(path: &Path) -> Result<PathBuf, HostError> {
    let fail = |source: io::Error| HostError::Pin {
        path: path.to_path_buf(),
        source,
    };
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(fail(io::Error::from(io::ErrorKind::InvalidInput)));
    };
    let dir = fs::File::open(if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    })
    .map_err(fail)?;
    let pinned = PathBuf::from(format!(
        "/proc/self/fd/{}",
        std::os::fd::AsRawFd::as_raw_fd(&dir)
    ))
    .join(name);
    PINNED_DIRS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(dir);
    Ok(pinned)
}

/// Whether this process is in PID 1's cgroup namespace. Where PID 1's cannot
/// be inspected (no hostPID, or a sandbox that hides it) this cannot be
/// told, and it says yes: the joining step reports that case itself.
pub fn shares_cgroup_namespace_with_pid_1() -> bool {
    let id = |path: &str| fs::metadata(path).map(|m| (m.dev(), m.ino())).ok();
    match (id("/proc/1/ns/cgroup"), id("/proc/self/ns/cgroup")) {
        (Some(host), Some(own)) => host == own,
        _ => true,
    }
}

/// Installs the global log subscriber (stderr, level from `RUST_LOG`, else
/// `default_level`, e.g. `info`).
pub fn init_tracing(format: LogFormat, default_level: &str) -> Result<(), HostError> {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Escape codes only for a person at a terminal, never into a file
        // or a pipe (the DaemonSet pod's log, journald, a shell's `2>`).
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    }
    .map_err(|error| HostError::Logging(error.to_string()))
}

/// This machine's host name, the standalone node's default name.
pub fn host_name() -> Option<String> {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_string())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|name| !name.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn the_default_run_dir_fits_every_generation_socket_of_the_longest_key() {
        let run_dir = Path::new(DEFAULT_RUN_DIR);
        disk_name::check_run_dir(run_dir).expect("the default run dir fits");
        let name = format!("{}.{}", "b".repeat(126), "c".repeat(126));
        let longest = crate::gate::InstanceKey::new("a".repeat(63), name).expect("the longest key");
        let socket = crate::switch::RunLayout::new(run_dir).generation_socket(&longest, u64::MAX);
        assert!(disk_name::socket_path_fits(&socket), "{}", socket.display());
    }

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        host: HostArgs,
    }

    #[test]
    fn defaults_are_the_documented_host_paths() {
        let cli = Cli::try_parse_from(["node-agent"]).expect("no flags parse");
        let settings = cli.host.settings();
        assert_eq!(settings.cgroup_root, None);
        assert_eq!(settings.run_dir, PathBuf::from(DEFAULT_RUN_DIR));
        assert_eq!(settings.state_dir, PathBuf::from(DEFAULT_STATE_DIR));
        assert_eq!(settings.staging_root, PathBuf::from(DEFAULT_STAGING_ROOT));
        assert_eq!(
            settings.store_dir(),
            PathBuf::from(DEFAULT_STATE_DIR).join(STORE_SUBDIR)
        );
        assert_eq!(settings.engine, EngineConfig::default());
        assert!(!cli.host.no_host_namespaces);
    }

    #[test]
    fn swap_off_and_root_instances_reach_the_engine_config() {
        let cli = Cli::try_parse_from([
            "node-agent",
            "--swap=off",
            "--allow-root-instances",
            "--state-dir",
            "/tmp/s",
        ])
        .expect("flags parse");
        let settings = cli.host.settings();
        assert!(!settings.engine.swaps_on);
        assert!(settings.engine.allow_root);
        assert_eq!(settings.store_dir(), PathBuf::from("/tmp/s/store"));
    }

    /// Settings with every directory in `dir` (the cgroup root a plain
    /// directory).
    fn settings_in(dir: &Path) -> HostSettings {
        HostSettings {
            cgroup_root: Some(dir.join("genswap")),
            run_dir: dir.join("run"),
            state_dir: dir.join("state"),
            staging_root: dir.join("staging"),
            store_dir: None,
            tree_limits: genswap_store::TreeLimits::default(),
            registries: Default::default(),
            trust: Default::default(),
            retention: Default::default(),
            engine: EngineConfig::default(),
            logs: LogSettings {
                dir: dir.join("logs"),
                ..LogSettings::default()
            },
        }
    }

    #[test]
    fn the_helper_named_is_held_open_and_one_that_cannot_run_is_refused_by_name() {
        let dir = tempfile::tempdir().expect("temp dir");
        let helper = dir.path().join("genswap-helper");
        fs::write(&helper, b"#!/bin/sh\n").expect("a helper");
        fs::set_permissions(&helper, fs::Permissions::from_mode(0o755)).expect("chmod");
        let found = locate_helper(Some(&helper)).expect("an executable helper");
        assert_eq!(found.name, "genswap-helper");
        let fd: i32 = found
            .path
            .strip_prefix("/proc/self/fd")
            .ok()
            .and_then(|n| n.to_str()?.parse().ok())
            .expect("a held descriptor");
        assert!(
            fd >= crate::launch::SETUP_FD_FLOOR,
            "above a child's descriptors: {fd}"
        );
        // Removed from its directory, it still runs through the descriptor:
        // as the image's path is gone from view once the host's namespaces
        // are joined.
        fs::remove_file(&helper).expect("remove the helper");
        assert!(fs::metadata(&found.path).is_ok_and(|m| m.is_file()));

        let plain = dir.path().join("plain");
        fs::write(&plain, b"data").expect("a plain file");
        for path in [plain, dir.path().join("missing"), dir.path().to_path_buf()] {
            let error = locate_helper(Some(&path)).expect_err("not a program");
            assert!(
                error.to_string().contains(&path.display().to_string()),
                "{error}"
            );
        }
    }

    #[test]
    fn the_helper_beside_the_agent_is_found_and_without_one_the_agent_runs_itself() {
        let dir = tempfile::tempdir().expect("temp dir");
        let agent = dir.path().join("node-agent");
        assert_eq!(
            locate_helper_beside(None, Ok(agent.clone())).expect("a fallback"),
            HelperProgram::agent_itself()
        );
        let helper = dir.path().join(crate::logs::HELPER_NAME);
        fs::write(&helper, b"#!/bin/sh\n").expect("a helper");
        fs::set_permissions(&helper, fs::Permissions::from_mode(0o755)).expect("chmod");
        let found = locate_helper_beside(None, Ok(agent)).expect("the helper");
        assert_eq!(found.name, crate::logs::HELPER_NAME);
        assert!(found.path.starts_with("/proc/self/fd"), "{found:?}");
    }

    #[test]
    fn a_cgroup_root_outside_cgroup_v2_is_refused_with_what_to_do() {
        let dir = tempfile::tempdir().expect("temp dir");
        let settings = settings_in(dir.path());
        let Err(error) = Host::build(&settings) else {
            panic!("a root in a plain directory was accepted");
        };
        assert!(matches!(error, HostError::Cgroup { .. }), "{error:?}");
        let message = error.to_string();
        assert!(message.contains("cgroup v2"), "{message}");
        assert!(message.contains("--cgroup-root"), "{message}");
        assert!(
            !dir.path().join("run").exists(),
            "nothing was created before the refusal"
        );
    }

    #[test]
    fn a_run_dir_too_long_for_socket_paths_is_refused_before_anything_is_made() {
        let dir = tempfile::tempdir().expect("temp dir");
        let run_dir = dir.path().join("r".repeat(40));
        let settings = HostSettings {
            run_dir: run_dir.clone(),
            ..settings_in(dir.path())
        };
        let Err(error) = Host::build(&settings) else {
            panic!("a run dir too long for its sockets was accepted");
        };
        assert!(matches!(error, HostError::PathTooLong(_)), "{error:?}");
        let message = error.to_string();
        assert!(
            message.contains(&run_dir.display().to_string()),
            "{message}"
        );
        assert!(message.contains("--run-dir"), "{message}");
        assert!(!run_dir.exists() && !dir.path().join("state").exists());
    }

    #[test]
    fn the_log_flags_reach_the_settings() {
        let cli = Cli::try_parse_from(["node-agent"]).expect("defaults parse");
        assert_eq!(cli.host.settings().logs, LogSettings::default());
        let cli = Cli::try_parse_from([
            "node-agent",
            "--log-dir",
            "/tmp/l",
            "--log-max-size",
            "1Mi",
            "--log-max-files",
            "3",
        ])
        .expect("flags parse");
        assert_eq!(
            cli.host.settings().logs,
            LogSettings {
                dir: PathBuf::from("/tmp/l"),
                max_size: 1024 * 1024,
                max_files: 3,
                helper: HelperProgram::agent_itself(),
            }
        );
        assert!(Cli::try_parse_from(["node-agent", "--log-max-files", "1"]).is_err());
        assert!(Cli::try_parse_from(["node-agent", "--log-max-size", "0"]).is_err());
    }

    #[test]
    fn an_unknown_swap_value_is_refused() {
        assert!(Cli::try_parse_from(["node-agent", "--swap=maybe"]).is_err());
    }

    #[test]
    fn a_pinned_file_stays_readable_when_its_path_names_something_else() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mounted = dir.path().join("mounted");
        fs::create_dir(&mounted).expect("mount dir");
        fs::write(mounted.join("config.json"), "v1").expect("config");
        let pinned = pin_through_fd(&mounted.join("config.json")).expect("pinned");
        // The path stops naming the mount (as after the namespace join) ...
        fs::rename(&mounted, dir.path().join("elsewhere")).expect("move");
        fs::create_dir(&mounted).expect("another dir at the path");
        assert_eq!(fs::read_to_string(&pinned).expect("read"), "v1");
        // ... and an update of the mount is still seen.
        fs::write(dir.path().join("elsewhere/config.json"), "v2").expect("update");
        assert_eq!(fs::read_to_string(&pinned).expect("read"), "v2");
    }
}
