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
//! The program is built once per agent, before any fork, and installed by
//! the child as its last step before exec. It is laid out as a binary
//! search over the call numbers, as libseccomp lays out its filters, not
//! as seccompiler's linear list: the kernel runs a filter over every call
//! number when it is attached (to cache the calls always allowed) and on
//! every call it cannot cache (an `openat`, a `socket`), and the list made
//! that about 370 comparisons deep. The tests hold the program to the one
//! seccompiler builds from the same policy, by running both over every
//! call number and a set of arguments.

use std::collections::BTreeMap;
use std::str::FromStr;

use nix::libc;
use seccompiler::{BpfProgram, TargetArch};

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

/// What one argument of a call must be for a rule to hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cond {
    /// `arg & mask == 0`, on the low 32 bits (`qword: false`) or all 64.
    MaskedZero { arg: u8, mask: u64, qword: bool },
    /// The low 32 bits of `arg` are `value`.
    Is { arg: u8, value: u32 },
}

/// The calls allowed, each with its rules: none, always allowed; else
/// allowed when every condition of one of them holds. Everything else is
/// `EPERM`, and `clone3` `ENOSYS`.
type Policy = BTreeMap<u32, Vec<Vec<Cond>>>;

/// This architecture's number of the call `name`, if it has one.
fn call(name: &str) -> Option<u32> {
    number_of(name).and_then(|n| u32::try_from(n).ok())
}

fn sys(number: libc::c_long) -> u32 {
    u32::try_from(number).unwrap_or(u32::MAX)
}

fn policy(packet: bool) -> Policy {
    let mut policy: Policy = allowed_names()
        .filter_map(call)
        .map(|number| (number, Vec::new()))
        .collect();
    // A name of another architecture (`_llseek` on x86_64) has no number.
    let no_new_namespace = vec![vec![Cond::MaskedZero {
        arg: 0,
        mask: NEW_NAMESPACES,
        qword: true,
    }]];
    policy.insert(sys(libc::SYS_unshare), no_new_namespace.clone());
    policy.insert(sys(libc::SYS_clone), no_new_namespace);
    // LockPersonality=yes: the personality may be read or set to Linux's.
    policy.insert(
        sys(libc::SYS_personality),
        vec![
            vec![Cond::Is { arg: 0, value: 0 }],
            vec![Cond::Is {
                arg: 0,
                value: 0xffff_ffff,
            }],
        ],
    );
    // RestrictSUIDSGID=yes: no mode with the setuid or setgid bit, by
    // the calls that set a mode (argument `mode`, and for the opens only
    // with O_CREAT or O_TMPFILE).
    let no_suid = |arg: u8| Cond::MaskedZero {
        arg,
        mask: SUID_SGID,
        qword: false,
    };
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
        if let Some(rules) = call(name).and_then(|number| policy.get_mut(&number)) {
            *rules = vec![vec![no_suid(mode)]];
        }
    }
    for (name, flags, mode) in [("open", 1, 2), ("openat", 2, 3)] {
        if let Some(rules) = call(name).and_then(|number| policy.get_mut(&number)) {
            *rules = vec![
                vec![Cond::MaskedZero {
                    arg: flags,
                    mask: CREATES,
                    qword: false,
                }],
                vec![no_suid(mode)],
            ];
        }
    }
    let families = ADDRESS_FAMILIES
        .iter()
        .map(|(_, family)| *family)
        .chain(packet.then_some(libc::AF_PACKET));
    policy.insert(
        sys(libc::SYS_socket),
        families
            .map(|family| {
                vec![Cond::Is {
                    arg: 0,
                    value: u32::try_from(family).unwrap_or(u32::MAX),
                }]
            })
            .collect(),
    );
    policy.remove(&sys(libc::SYS_setns));
    policy.remove(&sys(libc::SYS_clone3));
    policy
}

fn build(packet: bool) -> Result<BpfProgram, ConfineError> {
    compile(&policy(packet), audit_arch()?)
}

/// `AUDIT_ARCH_*` of this machine.
fn audit_arch() -> Result<u32, ConfineError> {
    const LE_64: u32 = 0x8000_0000 | 0x4000_0000;
    match native()? {
        TargetArch::x86_64 => Ok(62 | LE_64),
        TargetArch::aarch64 => Ok(183 | LE_64),
        TargetArch::riscv64 => Ok(243 | LE_64),
    }
}

/// Where `seccomp_data` keeps what a filter reads.
const NR_OFFSET: u32 = 0;
const ARCH_OFFSET: u32 = 4;
/// The low word of argument `arg` (little-endian); the high one follows.
fn arg_offset(arg: u8) -> u32 {
    16 + 8 * u32::from(arg)
}

