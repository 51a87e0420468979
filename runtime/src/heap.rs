//! How much of the process's heap is in use and how much the allocator
//! holds free: the two figures that tell data from fragmentation when RSS
//! grows (docs/BENCHMARKS.md, "Fleet").
//!
//! Read from glibc's `mallinfo2`, which sums every arena; other C
//! libraries have no such call and report nothing. A program that sets
//! another global allocator reads that allocator's own figures (the
//! controller: `controller/src/allocator.rs`).

/// The heap as the allocator sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeapUsage {
    /// Bytes handed out and not yet freed, mmapped chunks included.
    pub in_use: u64,
    /// Bytes freed but kept by the allocator in its arenas.
    pub held_free: u64,
}

/// The heap now; `None` where the C library cannot tell.
pub fn usage() -> Option<HeapUsage> {
    imp::usage()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod imp {
    use super::HeapUsage;

    #[allow(unsafe_code)]
    pub(super) fn usage() -> Option<HeapUsage> {
        // SAFETY: mallinfo2 takes no arguments, returns a struct by value
        // and only takes the arenas' locks while it reads them.
        let info = unsafe { libc::mallinfo2() };
        Some(HeapUsage {
            in_use: (info.uordblks as u64).saturating_add(info.hblkhd as u64),
            held_free: info.fordblks as u64,
        })
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod imp {
    pub(super) fn usage() -> Option<super::HeapUsage> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_live_allocation_shows_in_use() {
        let before = usage().expect("glibc reports its heap");
        let block: Vec<u8> = vec![1; 8 << 20];
        let during = usage().expect("glibc reports its heap");
        assert!(
            during.in_use >= before.in_use + (8 << 20),
            "{before:?} -> {during:?}"
        );
        drop(block);
        let after = usage().expect("glibc reports its heap");
        assert!(after.in_use < during.in_use, "{during:?} -> {after:?}");
    }
}
