//! Callbacks. A failing callback is reported with its traceback and switched off: observing
//! a run must not stop it.

use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::{PluginLoadError, PluginRef, Sdk};
use crate::config::{KeyPath, LoadedConfig};
use crate::python::convert::json_to_py;
use crate::roles::RunStarted;

struct Callback {
    plugin: PluginRef,
    enabled: AtomicBool,
}

pub struct CallbackSet {
    callbacks: Vec<Callback>,
    sdk: std::sync::Arc<Sdk>,
}

impl CallbackSet {
    pub fn load(
        py: Python<'_>,
        loaded: &LoadedConfig,
        sdk: std::sync::Arc<Sdk>,
    ) -> Result<Self, PluginLoadError> {
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
        Ok(CallbackSet { callbacks, sdk })
    }

    pub fn on_run_start(&self, py: Python<'_>, start: &RunStarted) {
        let info = (|| {
            let fields = PyDict::new(py);
            fields.set_item("name", &start.name)?;
            fields.set_item("output_dir", &start.output_dir)?;
            fields.set_item("total_steps", start.total_steps)?;
            fields.set_item("start_step", start.start_step)?;
            fields.set_item("config", json_to_py(py, &start.config)?)?;
            self.sdk.run_info.bind(py).call((), Some(&fields))
        })();
        match info {
            Ok(info) => self.each(py, "on_run_start", |_| Ok((info.clone(),))),
            Err(err) => tracing::error!("cannot build RunInfo for callbacks: {err}"),
        }
    }

    pub fn on_step_end(&self, py: Python<'_>, step: u64, metrics: &serde_json::Value) {
        self.each(py, "on_step_end", |py| Ok((step, json_to_py(py, metrics)?)));
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
