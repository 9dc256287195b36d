//! Multi-agent environments: one plugin instance per episode, several agents taking turns.

use pyo3::prelude::*;
use rollout_core::config::{KeyPath, LoadedConfig};
use rollout_core::roles::{AgentTurn, JointOutcome};

use super::{Episode, EpisodePlugin, PluginError, PluginLoadError, PluginRef};
use crate::contract;

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
        let hook = "reset";
        let turn = episode.reset(&self.prototype, py, record, seed)?;
        let turn: contract::AgentTurn = contract::from_python(&turn)
            .map_err(|reason| self.prototype.bad_return(hook, reason))?;
        self.declared(hook, turn.into())
    }

    fn step(
        &self,
        py: Python<'_>,
        episode: &Episode,
        action: &str,
    ) -> Result<JointOutcome, PluginError> {
        let hook = "step";
        let result = episode.step(&self.prototype, py, action)?;
        let result: contract::JointStepResult = contract::from_python(&result)
            .map_err(|reason| self.prototype.bad_return(hook, reason))?;
        for (agent, reward) in &result.rewards {
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
        let next = match result.next_turn {
            Some(turn) => Some(self.declared(hook, turn.into())?),
            None => None,
        };
        Ok(JointOutcome {
            rewards: result.rewards,
            next,
        })
    }
}

impl MultiAgentEnvironmentPlugin {
    /// `turn`, if it goes to one of the declared agents.
    fn declared(&self, hook: &'static str, turn: AgentTurn) -> Result<AgentTurn, PluginError> {
        if !self.agents.contains(&turn.agent) {
            return Err(self.prototype.bad_return(
                hook,
                format!(
                    "handed a turn to `{}`, which is not one of its agents {:?}",
                    turn.agent, self.agents
                ),
            ));
        }
        Ok(turn)
    }
}
