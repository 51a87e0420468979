//! `node-agent sandbox`: an instance's effective sandbox written as the
//! systemd unit that would confine it the same way, so that an operator
//! (and CI) can score it with `systemd-analyze security --offline=yes`.
//!
//! Only what the agent applies is written; each line names a directive
//! whose effect `crate::launch` gives the process (the test
//! `node-agent/tests/sandbox_unit.rs` scores the examples with the real
//! `systemd-analyze`).

use std::fmt::Write as _;
use std::path::PathBuf;

use genswap_crds::{
    Capability, FilesystemProfile, InstanceGeneration, RootProfile, SeccompProfile,
};
use thiserror::Error;

use super::{Confinement, HostFacts, SandboxSpec, limit_text};

/// `node-agent sandbox`.
#[derive(clap::Args, Debug)]
pub struct SandboxArgs {
    /// An instance this agent runs, as `NAMESPACE/NAME`: its serving (or
    /// newest) spec, from the agent's journal.
    #[arg(conflicts_with = "manifest", required_unless_present = "manifest")]
    pub instance: Option<String>,
    /// An InstanceGeneration manifest instead (YAML, as standalone mode
    /// reads it; `-` for stdin).
    #[arg(long, value_name = "FILE")]
    pub manifest: Option<PathBuf>,
    #[command(flatten)]
    pub host: crate::host::HostArgs,
}

#[derive(Debug, Error)]
pub enum UnitError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Manifest {
        path: String,
        #[source]
        source: genswap_crds::manifest::ManifestError,
    },
    #[error(transparent)]
    Confine(#[from] super::ConfineError),
    #[error("{0:?} is not NAMESPACE/NAME of an InstanceGeneration")]
    BadInstance(String),
    #[error("the agent's journal: {0}")]
    Journal(#[from] crate::journal::JournalError),
    #[error("this agent's journal holds no spec of {0} (it never ran here, or it was removed)")]
    Unknown(String),
}

/// systemd's directive for each limit a `Limit…=` line can say plainly
/// (`LimitNICE=` and `LimitRTPRIO=` take priorities, not the raw value).
const LIMIT_DIRECTIVES: [(&str, &str); 14] = [
    ("cpu", "LimitCPU"),
    ("fsize", "LimitFSIZE"),
    ("data", "LimitDATA"),
    ("stack", "LimitSTACK"),
    ("core", "LimitCORE"),
    ("rss", "LimitRSS"),
    ("nproc", "LimitNPROC"),
    ("nofile", "LimitNOFILE"),
    ("memlock", "LimitMEMLOCK"),
    ("as", "LimitAS"),
    ("locks", "LimitLOCKS"),
    ("sigpending", "LimitSIGPENDING"),
    ("msgqueue", "LimitMSGQUEUE"),
    ("rttime", "LimitRTTIME"),
];

/// The unit for the instance or the manifest `args` names.
pub fn render(args: &SandboxArgs) -> Result<String, UnitError> {
    let facts = HostFacts::read()?;
    if let Some(instance) = &args.instance {
        let key = instance
            .split_once('/')
            .and_then(|(namespace, name)| crate::gate::InstanceKey::new(namespace, name).ok())
            .ok_or_else(|| UnitError::BadInstance(instance.clone()))?;
        let settings = args.host.settings();
        let journal = crate::journal::Journal::open(&settings.state_dir)?;
        let entry = journal.load_entry(&key)?;
        let spec = entry
            .and_then(|entry| {
                entry
                    .supervised
                    .map(|s| s.spec)
                    .or_else(|| entry.attempt.and_then(|a| a.spec.map(|s| *s)))
            })
            .ok_or_else(|| UnitError::Unknown(instance.clone()))?;
        return unit_for(
            &Named {
                run_dir: &settings.run_dir,
                state_dir: &settings.state_dir,
                namespace: key.namespace(),
                name: key.name(),
                build: &spec.build,
                process: &spec.process,
            },
            &facts,
        );
    }
    let manifest = args.manifest.clone().unwrap_or_else(|| PathBuf::from("-"));
    let path = manifest.display().to_string();
    let text = if path == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(&manifest)
    }
    .map_err(|source| UnitError::Read {
        path: path.clone(),
        source,
    })?;
    let ig = genswap_crds::manifest::parse_instance_generation(&text)
        .map_err(|source| UnitError::Manifest { path, source })?;
    let settings = args.host.settings();
    unit_of(&ig, &settings.run_dir, &settings.state_dir, &facts)
}

