"""Sampling with the model's own KV cache, all of a call's samples in one left-padded batch.

The policy's ``generate`` for models the sampling engine cannot run (and for runs without
it): every row decodes until all rows have stopped or reached ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from python_plugins.sampling import select_tokens
from rollout_sdk import Generation, SamplingParams

__all__ = ["generate_batched"]


def generate_batched(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    pad_id: int,
    eos_ids: Sequence[int],
    device: torch.device,
    keeps_last_logits_only: bool,
) -> list[Generation]:
    """One generation per prompt (none empty), stopping at an EOS or stop token;
    ``keeps_last_logits_only``: the model's forward takes ``logits_to_keep``."""
    input_ids, attention_mask = left_padded(prompts, pad_id, device)
    positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    rows = len(prompts)
    stop_ids = torch.tensor(sorted({*eos_ids, *params.stop_token_ids}), dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(params.seed)
    tokens = torch.full((rows, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((rows, params.max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    stopped = torch.zeros(rows, dtype=torch.bool, device=device)
    cache = None
    for step in range(params.max_new_tokens):
        output = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            **({"logits_to_keep": 1} if keeps_last_logits_only else {}),
        )
        cache = output.past_key_values
        chosen, chosen_logprobs = select_tokens(output.logits[:, -1], params, generator)
        active = ~stopped
        chosen = torch.where(active, chosen, pad_id)
        tokens[:, step] = chosen
        logprobs[:, step] = chosen_logprobs
        lengths += active.long()
        stopped |= active & torch.isin(chosen, stop_ids)
        if bool(stopped.all()):
            break
        input_ids = chosen.unsqueeze(-1)
        positions = positions[:, -1:] + 1
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((rows, 1))], dim=-1)
    return [
        Generation(
            token_ids=tokens[row, :length].cpu().numpy().astype(np.int64),
            logprobs=logprobs[row, :length].cpu().numpy().astype(np.float32),
            finish_reason="stop" if bool(stopped[row]) else "length",
        )
        for row, length in enumerate(lengths.tolist())
    ]


def left_padded(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, each prompt right-aligned behind padding."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)
