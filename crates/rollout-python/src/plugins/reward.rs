//! Reward plugins and their weighted combination.

use pyo3::prelude::*;
use pyo3::types::PyList;
use rollout_core::config::{KeyPath, LoadedConfig, reward_name};
use rollout_net::messages::{RewardComponent, ScoreRequest, ScoreResponse};

use super::{PluginError, PluginLoadError, PluginRef};
use crate::contract::{Sample, to_python};

struct WeightedReward {
    name: String,
    weight: f64,
    /// The scores it declares (`Reward.score_range`): every score is clamped into it.
    range: (f64, f64),
    plugin: PluginRef,
}

/// Every configured reward; a sample's total is the weighted sum of their scores.
pub struct RewardSet {
    rewards: Vec<WeightedReward>,
}

impl RewardSet {
    pub fn load(py: Python<'_>, loaded: &LoadedConfig) -> Result<Self, PluginLoadError> {
        let rewards = loaded
            .config
            .rewards
            .iter()
            .enumerate()
            .map(|(index, reward)| {
                let key = KeyPath::default().key("rewards").index(index);
                let plugin =
                    PluginRef::load(py, loaded, &key, &reward.plugin, &reward.options, "Reward")?;
                let range = score_range(py, &plugin)?;
                Ok(WeightedReward {
                    name: reward_name(reward),
                    weight: reward.weight,
                    range,
                    plugin,
                })
            })
            .collect::<Result<Vec<_>, PluginLoadError>>()?;
        Ok(RewardSet { rewards })
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.rewards.iter().map(|r| r.name.as_str())
    }

    /// Scores every sample with every reward; rejects a wrong count or a non-finite score.
    pub fn score(
        &self,
        py: Python<'_>,
        request: &ScoreRequest,
    ) -> Result<ScoreResponse, PluginError> {
        let count = request.samples.len();
        let mut totals = vec![0.0; count];
        let mut components = Vec::with_capacity(self.rewards.len());
        if self.rewards.is_empty() {
            return Ok(ScoreResponse {
                totals,
                components,
                failed: Vec::new(),
            });
        }
        let samples = samples(py, request).map_err(|err| {
            // Building `Sample`s only fails if the SDK itself is broken; blame the first reward.
            self.rewards[0].plugin.raised(py, "score", &err)
        })?;
        for reward in &self.rewards {
            let hook = "score";
            let result = reward.plugin.call(py, hook, (samples.clone(),))?;
            let scores: Vec<f64> = result.extract().map_err(|_| {
                reward
                    .plugin
                    .bad_return(hook, "must return a sequence of float")
            })?;
            if scores.len() != count {
                return Err(reward.plugin.bad_return(
                    hook,
                    format!("returned {} scores for {count} samples", scores.len()),
                ));
            }
            if let Some((index, bad)) = scores.iter().enumerate().find(|(_, s)| !s.is_finite()) {
                return Err(reward.plugin.bad_return(
                    hook,
                    format!("returned {bad} for sample {index}; rewards must be finite"),
                ));
            }
            let (low, high) = reward.range;
            let scores: Vec<f64> = scores.into_iter().map(|s| s.clamp(low, high)).collect();
            for (total, score) in totals.iter_mut().zip(&scores) {
                *total += reward.weight * score;
            }
            components.push(RewardComponent {
                name: reward.name.clone(),
                weight: reward.weight,
                scores,
            });
        }
        Ok(ScoreResponse {
            totals,
            components,
            failed: Vec::new(),
        })
    }
}

/// The reward's declared `score_range`, checked by the SDK.
fn score_range(py: Python<'_>, plugin: &PluginRef) -> Result<(f64, f64), PluginError> {
    let hook = "score_range";
    py.import("rollout_sdk.reward")
        .and_then(|module| module.call_method1("check_score_range", (plugin.object.bind(py),)))
        .and_then(|range| range.extract())
        .map_err(|err| plugin.raised(py, hook, &err))
}

/// The request's samples as `rollout_sdk.Sample`s.
fn samples<'py>(py: Python<'py>, request: &ScoreRequest) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for sample in &request.samples {
        list.append(to_python(py, Sample::from(sample))?)?;
    }
    Ok(list)
}
