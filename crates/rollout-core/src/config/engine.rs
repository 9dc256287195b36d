//! Checks on `[engine]` that involve other sections: a generation backend other than
//! Rollout's engine samples with its own copy of the whole weights.

use super::algorithm::Algorithm;
use super::loaded::{ConfigError, LoadedConfig};
use super::schema::{EngineBackend, SpeculationMethod};

/// A vLLM backend samples with its own copy of the weights: it needs them whole (no LoRA
/// adapters) and does its own scheduling (no speculation of Rollout's engine).
pub(super) fn validate_engine(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    let config = &loaded.config;
    let engine = &config.engine;
    if engine.backend == EngineBackend::Rollout {
        return Ok(());
    }
    loaded.require(
        engine.enabled,
        "engine.enabled",
        "must be true with `backend = \"vllm\"` (false samples with the policy's own `generate`)",
    )?;
    loaded.require(
        engine.speculation.method == SpeculationMethod::Off,
        "engine.speculation.method",
        "is Rollout's engine's; with `backend = \"vllm\"` pass vLLM's `speculative_config` in \
         `[engine.vllm] engine_args`",
    )?;
    loaded.require(
        !config.multi_agent(),
        "engine.backend",
        "multi-agent runs sample with Rollout's engine only (each agent's policy is its own model)",
    )?;
    loaded.require(
        config.algorithm.name != Algorithm::Ppo,
        "algorithm.name",
        "PPO cannot sample with vLLM yet: its value head is part of the weights a version \
         carries and vLLM's model has no place for it (docs/vllm.md)",
    )?;
    let lora_rank = config.policy.options.get("lora_rank");
    loaded.require(
        lora_rank.and_then(toml::Value::as_integer).unwrap_or(0) == 0,
        "policy.options.lora_rank",
        "LoRA runs cannot sample with vLLM yet: its weights would be the adapters only \
         (docs/vllm.md); use `backend = \"rollout\"`",
    )?;
    let has_model = engine.vllm.contains_key("model")
        || config
            .policy
            .options
            .get("model_path")
            .is_some_and(toml::Value::is_str);
    loaded.require(
        has_model,
        "engine.vllm",
        "needs `model`, the Hugging Face directory vLLM loads (the policy has no `model_path`)",
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::path::Path;

    use crate::config::load_text;

    const BASE: &str = "[policy]\nplugin = \"p:P\"\noptions = { model_path = \"m\" }\n\
                        [data]\nplugin = \"d:D\"\n[[rewards]]\nplugin = \"r:R\"\n";

    fn check(extra: &str) -> Result<(), String> {
        load_text(Path::new("run.toml"), format!("{BASE}{extra}"), &[])
            .map(drop)
            .map_err(|err| err.to_string())
    }

    #[test]
    fn a_vllm_backend_takes_its_options_and_the_policys_model() {
        assert_eq!(check("[engine]\nbackend = \"vllm\"\n"), Ok(()));
        assert_eq!(
            check("[engine]\nbackend = \"vllm\"\nvllm = { dtype = \"float32\" }\n"),
            Ok(())
        );
        let err = check("[engine]\nbackend = \"vlm\"\n").unwrap_err();
        assert!(err.starts_with("run.toml:9:11"), "{err}");
        assert!(err.contains("did you mean `vllm`?"), "{err}");
    }

    #[test]
    fn what_a_vllm_backend_cannot_do_is_refused_where_it_is_set() {
        let err = check("[engine]\nbackend = \"vllm\"\nenabled = false\n").unwrap_err();
        assert!(err.starts_with("run.toml:10:1"), "{err}");
        let err = check("[engine]\nbackend = \"vllm\"\nspeculation = { method = \"ngram\" }\n")
            .unwrap_err();
        assert!(err.starts_with("run.toml:10:"), "{err}");
        assert!(err.contains("speculative_config"), "{err}");
        let lora = BASE.replace("model_path = \"m\"", "model_path = \"m\", lora_rank = 8");
        let err = load_text(
            Path::new("run.toml"),
            format!("{lora}[engine]\nbackend = \"vllm\"\n"),
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(err.starts_with("run.toml:3:"), "{err}");
        assert!(err.contains("LoRA"), "{err}");
        let err = check("[algorithm]\nname = \"ppo\"\n[engine]\nbackend = \"vllm\"\n").unwrap_err();
        assert!(err.starts_with("run.toml:9:"), "{err}");
        let anonymous = BASE.replace("options = { model_path = \"m\" }\n", "");
        let err = load_text(
            Path::new("run.toml"),
            format!("{anonymous}[engine]\nbackend = \"vllm\"\n"),
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("needs `model`"), "{err}");
    }
}
