//! Training every agent on its own turns: per-agent group advantages of the episodes'
//! returns, micro-batches of the run's objective, one update per agent.

use std::time::Instant;

use rollout_net::messages::{TrainRequest, TrainResponse};
use serde_json::{Value, json};

use super::play::Played;
use crate::config::Config;
use crate::metrics::StepMetrics;
use crate::train::Team;
use crate::train::advantage::scored_group_advantages;
use crate::train::rl_step::{rl_objective, warmed_up};
use crate::train::{RunError, TrainSequence, mean, micro_batches, std_dev};

/// One agent's share of a step.
pub(super) struct AgentStep {
    /// Per episode: the agent's advantage (0 where it did not act).
    pub advantages: Vec<f64>,
    pub zero_std_groups: usize,
    pub learning_rate: f64,
    pub response: TrainResponse,
    pub train_seconds: f64,
}

/// The advantage of each episode's return for `agent`, within groups of `group_size`
/// episodes; episodes the agent took no turn in are left out.
pub(super) fn agent_advantages(
    played: &Played,
    agent: usize,
    config: &Config,
) -> (Vec<f64>, usize) {
    let group_size = config.rollout.group_size.max(1);
    let episodes = played.returns.len();
    let groups: Vec<usize> = (0..episodes).map(|e| e / group_size).collect();
    let returns: Vec<f64> = played.returns.iter().map(|r| r[agent]).collect();
    let acted: Vec<bool> = played.acted.iter().map(|a| a[agent]).collect();
    scored_group_advantages(
        &groups,
        &returns,
        &acted,
        episodes.div_ceil(group_size),
        config.algorithm.estimator(),
        config.algorithm.std_eps,
    )
}

/// Trains every agent on its turns of `played` (agents one after another: in one process
/// they share the interpreter).
pub(super) async fn train_agents(
    config: &Config,
    team: &Team<'_>,
    step: u64,
    played: &Played,
) -> Result<Vec<AgentStep>, RunError> {
    let objective = rl_objective(config, step);
    let skip_zero = config.algorithm.kl_coef == 0.0;
    let mut steps = Vec::with_capacity(team.agents.len());
    for (agent, member) in team.agents.iter().enumerate() {
        let (advantages, zero_std_groups) = agent_advantages(played, agent, config);
        let sequences: Vec<TrainSequence> = played
            .turns
            .iter()
            .filter(|t| t.agent == agent)
            .map(|t| TrainSequence {
                tokens: t.tokens.clone(),
                loss_mask: t.loss_mask.clone(),
                logprobs: t.logprobs.clone(),
                advantage: advantages[t.episode] as f32,
                // Agents play with the weights they train (no staleness in a team).
                staleness: 0,
            })
            .collect();
        let (batches, _) = micro_batches(
            &sequences,
            &objective,
            config.train.micro_batch_tokens,
            skip_zero,
        );
        let learning_rate = warmed_up(member.learning_rate, config, step);
        let started = Instant::now();
        let span = tracing::info_span!("train", step, agent = member.name.as_str());
        let response = tracing::Instrument::instrument(
            member.learner.train(TrainRequest {
                micro_batches: batches,
                learning_rate,
                epochs: config.algorithm.epochs,
            }),
            span,
        )
        .await?;
        steps.push(AgentStep {
            advantages,
            zero_std_groups,
            learning_rate,
            response,
            train_seconds: started.elapsed().as_secs_f64(),
        });
    }
    Ok(steps)
}

/// The step's metrics: the run's and, under `<agent>/`, each agent's (in `measured`).
pub(super) fn metrics(
    team: &Team<'_>,
    mut line: StepMetrics,
    played: &Played,
    trained: &[AgentStep],
) -> StepMetrics {
    let mut agent_rewards = Vec::new();
    for (agent, (member, trained)) in team.agents.iter().zip(trained).enumerate() {
        let stats = AgentStats::of(played, agent);
        agent_rewards.push(stats.reward_mean);
        let mut put = |name: &str, value: f64| {
            line.measured
                .insert(format!("{}/{name}", member.name), value);
        };
        put("reward_mean", stats.reward_mean);
        put("reward_std", stats.reward_std);
        put("turns", stats.turns as f64);
        put("generated_tokens", stats.generated_tokens as f64);
        put("completion_length_mean", stats.completion_length_mean());
        put("zero_std_groups", trained.zero_std_groups as f64);
        put("learning_rate", trained.learning_rate);
        put("weight_version", trained.response.weight_version as f64);
        put("train_seconds", trained.train_seconds);
        for (name, value) in &crate::mismatch::finish(trained.response.metrics.clone()) {
            put(name, *value);
        }
    }
    line.reward_mean = Some(mean(&agent_rewards));
    let episodes = played.returns.len();
    line.episodes = Some(episodes as u64);
    line.episode_turns_mean = Some(played.turns.len() as f64 / episodes.max(1) as f64);
    line.truncated_episodes = Some(played.truncated as u64);
    line.generate_seconds = Some(played.generate_seconds);
    line.environment_seconds = Some(played.environment_seconds);
    line.train_seconds = Some(trained.iter().map(|t| t.train_seconds).sum::<f64>());
    line
}

/// What `samples.jsonl` holds of a step: each agent's first `limit` turns.
pub(super) fn sample_lines(
    team: &Team<'_>,
    step: u64,
    played: &Played,
    trained: &[AgentStep],
    limit: usize,
) -> Vec<Value> {
    (0..team.agents.len())
        .flat_map(|agent| {
            played
                .turns
                .iter()
                .filter(move |t| t.agent == agent)
                .take(limit)
        })
        .map(|turn| {
            json!({
                "step": step,
                "episode": turn.episode,
                "agent": team.agents[turn.agent].name,
                "prompt": turn.prompt,
                "completion": turn.completion,
                "reward": played.returns[turn.episode][turn.agent],
                "advantage": trained[turn.agent].advantages[turn.episode],
                "finish_reason": turn.finish_reason,
            })
        })
        .collect()
}

struct AgentStats {
    reward_mean: f64,
    reward_std: f64,
    turns: usize,
    generated_tokens: usize,
}

impl AgentStats {
    fn of(played: &Played, agent: usize) -> Self {
        let returns: Vec<f64> = played
            .returns
            .iter()
            .zip(&played.acted)
            .filter(|(_, acted)| acted[agent])
            .map(|(r, _)| r[agent])
            .collect();
        let mine = played.turns.iter().filter(|t| t.agent == agent);
        let (turns, generated_tokens) = mine.fold((0, 0), |(n, tokens), t| {
            (n + 1, tokens + t.loss_mask.iter().filter(|&&m| m).count())
        });
        AgentStats {
            reward_mean: mean(&returns),
            reward_std: std_dev(&returns),
            turns,
            generated_tokens,
        }
    }

    fn completion_length_mean(&self) -> f64 {
        self.generated_tokens as f64 / self.turns.max(1) as f64
    }
}
