//! What an instance's processes may use (SPEC 5.16), resolved before the
//! fork into plain numbers the child applies with one system call each
//! ([`crate::launch`]): every resource limit, explicit, never the agent's
//! own; the capabilities kept in the bounding set and raised as ambient;
//! the umask.
//!
//! Limits left out of `process.limits` are systemd's defaults for a
//! service (`DefaultLimitNOFILE=1024:524288`, `DefaultLimitCORE=0:infinity`,
//! `DefaultLimitMEMLOCK=8M`) and the kernel's own for PID 1 for the rest
//! (`RLIMIT_NPROC` and `RLIMIT_SIGPENDING` half of `kernel.threads-max`,
//! an 8 MiB stack, `RLIMIT_MSGQUEUE` 819200, no nice or realtime
//! priority): what the same program gets as a systemd unit, whatever the
//! container runtime gave the agent.

pub mod directories;
pub mod filesystem;
pub mod seccomp;
pub mod unit;

use std::fs;
use std::io;

use std::path::PathBuf;

use genswap_crds::{
    CapabilitiesSpec, FilesystemProfile, Limit, LimitsSpec, ProcessSpec, RootProfile,
    SeccompProfile,
};
use nix::libc;
use thiserror::Error;

/// `RLIM_INFINITY`.
pub const INFINITY: u64 = u64::MAX;
const MIB: u64 = 1024 * 1024;

/// Why an instance's confinement cannot be applied as its spec says;
/// nothing has started.
#[derive(Debug, Error)]
pub enum ConfineError {
    #[error("cannot read {path}: {source}")]
    Host {
        path: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{path} holds {found:?}, not a number")]
    HostValue { path: &'static str, found: String },
    #[error(
        "process.limits.nofile: a hard limit of {hard} is above the kernel's fs.nr_open ({nr_open}), which no process may have"
    )]
    NofileAboveNrOpen { hard: String, nr_open: u64 },
    #[error(
        "process.limits.{name}: a hard limit of {hard} is above the agent's own ({agent}), and the agent lacks CAP_SYS_RESOURCE to raise it"
    )]
    AboveAgent {
        name: &'static str,
        hard: String,
        agent: String,
    },
    #[error("process.limits.{name}: a negative limit ({value})")]
    Negative { name: &'static str, value: i64 },
    #[error("process.limits.{name}: the soft limit is above the hard one")]
    SoftAboveHard { name: &'static str },
    #[error("process.umask {0:?} is not an octal mask such as 0022")]
    Umask(String),
    #[error(
        "process.capabilities.add names {name}, which this kernel does not have (its last is {last})"
    )]
    UnknownCapability { name: String, last: u8 },
    #[error("cannot build the seccomp filter: {0}")]
    Seccomp(String),
    #[error(
        "process.capabilities.add names {name}, which the agent does not hold itself (a pod's agent needs it added: the chart's agent.instanceCapabilities)"
    )]
    AgentLacks { name: String },
    #[error(
        "the agent lacks CAP_SETPCAP, which emptying an instance's capability bounding set needs (the chart adds it)"
    )]
    NoSetpcap,
    #[error(transparent)]
    Filesystem(#[from] filesystem::FsError),
    #[error("process.root: build cannot run {0}")]
    RootBuild(String),
}

/// The sandbox's part of a process spec, as a spawn takes it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SandboxSpec {
    pub limits: LimitsSpec,
    pub capabilities: CapabilitiesSpec,
    pub umask: Option<String>,
    pub seccomp: SeccompProfile,
    pub filesystem: FilesystemProfile,
    /// Writable inside a `Protected` filesystem.
    pub writable_paths: Vec<PathBuf>,
    /// `process.root`.
    pub root: RootProfile,
    /// The build's tree on the node, which `root: build` makes `/`; the
    /// engine sets it once the build is staged.
    pub tree: Option<PathBuf>,
}

