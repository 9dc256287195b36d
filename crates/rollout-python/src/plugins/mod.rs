//! The Rust side of Python plugins: loading them from the config and calling their hooks.
//!
//! Every function here that takes a `Python` token runs on the Python worker thread.

mod callbacks;
mod data;
mod environment;
mod generation;
mod generation_engine;
mod memory;
mod multi_agent;
mod policy;
mod policy_in_place;
mod policy_training;
mod policy_weights;
mod reward;
mod sandboxed;
mod snapshot;
mod weight_import;

use std::fmt;

use pyo3::prelude::*;

use crate::contract::table_to_py;
use crate::interpreter::PythonError;
use rollout_core::config::{ConfigError, KeyPath, LoadedConfig, Segment};

pub use callbacks::CallbackSet;
pub use data::DataPlugins;
pub use environment::{EnvironmentPlugin, Episode, EpisodePlugin};
pub use generation_engine::GenerationEnginePlugin;
pub use multi_agent::MultiAgentEnvironmentPlugin;
pub use policy::PolicyPlugin;
pub use reward::RewardSet;
pub use sandboxed::{environment_pool_spec, pool_spec, sandbox_launch, sandbox_load_error};

/// Why a plugin hook failed: it raised, or it returned something that breaks the contract.
#[derive(Debug)]
pub enum PluginFailure {
    Raised(PythonError),
    BadReturn(String),
}

/// A plugin hook failed; names the plugin, where it is configured and the hook.
#[derive(Debug)]
pub struct PluginError {
    pub plugin: String,
    pub location: String,
    pub hook: &'static str,
    pub failure: PluginFailure,
}

impl fmt::Display for PluginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "plugin `{}` ({}) failed in `{}`: ",
            self.plugin, self.location, self.hook
        )?;
        match &self.failure {
            PluginFailure::Raised(err) => {
                write!(f, "{}", err.summary())?;
                if let Some(traceback) = err.traceback().filter(|t| !t.is_empty()) {
                    write!(f, "\n{traceback}")?;
                }
                Ok(())
            }
            PluginFailure::BadReturn(reason) => write!(f, "{reason}"),
        }
    }
}

impl std::error::Error for PluginError {}

/// Loading a plugin failed: a bad option (located in the config file) or the plugin itself.
#[derive(Debug, thiserror::Error)]
pub enum PluginLoadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Plugin(#[from] PluginError),
}

/// A loaded plugin instance and where it was configured.
#[derive(Debug)]
pub struct PluginRef {
    pub spec: String,
    pub location: String,
    pub object: Py<PyAny>,
}

impl PluginRef {
    /// Resolves `spec`, builds its `Config` from `options` and instantiates it. `key` is the
    /// plugin's table in the config (its options are at `key.options`).
    pub fn load(
        py: Python<'_>,
        loaded: &LoadedConfig,
        key: &KeyPath,
        spec: &str,
        options: &toml::Table,
        expected: &str,
    ) -> Result<Self, PluginLoadError> {
        let options_key = key.clone().key("options");
        Self::load_options_at(py, loaded, key, &options_key, spec, options, expected)
    }

    /// [`PluginRef::load`] for a plugin whose options are the table at `options_key`.
    pub fn load_options_at(
        py: Python<'_>,
        loaded: &LoadedConfig,
        key: &KeyPath,
        options_key: &KeyPath,
        spec: &str,
        options: &toml::Table,
        expected: &str,
    ) -> Result<Self, PluginLoadError> {
        let location = loaded.describe_location(key);
        let raised = |err: PyErr| plugin_load_error(py, loaded, options_key, spec, &location, &err);
        let sdk = py.import("rollout_sdk").map_err(raised)?;
        let expected_class = sdk.getattr(expected).map_err(raised)?;
        let options = table_to_py(py, options).map_err(raised)?;
        let object = sdk
            .getattr("load_plugin")
            .and_then(|load| load.call1((spec, options, expected_class)))
            .map_err(raised)?;
        Ok(PluginRef {
            spec: spec.to_owned(),
            location,
            object: object.unbind(),
        })
    }

    /// Calls `hook(*args)` on the plugin.
    pub fn call<'py, A>(
        &self,
        py: Python<'py>,
        hook: &'static str,
        args: A,
    ) -> Result<Bound<'py, PyAny>, PluginError>
    where
        A: pyo3::call::PyCallArgs<'py>,
    {
        self.object
            .bind(py)
            .call_method1(hook, args)
            .map_err(|err| self.raised(py, hook, &err))
    }

    pub fn raised(&self, py: Python<'_>, hook: &'static str, err: &PyErr) -> PluginError {
        self.error(hook, PluginFailure::Raised(PythonError::from_py(py, err)))
    }

    pub fn bad_return(&self, hook: &'static str, reason: impl Into<String>) -> PluginError {
        self.error(hook, PluginFailure::BadReturn(reason.into()))
    }

    fn error(&self, hook: &'static str, failure: PluginFailure) -> PluginError {
        PluginError {
            plugin: self.spec.clone(),
            location: self.location.clone(),
            hook,
            failure,
        }
    }
}

/// A `rollout_sdk.ConfigError` points at an option; anything else is the plugin failing to
/// load.
fn plugin_load_error(
    py: Python<'_>,
    loaded: &LoadedConfig,
    options_key: &KeyPath,
    spec: &str,
    location: &str,
    err: &PyErr,
) -> PluginLoadError {
    if let Some(option_path) = config_error_key(py, err) {
        let mut path = options_key.clone();
        path.0.extend(option_path);
        let reason = err
            .value(py)
            .getattr("reason")
            .and_then(|r| r.extract::<String>())
            .unwrap_or_else(|_| err.to_string());
        return loaded
            .error_at(&path, format!("{reason} (plugin `{spec}`)"))
            .into();
    }
    PluginError {
        plugin: spec.to_owned(),
        location: location.to_owned(),
        hook: "load",
        failure: PluginFailure::Raised(PythonError::from_py(py, err)),
    }
    .into()
}

fn config_error_key(py: Python<'_>, err: &PyErr) -> Option<Vec<Segment>> {
    let config_error = py.import("rollout_sdk").ok()?.getattr("ConfigError").ok()?;
    if !err.is_instance(py, &config_error) {
        return None;
    }
    let key: Vec<String> = err.value(py).getattr("key").ok()?.extract().ok()?;
    Some(
        key.into_iter()
            .map(|part| match part.parse::<usize>() {
                Ok(index) => Segment::Index(index),
                Err(_) => Segment::Key(part),
            })
            .collect(),
    )
}
