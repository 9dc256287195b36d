//! Rewards given by a rule.

use rollout_core::roles::{RoleFuture, Scorer};
use rollout_net::messages::{
    FailureReason, RewardComponent, ScoreFailure, ScoreRequest, ScoreResponse, ScoreSample,
};

/// What the rule gives one sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Score {
    Reward(f64),
    /// The reward raised on this sample (as a sandboxed reward reports it).
    Fails,
}

type Rule = dyn Fn(&ScoreSample) -> Score + Send + Sync;

/// One reward, `fake`, scoring each sample by a rule.
pub struct FakeRewards {
    rule: Box<Rule>,
}

impl FakeRewards {
    pub fn new(rule: impl Fn(&ScoreSample) -> Score + Send + Sync + 'static) -> Self {
        FakeRewards {
            rule: Box::new(rule),
        }
    }

    /// 1 for a completion that starts with `a` (a [`super::FakePolicy`]'s first sample of
    /// each group), else 0: every group has a spread.
    pub fn first_letter() -> Self {
        Self::new(|sample| Score::Reward(f64::from(u8::from(sample.completion.starts_with('a')))))
    }
}

impl Scorer for FakeRewards {
    fn score(&self, request: ScoreRequest) -> RoleFuture<'_, ScoreResponse> {
        let scores: Vec<Score> = request.samples.iter().map(|s| (self.rule)(s)).collect();
        let totals: Vec<f64> = scores
            .iter()
            .map(|score| match score {
                Score::Reward(reward) => *reward,
                Score::Fails => 0.0,
            })
            .collect();
        let failed = scores
            .iter()
            .enumerate()
            .filter(|(_, score)| **score == Score::Fails)
            .map(|(index, _)| ScoreFailure {
                index,
                reason: FailureReason::Raised,
                message: "ValueError: the fake reward fails here".into(),
                reward: Some("fake".into()),
                environment: None,
                traceback: None,
            })
            .collect();
        let components = vec![RewardComponent {
            name: "fake".into(),
            weight: 1.0,
            scores: totals.clone(),
        }];
        Box::pin(async move {
            Ok(ScoreResponse {
                totals,
                components,
                failed,
            })
        })
    }
}
