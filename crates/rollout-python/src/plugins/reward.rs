//! Reward plugins and their weighted combination.

use pyo3::prelude::*;
use pyo3::types::PyList;
use rollout_core::config::{KeyPath, LoadedConfig, reward_name};
use rollout_net::messages::{
    FailureReason, RewardComponent, ScoreFailure, ScoreRequest, ScoreResponse,
};

use super::{PluginError, PluginLoadError, PluginRef};
use crate::contract::{self, Sample, to_python};

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
        let mut failed: Vec<ScoreFailure> = Vec::new();
        for reward in &self.rewards {
            let scores = reward.scores(py, &samples, count)?;
            let mut component = Vec::with_capacity(count);
            for (index, score) in scores.into_iter().enumerate() {
                let value = match score {
                    Ok(value) => value,
                    Err((reason, message)) => {
                        if !failed.iter().any(|f| f.index == index) {
                            failed.push(ScoreFailure {
                                index,
                                reason,
                                message,
                                reward: Some(reward.name.clone()),
                                environment: None,
                                traceback: None,
                            });
                        }
                        0.0
                    }
                };
                totals[index] += reward.weight * value;
                component.push(value);
            }
            components.push(RewardComponent {
                name: reward.name.clone(),
                weight: reward.weight,
                scores: component,
            });
        }
        failed.sort_by_key(|failure| failure.index);
        Ok(ScoreResponse {
            totals,
            components,
            failed,
        })
    }
}

/// A sample's score, clamped into the reward's range, or why it could not be scored.
type SampleScore = Result<f64, (FailureReason, String)>;

impl WeightedReward {
    /// Calls `score` on `samples` (`count` of them) and checks what it returned: one finite
    /// float or `SampleFailure` per sample.
    fn scores(
        &self,
        py: Python<'_>,
        samples: &Bound<'_, PyList>,
        count: usize,
    ) -> Result<Vec<SampleScore>, PluginError> {
        let hook = "score";
        let result = self.plugin.call(py, hook, (samples.clone(),))?;
        let scores: Vec<Score> = result.extract().map_err(|_| {
            self.plugin.bad_return(
                hook,
                "must return a sequence of float (or rollout_sdk.SampleFailure)",
            )
        })?;
        if scores.len() != count {
            return Err(self.plugin.bad_return(
                hook,
                format!("returned {} scores for {count} samples", scores.len()),
            ));
        }
        let (low, high) = self.range;
        scores
            .into_iter()
            .enumerate()
            .map(|(index, score)| match score {
                Score::Value(value) if value.is_finite() => Ok(Ok(value.clamp(low, high))),
                Score::Value(bad) => Err(self.plugin.bad_return(
                    hook,
                    format!("returned {bad} for sample {index}; rewards must be finite"),
                )),
                Score::Failed(failure) => match failure_reason(&failure.reason) {
                    Some(reason) => Ok(Err((reason, failure.message))),
                    None => Err(self.plugin.bad_return(
                        hook,
                        format!("returned a SampleFailure with reason {:?}", failure.reason),
                    )),
                },
            })
            .collect()
    }
}

/// One element of what `Reward.score` returned: a float, or a `SampleFailure`.
enum Score {
    Value(f64),
    Failed(contract::SampleFailure),
}

impl<'py> FromPyObject<'_, 'py> for Score {
    type Error = PyErr;

    fn extract(object: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(value) = object.extract::<f64>() {
            return Ok(Score::Value(value));
        }
        let failure_class = object
            .py()
            .import("rollout_sdk")?
            .getattr("SampleFailure")?;
        if object.is_instance(&failure_class)? {
            return Ok(Score::Failed(object.extract()?));
        }
        Err(pyo3::exceptions::PyTypeError::new_err(
            "not a float or a SampleFailure",
        ))
    }
}

/// The engine's failure reason a `SampleFailure.reason` names (`rollout_sdk.FailureReason`).
fn failure_reason(name: &str) -> Option<FailureReason> {
    FailureReason::ALL
        .into_iter()
        .find(|reason| reason.as_str() == name && *reason != FailureReason::Restarted)
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