/// Where a jump of the program being laid out goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum To {
    Next,
    Label(usize),
}

/// An instruction whose jumps are labels until the layout is done.
enum Op {
    Plain(seccompiler::sock_filter),
    /// `code` compares the accumulator with `k`: `then` when true.
    Cond {
        code: u16,
        k: u32,
        then: To,
        other: To,
    },
    Goto(usize),
    Mark(usize),
}

struct Layout {
    ops: Vec<Op>,
    labels: usize,
}

impl Layout {
    fn label(&mut self) -> usize {
        self.labels += 1;
        self.labels
    }

    fn plain(&mut self, code: u32, k: u32) {
        self.ops.push(Op::Plain(statement(
            u16::try_from(code).unwrap_or(u16::MAX),
            k,
        )));
    }

    fn load(&mut self, offset: u32) {
        self.plain(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, offset);
    }

    fn ret(&mut self, action: u32) {
        self.plain(libc::BPF_RET | libc::BPF_K, action);
    }

    fn cond(&mut self, code: u32, k: u32, then: To, other: To) {
        self.ops.push(Op::Cond {
            code: u16::try_from(libc::BPF_JMP | code | libc::BPF_K).unwrap_or(u16::MAX),
            k,
            then,
            other,
        });
    }

    /// A binary search of `calls` (sorted) for the number in the
    /// accumulator: each found one goes to its label, the rest to `deny`.
    fn search(&mut self, calls: &[(u32, usize)], deny: usize) {
        if calls.len() <= 3 {
            for (number, target) in calls {
                let skip = self.label();
                self.cond(libc::BPF_JEQ, *number, To::Next, To::Label(skip));
                self.ops.push(Op::Goto(*target));
                self.ops.push(Op::Mark(skip));
            }
            self.ops.push(Op::Goto(deny));
            return;
        }
        let (below, from) = calls.split_at(calls.len() / 2);
        let upper = self.label();
        let lower = self.label();
        self.cond(libc::BPF_JGE, from[0].0, To::Next, To::Label(lower));
        self.ops.push(Op::Goto(upper));
        self.ops.push(Op::Mark(lower));
        self.search(below, deny);
        self.ops.push(Op::Mark(upper));
        self.search(from, deny);
    }

    /// The instructions, every label resolved into a forward offset.
    fn finish(self) -> Result<Vec<seccompiler::sock_filter>, ConfineError> {
        let mut at = std::collections::HashMap::new();
        let mut pc = 0usize;
        for op in &self.ops {
            match op {
                Op::Mark(label) => {
                    at.insert(*label, pc);
                }
                _ => pc += 1,
            }
        }
        let too_far = || ConfineError::Seccomp("a jump of the filter is out of range".into());
        let offset = |from: usize, to: To| -> Result<usize, ConfineError> {
            match to {
                To::Next => Ok(0),
                To::Label(label) => at
                    .get(&label)
                    .and_then(|target| target.checked_sub(from + 1))
                    .ok_or_else(too_far),
            }
        };
        let mut program = Vec::with_capacity(pc);
        for op in self.ops {
            let here = program.len();
            match op {
                Op::Mark(_) => {}
                Op::Plain(instruction) => program.push(instruction),
                Op::Cond {
                    code,
                    k,
                    then,
                    other,
                } => {
                    let jt = u8::try_from(offset(here, then)?).map_err(|_| too_far())?;
                    let jf = u8::try_from(offset(here, other)?).map_err(|_| too_far())?;
                    program.push(seccompiler::sock_filter { code, jt, jf, k });
                }
                Op::Goto(label) => {
                    let k =
                        u32::try_from(offset(here, To::Label(label))?).map_err(|_| too_far())?;
                    program.push(statement(
                        u16::try_from(libc::BPF_JMP | libc::BPF_JA).unwrap_or(u16::MAX),
                        k,
                    ));
                }
            }
        }
        if program.len() > 4096 {
            return Err(ConfineError::Seccomp(format!(
                "the filter has {} instructions, more than the kernel's 4096",
                program.len()
            )));
        }
        Ok(program)
    }
}

