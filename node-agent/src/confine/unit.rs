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

use genswap_crds::{InstanceGeneration, SeccompProfile};
use thiserror::Error;

use super::{Confinement, HostFacts, SandboxSpec, limit_text};

/// `node-agent sandbox`.
#[derive(clap::Args, Debug)]
pub struct SandboxArgs {
    /// An InstanceGeneration manifest (YAML, as standalone mode reads it;
    /// `-` for stdin).
    #[arg(long, value_name = "FILE")]
    pub manifest: PathBuf,
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

/// The unit for the manifest `args` names.
pub fn render(args: &SandboxArgs) -> Result<String, UnitError> {
    let path = args.manifest.display().to_string();
    let text = if path == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(&args.manifest)
    }
    .map_err(|source| UnitError::Read {
        path: path.clone(),
        source,
    })?;
    let ig = genswap_crds::manifest::parse_instance_generation(&text)
        .map_err(|source| UnitError::Manifest { path, source })?;
    unit_of(&ig, &HostFacts::read()?)
}

/// `ig`'s sandbox on a host with `facts`, as a unit file.
pub fn unit_of(ig: &InstanceGeneration, facts: &HostFacts) -> Result<String, UnitError> {
    let spec = &ig.spec;
    let process = &spec.process;
    let sandbox = SandboxSpec::of(process);
    let confinement = Confinement::resolve(&sandbox, facts)?;
    let namespace = ig.metadata.namespace.as_deref().unwrap_or("default");
    let name = ig.metadata.name.as_deref().unwrap_or_default();
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
        spec.build.id
    ));
    line(String::new());
    line("[Service]".into());
    let executable = match (&spec.build.artifact.path, &spec.build.entrypoint) {
        (Some(path), None) => path.clone(),
        (_, Some(entrypoint)) => format!(
            "/var/lib/genswap/store/tree-sha256-{}/rootfs/{entrypoint}",
            spec.build.sha256
        ),
        (None, None) => format!("/var/lib/genswap/store/sha256-{}", spec.build.sha256),
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
    // RLIMIT_RTPRIO is 0 and CAP_SYS_NICE gone: the kernel refuses a
    // realtime policy, filter or not.
    if !process
        .capabilities
        .add
        .contains(&genswap_crds::Capability::SysNice)
    {
        line("RestrictRealtime=yes".into());
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
