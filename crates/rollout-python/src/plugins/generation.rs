//! What a `generate` hook (a policy's or a generation engine's) is given and returns: the
//! prompts and sampling parameters in, every prompt's completions out, checked against the
//! contract and the policy's vocabulary before the engine keeps any of them.

use pyo3::prelude::*;
use pyo3::types::PyList;
use rollout_net::messages::{
    Completion, FinishReason, GenerateRequest, GenerateResponse, PromptRequest,
};

use super::{PluginError, PluginRef};
use crate::contract::{self, Generation, GenerationRequest, SamplingParams, to_python};

/// The arguments of a `generate` hook: one `GenerationRequest` per prompt, and `params`.
pub(super) fn generation_args<'py>(
    py: Python<'py>,
    request: &GenerateRequest,
    params: SamplingParams,
) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyAny>)> {
    let params = to_python(py, params)?;
    let requests = PyList::empty(py);
    for prompt in &request.prompts {
        requests.append(to_python(py, GenerationRequest::from(prompt))?)?;
    }
    Ok((requests, params))
}

/// Reads the result of `plugin`'s `generate` hook; every token id must be below `vocabulary`.
pub(super) struct Generations<'a> {
    pub plugin: &'a PluginRef,
    pub vocabulary: u64,
}

impl Generations<'_> {
    const HOOK: &'static str = "generate";

    /// Every prompt's completions, tagged with `weight_version`.
    pub fn read(
        &self,
        result: &Bound<'_, PyAny>,
        request: &GenerateRequest,
        weight_version: u64,
    ) -> Result<GenerateResponse, PluginError> {
        let groups = result.cast::<PyList>().map_err(|_| {
            self.plugin
                .bad_return(Self::HOOK, "must return a list (one per request)")
        })?;
        if groups.len() != request.prompts.len() {
            return Err(self.plugin.bad_return(
                Self::HOOK,
                format!(
                    "returned {} groups for {} requests",
                    groups.len(),
                    request.prompts.len()
                ),
            ));
        }
        let mut out = Vec::with_capacity(groups.len());
        for (group, prompt) in groups.iter().zip(&request.prompts) {
            out.push(self.group_completions(&group, prompt, request, weight_version)?);
        }
        Ok(GenerateResponse {
            groups: out,
            metrics: Default::default(),
            producers: Vec::new(),
        })
    }

    /// One prompt's list of `Generation`s, each cut to its sample's token budget.
    fn group_completions(
        &self,
        group: &Bound<'_, PyAny>,
        prompt: &PromptRequest,
        request: &GenerateRequest,
        weight_version: u64,
    ) -> Result<Vec<Completion>, PluginError> {
        let group = group.cast::<PyList>().map_err(|_| {
            self.plugin
                .bad_return(Self::HOOK, "each group must be a list of Generation")
        })?;
        if group.len() != prompt.n as usize {
            return Err(self.plugin.bad_return(
                Self::HOOK,
                format!(
                    "returned {} completions for a request with n={}",
                    group.len(),
                    prompt.n
                ),
            ));
        }
        group
            .iter()
            .enumerate()
            .map(|(sample, generation)| {
                let mut completion =
                    self.completion(&generation, request.longest_budget(), weight_version)?;
                let budget = prompt
                    .max_new_tokens
                    .get(sample)
                    .copied()
                    .unwrap_or(request.sampling.max_new_tokens)
                    as usize;
                if completion.token_ids.len() > budget {
                    completion.token_ids.truncate(budget);
                    completion.logprobs.truncate(budget);
                    completion.finish_reason = FinishReason::Length;
                }
                Ok(completion)
            })
            .collect()
    }

    fn completion(
        &self,
        generation: &Bound<'_, PyAny>,
        max_new_tokens: u32,
        weight_version: u64,
    ) -> Result<Completion, PluginError> {
        let bad = |reason: &str| self.plugin.bad_return(Self::HOOK, reason.to_owned());
        let generation: Generation =
            contract::from_python(generation).map_err(|reason| bad(&reason))?;
        let token_ids = self.token_ids(Self::HOOK, generation.token_ids.data.into_iter())?;
        let logprobs = generation.logprobs.data;
        if token_ids.len() != logprobs.len() {
            return Err(bad("Generation.token_ids and logprobs differ in length"));
        }
        if token_ids.is_empty() || token_ids.len() > max_new_tokens as usize {
            return Err(self.plugin.bad_return(
                Self::HOOK,
                format!(
                    "a completion has {} tokens, outside 1..={max_new_tokens}",
                    token_ids.len()
                ),
            ));
        }
        if logprobs.iter().any(|l| !l.is_finite()) {
            return Err(bad("a generated token's logprob is NaN or infinite"));
        }
        let finish_reason = match generation.finish_reason.as_str() {
            "stop" => FinishReason::Stop,
            "length" => FinishReason::Length,
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

    /// `ids` as token ids, each inside the vocabulary.
    pub fn token_ids(
        &self,
        hook: &'static str,
        ids: impl Iterator<Item = i64>,
    ) -> Result<Vec<u32>, PluginError> {
        ids.map(|id| {
            u32::try_from(id)
                .ok()
                .filter(|&id| u64::from(id) < self.vocabulary)
                .ok_or_else(|| {
                    self.plugin.bad_return(
                        hook,
                        format!(
                            "token id {id} is outside the policy's vocabulary of {}",
                            self.vocabulary
                        ),
                    )
                })
        })
        .collect()
    }
}
