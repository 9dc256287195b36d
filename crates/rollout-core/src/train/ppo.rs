//! PPO's per-token targets: with the value head's predictions taken before the update,
//! generalised advantage estimation over each completion's tokens.
//!
//! A row's tokens that are not trained on (its prompt, an environment's observations
//! between turns) are not actions: GAE runs over the trained tokens in order, so a turn's
//! last token bootstraps from the next turn's first. The sequence's reward arrives at its
//! last trained token; every other token's reward is 0 (a KL term, if any, is in the loss).

use rollout_net::messages::MicroBatch;

use crate::config::AlgorithmConfig;

/// A row's advantages and returns at its trained positions, zero elsewhere.
pub fn gae(
    reward: f32,
    values: &[f32],
    loss_mask: &[f32],
    gamma: f32,
    lam: f32,
) -> (Vec<f32>, Vec<f32>) {
    let mut advantages = vec![0.0; values.len()];
    let mut returns = vec![0.0; values.len()];
    let (mut next_value, mut next_advantage, mut last) = (0.0, 0.0, true);
    for t in (0..values.len()).rev() {
        if loss_mask[t] <= 0.0 {
            continue;
        }
        let step_reward = if last { reward } else { 0.0 };
        let delta = step_reward + gamma * next_value - values[t];
        let advantage = delta + gamma * lam * next_advantage;
        advantages[t] = advantage;
        returns[t] = advantage + values[t];
        (next_value, next_advantage, last) = (values[t], advantage, false);
    }
    (advantages, returns)
}

/// Replaces each row's advantages (on the way in, its sequence reward at every trained
/// token, as the batcher spreads a per-sequence scalar) with GAE's, sets the returns and
/// the values they were computed from, and whitens the advantages over the whole update
/// when `whiten_advantages`.
pub fn attach_targets(
    batches: &mut [MicroBatch],
    values: Vec<Vec<f32>>,
    algorithm: &AlgorithmConfig,
) -> Result<(), String> {
    if values.len() != batches.len() {
        return Err(format!(
            "values for {} micro-batches, {} were sent",
            values.len(),
            batches.len()
        ));
    }
    for (batch, values) in batches.iter_mut().zip(values) {
        if values.len() != batch.rows * batch.width {
            return Err(format!(
                "{} values for a [{}, {}] micro-batch",
                values.len(),
                batch.rows,
                batch.width
            ));
        }
        let mut returns = vec![0.0; values.len()];
        for row in 0..batch.rows {
            let span = row * batch.width..(row + 1) * batch.width;
            let mask = &batch.loss_mask[span.clone()];
            let reward = mask
                .iter()
                .rposition(|&m| m > 0.0)
                .map_or(0.0, |t| batch.advantages[span.start + t]);
            let (advantages, row_returns) = gae(
                reward,
                &values[span.clone()],
                mask,
                algorithm.gamma,
                algorithm.lam,
            );
            batch.advantages[span.clone()].copy_from_slice(&advantages);
            returns[span].copy_from_slice(&row_returns);
        }
        batch.returns = returns;
        batch.old_values = values;
    }
    if algorithm.whiten_advantages {
        whiten(batches);
    }
    Ok(())
}

