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

/// Releases the free heap after each burst, checking every `every`: after
/// thousands of requests at once glibc keeps the freed memory in its
/// arenas, and the RSS would stay at the burst's peak for the process's
/// life. A burst is the RSS beyond the heap in use growing by more than
/// `slack` ([`BurstRule`]).
pub async fn release_after_bursts(every: std::time::Duration, slack: u64) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut rule = BurstRule::new(slack);
    loop {
        ticks.tick().await;
        let Some(beyond) = beyond_heap() else {
            return;
        };
        if rule.due(beyond) {
            let released = tokio::task::spawn_blocking(release_free)
                .await
                .unwrap_or(false);
            let after = beyond_heap().unwrap_or(beyond);
            rule.released(after);
            tracing::debug!(
                before = beyond,
                after,
                released,
                "released the heap a burst left free"
            );
        }
    }
}

/// The RSS beyond the heap in use: code, stacks, and what the allocator
/// keeps resident though nothing uses it.
fn beyond_heap() -> Option<u64> {
    let (heap, resident) = (usage()?, resident_bytes()?);
    Some(resident.saturating_sub(heap.in_use))
}

/// When to release the heap. What the RSS holds beyond the heap in use
/// right after a release (or at start) is its floor: code, stacks, and
/// fragments a release cannot return. A release is due once that figure
/// has grown past the floor by `slack`. A fixed threshold either never
/// fires for a small process (its burst stays under it) or fires on every
/// check for a large one (its fragments alone pass it).
#[derive(Clone, Copy, Debug)]
pub struct BurstRule {
    slack: u64,
    floor: Option<u64>,
}

impl BurstRule {
    pub fn new(slack: u64) -> Self {
        Self { slack, floor: None }
    }

    /// Whether to release now, given the RSS beyond the heap in use.
    pub fn due(&mut self, beyond: u64) -> bool {
        let floor = *self.floor.get_or_insert(beyond);
        if beyond < floor {
            self.floor = Some(beyond);
        }
        beyond > floor.saturating_add(self.slack)
    }

    /// A release left `beyond` resident beyond the heap in use.
    pub fn released(&mut self, beyond: u64) {
        self.floor = Some(beyond);
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

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_release_is_due_once_per_burst_past_the_floor() {
        let mut rule = BurstRule::new(16 * MIB);
        // The first figure is the floor: nothing to release at start.
        assert!(!rule.due(20 * MIB));
        assert!(!rule.due(36 * MIB), "at the slack, not past it");
        assert!(rule.due(45 * MIB), "a burst left 25 MiB");
        // The release could not return all of it: the new floor.
        rule.released(30 * MIB);
        assert!(!rule.due(30 * MIB), "not again for the same burst");
        assert!(!rule.due(40 * MIB));
        assert!(rule.due(50 * MIB), "the next burst");
    }

    #[test]
    fn the_floor_follows_the_rss_down() {
        let mut rule = BurstRule::new(16 * MIB);
        assert!(!rule.due(40 * MIB));
        // Freed memory went back by itself (an unmapped large block).
        assert!(!rule.due(20 * MIB));
        assert!(rule.due(40 * MIB), "20 MiB past the lower floor");
    }

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
