//! Rewards and the environment in the sandbox pools: how their workers are started (the
//! embedded interpreter's executable and `sys.path`, so plugins resolve as they do
//! in-process) and how a plugin that fails to load there is reported (located in the
//! config, like an in-process one).

use std::sync::Arc;

use pyo3::prelude::*;
use rollout_core::config::{Config, KeyPath, LoadedConfig, Segment, reward_name};
use rollout_core::sandbox::protocol::{EnvironmentSpec, RewardSpec, table_to_json};
use rollout_core::sandbox::{
    EnvironmentPoolSpec, FailureLedger, Launch, PoolSpec, SandboxError, inherited_environment,
};
use rollout_core::threads::{THREADS_VARIABLE, available_cores, set_in_environment, share};

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

/// `launch`, passing on the environment `[sandbox]` lets workers have, and with each
/// worker's share of the cores unless this process's `OMP_NUM_THREADS` (`threads_set_here`)
/// leaves them nothing to decide.
fn inheriting(launch: Launch, config: &Config, threads_set_here: bool) -> Launch {
    let mut env = launch.env;
    if let Some(threads) = worker_threads(config, available_cores(), threads_set_here) {
        env.push((THREADS_VARIABLE.into(), threads.to_string()));
    }
    Launch {
        env,
        inherit: inherited_environment(&config.sandbox.pass_environment),
        ..launch
    }
}

/// Each sandbox worker's torch threads: `cores` shared by the workers of `config`'s pools,
/// which score (and play episodes) at the same time; `None` when this process's
/// `OMP_NUM_THREADS` (`threads_set_here`), which the workers inherit, decides.
fn worker_threads(config: &Config, cores: usize, threads_set_here: bool) -> Option<usize> {
    let pools =
        usize::from(config.rewards_sandboxed()) + usize::from(config.environment_sandboxed());
    (!threads_set_here).then(|| share(cores, config.sandbox.processes * pools))
}

/// The pool for the config's `[[rewards]]` and `[sandbox]`.
pub fn pool_spec(loaded: &LoadedConfig, launch: Launch, ledger: Arc<FailureLedger>) -> PoolSpec {
    let config = &loaded.config;
    PoolSpec {
        launch: inheriting(launch, config, set_in_environment()),
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
        launch: inheriting(launch, config, set_in_environment()),
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::path::Path;

    use rollout_core::config::load_text;

    use super::*;

    fn config(extra: &str) -> Config {
        let text = format!(
            "[policy]\nplugin = \"p:P\"\n[data]\nplugin = \"d:D\"\n\
             [[rewards]]\nplugin = \"r:R\"\n{extra}"
        );
        load_text(Path::new("sandbox.toml"), text, &[])
            .unwrap()
            .config
    }

    #[test]
    fn sandbox_workers_share_the_cores_unless_the_environment_sets_the_threads() {
        let rewards = config("[sandbox]\nprocesses = 2\n");
        assert_eq!(worker_threads(&rewards, 16, false), Some(8));
        assert_eq!(worker_threads(&rewards, 2, false), Some(1));
        assert_eq!(worker_threads(&rewards, 16, true), None);
        let with_episodes = config("[environment]\nplugin = \"e:E\"\n[sandbox]\nprocesses = 2\n");
        assert_eq!(worker_threads(&with_episodes, 16, false), Some(4));
        let episodes_in_process = config(
            "[environment]\nplugin = \"e:E\"\n[sandbox]\nprocesses = 2\nenvironments = false\n",
        );
        assert_eq!(worker_threads(&episodes_in_process, 16, false), Some(8));
    }

    #[test]
    fn each_worker_is_started_with_its_share_unless_the_variable_is_inherited() {
        let launch = || Launch {
            program: "python".into(),
            args: Vec::new(),
            env: vec![("PYTHONPATH".into(), "p".into())],
            inherit: Vec::new(),
        };
        let rewards = config("[sandbox]\nprocesses = 2\npass_environment = [\"HF_TOKEN\"]\n");
        let started = inheriting(launch(), &rewards, false);
        let share = share(available_cores(), 2).to_string();
        assert_eq!(
            started.env,
            [
                ("PYTHONPATH".to_owned(), "p".to_owned()),
                (THREADS_VARIABLE.to_owned(), share)
            ]
        );
        assert!(started.inherit.contains(&"HF_TOKEN".to_owned()));
        assert!(started.inherit.contains(&THREADS_VARIABLE.to_owned()));
        let inherited = inheriting(launch(), &rewards, true);
        assert_eq!(inherited.env, [("PYTHONPATH".to_owned(), "p".to_owned())]);
    }
}
