//! Multi-agent environments: one plugin instance per episode, several agents taking turns.

use std::collections::BTreeMap;

use pyo3::prelude::*;

use super::{Episode, PluginError, PluginLoadError, PluginRef};
use crate::config::{KeyPath, LoadedConfig};
use crate::live_episodes::EpisodePlugin;
use crate::roles::{AgentTurn, JointOutcome};

/// The configured multi-agent environment; every episode gets a fresh instance of its class
/// with the same `Config`.
pub struct MultiAgentEnvironmentPlugin {
    prototype: PluginRef,
    agents: Vec<String>,
}

impl MultiAgentEnvironmentPlugin {
    /// Loads `[environment]` of a run with `[agents]`; its declared `agents` must be the
    /// configured ones.
    pub fn load(py: Python<'_>, loaded: &LoadedConfig) -> Result<Option<Self>, PluginLoadError> {
        let config = &loaded.config;
        let (Some(environment), true) = (&config.environment, config.multi_agent()) else {
            return Ok(None);
        };
        let key = KeyPath::default().key("environment");
        let prototype = PluginRef::load(
            py,
            loaded,
            &key,
            &environment.plugin,
            &environment.options,
            "MultiAgentEnvironment",
        )?;
        let declared: Vec<String> = prototype
            .object
            .bind(py)
            .getattr("agents")
            .and_then(|agents| agents.extract())
            .map_err(|_| prototype.bad_return("agents", "must be a tuple of agent names (str)"))?;
        let mut sorted = declared.clone();
        sorted.sort();
        let configured: Vec<String> = config.agents.keys().cloned().collect();
        if sorted != configured {
            return Err(loaded
                .error_at(
                    &KeyPath::default().key("agents"),
                    format!(
                        "{} hands turns to {declared:?}, but [agents] configures {configured:?}: \
                         configure exactly its agents",
                        environment.plugin
                    ),
                )
                .into());
        }
        Ok(Some(MultiAgentEnvironmentPlugin {
            prototype,
            agents: declared,
        }))
    }
}

impl EpisodePlugin for MultiAgentEnvironmentPlugin {
    type Start = AgentTurn;
    type Outcome = JointOutcome;

    fn new_episode(&self, py: Python<'_>) -> Result<Episode, PluginError> {
        Episode::of(&self.prototype, py)
    }

    fn reset(
        &self,
        py: Python<'_>,
        episode: &Episode,
        record: &serde_json::Value,
        seed: u64,
    ) -> Result<AgentTurn, PluginError> {
        let turn = episode.reset(&self.prototype, py, record, seed)?;
        self.turn("reset", &turn)?.ok_or_else(|| {
            self.prototype
                .bad_return("reset", "must return an AgentTurn, not None")
        })
    }

    fn step(
        &self,
        py: Python<'_>,
        episode: &Episode,
        action: &str,
    ) -> Result<JointOutcome, PluginError> {
        let hook = "step";
        let result = episode.step(&self.prototype, py, action)?;
        let bad = || {
            self.prototype
                .bad_return(hook, "must return a rollout_sdk.JointStepResult")
        };
        let rewards: BTreeMap<String, f64> = result
            .getattr("rewards")
            .and_then(|rewards| rewards.extract())
            .map_err(|_| bad())?;
        for (agent, reward) in &rewards {
            if !self.agents.contains(agent) {
                return Err(self.prototype.bad_return(
                    hook,
                    format!(
                        "rewarded `{agent}`, which is not one of its agents {:?}",
                        self.agents
                    ),
                ));
            }
            if !reward.is_finite() {
                return Err(self.prototype.bad_return(
                    hook,
                    format!("returned reward {reward} for `{agent}`; rewards must be finite"),
                ));
            }
        }
        let next = result.getattr("next_turn").map_err(|_| bad())?;
        Ok(JointOutcome {
            rewards,
            next: self.turn(hook, &next)?,
        })
    }
}

impl MultiAgentEnvironmentPlugin {
    /// An `AgentTurn` (or `None`) of a declared agent.
    fn turn(
        &self,
        hook: &'static str,
        turn: &Bound<'_, PyAny>,
    ) -> Result<Option<AgentTurn>, PluginError> {
        if turn.is_none() {
            return Ok(None);
        }
        let bad = || {
            self.prototype
                .bad_return(hook, "a turn must be a rollout_sdk.AgentTurn")
        };
        let agent: String = turn
            .getattr("agent")
            .and_then(|a| a.extract())
            .map_err(|_| bad())?;
        let prompt: String = turn
            .getattr("prompt")
            .and_then(|p| p.extract())
            .map_err(|_| bad())?;
        if !self.agents.contains(&agent) {
            return Err(self.prototype.bad_return(
                hook,
                format!(
                    "handed a turn to `{agent}`, which is not one of its agents {:?}",
                    self.agents
                ),
            ));
        }
        Ok(Some(AgentTurn { agent, prompt }))
    }
}
