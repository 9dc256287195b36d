//! Rewards and the environment in the sandbox pools: how their workers are started (the
//! embedded interpreter's executable and `sys.path`, so plugins resolve as they do
//! in-process) and how a plugin that fails to load there is reported (located in the
//! config, like an in-process one).

use std::sync::Arc;

use pyo3::prelude::*;
use rollout_core::config::{KeyPath, LoadedConfig, SandboxConfig, Segment, reward_name};
use rollout_core::sandbox::protocol::{EnvironmentSpec, RewardSpec, table_to_json};
use rollout_core::sandbox::{
    EnvironmentPoolSpec, FailureLedger, Launch, PoolSpec, SandboxError, inherited_environment,
};

use super::{PluginError, PluginFailure, PluginLoadError};
use crate::interpreter::PythonError;

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
        inherit: Vec::new(),
    })
}

/// `launch`, passing on the environment `[sandbox]` lets workers have.
fn inheriting(launch: Launch, sandbox: &SandboxConfig) -> Launch {
    Launch {
        inherit: inherited_environment(&sandbox.pass_environment),
        ..launch
    }
}

/// The pool for the config's `[[rewards]]` and `[sandbox]`.
pub fn pool_spec(loaded: &LoadedConfig, launch: Launch, ledger: Arc<FailureLedger>) -> PoolSpec {
    let config = &loaded.config;
    PoolSpec {
        launch: inheriting(launch, &config.sandbox),
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
        ledger,
    }
}

/// The pool for the config's `[environment]` and `[sandbox]`, if it has an environment.
pub fn environment_pool_spec(
    loaded: &LoadedConfig,
    launch: Launch,
    ledger: Arc<FailureLedger>,
) -> Option<EnvironmentPoolSpec> {
    let config = &loaded.config;
    let environment = config.environment.as_ref()?;
    Some(EnvironmentPoolSpec {
        launch: inheriting(launch, &config.sandbox),
        environment: EnvironmentSpec {
            plugin: environment.plugin.clone(),
            options: table_to_json(&environment.options),
        },
        seed: config.run.seed,
        config: config.sandbox.clone(),
        ledger,
    })
}

/// A reward (or the environment) that failed to load in a worker, as the same error an
/// in-process load gives: a bad option points at its line, anything else names the plugin
/// with its traceback.
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
    let config = &loaded.config;
    let (spec, table) = match reward {
        Some(reward) => (
            config.rewards.get(reward).map(|r| r.plugin.clone()),
            KeyPath::default().key("rewards").index(reward),
        ),
        None => (
            config.environment.as_ref().map(|e| e.plugin.clone()),
            KeyPath::default().key("environment"),
        ),
    };
    let spec = spec.unwrap_or_default();
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
