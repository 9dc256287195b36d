//! What a trainer checks of a micro-batch before the model sees it: every token id inside
//! the policy's vocabulary (an id past it would fail deep inside the model, on a GPU by
//! killing the process) and every behaviour logprob the loss uses one a sampler could have
//! given (the peer check's range). A row that breaks either is left out of the update: its
//! ids become 0 and its loss mask, advantages and logprobs 0, so it is trained on by no one
//! and costs its sample, not the run.

use rollout_net::messages::MicroBatch;

use crate::cluster::pool::{MAX_LOGPROB, MIN_LOGPROB};

/// The rows (indices) of `batch` that break the checks against `vocabulary`.
pub fn invalid_rows(batch: &MicroBatch, vocabulary: u64) -> Vec<usize> {
    let width = batch.width;
    (0..batch.rows)
        .filter(|&row| {
            let cells = row.saturating_mul(width)..(row + 1).saturating_mul(width);
            cells.into_iter().any(|cell| {
                let id_outside = batch
                    .input_ids
                    .get(cell)
                    .is_some_and(|&id| u64::from(id) >= vocabulary);
                let in_loss = batch.loss_mask.get(cell).is_some_and(|&m| m != 0.0);
                let logprob_outside = in_loss
                    && batch
                        .old_logprobs
                        .get(cell)
                        .is_some_and(|lp| !(MIN_LOGPROB..=MAX_LOGPROB).contains(lp));
                id_outside || logprob_outside
            })
        })
        .collect()
}

/// `batch` with `rows` left out of the update: their ids 0, nothing of theirs in the loss.
pub fn without_rows(batch: &MicroBatch, rows: &[usize]) -> MicroBatch {
    let mut kept = batch.clone();
    let width = batch.width;
    for &row in rows {
        let cells = row.saturating_mul(width)..(row + 1).saturating_mul(width);
        for vector in [
            &mut kept.loss_mask,
            &mut kept.advantages,
            &mut kept.old_logprobs,
            &mut kept.returns,
            &mut kept.old_values,
        ] {
            if let Some(values) = vector.get_mut(cells.clone()) {
                values.fill(0.0);
            }
        }
        if let Some(ids) = kept.input_ids.get_mut(cells) {
            ids.fill(0);
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use rollout_net::messages::Objective;

    use super::*;

    /// Two rows of three tokens, the loss on the last two of each.
    fn batch(input_ids: [u32; 6], old_logprobs: [f32; 6]) -> MicroBatch {
        MicroBatch {
            rows: 2,
            width: 3,
            input_ids: input_ids.to_vec(),
            attention_mask: vec![1; 6],
            loss_mask: vec![0.0, 1.0, 1.0, 0.0, 1.0, 1.0],
            advantages: vec![0.0, 1.0, 1.0, 0.0, -1.0, -1.0],
            old_logprobs: old_logprobs.to_vec(),
            loss_scale: 0.25,
            objective: Objective::Sft,
            returns: Vec::new(),
            old_values: Vec::new(),
            row_staleness: Vec::new(),
        }
    }

    const HONEST: [f32; 6] = [0.0, -0.5, -80.0, 0.0, -2.0, 0.0];

    #[test]
    fn an_honest_batch_has_no_invalid_row() {
        assert!(invalid_rows(&batch([1, 2, 9, 3, 4, 5], HONEST), 10).is_empty());
    }

    #[test]
    fn an_id_past_the_vocabulary_or_an_impossible_logprob_marks_its_row() {
        assert_eq!(invalid_rows(&batch([1, 2, 10, 3, 4, 5], HONEST), 10), [0]);
        let mut poisoned = HONEST;
        poisoned[5] = -95.0;
        assert_eq!(invalid_rows(&batch([1; 6], poisoned), 10), [1]);
        poisoned[1] = f32::NAN;
        assert_eq!(invalid_rows(&batch([1; 6], poisoned), 10), [0, 1]);
    }

    #[test]
    fn a_logprob_outside_the_loss_is_not_used_and_not_checked() {
        let mut outside = HONEST;
        outside[3] = -1.0e9;
        assert!(invalid_rows(&batch([1; 6], outside), 10).is_empty());
    }

    #[test]
    fn a_row_left_out_trains_on_nothing_and_takes_valid_ids() {
        let mut poisoned = HONEST;
        poisoned[4] = -95.0;
        let screened = without_rows(&batch([1, 2, 3, 4, 99, 5], poisoned), &[1]);
        assert_eq!(screened.input_ids, [1, 2, 3, 0, 0, 0]);
        assert_eq!(screened.loss_mask, [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]);
        assert_eq!(screened.old_logprobs[..3], HONEST[..3]);
        assert!(screened.old_logprobs[3..].iter().all(|&lp| lp == 0.0));
        assert_eq!(screened.loss_scale, 0.25, "the update's scale is unchanged");
        assert!(invalid_rows(&screened, 10).is_empty());
    }
}
