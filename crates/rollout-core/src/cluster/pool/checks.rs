//! What a generation worker's answer must hold before the controller uses it. A worker is
//! authenticated, not trusted: a faulty or hostile one may send completions whose lengths
//! disagree, token ids past the vocabulary, logprobs that would make the loss NaN, or a
//! weight version newer than any it was sent (to dodge the staleness bound). Such a group
//! fails its lease; it is leased again elsewhere and counted as rejected.

use rollout_net::messages::{Completion, PromptRequest, SamplingParams};

/// The lowest logprob a sampled token may carry. A token this unlikely (p < e^-80 = 1.8e-35)
/// is never sampled: with a vocabulary of a million tokens, all of them that unlikely
/// together are drawn with p < 1.8e-29 per token, about one in 10^13 over a run of 10^15
/// generated tokens; top-p and top-k cut such tokens before they can be drawn, and the
/// logprob is of the same (temperature-scaled) distribution the token was drawn from. And
/// `exp(-MIN_LOGPROB)` (5.5e34) is finite in float32 and bfloat16 (both overflow past
/// e^88.7), so no accepted value can overflow an importance ratio; the loss also clamps
/// every log-ratio to 20 (`rollout_sdk.objectives.LOG_RATIO_BOUND`).
pub const MIN_LOGPROB: f32 = -80.0;
/// Rounding room above 0 for logprobs computed in low precision.
pub const MAX_LOGPROB: f32 = 1.0e-3;

/// What the controller knows to check one worker's group against.
pub(super) struct Expected<'a> {
    pub prompt: &'a PromptRequest,
    pub sampling: &'a SamplingParams,
    /// The newest weight version sent to the worker.
    pub newest_version: u64,
    /// The policy's vocabulary size, when the controller can read it.
    pub vocabulary: Option<u64>,
}

/// Why `group` cannot be used, if it cannot.
pub(super) fn check_group(expected: &Expected<'_>, group: &[Completion]) -> Result<(), String> {
    let asked = expected.prompt.n as usize;
    if group.len() != asked {
        return Err(format!(
            "{} completions for a prompt asked {asked} times",
            group.len()
        ));
    }
    for (index, completion) in group.iter().enumerate() {
        check_completion(expected, index, completion)
            .map_err(|reason| format!("completion {index}: {reason}"))?;
    }
    Ok(())
}

fn check_completion(
    expected: &Expected<'_>,
    index: usize,
    completion: &Completion,
) -> Result<(), String> {
    let (tokens, logprobs) = (completion.token_ids.len(), completion.logprobs.len());
    if tokens != logprobs {
        return Err(format!("{tokens} tokens but {logprobs} logprobs"));
    }
    let budget = expected
        .prompt
        .max_new_tokens
        .get(index)
        .copied()
        .unwrap_or(expected.sampling.max_new_tokens) as usize;
    if tokens > budget {
        return Err(format!("{tokens} tokens past its budget of {budget}"));
    }
    if let Some(vocabulary) = expected.vocabulary
        && let Some(&id) = completion
            .token_ids
            .iter()
            .find(|&&id| u64::from(id) >= vocabulary)
    {
        return Err(format!(
            "token id {id} outside the vocabulary of {vocabulary}"
        ));
    }
    if let Some(bad) = completion
        .logprobs
        .iter()
        .find(|&&logprob| !(MIN_LOGPROB..=MAX_LOGPROB).contains(&logprob))
    {
        return Err(format!(
            "logprob {bad} outside [{MIN_LOGPROB}, 0] (or not a number)"
        ));
    }
    if completion.weight_version > expected.newest_version {
        return Err(format!(
            "weight version {} claimed, but the newest sent to this worker is {}",
            completion.weight_version, expected.newest_version
        ));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::expect_used)]
mod tests {
    use rollout_net::messages::FinishReason;

    use super::*;

    fn sampling() -> SamplingParams {
        SamplingParams::plain(4, 0)
    }

    fn prompt(n: u32) -> PromptRequest {
        PromptRequest {
            prompt_ids: vec![1, 2],
            n,
            max_new_tokens: Vec::new(),
            seed: None,
            group: None,
        }
    }

    fn completion(token_ids: Vec<u32>, logprobs: Vec<f32>, weight_version: u64) -> Completion {
        Completion {
            token_ids,
            logprobs,
            finish_reason: FinishReason::Length,
            weight_version,
        }
    }

    fn check(group: &[Completion]) -> Result<(), String> {
        let (prompt, sampling) = (prompt(2), sampling());
        let expected = Expected {
            prompt: &prompt,
            sampling: &sampling,
            newest_version: 5,
            vocabulary: Some(100),
        };
        check_group(&expected, group)
    }

    fn honest() -> Completion {
        completion(vec![3, 99], vec![-0.5, -20.0], 5)
    }

    #[test]
    fn an_honest_group_passes() {
        assert_eq!(check(&[honest(), completion(vec![], vec![], 4)]), Ok(()));
    }

    #[test]
    fn each_malformed_answer_is_refused_with_its_reason() {
        let cases = [
            (vec![honest()], "1 completions for a prompt asked 2 times"),
            (
                vec![honest(), completion(vec![3, 4], vec![-0.5], 5)],
                "completion 1: 2 tokens but 1 logprobs",
            ),
            (
                vec![honest(), completion(vec![1; 5], vec![-1.0; 5], 5)],
                "5 tokens past its budget of 4",
            ),
            (
                vec![honest(), completion(vec![100], vec![-1.0], 5)],
                "token id 100 outside the vocabulary of 100",
            ),
            (
                vec![honest(), completion(vec![1], vec![f32::NAN], 5)],
                "logprob NaN",
            ),
            (
                vec![honest(), completion(vec![1], vec![-1.0e39_f64 as f32], 5)],
                "logprob -inf",
            ),
            (
                vec![honest(), completion(vec![1], vec![0.7], 5)],
                "logprob 0.7",
            ),
            (
                vec![honest(), completion(vec![1, 2], vec![-1.0, -95.0], 5)],
                "logprob -95 outside [-80, 0]",
            ),
            (
                vec![honest(), completion(vec![1], vec![-1.0], 6)],
                "weight version 6 claimed, but the newest sent to this worker is 5",
            ),
        ];
        for (group, reason) in cases {
            let refused = check(&group).expect_err(reason);
            assert!(refused.contains(reason), "{refused} lacks {reason}");
        }
    }

    #[test]
    fn the_logprob_floor_is_accepted_and_its_ratio_is_finite() {
        let floor = completion(vec![1, 2], vec![MIN_LOGPROB, -0.0], 5);
        assert_eq!(check(&[honest(), floor]), Ok(()));
        // The largest ratio an accepted logprob allows, new logprob 0 over the floor.
        assert!((-MIN_LOGPROB).exp().is_finite());
        assert!((-MIN_LOGPROB + 8.0).exp().is_finite(), "room for rounding");
    }

    #[test]
    fn per_sample_budgets_are_the_limit_when_given() {
        let mut prompt = prompt(1);
        prompt.max_new_tokens = vec![1];
        let sampling = sampling();
        let expected = Expected {
            prompt: &prompt,
            sampling: &sampling,
            newest_version: 0,
            vocabulary: None,
        };
        let two = completion(vec![1, 2], vec![-1.0, -1.0], 0);
        assert!(check_group(&expected, &[two]).is_err());
        let one = completion(vec![1_000_000], vec![-1.0], 0);
        assert_eq!(check_group(&expected, &[one]), Ok(()));
    }
}
