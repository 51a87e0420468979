//! The binary's allocator: jemalloc, with a background thread that gives
//! freed pages back to the kernel about a second after they are freed.
//!
//! A release of many IGs is a burst of thousands of requests; glibc kept
//! what it freed in its arenas, and a release of the free heap after the
//! burst returned only whole free pages: at rest after a 1,000-node
//! release 6–7 KiB of RSS per attempt, against 4.0 with this
//! (docs/BENCHMARKS.md, "Fleet: the heap given back per burst"). Without
//! the background thread jemalloc purges only while something allocates,
//! and at rest nothing much does.

use genswap_runtime::heap::HeapUsage;
use tikv_jemalloc_ctl::{epoch, stats};

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read once at its start (`malloc_conf`).
#[repr(transparent)]
pub struct Options(*const std::ffi::c_char);

// SAFETY: the pointer is to a `'static` C string literal that nothing writes.
unsafe impl Sync for Options {}

// SAFETY: jemalloc reads this symbol, as prefixed by tikv-jemalloc-sys, as a
// `const char *` to a NUL-terminated string; `Options` is a transparent
// pointer to one, and no other symbol of that name is defined.
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static OPTIONS: Options =
    Options(c"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0".as_ptr());

/// The heap as jemalloc counts it: bytes handed out, and what is resident
/// beyond them (free pages not yet purged, fragments, its own metadata).
pub fn usage() -> Option<HeapUsage> {
    epoch::advance().ok()?;
    let allocated = stats::allocated::read().ok()? as u64;
    let resident = stats::resident::read().ok()? as u64;
    Some(HeapUsage {
        in_use: allocated,
        held_free: resident.saturating_sub(allocated),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_options_are_in_force() {
        assert!(tikv_jemalloc_ctl::opt::background_thread::read().expect("read the option"));
    }

    #[test]
    fn a_live_allocation_shows_in_use() {
        let before = usage().expect("jemalloc reports its heap");
        // Other tests allocate and free meanwhile: a margin of 1 MiB.
        let block: Vec<u8> = vec![1; 32 << 20];
        let during = usage().expect("jemalloc reports its heap");
        assert!(
            during.in_use >= before.in_use + (31 << 20),
            "{before:?} -> {during:?}"
        );
        drop(block);
        let after = usage().expect("jemalloc reports its heap");
        assert!(after.in_use < during.in_use, "{during:?} -> {after:?}");
    }
}
