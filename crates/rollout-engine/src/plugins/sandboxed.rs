//! Rewards in the sandbox pool: how its workers are started (the embedded interpreter's
//! executable and `sys.path`, so plugins resolve as they do in-process) and how a reward that
//! fails to load there is reported (located in the config, like an in-process one).

use pyo3::prelude::*;

use super::{PluginError, PluginFailure, PluginLoadError};
use crate::config::{KeyPath, LoadedConfig, Segment, reward_name};
use crate::python::PythonError;
use crate::sandbox::protocol::{RewardSpec, table_to_json};
use crate::sandbox::{Launch, PoolSpec, SandboxError};

/// `python -m rollout_sdk.sandbox` with this interpreter's executable and `sys.path`.
pub fn sandbox_launch(py: Python<'_>) -> Result<Launch, PythonError> {
    let wrap = |err: PyErr| PythonError::from_py(py, &err);
    let spec = py
        .import("rollout_sdk.sandbox")
        .and_then(|module| module.call_method0("launch_spec"))
        .map_err(wrap)?;
    let program: String = spec
        .get_item("program")
        .and_then(|p| p.extract())
        .map_err(wrap)?;
    let paths: Vec<String> = spec
        .get_item("pythonpath")
        .and_then(|p| p.extract())
        .map_err(wrap)?;
    Ok(Launch {
        program: program.into(),
        args: vec!["-m".into(), "rollout_sdk.sandbox".into()],
        env: vec![
            ("PYTHONPATH".into(), paths.join(":")),
            ("PYTHONFAULTHANDLER".into(), "1".into()),
        ],
    })
}

/// The pool for the config's `[[rewards]]` and `[sandbox]`.
pub fn pool_spec(loaded: &LoadedConfig, launch: Launch) -> PoolSpec {
    let config = &loaded.config;
    PoolSpec {
        launch,
        rewards: config
            .rewards
            .iter()
            .map(|reward| RewardSpec {
                plugin: reward.plugin.clone(),
                options: table_to_json(&reward.options),
            })
            .collect(),
        names: config.rewards.iter().map(reward_name).collect(),
        weights: config.rewards.iter().map(|reward| reward.weight).collect(),
        config: config.sandbox.clone(),
    }
}

/// A reward that failed to load in a worker, as the same error an in-process load gives: a
/// bad option points at its line, anything else names the plugin with its traceback.
pub fn sandbox_load_error(
    loaded: &LoadedConfig,
    err: SandboxError,
) -> Result<PluginLoadError, SandboxError> {
    let SandboxError::LoadFailed {
        reward,
        key,
        message,
        traceback,
    } = err
    else {
        return Err(err);
    };
    let spec = loaded
        .config
        .rewards
        .get(reward)
        .map_or_else(String::new, |r| r.plugin.clone());
    let table = KeyPath::default().key("rewards").index(reward);
    if let Some(option_path) = key {
        let mut path = table.key("options");
        path.0.extend(
            option_path
                .into_iter()
                .map(|part| match part.parse::<usize>() {
                    Ok(index) => Segment::Index(index),
                    Err(_) => Segment::Key(part),
                }),
        );
        return Ok(loaded
            .error_at(&path, format!("{message} (plugin `{spec}`)"))
            .into());
    }
    Ok(PluginError {
        plugin: spec,
        location: loaded.describe_location(&table),
        hook: "load",
        failure: PluginFailure::Raised(PythonError::Exception {
            summary: message,
            traceback: traceback.trim_end().to_owned(),
        }),
    }
    .into())
}