/// Shifts and scales the trained tokens' advantages to mean 0 and standard deviation 1.
fn whiten(batches: &mut [MicroBatch]) {
    let trained = |b: &MicroBatch| {
        b.advantages
            .iter()
            .zip(&b.loss_mask)
            .filter(|(_, m)| **m > 0.0)
            .map(|(a, _)| f64::from(*a))
            .collect::<Vec<_>>()
    };
    let all: Vec<f64> = batches.iter().flat_map(trained).collect();
    if all.len() < 2 {
        return;
    }
    let mean = all.iter().sum::<f64>() / all.len() as f64;
    let var = all.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / all.len() as f64;
    let scale = 1.0 / (var.sqrt() + 1e-8);
    for batch in batches {
        for (a, m) in batch.advantages.iter_mut().zip(&batch.loss_mask) {
            if *m > 0.0 {
                *a = ((f64::from(*a) - mean) * scale) as f32;
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn lambda_one_gamma_one_gives_reward_minus_value() {
        let values = [9.0, 0.5, 0.25, 0.75];
        let mask = [0.0, 1.0, 1.0, 1.0];
        let (advantages, returns) = gae(2.0, &values, &mask, 1.0, 1.0);
        assert_eq!(advantages, [0.0, 1.5, 1.75, 1.25]);
        assert_eq!(returns, [0.0, 2.0, 2.0, 2.0]);
    }

    #[test]
    fn lambda_zero_is_the_one_step_td_error() {
        let values = [0.0, 1.0, 3.0];
        let mask = [1.0, 1.0, 1.0];
        let (advantages, _) = gae(5.0, &values, &mask, 0.5, 0.0);
        // delta_t = r_t + gamma V_{t+1} - V_t.
        assert_eq!(advantages, [0.5, 0.5, 2.0]);
    }

    #[test]
    fn untrained_tokens_between_turns_are_skipped() {
        // Two turns with an observation (untrained) between them: the first turn's last
        // token bootstraps from the second turn's first.
        let values = [1.0, 7.0, 7.0, 2.0];
        let mask = [1.0, 0.0, 0.0, 1.0];
        let (advantages, returns) = gae(4.0, &values, &mask, 1.0, 1.0);
        assert_eq!(advantages, [3.0, 0.0, 0.0, 2.0]);
        assert_eq!(returns, [4.0, 0.0, 0.0, 4.0]);
    }

    proptest! {
        /// With gamma = lambda = 1 every trained token's return is the sequence reward and
        /// its advantage is the reward minus its value, whatever the values and mask.
        #[test]
        fn monte_carlo_returns(
            reward in -5.0f32..5.0,
            row in proptest::collection::vec((-3.0f32..3.0, any::<bool>()), 1..40),
        ) {
            let values: Vec<f32> = row.iter().map(|(v, _)| *v).collect();
            let mask: Vec<f32> = row.iter().map(|(_, m)| if *m { 1.0 } else { 0.0 }).collect();
            let (advantages, returns) = gae(reward, &values, &mask, 1.0, 1.0);
            for t in 0..values.len() {
                if mask[t] > 0.0 {
                    prop_assert!((returns[t] - reward).abs() < 1e-4);
                    prop_assert!((advantages[t] - (reward - values[t])).abs() < 1e-4);
                } else {
                    prop_assert_eq!((advantages[t], returns[t]), (0.0, 0.0));
                }
            }
        }
    }

    fn batch(rows: &[(f32, &[f32])]) -> MicroBatch {
        let width = rows.iter().map(|(_, m)| m.len()).max().unwrap_or(0);
        let mut loss_mask = vec![0.0; rows.len() * width];
        let mut advantages = vec![0.0; rows.len() * width];
        for (r, (reward, mask)) in rows.iter().enumerate() {
            for (t, &m) in mask.iter().enumerate() {
                loss_mask[r * width + t] = m;
                advantages[r * width + t] = if m > 0.0 { *reward } else { 0.0 };
            }
        }
        MicroBatch {
            rows: rows.len(),
            width,
            input_ids: vec![1; rows.len() * width],
            attention_mask: vec![1; rows.len() * width],
            loss_mask,
            advantages,
            old_logprobs: vec![0.0; rows.len() * width],
            loss_scale: 1.0,
            objective: rollout_net::messages::Objective::Sft,
            returns: Vec::new(),
            old_values: Vec::new(),
            row_staleness: Vec::new(),
        }
    }

    #[test]
    fn targets_replace_the_spread_reward_and_whiten_over_every_batch() {
        let algorithm = AlgorithmConfig {
            gamma: 1.0,
            lam: 1.0,
            whiten_advantages: false,
            ..AlgorithmConfig::default()
        };
        let mut batches = vec![
            batch(&[(1.0, &[0.0, 1.0, 1.0])]),
            batch(&[(0.0, &[1.0, 1.0])]),
        ];
        let values = vec![vec![0.0, 0.25, 0.5], vec![0.5, 0.5]];
        attach_targets(&mut batches, values.clone(), &algorithm).unwrap();
        assert_eq!(batches[0].advantages, [0.0, 0.75, 0.5]);
        assert_eq!(batches[0].returns, [0.0, 1.0, 1.0]);
        assert_eq!(batches[0].old_values, values[0]);
        assert_eq!(batches[1].advantages, [-0.5, -0.5]);

        let whitened = AlgorithmConfig {
            whiten_advantages: true,
            ..algorithm
        };
        let mut batches = vec![
            batch(&[(1.0, &[0.0, 1.0, 1.0])]),
            batch(&[(0.0, &[1.0, 1.0])]),
        ];
        attach_targets(&mut batches, values, &whitened).unwrap();
        let trained: Vec<f32> = [&batches[0].advantages[1..], &batches[1].advantages[..]].concat();
        let mean = trained.iter().sum::<f32>() / 4.0;
        let var = trained.iter().map(|a| (a - mean).powi(2)).sum::<f32>() / 4.0;
        assert!(mean.abs() < 1e-5 && (var - 1.0).abs() < 1e-4, "{trained:?}");
        assert_eq!(batches[0].advantages[0], 0.0, "prompt tokens stay 0");
    }

    #[test]
    fn a_wrongly_shaped_answer_is_an_error() {
        let mut batches = vec![batch(&[(1.0, &[1.0, 1.0])])];
        let algorithm = AlgorithmConfig::default();
        assert!(attach_targets(&mut batches, vec![vec![0.0; 3]], &algorithm).is_err());
        assert!(attach_targets(&mut batches, vec![], &algorithm).is_err());
    }
}
