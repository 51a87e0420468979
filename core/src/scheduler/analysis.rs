//! `rollout.analysis` (SPEC 4.3): a finished wave is judged by PromQL
//! queries before the next wave starts.
//!
//! The scheduler stays pure: it says when a measurement is due and for
//! what ([`AnalysisRequest`], in [`super::Plan::analysis`]); the adapter
//! asks Prometheus, [`judge`]s the answers and folds them into the record
//! with [`measured`], and plans again from the InstanceGeneration that
//! carries it. The record (`status.rollout.analysis`) is the only state:
//! when each measurement is due is derived from the wave's end, which the
//! node records give, so a restarted controller goes on where it was.

use genswap_crds::{
    AnalysisPhase, AnalysisSpec, AnalysisStatus, Inconclusive, InstanceGeneration,
    InstanceGenerationSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::{Context, Plan, PlanEvent, cut};

/// Event and condition reasons of the analysis.
pub mod reasons {
    /// Stalled: a bound was crossed more than `failureLimit` times.
    pub const ANALYSIS_FAILED: &str = "AnalysisFailed";
    /// Stalled: measurements could not be taken (`inconclusive: halt`).
    pub const ANALYSIS_INCONCLUSIVE: &str = "AnalysisInconclusive";
    /// Every measurement of a wave stayed within its bounds.
    pub const ANALYSIS_PASSED: &str = "AnalysisPassed";
    /// Ready=False, Reconciling=True: a finished wave is being measured.
    pub const ANALYSIS_RUNNING: &str = "AnalysisRunning";
}

/// One query as sent: its variables replaced.
#[derive(Clone, Debug, PartialEq)]
pub struct RenderedQuery {
    pub name: String,
    pub promql: String,
    pub min: Option<f64>,
    pub max: Option<f64>,
}

/// A measurement due now.
#[derive(Clone, Debug, PartialEq)]
pub struct AnalysisRequest {
    pub build: String,
    pub wave: String,
    pub wave_index: i32,
    /// Which measurement this is, from 1.
    pub number: i32,
    pub queries: Vec<RenderedQuery>,
}

/// What Prometheus answered for one query.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// The samples of an instant vector (or one, of a scalar), each with
    /// its labels as PromQL prints them.
    Samples(Vec<(String, f64)>),
    /// It could not be asked, or refused the query.
    Unanswered(String),
}

impl<E: std::fmt::Display> From<Result<Vec<(String, f64)>, E>> for Answer {
    fn from(result: Result<Vec<(String, f64)>, E>) -> Self {
        match result {
            Ok(samples) => Answer::Samples(samples),
            Err(error) => Answer::Unanswered(error.to_string()),
        }
    }
}

/// One measurement's verdict.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    Pass,
    /// A bound was crossed: the query, the value and the bound.
    Fail(String),
    /// Nothing could be judged: why.
    Inconclusive(String),
}

/// Judges one answer per query. A crossing anywhere fails the measurement;
/// otherwise a query with no answer, no samples or a NaN makes it
/// inconclusive.
pub fn judge(queries: &[RenderedQuery], answers: &[Answer]) -> Verdict {
    let mut unjudged = None;
    for (query, answer) in queries.iter().zip(answers) {
        let samples = match answer {
            Answer::Unanswered(why) => {
                unjudged.get_or_insert_with(|| format!("query {}: {why}", query.name));
                continue;
            }
            Answer::Samples(samples) => samples,
        };
        if samples.is_empty() {
            unjudged.get_or_insert_with(|| format!("query {} returned no data", query.name));
            continue;
        }
        for (labels, value) in samples {
            if value.is_nan() {
                unjudged.get_or_insert_with(|| {
                    format!(
                        "query {} returned NaN for {labels} (no traffic?)",
                        query.name
                    )
                });
                continue;
            }
            let below = query.min.filter(|min| value < min);
            let above = query.max.filter(|max| value > max);
            if let Some(min) = below {
                return Verdict::Fail(format!(
                    "query {} gave {value} for {labels}, below its min {min}",
                    query.name
                ));
            }
            if let Some(max) = above {
                return Verdict::Fail(format!(
                    "query {} gave {value} for {labels}, above its max {max}",
                    query.name
                ));
            }
        }
    }
    if queries.len() > answers.len() {
        unjudged.get_or_insert_with(|| "not every query was answered".to_string());
    }
    unjudged.map_or(Verdict::Pass, Verdict::Inconclusive)
}

