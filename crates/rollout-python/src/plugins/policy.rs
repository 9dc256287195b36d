//! The policy (model) plugin.

use std::collections::BTreeMap;
use std::path::Path;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use rollout_core::cluster::in_place::ServedInPlace;
use rollout_core::config::{KeyPath, LoadedConfig, PluginConfig};
use rollout_core::scheduler::{StepOutput, StepPlan};
use rollout_core::train::SnapshotFiles;
use rollout_net::messages::{GenerateRequest, GenerateResponse};

use super::generation::{Generations, generation_args};
use super::{PluginError, PluginLoadError, PluginRef};
use crate::contract::{
    self, EngineStep, EngineStepOutput, KvLayout, SamplingParams, py_to_json, to_python,
};

pub struct PolicyPlugin {
    pub(super) plugin: PluginRef,
    /// How many token ids the model takes: every id it is given or gives is checked.
    pub(super) vocabulary: u64,
    /// The `rollout_sdk.distributed.GradientReducer` of the data-parallel group this
    /// trainer rank joined, if any.
    pub(super) data_parallel: std::sync::OnceLock<Py<PyAny>>,
    /// The version served from the weights in place, until they next change.
    pub(super) served_in_place: std::sync::Mutex<Option<ServedInPlace>>,
}

impl PolicyPlugin {
    /// Loads `policy`, configured at `key` of `loaded` (`[policy]`, or an agent's).
    pub fn load(
        py: Python<'_>,
        loaded: &LoadedConfig,
        key: &KeyPath,
        policy: &PluginConfig,
    ) -> Result<Self, PluginLoadError> {
        let plugin = PluginRef::load(py, loaded, key, &policy.plugin, &policy.options, "Policy")?;
        let vocabulary = vocabulary_of(py, &plugin, policy)?;
        Ok(PolicyPlugin {
            plugin,
            vocabulary,
            data_parallel: std::sync::OnceLock::new(),
            served_in_place: std::sync::Mutex::new(None),
        })
    }

    pub fn spec(&self) -> &str {
        &self.plugin.spec
    }

    /// How many token ids the model takes (ids `0..vocabulary`): from its
    /// `vocabulary_size` hook, else its `model_path`'s `config.json`.
    pub fn vocabulary(&self) -> u64 {
        self.vocabulary
    }

    /// Tokenises prompts, or with `continuation` text appended to an existing context.
    pub fn encode(
        &self,
        py: Python<'_>,
        texts: &[String],
        continuation: bool,
    ) -> Result<Vec<Vec<u32>>, PluginError> {
        let hook = "encode";
        let kwargs = PyDict::new(py);
        kwargs
            .set_item("continuation", continuation)
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        let result = self
            .plugin
            .object
            .bind(py)
            .call_method(hook, (texts.to_vec(),), Some(&kwargs))
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        let ids: Vec<Vec<i64>> = result.extract().map_err(|_| {
            self.plugin
                .bad_return(hook, "must return a list of lists of int")
        })?;
        if ids.len() != texts.len() {
            return Err(self.plugin.bad_return(
                hook,
                format!("returned {} sequences for {} texts", ids.len(), texts.len()),
            ));
        }
        ids.into_iter()
            .map(|seq| self.token_ids(hook, seq.into_iter()))
            .collect()
    }

    pub fn decode(&self, py: Python<'_>, sequences: &[&[u32]]) -> Result<Vec<String>, PluginError> {
        let hook = "decode";
        let lists: Vec<Vec<u32>> = sequences.iter().map(|s| s.to_vec()).collect();
        let texts: Vec<String> = self
            .plugin
            .call(py, hook, (lists,))?
            .extract()
            .map_err(|_| self.plugin.bad_return(hook, "must return a list of str"))?;
        if texts.len() != sequences.len() {
            return Err(self.plugin.bad_return(
                hook,
                format!(
                    "returned {} texts for {} sequences",
                    texts.len(),
                    sequences.len()
                ),
            ));
        }
        Ok(texts)
    }

    pub fn eos_token_ids(&self, py: Python<'_>) -> Result<Vec<u32>, PluginError> {
        let hook = "eos_token_ids";
        let ids: Vec<i64> = self
            .plugin
            .call(py, hook, ())?
            .extract()
            .map_err(|_| self.plugin.bad_return(hook, "must return a list of int"))?;
        self.token_ids(hook, ids.into_iter())
    }

    pub fn describe(&self, py: Python<'_>) -> Result<serde_json::Value, PluginError> {
        let hook = "describe";
        let result = self.plugin.call(py, hook, ())?;
        let dict = PyDict::new(py);
        dict.update(
            result
                .cast::<pyo3::types::PyMapping>()
                .map_err(|_| self.plugin.bad_return(hook, "must return a mapping"))?,
        )
        .map_err(|err| self.plugin.raised(py, hook, &err))?;
        py_to_json(py, dict.as_any()).map_err(|err| self.plugin.raised(py, hook, &err))
    }

    /// Samples every prompt's completions and tags them with `weight_version`.
    pub fn generate(
        &self,
        py: Python<'_>,
        request: &GenerateRequest,
        weight_version: u64,
    ) -> Result<GenerateResponse, PluginError> {
        let hook = "generate";
        let (requests, params) = generation_args(py, request, SamplingParams::of(request))
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        let result = self.plugin.call(py, hook, (requests, params))?;
        self.generations().read(&result, request, weight_version)
    }

