//! The scheduler alone: plans per second and memory, for many small
//! InstanceGenerations and for a few wide ones.
//!
//! `cargo bench -p controller --bench scheduler` prints a table; nothing is
//! asserted about time. Fixtures are made by the scheduler itself: each IG is
//! rolled out to build b1, then moved to b2 and left mid-rollout (canary
//! done, `maxParallel` attempts in flight) or settled (every node on b1).
//!
//! Memory is counted by a global allocator: the heap the fixtures hold, the
//! peak extra heap one plan needs, and allocations per plan; VmHWM (the
//! process's peak resident set) is read from /proc/self/status.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use genswap_core::scheduler::plan;

#[path = "support/fleet.rs"]
mod fleet;
use fleet::{cluster, fleet, now};

/// Forwards to the system allocator and counts live bytes, their peak and
/// the number of allocations.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(live, Ordering::Relaxed);
    ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
}

// SAFETY: every method forwards to `System` with the caller's arguments and
// returns its result unchanged; the counters never affect the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `alloc`'s contract for `layout`.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` (through us) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` was allocated by `System` with `layout`; the caller
        // upholds `realloc`'s contract for `new_size`.
        let moved = unsafe { System.realloc(ptr, layout, new_size) };
        if !moved.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        moved
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

struct Row {
    name: String,
    igs: usize,
    nodes: usize,
    attempts: usize,
    plans: usize,
    elapsed: Duration,
    allocations_per_plan: f64,
    fixture_heap: usize,
    peak_plan_heap: usize,
    vm_hwm_kib: Option<u64>,
}

fn measure(name: &str, igs: usize, node_count: usize, max_parallel: i32, mid_rollout: bool) -> Row {
    let nodes = cluster(node_count);
    let live_before = LIVE.load(Ordering::Relaxed);
    let fleet = fleet(igs, &nodes, max_parallel, mid_rollout);
    let fixture_heap = LIVE.load(Ordering::Relaxed).saturating_sub(live_before);
    let attempts = fleet.iter().map(|s| s.attempts.len()).sum();

    // One warm-up round decides how many rounds fill about two seconds.
    let started = Instant::now();
    for stored in &fleet {
        black_box(plan(&stored.ig, &stored.attempts, &nodes, now()));
    }
    let round = started.elapsed().max(Duration::from_micros(1));
    let rounds = (Duration::from_secs(2).as_nanos() / round.as_nanos()).clamp(1, 1000) as usize;

    let allocations_before = ALLOCATIONS.load(Ordering::Relaxed);
    let mut peak_plan_heap = 0;
    let started = Instant::now();
    for _ in 0..rounds {
        for stored in &fleet {
            let base = LIVE.load(Ordering::Relaxed);
            PEAK.store(base, Ordering::Relaxed);
            let plan = black_box(plan(&stored.ig, &stored.attempts, &nodes, now()));
            peak_plan_heap = peak_plan_heap.max(PEAK.load(Ordering::Relaxed).saturating_sub(base));
            drop(plan);
        }
    }
    let elapsed = started.elapsed();
    let plans = rounds * fleet.len();
    let allocations = ALLOCATIONS.load(Ordering::Relaxed) - allocations_before;
    Row {
        name: name.to_string(),
        igs,
        nodes: node_count,
        attempts,
        plans,
        elapsed,
        allocations_per_plan: allocations as f64 / plans as f64,
        fixture_heap,
        peak_plan_heap,
        vm_hwm_kib: vm_hwm_kib(),
    }
}

/// The process's peak resident set, from /proc/self/status.
fn vm_hwm_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

fn kib(bytes: usize) -> String {
    format!("{:.1} KiB", bytes as f64 / 1024.0)
}

fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn main() {
    // `cargo bench -p controller --bench scheduler -- --test`: a smoke run.
    let quick = std::env::args().any(|a| a == "--test");
    let cases: &[(&str, usize, usize, i32, bool)] = if quick {
        &[("smoke", 10, 3, 1, true)]
    } else {
        &[
            ("10,000 IGs x 3 nodes, mid-rollout", 10_000, 3, 1, true),
            ("10,000 IGs x 3 nodes, settled", 10_000, 3, 1, false),
            ("100 IGs x 1,000 nodes, mid-rollout", 100, 1_000, 50, true),
            ("100 IGs x 1,000 nodes, settled", 100, 1_000, 50, false),
        ]
    };
    println!(
        "{:<36} {:>6} {:>6} {:>9} {:>7} {:>9} {:>9} {:>9} {:>11} {:>11} {:>11}",
        "scenario",
        "IGs",
        "nodes",
        "attempts",
        "plans",
        "plans/s",
        "us/plan",
        "allocs/pl",
        "fixtures",
        "plan peak",
        "VmHWM"
    );
    for &(name, igs, nodes, max_parallel, mid_rollout) in cases {
        let row = measure(name, igs, nodes, max_parallel, mid_rollout);
        let per_plan = row.elapsed.as_secs_f64() / row.plans as f64;
        println!(
            "{:<36} {:>6} {:>6} {:>9} {:>7} {:>9.0} {:>9.1} {:>9.0} {:>11} {:>11} {:>11}",
            row.name,
            row.igs,
            row.nodes,
            row.attempts,
            row.plans,
            1.0 / per_plan,
            per_plan * 1e6,
            row.allocations_per_plan,
            mib(row.fixture_heap),
            kib(row.peak_plan_heap),
            row.vm_hwm_kib.map_or_else(
                || "n/a".to_string(),
                |k| format!("{:.1} MiB", k as f64 / 1024.0)
            ),
        );
    }
}
