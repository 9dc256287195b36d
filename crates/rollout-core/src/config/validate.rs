//! Checks on values that parse but cannot run (a group of one, a negative temperature...).

use super::loaded::{ConfigError, LoadedConfig};
use super::location::KeyPath;
use rollout_net::messages::CorrectionMode;

impl LoadedConfig {
    /// An error at the dotted `path` (where the file set it) unless `ok`.
    pub(super) fn require(&self, ok: bool, path: &str, message: &str) -> Result<(), ConfigError> {
        if ok {
            Ok(())
        } else {
            Err(self.error_at(&KeyPath::parse_dotted(path), message))
        }
    }
}

/// Every check, section by section; the first that fails is the error.
pub fn validate(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    validate_run_and_rollout(loaded)?;
    validate_algorithm(loaded)?;
    validate_algorithm_fits(loaded)?;
    super::agents::validate_agents(loaded)?;
    validate_training(loaded)?;
    validate_cluster_membership(loaded)?;
    validate_cluster_transport(loaded)?;
    super::devices::validate_devices(loaded)?;
    validate_services(loaded)?;
    super::engine::validate_engine(loaded)?;
    validate_rewards(loaded)
}

fn validate_run_and_rollout(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    let config = &loaded.config;
    loaded.require(
        config.run.steps >= 1 || config.sft.is_some(),
        "run.steps",
        "must be at least 1 (0 is allowed for a supervised-only run with [sft])",
    )?;
    loaded.require(
        config.run.memory_limit_gb.is_finite() && config.run.memory_limit_gb >= 0.0,
        "run.memory_limit_gb",
        "must be a finite number of GB >= 0 (0: only what is detected)",
    )?;
    let rollout = &config.rollout;
    loaded.require(
        rollout.prompts_per_step >= 1,
        "rollout.prompts_per_step",
        "must be at least 1",
    )?;
    loaded.require(
        rollout.group_size >= 2,
        "rollout.group_size",
        "must be at least 2: advantages compare the completions of a group",
    )?;
    loaded.require(
        rollout.max_new_tokens >= 1,
        "rollout.max_new_tokens",
        "must be at least 1",
    )?;
    loaded.require(
        rollout.temperature.is_finite() && rollout.temperature >= 0.0,
        "rollout.temperature",
        "must be a finite number >= 0 (0 is greedy)",
    )?;
    loaded.require(
        rollout.top_p > 0.0 && rollout.top_p <= 1.0,
        "rollout.top_p",
        "must be in (0, 1]",
    )?;
    Ok(())
}

/// The update's own settings: the KL term, the optimizer, an SFT warm start, checkpoints.
fn validate_training(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    let config = &loaded.config;
    let algorithm = &config.algorithm;
    loaded.require(
        algorithm.kl_coef.is_finite() && algorithm.kl_coef >= 0.0,
        "algorithm.kl_coef",
        "must be a finite number >= 0",
    )?;
    loaded.require(
        algorithm.std_eps.is_finite() && algorithm.std_eps > 0.0,
        "algorithm.std_eps",
        "must be > 0",
    )?;
    let train = &config.train;
    loaded.require(
        train.learning_rate.is_finite() && train.learning_rate > 0.0,
        "train.learning_rate",
        "must be a finite number > 0",
    )?;
    loaded.require(
        train.micro_batch_tokens >= 1,
        "train.micro_batch_tokens",
        "must be at least 1",
    )?;
    if let Some(sft) = &config.sft {
        loaded.require(sft.batch_size >= 1, "sft.batch_size", "must be at least 1")?;
        loaded.require(
            sft.learning_rate.is_finite() && sft.learning_rate > 0.0,
            "sft.learning_rate",
            "must be a finite number > 0",
        )?;
    }
    loaded.require(
        config.checkpoint.keep >= 1,
        "checkpoint.keep",
        "must be at least 1",
    )?;
    Ok(())
}