/// Adds one measurement to `record`, the analysis ending once it failed
/// (a bound crossed more than `failureLimit` times) or `count`
/// measurements were taken.
pub fn fold(
    record: &AnalysisStatus,
    spec: &AnalysisSpec,
    verdict: &Verdict,
    now: &Time,
) -> AnalysisStatus {
    let mut next = record.clone();
    if next.phase != AnalysisPhase::Running {
        return next;
    }
    next.measurements += 1;
    next.last_measured_time = Some(now.clone());
    match verdict {
        Verdict::Pass => {}
        Verdict::Fail(why) => {
            next.failures += 1;
            next.message = Some(cut(why, 1024));
        }
        Verdict::Inconclusive(why) => {
            next.inconclusive += 1;
            next.message = Some(cut(why, 1024));
        }
    }
    if next.failures > spec.failure_limit {
        next.phase = AnalysisPhase::Failed;
    } else if next.measurements >= spec.count {
        next.phase = if next.inconclusive > 0 && spec.inconclusive == Inconclusive::Halt {
            AnalysisPhase::Inconclusive
        } else {
            AnalysisPhase::Passed
        };
    }
    next
}

/// The plan after the measurement `first` asked for was judged `verdict`:
/// the measurement folded into the record, and `replan` (the adapter's
/// call of the scheduler) run again on the InstanceGeneration that carries
/// it, with the Event that says how the analysis ended. Its status is
/// never put off: the record is what a restarted controller goes on from.
pub fn measured(
    first: Plan,
    verdict: &Verdict,
    ig: &InstanceGeneration,
    now: &Time,
    replan: impl FnOnce(&InstanceGeneration) -> Plan,
) -> Plan {
    let (Some(spec), Some(planned)) = (
        ig.spec.rollout.analysis.as_ref(),
        first
            .status
            .rollout
            .as_ref()
            .and_then(|rollout| rollout.analysis.as_ref()),
    ) else {
        return first;
    };
    let record = fold(planned, spec, verdict, now);
    let event = ended(spec, &record);
    let mut measured = ig.clone();
    measured
        .status
        .get_or_insert_default()
        .rollout
        .get_or_insert_default()
        .analysis = Some(record);
    let mut plan = replan(&measured);
    plan.events.extend(event);
    plan.status_may_wait = false;
    plan
}

fn ended(spec: &AnalysisSpec, record: &AnalysisStatus) -> Option<PlanEvent> {
    let wave = format!("wave {} of build {}", record.wave, record.build);
    let tally = format!(
        "{} measurement(s), {} crossed a bound, {} inconclusive",
        record.measurements, record.failures, record.inconclusive
    );
    let last = record.message.as_deref().unwrap_or_default();
    let (warning, reason, message) = match record.phase {
        AnalysisPhase::Running => return None,
        AnalysisPhase::Failed => (
            true,
            reasons::ANALYSIS_FAILED,
            format!(
                "{wave} failed its analysis ({tally}; failureLimit {}): {last}",
                spec.failure_limit
            ),
        ),
        AnalysisPhase::Inconclusive => (
            true,
            reasons::ANALYSIS_INCONCLUSIVE,
            format!(
                "{wave} could not be judged ({tally}): {last}; the rollout halts (rollout.analysis.inconclusive: halt) until spec.retry changes"
            ),
        ),
        AnalysisPhase::Passed if record.inconclusive > 0 => (
            true,
            reasons::ANALYSIS_PASSED,
            format!(
                "{wave} passed without every measurement ({tally}, rollout.analysis.inconclusive: proceed): {last}"
            ),
        ),
        AnalysisPhase::Passed => (
            false,
            reasons::ANALYSIS_PASSED,
            format!("{wave} passed ({tally})"),
        ),
    };
    Some(PlanEvent {
        warning,
        reason: reason.into(),
        message,
    })
}

/// The stored analysis that still counts for the desired build: not one of
/// an older build, nor a failed or inconclusive one that a new
/// `spec.retry` token starts again, nor any once the spec asks for none
/// (removing `rollout.analysis` lifts its halt).
pub(super) fn current(ig: &InstanceGeneration) -> Option<&AnalysisStatus> {
    ig.spec.rollout.analysis.as_ref()?;
    let record = ig.status.as_ref()?.rollout.as_ref()?.analysis.as_ref()?;
    let ended_badly = matches!(
        record.phase,
        AnalysisPhase::Failed | AnalysisPhase::Inconclusive
    );
    (record.build == ig.spec.build.id && !(ended_badly && record.retry != ig.spec.retry))
        .then_some(record)
}