impl SandboxSpec {
    /// What `process` asks for.
    pub fn of(process: &ProcessSpec) -> SandboxSpec {
        SandboxSpec {
            limits: process.limits.clone(),
            capabilities: process.capabilities.clone(),
            umask: process.umask.clone(),
            seccomp: process.seccomp.unwrap_or_default(),
            filesystem: process.filesystem.unwrap_or_default(),
            writable_paths: process.writable_paths.iter().map(PathBuf::from).collect(),
            root: process.root.unwrap_or_default(),
            tree: None,
        }
    }
}

/// What the host's kernel says the defaults and bounds are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostFacts {
    /// `kernel.threads-max`.
    pub threads_max: u64,
    /// `fs.nr_open`: no `RLIMIT_NOFILE` may exceed it.
    pub nr_open: u64,
    /// `kernel.cap_last_cap`.
    pub last_cap: u8,
    /// Whether the agent may raise a hard limit (`CAP_SYS_RESOURCE`).
    pub can_raise: bool,
    /// Whether the agent may drop capabilities from a bounding set
    /// (`CAP_SETPCAP`).
    pub can_drop: bool,
    /// The agent's permitted capabilities: the most an instance can keep.
    pub agent_permitted: u64,
    /// The agent's own hard limits, by resource number: the most an
    /// instance gets where the agent cannot raise them.
    pub agent_hard: [u64; RESOURCES],
}

/// `RLIMIT_NLIMITS`.
pub const RESOURCES: usize = 16;
/// `CAP_SYS_RESOURCE`.
const CAP_SYS_RESOURCE: u32 = 24;
/// `CAP_SETPCAP`.
const CAP_SETPCAP: u32 = 8;

impl HostFacts {
    /// Read from `/proc/sys`.
    pub fn read() -> Result<HostFacts, ConfineError> {
        let number = |path: &'static str| -> Result<u64, ConfineError> {
            let text =
                fs::read_to_string(path).map_err(|source| ConfineError::Host { path, source })?;
            text.trim().parse().map_err(|_| ConfineError::HostValue {
                path,
                found: text.trim().to_owned(),
            })
        };
        let last_cap = number("/proc/sys/kernel/cap_last_cap")?;
        let status =
            fs::read_to_string("/proc/self/status").map_err(|source| ConfineError::Host {
                path: "/proc/self/status",
                source,
            })?;
        let set = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
                .unwrap_or(0)
        };
        let (effective, permitted) = (set("CapEff:"), set("CapPrm:"));
        let mut agent_hard = [INFINITY; RESOURCES];
        for (resource, hard) in (0u32..).zip(agent_hard.iter_mut()) {
            let mut limit = libc::rlimit64 {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit64 writes one rlimit64 into a live one.
            if unsafe { libc::getrlimit64(resource as _, &mut limit) } == 0 {
                *hard = limit.rlim_max;
            }
        }
        Ok(HostFacts {
            threads_max: number("/proc/sys/kernel/threads-max")?,
            nr_open: number("/proc/sys/fs/nr_open")?,
            last_cap: u8::try_from(last_cap).unwrap_or(63).min(63),
            can_raise: effective & (1 << CAP_SYS_RESOURCE) != 0,
            can_drop: effective & (1 << CAP_SETPCAP) != 0,
            agent_permitted: permitted,
            agent_hard,
        })
    }
}

/// One resource limit to set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rlimit {
    /// `RLIMIT_*`.
    pub resource: u32,
    /// Its name, as `/proc/PID/limits` and `process.limits` say it.
    pub name: &'static str,
    pub soft: u64,
    pub hard: u64,
}

/// Everything the child applies, resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Confinement {
    /// Every resource limit the kernel has.
    pub limits: Vec<Rlimit>,
    /// The capabilities kept (a bit per number); the rest leave the
    /// bounding set.
    pub keep: u64,
    /// The last capability number of the kernel.
    pub last_cap: u8,
    /// The umask.
    pub umask: u32,
    /// The system call filter, `None` when unconfined.
    pub seccomp: Option<seccompiler::BpfProgram>,
}

