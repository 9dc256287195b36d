"""Building HFCausalLM instances and batches for the policy tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from python_plugins.hf_policy import HFCausalLM
from rollout_sdk import GenerationRequest, GrpoObjective, SftObjective, TokenBatch, TrainBatch
from rollout_sdk.testing import load_plugin

PROMPTS = ["12+34=", "7+8=", "what is 99+1? ", "a"]
LR = 1e-2
PAIRS = [("1+2=", "3"), ("20+22=", "42"), ("5+5=", "10"), ("7+0=", "7")]


def make_policy(model_dir: Path, **options) -> HFCausalLM:
    return load_plugin("python_plugins.hf_policy:HFCausalLM", {"model_path": str(model_dir), **options})


def requests(policy: HFCausalLM, prompts=PROMPTS, n: int = 1) -> list[GenerationRequest]:
    return [
        GenerationRequest(prompt_ids=np.asarray(ids, dtype=np.int64), n=n) for ids in policy.encode(prompts)
    ]


def right_padded(sequences: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(s) for s in sequences)
    ids = np.zeros((len(sequences), width), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return ids, mask


def sft_batch(policy: HFCausalLM, pairs: list[tuple[str, str]]) -> TrainBatch:
    """Questions as context, answers plus EOS as targets."""
    eos = policy.eos_token_ids()[0]
    questions = policy.encode([q for q, _ in pairs])
    answers = policy.encode([a for _, a in pairs])
    ids, mask = right_padded([q + a + [eos] for q, a in zip(questions, answers, strict=True)])
    loss_mask = np.zeros(ids.shape, dtype=np.float32)
    for row, (q, a) in enumerate(zip(questions, answers, strict=True)):
        loss_mask[row, len(q) : len(q) + len(a) + 1] = 1.0
    return TrainBatch(
        input_ids=ids,
        attention_mask=mask,
        loss_mask=loss_mask,
        advantages=np.zeros_like(loss_mask),
        old_logprobs=np.zeros_like(loss_mask),
        loss_scale=1.0 / float(loss_mask.sum()),
        objective=SftObjective(),
    )


def grpo_batch(policy: HFCausalLM, objective: GrpoObjective) -> TrainBatch:
    """Fixed completions with alternating advantages; old logprobs from the current policy."""
    prompts = policy.encode(["1+1=", "2+2=", "3+3="])
    completions = policy.encode(["2", "5", "6"])
    ids, mask = right_padded([p + c for p, c in zip(prompts, completions, strict=True)])
    loss_mask = np.zeros(ids.shape, dtype=np.float32)
    for row, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        loss_mask[row, len(p) : len(p) + len(c)] = 1.0
    old = policy.logprobs(TokenBatch(input_ids=ids, attention_mask=mask, temperature=objective.temperature))
    advantages = np.asarray([[1.0], [-1.0], [1.0]], dtype=np.float32) * loss_mask
    return TrainBatch(
        input_ids=ids,
        attention_mask=mask,
        loss_mask=loss_mask,
        advantages=advantages,
        old_logprobs=old * loss_mask,
        loss_scale=1.0 / float(loss_mask.sum()),
        objective=objective,
    )
