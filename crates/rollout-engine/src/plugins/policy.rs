//! The policy (model) plugin.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use rollout_net::messages::{Completion, FinishReason, GenerateRequest, GenerateResponse};

use super::{PluginError, PluginLoadError, PluginRef, Sdk};
use crate::config::{KeyPath, LoadedConfig, PluginConfig};
use crate::engine::{StepOutcome, StepPlan};
use crate::python::convert::py_to_json;
use crate::train::SnapshotFiles;

/// The cache geometry a policy reports (`rollout_sdk.KvLayout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: u64,
    pub num_kv_heads: u64,
    pub head_dim: u64,
    pub dtype_bytes: u64,
    pub max_positions: u64,
    pub available_bytes: u64,
}

impl KvLayout {
    /// Cache bytes of one token across all layers (keys and values).
    pub fn bytes_per_slot(&self) -> u64 {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes
    }
}

pub struct PolicyPlugin {
    pub(super) plugin: PluginRef,
    pub(super) sdk: Arc<Sdk>,
    /// The `rollout_sdk.distributed.GradientReducer` of the data-parallel group this
    /// trainer rank joined, if any.
    pub(super) data_parallel: std::sync::OnceLock<Py<PyAny>>,
}

impl PolicyPlugin {
    /// Loads `policy`, configured at `key` of `loaded` (`[policy]`, or an agent's).
    pub fn load(
        py: Python<'_>,
        loaded: &LoadedConfig,
        key: &KeyPath,
        policy: &PluginConfig,
        sdk: Arc<Sdk>,
    ) -> Result<Self, PluginLoadError> {
        let plugin = PluginRef::load(py, loaded, key, &policy.plugin, &policy.options, "Policy")?;
        Ok(PolicyPlugin {
            plugin,
            sdk,
            data_parallel: std::sync::OnceLock::new(),
        })
    }

    pub fn spec(&self) -> &str {
        &self.plugin.spec
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
        let sampling = &request.sampling;
        let (requests, params) = self
            .generation_args(py, request)
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        let result = self.plugin.call(py, hook, (requests, params))?;
        let groups = result.cast::<PyList>().map_err(|_| {
            self.plugin
                .bad_return(hook, "must return a list (one per request)")
        })?;
        if groups.len() != request.prompts.len() {
            return Err(self.plugin.bad_return(
                hook,
                format!(
                    "returned {} groups for {} requests",
                    groups.len(),
                    request.prompts.len()
                ),
            ));
        }
        let mut out = Vec::with_capacity(groups.len());
        for (group, prompt) in groups.iter().zip(&request.prompts) {
            let group = group.cast::<PyList>().map_err(|_| {
                self.plugin
                    .bad_return(hook, "each group must be a list of Generation")
            })?;
            if group.len() != prompt.n as usize {
                return Err(self.plugin.bad_return(
                    hook,
                    format!(
                        "returned {} completions for a request with n={}",
                        group.len(),
                        prompt.n
                    ),
                ));
            }
            let completions = group
                .iter()
                .enumerate()
                .map(|(sample, generation)| {
                    let mut completion =
                        self.completion(&generation, longest_budget(request), weight_version)?;
                    let budget = prompt
                        .max_new_tokens
                        .get(sample)
                        .copied()
                        .unwrap_or(sampling.max_new_tokens)
                        as usize;
                    if completion.token_ids.len() > budget {
                        completion.token_ids.truncate(budget);
                        completion.logprobs.truncate(budget);
                        completion.finish_reason = FinishReason::Length;
                    }
                    Ok(completion)
                })
                .collect::<Result<Vec<_>, PluginError>>()?;
            out.push(completions);
        }
        Ok(GenerateResponse {
            groups: out,
            metrics: Default::default(),
        })
    }

