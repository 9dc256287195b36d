//! Turning each group's rewards into per-sample advantages.

use crate::config::AdvantageEstimator;

/// Advantages for one group of rewards (the completions of one prompt).
pub fn group_advantages(rewards: &[f64], estimator: AdvantageEstimator, std_eps: f64) -> Vec<f64> {
    let n = rewards.len();
    if n == 0 {
        return Vec::new();
    }
    let sum: f64 = rewards.iter().sum();
    let mean = sum / n as f64;
    match estimator {
        AdvantageEstimator::GroupMean => rewards.iter().map(|r| r - mean).collect(),
        AdvantageEstimator::GroupNorm | AdvantageEstimator::BatchNorm => {
            // Unbiased (n - 1) standard deviation, as GRPO implementations use.
            let std = if n > 1 {
                (rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
            } else {
                0.0
            };
            rewards
                .iter()
                .map(|r| (r - mean) / (std + std_eps))
                .collect()
        }
        AdvantageEstimator::LeaveOneOut => {
            if n == 1 {
                return vec![0.0];
            }
            rewards
                .iter()
                .map(|r| r - (sum - r) / (n - 1) as f64)
                .collect()
        }
    }
}

/// Advantages of a step's samples (`groups[i]` is sample `i`'s group, of `group_count`) over
/// the samples that were scored: a sample whose reward failed (`scored[i]` false) is left out
/// of its group's mean and standard deviation and gets advantage 0, so it neither trains
/// (with no KL term) nor shifts its neighbours. Also returns how many groups have no reward
/// spread among their scored samples.
pub fn scored_group_advantages(
    groups: &[usize],
    rewards: &[f64],
    scored: &[bool],
    group_count: usize,
    estimator: AdvantageEstimator,
    std_eps: f64,
) -> (Vec<f64>, usize) {
    let mut advantages = vec![0.0; groups.len()];
    let mut zero_std_groups = 0;
    if estimator == AdvantageEstimator::BatchNorm {
        let members: Vec<usize> = (0..groups.len()).filter(|&i| scored[i]).collect();
        let step_rewards: Vec<f64> = members.iter().map(|&i| rewards[i]).collect();
        let computed = group_advantages(&step_rewards, estimator, std_eps);
        for (&i, advantage) in members.iter().zip(computed) {
            advantages[i] = advantage;
        }
    }
    for group in 0..group_count {
        let members: Vec<usize> = (0..groups.len())
            .filter(|&i| groups[i] == group && scored[i])
            .collect();
        let group_rewards: Vec<f64> = members.iter().map(|&i| rewards[i]).collect();
        if group_rewards.windows(2).all(|w| w[0] == w[1]) {
            zero_std_groups += 1;
        }
        if estimator != AdvantageEstimator::BatchNorm {
            let computed = group_advantages(&group_rewards, estimator, std_eps);
            for (&i, advantage) in members.iter().zip(computed) {
                advantages[i] = advantage;
            }
        }
    }
    (advantages, zero_std_groups)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn batch_norm_normalises_over_the_whole_step_not_the_group() {
        let groups = [0, 0, 1, 1];
        let rewards = [1.0, 1.0, 0.0, 2.0];
        let scored = [true, true, true, false];
        let (got, zero_std) = scored_group_advantages(
            &groups,
            &rewards,
            &scored,
            2,
            AdvantageEstimator::BatchNorm,
            0.0,
        );
        // Over the three scored samples: mean 2/3, unbiased std 1/sqrt(3).
        let std = (1.0f64 / 3.0).sqrt();
        let expected = [
            (1.0 - 2.0 / 3.0) / std,
            (1.0 - 2.0 / 3.0) / std,
            -(2.0 / 3.0) / std,
            0.0,
        ];
        for (g, e) in got.iter().zip(expected) {
            assert!((g - e).abs() < 1e-12, "{got:?}");
        }
        // Group 0 has no spread, yet its samples are trained: the step's mean is the baseline.
        assert_eq!(zero_std, 2);
    }

    #[test]
    fn failed_samples_get_zero_and_leave_their_group_alone() {
        let groups = [0, 0, 0, 1, 1];
        let rewards = [1.0, 0.0, 100.0, 0.5, 0.5];
        let scored = [true, true, false, true, true];
        let (got, zero_std) = scored_group_advantages(
            &groups,
            &rewards,
            &scored,
            2,
            AdvantageEstimator::GroupMean,
            0.0,
        );
        // Group 0 is {1.0, 0.0} as if the failed sample's 100.0 never existed.
        assert!(close(&got, &[0.5, -0.5, 0.0, 0.0, 0.0]), "{got:?}");
        assert_eq!(zero_std, 1);
        let all_scored = [true; 5];
        let (with_it, _) = scored_group_advantages(
            &groups,
            &rewards,
            &all_scored,
            2,
            AdvantageEstimator::GroupMean,
            0.0,
        );
        assert!(
            with_it[0] < 0.0,
            "the outlier would have pulled the mean: {with_it:?}"
        );
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9)
    }

    #[test]
    fn group_norm_matches_hand_computation() {
        // mean 0.5, unbiased std = sqrt(((.5^2)*4)/3) = 0.57735
        let got = group_advantages(&[1.0, 0.0, 1.0, 0.0], AdvantageEstimator::GroupNorm, 0.0);
        let a = 0.5 / (1.0f64 / 3.0).sqrt();
        assert!(close(&got, &[a, -a, a, -a]), "{got:?}");
    }

    #[test]
    fn identical_rewards_give_zero_advantage() {
        for estimator in [
            AdvantageEstimator::GroupNorm,
            AdvantageEstimator::GroupMean,
            AdvantageEstimator::LeaveOneOut,
        ] {
            let got = group_advantages(&[0.7; 5], estimator, 1e-4);
            assert!(
                got.iter().all(|a| a.abs() < 1e-12),
                "{estimator:?}: {got:?}"
            );
        }
    }

    #[test]
    fn leave_one_out_uses_the_other_samples() {
        let got = group_advantages(&[1.0, 0.0, 0.0], AdvantageEstimator::LeaveOneOut, 0.0);
        assert!(close(&got, &[1.0, -0.5, -0.5]), "{got:?}");
    }

    #[test]
    fn group_mean_does_not_scale() {
        let got = group_advantages(&[3.0, 1.0], AdvantageEstimator::GroupMean, 0.0);
        assert!(close(&got, &[1.0, -1.0]), "{got:?}");
    }

    proptest! {
        #[test]
        fn advantages_sum_to_zero(rewards in proptest::collection::vec(-10.0f64..10.0, 2..32)) {
            for estimator in [AdvantageEstimator::GroupNorm, AdvantageEstimator::GroupMean, AdvantageEstimator::LeaveOneOut] {
                let got = group_advantages(&rewards, estimator, 1e-4);
                prop_assert_eq!(got.len(), rewards.len());
                prop_assert!(got.iter().sum::<f64>().abs() < 1e-6);
                prop_assert!(got.iter().all(|a| a.is_finite()));
            }
        }

        #[test]
        fn better_reward_never_gets_lower_advantage(rewards in proptest::collection::vec(0.0f64..1.0, 2..16)) {
            let got = group_advantages(&rewards, AdvantageEstimator::GroupNorm, 1e-4);
            for i in 0..rewards.len() {
                for j in 0..rewards.len() {
                    if rewards[i] > rewards[j] {
                        prop_assert!(got[i] > got[j]);
                    }
                }
            }
        }
    }
}
