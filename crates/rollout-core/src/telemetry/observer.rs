//! An [`Observer`] that publishes run events to the metrics registry, then passes them on.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;

use super::Telemetry;
use crate::metrics::StepMetrics;
use crate::roles::{Observer, RunStarted};

type Notify<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// Wraps the run's observer (its callbacks): each step's metrics line is published to
/// `telemetry` (when there is one) before the callbacks see it, so a callback that takes its
/// time does not delay what `/metrics` shows.
pub struct Observed<'a> {
    inner: &'a dyn Observer,
    telemetry: Option<&'a Telemetry>,
}

impl<'a> Observed<'a> {
    pub fn new(inner: &'a dyn Observer, telemetry: Option<&'a Telemetry>) -> Self {
        Observed { inner, telemetry }
    }
}

impl Observer for Observed<'_> {
    fn run_started(&self, info: RunStarted) -> Notify<'_> {
        if let Some(telemetry) = self.telemetry {
            telemetry.run_started(&info);
        }
        self.inner.run_started(info)
    }

    fn step_ended(&self, metrics: StepMetrics) -> Notify<'_> {
        if let Some(telemetry) = self.telemetry {
            telemetry.step_ended(&metrics);
        }
        self.inner.step_ended(metrics)
    }

    fn checkpoint_written(&self, step: u64, path: PathBuf) -> Notify<'_> {
        if let Some(telemetry) = self.telemetry {
            telemetry.checkpoint_written(step);
        }
        self.inner.checkpoint_written(step, path)
    }

    fn run_ended(&self, summary: serde_json::Value) -> Notify<'_> {
        self.inner.run_ended(summary)
    }
}