/// How many roles a cluster has, and how long it waits for them.
fn validate_cluster_membership(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    let cluster = &loaded.config.cluster;
    loaded.require(
        cluster.workers >= 1,
        "cluster.workers",
        "must be at least 1",
    )?;
    loaded.require(
        cluster.trainers >= 1,
        "cluster.trainers",
        "must be at least 1",
    )?;
    loaded.require(
        cluster
            .min_trainers
            .is_none_or(|fewest| (1..=cluster.trainers).contains(&fewest)),
        "cluster.min_trainers",
        "must be between 1 and cluster.trainers",
    )?;
    loaded.require(
        cluster.heartbeat_seconds.is_finite() && cluster.heartbeat_seconds > 0.0,
        "cluster.heartbeat_seconds",
        "must be > 0",
    )?;
    loaded.require(
        cluster.peer_timeout_seconds.is_finite()
            && cluster.peer_timeout_seconds > 2.0 * cluster.heartbeat_seconds,
        "cluster.peer_timeout_seconds",
        "must be more than twice cluster.heartbeat_seconds",
    )?;
    loaded.require(
        cluster.join_timeout_seconds.is_finite() && cluster.join_timeout_seconds > 0.0,
        "cluster.join_timeout_seconds",
        "must be > 0",
    )?;
    loaded.require(
        cluster.lease_timeout_seconds.is_finite() && cluster.lease_timeout_seconds > 0.0,
        "cluster.lease_timeout_seconds",
        "must be > 0",
    )?;
    loaded.require(
        cluster.max_attempts >= 1,
        "cluster.max_attempts",
        "must be at least 1",
    )?;
    Ok(())
}

/// How ranks exchange weights and gradients.
fn validate_cluster_transport(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    let cluster = &loaded.config.cluster;
    loaded.require(
        cluster.weight_bucket_bytes >= 1024,
        "cluster.weight_bucket_bytes",
        "must be at least 1024",
    )?;
    loaded.require(
        cluster.powersgd_rank >= 1,
        "cluster.powersgd_rank",
        "must be at least 1",
    )?;
    loaded.require(
        cluster.powersgd_warmup_updates >= 2,
        "cluster.powersgd_warmup_updates",
        "must be at least 2 (PowerSGD's error feedback starts after two plain all-reduces)",
    )?;
    loaded.require(
        ["auto", "gloo", "nccl"].contains(&cluster.backend.as_str()),
        "cluster.backend",
        "must be \"auto\", \"gloo\" or \"nccl\"",
    )?;
    Ok(())
}

/// The metrics server and the reward sandbox.
fn validate_services(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    let config = &loaded.config;
    let listen = config.metrics.listen.as_str();
    loaded.require(
        listen.is_empty() || listen.parse::<std::net::SocketAddr>().is_ok(),
        "metrics.listen",
        "must be an address IP:PORT such as \"127.0.0.1:9400\" (empty: no metrics server)",
    )?;
    let sandbox = &config.sandbox;
    loaded.require(
        sandbox.timeout_seconds.is_finite() && sandbox.timeout_seconds > 0.0,
        "sandbox.timeout_seconds",
        "must be > 0",
    )?;
    loaded.require(
        sandbox.start_timeout_seconds.is_finite() && sandbox.start_timeout_seconds > 0.0,
        "sandbox.start_timeout_seconds",
        "must be > 0",
    )?;
    loaded.require(
        (0.0..=1.0).contains(&sandbox.max_failed_fraction),
        "sandbox.max_failed_fraction",
        "must be in [0, 1]",
    )?;
    loaded.require(
        (0.0..=1.0).contains(&sandbox.max_failed_fraction_per_step),
        "sandbox.max_failed_fraction_per_step",
        "must be in [0, 1]",
    )?;
    loaded.require(
        sandbox
            .pass_environment
            .iter()
            .all(|name| !name.is_empty() && !name.contains(['=', '\0'])),
        "sandbox.pass_environment",
        "must be names of environment variables (no `=`)",
    )?;
    Ok(())
}

/// At least one reward (or an environment) for an algorithm that samples, each weight finite
/// and each name distinct.
fn validate_rewards(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    let config = &loaded.config;
    let samples = config.algorithm.name.samples();
    if samples && config.rewards.is_empty() && config.environment.is_none() {
        return Err(loaded.error_at(
            &KeyPath::default(),
            "no reward: add a [[rewards]] table or an [environment]",
        ));
    }
    for (index, reward) in config.rewards.iter().enumerate() {
        if !reward.weight.is_finite() {
            return Err(loaded.error_at(
                &KeyPath::default().key("rewards").index(index).key("weight"),
                "must be a finite number",
            ));
        }
    }
    if let Some(environment) = &config.environment {
        loaded.require(
            environment.max_turns >= 1,
            "environment.max_turns",
            "must be at least 1",
        )?;
    }
    let mut names = std::collections::BTreeSet::new();
    for (index, reward) in config.rewards.iter().enumerate() {
        let name = super::reward_name(reward);
        if !names.insert(name.clone()) {
            return Err(loaded.error_at(
                &KeyPath::default().key("rewards").index(index),
                format!("a second reward named `{name}`: give one a different `name`"),
            ));
        }
    }
    Ok(())
}