    fn generation_args<'py>(
        &self,
        py: Python<'py>,
        request: &GenerateRequest,
    ) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyAny>)> {
        let sampling = &request.sampling;
        let params = PyDict::new(py);
        params.set_item("max_new_tokens", longest_budget(request))?;
        params.set_item("temperature", sampling.temperature)?;
        params.set_item("top_p", sampling.top_p)?;
        params.set_item("top_k", sampling.top_k)?;
        params.set_item(
            "stop_token_ids",
            PyTuple::new(py, &sampling.stop_token_ids)?,
        )?;
        params.set_item("seed", sampling.seed)?;
        let params = self.sdk.sampling_params.bind(py).call((), Some(&params))?;
        let requests = PyList::empty(py);
        for prompt in &request.prompts {
            let fields = PyDict::new(py);
            let ids: Vec<i64> = prompt.prompt_ids.iter().map(|&t| i64::from(t)).collect();
            fields.set_item("prompt_ids", PyArray1::from_vec(py, ids))?;
            fields.set_item("n", prompt.n)?;
            requests.append(
                self.sdk
                    .generation_request
                    .bind(py)
                    .call((), Some(&fields))?,
            )?;
        }
        Ok((requests, params))
    }

    fn completion(
        &self,
        generation: &Bound<'_, PyAny>,
        max_new_tokens: u32,
        weight_version: u64,
    ) -> Result<Completion, PluginError> {
        let hook = "generate";
        let bad = |reason: &str| self.plugin.bad_return(hook, reason.to_owned());
        let token_ids = generation
            .getattr("token_ids")
            .ok()
            .and_then(|a| a.extract::<PyReadonlyArray1<i64>>().ok())
            .ok_or_else(|| bad("Generation.token_ids must be a 1-D int64 array"))?;
        let logprobs = generation
            .getattr("logprobs")
            .ok()
            .and_then(|a| a.extract::<PyReadonlyArray1<f32>>().ok())
            .ok_or_else(|| bad("Generation.logprobs must be a 1-D float32 array"))?;
        let token_ids = self.token_ids(hook, token_ids.as_array().iter().copied())?;
        let logprobs = logprobs.as_array().to_vec();
        if token_ids.len() != logprobs.len() {
            return Err(bad("Generation.token_ids and logprobs differ in length"));
        }
        if token_ids.is_empty() || token_ids.len() > max_new_tokens as usize {
            return Err(self.plugin.bad_return(
                hook,
                format!(
                    "a completion has {} tokens, outside 1..={max_new_tokens}",
                    token_ids.len()
                ),
            ));
        }
        if logprobs.iter().any(|l| !l.is_finite()) {
            return Err(bad("a generated token's logprob is NaN or infinite"));
        }
        let finish_reason = match generation
            .getattr("finish_reason")
            .and_then(|r| r.extract::<String>())
            .as_deref()
        {
            Ok("stop") => FinishReason::Stop,
            Ok("length") => FinishReason::Length,
            _ => {
                return Err(bad(
                    "Generation.finish_reason must be \"stop\" or \"length\"",
                ));
            }
        };
        Ok(Completion {
            token_ids,
            logprobs,
            finish_reason,
            weight_version,
        })
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
        let field = |name: &str| -> Result<u64, PluginError> {
            layout
                .getattr(name)
                .and_then(|v| v.extract::<u64>())
                .map_err(|_| {
                    self.plugin
                        .bad_return(hook, format!("KvLayout.{name} must be a non-negative int"))
                })
        };
        Ok(Some(KvLayout {
            num_layers: field("num_layers")?,
            num_kv_heads: field("num_kv_heads")?,
            head_dim: field("head_dim")?,
            dtype_bytes: field("dtype_bytes")?,
            max_positions: field("max_positions")?,
            available_bytes: field("available_bytes")?,
        }))
    }

    pub fn allocate_kv(&self, py: Python<'_>, num_slots: usize) -> Result<(), PluginError> {
        self.plugin.call(py, "allocate_kv", (num_slots,)).map(drop)
    }

    /// Runs one engine step. The plan's arrays move into NumPy (no copy); its bookkeeping
    /// stays for `Scheduler::apply`. Returns the outcome and the seconds inside forwards.
    pub fn engine_step(
        &self,
        py: Python<'_>,
        plan: &mut StepPlan,
    ) -> Result<(StepOutcome, f64), PluginError> {
        let hook = "engine_step";
        let step = self
            .engine_step_args(py, plan)
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        let output = self.plugin.call(py, hook, (step,))?;
        let bad = |what: &str| {
            self.plugin
                .bad_return(hook, format!("EngineStepOutput.{what}"))
        };
        let tokens = output
            .getattr("tokens")
            .ok()
            .and_then(|a| a.extract::<PyReadonlyArray2<i64>>().ok())
            .ok_or_else(|| bad("tokens must be a 2-D int64 array"))?;
        let logprobs = output
            .getattr("logprobs")
            .ok()
            .and_then(|a| a.extract::<PyReadonlyArray2<f32>>().ok())
            .ok_or_else(|| bad("logprobs must be a 2-D float32 array"))?;
        let counts = output
            .getattr("counts")
            .ok()
            .and_then(|a| a.extract::<PyReadonlyArray1<i64>>().ok())
            .ok_or_else(|| bad("counts must be a 1-D int64 array"))?;
        let forward_seconds = output
            .getattr("forward_seconds")
            .and_then(|v| v.extract::<f64>())
            .map_err(|_| bad("forward_seconds must be a float"))?;
        let outcome = StepOutcome {
            tokens: tokens.as_array().iter().copied().collect(),
            logprobs: logprobs.as_array().iter().copied().collect(),
            counts: counts.as_array().to_vec(),
        };
        Ok((outcome, forward_seconds))
    }

    fn engine_step_args<'py>(
        &self,
        py: Python<'py>,
        plan: &mut StepPlan,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (seqs, rows, k1) = (plan.num_seqs(), plan.num_rows(), plan.max_drafts + 1);
        let fields = PyDict::new(py);
        let vector = |values: &mut Vec<i64>| PyArray1::from_vec(py, std::mem::take(values));
        fields.set_item("input_ids", vector(&mut plan.input_ids))?;
        fields.set_item("positions", vector(&mut plan.positions))?;
        fields.set_item("slot_mapping", vector(&mut plan.slot_mapping))?;
        fields.set_item("query_start", vector(&mut plan.query_start))?;
        fields.set_item(
            "context_slots",
            matrix(
                py,
                std::mem::take(&mut plan.context_slots),
                seqs,
                plan.context_width,
            )?,
        )?;
        fields.set_item("context_lens", vector(&mut plan.context_lens))?;
        fields.set_item("sample_seq", vector(&mut plan.sample_seq))?;
        fields.set_item("draft_lens", vector(&mut plan.draft_lens))?;
        fields.set_item(
            "temperature",
            PyArray1::from_vec(py, std::mem::take(&mut plan.temperature)),
        )?;
        fields.set_item(
            "top_p",
            PyArray1::from_vec(py, std::mem::take(&mut plan.top_p)),
        )?;
        fields.set_item("top_k", vector(&mut plan.top_k))?;
        fields.set_item(
            "uniforms",
            PyArray1::from_vec(py, std::mem::take(&mut plan.uniforms)).reshape([rows, k1, 3])?,
        )?;
        fields.set_item("copy_from", vector(&mut plan.copy_from))?;
        fields.set_item("copy_to", vector(&mut plan.copy_to))?;
        fields.set_item("draft_with_model", plan.draft_with_model)?;
        self.sdk.engine_step.bind(py).call((), Some(&fields))
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
        self.plugin.call(py, "load", (directory,)).map(drop)
    }

    fn token_ids(
        &self,
        hook: &'static str,
        ids: impl Iterator<Item = i64>,
    ) -> Result<Vec<u32>, PluginError> {
        ids.map(|id| {
            u32::try_from(id).map_err(|_| {
                self.plugin
                    .bad_return(hook, format!("token id {id} is out of range"))
            })
        })
        .collect()
    }
}

fn longest_budget(request: &GenerateRequest) -> u32 {
    request
        .prompts
        .iter()
        .flat_map(|prompt| {
            if prompt.max_new_tokens.is_empty() {
                vec![request.sampling.max_new_tokens]
            } else {
                prompt.max_new_tokens.clone()
            }
        })
        .max()
        .unwrap_or(request.sampling.max_new_tokens)
}

pub(super) fn matrix<'py, T: numpy::Element>(
    py: Python<'py>,
    values: Vec<T>,
    rows: usize,
    width: usize,
) -> PyResult<Bound<'py, PyAny>> {
    Ok(PyArray1::from_vec(py, values)
        .reshape([rows, width])?
        .into_any())
}
