//! What became of a step's prompt groups, for the ledger: exactly the groups whose samples
//! go into the update (those of `samples.jsonl`), the groups replaced by another group of
//! the step, and the groups dropped.

use std::collections::{BTreeMap, BTreeSet};

use rollout_net::messages::GroupRef;

use super::sampler::Collected;
use crate::roles::{DropReason, DroppedGroup, GroupRecord, ReplacedGroup, StepGroups};

/// The fate of every group generated for the step of `collected`, as it is about to be
/// trained. `redrawn` holds, for the step's first groups, the group whose requeued record
/// each carries; `requeue`: dropped groups' records go back to the data queue; `per_turn`:
/// generation was leased per episode turn.
pub(super) fn step_groups(
    collected: &Collected,
    redrawn: &[GroupRef],
    requeue: bool,
    per_turn: bool,
) -> StepGroups {
    let trained: BTreeMap<usize, usize> = collected
        .trajectories
        .iter()
        .map(|t| (t.group, t.record))
        .collect();
    let replaced: BTreeSet<usize> = collected.replaced.iter().map(|r| r.0).collect();
    let dropped = collected
        .generated
        .iter()
        .filter(|(group, _)| !trained.contains_key(group) && !replaced.contains(group))
        .map(|(&group, &record)| DroppedGroup {
            group: group as u32,
            record: record as u64,
            reason: if collected.left_out.contains(&group) {
                DropReason::Stale
            } else {
                // The pool answered it with no samples: its leases ran out.
                DropReason::Attempts
            },
            requeued: requeue,
        })
        .collect();
    StepGroups {
        trained: trained
            .into_iter()
            .map(|(group, record)| GroupRecord {
                group: group as u32,
                record: record as u64,
            })
            .collect(),
        replaced: collected
            .replaced
            .iter()
            .map(|&(group, by, reason)| ReplacedGroup {
                group: group as u32,
                by: by as u32,
                reason,
            })
            .collect(),
        dropped,
        redrawn: (0..).zip(redrawn.iter().copied()).collect(),
        per_turn,
    }
}