/// Where the analysis of a finished wave stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Gate {
    /// Passed, or no analysis applies: the next wave may start.
    Open,
    /// Measurements are still to come; the next is due then (ms).
    Measuring { due: i64 },
    /// It failed or was inconclusive under `halt`: nothing more starts.
    Halted(AnalysisPhase),
}

/// Whether `wave` (of `wave_count`) is judged before the next starts: the
/// canaries, and with `everyWave` every wave but the last.
pub(super) fn applies(spec: &InstanceGenerationSpec, wave: usize) -> bool {
    spec.rollout
        .analysis
        .as_ref()
        .is_some_and(|analysis| wave == 0 || analysis.every_wave)
}

/// The gate of a finished `wave` that ended at `finished_at` (ms).
pub(super) fn gate(ctx: &Context<'_>, wave: usize, finished_at: i64) -> Gate {
    let Some(spec) = ctx.spec.rollout.analysis.as_ref() else {
        return Gate::Open;
    };
    // A record of a later wave means this one passed.
    if ctx
        .analysis
        .is_some_and(|record| usize::try_from(record.wave_index).is_ok_and(|judged| judged > wave))
    {
        return Gate::Open;
    }
    let record = ctx
        .analysis
        .filter(|record| usize::try_from(record.wave_index).ok() == Some(wave));
    let measurements = record.map_or(0, |record| record.measurements);
    match record.map(|record| record.phase) {
        Some(AnalysisPhase::Passed) => Gate::Open,
        Some(phase @ (AnalysisPhase::Failed | AnalysisPhase::Inconclusive)) => Gate::Halted(phase),
        Some(AnalysisPhase::Running) | None => {
            let interval = spec.interval_seconds.max(1).saturating_mul(1000);
            let due = finished_at
                .saturating_add(interval.saturating_mul(i64::from(measurements.saturating_add(1))));
            Gate::Measuring { due }
        }
    }
}

/// The record the status carries while `wave` is measured, begun afresh
/// when the stored one is of another wave.
pub(super) fn record_for(ctx: &Context<'_>, wave: usize, wave_name: &str) -> AnalysisStatus {
    let index = i32::try_from(wave).unwrap_or(i32::MAX);
    match ctx.analysis {
        Some(record) if record.wave_index == index => record.clone(),
        _ => AnalysisStatus {
            build: ctx.desired.build.clone(),
            wave: wave_name.chars().take(63).collect(),
            wave_index: index,
            retry: ctx.spec.retry.clone(),
            ..AnalysisStatus::default()
        },
    }
}

/// The measurement due now for `record`, its queries given `nodes` (the
/// wave's) and the InstanceGeneration's name.
pub(super) fn request(
    ctx: &Context<'_>,
    record: &AnalysisStatus,
    nodes: &[&str],
) -> Option<AnalysisRequest> {
    let spec = ctx.spec.rollout.analysis.as_ref()?;
    let node = nodes
        .iter()
        .map(|name| regex_literal(name))
        .collect::<Vec<_>>()
        .join("|");
    let queries = spec
        .queries
        .iter()
        .map(|query| RenderedQuery {
            name: query.name.clone(),
            promql: render(&query.query, &node, &record.build, ctx.name),
            min: query.min,
            max: query.max,
        })
        .collect();
    Some(AnalysisRequest {
        build: record.build.clone(),
        wave: record.wave.clone(),
        wave_index: record.wave_index,
        number: record.measurements.saturating_add(1),
        queries,
    })
}

/// Replaces `$node`, `$build` and `$instance` in one pass, so a value that
/// itself reads `$build` is left as it is.
fn render(query: &str, node: &str, build: &str, instance: &str) -> String {
    let mut out = String::with_capacity(query.len() + node.len());
    let mut rest = query;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        let (value, len) = if tail.starts_with("$node") {
            (node, "$node".len())
        } else if tail.starts_with("$build") {
            (build, "$build".len())
        } else if tail.starts_with("$instance") {
            (instance, "$instance".len())
        } else {
            ("$", 1)
        };
        out.push_str(value);
        rest = &tail[len..];
    }
    out.push_str(rest);
    out
}

