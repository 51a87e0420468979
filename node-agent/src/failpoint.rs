//! Deterministic crash points for the kill tests (SPEC 5.7, issue 7).
//!
//! `failpoint!("overlap.after_spawn")` marks a step boundary of a swap. With
//! `GENSWAP_CRASH_AT=overlap.after_spawn` in the agent's environment the
//! process dies right there:
//!
//! - `GENSWAP_CRASH_HOW=abort` (the default): [`std::process::abort`], a
//!   death with no unwinding, no destructors and no flushing, which leaves the
//!   host as a SIGKILL or a power cut would;
//! - `GENSWAP_CRASH_HOW=pause`: one line, [`PAUSED_PREFIX`]`<point>`, goes to
//!   stderr and the thread that reached the point stops for good. The rest of
//!   the agent keeps running, so a test can wait until the adapter's own
//!   bookkeeping (the standalone state file) has caught up and then SIGKILL
//!   the process at a known instant.
//!
//! Why an environment hook rather than a `cfg(test)` fail-point: the kill
//! tests run the real `node-agent` binary as a separate process, built by
//! cargo in the normal profile for the integration tests, and `cfg(test)`
//! exists only in the crate's own unit-test build. The hook is therefore
//! compiled in always and inert when the variable is unset: the environment
//! is read once, at the first point reached, and every check after that is
//! one atomic load.
//!
//! The names are `<mode>.<boundary>` with `<mode>` the effective mode
//! (`overlap` or `hold`), or `restart` for the supervisor's restart of an
//! exited instance (an install of a server: its overlap boundaries without
//! an incumbent); [`POINTS`] lists every one, in the order a
//! successful swap reaches them, and `docs/RELIABILITY.md` says what recovery
//! does after each.

use std::io::Write;
use std::sync::OnceLock;

/// The variable naming the point to crash at.
pub const CRASH_AT_ENV: &str = "GENSWAP_CRASH_AT";
/// The variable choosing how to crash: `abort` (default) or `pause`.
pub const CRASH_HOW_ENV: &str = "GENSWAP_CRASH_HOW";
/// What a paused point writes to stderr, followed by the point's name.
pub const PAUSED_PREFIX: &str = "genswap failpoint paused at ";

/// Every crash point, in the order a successful swap of that mode reaches
/// them (`settle` only with a settle window).
pub const POINTS: &[&str] = &[
    "overlap.admitted",
    "overlap.staged",
    "overlap.after_admit",
    "overlap.after_raise",
    "overlap.after_journal",
    "overlap.after_spawn",
    "overlap.before_health",
    "overlap.after_health",
    "overlap.after_settle",
    "overlap.before_switch",
    "overlap.after_link_switch",
    "overlap.after_switch",
    "overlap.before_retire",
    "overlap.after_retire",
    "overlap.before_finish",
    "overlap.after_finish",
    "hold.admitted",
    "hold.staged",
    "hold.after_admit",
    "hold.before_stop",
    "hold.after_stop",
    "hold.after_raise",
    "hold.after_journal",
    "hold.after_spawn",
    "hold.before_health",
    "hold.after_health",
    "hold.after_settle",
    "hold.before_switch",
    "hold.after_switch",
    "hold.before_finish",
    "hold.after_finish",
    "restart.admitted",
    "restart.staged",
    "restart.after_admit",
    "restart.after_raise",
    "restart.after_journal",
    "restart.after_spawn",
    "restart.before_health",
    "restart.after_health",
    "restart.before_switch",
    "restart.after_link_switch",
    "restart.after_switch",
    "restart.before_finish",
    "restart.after_finish",
];

/// How an armed point ends the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashHow {
    /// [`std::process::abort`].
    Abort,
    /// Say so on stderr and stop the thread, for a test to SIGKILL.
    Pause,
}

#[derive(Debug)]
struct Armed {
    point: String,
    how: CrashHow,
}

static ARMED: OnceLock<Option<Armed>> = OnceLock::new();

/// Marks a crash point. `failpoint!("hold.before_stop")`, or
/// `failpoint!(mode, "after_spawn")` for `<mode>.after_spawn` where the
/// mode is only known at run time.
#[macro_export]
macro_rules! failpoint {
    ($point:expr) => {
        $crate::failpoint::reached($point)
    };
    ($scope:expr, $step:expr) => {
        $crate::failpoint::reached_in($scope, $step)
    };
}

/// The point `point` is reached: crashes when it is the armed one.
#[inline]
pub fn reached(point: &str) {
    if let Some(armed) = armed()
        && armed.point == point
    {
        crash(armed);
    }
}

/// The point `<scope>.<step>` is reached: crashes when it is the armed one.
#[inline]
pub fn reached_in(scope: &str, step: &str) {
    if let Some(armed) = armed()
        && armed.point.split_once('.') == Some((scope, step))
    {
        crash(armed);
    }
}

/// The armed point, if any (read from the environment once).
pub fn armed_point() -> Option<(&'static str, CrashHow)> {
    armed().map(|armed| (armed.point.as_str(), armed.how))
}

fn armed() -> Option<&'static Armed> {
    ARMED.get_or_init(from_env).as_ref()
}

fn from_env() -> Option<Armed> {
    let point = std::env::var(CRASH_AT_ENV).ok().filter(|p| !p.is_empty())?;
    let how = match std::env::var(CRASH_HOW_ENV).as_deref() {
        Ok("pause") => CrashHow::Pause,
        _ => CrashHow::Abort,
    };
    if !POINTS.contains(&point.as_str()) {
        // Said on stderr: a misspelt point would otherwise look like a run
        // that survived it.
        let _ = writeln!(
            std::io::stderr(),
            "{CRASH_AT_ENV}={point} names no crash point; known points: {}",
            POINTS.join(", ")
        );
    }
    Some(Armed { point, how })
}

fn crash(armed: &Armed) -> ! {
    match armed.how {
        CrashHow::Abort => std::process::abort(),
        CrashHow::Pause => {
            let mut stderr = std::io::stderr().lock();
            let _ = writeln!(stderr, "{PAUSED_PREFIX}{}", armed.point);
            let _ = stderr.flush();
            drop(stderr);
            loop {
                std::thread::park();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn point_names_are_unique_and_scoped_by_mode_or_restart() {
        let mut seen = std::collections::BTreeSet::new();
        for point in POINTS {
            assert!(seen.insert(*point), "{point} listed twice");
            let (scope, step) = point.split_once('.').expect("<mode>.<step>");
            assert!(matches!(scope, "overlap" | "hold" | "restart"), "{point}");
            assert!(!step.is_empty() && !step.contains('.'), "{point}");
        }
    }

    #[test]
    fn unarmed_points_do_nothing() {
        // The unit-test process never sets the variable.
        if std::env::var_os(CRASH_AT_ENV).is_none() {
            reached("overlap.after_spawn");
            reached_in("hold", "before_stop");
            assert_eq!(armed_point(), None);
        }
    }
}
