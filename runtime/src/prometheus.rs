//! Instant queries against Prometheus's HTTP API (`/api/v1/query`), for
//! `rollout.analysis`: the controller, and standalone mode, ask the
//! Prometheus they were configured with (never a URL from a spec).

use std::time::Duration;

use genswap_core::scheduler::{self, AnalysisRequest, Answer, Plan, Verdict, judge};
use genswap_crds::InstanceGeneration;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::Deserialize;
use thiserror::Error;

/// Why a query has no samples to judge. Each is an inconclusive
/// measurement, never a pass.
#[derive(Debug, Error)]
pub enum QueryError {
    #[error("Prometheus at {url} could not be reached: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("Prometheus refused the query ({status}): {reason}")]
    Refused { status: u16, reason: String },
    #[error("Prometheus answered what is not its API's JSON: {0}")]
    Malformed(String),
    #[error("the query returned a {0}, not an instant vector or a scalar")]
    NotInstant(String),
}

/// Why a client could not be made.
#[derive(Debug, Error)]
pub enum PrometheusError {
    #[error("--prometheus-url {url:?} is not an http or https URL: {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("building the HTTP client")]
    Client(#[source] reqwest::Error),
}

/// A client of one Prometheus.
#[derive(Clone, Debug)]
pub struct Prometheus {
    endpoint: reqwest::Url,
    http: reqwest::Client,
}

/// The same Prometheus: the same endpoint (the HTTP client is no part of
/// what a configuration means).
impl PartialEq for Prometheus {
    fn eq(&self, other: &Self) -> bool {
        self.endpoint == other.endpoint
    }
}

impl Eq for Prometheus {}

#[derive(Deserialize)]
struct Reply {
    status: String,
    #[serde(default)]
    data: Option<Data>,
    #[serde(default)]
    error: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Data {
    result_type: String,
    result: serde_json::Value,
}

#[derive(Deserialize)]
struct Series {
    #[serde(default)]
    metric: std::collections::BTreeMap<String, String>,
    value: (f64, String),
}

impl Prometheus {
    /// A client of the Prometheus at `url` (its root, as Grafana's data
    /// source takes it), each query given `timeout`.
    pub fn new(url: &str, timeout: Duration) -> Result<Self, PrometheusError> {
        let invalid = |reason: String| PrometheusError::InvalidUrl {
            url: url.to_string(),
            reason,
        };
        let base = reqwest::Url::parse(url).map_err(|e| invalid(e.to_string()))?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(invalid(format!("scheme {}", base.scheme())));
        }
        let endpoint = reqwest::Url::parse(&format!(
            "{}/api/v1/query",
            base.as_str().trim_end_matches('/')
        ))
        .map_err(|e| invalid(e.to_string()))?;
        // reqwest brings no TLS provider of its own here (see the
        // workspace's Cargo.toml): the process's one is aws-lc-rs.
        let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(PrometheusError::Client)?;
        Ok(Self { endpoint, http })
    }

    /// Where queries go.
    pub fn endpoint(&self) -> &str {
        self.endpoint.as_str()
    }

    /// The samples of an instant query, each with its labels as PromQL
    /// prints them (`{code="500",node="a"}`); a scalar is one sample
    /// without labels. Sent as a form (POST), so a wave of many nodes fits.
    pub async fn query(&self, promql: &str) -> Result<Vec<(String, f64)>, QueryError> {
        let unreachable = |reason: String| QueryError::Unreachable {
            url: self.endpoint.to_string(),
            reason,
        };
        let response = self
            .http
            .post(self.endpoint.clone())
            .form(&[("query", promql)])
            .send()
            .await
            .map_err(|e| unreachable(chain(&e)))?;
        let status = response.status();
        let body = response.bytes().await.map_err(|e| unreachable(chain(&e)))?;
        let reply: Reply = serde_json::from_slice(&body).map_err(|e| {
            if status.is_success() {
                QueryError::Malformed(e.to_string())
            } else {
                QueryError::Refused {
                    status: status.as_u16(),
                    reason: String::from_utf8_lossy(&body).chars().take(200).collect(),
                }
            }
        })?;
        if reply.status != "success" {
            return Err(QueryError::Refused {
                status: status.as_u16(),
                reason: reply.error.unwrap_or(reply.status),
            });
        }
        let data = reply
            .data
            .ok_or_else(|| QueryError::Malformed("no data".into()))?;
        match data.result_type.as_str() {
            "vector" => {
                let series: Vec<Series> = serde_json::from_value(data.result)
                    .map_err(|e| QueryError::Malformed(e.to_string()))?;
                series
                    .into_iter()
                    .map(|s| Ok((labels(&s.metric), number(&s.value.1)?)))
                    .collect()
            }
            "scalar" => {
                let (_, value): (f64, String) = serde_json::from_value(data.result)
                    .map_err(|e| QueryError::Malformed(e.to_string()))?;
                Ok(vec![("{}".to_string(), number(&value)?)])
            }
            other => Err(QueryError::NotInstant(other.to_string())),
        }
    }