/// `policy` as a BPF program: the architecture checked (another one
/// kills), `clone3` answered `ENOSYS`, then a binary search of the call
/// number, each allowed call with its rules in a block of its own.
fn compile(policy: &Policy, arch: u32) -> Result<BpfProgram, ConfineError> {
    let allow = libc::SECCOMP_RET_ALLOW;
    let deny = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
    let mut layout = Layout {
        ops: Vec::new(),
        labels: 0,
    };
    let (native, not_clone3) = (layout.label(), layout.label());
    layout.load(ARCH_OFFSET);
    layout.cond(libc::BPF_JEQ, arch, To::Label(native), To::Next);
    layout.ret(libc::SECCOMP_RET_KILL_PROCESS);
    layout.ops.push(Op::Mark(native));
    layout.load(NR_OFFSET);
    // clone3's flags lie in a struct no filter can read: ENOSYS makes libc
    // fall back to clone, whose flags the filter checks.
    layout.cond(
        libc::BPF_JEQ,
        sys(libc::SYS_clone3),
        To::Next,
        To::Label(not_clone3),
    );
    layout.ret(libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32);
    layout.ops.push(Op::Mark(not_clone3));

    let allowed = layout.label();
    let denied = layout.label();
    let mut blocks = Vec::new();
    let calls: Vec<(u32, usize)> = policy
        .iter()
        .map(|(number, rules)| {
            if rules.is_empty() {
                (*number, allowed)
            } else {
                let block = layout.label();
                blocks.push((block, rules));
                (*number, block)
            }
        })
        .collect();
    layout.search(&calls, denied);
    layout.ops.push(Op::Mark(allowed));
    layout.ret(allow);
    layout.ops.push(Op::Mark(denied));
    layout.ret(deny);
    for (block, rules) in blocks {
        layout.ops.push(Op::Mark(block));
        for rule in rules {
            let failed = layout.label();
            for cond in rule {
                match *cond {
                    Cond::MaskedZero { arg, mask, qword } => {
                        let words = [
                            (arg_offset(arg), mask & 0xffff_ffff),
                            (arg_offset(arg) + 4, if qword { mask >> 32 } else { 0 }),
                        ];
                        for (offset, part) in words {
                            if part != 0 {
                                layout.load(offset);
                                layout.cond(
                                    libc::BPF_JSET,
                                    u32::try_from(part).unwrap_or(u32::MAX),
                                    To::Label(failed),
                                    To::Next,
                                );
                            }
                        }
                    }
                    Cond::Is { arg, value } => {
                        layout.load(arg_offset(arg));
                        layout.cond(libc::BPF_JEQ, value, To::Next, To::Label(failed));
                    }
                }
            }
            layout.ret(allow);
            layout.ops.push(Op::Mark(failed));
        }
        layout.ret(deny);
    }
    layout.finish()
}

