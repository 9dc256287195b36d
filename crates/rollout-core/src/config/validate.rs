//! Checks on values that parse but cannot run (a group of one, a negative temperature...).

use super::loaded::{ConfigError, LoadedConfig};
use super::location::KeyPath;

pub fn validate(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    let config = &loaded.config;
    let at = |path: &str| KeyPath::parse_dotted(path);
    let check = |ok: bool, path: &str, message: &str| {
        if ok {
            Ok(())
        } else {
            Err(loaded.error_at(&at(path), message))
        }
    };
    check(
        config.run.steps >= 1 || config.sft.is_some(),
        "run.steps",
        "must be at least 1 (0 is allowed for a supervised-only run with [sft])",
    )?;
    check(
        config.run.memory_limit_gb.is_finite() && config.run.memory_limit_gb >= 0.0,
        "run.memory_limit_gb",
        "must be a finite number of GB >= 0 (0: only what is detected)",
    )?;
    let rollout = &config.rollout;
    check(
        rollout.prompts_per_step >= 1,
        "rollout.prompts_per_step",
        "must be at least 1",
    )?;
    check(
        rollout.group_size >= 2,
        "rollout.group_size",
        "must be at least 2: advantages compare the completions of a group",
    )?;
    check(
        rollout.max_new_tokens >= 1,
        "rollout.max_new_tokens",
        "must be at least 1",
    )?;
    check(
        rollout.temperature.is_finite() && rollout.temperature >= 0.0,
        "rollout.temperature",
        "must be a finite number >= 0 (0 is greedy)",
    )?;
    check(
        rollout.top_p > 0.0 && rollout.top_p <= 1.0,
        "rollout.top_p",
        "must be in (0, 1]",
    )?;
    validate_algorithm(loaded)?;
    super::agents::validate_agents(loaded)?;
    let algorithm = &config.algorithm;
    check(
        algorithm.kl_coef.is_finite() && algorithm.kl_coef >= 0.0,
        "algorithm.kl_coef",
        "must be a finite number >= 0",
    )?;
    check(
        algorithm.std_eps.is_finite() && algorithm.std_eps > 0.0,
        "algorithm.std_eps",
        "must be > 0",
    )?;
    let train = &config.train;
    check(
        train.learning_rate.is_finite() && train.learning_rate > 0.0,
        "train.learning_rate",
        "must be a finite number > 0",
    )?;
    check(
        train.micro_batch_tokens >= 1,
        "train.micro_batch_tokens",
        "must be at least 1",
    )?;
    if let Some(sft) = &config.sft {
        check(sft.batch_size >= 1, "sft.batch_size", "must be at least 1")?;
        check(
            sft.learning_rate.is_finite() && sft.learning_rate > 0.0,
            "sft.learning_rate",
            "must be a finite number > 0",
        )?;
    }
    check(
        config.checkpoint.keep >= 1,
        "checkpoint.keep",
        "must be at least 1",
    )?;
    let cluster = &config.cluster;
    check(
        cluster.workers >= 1,
        "cluster.workers",
        "must be at least 1",
    )?;
    check(
        cluster.trainers >= 1,
        "cluster.trainers",
        "must be at least 1",
    )?;
    check(
        cluster
            .min_trainers
            .is_none_or(|fewest| (1..=cluster.trainers).contains(&fewest)),
        "cluster.min_trainers",
        "must be between 1 and cluster.trainers",
    )?;
    check(
        cluster.heartbeat_seconds.is_finite() && cluster.heartbeat_seconds > 0.0,
        "cluster.heartbeat_seconds",
        "must be > 0",
    )?;
    check(
        cluster.peer_timeout_seconds.is_finite()
            && cluster.peer_timeout_seconds > 2.0 * cluster.heartbeat_seconds,
        "cluster.peer_timeout_seconds",
        "must be more than twice cluster.heartbeat_seconds",
    )?;
    check(
        cluster.join_timeout_seconds.is_finite() && cluster.join_timeout_seconds > 0.0,
        "cluster.join_timeout_seconds",
        "must be > 0",
    )?;
    check(
        cluster.lease_timeout_seconds.is_finite() && cluster.lease_timeout_seconds > 0.0,
        "cluster.lease_timeout_seconds",
        "must be > 0",
    )?;
    check(
        cluster.max_attempts >= 1,
        "cluster.max_attempts",
        "must be at least 1",
    )?;
    check(
        cluster.weight_bucket_bytes >= 1024,
        "cluster.weight_bucket_bytes",
        "must be at least 1024",
    )?;
    check(
        cluster.powersgd_rank >= 1,
        "cluster.powersgd_rank",
        "must be at least 1",
    )?;
    check(
        cluster.powersgd_warmup_updates >= 2,
        "cluster.powersgd_warmup_updates",
        "must be at least 2 (PowerSGD's error feedback starts after two plain all-reduces)",
    )?;
    check(
        ["auto", "gloo", "nccl"].contains(&cluster.backend.as_str()),
        "cluster.backend",
        "must be \"auto\", \"gloo\" or \"nccl\"",
    )?;
    super::devices::validate_devices(loaded)?;
    let listen = config.metrics.listen.as_str();
    check(
        listen.is_empty() || listen.parse::<std::net::SocketAddr>().is_ok(),
        "metrics.listen",
        "must be an address IP:PORT such as \"127.0.0.1:9400\" (empty: no metrics server)",
    )?;
    let sandbox = &config.sandbox;
    check(
        sandbox.timeout_seconds.is_finite() && sandbox.timeout_seconds > 0.0,
        "sandbox.timeout_seconds",
        "must be > 0",
    )?;
    check(
        sandbox.start_timeout_seconds.is_finite() && sandbox.start_timeout_seconds > 0.0,
        "sandbox.start_timeout_seconds",
        "must be > 0",
    )?;
    check(
        (0.0..=1.0).contains(&sandbox.max_failed_fraction),
        "sandbox.max_failed_fraction",
        "must be in [0, 1]",
    )?;
    check(
        (0.0..=1.0).contains(&sandbox.max_failed_fraction_per_step),
        "sandbox.max_failed_fraction_per_step",
        "must be in [0, 1]",
    )?;
    check(
        sandbox
            .pass_environment
            .iter()
            .all(|name| !name.is_empty() && !name.contains(['=', '\0'])),
        "sandbox.pass_environment",
        "must be names of environment variables (no `=`)",
    )?;
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
        check(
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
    let check = |ok: bool, path: &str, message: &str| {
        if ok {
            Ok(())
        } else {
            Err(loaded.error_at(&KeyPath::parse_dotted(path), message))
        }
    };
    let algorithm = &config.algorithm;
    let (clip_low, clip_high) = algorithm.clip();
    check(
        (0.0..1.0).contains(&clip_low),
        "algorithm.clip_low",
        "must be in [0, 1)",
    )?;
    check(clip_high >= 0.0, "algorithm.clip_high", "must be >= 0")?;
    check(
        algorithm.beta.is_finite() && algorithm.beta > 0.0,
        "algorithm.beta",
        "must be a finite number > 0",
    )?;
    check(
        algorithm.overlong_buffer < config.rollout.max_new_tokens,
        "algorithm.overlong_buffer",
        "must be less than rollout.max_new_tokens",
    )?;
    check(
        algorithm.overlong_penalty.is_finite() && algorithm.overlong_penalty >= 0.0,
        "algorithm.overlong_penalty",
        "must be a finite number >= 0",
    )?;
    check(algorithm.epochs >= 1, "algorithm.epochs", "must be >= 1")?;
    let unit = |x: f32| x.is_finite() && (0.0..=1.0).contains(&x);
    check(
        unit(algorithm.gamma),
        "algorithm.gamma",
        "must be in [0, 1]",
    )?;
    check(unit(algorithm.lam), "algorithm.lam", "must be in [0, 1]")?;
    check(
        algorithm.value_clip.is_finite() && algorithm.value_clip >= 0.0,
        "algorithm.value_clip",
        "must be a finite number >= 0 (0: no clipping)",
    )?;
    check(
        algorithm.value_coef.is_finite() && algorithm.value_coef > 0.0,
        "algorithm.value_coef",
        "must be a finite number > 0",
    )?;
    if algorithm.dynamic_sampling_rounds > 0 {
        check(
            algorithm.name.samples() && config.environment.is_none(),
            "algorithm.dynamic_sampling_rounds",
            "refills single-turn groups of a policy-gradient algorithm: not DPO, SFT or an \
             [environment]",
        )?;
    }
    if !algorithm.name.samples() {
        check(
            algorithm.epochs == 1,
            "algorithm.epochs",
            "applies to the policy-gradient algorithms; DPO and SFT make one update per step",
        )?;
        check(
            config.environment.is_none(),
            "algorithm.name",
            "trains on the data's completions: it cannot play an [environment]",
        )?;
        check(
            config.sft.is_none(),
            "algorithm.name",
            "trains on the data's completions from the first step: drop the [sft] warm start",
        )?;
    }
    Ok(())
}
