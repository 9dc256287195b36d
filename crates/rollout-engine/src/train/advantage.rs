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
        AdvantageEstimator::GroupNorm => {
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
