//! Callbacks. A failing callback is reported with its traceback and switched off: observing
//! a run must not stop it.

use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::prelude::*;
use rollout_core::config::{KeyPath, LoadedConfig};
use rollout_core::metrics::StepMetrics;
use rollout_core::roles::RunStarted;

use super::{PluginLoadError, PluginRef};
use crate::contract::{RunInfo, json_to_py, to_python};

struct Callback {
    plugin: PluginRef,
    enabled: AtomicBool,
}

pub struct CallbackSet {
    callbacks: Vec<Callback>,
}

impl CallbackSet {
    pub fn load(py: Python<'_>, loaded: &LoadedConfig) -> Result<Self, PluginLoadError> {
        let callbacks = loaded
            .config
            .callbacks
            .iter()
            .enumerate()
            .map(|(index, callback)| {
                let key = KeyPath::default().key("callbacks").index(index);
                let plugin = PluginRef::load(
                    py,
                    loaded,
                    &key,
                    &callback.plugin,
                    &callback.options,
                    "Callback",
                )?;
                Ok(Callback {
                    plugin,
                    enabled: AtomicBool::new(true),
                })
            })
            .collect::<Result<Vec<_>, PluginLoadError>>()?;
        Ok(CallbackSet { callbacks })
    }

    pub fn on_run_start(&self, py: Python<'_>, start: &RunStarted) {
        match to_python(py, RunInfo::from(start)) {
            Ok(info) => self.each(py, "on_run_start", |_| Ok((info.clone(),))),
            Err(err) => tracing::error!("cannot build RunInfo for callbacks: {err}"),
        }
    }

    /// `on_step_end(step, metrics)`: the step's line of `metrics.jsonl` as a dict
    /// (`rollout_sdk.StepMetrics`).
    pub fn on_step_end(&self, py: Python<'_>, metrics: &StepMetrics) {
        let line = metrics.to_line();
        self.each(py, "on_step_end", |py| {
            Ok((metrics.step, json_to_py(py, &line)?))
        });
    }

    pub fn on_checkpoint(&self, py: Python<'_>, step: u64, path: &std::path::Path) {
        // The SDK promises a `str` (a `PathBuf` would arrive as a `pathlib.Path`).
        self.each(py, "on_checkpoint", |_| {
            Ok((step, path.to_string_lossy().into_owned()))
        });
    }

    pub fn on_run_end(&self, py: Python<'_>, summary: &serde_json::Value) {
        self.each(py, "on_run_end", |py| Ok((json_to_py(py, summary)?,)));
    }

    fn each<'py, A>(
        &self,
        py: Python<'py>,
        hook: &'static str,
        args: impl Fn(Python<'py>) -> PyResult<A>,
    ) where
        A: pyo3::call::PyCallArgs<'py>,
    {
        for callback in self
            .callbacks
            .iter()
            .filter(|c| c.enabled.load(Ordering::Relaxed))
        {
            let result = args(py)
                .map_err(|err| callback.plugin.raised(py, hook, &err))
                .and_then(|args| callback.plugin.call(py, hook, args));
            if let Err(err) = result {
                tracing::error!("{err}\nthis callback is switched off for the rest of the run");
                callback.enabled.store(false, Ordering::Relaxed);
            }
        }
    }
}
