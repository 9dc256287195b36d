//! The processes that hold no policy: the controller's plugins and the sandbox pools, and
//! the torch and transformers they import only when a plugin there loads a model or a
//! tokenizer.

use super::estimate::{
    Component, MODEL_LIBRARIES_BYTES, Phases, SANDBOX_RUNTIME_BYTES, component, count,
    frozen_weights_bytes,
};
use super::inputs::{Inputs, Role};
use super::options::{Device, Quantization};

/// The baseline of a process that holds no policy (a controller, a sandbox process).
pub(super) fn plain_runtime(bytes: u64, detail: &str) -> Component {
    component(
        "runtime",
        Device::Cpu,
        bytes as f64,
        Phases::ALL,
        detail.into(),
    )
}

/// torch and transformers, in a process that holds no policy but loads a model or a tokenizer.
fn model_libraries(detail: &str) -> Component {
    component(
        "torch and transformers",
        Device::Cpu,
        MODEL_LIBRARIES_BYTES as f64,
        Phases::ALL,
        detail.into(),
    )
}

/// The controller imports torch and transformers only for what needs them: reward models it
/// scores with itself, or a plugin it hosts with a `tokenizer` option (a chat template).
pub(super) fn controller_model_libraries(inputs: &Inputs<'_>) -> Option<Component> {
    let config = inputs.config;
    let scores_here = !config.rewards_sandboxed();
    if scores_here && !inputs.reward_models.is_empty() {
        return Some(model_libraries("for the reward models it scores with"));
    }
    let mut hosted = vec![&config.data.options];
    hosted.extend(config.data.transforms.iter().map(|t| &t.options));
    hosted.extend(config.callbacks.iter().map(|c| &c.options));
    if scores_here {
        hosted.extend(config.rewards.iter().map(|r| &r.options));
    }
    if !config.environment_sandboxed() {
        hosted.extend(config.environment.iter().map(|e| &e.options));
    }
    has_tokenizer(hosted).then(|| model_libraries("for a plugin's `tokenizer`"))
}

/// Whether a plugin of these options loads a tokenizer (and so transformers).
fn has_tokenizer<'a>(options: impl IntoIterator<Item = &'a toml::Table>) -> bool {
    options
        .into_iter()
        .any(|options| options.contains_key("tokenizer"))
}

/// Reward models load where rewards are scored: the run's (or controller's) process, or
/// each process of the reward sandbox. The sandbox's pools (one for rewards, one for the
/// environment's episodes, `[sandbox] processes` each) are processes of their own.
pub(super) fn place_sandboxes(inputs: &Inputs<'_>, roles: &mut Vec<Role>) {
    let config = inputs.config;
    let models = reward_models(inputs);
    if !config.rewards_sandboxed() {
        if let Some(first) = roles.first_mut() {
            first.components.extend(models);
        }
    } else {
        let mut components = vec![plain_runtime(
            SANDBOX_RUNTIME_BYTES,
            "Python and the reward plugins",
        )];
        if !models.is_empty() {
            components.push(model_libraries("for the reward models"));
        } else if has_tokenizer(config.rewards.iter().map(|r| &r.options)) {
            components.push(model_libraries("for a reward's `tokenizer`"));
        }
        components.extend(models);
        push_pool(roles, "sandbox", config.sandbox.processes, &components);
    }
    if config.environment_sandboxed() {
        let mut components = vec![plain_runtime(
            SANDBOX_RUNTIME_BYTES,
            "Python and the environment plugin",
        )];
        if has_tokenizer(config.environment.iter().map(|e| &e.options)) {
            components.push(model_libraries("for the environment's `tokenizer`"));
        }
        push_pool(
            roles,
            "environment sandbox",
            config.sandbox.processes,
            &components,
        );
    }
}

/// The weights of each reward model of the run.
fn reward_models(inputs: &Inputs<'_>) -> Vec<Component> {
    inputs
        .reward_models
        .iter()
        .map(|(reward, shape)| {
            let bytes = frozen_weights_bytes(&shape.parameters(), reward.dtype, Quantization::None);
            component(
                "reward model",
                reward.device,
                bytes,
                Phases::ALL,
                format!(
                    "`{}`: {} parameters",
                    reward.name,
                    count(shape.parameters().total())
                ),
            )
        })
        .collect()
}

/// `processes` sandbox processes named `<name> <index>`, each holding `components`.
fn push_pool(roles: &mut Vec<Role>, name: &str, processes: usize, components: &[Component]) {
    roles.extend((0..processes).map(|index| Role {
        name: format!("{name} {index}"),
        components: components.to_vec(),
    }));
}
