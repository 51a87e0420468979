//! Figures the benchmarks print: percentiles of duration samples.
#![allow(dead_code)]

use std::future::Future;
use std::time::Duration;

/// Runs `bench` with the count from the environment variable `name` (or
/// `default`) on the two-worker runtime every benchmark uses.
pub fn run_counted<F: Future<Output = ()>>(
    name: &str,
    default: usize,
    bench: impl FnOnce(usize) -> F,
) {
    let count = std::env::var(name)
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(bench(count));
}

/// `release build` or `debug build`, and where cgroup v2 is mounted.
pub fn build_and_mount() -> String {
    format!(
        "{}, cgroup {}",
        if cfg!(debug_assertions) {
            "debug build"
        } else {
            "release build"
        },
        node_agent::cgroup::discover_mount()
            .map(|m| m.display().to_string())
            .unwrap_or_default()
    )
}

pub fn print_row(name: &str, mut samples: Vec<Duration>) {
    samples.sort_unstable();
    println!(
        "{:<28} {:>10} {:>10} {:>10}",
        name,
        millis(percentile(&samples, 50)),
        millis(percentile(&samples, 99)),
        millis(samples.last().copied().unwrap_or_default())
    );
}

/// The nearest-rank percentile of sorted samples.
pub fn percentile(sorted: &[Duration], p: usize) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    sorted[rank.min(sorted.len()) - 1]
}

pub fn millis(duration: Duration) -> String {
    format!("{:.2} ms", duration.as_secs_f64() * 1000.0)
}
