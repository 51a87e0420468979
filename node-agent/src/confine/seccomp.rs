//! The default system call filter (`process.seccomp: RuntimeDefault`):
//! systemd's `@system-service` allow-list, the one systemd recommends for
//! services and the one `systemd-analyze security` judges units by, plus
//! what systemd's `RestrictNamespaces=yes` adds: no new namespace by
//! `unshare` or `clone`, no `setns`, and `clone3` (whose flags a filter
//! cannot read) answered `ENOSYS` so that libc falls back to `clone`;
//! `LockPersonality=yes` (the personality may be read or set to Linux's
//! only) and `RestrictSUIDSGID=yes` (no mode with the setuid or setgid bit
//! by `chmod`, `fchmod`, `fchmodat`, `mkdir`, `mknod`, and the opens and
//! `creat` that create a file). Every other call is answered `EPERM`; a call of another architecture
//! (a 32-bit one on a 64-bit kernel) kills the process
//! (`SystemCallArchitectures=native`). Sockets may be made of the
//! families a host service uses, `AF_UNIX`, `AF_INET`, `AF_INET6` and
//! `AF_NETLINK` (interface and route lookups), and `AF_PACKET` only where
//! the spec adds `NET_RAW` (`RestrictAddressFamilies=`).
//!
//! Why this list and not containerd's default profile: a genswap instance
//! replaces a systemd unit, and an operator compares it with one; the list
//! is systemd's own (`system_service.txt`, from `systemd-analyze
//! syscall-filter @system-service` of systemd 252, expanded; a test holds
//! it to the installed systemd where there is one). Containerd's profile
//! allows more (the `@privileged` calls a container's capabilities gate),
//! where an instance has no capabilities to gate them with.
//!
//! The program is built before the fork with seccompiler (pure Rust; no
//! libseccomp), and installed by the child as its last step before exec.

use std::collections::BTreeMap;
use std::str::FromStr;

use nix::libc;
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use super::ConfineError;

/// `@system-service`, one name per line, for every architecture.
const SYSTEM_SERVICE: &str = include_str!("system_service.txt");

/// Every `CLONE_NEW*` flag.
const NEW_NAMESPACES: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET) as u64
    | 0x80; // CLONE_NEWTIME

/// The setuid and setgid bits of a mode.
const SUID_SGID: u64 = (libc::S_ISUID | libc::S_ISGID) as u64;
/// The open flags that create a file.
const CREATES: u64 = (libc::O_CREAT | libc::O_TMPFILE) as u64;

fn no_suid() -> SeccompCmpOp {
    SeccompCmpOp::MaskedEq(SUID_SGID)
}

/// A rule: every one of `conditions` (argument, comparison, value) holds.
fn rule(conditions: &[(u8, SeccompCmpOp, u64)]) -> Result<SeccompRule, ConfineError> {
    let conditions = conditions
        .iter()
        .map(|(arg, op, value)| {
            SeccompCondition::new(*arg, SeccompCmpArgLen::Dword, op.clone(), *value)
                .map_err(|e| ConfineError::Seccomp(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    SeccompRule::new(conditions).map_err(|e| ConfineError::Seccomp(e.to_string()))
}

/// This architecture's number of the call `name`, if it has one.
fn number_of(name: &str) -> Option<i64> {
    syscalls::Sysno::from_str(name)
        .ok()
        .map(|call| i64::from(call.id()))
}

/// The names of the allow-list.
pub fn allowed_names() -> impl Iterator<Item = &'static str> {
    SYSTEM_SERVICE
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
}

/// This machine's architecture, as seccompiler names it.
fn native() -> Result<TargetArch, ConfineError> {
    TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|_| ConfineError::Seccomp(format!("no filter for {}", std::env::consts::ARCH)))
}

/// The socket families every instance may make.
pub const ADDRESS_FAMILIES: [(&str, libc::c_int); 4] = [
    ("AF_UNIX", libc::AF_UNIX),
    ("AF_INET", libc::AF_INET),
    ("AF_INET6", libc::AF_INET6),
    ("AF_NETLINK", libc::AF_NETLINK),
];

/// The default filter, as a BPF program, with `AF_PACKET` sockets allowed
/// or not: each built once per process.
pub fn runtime_default(packet: bool) -> Result<BpfProgram, ConfineError> {
    type Built = std::sync::OnceLock<Result<BpfProgram, String>>;
    static BUILT: [Built; 2] = [Built::new(), Built::new()];
    BUILT[usize::from(packet)]
        .get_or_init(|| build(packet).map_err(|e| e.to_string()))
        .clone()
        .map_err(ConfineError::Seccomp)
}

fn build(packet: bool) -> Result<BpfProgram, ConfineError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for name in allowed_names() {
        // A name of another architecture (`_llseek` on x86_64) is skipped.
        if let Some(number) = number_of(name) {
            rules.insert(number, Vec::new());
        }
    }
    let no_new_namespace = || -> Result<Vec<SeccompRule>, ConfineError> {
        let condition = SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(NEW_NAMESPACES),
            0,
        )
        .map_err(|e| ConfineError::Seccomp(e.to_string()))?;
        Ok(vec![
            SeccompRule::new(vec![condition]).map_err(|e| ConfineError::Seccomp(e.to_string()))?,
        ])
    };
    rules.insert(libc::SYS_unshare, no_new_namespace()?);
    rules.insert(libc::SYS_clone, no_new_namespace()?);
    // LockPersonality=yes: the personality may be read or set to Linux's.
    rules.insert(
        libc::SYS_personality,
        vec![
            rule(&[(0, SeccompCmpOp::Eq, 0)])?,
            rule(&[(0, SeccompCmpOp::Eq, 0xffff_ffff)])?,
        ],
    );
    // RestrictSUIDSGID=yes: no mode with the setuid or setgid bit, by
    // the calls that set a mode (argument `mode`, and for the opens only
    // with O_CREAT or O_TMPFILE).
    for (name, mode) in [
        ("chmod", 1),
        ("fchmod", 1),
        ("fchmodat", 2),
        ("fchmodat2", 2),
        ("creat", 1),
        ("mkdir", 1),
        ("mkdirat", 2),
        ("mknod", 1),
        ("mknodat", 2),
    ] {
        if let Some(number) = number_of(name)
            && rules.contains_key(&number)
        {
            rules.insert(number, vec![rule(&[(mode, no_suid(), 0)])?]);
        }
    }
    for (name, flags, mode) in [("open", 1, 2), ("openat", 2, 3)] {
        if let Some(number) = number_of(name)
            && rules.contains_key(&number)
        {
            rules.insert(
                number,
                vec![
                    rule(&[(flags, SeccompCmpOp::MaskedEq(CREATES), 0)])?,
                    rule(&[(mode, no_suid(), 0)])?,
                ],
            );
        }
    }
    let families = ADDRESS_FAMILIES
        .iter()
        .map(|(_, family)| *family)
        .chain(packet.then_some(libc::AF_PACKET));
    rules.insert(
        libc::SYS_socket,
        families
            .map(|family| rule(&[(0, SeccompCmpOp::Eq, family as u64)]))
            .collect::<Result<_, _>>()?,
    );
    rules.remove(&libc::SYS_setns);
    rules.remove(&libc::SYS_clone3);
    let allowing = SeccompFilter::new(
        rules,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        native()?,
    )
    .map_err(|e| ConfineError::Seccomp(e.to_string()))?;
    let mut program =
        BpfProgram::try_from(allowing).map_err(|e| ConfineError::Seccomp(e.to_string()))?;
    // clone3 answered ENOSYS, ahead of the rest: seccompiler's filter has
    // one answer for every call it does not allow.
    program = clone3_enosys(program)?;
    Ok(program)
}

