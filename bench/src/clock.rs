//! One clock for every process of a run: CLOCK_MONOTONIC, in nanoseconds.
//! The driver stamps swaps with it and the load generator stamps requests
//! with it, so the two line up without any exchange between them.

use nix::time::{ClockId, clock_gettime};

/// Now on CLOCK_MONOTONIC, in nanoseconds.
pub fn mono_ns() -> u64 {
    // CLOCK_MONOTONIC exists on every Linux; a failure here is impossible
    // short of a broken libc, and 0 would only show as a nonsense figure.
    clock_gettime(ClockId::CLOCK_MONOTONIC)
        .map(|t| {
            u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000_000
                + u64::try_from(t.tv_nsec()).unwrap_or(0)
        })
        .unwrap_or(0)
}
