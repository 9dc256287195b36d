//! Multi-turn environments: one plugin instance per episode.

use pyo3::prelude::*;

use super::{PluginError, PluginLoadError, PluginRef};
use crate::config::{KeyPath, LoadedConfig};
use crate::live_episodes::EpisodePlugin;
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
    /// A fresh instance of `prototype`'s class, built from the same `Config`.
    pub(super) fn of(prototype: &PluginRef, py: Python<'_>) -> Result<Self, PluginError> {
        let object = prototype.object.bind(py);
        object
            .getattr("config")
            .and_then(|config| object.get_type().call1((config,)))
            .map(|instance| Episode(instance.unbind()))
            .map_err(|err| prototype.raised(py, "__init__", &err))
    }

    /// Calls the episode's `reset(record, seed=seed)`.
    pub(super) fn reset<'py>(
        &self,
        prototype: &PluginRef,
        py: Python<'py>,
        record: &serde_json::Value,
        seed: u64,
    ) -> Result<Bound<'py, PyAny>, PluginError> {
        let raised = |err: PyErr| prototype.raised(py, "reset", &err);
        let record = json_to_py(py, record).map_err(raised)?;
        let kwargs = pyo3::types::PyDict::new(py);
        kwargs.set_item("seed", seed).map_err(raised)?;
        self.0
            .bind(py)
            .call_method("reset", (record,), Some(&kwargs))
            .map_err(raised)
    }

    /// Calls the episode's `step(action)`.
    pub(super) fn step<'py>(
        &self,
        prototype: &PluginRef,
        py: Python<'py>,
        action: &str,
    ) -> Result<Bound<'py, PyAny>, PluginError> {
        self.0
            .bind(py)
            .call_method1("step", (action,))
            .map_err(|err| prototype.raised(py, "step", &err))
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
}

impl EpisodePlugin for EnvironmentPlugin {
    type Start = String;
    type Outcome = StepOutcome;

    fn new_episode(&self, py: Python<'_>) -> Result<Episode, PluginError> {
        Episode::of(&self.prototype, py)
    }

    fn reset(
        &self,
        py: Python<'_>,
        episode: &Episode,
        record: &serde_json::Value,
        seed: u64,
    ) -> Result<String, PluginError> {
        episode
            .reset(&self.prototype, py, record, seed)?
            .extract()
            .map_err(|_| {
                self.prototype
                    .bad_return("reset", "must return the first prompt as a str")
            })
    }

    fn step(
        &self,
        py: Python<'_>,
        episode: &Episode,
        action: &str,
    ) -> Result<StepOutcome, PluginError> {
        let hook = "step";
        let result = episode.step(&self.prototype, py, action)?;
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
