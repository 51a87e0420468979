//! How much of the process's heap is in use and how much the allocator
//! holds free: the two figures that tell data from fragmentation when RSS
//! grows (docs/BENCHMARKS.md, "Fleet").
//!
//! Read from glibc's `mallinfo2`, which sums every arena; other C
//! libraries have no such call and report nothing.

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

/// Hands the free pages glibc's arenas hold back to the kernel; returns
/// whether any were. A no-op where the C library cannot.
pub fn release_free() -> bool {
    imp::release_free()
}

/// Releases the free heap whenever the process's RSS exceeds the heap in
/// use by more than `slack`, checking every `every`: after a burst
/// (thousands of requests at once) glibc keeps the freed memory in its
/// arenas, and the RSS would stay at the burst's peak for the process's
/// life.
pub async fn release_after_bursts(every: std::time::Duration, slack: u64) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let (Some(heap), Some(resident)) = (usage(), resident_bytes()) else {
            return;
        };
        if resident.saturating_sub(heap.in_use) > slack {
            let released = tokio::task::spawn_blocking(release_free)
                .await
                .unwrap_or(false);
            tracing::debug!(
                ?heap,
                resident,
                released,
                "released the heap a burst left free"
            );
        }
    }
}

/// The process's resident set, from `/proc/self/status`.
pub fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod imp {
    use super::HeapUsage;

    #[allow(unsafe_code)]
    pub(super) fn release_free() -> bool {
        // SAFETY: malloc_trim only walks the arenas under their locks and
        // madvises pages no allocation holds; 0 keeps no pad at the top.
        unsafe { libc::malloc_trim(0) == 1 }
    }

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

    pub(super) fn release_free() -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// The figures are the whole process's: one test at a time moves them.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_live_allocation_shows_in_use() {
        let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
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

    /// Many small blocks freed out of order stay in the arena (a large one
    /// would be unmapped at once); releasing gives their pages back.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn releasing_returns_a_freed_burst_to_the_kernel() {
        let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let before = resident_bytes().expect("procfs reports the RSS");
        let mut blocks: Vec<Vec<u8>> = (0..64 * 1024).map(|i| vec![i as u8; 1024]).collect();
        // One block in 512 outlives the burst, so the arena cannot shrink
        // from its top by itself.
        let kept: Vec<Vec<u8>> = blocks.drain(..).step_by(512).collect();
        let freed = resident_bytes().expect("procfs reports the RSS");
        assert!(freed >= before + (32 << 20), "{before} -> {freed}");
        release_free();
        let after = resident_bytes().expect("procfs reports the RSS");
        assert!(
            after + (32 << 20) < freed,
            "{freed} bytes resident once the burst was freed, {after} after the release"
        );
        drop(kept);
    }
}
