//! Dropped groups' records back in the data queue. A group left out of its step's update
//! (still stale after the last round of regeneration, or no answer after its last lease)
//! has its record drawn again by a later step, unless `cluster.dropped_groups = "skip"`
//! (strict data order: the prompt is not trained, and the audit reports it lost).
//!
//! What a step draws must not depend on timing, so that a resumed run draws exactly what an
//! uninterrupted one would: a record dropped from step `k` may be drawn from step
//! `k + 1 + max_staleness` on (the first step whose prompts are drawn after the update of
//! step `k`), oldest first and before fresh records, at most `prompts_per_step` a step. The
//! queue saved with the checkpoint of step `k` holds what steps up to `k` had not drawn.

use rollout_net::messages::GroupRef;
use serde::{Deserialize, Serialize};

use crate::roles::StepGroups;

/// A record to train again, dropped from group `from`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requeued {
    pub record: usize,
    pub from: GroupRef,
    /// The first step that may draw it.
    pub ready_at: u64,
}

impl Requeued {
    fn order(&self) -> (u64, GroupRef) {
        (self.ready_at, self.from)
    }
}

/// The requeued records, and the step (not yet trained) that drew each, if one did.
#[derive(Debug, Default)]
pub(super) struct RequeueQueue {
    entries: Vec<(Requeued, Option<u64>)>,
}

impl RequeueQueue {
    /// The queue a checkpoint saved; records past the data's `records` (a checkpoint of
    /// other data) are left out, with a warning.
    pub fn new(saved: &[Requeued], records: usize) -> Self {
        let (kept, unknown): (Vec<Requeued>, Vec<Requeued>) =
            saved.iter().partition(|entry| entry.record < records);
        if !unknown.is_empty() {
            tracing::warn!(
                "{} requeued records of the checkpoint are past the data's {records} records; \
                 they are left out",
                unknown.len()
            );
        }
        let mut queue = Self::default();
        queue.push(kept);
        queue
    }

    pub fn push(&mut self, entries: impl IntoIterator<Item = Requeued>) {
        self.entries
            .extend(entries.into_iter().map(|entry| (entry, None)));
        self.entries.sort_by_key(|(entry, _)| entry.order());
    }

    /// Queues the records of the groups of `step` that were dropped and requeued; they may
    /// be drawn from step `ready_at` on. Returns how many.
    pub fn requeue_dropped(&mut self, step: u64, groups: &StepGroups, ready_at: u64) -> usize {
        let requeued: Vec<Requeued> = groups
            .dropped
            .iter()
            .filter(|dropped| dropped.requeued)
            .map(|dropped| Requeued {
                record: dropped.record as usize,
                from: GroupRef {
                    step,
                    index: dropped.group,
                },
                ready_at,
            })
            .collect();
        let count = requeued.len();
        self.push(requeued);
        count
    }

    /// Up to `count` records step `step` may draw, oldest first.
    pub fn draw(&mut self, step: u64, count: usize) -> Vec<Requeued> {
        let mut drawn = Vec::new();
        for (entry, drawn_by) in &mut self.entries {
            if drawn.len() == count {
                break;
            }
            if drawn_by.is_none() && entry.ready_at <= step {
                *drawn_by = Some(step);
                drawn.push(*entry);
            }
        }
        drawn
    }

    /// Forgets the records drawn by steps up to `step`, now trained.
    pub fn settled(&mut self, step: u64) {
        self.entries
            .retain(|(_, drawn_by)| drawn_by.is_none_or(|by| by > step));
    }

    /// What a checkpoint of `step` saves: the records steps up to `step` have not drawn.
    pub fn saved(&self, step: u64) -> Vec<Requeued> {
        self.entries
            .iter()
            .filter(|(_, drawn_by)| drawn_by.is_none_or(|by| by > step))
            .map(|(entry, _)| *entry)
            .collect()
    }

    /// Records waiting to be drawn.
    pub fn waiting(&self) -> usize {
        self.entries.iter().filter(|(_, by)| by.is_none()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(record: usize, step: u64, index: u32, ready_at: u64) -> Requeued {
        Requeued {
            record,
            from: GroupRef { step, index },
            ready_at,
        }
    }

    fn records(drawn: &[Requeued]) -> Vec<usize> {
        drawn.iter().map(|entry| entry.record).collect()
    }

    #[test]
    fn records_are_drawn_once_oldest_first_and_not_before_they_are_ready() {
        let mut queue = RequeueQueue::default();
        queue.push([entry(7, 3, 1, 5), entry(4, 2, 0, 4), entry(9, 3, 0, 5)]);
        assert!(queue.draw(3, 8).is_empty(), "none is ready at step 3");
        assert_eq!(records(&queue.draw(4, 8)), [4]);
        assert_eq!(records(&queue.draw(5, 1)), [9], "group order within a step");
        assert_eq!(records(&queue.draw(6, 8)), [7]);
        assert!(queue.draw(7, 8).is_empty(), "each is drawn once");
        assert_eq!(queue.waiting(), 0);
    }

    #[test]
    fn a_checkpoint_keeps_what_later_steps_drew_and_a_resume_draws_it_alike() {
        // Uninterrupted: step 4 and 5 drew (sampled ahead) when the checkpoint of step 4 is
        // taken; step 5 is not trained yet.
        let mut straight = RequeueQueue::default();
        straight.push([entry(1, 2, 0, 4), entry(2, 2, 1, 4), entry(3, 3, 0, 5)]);
        let step_four = straight.draw(4, 1);
        let step_five = straight.draw(5, 1);
        straight.settled(4);
        let saved = straight.saved(4);
        assert_eq!(records(&saved), [2, 3], "step 5's draw is not settled");
        let step_six = straight.draw(6, 2);
        assert_eq!(
            (records(&step_four), records(&step_five), records(&step_six)),
            (vec![1], vec![2], vec![3])
        );

        let mut resumed = RequeueQueue::new(&saved, 10);
        assert_eq!(resumed.draw(5, 1), step_five);
        assert_eq!(resumed.draw(6, 2), step_six);
    }

    #[test]
    fn requeued_records_past_the_data_are_left_out() {
        let queue = RequeueQueue::new(&[entry(3, 1, 0, 2), entry(30, 1, 1, 2)], 10);
        assert_eq!(records(&queue.saved(0)), [3]);
    }
}
