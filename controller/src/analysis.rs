//! The measurement a plan asks for (`rollout.analysis`), taken from the
//! Prometheus the controller was started with and judged by the core.

use genswap_core::scheduler::{AnalysisRequest, Answer, Verdict, judge};
use genswap_runtime::prometheus::Prometheus;

/// What the measurement `request` finds: every query asked at once.
pub async fn measure(prometheus: Option<&Prometheus>, request: &AnalysisRequest) -> Verdict {
    let Some(prometheus) = prometheus else {
        return Verdict::Inconclusive(
            "the controller has no Prometheus to ask (--prometheus-url, the chart's controller.prometheusURL)".into(),
        );
    };
    let answers: Vec<Answer> = prometheus
        .query_all(request.queries.iter().map(|query| query.promql.as_str()))
        .await
        .into_iter()
        .map(Answer::from)
        .collect();
    judge(&request.queries, &answers)
}