impl Confinement {
    /// `spec` on a host with `facts`.
    pub fn resolve(spec: &SandboxSpec, facts: &HostFacts) -> Result<Confinement, ConfineError> {
        let half_threads = (facts.threads_max / 2).max(1);
        let given = |name: &'static str, limit: Option<Limit>, default: (u64, u64)| {
            limit.map_or(Ok(default), |limit| bounds(name, limit))
        };
        let l = &spec.limits;
        // systemd's default, at most what the kernel allows anyone; a
        // limit the spec asks for is given or refused.
        let default_nofile = (1024.min(facts.nr_open), 524_288.min(facts.nr_open));
        let nofile = given("nofile", l.nofile, default_nofile)?;
        if nofile.1 > facts.nr_open {
            return Err(ConfineError::NofileAboveNrOpen {
                hard: limit_text(nofile.1),
                nr_open: facts.nr_open,
            });
        }
        let table: [(u32, &'static str, (u64, u64)); 16] = [
            (libc::RLIMIT_CPU, "cpu", (INFINITY, INFINITY)),
            (libc::RLIMIT_FSIZE, "fsize", (INFINITY, INFINITY)),
            (libc::RLIMIT_DATA, "data", (INFINITY, INFINITY)),
            (
                libc::RLIMIT_STACK,
                "stack",
                given("stack", l.stack, (8 * MIB, INFINITY))?,
            ),
            (
                libc::RLIMIT_CORE,
                "core",
                given("core", l.core, (0, INFINITY))?,
            ),
            (libc::RLIMIT_RSS, "rss", (INFINITY, INFINITY)),
            (
                libc::RLIMIT_NPROC,
                "nproc",
                given("nproc", l.nproc, (half_threads, half_threads))?,
            ),
            (libc::RLIMIT_NOFILE, "nofile", nofile),
            (
                libc::RLIMIT_MEMLOCK,
                "memlock",
                given("memlock", l.memlock, (8 * MIB, 8 * MIB))?,
            ),
            (libc::RLIMIT_AS, "as", (INFINITY, INFINITY)),
            (libc::RLIMIT_LOCKS, "locks", (INFINITY, INFINITY)),
            (
                libc::RLIMIT_SIGPENDING,
                "sigpending",
                (half_threads, half_threads),
            ),
            (libc::RLIMIT_MSGQUEUE, "msgqueue", (819_200, 819_200)),
            (libc::RLIMIT_NICE, "nice", (0, 0)),
            (libc::RLIMIT_RTPRIO, "rtprio", (0, 0)),
            (libc::RLIMIT_RTTIME, "rttime", (INFINITY, INFINITY)),
        ];
        let given_names: Vec<&str> = [
            ("nofile", l.nofile),
            ("core", l.core),
            ("memlock", l.memlock),
            ("nproc", l.nproc),
            ("stack", l.stack),
        ]
        .into_iter()
        .filter_map(|(name, limit)| limit.map(|_| name))
        .collect();
        let mut limits = Vec::with_capacity(table.len());
        for (resource, name, (mut soft, mut hard)) in table {
            let agent = facts
                .agent_hard
                .get(resource as usize)
                .copied()
                .unwrap_or(INFINITY);
            if !facts.can_raise && hard > agent {
                // A default is what systemd would give, at most what the
                // agent has; what a spec asks for is given or refused.
                if given_names.contains(&name) {
                    return Err(ConfineError::AboveAgent {
                        name,
                        hard: limit_text(hard),
                        agent: limit_text(agent),
                    });
                }
                hard = agent;
                soft = soft.min(hard);
            }
            limits.push(Rlimit {
                resource,
                name,
                soft,
                hard,
            });
        }
        let mut keep = 0u64;
        for capability in &spec.capabilities.add {
            let number = capability.number();
            if number > facts.last_cap {
                return Err(ConfineError::UnknownCapability {
                    name: capability.name(),
                    last: facts.last_cap,
                });
            }
            if facts.agent_permitted & (1 << number) == 0 {
                return Err(ConfineError::AgentLacks {
                    name: capability.name(),
                });
            }
            keep |= 1 << number;
        }
        if !facts.can_drop {
            return Err(ConfineError::NoSetpcap);
        }
        Ok(Confinement {
            limits,
            keep,
            last_cap: facts.last_cap,
            umask: umask_of(spec.umask.as_deref())?,
            seccomp: match spec.seccomp {
                SeccompProfile::RuntimeDefault => Some(seccomp::runtime_default(
                    keep & (1 << genswap_crds::Capability::NetRaw.number()) != 0,
                )?),
                SeccompProfile::Unconfined => None,
            },
        })
    }

