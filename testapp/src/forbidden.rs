//! `TESTAPP_TRY`: tries what a sandbox forbids, each once, and says what
//! the kernel answered, so a test can show each refusal (and the same
//! thing allowed where the spec opens it).

use std::io;

use nix::libc;

/// Tries each of `things` (comma-separated) and prints one line for each.
pub fn try_each(things: &str) {
    for thing in things.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let result = match thing.strip_prefix("list:") {
            Some(dir) => list(dir),
            None => match try_one(thing) {
                Ok(()) => "ok".to_string(),
                Err(error) => error.to_string(),
            },
        };
        println!("tried {thing}: {result}");
    }
}

/// The names in `dir`, sorted, space-separated; or the error.
fn list(dir: &str) -> String {
    match std::fs::read_dir(dir) {
        Ok(entries) => {
            let mut names: Vec<String> = entries
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names.join(" ")
        }
        Err(error) => error.to_string(),
    }
}

/// The result of a raw system call: its errno when it failed.
fn checked(result: libc::c_long) -> io::Result<()> {
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn try_one(thing: &str) -> io::Result<()> {
    if let Some(path) = thing.strip_prefix("write:") {
        return std::fs::write(path, b"written by the test app\n");
    }
    // A file of its own made setuid, by chmod and by creating it so.
    if let Some(dir) = thing.strip_prefix("setuid-chmod:") {
        use std::os::unix::fs::PermissionsExt;
        let path = std::path::Path::new(dir).join("setuid-chmod");
        std::fs::write(&path, b"")?;
        return std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o4755));
    }
    if let Some(dir) = thing.strip_prefix("setuid-create:") {
        use std::os::unix::fs::OpenOptionsExt;
        let path = std::path::Path::new(dir).join("setuid-create");
        return std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o4755)
            .open(path)
            .map(drop);
    }
    if let Some(path) = thing.strip_prefix("read:") {
        return std::fs::read_dir(path).map(drop).or_else(|error| {
            if error.raw_os_error() == Some(libc::ENOTDIR) {
                std::fs::read(path).map(drop)
            } else {
                Err(error)
            }
        });
    }
    // SAFETY (every call below): a raw system call with integer arguments
    // and, where a pointer is passed, a NUL-terminated literal or null.
    match thing {
        "mount" => checked(unsafe {
            libc::syscall(
                libc::SYS_mount,
                c"none".as_ptr(),
                c"/tmp".as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                std::ptr::null::<libc::c_void>(),
            )
        }),
        // PID 1: never this process's child, so only a privilege allows it.
        "ptrace" => {
            checked(unsafe { libc::syscall(libc::SYS_ptrace, libc::PTRACE_ATTACH, 1, 0, 0) })
        }
        "unshare-user" => checked(unsafe { libc::syscall(libc::SYS_unshare, libc::CLONE_NEWUSER) }),
        "raw-socket" => socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_ICMP),
        "packet-socket" => socket(libc::AF_PACKET, libc::SOCK_RAW, 0),
        "netlink-socket" => socket(libc::AF_NETLINK, libc::SOCK_DGRAM, 0),
        // A family no user needs a capability for, and no host service uses.
        "vsock-socket" => socket(libc::AF_VSOCK, libc::SOCK_STREAM, 0),
        "kexec" => checked(unsafe {
            libc::syscall(
                libc::SYS_kexec_load,
                0,
                0,
                std::ptr::null::<libc::c_void>(),
                0,
            )
        }),
        "init-module" => checked(unsafe {
            libc::syscall(
                libc::SYS_init_module,
                std::ptr::null::<libc::c_void>(),
                0,
                c"".as_ptr(),
            )
        }),
        // PER_LINUX32: another personality than Linux's.
        "personality" => {
            // SAFETY: personality takes an integer.
            let old = unsafe { libc::personality(0x0008) };
            if old == -1 {
                Err(io::Error::last_os_error())
            } else {
                // SAFETY: as above; back to what it was.
                unsafe { libc::personality(old as libc::c_ulong) };
                Ok(())
            }
        }
        "realtime" => {
            let param = libc::sched_param { sched_priority: 1 };
            // SAFETY: sched_setscheduler reads one live sched_param.
            checked(unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) }.into())
        }
        other => Err(io::Error::other(format!("unknown thing to try: {other}"))),
    }
}

fn socket(domain: libc::c_int, kind: libc::c_int, protocol: libc::c_int) -> io::Result<()> {
    // SAFETY: socket takes integers; the descriptor it returns is closed.
    let fd = unsafe { libc::socket(domain, kind, protocol) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned and is this function's alone.
    unsafe { libc::close(fd) };
    Ok(())
}