fn validate_algorithm(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    let config = &loaded.config;
    let algorithm = &config.algorithm;
    let (clip_low, clip_high) = algorithm.clip();
    loaded.require(
        (0.0..1.0).contains(&clip_low),
        "algorithm.clip_low",
        "must be in [0, 1)",
    )?;
    loaded.require(clip_high >= 0.0, "algorithm.clip_high", "must be >= 0")?;
    loaded.require(
        algorithm.beta.is_finite() && algorithm.beta > 0.0,
        "algorithm.beta",
        "must be a finite number > 0",
    )?;
    loaded.require(
        algorithm.overlong_buffer < config.rollout.max_new_tokens,
        "algorithm.overlong_buffer",
        "must be less than rollout.max_new_tokens",
    )?;
    loaded.require(
        algorithm.overlong_penalty.is_finite() && algorithm.overlong_penalty >= 0.0,
        "algorithm.overlong_penalty",
        "must be a finite number >= 0",
    )?;
    loaded.require(algorithm.epochs >= 1, "algorithm.epochs", "must be >= 1")?;
    let unit = |x: f32| x.is_finite() && (0.0..=1.0).contains(&x);
    loaded.require(
        unit(algorithm.gamma),
        "algorithm.gamma",
        "must be in [0, 1]",
    )?;
    loaded.require(unit(algorithm.lam), "algorithm.lam", "must be in [0, 1]")?;
    loaded.require(
        algorithm.value_clip.is_finite() && algorithm.value_clip >= 0.0,
        "algorithm.value_clip",
        "must be a finite number >= 0 (0: no clipping)",
    )?;
    loaded.require(
        algorithm.value_coef.is_finite() && algorithm.value_coef > 0.0,
        "algorithm.value_coef",
        "must be a finite number > 0",
    )?;
    validate_rollout_correction(loaded)
}

fn validate_rollout_correction(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    let algorithm = &loaded.config.algorithm;
    let cap = algorithm.rollout_correction_cap;
    loaded.require(
        cap.is_finite() && cap >= 1.0,
        "algorithm.rollout_correction_cap",
        "must be a finite number >= 1",
    )?;
    let [low, high] = algorithm.rollout_correction_band;
    loaded.require(
        low.is_finite() && high.is_finite() && (0.0..=1.0).contains(&low) && high >= 1.0,
        "algorithm.rollout_correction_band",
        "must be [low, high] with 0 <= low <= 1 <= high",
    )?;
    if algorithm.rollout_correction != CorrectionMode::None {
        loaded.require(
            algorithm.name.samples(),
            "algorithm.rollout_correction",
            "corrects the generator's logprobs of a policy-gradient algorithm: not DPO or SFT",
        )?;
    }
    Ok(())
}

/// Settings that only some algorithms can use.
fn validate_algorithm_fits(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    let config = &loaded.config;
    let algorithm = &config.algorithm;
    if algorithm.dynamic_sampling_rounds > 0 {
        loaded.require(
            algorithm.name.samples() && config.environment.is_none(),
            "algorithm.dynamic_sampling_rounds",
            "refills single-turn groups of a policy-gradient algorithm: not DPO, SFT or an \
             [environment]",
        )?;
    }
    if !algorithm.name.samples() {
        loaded.require(
            algorithm.epochs == 1,
            "algorithm.epochs",
            "applies to the policy-gradient algorithms; DPO and SFT make one update per step",
        )?;
        loaded.require(
            config.environment.is_none(),
            "algorithm.name",
            "trains on the data's completions: it cannot play an [environment]",
        )?;
        loaded.require(
            config.sft.is_none(),
            "algorithm.name",
            "trains on the data's completions from the first step: drop the [sft] warm start",
        )?;
    }
    Ok(())
}
