//! Failure accounting: how many samples failed, in a step and over the run, held against
//! `[sandbox] max_failed_fraction_per_step` and `max_failed_fraction`.

use std::collections::BTreeMap;
use std::sync::Mutex;

use rollout_net::messages::ScoreFailure;

use super::SandboxError;
use crate::config::SandboxConfig;

/// Samples judged and failed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FailureCounts {
    pub total: u64,
    pub failed: u64,
}

/// The run's counts: every sample once, failed for its environment or for a reward.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunCounts {
    pub total: u64,
    pub failed: u64,
    /// Of `failed`, the samples whose episode's environment failed.
    pub environment_failed: u64,
}

/// The run's failure counts, shared by the reward pool and the environment pool (counted
/// from the start of this process). Each sample counts once: when the environment runs in
/// the sandbox its pool counts every episode, failed or not, when the episodes finish; the
/// reward pool then adds only the failures among the samples it scored (a failed episode
/// is not scored).
#[derive(Debug, Default)]
pub struct FailureLedger {
    episodes_counted: bool,
    counts: Mutex<RunCounts>,
}

impl FailureLedger {
    /// `episodes_counted`: a sandboxed environment's pool counts every sample.
    pub fn new(episodes_counted: bool) -> Self {
        FailureLedger {
            episodes_counted,
            counts: Mutex::default(),
        }
    }

    /// `step.total` samples were scored, `step.failed` of them failed; returns the run.
    pub fn add_scored(&self, step: FailureCounts) -> RunCounts {
        let total = if self.episodes_counted { 0 } else { step.total };
        self.add(total, step.failed, 0)
    }

    /// `step.total` episodes finished, `step.failed` of them failed; returns the run.
    pub fn add_episodes(&self, step: FailureCounts) -> RunCounts {
        self.add(step.total, step.failed, step.failed)
    }

    fn add(&self, total: u64, failed: u64, environment_failed: u64) -> RunCounts {
        let mut counts = match self.counts.lock() {
            Ok(counts) => counts,
            // Counting cannot panic; a poisoned lock still holds valid numbers.
            Err(poisoned) => poisoned.into_inner(),
        };
        counts.total += total;
        counts.failed += failed;
        counts.environment_failed += environment_failed;
        *counts
    }
}

/// Holds a step's counts (with its `failed` samples, for the message) and the run's
/// against the configured fractions.
pub fn check_limits(
    config: &SandboxConfig,
    step: Option<FailureCounts>,
    run: Option<RunCounts>,
    failed: &[ScoreFailure],
) -> Result<(), SandboxError> {
    let in_environment = failed.iter().filter(|f| f.environment.is_some()).count() as u64;
    let step = step.map(|counts| {
        let what = culprits(in_environment, counts.failed.max(failed.len() as u64));
        (counts, what, "in this step", "max_failed_fraction_per_step")
    });
    let limit_per_step = config.max_failed_fraction_per_step;
    let run = run.map(|counts| {
        let plain = FailureCounts {
            total: counts.total,
            failed: counts.failed,
        };
        let what = culprits(counts.environment_failed, counts.failed);
        (plain, what, "so far in the run", "max_failed_fraction")
    });
    let limits = [
        step.map(|s| (s, limit_per_step)),
        run.map(|r| (r, config.max_failed_fraction)),
    ];
    for ((counts, what, scope, key), limit) in limits.into_iter().flatten() {
        if counts.failed as f64 > limit * counts.total as f64 {
            return Err(SandboxError::TooManyFailures {
                what,
                failed: counts.failed,
                total: counts.total,
                scope,
                key,
                limit,
                reasons: format!("this step: {}", reason_counts(failed)),
                last: failed.last().map(describe).unwrap_or_else(|| "none".into()),
            });
        }
    }
    Ok(())
}

/// Who failed: `environment` of `failed` were environment failures.
fn culprits(environment: u64, failed: u64) -> &'static str {
    match environment {
        0 => "rewards",
        n if n >= failed => "environments",
        _ => "environments and rewards",
    }
}

/// "2 timeout, 1 raised", with environment failures told apart.
pub fn reason_counts(failed: &[ScoreFailure]) -> String {
    let mut counts: BTreeMap<(bool, &str), usize> = BTreeMap::new();
    for failure in failed {
        let key = (failure.environment.is_some(), failure.reason.as_str());
        *counts.entry(key).or_default() += 1;
    }
    if counts.is_empty() {
        return "none failed".into();
    }
    counts
        .iter()
        .map(|((environment, reason), count)| {
            let place = if *environment {
                " in the environment"
            } else {
                ""
            };
            format!("{count} {reason}{place}")
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// "sample 3 (reward `exact`): raised: ValueError: ..." or "(environment `step`)".
pub fn describe(failure: &ScoreFailure) -> String {
    let culprit = match (&failure.environment, &failure.reward) {
        (Some(hook), _) => format!(" (environment `{hook}`)"),
        (None, Some(name)) => format!(" (reward `{name}`)"),
        (None, None) => String::new(),
    };
    format!(
        "sample {}{culprit}: {}: {}",
        failure.index,
        failure.reason.as_str(),
        failure.message
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use rollout_net::messages::FailureReason;

    use super::*;

    fn failure(index: usize, environment: Option<&str>) -> ScoreFailure {
        ScoreFailure {
            index,
            reason: FailureReason::Raised,
            message: "ValueError: no".into(),
            reward: None,
            environment: environment.map(str::to_owned),
            traceback: None,
        }
    }

    #[test]
    fn each_sample_counts_once_when_episodes_are_counted() {
        let ledger = FailureLedger::new(true);
        ledger.add_episodes(FailureCounts {
            total: 8,
            failed: 2,
        });
        let run = ledger.add_scored(FailureCounts {
            total: 6,
            failed: 1,
        });
        assert_eq!(
            run,
            RunCounts {
                total: 8,
                failed: 3,
                environment_failed: 2
            }
        );
        let alone = FailureLedger::new(false);
        let run = alone.add_scored(FailureCounts {
            total: 6,
            failed: 1,
        });
        assert_eq!((run.total, run.failed), (6, 1));
    }

    #[test]
    fn the_message_names_who_failed() {
        let config = SandboxConfig {
            max_failed_fraction: 0.1,
            ..SandboxConfig::default()
        };
        let failed = [failure(1, Some("step")), failure(4, None)];
        let run = RunCounts {
            total: 10,
            failed: 2,
            environment_failed: 1,
        };
        let err = check_limits(&config, None, Some(run), &failed).unwrap_err();
        let text = err.to_string();
        assert!(
            text.starts_with("environments and rewards failed on 2 of 10 samples so far"),
            "{text}"
        );
        assert!(
            text.contains("1 raised, 1 raised in the environment"),
            "{text}"
        );
        assert!(text.contains("sample 4: raised"), "{text}");
        let step = FailureCounts {
            total: 4,
            failed: 1,
        };
        let only_environment = [failure(0, Some("reset"))];
        let err = check_limits(
            &SandboxConfig {
                max_failed_fraction_per_step: 0.2,
                ..SandboxConfig::default()
            },
            Some(step),
            None,
            &only_environment,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("environments failed on 1 of 4 samples in this step (25.0%)"),
            "{err}"
        );
        assert!(err.contains("(environment `reset`)"), "{err}");
        assert!(
            check_limits(
                &SandboxConfig::default(),
                Some(step),
                None,
                &only_environment
            )
            .is_ok()
        );
    }
}
