//! A generation engine plugin (`rollout_sdk.GenerationEngine`): a backend such as vLLM that
//! samples for the policy with a copy of its weights (`[engine] backend`).

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use rollout_core::config::{KeyPath, LoadedConfig};
use rollout_net::TensorBytes;
use rollout_net::messages::{GenerateRequest, GenerateResponse};

use super::generation::generation_args;
use super::policy::PolicyPlugin;
use super::weight_import::streamed_weights;
use super::{PluginError, PluginLoadError, PluginRef};
use crate::contract::SamplingParams;

pub struct GenerationEnginePlugin {
    plugin: PluginRef,
}

impl GenerationEnginePlugin {
    /// Loads the engine `spec` with the options of `[engine.vllm]`; without a `model`
    /// option, vLLM loads the policy's `model_path`.
    pub fn load(
        py: Python<'_>,
        loaded: &LoadedConfig,
        spec: &str,
    ) -> Result<Self, PluginLoadError> {
        let config = &loaded.config;
        let mut options = config.engine.vllm.clone();
        if !options.contains_key("model")
            && let Some(model_path) = config.policy.options.get("model_path")
        {
            options.insert("model".into(), model_path.clone());
        }
        let key = KeyPath::default().key("engine");
        let options_key = key.clone().key("vllm");
        let plugin = PluginRef::load_options_at(
            py,
            loaded,
            &key,
            &options_key,
            spec,
            &options,
            "GenerationEngine",
        )?;
        Ok(GenerationEnginePlugin { plugin })
    }

    /// Samples every prompt's completions, stopping at `eos_token_ids` unless the request
    /// ignores them; read as the policy's own `generate` would be.
    pub fn generate(
        &self,
        py: Python<'_>,
        policy: &PolicyPlugin,
        request: &GenerateRequest,
        eos_token_ids: &[u32],
        weight_version: u64,
    ) -> Result<GenerateResponse, PluginError> {
        let hook = "generate";
        let sampling = &request.sampling;
        let mut params = SamplingParams::of(request);
        if !sampling.ignore_eos {
            params.stop_token_ids.0.extend_from_slice(eos_token_ids);
        }
        let (requests, params) = generation_args(py, request, params)
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        let stop_strings = PyList::new(py, &sampling.stop_strings)
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        let result = self.plugin.call(
            py,
            hook,
            (requests, params, stop_strings, sampling.ignore_eos),
        )?;
        policy
            .generations_of(&self.plugin)
            .read(&result, request, weight_version)
    }

    /// Replaces the engine's weights with a received (and verified) version.
    pub fn load_received(
        &self,
        py: Python<'_>,
        tensors: Vec<TensorBytes>,
    ) -> Result<(), PluginError> {
        let hook = "load_weights";
        let weights =
            streamed_weights(py, tensors).map_err(|err| self.plugin.raised(py, hook, &err))?;
        self.plugin.call(py, hook, (weights,)).map(drop)
    }

    /// Replaces the engine's weights with the policy's current ones (one process: the
    /// learner's `weight_views`, no copy on the way).
    pub fn load_from_policy(
        &self,
        py: Python<'_>,
        policy: &PolicyPlugin,
    ) -> Result<(), PluginError> {
        let hook = "load_weights";
        let (_, views) = policy.weight_views(py)?;
        let weights = (|| -> PyResult<Bound<'_, PyAny>> {
            let pairs = match views.cast::<PyDict>() {
                Ok(dict) => dict.items().into_any(),
                Err(_) => views.clone(),
            };
            py.import("rollout_sdk.weights")?
                .call_method1("StreamedWeights", (pairs.try_iter()?,))
        })()
        .map_err(|err| self.plugin.raised(py, hook, &err))?;
        self.plugin.call(py, hook, (weights,)).map(drop)
    }

    pub fn release_memory(&self, py: Python<'_>) -> Result<(), PluginError> {
        self.plugin.call(py, "release_memory", ()).map(drop)
    }

    pub fn restore_memory(&self, py: Python<'_>) -> Result<(), PluginError> {
        self.plugin.call(py, "restore_memory", ()).map(drop)
    }
}
