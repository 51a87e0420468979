//! Figures the benchmarks print: percentiles of duration samples.
#![allow(dead_code)]

use std::time::Duration;

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
