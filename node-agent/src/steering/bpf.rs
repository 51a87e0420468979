//! The few `bpf(2)` commands steering needs: two maps, one program, and
//! their elements. aya has no `sk_reuseport` program type (aya-rs/aya#215)
//! and libbpf-rs loads programs from ELF objects, which would need a BPF
//! toolchain at build time for a dozen instructions; the kernel's own
//! interface is small enough to call directly.

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use nix::libc;

/// `enum bpf_cmd`.
const BPF_MAP_CREATE: libc::c_int = 0;
const BPF_MAP_LOOKUP_ELEM: libc::c_int = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_int = 2;
const BPF_MAP_DELETE_ELEM: libc::c_int = 3;
const BPF_PROG_LOAD: libc::c_int = 5;

/// `enum bpf_map_type`.
pub(super) const BPF_MAP_TYPE_HASH: u32 = 1;
pub(super) const BPF_MAP_TYPE_REUSEPORT_SOCKARRAY: u32 = 20;
/// `enum bpf_prog_type`.
pub(super) const BPF_PROG_TYPE_SK_REUSEPORT: u32 = 21;
/// `enum bpf_attach_type`: may also pick where a closing listener's queued
/// connections go (Linux 5.14).
pub(super) const BPF_SK_REUSEPORT_SELECT_OR_MIGRATE: u32 = 40;
/// `enum bpf_attach_type`: picks for new connections only.
pub(super) const BPF_SK_REUSEPORT_SELECT: u32 = 39;
/// `BPF_ANY`: create or replace.
const BPF_ANY: u64 = 0;

/// The verifier's log kept when a load is refused.
const LOG_SIZE: usize = 64 * 1024;

#[repr(C)]
#[derive(Default)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
}

#[repr(C)]
#[derive(Default)]
struct MapElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// Runs `cmd` with `attr`; the result is the syscall's non-negative value.
fn bpf<T>(cmd: libc::c_int, attr: &mut T) -> io::Result<i64> {
    // SAFETY: `attr` is a live, initialised `repr(C)` prefix of `union
    // bpf_attr` for `cmd`, and its size is passed with it; the kernel reads
    // (and for lookups writes through the pointers it holds) no more.
    let result = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr).cast::<libc::c_void>(),
            size_of::<T>(),
        )
    };
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(result)
}

/// Takes ownership of a descriptor the kernel just returned.
fn owned(raw: i64) -> io::Result<OwnedFd> {
    let raw = i32::try_from(raw).map_err(|_| io::Error::other("an impossible descriptor"))?;
    // SAFETY: the bpf syscall just returned this descriptor; nothing else
    // owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// A kernel object's name: at most 15 bytes and a NUL.
fn object_name(name: &str) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (slot, byte) in out.iter_mut().zip(name.bytes().take(15)) {
        *slot = byte;
    }
    out
}

/// Creates a map.
pub(super) fn map_create(
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    name: &str,
) -> io::Result<OwnedFd> {
    let mut attr = MapCreateAttr {
        map_type,
        key_size,
        value_size,
        max_entries,
        map_name: object_name(name),
        ..MapCreateAttr::default()
    };
    owned(bpf(BPF_MAP_CREATE, &mut attr)?)
}

fn elem_attr(map: BorrowedFd<'_>, key: &[u8], value: u64, flags: u64) -> io::Result<MapElemAttr> {
    Ok(MapElemAttr {
        map_fd: u32::try_from(map.as_raw_fd()).map_err(|_| io::Error::other("a negative fd"))?,
        key: key.as_ptr() as u64,
        value,
        flags,
        ..MapElemAttr::default()
    })
}

/// Sets `key` to `value` (created or replaced).
pub(super) fn map_update(map: BorrowedFd<'_>, key: &[u8], value: &[u8]) -> io::Result<()> {
    let mut attr = elem_attr(map, key, value.as_ptr() as u64, BPF_ANY)?;
    bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(drop)
}

/// Removes `key`; one that was not there is not an error.
pub(super) fn map_delete(map: BorrowedFd<'_>, key: &[u8]) -> io::Result<()> {
    let mut attr = elem_attr(map, key, 0, 0)?;
    match bpf(BPF_MAP_DELETE_ELEM, &mut attr) {
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other.map(drop),
    }
}

/// Reads `key` into `value`; `None` when it is not there.
pub(super) fn map_lookup(
    map: BorrowedFd<'_>,
    key: &[u8],
    value: &mut [u8],
) -> io::Result<Option<()>> {
    let mut attr = elem_attr(map, key, value.as_mut_ptr() as u64, 0)?;
    match bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) {
        Ok(_) => Ok(Some(())),
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(error) => Err(error),
    }
}

/// Why a program was refused: the errno, and the verifier's last lines.
#[derive(Debug)]
pub(super) struct LoadRefused {
    pub(super) error: io::Error,
    pub(super) log: String,
}

/// Loads `insns` as a program of `prog_type`; a refused load is tried once
/// more with the verifier's log on, to say why.
pub(super) fn prog_load(
    prog_type: u32,
    expected_attach_type: u32,
    insns: &[u64],
    name: &str,
) -> Result<OwnedFd, LoadRefused> {
    let license = c"Dual MIT/GPL";
    let refused = |error| LoadRefused {
        error,
        log: String::new(),
    };
    let mut attr = ProgLoadAttr {
        prog_type,
        insn_cnt: u32::try_from(insns.len())
            .map_err(|_| refused(io::Error::other("too many instructions")))?,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        prog_name: object_name(name),
        expected_attach_type,
        ..ProgLoadAttr::default()
    };
    match bpf(BPF_PROG_LOAD, &mut attr) {
        Ok(raw) => owned(raw).map_err(refused),
        Err(error) => {
            let mut log = vec![0u8; LOG_SIZE];
            attr.log_level = 1;
            attr.log_size = LOG_SIZE as u32;
            attr.log_buf = log.as_mut_ptr() as u64;
            // The second try only fills the log; its own result is the same.
            if let Ok(raw) = bpf(BPF_PROG_LOAD, &mut attr) {
                return owned(raw).map_err(refused);
            }
            let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]);
            let tail: Vec<&str> = text.lines().rev().take(6).collect();
            Err(LoadRefused {
                error,
                log: tail.into_iter().rev().collect::<Vec<_>>().join(" | "),
            })
        }
    }
}
