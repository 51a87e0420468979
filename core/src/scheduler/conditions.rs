//! `Ready`, `Reconciling` and `Stalled` with their kstatus meanings, and
//! messages that name the nodes and builds concerned.

use genswap_crds::{AnalysisPhase, ConditionType, DesiredState, OnFailure, set_condition};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

use super::analysis::{self, Gate};
use super::failure_book::FailureBook;
use super::rollout::Progress;
use super::supervision::Down;
use super::{Context, cut};

/// The reasons the scheduler writes on its conditions.
pub mod reasons {
    /// Ready=True: every selected node serves the desired state.
    pub const ALL_NODES_READY: &str = "AllNodesReady";
    /// Attempts are in flight or wait their turn (canaries, maxParallel).
    pub const ROLLOUT_IN_PROGRESS: &str = "RolloutInProgress";
    /// Attempts for an older desired state are being replaced or still run.
    pub const SUPERSEDING: &str = "Superseding";
    /// An abandoned attempt is re-issued, or waits for its backoff.
    pub const RETRYING_ABANDONED: &str = "RetryingAbandoned";
    /// A change of `spec.retry` armed one attempt of the held-down build.
    pub const RETRYING_HELD_BUILD: &str = "RetryingHeldBuild";
    /// The desired build failed and is held down: a human must act.
    pub const BUILD_FAILED: &str = "BuildFailed";
    /// Like BuildFailed, and nothing serves on a node (a hold went down).
    pub const NODE_DOWN: &str = "NodeDown";
    /// The selector matches no node.
    pub const NO_MATCHING_NODES: &str = "NoMatchingNodes";
    /// A node's generation exited between attempts: it is being restarted,
    /// or (Stalled) its restart policy leaves it down.
    pub const GENERATION_EXITED: &str = "GenerationExited";
    /// A node refused the desired state's last attempts for one reason:
    /// they are retried, but a human must act.
    pub const REPEATED_REFUSAL: &str = "RepeatedRefusal";
    /// A node's generation keeps exiting; its next restart waits.
    pub const CRASH_LOOP_BACK_OFF: &str = "CrashLoopBackOff";
    /// A node's generation failed its liveness probe and was stopped; it is
    /// being restarted, or its restart policy leaves it down.
    pub const LIVENESS_FAILED: &str = "LivenessFailed";
    /// `spec.rollout.paused`: nodes wait for the rollout to resume.
    pub const PAUSED: &str = "Paused";
    /// `rollout.prestage`: the nodes stage the desired build before its
    /// first swap.
    pub const PRESTAGING: &str = "Prestaging";
    /// Stalled: pre-staging has not finished on every node within
    /// `rollout.prestageDeadlineSeconds`.
    pub const PRESTAGE_DEADLINE_EXCEEDED: &str = "PrestageDeadlineExceeded";
    /// Ready=True, and a sidecar of a serving generation is not running
    /// (exited, backing off): the instance serves, its helper does not.
    pub const SIDECAR_DOWN: &str = "SidecarDown";
    /// Stalled: the rollout has not moved for
    /// `rollout.progressDeadlineSeconds`.
    pub const PROGRESS_DEADLINE_EXCEEDED: &str = "ProgressDeadlineExceeded";
}

/// At most this many names in one message.
const NAMES_SHOWN: usize = 8;

/// At most this many bytes of one message (the reasons in it are the
/// agents' free text).
pub(super) const MESSAGE_BYTES: usize = 1024;