/// `name` as an RE2 literal inside a PromQL double-quoted string: node
/// names are DNS subdomains, so only `.` needs escaping (`\\.` in PromQL's
/// string, `\.` to the regular expression).
fn regex_literal(name: &str) -> String {
    name.replace('.', "\\\\.")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(min: Option<f64>, max: Option<f64>) -> RenderedQuery {
        RenderedQuery {
            name: "errors".into(),
            promql: "x".into(),
            min,
            max,
        }
    }

    fn spec(count: i32, failure_limit: i32, inconclusive: Inconclusive) -> AnalysisSpec {
        AnalysisSpec {
            queries: Vec::new(),
            interval_seconds: 10,
            count,
            failure_limit,
            every_wave: false,
            inconclusive,
        }
    }

    fn at(secs: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(secs).expect("a valid time"))
    }

    #[test]
    fn variables_are_replaced_once_and_node_names_become_a_regex() {
        let node = ["n1.zone-a", "n2"]
            .iter()
            .map(|n| regex_literal(n))
            .collect::<Vec<_>>()
            .join("|");
        assert_eq!(
            render(
                r#"rate(x{node=~"$node",build="$build",ig="$instance",le="$5"}[1m])"#,
                &node,
                "b-$build",
                "web"
            ),
            r#"rate(x{node=~"n1\\.zone-a|n2",build="b-$build",ig="web",le="$5"}[1m])"#
        );
    }

    #[test]
    fn a_crossing_fails_whatever_else_is_unanswered() {
        let queries = [query(None, Some(0.01)), query(Some(1.0), None)];
        let verdict = judge(
            &queries,
            &[
                Answer::Unanswered("connection refused".into()),
                Answer::Samples(vec![("{node=\"a\"}".into(), 0.5)]),
            ],
        );
        assert_eq!(
            verdict,
            Verdict::Fail("query errors gave 0.5 for {node=\"a\"}, below its min 1".into())
        );
    }

    #[test]
    fn no_data_nan_and_no_answer_are_inconclusive_not_a_pass() {
        let queries = [query(None, Some(0.01))];
        for answer in [
            Answer::Samples(Vec::new()),
            Answer::Samples(vec![("{}".into(), f64::NAN)]),
            Answer::Unanswered("503".into()),
        ] {
            assert!(
                matches!(
                    judge(&queries, std::slice::from_ref(&answer)),
                    Verdict::Inconclusive(_)
                ),
                "{answer:?}"
            );
        }
        assert_eq!(
            judge(&queries, &[Answer::Samples(vec![("{}".into(), 0.01)])]),
            Verdict::Pass
        );
    }

    #[test]
    fn failure_limit_plus_one_crossings_fail_and_count_measurements_end_it() {
        let spec = spec(3, 1, Inconclusive::Halt);
        let fail = Verdict::Fail("over".into());
        let mut record = AnalysisStatus::default();
        record = fold(&record, &spec, &fail, &at(1));
        assert_eq!(
            record.phase,
            AnalysisPhase::Running,
            "one crossing is within the limit"
        );
        record = fold(&record, &spec, &fail, &at(2));
        assert_eq!(record.phase, AnalysisPhase::Failed);
        assert_eq!((record.measurements, record.failures), (2, 2));
        assert_eq!(
            fold(&record, &spec, &Verdict::Pass, &at(3)),
            record,
            "an ended analysis stays"
        );

        let mut passed = AnalysisStatus::default();
        for second in 0..3 {
            passed = fold(&passed, &spec, &Verdict::Pass, &at(second));
        }
        assert_eq!(passed.phase, AnalysisPhase::Passed);
    }

    #[test]
    fn inconclusive_measurements_halt_or_proceed_as_the_spec_says() {
        let unjudged = Verdict::Inconclusive("no data".into());
        for (inconclusive, phase) in [
            (Inconclusive::Halt, AnalysisPhase::Inconclusive),
            (Inconclusive::Proceed, AnalysisPhase::Passed),
        ] {
            let spec = spec(2, 0, inconclusive);
            let mut record = fold(&AnalysisStatus::default(), &spec, &Verdict::Pass, &at(1));
            record = fold(&record, &spec, &unjudged, &at(2));
            assert_eq!(record.phase, phase, "{inconclusive:?}");
            assert_eq!(record.message.as_deref(), Some("no data"));
        }
    }
}
