//! `[agents.NAME]`: several policies trained together in one run, taking turns in a
//! multi-agent environment (`rollout_sdk.MultiAgentEnvironment`).

use serde::{Deserialize, Serialize};

use super::{Algorithm, Config, ConfigError, KeyPath, LoadedConfig, PluginConfig};

/// One agent: its own policy (a copy of `[policy]` unless it names one), optimizer and
/// checkpoint.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    /// The agent's policy; absent: its own copy of the run's `[policy]`.
    pub policy: Option<PluginConfig>,
    /// The agent's learning rate; absent: `train.learning_rate`.
    pub learning_rate: Option<f64>,
}

/// An agent of the run with its policy resolved and the config key it came from.
pub struct AgentSpec<'c> {
    pub name: &'c str,
    pub policy: &'c PluginConfig,
    /// Where the policy is configured, for located errors.
    pub policy_key: KeyPath,
    pub learning_rate: f64,
}

impl Config {
    /// Whether the run trains several agents (`[agents]`).
    pub fn multi_agent(&self) -> bool {
        !self.agents.is_empty()
    }

    /// The run's agents in name order.
    pub fn agent_specs(&self) -> Vec<AgentSpec<'_>> {
        self.agents
            .iter()
            .map(|(name, agent)| {
                let (policy, policy_key) = match &agent.policy {
                    Some(policy) => (
                        policy,
                        KeyPath::default().key("agents").key(name).key("policy"),
                    ),
                    None => (&self.policy, KeyPath::default().key("policy")),
                };
                AgentSpec {
                    name,
                    policy,
                    policy_key,
                    learning_rate: agent.learning_rate.unwrap_or(self.train.learning_rate),
                }
            })
            .collect()
    }
}

/// What a multi-agent run needs and what it cannot combine with.
pub(super) fn validate_agents(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    if !loaded.config.multi_agent() {
        return Ok(());
    }
    for (name, agent) in &loaded.config.agents {
        validate_agent(loaded, name, agent)?;
    }
    validate_team_run(loaded)
}

/// One `[agents.<name>]` table: its name and its own learning rate.
fn validate_agent(
    loaded: &LoadedConfig,
    name: &str,
    agent: &AgentConfig,
) -> Result<(), ConfigError> {
    let key = KeyPath::default().key("agents").key(name);
    let valid_name = name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !valid_name {
        return Err(loaded.error_at(
            &key,
            format!(
                "agent name `{name}`: use lowercase letters, digits and `_`, starting with a letter"
            ),
        ));
    }
    if let Some(rate) = agent.learning_rate {
        if !(rate.is_finite() && rate > 0.0) {
            return Err(loaded.error_at(&key.key("learning_rate"), "must be a finite number > 0"));
        }
    }
    Ok(())
}

/// The rest of the config, as a multi-agent run needs it.
fn validate_team_run(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    let config = &loaded.config;
    let at =
        |path: &str, message: &str| Err(loaded.error_at(&KeyPath::parse_dotted(path), message));
    if config.environment.is_none() {
        return at(
            "agents",
            "agents take turns in an environment: add an [environment] whose plugin is a \
             rollout_sdk.MultiAgentEnvironment",
        );
    }
    if !config.rewards.is_empty() {
        return at(
            "rewards",
            "a multi-agent run's rewards come from its environment (JointStepResult.rewards): \
             drop the [[rewards]] tables",
        );
    }
    if !config.algorithm.name.samples() || config.algorithm.name == Algorithm::Ppo {
        return at(
            "algorithm.name",
            "a multi-agent run trains each agent with a critic-free policy-gradient algorithm \
             (grpo, dr_grpo, rloo, reinforce_pp or gspo)",
        );
    }
    if config.sft.is_some() {
        return at(
            "sft",
            "a multi-agent run has no supervised warm start: drop [sft]",
        );
    }
    if config.sandbox.processes > 0 && config.sandbox.environments {
        return at(
            "sandbox.environments",
            "a multi-agent environment runs in the trainer's process: set \
             sandbox.environments = false",
        );
    }
    if config.rollout.max_new_tokens_field.is_some() {
        return at(
            "rollout.max_new_tokens_field",
            "per-record token budgets apply to single-policy runs; a multi-agent run uses \
             rollout.max_new_tokens for every turn",
        );
    }
    Ok(())
}