/// `ig`'s sandbox on a host with `facts`, as a unit file.
pub fn unit_of(
    ig: &InstanceGeneration,
    run_dir: &std::path::Path,
    state_dir: &std::path::Path,
    facts: &HostFacts,
) -> Result<String, UnitError> {
    unit_for(
        &Named {
            run_dir,
            state_dir,
            namespace: ig.metadata.namespace.as_deref().unwrap_or("default"),
            name: ig.metadata.name.as_deref().unwrap_or_default(),
            build: &ig.spec.build,
            process: &ig.spec.process,
        },
        facts,
    )
}

/// An instance's name and what its unit is made from.
struct Named<'a> {
    /// The agent's run dir.
    run_dir: &'a std::path::Path,
    /// The agent's state dir.
    state_dir: &'a std::path::Path,
    namespace: &'a str,
    name: &'a str,
    build: &'a genswap_crds::BuildSpec,
    process: &'a genswap_crds::ProcessSpec,
}

fn unit_for(named: &Named<'_>, facts: &HostFacts) -> Result<String, UnitError> {
    let Named {
        run_dir,
        state_dir,
        namespace,
        name,
        build,
        process,
    } = *named;
    let sandbox = SandboxSpec::of(process);
    let confinement = Confinement::resolve(&sandbox, facts)?;
    let mut unit = String::new();
    let mut line = |text: String| {
        let _ = writeln!(unit, "{text}");
    };
    line(format!(
        "# The sandbox genswap gives {namespace}/{name}, as the systemd unit that confines a process the same way (node-agent sandbox)."
    ));
    line("[Unit]".into());
    line(format!(
        "Description=genswap instance {namespace}/{name}, build {}",
        build.id
    ));
    line(String::new());
    line("[Service]".into());
    let executable = match (&build.artifact.path, &build.entrypoint) {
        (Some(path), None) => path.clone(),
        (_, Some(entrypoint)) => format!(
            "/var/lib/genswap/store/tree-sha256-{}/rootfs/{entrypoint}",
            build.sha256
        ),
        (None, None) => format!("/var/lib/genswap/store/sha256-{}", build.sha256),
    };
    let tree = format!("/var/lib/genswap/store/tree-sha256-{}/rootfs", build.sha256);
    let in_tree = sandbox.root == RootProfile::Build;
    let executable = match (&build.entrypoint, in_tree) {
        (Some(entrypoint), true) => format!("/{entrypoint}"),
        _ => executable,
    };
    let mut exec = vec![executable];
    exec.extend(process.args.iter().map(|a| quoted(a)));
    line(format!("ExecStart={}", exec.join(" ")));
    if let Some(user) = process.user {
        line(format!("User={user}"));
    }
    if let Some(group) = process.group {
        line(format!("Group={group}"));
    }
    line("NoNewPrivileges=yes".into());
    let kept: Vec<String> = process
        .capabilities
        .add
        .iter()
        .map(|c| format!("CAP_{}", c.name()))
        .collect();
    line(format!("CapabilityBoundingSet={}", kept.join(" ")));
    line(format!("AmbientCapabilities={}", kept.join(" ")));
    for (limit_name, directive) in LIMIT_DIRECTIVES {
        if let Some(limit) = confinement.limit(limit_name) {
            line(format!(
                "{directive}={}:{}",
                limit_text(limit.soft),
                limit_text(limit.hard)
            ));
        }
    }
    line(format!("UMask={:04o}", confinement.umask));
    if sandbox.seccomp == SeccompProfile::RuntimeDefault {
        line("SystemCallFilter=@system-service".into());
        line("SystemCallErrorNumber=EPERM".into());
        line("SystemCallArchitectures=native".into());
        line("RestrictNamespaces=yes".into());
        line("LockPersonality=yes".into());
        line("RestrictSUIDSGID=yes".into());
    }
    let added = |capability: Capability| process.capabilities.add.contains(&capability);
    let filtered = sandbox.seccomp == SeccompProfile::RuntimeDefault;
    if filtered {
        let mut families: Vec<&str> = super::seccomp::ADDRESS_FAMILIES
            .iter()
            .map(|(name, _)| *name)
            .collect();
        if added(Capability::NetRaw) {
            families.push("AF_PACKET");
        }
        line(format!("RestrictAddressFamilies={}", families.join(" ")));
    }
    // RLIMIT_RTPRIO is 0 and CAP_SYS_NICE gone: the kernel refuses a
    // realtime policy, filter or not.
    if !added(Capability::SysNice) {
        line("RestrictRealtime=yes".into());
    }
    // With CAP_SYS_ADMIN an instance could undo its mounts: none of the
    // filesystem's directives is claimed then.
    if sandbox.filesystem == FilesystemProfile::Protected && !added(Capability::SysAdmin) {
        let key = crate::gate::InstanceKey::new(namespace, name).ok();
        let instance_run_dir = key.as_ref().map_or_else(
            || run_dir.join(format!("{namespace}.{name}")),
            |key| crate::switch::RunLayout::new(run_dir).instance_dir(key),
        );
        let mut writable = vec![instance_run_dir.display().to_string()];
        writable.extend(process.writable_paths.iter().cloned());
        if let Some(key) = &key {
            let managed = super::directories::ManagedDirs::of(
                &process.directories,
                key,
                state_dir,
                &instance_run_dir,
            );
            writable.extend(managed.paths().iter().map(|p| p.display().to_string()));
        }
        line("PrivateMounts=yes".into());
        if in_tree {
            // The node's paths, bound in where they are on the node.
            line(format!("RootDirectory={tree}"));
            line("MountAPIVFS=yes".into());
            line(format!(
                "BindReadOnlyPaths={}",
                crate::confine::filesystem::FROM_THE_NODE
                    .map(|file| format!("-{file}"))
                    .join(" ")
            ));
            line(format!("BindPaths={}", writable.join(" ")));
            line("ProtectSystem=strict".into());
        } else {
            line("ProtectSystem=strict".into());
            line(format!("ReadWritePaths={}", writable.join(" ")));
        }
        line("PrivateTmp=yes".into());
        line("ProtectHome=yes".into());
        line("PrivateDevices=yes".into());
        line("ProtectProc=invisible".into());
        line("ProtectKernelTunables=yes".into());
        line("ProtectControlGroups=yes".into());
        line("ProtectHostname=yes".into());
        if !added(Capability::SysModule) {
            line("ProtectKernelModules=yes".into());
        }
        if !added(Capability::Syslog) {
            line("ProtectKernelLogs=yes".into());
        }
        // No clock call in the filter, no CAP_SYS_TIME, no /dev/rtc.
        if filtered && !added(Capability::SysTime) && !added(Capability::WakeAlarm) {
            line("ProtectClock=yes".into());
        }
    }
    Ok(unit)
}

/// `arg` as systemd's command line reads it.
fn quoted(arg: &str) -> String {
    if !arg.is_empty() && !arg.contains(|c: char| c.is_whitespace() || "\"'\\;$%".contains(c)) {
        return arg.to_owned();
    }
    let mut out = String::from("\"");
    for c in arg.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            '$' => out.push_str("$$"),
            '%' => out.push_str("%%"),
            _ => out.push(c),
        }
    }
    out.push('"');
    out
}
