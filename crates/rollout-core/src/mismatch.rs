//! The training/inference mismatch metrics: how far the generator's logprobs are from the
//! trainer's at its first evaluation of a sample, for samples generated with the weights
//! being trained (`mismatch/...`) and apart from them, older ones (`stale/...`).
//!
//! The objective reports each micro-batch's sums, counts and extremes
//! (`rollout_sdk.objectives.mismatch_metrics`); they add up over micro-batches (the first
//! epoch's only) and trainer ranks as [`merge`] says, and [`finish`] turns them into the
//! step's token means and fractions, so every token weighs the same wherever it was trained.

use std::collections::BTreeMap;

/// The two families: rows of the trained weights, and older ones.
pub const FAMILIES: [&str; 2] = ["mismatch", "stale"];

/// How a raw mismatch measurement combines with another of the same name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merge {
    Sum,
    Min,
    Max,
}

/// The rule `name` combines by, if it is a raw mismatch measurement.
pub fn rule(name: &str) -> Option<Merge> {
    let (family, stat) = name.split_once('/')?;
    if !FAMILIES.contains(&family) {
        return None;
    }
    match stat {
        "tokens" | "k3_sum" | "ratio_sum" | "outside_tokens" => Some(Merge::Sum),
        "ratio_min" => Some(Merge::Min),
        "ratio_max" => Some(Merge::Max),
        _ => None,
    }
}

/// Adds `value` of raw measurement `name` (combined by `merge`) into `into`.
pub fn merge(into: &mut BTreeMap<String, f64>, name: &str, value: f64, merge: Merge) {
    into.entry(name.to_owned())
        .and_modify(|entry| {
            *entry = match merge {
                Merge::Sum => *entry + value,
                Merge::Min => entry.min(value),
                Merge::Max => entry.max(value),
            }
        })
        .or_insert(value);
}

/// `metrics` with the raw mismatch measurements replaced by the step's: per family its
/// `tokens`, `kl_k3` (token mean of k3), `ratio_mean`, `ratio_min`, `ratio_max` and
/// `ratio_outside_fraction`. A family with no token reports 0 tokens, no KL and ratios of 1,
/// so every line has every key.
pub fn finish(mut metrics: BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    for family in FAMILIES {
        let mut take = |stat: &str| metrics.remove(&format!("{family}/{stat}"));
        let tokens = take("tokens").unwrap_or(0.0);
        let sums = [take("k3_sum"), take("ratio_sum"), take("outside_tokens")];
        let (min, max) = (take("ratio_min"), take("ratio_max"));
        let mean = |sum: Option<f64>, empty: f64| match sum {
            Some(sum) if tokens > 0.0 => sum / tokens,
            _ => empty,
        };
        let finished = [
            ("tokens", tokens),
            ("kl_k3", mean(sums[0], 0.0)),
            ("ratio_mean", mean(sums[1], 1.0)),
            ("ratio_outside_fraction", mean(sums[2], 0.0)),
            ("ratio_min", min.filter(|_| tokens > 0.0).unwrap_or(1.0)),
            ("ratio_max", max.filter(|_| tokens > 0.0).unwrap_or(1.0)),
        ];
        for (stat, value) in finished {
            metrics.insert(format!("{family}/{stat}"), value);
        }
    }
    metrics
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn raw(
        tokens: f64,
        k3: f64,
        ratio: f64,
        outside: f64,
        min: f64,
        max: f64,
    ) -> Vec<(String, f64)> {
        [
            ("tokens", tokens),
            ("k3_sum", k3),
            ("ratio_sum", ratio),
            ("outside_tokens", outside),
            ("ratio_min", min),
            ("ratio_max", max),
        ]
        .into_iter()
        .map(|(stat, value)| (format!("mismatch/{stat}"), value))
        .collect()
    }

    #[test]
    fn only_raw_mismatch_measurements_have_a_rule() {
        assert_eq!(rule("mismatch/tokens"), Some(Merge::Sum));
        assert_eq!(rule("stale/ratio_min"), Some(Merge::Min));
        assert_eq!(rule("stale/ratio_max"), Some(Merge::Max));
        assert_eq!(rule("mismatch/kl_k3"), None);
        assert_eq!(rule("ratio_mean"), None);
        assert_eq!(rule("agent/tokens"), None);
    }

    #[test]
    fn parts_combine_into_token_means_and_extremes() {
        // Two micro-batches (or ranks): 2 tokens with k3 0.1 in all and 6 with k3 0.7.
        let mut merged = BTreeMap::new();
        for part in [
            raw(2.0, 0.1, 2.0, 0.0, 0.9, 1.1),
            raw(6.0, 0.7, 7.0, 3.0, 0.5, 1.5),
        ] {
            for (name, value) in part {
                let how = rule(&name).unwrap();
                merge(&mut merged, &name, value, how);
            }
        }
        let done = finish(merged);
        assert_eq!(done["mismatch/tokens"], 8.0);
        assert!((done["mismatch/kl_k3"] - 0.1).abs() < 1e-12);
        assert!((done["mismatch/ratio_mean"] - 9.0 / 8.0).abs() < 1e-12);
        assert!((done["mismatch/ratio_outside_fraction"] - 3.0 / 8.0).abs() < 1e-12);
        assert_eq!(done["mismatch/ratio_min"], 0.5);
        assert_eq!(done["mismatch/ratio_max"], 1.5);
        assert!(!done.contains_key("mismatch/k3_sum"));
    }

    #[test]
    fn a_family_without_tokens_still_has_its_keys() {
        let done = finish(BTreeMap::from([("loss".to_owned(), 0.5)]));
        assert_eq!(done["stale/tokens"], 0.0);
        assert_eq!(done["stale/kl_k3"], 0.0);
        assert_eq!(done["stale/ratio_max"], 1.0);
        assert_eq!(done["mismatch/ratio_outside_fraction"], 0.0);
        assert_eq!(done["loss"], 0.5);
    }
}