fn statement(code: u16, k: u32) -> seccompiler::sock_filter {
    seccompiler::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use seccompiler::{
        SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
    };

    /// The same policy as seccompiler builds it (a linear list), with the
    /// same first check for clone3: the reference the program is held to.
    fn reference(policy: &Policy) -> BpfProgram {
        let rules: BTreeMap<i64, Vec<SeccompRule>> = policy
            .iter()
            .map(|(number, rules)| {
                let rules = rules
                    .iter()
                    .map(|conditions| {
                        let conditions = conditions
                            .iter()
                            .map(|cond| match *cond {
                                Cond::MaskedZero { arg, mask, qword } => SeccompCondition::new(
                                    arg,
                                    if qword {
                                        SeccompCmpArgLen::Qword
                                    } else {
                                        SeccompCmpArgLen::Dword
                                    },
                                    SeccompCmpOp::MaskedEq(mask),
                                    0,
                                ),
                                Cond::Is { arg, value } => SeccompCondition::new(
                                    arg,
                                    SeccompCmpArgLen::Dword,
                                    SeccompCmpOp::Eq,
                                    u64::from(value),
                                ),
                            })
                            .collect::<Result<Vec<_>, _>>()
                            .expect("conditions");
                        SeccompRule::new(conditions).expect("a rule")
                    })
                    .collect();
                (i64::from(*number), rules)
            })
            .collect();
        let filter = SeccompFilter::new(
            rules,
            SeccompAction::Errno(libc::EPERM as u32),
            SeccompAction::Allow,
            native().expect("an architecture"),
        )
        .expect("a filter");
        clone3_enosys(BpfProgram::try_from(filter).expect("a program"))
    }

    /// `program` with a first check that answers `clone3` with `ENOSYS`,
    /// placed after seccompiler's architecture check (which reads the arch
    /// and kills on another one; the syscall number is loaded after it).
    fn clone3_enosys(program: BpfProgram) -> BpfProgram {
        let load_nr = program
            .iter()
            .position(|i| i.code == (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16 && i.k == 0)
            .expect("the filter loads the number");
        let mut out = program[..=load_nr].to_vec();
        out.push(seccompiler::sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt: 0,
            jf: 1,
            k: libc::SYS_clone3 as u32,
        });
        out.push(statement(
            (libc::BPF_RET | libc::BPF_K) as u16,
            libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
        ));
        out.extend_from_slice(&program[load_nr + 1..]);
        out
    }

    /// Runs a classic BPF program of the instructions a seccomp filter
    /// uses over one call: its answer, and how many instructions it ran.
    fn run(
        program: &[seccompiler::sock_filter],
        arch: u32,
        nr: u32,
        args: [u64; 6],
    ) -> (u32, usize) {
        let word = |offset: u32| -> u32 {
            match offset {
                0 => nr,
                4 => arch,
                o if (16..64).contains(&o) => {
                    let arg = args[((o - 16) / 8) as usize];
                    if (o - 16) % 8 == 0 {
                        arg as u32
                    } else {
                        (arg >> 32) as u32
                    }
                }
                o => panic!("a load at {o}"),
            }
        };
        let (mut pc, mut acc, mut ran) = (0usize, 0u32, 0usize);
        loop {
            let i = &program[pc];
            ran += 1;
            let class = u32::from(i.code) & 0x07;
            let op = u32::from(i.code) & 0xf0;
            match class {
                c if c == libc::BPF_LD => {
                    acc = word(i.k);
                    pc += 1;
                }
                c if c == libc::BPF_ALU && op == libc::BPF_AND => {
                    acc &= i.k;
                    pc += 1;
                }
                c if c == libc::BPF_JMP => {
                    let taken = match op {
                        o if o == libc::BPF_JA => {
                            pc += 1 + i.k as usize;
                            continue;
                        }
                        o if o == libc::BPF_JEQ => acc == i.k,
                        o if o == libc::BPF_JGE => acc >= i.k,
                        o if o == libc::BPF_JGT => acc > i.k,
                        o if o == libc::BPF_JSET => acc & i.k != 0,
                        o => panic!("jump op {o:#x}"),
                    };
                    pc += 1 + usize::from(if taken { i.jt } else { i.jf });
                }
                c if c == libc::BPF_RET => return (i.k, ran),
                c => panic!("class {c:#x} at {pc}"),
            }
        }
    }

    /// Argument values around every bit a rule looks at.
    fn interesting() -> Vec<u64> {
        let mut values = vec![
            0,
            1,
            2,
            3,
            10,
            16,
            17,
            0xffff_ffff,
            u64::MAX,
            1 << 32,
            0xffff_ffff_0000_0000,
        ];
        for bit in 0..64 {
            values.push(1 << bit);
        }
        values.extend([
            0o4755,
            0o2755,
            0o6755,
            0o755,
            0o644,
            (libc::O_CREAT | libc::O_WRONLY) as u64,
            libc::O_TMPFILE as u64,
            (libc::CLONE_NEWUSER | libc::SIGCHLD) as u64,
            (libc::CLONE_VM | libc::CLONE_THREAD) as u64,
        ]);
        values
    }

    #[test]
    fn the_search_answers_every_call_as_seccompilers_list_does() {
        let arch = audit_arch().expect("an architecture");
        for packet in [false, true] {
            let policy = policy(packet);
            let ours = compile(&policy, arch).expect("ours");
            let theirs = reference(&policy);
            let (mut ours_ran, mut theirs_ran) = (0usize, 0usize);
            let mut calls = 0usize;
            let numbers = (0..1024u32).chain([0x4000_0000, 0x4000_0000 + 257, u32::MAX]);
            for nr in numbers {
                let mut argss = vec![[0u64; 6]];
                if policy.get(&nr).is_some_and(|rules| !rules.is_empty()) {
                    for arg in 0..6 {
                        for value in interesting() {
                            let mut args = [0u64; 6];
                            args[arg] = value;
                            argss.push(args);
                            let mut with_create = [0u64; 6];
                            with_create[arg] = value;
                            with_create[(arg + 1) % 6] = libc::O_CREAT as u64;
                            argss.push(with_create);
                        }
                    }
                }
                for args in argss {
                    let (a, ran_a) = run(&ours, arch, nr, args);
                    let (b, ran_b) = run(&theirs, arch, nr, args);
                    assert_eq!(a, b, "call {nr} with {args:?}");
                    ours_ran += ran_a;
                    theirs_ran += ran_b;
                    calls += 1;
                }
            }
            // Another architecture is killed by both.
            assert_eq!(
                run(&ours, arch ^ 1, 0, [0; 6]).0,
                libc::SECCOMP_RET_KILL_PROCESS
            );
            assert_eq!(
                run(&theirs, arch ^ 1, 0, [0; 6]).0,
                libc::SECCOMP_RET_KILL_PROCESS
            );
            println!(
                "packet {packet}: {calls} calls, {:.1} instructions each (seccompiler's list: {:.1}); {} instructions (its: {})",
                ours_ran as f64 / calls as f64,
                theirs_ran as f64 / calls as f64,
                ours.len(),
                theirs.len()
            );
            assert!(ours_ran * 4 < theirs_ran, "the search is not shorter");
        }
    }

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
