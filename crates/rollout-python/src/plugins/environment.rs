//! Multi-turn environments: one plugin instance per episode.

use pyo3::prelude::*;
use pyo3::types::IntoPyDict;
use rollout_core::config::{KeyPath, LoadedConfig};
use rollout_core::roles::StepResult;

use super::{PluginError, PluginLoadError, PluginRef};
use crate::contract::{self, json_to_py};

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
        let kwargs = [("seed", seed)].into_py_dict(py).map_err(raised)?;
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

/// An environment plugin whose episodes are instances of its class.
pub trait EpisodePlugin: Send + Sync + 'static {
    /// What `reset` answers: the first prompt, or the first turn.
    type Start: Send + 'static;
    /// What `step` answers.
    type Outcome: Send + 'static;
    fn new_episode(&self, py: Python<'_>) -> Result<Episode, PluginError>;
    fn reset(
        &self,
        py: Python<'_>,
        episode: &Episode,
        record: &serde_json::Value,
        seed: u64,
    ) -> Result<Self::Start, PluginError>;
    fn step(
        &self,
        py: Python<'_>,
        episode: &Episode,
        action: &str,
    ) -> Result<Self::Outcome, PluginError>;
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
    type Outcome = StepResult;

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
    ) -> Result<StepResult, PluginError> {
        let hook = "step";
        let result = episode.step(&self.prototype, py, action)?;
        let result: contract::StepResult = contract::from_python(&result)
            .map_err(|reason| self.prototype.bad_return(hook, reason))?;
        let reward = result.reward;
        if !reward.is_finite() {
            return Err(self.prototype.bad_return(
                hook,
                format!("returned reward {reward}; rewards must be finite"),
            ));
        }
        Ok(result.into())
    }
}