    /// Each of `queries`, asked at once.
    pub async fn query_all<'q>(
        &self,
        queries: impl IntoIterator<Item = &'q str>,
    ) -> Vec<Result<Vec<(String, f64)>, QueryError>> {
        futures::future::join_all(queries.into_iter().map(|promql| self.query(promql))).await
    }
}

/// What the measurement `request` of `rollout.analysis` finds: every query
/// asked at once, the answers judged by the core; without a Prometheus,
/// inconclusive (`unconfigured` says why).
pub async fn measure(
    prometheus: Option<&Prometheus>,
    request: &AnalysisRequest,
    unconfigured: &str,
) -> Verdict {
    let Some(prometheus) = prometheus else {
        return Verdict::Inconclusive(unconfigured.to_string());
    };
    let answers: Vec<Answer> = prometheus
        .query_all(request.queries.iter().map(|query| query.promql.as_str()))
        .await
        .into_iter()
        .map(Answer::from)
        .collect();
    judge(&request.queries, &answers)
}

/// Takes the measurement `plan` asks for, when it asks for one, and
/// returns the plan made again with the verdict folded in
/// ([`scheduler::measured`]), with the verdict for the caller's metrics.
/// `replan` plans `ig` as the first plan was made: the one way both the
/// controller and standalone mode measure.
pub async fn measure_plan(
    mut plan: Plan,
    prometheus: Option<&Prometheus>,
    unconfigured: &str,
    ig: &InstanceGeneration,
    now: &Time,
    replan: impl FnOnce(&InstanceGeneration) -> Plan,
) -> (Plan, Option<Verdict>) {
    let Some(request) = plan.analysis.take() else {
        return (plan, None);
    };
    let verdict = measure(prometheus, &request, unconfigured).await;
    tracing::info!(
        ig = ig.metadata.name.as_deref().unwrap_or_default(),
        wave = %request.wave,
        number = request.number,
        ?verdict,
        "analysis measured"
    );
    let plan = scheduler::measured(plan, &verdict, ig, now, replan);
    (plan, Some(verdict))
}

/// Prometheus writes sample values as strings: numbers, `NaN`, `+Inf`,
/// `-Inf`.
fn number(text: &str) -> Result<f64, QueryError> {
    match text {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => text
            .parse()
            .map_err(|_| QueryError::Malformed(format!("sample value {text:?}"))),
    }
}

fn labels(metric: &std::collections::BTreeMap<String, String>) -> String {
    let pairs: Vec<String> = metric
        .iter()
        .map(|(name, value)| format!("{name}={value:?}"))
        .collect();
    format!("{{{}}}", pairs.join(","))
}

/// An error with its causes, which say what reqwest's own message hides
/// (connection refused, the timeout).
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_http_urls_are_taken_and_the_query_path_is_appended() {
        let at = |url: &str| {
            Prometheus::new(url, Duration::from_secs(1)).map(|p| p.endpoint().to_string())
        };
        assert_eq!(
            at("http://127.0.0.1:9090").ok().as_deref(),
            Some("http://127.0.0.1:9090/api/v1/query")
        );
        assert_eq!(
            at("https://mon.example/prometheus/").ok().as_deref(),
            Some("https://mon.example/prometheus/api/v1/query")
        );
        assert_eq!(
            at("http://mon.example/prometheus").ok().as_deref(),
            Some("http://mon.example/prometheus/api/v1/query"),
            "a path prefix is kept"
        );
        assert!(matches!(
            at("file:///etc/passwd"),
            Err(PrometheusError::InvalidUrl { .. })
        ));
        assert!(matches!(
            at("not a url"),
            Err(PrometheusError::InvalidUrl { .. })
        ));
    }

    #[test]
    fn special_values_parse() {
        assert!(number("NaN").is_ok_and(f64::is_nan));
        assert_eq!(number("+Inf").ok(), Some(f64::INFINITY));
        assert_eq!(number("0.05").ok(), Some(0.05));
        assert!(number("x").is_err());
    }
}
