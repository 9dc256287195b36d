//! Multi-turn environments: one plugin instance per episode.

use pyo3::prelude::*;

use super::{PluginError, PluginLoadError, PluginRef};
use crate::config::{KeyPath, LoadedConfig};
use crate::python::convert::json_to_py;
use crate::roles::StepOutcome;

/// The configured environment; `prototype` is the instance `rollout check` builds, and every
/// episode gets a fresh instance of its class with the same `Config`.
pub struct EnvironmentPlugin {
    prototype: PluginRef,
}

/// An episode's environment instance.
pub struct Episode(Py<PyAny>);

impl Episode {
    pub(super) fn new(instance: Py<PyAny>) -> Self {
        Episode(instance)
    }

    pub(super) fn object<'py>(&self, py: Python<'py>) -> &Bound<'py, PyAny> {
        self.0.bind(py)
    }
}

impl EnvironmentPlugin {
    pub fn load(py: Python<'_>, loaded: &LoadedConfig) -> Result<Option<Self>, PluginLoadError> {
        let Some(environment) = &loaded.config.environment else {
            return Ok(None);
        };
        let key = KeyPath::default().key("environment");
        let prototype = PluginRef::load(
            py,
            loaded,
            &key,
            &environment.plugin,
            &environment.options,
            "Environment",
        )?;
        Ok(Some(EnvironmentPlugin { prototype }))
    }

    pub fn new_episode(&self, py: Python<'_>) -> Result<Episode, PluginError> {
        let hook = "__init__";
        let prototype = self.prototype.object.bind(py);
        prototype
            .getattr("config")
            .and_then(|config| prototype.get_type().call1((config,)))
            .map(|instance| Episode(instance.unbind()))
            .map_err(|err| self.prototype.raised(py, hook, &err))
    }

    pub fn reset(
        &self,
        py: Python<'_>,
        episode: &Episode,
        record: &serde_json::Value,
        seed: u64,
    ) -> Result<String, PluginError> {
        let hook = "reset";
        let raised = |err: PyErr| self.prototype.raised(py, hook, &err);
        let record = json_to_py(py, record).map_err(raised)?;
        let kwargs = pyo3::types::PyDict::new(py);
        kwargs.set_item("seed", seed).map_err(raised)?;
        episode
            .0
            .bind(py)
            .call_method(hook, (record,), Some(&kwargs))
            .map_err(raised)?
            .extract()
            .map_err(|_| {
                self.prototype
                    .bad_return(hook, "must return the first prompt as a str")
            })
    }

    pub fn step(
        &self,
        py: Python<'_>,
        episode: &Episode,
        action: &str,
    ) -> Result<StepOutcome, PluginError> {
        let hook = "step";
        let raised = |err: PyErr| self.prototype.raised(py, hook, &err);
        let result = episode
            .0
            .bind(py)
            .call_method1(hook, (action,))
            .map_err(raised)?;
        let bad = || {
            self.prototype
                .bad_return(hook, "must return a rollout_sdk.StepResult")
        };
        let observation: String = result
            .getattr("observation")
            .map_err(|_| bad())?
            .extract()
            .map_err(|_| bad())?;
        let reward: f64 = result
            .getattr("reward")
            .map_err(|_| bad())?
            .extract()
            .map_err(|_| bad())?;
        let done: bool = result
            .getattr("done")
            .map_err(|_| bad())?
            .extract()
            .map_err(|_| bad())?;
        if !reward.is_finite() {
            return Err(self.prototype.bad_return(
                hook,
                format!("returned reward {reward}; rewards must be finite"),
            ));
        }
        Ok(StepOutcome {
            observation,
            reward,
            done,
        })
    }
}