    /// Reads a `generate` hook's result against this policy's vocabulary.
    pub(super) fn generations_of<'a>(&self, plugin: &'a PluginRef) -> Generations<'a> {
        Generations {
            plugin,
            vocabulary: self.vocabulary,
        }
    }

    fn generations(&self) -> Generations<'_> {
        self.generations_of(&self.plugin)
    }

    pub(super) fn float_metrics(
        &self,
        hook: &'static str,
        value: &Bound<'_, PyAny>,
    ) -> Result<BTreeMap<String, f64>, PluginError> {
        value.extract::<BTreeMap<String, f64>>().map_err(|_| {
            self.plugin
                .bad_return(hook, "must return a mapping of str to float")
        })
    }

    /// The policy's KV-cache geometry, or `None` when it cannot run in the sampling engine
    /// (its `kv_layout` raises `NotImplementedError`).
    pub fn kv_layout(&self, py: Python<'_>) -> Result<Option<KvLayout>, PluginError> {
        let hook = "kv_layout";
        let layout = match self.plugin.object.bind(py).call_method0(hook) {
            Ok(layout) => layout,
            Err(err) if err.is_instance_of::<pyo3::exceptions::PyNotImplementedError>(py) => {
                return Ok(None);
            }
            Err(err) => return Err(self.plugin.raised(py, hook, &err)),
        };
        contract::from_python(&layout)
            .map(Some)
            .map_err(|reason| self.plugin.bad_return(hook, reason))
    }

    pub fn allocate_kv(&self, py: Python<'_>, num_slots: usize) -> Result<(), PluginError> {
        self.plugin.call(py, "allocate_kv", (num_slots,)).map(drop)
    }

    /// Runs one engine step. The plan's arrays move into NumPy (no copy); its bookkeeping
    /// stays for `Scheduler::apply`. Returns the output and the seconds inside forwards.
    pub fn engine_step(
        &self,
        py: Python<'_>,
        plan: &mut StepPlan,
    ) -> Result<(StepOutput, f64), PluginError> {
        let hook = "engine_step";
        let step = to_python(py, EngineStep::take(plan))
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        let output = self.plugin.call(py, hook, (step,))?;
        let output: EngineStepOutput = contract::from_python(&output)
            .map_err(|reason| self.plugin.bad_return(hook, reason))?;
        let forward_seconds = output.forward_seconds;
        Ok((output.into(), forward_seconds))
    }

    pub fn save(&self, py: Python<'_>, directory: &Path) -> Result<(), PluginError> {
        self.plugin.call(py, "save", (directory,)).map(drop)
    }

    /// The files `save` would write, copied now, or `None` when the policy cannot
    /// snapshot (its `snapshot` raises `NotImplementedError`).
    pub fn snapshot(&self, py: Python<'_>) -> Result<Option<SnapshotFiles>, PluginError> {
        let hook = "snapshot";
        match self.plugin.object.bind(py).call_method0(hook) {
            Ok(files) => super::snapshot::copy_files(&files)
                .map(Some)
                .map_err(|reason| self.plugin.bad_return(hook, reason)),
            Err(err) if err.is_instance_of::<pyo3::exceptions::PyNotImplementedError>(py) => {
                Ok(None)
            }
            Err(err) => Err(self.plugin.raised(py, hook, &err)),
        }
    }

    pub fn load_state(&self, py: Python<'_>, directory: &Path) -> Result<(), PluginError> {
        self.settle_served_version(py);
        self.plugin.call(py, "load", (directory,)).map(drop)
    }

    /// `ids` as token ids, each inside the vocabulary.
    fn token_ids(
        &self,
        hook: &'static str,
        ids: impl Iterator<Item = i64>,
    ) -> Result<Vec<u32>, PluginError> {
        self.generations().token_ids(hook, ids)
    }
}

/// The vocabulary size of the loaded `plugin`: its `vocabulary_size()`, else `vocab_size`
/// in the `config.json` under its `model_path` option. A policy with neither is refused:
/// token ids could not be checked before they reach the model.
fn vocabulary_of(
    py: Python<'_>,
    plugin: &PluginRef,
    policy: &PluginConfig,
) -> Result<u64, PluginLoadError> {
    let hook = "vocabulary_size";
    match plugin.object.bind(py).call_method0(hook) {
        Ok(size) => {
            return match size.extract::<u64>() {
                Ok(size) if size > 0 => Ok(size),
                _ => Err(plugin.bad_return(hook, "must return a positive int").into()),
            };
        }
        Err(err) if err.is_instance_of::<pyo3::exceptions::PyNotImplementedError>(py) => {}
        Err(err) => return Err(plugin.raised(py, hook, &err).into()),
    }
    let model_path = policy.options.get("model_path").and_then(|v| v.as_str());
    let from_config = model_path.and_then(|path| {
        rollout_core::plan::ModelShape::read(Path::new(path))
            .ok()
            .map(|shape| shape.vocab_size)
    });
    from_config.filter(|&size| size > 0).ok_or_else(|| {
        plugin
            .bad_return(
                hook,
                "the policy's vocabulary size is unknown: implement `vocabulary_size()` \
                 (rollout_sdk.Policy), or give it a `model_path` option whose config.json \
                 has `vocab_size`. Every token id is checked against it before the model \
                 sees it, so the run cannot start without it",
            )
            .into()
    })
}