pub(super) fn write(
    conditions: &mut Vec<Condition>,
    ctx: &Context<'_>,
    progress: &Progress<'_>,
    book: &FailureBook,
    wave_names: &[String],
) {
    let generation = ctx.generation;
    let now = &ctx.now;
    let target = describe(&ctx.desired);
    let none_selected = progress.selected == 0;
    let measuring = matches!(progress.position.analysis, Some(Gate::Measuring { .. }));
    let all_serve = !none_selected && progress.ready == progress.selected;
    // Not Ready while the metrics judge what every node runs, nor when
    // they halted it.
    let all_ready = all_serve && progress.position.analysis.is_none();
    let left_down: Vec<(&str, Down)> = progress
        .down_between
        .iter()
        .filter(|(_, down)| matches!(down, Down::Left(_)))
        .cloned()
        .collect();
    let held = (!progress.stalled.is_empty()).then_some(if progress.down.is_empty() {
        reasons::BUILD_FAILED
    } else {
        reasons::NODE_DOWN
    });
    let analysis_halt = match progress.position.analysis {
        Some(Gate::Halted(AnalysisPhase::Failed)) => Some(analysis::reasons::ANALYSIS_FAILED),
        Some(Gate::Halted(_)) => Some(analysis::reasons::ANALYSIS_INCONCLUSIVE),
        _ => None,
    };
    let stall_reason = analysis_halt
        .or(held)
        .or((!left_down.is_empty()).then_some(reasons::GENERATION_EXITED))
        .or((!progress.refused.is_empty()).then_some(reasons::REPEATED_REFUSAL))
        .or(progress
            .prestage
            .deadline_exceeded
            .map(|_| reasons::PRESTAGE_DEADLINE_EXCEEDED))
        .or(progress
            .deadline_exceeded
            .map(|_| reasons::PROGRESS_DEADLINE_EXCEEDED));
    // Down between attempts, the agent restarting it: not stalled, not ready.
    let between_reason = if progress
        .down_between
        .iter()
        .any(|(_, down)| matches!(down, Down::BackingOff(_)))
    {
        Some(reasons::CRASH_LOOP_BACK_OFF)
    } else if progress.down_between.is_empty() {
        None
    } else if !progress.liveness_failed.is_empty() {
        Some(reasons::LIVENESS_FAILED)
    } else {
        Some(reasons::GENERATION_EXITED)
    };
    let idle_reason = if none_selected {
        reasons::NO_MATCHING_NODES
    } else if all_ready {
        reasons::ALL_NODES_READY
    } else {
        stall_reason.or(between_reason).unwrap_or(if measuring {
            analysis::reasons::ANALYSIS_RUNNING
        } else {
            reasons::ROLLOUT_IN_PROGRESS
        })
    };

    let (ready_reason, ready_message) = if none_selected {
        (
            reasons::NO_MATCHING_NODES,
            if ctx.spec.node_selector.is_empty() {
                "there are no nodes".to_string()
            } else {
                format!(
                    "no node has the labels {}",
                    ctx.spec
                        .node_selector
                        .iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect::<Vec<_>>()
                        .join(",")
                )
            },
        )
    } else if all_ready && !progress.sidecars_down.is_empty() {
        // A sidecar never makes its generation unready (SPEC 5.13).
        (
            reasons::SIDECAR_DOWN,
            format!(
                "all {} nodes serve {target}; SidecarDown: {}",
                progress.selected,
                progress
                    .sidecars_down
                    .iter()
                    .take(NAMES_SHOWN)
                    .map(|(node, how)| format!("{node}: {how}"))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        )
    } else if all_ready {
        (
            reasons::ALL_NODES_READY,
            format!("all {} nodes serve {target}", progress.selected),
        )
    } else if all_serve {
        (
            idle_reason,
            format!(
                "all {} nodes serve {target}{}",
                progress.selected,
                if measuring {
                    wave_note(ctx, progress, wave_names)
                } else {
                    "; rollout.analysis halted it (see Stalled)".to_string()
                }
            ),
        )
    } else if !progress.down_between.is_empty() {
        (
            idle_reason,
            format!(
                "{}/{} nodes serve {target}; down between attempts: {}",
                progress.ready,
                progress.selected,
                down_list(&progress.down_between)
            ),
        )
    } else {
        (
            idle_reason,
            format!(
                "{}/{} nodes serve {target}; not yet: {}",
                progress.ready,
                progress.selected,
                names(&progress.not_ready)
            ),
        )
    };
    set_condition(
        conditions,
        ConditionType::Ready,
        all_ready,
        ready_reason,
        &cut(&ready_message, MESSAGE_BYTES),
        generation,
        now,
    );

    let prestaging = progress.prestage.closed;
    let reconciling = progress.in_flight > 0 || progress.waiting > 0 || measuring || prestaging;
    let (reconciling_reason, reconciling_message) = if reconciling && ctx.spec.rollout.paused {
        (
            reasons::PAUSED,
            format!(
                "spec.rollout.paused: no new attempts toward {target}; {} attempt(s) in flight finish, {} node(s) wait for the rollout to resume",
                progress.in_flight, progress.waiting
            ),
        )
    } else if prestaging && progress.in_flight == 0 {
        (reasons::PRESTAGING, prestage_message(&target, progress))
    } else if reconciling {
        let reason = if progress.in_flight == 0 && measuring {
            analysis::reasons::ANALYSIS_RUNNING
        } else if progress.superseding {
            reasons::SUPERSEDING
        } else if progress.retrying_held {
            reasons::RETRYING_HELD_BUILD
        } else if progress.retrying_abandoned {
            reasons::RETRYING_ABANDONED
        } else {
            reasons::ROLLOUT_IN_PROGRESS
        };
        (
            reason,
            format!(
                "moving to {target}: {} attempt(s) in flight, {} node(s) waiting their turn{}",
                progress.in_flight,
                progress.waiting,
                wave_note(ctx, progress, wave_names)
            ),
        )
    } else {
        (idle_reason, "no attempt in flight or to issue".to_string())
    };
    set_condition(
        conditions,
        ConditionType::Reconciling,
        reconciling,
        reconciling_reason,
        &cut(&reconciling_message, MESSAGE_BYTES),
        generation,
        now,
    );

    let (stalled_reason, stalled_message) = match (held, stall_reason) {
        (_, Some(reason)) if Some(reason) == analysis_halt => {
            (reason, analysis_message(ctx, progress, book))
        }
        (Some(reason), _) => (reason, stall_message(ctx, progress, book)),
        (None, Some(reasons::PROGRESS_DEADLINE_EXCEEDED)) => (
            reasons::PROGRESS_DEADLINE_EXCEEDED,
            // The last move, not the time since: a message that changed
            // with every plan would rewrite the status of a stalled rollout.
            format!(
                "no progress toward {target} since {} (rollout.progressDeadlineSeconds {}); {}",
                progress
                    .last_progress
                    .and_then(|ms| k8s_openapi::jiff::Timestamp::from_millisecond(ms).ok())
                    .map(|t| t.to_string())
                    .unwrap_or_default(),
                ctx.spec.rollout.progress_deadline_seconds,
                if progress.in_flight_nodes.is_empty() {
                    format!("waiting on: {}", names(&progress.not_ready))
                } else {
                    format!(
                        "attempts in flight on: {}",
                        names(&progress.in_flight_nodes)
                    )
                }
            ),
        ),
        (None, Some(reasons::PRESTAGE_DEADLINE_EXCEEDED)) => (
            reasons::PRESTAGE_DEADLINE_EXCEEDED,
            format!(
                "not every node holds the build within rollout.prestageDeadlineSeconds {}, and the rollout waits for them; {}",
                ctx.spec.rollout.prestage_deadline_seconds,
                prestage_message(&target, progress)
            ),
        ),
        (None, Some(reasons::REPEATED_REFUSAL)) => (
            reasons::REPEATED_REFUSAL,
            format!(
                "the last {} attempts of {target} were refused for the same reason on {}; they are retried with backoff, but the cause must be fixed",
                super::rollout::REFUSALS_TO_STALL,
                refusal_list(&progress.refused)
            ),
        ),
        (None, Some(reason)) => (
            reason,
            format!(
                "the restart policy leaves these nodes down: {}; change spec.restartID to start the instance again",
                down_list(&left_down)
            ),
        ),
        (None, None) => (idle_reason, "progress needs no human".to_string()),
    };
    set_condition(
        conditions,
        ConditionType::Stalled,
        stall_reason.is_some(),
        stalled_reason,
        &cut(&stalled_message, MESSAGE_BYTES),
        generation,
        now,
    );

    // Fixed order, whatever order the conditions were first added in.
    conditions.sort_by_key(|c| match c.type_.as_str() {
        "Ready" => 0,
        "Reconciling" => 1,
        "Stalled" => 2,
        _ => 3,
    });
}

/// `; wave zone-b (2 of 5)`, or the wave that bakes, when there are waves
/// to tell apart.
fn wave_note(ctx: &Context<'_>, progress: &Progress<'_>, wave_names: &[String]) -> String {
    let Some(wave) = progress.position.wave else {
        return String::new();
    };
    if let (Some(Gate::Measuring { .. }), Some(spec)) =
        (progress.position.analysis, &ctx.spec.rollout.analysis)
    {
        let taken = ctx
            .analysis
            .filter(|record| usize::try_from(record.wave_index).ok() == Some(wave))
            .map_or(0, |record| record.measurements);
        return format!(
            "; wave {} is done and judged by rollout.analysis: {taken} of {} measurements taken",
            wave_names.get(wave).map_or("", String::as_str),
            spec.count
        );
    }
    if wave_names.len() <= 2 && progress.position.baking_until.is_none() {
        // The canaries, then the rest: nothing the message does not say.
        return String::new();
    }
    let name = wave_names.get(wave).map_or("", String::as_str);
    let place = if wave == 0 {
        String::new()
    } else {
        format!(" ({wave} of {})", wave_names.len().saturating_sub(1))
    };
    match progress.position.baking_until {
        Some(until) => format!(
            "; wave {name}{place} is done and bakes until {} (rollout.bakeSeconds)",
            k8s_openapi::jiff::Timestamp::from_millisecond(until)
                .map(|t| t.to_string())
                .unwrap_or_default()
        ),
        None => format!("; wave {name}{place}"),
    }
}

/// Why the analysis halts the rollout, from its record, and what became
/// of the nodes it judged.
fn analysis_message(ctx: &Context<'_>, progress: &Progress<'_>, book: &FailureBook) -> String {
    let Some(record) = ctx.analysis else {
        return String::new();
    };
    let verdict = match record.phase {
        AnalysisPhase::Failed => "failed its analysis",
        _ => "could not be judged (rollout.analysis.inconclusive: halt)",
    };
    let restored = match (ctx.spec.rollout.on_failure, ctx.good) {
        (OnFailure::Restore, Some(good)) if record.phase == AnalysisPhase::Failed => {
            format!("; its nodes are restored to build {}", good.build)
        }
        _ => String::new(),
    };
    let held = if progress.stalled.is_empty() {
        String::new()
    } else {
        format!("; {}", stall_message(ctx, progress, book))
    };
    format!(
        "wave {} of build {} {verdict}: {} ({} measurement(s), {} crossed a bound, {} inconclusive){restored}; no other node gets it until the build changes or spec.retry does{held}",
        record.wave,
        record.build,
        record.message.as_deref().unwrap_or_default(),
        record.measurements,
        record.failures,
        record.inconclusive,
    )
}

fn stall_message(ctx: &Context<'_>, progress: &Progress<'_>, book: &FailureBook) -> String {
    let failures: Vec<String> = book
        .holds(&ctx.desired.build, ctx.mode)
        .take(NAMES_SHOWN)
        .map(|e| {
            if e.reason.is_empty() {
                e.node.clone()
            } else {
                format!("{} ({})", e.node, e.reason)
            }
        })
        .collect();
    let down = if progress.down.is_empty() {
        String::new()
    } else {
        format!("; nothing serves on {}", names(&progress.down))
    };
    // The rollout is what stopped, not the nodes: they keep whatever they
    // ran before (status.nodes says what).
    format!(
        "build {} ({}) is held down after failing on {}{down}; not rolled out: {}; \
         change spec.retry to attempt it once more, or choose another build",
        ctx.desired.build,
        ctx.mode.as_str(),
        failures.join(", "),
        names(&progress.stalled),
    )
}

/// `build b2` with the configRev and restartID when they are set.
/// Where pre-staging stands: how many nodes hold the build, and those
/// that cannot stage it with why (the rest stage; their bytes are in
/// `status.rollout.prestage`).
fn prestage_message(target: &str, progress: &Progress<'_>) -> String {
    let prestage = &progress.prestage;
    let mut message = format!(
        "staging {target} before its first swap: {}/{} nodes hold it",
        prestage.staged, prestage.needed
    );
    if !prestage.failing.is_empty() {
        message.push_str("; cannot stage: ");
        message.push_str(&refusal_list(&prestage.failing));
    }
    message
}

fn describe(desired: &DesiredState) -> String {
    let mut text = format!("build {}", desired.build);
    if !desired.config_rev.is_empty() {
        text.push_str(&format!(" configRev {}", desired.config_rev));
    }
    if !desired.restart_id.is_empty() {
        text.push_str(&format!(" restartID {}", desired.restart_id));
    }
    text
}

/// `n1 (generation 3 exited with signal 9 (SIGKILL); restarting it), …`.
fn down_list(down: &[(&str, Down)]) -> String {
    node_list(
        down.iter().map(|(node, down)| (*node, down.message())),
        down.len(),
    )
}

/// `n1 (stage: the artifact path … is a directory), …`.
fn refusal_list(refused: &[(&str, String)]) -> String {
    node_list(
        refused
            .iter()
            .map(|(node, reason)| (*node, reason.as_str())),
        refused.len(),
    )
}

/// `node (why), …` for the first [`NAMES_SHOWN`] of `len` nodes.
fn node_list<'a>(nodes: impl Iterator<Item = (&'a str, &'a str)>, len: usize) -> String {
    let mut text = nodes
        .take(NAMES_SHOWN)
        .map(|(node, why)| format!("{node} ({why})"))
        .collect::<Vec<_>>()
        .join(", ");
    if len > NAMES_SHOWN {
        text.push_str(&format!(" and {} more", len - NAMES_SHOWN));
    }
    text
}

/// `a, b, c and 4 more`.
fn names(list: &[&str]) -> String {
    let mut text = list
        .iter()
        .take(NAMES_SHOWN)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    if list.len() > NAMES_SHOWN {
        text.push_str(&format!(" and {} more", list.len() - NAMES_SHOWN));
    }
    text
}
