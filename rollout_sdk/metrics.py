"""What a run reports each step: :class:`StepMetrics`, one line of ``metrics.jsonl``.

Callbacks receive it in ``on_step_end``. The engine defines the same fields
(``rollout_core::metrics::StepMetrics``), and a test holds the two together.
"""

from __future__ import annotations

from typing import TypedDict

__all__ = ["StepMetrics"]


class _EveryStep(TypedDict):
    """The keys every line has."""

    step: int
    #: The data epoch the step's records were drawn in.
    epoch: int
    #: The policy's weight version after the step's update.
    weight_version: int
    #: Wall time since the previous step ended.
    step_seconds: float
    #: Wall time since the run (or its resume) started.
    elapsed_seconds: float


class StepMetrics(_EveryStep, total=False):
    """One step of a run. An RL step fills the sampling fields, an SFT or DPO step the update's,
    a multi-agent step the episodes'; optional fields are absent when they do not apply.

    Besides these keys a line holds measurements named by whoever took them: the policy's
    training metrics besides ``loss`` (``grad_norm``, ``kl``...), each reward's mean
    (``reward/<name>``), the training/inference mismatch (``mismatch/...``, ``stale/...``) and
    rollout correction (``correction/...``), the sampling engine's (``engine/...``), the generation pool's
    (``workers``, ``leases``..., ``worker_completions/<worker>``), samples and updates left out of
    training (``samples_excluded_<reason>``, ``updates_skipped_<reason>``) and, in a multi-agent
    run, each agent's (``<agent>/...``); all of them numbers.
    """

    learning_rate: float
    #: The update's token-mean loss.
    loss: float
    #: Mean and deviation of the scored samples' rewards (multi-agent: the agents' mean returns,
    #: averaged).
    reward_mean: float
    reward_std: float
    #: Samples whose reward could not be computed, in all and by reason.
    reward_failed: int
    reward_failed_raised: int
    reward_failed_timeout: int
    reward_failed_crashed: int
    reward_failed_memory: int
    reward_failed_invalid: int
    #: Multi-turn: the mean return of the episodes played to their end.
    env_return_mean: float
    #: Multi-turn: episodes whose environment failed, in all and by reason.
    environment_failed: int
    environment_failed_raised: int
    environment_failed_timeout: int
    environment_failed_crashed: int
    environment_failed_memory: int
    environment_failed_invalid: int
    environment_failed_restarted: int
    completions: int
    prompt_tokens: int
    #: Tokens of the trained sequences, prompts and observations included.
    sequence_tokens: int
    generated_tokens: int
    completion_length_mean: float
    completion_length_max: int
    #: Completions cut off at `max_new_tokens`.
    truncated_fraction: float
    #: Groups whose rewards were all equal (no advantage).
    zero_std_group_fraction: float
    #: DAPO dynamic sampling: groups replaced, and the rounds it took.
    refilled_groups: int
    refill_rounds: int
    #: Groups generated again for lagging past `cluster.max_staleness`, and those still
    #: stale after the last round, left out of the update.
    stale_groups_regenerated: int
    stale_groups_dropped: int
    micro_batches: int
    trained_rows: int
    #: Rows with exactly zero advantage, left out of the update.
    skipped_rows: int
    padding_fraction: float
    #: SFT and DPO: tokens the loss was computed on.
    tokens: int
    generate_seconds: float
    score_seconds: float
    train_seconds: float
    weight_sync_seconds: float
    #: Weight versions the step's samples lag the trained policy: most and mean.
    staleness_max: int
    staleness_mean: float
    samples_per_second: float
    tokens_per_second: float
    #: The oldest weight version that generated any of the step's samples.
    generation_weight_version: int
    #: Multi-agent: episodes played, their mean turns, those cut at `max_turns`.
    episodes: int
    episode_turns_mean: float
    truncated_episodes: int
    environment_seconds: float
