//! Prometheus metrics of a run, served over HTTP at `/metrics` (`[metrics] listen`).
//!
//! [`Telemetry`] holds the registry: the step metrics arrive through [`Observed`], an
//! [`crate::roles::Observer`] that publishes each step's metrics before passing them on; the health of a distributed run's role processes arrives through [`WorkerHealth`],
//! a handle the generation pool and the controller feed. Neither knows about HTTP: only
//! [`server`] does, and it encodes the registry when scraped.

mod health;
mod observer;
mod series;
mod server;
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::registry::Registry;

use crate::config::MetricsConfig;
use crate::metrics::StepMetrics;
use crate::roles::RunStarted;

pub use health::{RoleKind, WorkerHealth};
pub use observer::Observed;
pub use server::MetricsServer;

use series::Series;

/// The `Content-Type` of what `/metrics` answers: the OpenMetrics text format.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("metrics.listen = \"{address}\" is not an address IP:PORT: {reason}")]
    Address { address: String, reason: String },
    #[error("cannot serve /metrics on {address} (metrics.listen): {source}")]
    Bind {
        address: String,
        source: std::io::Error,
    },
    #[error("cannot encode the metrics: {0}")]
    Encode(#[from] std::fmt::Error),
}

struct Inner {
    registry: Registry,
    series: Series,
    health: WorkerHealth,
}

/// The run's metrics registry. Cheap to clone; every clone publishes to the same registry.
#[derive(Clone)]
pub struct Telemetry {
    inner: Arc<Inner>,
}

impl Default for Telemetry {
    fn default() -> Self {
        Self::new()
    }
}

impl Telemetry {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let series = Series::register(&mut registry);
        let health = WorkerHealth::register(&mut registry);
        Telemetry {
            inner: Arc::new(Inner {
                registry,
                series,
                health,
            }),
        }
    }

    /// The handle through which role processes report joining, leaving and restarting.
    pub fn health(&self) -> WorkerHealth {
        self.inner.health.clone()
    }

    pub fn run_started(&self, info: &RunStarted) {
        self.inner.series.run_started(info);
    }

    /// Publishes one step's metrics.
    pub fn step_ended(&self, metrics: &StepMetrics) {
        self.inner.series.step_ended(metrics, unix_seconds());
    }

    pub fn checkpoint_written(&self, step: u64) {
        self.inner.series.checkpoint_written(step);
    }

    /// The OpenMetrics text of every series, as of now.
    pub fn render(&self) -> Result<String, TelemetryError> {
        self.inner.health.refresh(SystemTime::now());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.inner.registry)?;
        Ok(text)
    }
}

/// Starts serving `/metrics` when `config.listen` is set; `None` when it is empty.
pub async fn start(config: &MetricsConfig) -> Result<Option<MetricsServer>, TelemetryError> {
    if config.listen.is_empty() {
        return Ok(None);
    }
    MetricsServer::start(&config.listen, Telemetry::new())
        .await
        .map(Some)
}

fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |since| since.as_secs_f64())
}