/// `program` with a first check that answers `clone3` with `ENOSYS`,
/// placed after seccompiler's architecture check (which reads the arch
/// and kills on another one; the syscall number is loaded after it).
fn clone3_enosys(program: BpfProgram) -> Result<BpfProgram, ConfineError> {
    // The architecture check is: load arch; jump-if-equal over the kill;
    // kill. Then the number is loaded. The check is inserted after that
    // load, so it sees the number in the accumulator.
    let load_nr = program
        .iter()
        .position(|i| i.code == (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16 && i.k == 0)
        .ok_or_else(|| ConfineError::Seccomp("the filter loads no syscall number".into()))?;
    let mut out = program[..=load_nr].to_vec();
    out.push(jump_if_equal(libc::SYS_clone3 as u32, 0, 1));
    out.push(statement(
        (libc::BPF_RET | libc::BPF_K) as u16,
        libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
    ));
    out.extend_from_slice(&program[load_nr + 1..]);
    Ok(out)
}

fn statement(code: u16, k: u32) -> seccompiler::sock_filter {
    seccompiler::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump_if_equal(k: u32, jt: u8, jf: u8) -> seccompiler::sock_filter {
    seccompiler::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt,
        jf,
        k,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_allows_what_a_service_needs_and_not_what_it_must_not() {
        let names: Vec<&str> = allowed_names().collect();
        for needed in [
            "read",
            "write",
            "openat",
            "execve",
            "accept4",
            "clone",
            "setrlimit",
        ] {
            assert!(names.contains(&needed), "{needed}");
        }
        for forbidden in [
            "mount",
            "ptrace",
            "kexec_load",
            "init_module",
            "bpf",
            "reboot",
            "swapon",
        ] {
            assert!(!names.contains(&forbidden), "{forbidden}");
        }
    }

    #[test]
    fn the_program_builds_for_this_machine() {
        for packet in [false, true] {
            let program = runtime_default(packet).expect("builds");
            assert!(program.len() > 300, "one check per allowed call at least");
            assert!(
                program.len() < 4096,
                "the kernel takes at most 4096 per program"
            );
        }
    }

    /// Where systemd is installed, its list is this one (a newer systemd
    /// may have grown it: then the file is regenerated as its header says).
    #[test]
    fn the_list_is_the_installed_systemds() {
        let Ok(output) = std::process::Command::new("systemd-analyze")
            .args(["syscall-filter", "@system-service"])
            .output()
        else {
            println!("no systemd-analyze here: the list is not compared");
            return;
        };
        let said = String::from_utf8_lossy(&output.stdout);
        for group_or_call in said.lines().map(str::trim) {
            if group_or_call.is_empty()
                || group_or_call.starts_with('#')
                || group_or_call.starts_with('@')
            {
                continue;
            }
            assert!(
                allowed_names().any(|n| n == group_or_call),
                "systemd's @system-service has {group_or_call}, the list does not"
            );
        }
    }
}
