//! The `grpc` probe: `grpc.health.v1.Health/Check` over HTTP/2, healthy
//! when it answers `SERVING` (tonic-health's client, as the kubelet's own
//! gRPC probe asks).

use std::sync::{Arc, Mutex};

use hyper_util::rt::TokioIo;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

use super::Endpoint;
use crate::observation::Observation;

/// One `Check` of `service` ("" is the server as a whole).
pub(crate) async fn check(endpoint: &Endpoint, service: &str) -> Result<(), Observation> {
    // Connected here, so a missing socket or a refusal reads as it does for
    // every other probe; the channel takes this one stream.
    let stream = endpoint.connect().await?;
    let slot = Arc::new(Mutex::new(Some(stream)));
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let taken = slot.lock().ok().and_then(|mut slot| slot.take());
            async move {
                taken
                    .map(TokioIo::new)
                    .ok_or_else(|| std::io::Error::other("the probe's one connection is used"))
            }
        }))
        .await
        .map_err(|e| Observation::Grpc(error_chain(&e)))?;
    let answer = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.to_string(),
        })
        .await
        .map_err(|status| {
            Observation::Grpc(format!(
                "the call failed: {:?} {}",
                status.code(),
                status.message()
            ))
        })?;
    match answer.into_inner().status() {
        ServingStatus::Serving => Ok(()),
        other => Err(Observation::Grpc(format!(
            "answered {}",
            other.as_str_name()
        ))),
    }
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}