    /// The limit named `name`.
    pub fn limit(&self, name: &str) -> Option<Rlimit> {
        self.limits.iter().copied().find(|l| l.name == name)
    }
}

/// `limit`'s (soft, hard), a bound left out being infinity.
fn bounds(name: &'static str, limit: Limit) -> Result<(u64, u64), ConfineError> {
    let value = |bound: Option<i64>| match bound {
        None => Ok(INFINITY),
        Some(n) => u64::try_from(n)
            .map(|n| n.min(INFINITY - 1))
            .map_err(|_| ConfineError::Negative { name, value: n }),
    };
    let (soft, hard) = (value(limit.soft)?, value(limit.hard)?);
    if soft > hard {
        return Err(ConfineError::SoftAboveHard { name });
    }
    Ok((soft, hard))
}

/// A limit as systemd and `/proc/PID/limits` write it.
pub fn limit_text(value: u64) -> String {
    if value == INFINITY {
        "infinity".into()
    } else {
        value.to_string()
    }
}

/// The mask `text` gives; systemd's 0022 when none.
fn umask_of(text: Option<&str>) -> Result<u32, ConfineError> {
    let Some(text) = text else {
        return Ok(0o022);
    };
    let digits = text
        .strip_prefix('0')
        .filter(|d| d.len() == 3)
        .unwrap_or(text);
    if digits.len() != 3 {
        return Err(ConfineError::Umask(text.to_owned()));
    }
    u32::from_str_radix(digits, 8).map_err(|_| ConfineError::Umask(text.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use genswap_crds::Capability;

    fn facts() -> HostFacts {
        HostFacts {
            threads_max: 126_000,
            nr_open: 1_048_576,
            last_cap: 40,
            can_raise: true,
            can_drop: true,
            agent_permitted: u64::MAX,
            agent_hard: [1_000; RESOURCES],
        }
    }

    #[test]
    fn a_capability_the_agent_lacks_and_an_agent_that_cannot_drop_are_refused() {
        let mut spec = SandboxSpec::default();
        spec.capabilities.add = vec![Capability::NetBindService];
        let pod_agent = HostFacts {
            agent_permitted: 1 << Capability::SysAdmin.number(),
            ..facts()
        };
        let error = Confinement::resolve(&spec, &pod_agent).expect_err("not the agent's");
        assert!(error.to_string().contains("NET_BIND_SERVICE"), "{error}");
        let no_setpcap = HostFacts {
            can_drop: false,
            ..facts()
        };
        let error = Confinement::resolve(&SandboxSpec::default(), &no_setpcap)
            .expect_err("cannot empty the bounding set");
        assert!(error.to_string().contains("CAP_SETPCAP"), "{error}");
    }

    #[test]
    fn an_agent_that_cannot_raise_a_limit_gives_at_most_its_own_and_refuses_more() {
        let mut agent_hard = [INFINITY; RESOURCES];
        agent_hard[libc::RLIMIT_NOFILE as usize] = 20_000;
        let host = HostFacts {
            can_raise: false,
            agent_hard,
            ..facts()
        };
        let c = Confinement::resolve(&SandboxSpec::default(), &host).expect("resolves");
        let nofile = c.limit("nofile").expect("nofile");
        assert_eq!((nofile.soft, nofile.hard), (1024, 20_000));

        let mut spec = SandboxSpec::default();
        spec.limits.nofile = Some(Limit::new(Some(1024), Some(65_536)));
        let error = Confinement::resolve(&spec, &host).expect_err("more than the agent has");
        assert!(error.to_string().contains("CAP_SYS_RESOURCE"), "{error}");
        spec.limits.nofile = Some(Limit::new(Some(1024), Some(20_000)));
        assert!(
            Confinement::resolve(&spec, &host).is_ok(),
            "as much as it has"
        );
    }

    #[test]
    fn left_out_limits_are_systemds_defaults_and_the_kernels() {
        let c = Confinement::resolve(&SandboxSpec::default(), &facts()).expect("resolves");
        assert_eq!(c.limits.len(), 16, "every limit the kernel has");
        let pair = |name: &str| c.limit(name).map(|l| (l.soft, l.hard));
        assert_eq!(pair("nofile"), Some((1024, 524_288)));
        assert_eq!(pair("core"), Some((0, INFINITY)));
        assert_eq!(pair("memlock"), Some((8 * MIB, 8 * MIB)));
        assert_eq!(pair("stack"), Some((8 * MIB, INFINITY)));
        assert_eq!(pair("nproc"), Some((63_000, 63_000)));
        assert_eq!(pair("nice"), Some((0, 0)));
        assert_eq!(c.keep, 0, "the bounding set is emptied");
        assert_eq!(c.umask, 0o022);
    }

    #[test]
    fn a_given_limit_replaces_the_default_and_a_bound_left_out_is_infinity() {
        let mut spec = SandboxSpec::default();
        spec.limits.nofile = Some(Limit::new(Some(65_536), Some(65_536)));
        spec.limits.core = Some(Limit::new(None, None));
        spec.limits.memlock = Some(Limit::new(Some(0), None));
        spec.capabilities.add = vec![Capability::NetBindService, Capability::SysNice];
        spec.umask = Some("027".into());
        let c = Confinement::resolve(&spec, &facts()).expect("resolves");
        let pair = |name: &str| c.limit(name).map(|l| (l.soft, l.hard));
        assert_eq!(pair("nofile"), Some((65_536, 65_536)));
        assert_eq!(pair("core"), Some((INFINITY, INFINITY)));
        assert_eq!(pair("memlock"), Some((0, INFINITY)));
        assert_eq!(c.keep, (1 << 10) | (1 << 23));
        assert_eq!(c.umask, 0o027);
    }

    #[test]
    fn the_default_nofile_is_at_most_fs_nr_open() {
        let small = HostFacts {
            nr_open: 65_536,
            ..facts()
        };
        let c = Confinement::resolve(&SandboxSpec::default(), &small).expect("resolves");
        let nofile = c.limit("nofile").expect("nofile");
        assert_eq!((nofile.soft, nofile.hard), (1024, 65_536));
    }

    #[test]
    fn what_the_kernel_cannot_give_is_refused_naming_it() {
        let mut spec = SandboxSpec::default();
        spec.limits.nofile = Some(Limit::new(Some(1024), None));
        let error = Confinement::resolve(&spec, &facts()).expect_err("infinity > nr_open");
        assert!(error.to_string().contains("fs.nr_open"), "{error}");

        let mut spec = SandboxSpec::default();
        spec.capabilities.add = vec![Capability::CheckpointRestore];
        let old_kernel = HostFacts {
            last_cap: 37,
            ..facts()
        };
        let error = Confinement::resolve(&spec, &old_kernel).expect_err("no such capability");
        assert!(error.to_string().contains("CHECKPOINT_RESTORE"), "{error}");

        for (soft, hard) in [(Some(10), Some(5)), (None, Some(5)), (Some(-1), None)] {
            let mut spec = SandboxSpec::default();
            spec.limits.stack = Some(Limit::new(soft, hard));
            let error = Confinement::resolve(&spec, &facts()).expect_err("refused");
            assert!(
                error.to_string().contains("process.limits.stack"),
                "{error}"
            );
        }
        for bad in ["0999", "22", "00022", "abc"] {
            let spec = SandboxSpec {
                umask: Some(bad.into()),
                ..SandboxSpec::default()
            };
            assert!(Confinement::resolve(&spec, &facts()).is_err(), "{bad}");
        }
    }
}
