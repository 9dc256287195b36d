//! Pacing keeps samples within `cluster.max_staleness`, but churn can still deliver a group
//! generated on older weights (a lease revoked and answered by a worker that rejoined on an
//! older version, an answer that was already on its way). Such a group is generated again
//! on current weights, in up to [`ROUNDS`] rounds; what is still stale after that is left
//! out of the step. Either way it is counted (`stale_groups_regenerated`,
//! `stale_groups_dropped`) and told to the ledger (replaced by which group, or dropped),
//! never a reason to end the run.

use tracing::Instrument;

use super::RunError;
use super::sampler::{Collected, Sampler, Trajectory};
use crate::roles::ReplaceReason;

/// Generation rounds a step spends on replacing its stale groups.
const ROUNDS: u32 = 3;

impl Sampler<'_> {
    /// Replaces `collected`'s groups that lag the trainer's version by more than the bound
    /// (`versions`: both), then recomputes the advantages if anything changed.
    pub(super) async fn regenerate_stale(
        &self,
        collected: &mut Collected,
        step: u64,
        versions: (u64, u64),
        seed: u64,
    ) -> Result<(), RunError> {
        let (trained_version, max_staleness) = versions;
        let stale = |collected: &Collected| {
            stale_groups(&collected.trajectories, trained_version, max_staleness)
        };
        if stale(collected).is_empty() {
            return Ok(());
        }
        for round in 1..=ROUNDS {
            let groups = stale(collected);
            if groups.is_empty() {
                break;
            }
            let records = records_of(&collected.trajectories, &groups);
            let next_group = collected.next_group();
            tracing::warn!(
                "step {step}: {} groups were generated more than {max_staleness} versions \
                 behind the trainer ({trained_version}); generating them again (round {round})",
                groups.len()
            );
            let more = self
                .collect_groups(
                    step,
                    &records,
                    next_group,
                    crate::seeds::mix(seed, 7000 + u64::from(round)),
                )
                .instrument(tracing::info_span!(
                    "regenerate",
                    step,
                    round,
                    groups = groups.len()
                ))
                .await?;
            collected.replace_groups(&groups, more);
            collected.replaced_by(&groups, next_group, ReplaceReason::Stale);
            collected.stale_groups_regenerated += groups.len();
        }
        leave_out(collected, &stale(collected), step);
        if collected.trajectories.is_empty() {
            return Err(RunError::Data(format!(
                "step {step}: no group within cluster.max_staleness = {max_staleness} of the \
                 trainer's version {trained_version} after {ROUNDS} rounds of generation"
            )));
        }
        self.compute_advantages(collected);
        Ok(())
    }
}

/// Drops `groups`, still stale after the last round, from the step.
fn leave_out(collected: &mut Collected, groups: &[usize], step: u64) {
    if !groups.is_empty() {
        tracing::warn!(
            "step {step}: {} groups were still stale after {ROUNDS} rounds; the step trains \
             without them",
            groups.len()
        );
        collected.replace_groups(groups, Collected::empty());
        collected.left_out.extend_from_slice(groups);
        collected.stale_groups_dropped += groups.len();
    }
}

/// The groups (by index) with a sample generated more than `max_staleness`
/// versions before `trained_version`.
fn stale_groups(
    trajectories: &[Trajectory],
    trained_version: u64,
    max_staleness: u64,
) -> Vec<usize> {
    let mut groups: Vec<usize> = trajectories
        .iter()
        .filter(|t| {
            t.generated_by()
                .is_some_and(|version| trained_version.saturating_sub(version) > max_staleness)
        })
        .map(|t| t.group)
        .collect();
    groups.sort_unstable();
    groups.dedup();
    groups
}

/// The record of each of `groups`.
fn records_of(trajectories: &[Trajectory], groups: &[usize]) -> Vec<usize> {
    groups
        .iter()
        .filter_map(|&group| {
            trajectories
                .iter()
                .find(|t| t.group == group)
                .map(|t| t.record)
        })
        .collect()
}
