//! DAPO's dynamic sampling: a group whose rewards are all equal has no advantage, so no
//! learning signal. Such groups are replaced by groups of the step's reserve prompts, in up
//! to `algorithm.dynamic_sampling_rounds` further generation rounds; what is still flat
//! after the last round is trained as usual (contributing nothing without a KL term).

use tracing::Instrument;

use super::RunError;
use super::sampler::{Collected, Sampler, Trajectory};
use crate::metrics::merge_metrics;
use crate::roles::ReplaceReason;

impl Sampler<'_> {
    /// Replaces `collected`'s flat groups with groups of `reserve` records, in rounds.
    pub(super) async fn refill(
        &self,
        collected: &mut Collected,
        step: u64,
        mut reserve: &[usize],
        seed: u64,
    ) -> Result<(), RunError> {
        for round in 1..=self.config.algorithm.dynamic_sampling_rounds {
            let flat = flat_groups(collected);
            let count = flat.len().min(reserve.len());
            if count == 0 {
                break;
            }
            let (records, rest) = reserve.split_at(count);
            let round_seed = crate::seeds::mix(seed, u64::from(round));
            let next_group = collected.next_group();
            let more = self
                .collect_groups(step, records, next_group, round_seed)
                .instrument(tracing::info_span!("refill", step, round, groups = count))
                .await?;
            collected.replace_groups(&flat[..count], more);
            collected.replaced_by(&flat[..count], next_group, ReplaceReason::Flat);
            collected.refilled_groups += count;
            collected.refill_rounds = round;
            reserve = rest;
        }
        Ok(())
    }
}

/// The groups (by index) whose scored samples all have the same reward, in order.
fn flat_groups(collected: &Collected) -> Vec<usize> {
    let mut groups: Vec<usize> = collected.trajectories.iter().map(|t| t.group).collect();
    groups.dedup();
    groups
        .into_iter()
        .filter(|&group| {
            let rewards: Vec<f64> = collected
                .trajectories
                .iter()
                .zip(&collected.rewards)
                .zip(&collected.failures)
                .filter(|((t, _), failure)| t.group == group && failure.is_none())
                .map(|((_, &reward), _)| reward)
                .collect();
            rewards.windows(2).all(|w| w[0] == w[1])
        })
        .collect()
}

impl Collected {
    /// No samples: what replaces groups that are left out.
    pub(super) fn empty() -> Self {
        Collected {
            records: Vec::new(),
            trajectories: Vec::new(),
            completions: Vec::new(),
            rewards: Vec::new(),
            components: Vec::new(),
            advantages: Vec::new(),
            failures: Vec::new(),
            zero_std_groups: 0,
            refilled_groups: 0,
            refill_rounds: 0,
            stale_groups_regenerated: 0,
            stale_groups_dropped: 0,
            generated: Default::default(),
            replaced: Vec::new(),
            left_out: Vec::new(),
            generate_seconds: 0.0,
            score_seconds: 0.0,
            generator_metrics: Default::default(),
        }
    }

    /// Drops the samples of `groups` and appends `more`'s; times add up and generator
    /// measurements merge.
    pub(super) fn replace_groups(&mut self, groups: &[usize], more: Collected) {
        let keep: Vec<bool> = self
            .trajectories
            .iter()
            .map(|t| !groups.contains(&t.group))
            .collect();
        retain(&mut self.trajectories, &keep);
        retain(&mut self.completions, &keep);
        retain(&mut self.rewards, &keep);
        retain(&mut self.components, &keep);
        retain(&mut self.failures, &keep);
        self.trajectories.extend(more.trajectories);
        self.completions.extend(more.completions);
        self.rewards.extend(more.rewards);
        self.components.extend(more.components);
        self.failures.extend(more.failures);
        self.records = group_records(&self.trajectories);
        self.generated.extend(more.generated);
        self.generate_seconds += more.generate_seconds;
        self.score_seconds += more.score_seconds;
        let measured = [
            std::mem::take(&mut self.generator_metrics),
            more.generator_metrics,
        ];
        self.generator_metrics = merge_metrics(&measured);
    }
}

impl Collected {
    /// The index of the next group generated for the step: past every group generated so
    /// far, with samples or not.
    pub(super) fn next_group(&self) -> usize {
        self.generated.keys().next_back().map_or(0, |last| last + 1)
    }

    /// Records that `groups` were replaced, in order, by the groups from `first` on.
    pub(super) fn replaced_by(&mut self, groups: &[usize], first: usize, reason: ReplaceReason) {
        self.replaced.extend(
            groups
                .iter()
                .enumerate()
                .map(|(offset, &group)| (group, first + offset, reason)),
        );
    }
}

/// The record of each group, in the order the groups appear.
fn group_records(trajectories: &[Trajectory]) -> Vec<usize> {
    let mut records = Vec::new();
    let mut last = None;
    for trajectory in trajectories {
        if last != Some(trajectory.group) {
            records.push(trajectory.record);
            last = Some(trajectory.group);
        }
    }
    records
}

fn retain<T>(items: &mut Vec<T>, keep: &[bool]) {
    let mut flags = keep.iter();
    items.retain(|_| flags.next().copied().unwrap_or(true));
}
