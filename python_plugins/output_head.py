"""Teacher-forced logprobs from a causal LM's last hidden states and its output layer.

Instead of the model's ``[rows, width, vocab]`` logits, the decoder (the model without its
output layer) gives the hidden states and :func:`rollout_sdk.fused_logprobs.chunked_logprobs`
applies the output layer a chunk of tokens at a time, only at the tokens that are predicted.
That is exact only when the model's logits are a plain ``nn.Linear`` of the decoder's output:
:func:`output_head` checks the output layer and the config, then compares both ways once per
model on a few tokens, and returns ``None`` for any model where they differ (softcapped or
scaled logits, a quantized or adapter-wrapped output layer, ...); callers then use the logits.
The same probe tells whether the model keeps packed sequences apart (:mod:`python_plugins.packing`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedModel

from python_plugins.model_setup import BaseWithoutAdapters
from python_plugins.packing import Packing
from rollout_sdk.fused_logprobs import chunked_logprobs
from rollout_sdk.objectives import token_logprobs

__all__ = ["OutputHead", "output_head", "predicted_logprobs", "predicted_tokens", "sequence_logprobs"]

# Config entries of models whose logits are more than a linear layer of the hidden states.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
# Attention implementations whose masks transformers builds from packed position ids.
PACKING_ATTENTION = ("sdpa", "eager")
PROBE_TOKENS = (6, 5)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class OutputHead:
    """A model's decoder and its output layer, to call separately; ``packs`` if packed sequences
    stay apart. ``reference`` is set for the LoRA base without adapters, whose decoder runs with
    the adapters disabled and in eval mode, as :class:`BaseWithoutAdapters` runs the model."""

    decoder: torch.nn.Module = dataclasses.field(repr=False)
    linear: torch.nn.Linear
    packs: bool
    reference: BaseWithoutAdapters | None = dataclasses.field(default=None, repr=False)

    def hidden(self, **inputs: Any) -> torch.Tensor:
        """The decoder's last hidden states (after its final norm) for the model's inputs."""
        with self._mode():
            return self.decoder(**inputs).last_hidden_state

    def logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """Float32 logprob ``[N]`` of each of ``targets [N]`` after ``hidden [N, H]``."""
        return chunked_logprobs(hidden, self.linear.weight, self.linear.bias, targets, temperature)

    @contextlib.contextmanager
    def _mode(self) -> Iterator[None]:
        if self.reference is None:
            yield
            return
        adapters = self.reference.adapters
        model = adapters.model
        was_training = model.training
        with adapters.peft_model.disable_adapter():
            if was_training:
                model.eval()
            try:
                yield
            finally:
                if was_training:
                    model.train()


_probed: weakref.WeakKeyDictionary[torch.nn.Module, tuple[torch.nn.Module, torch.nn.Linear, bool] | None] = (
    weakref.WeakKeyDictionary()
)


def output_head(model: Any) -> OutputHead | None:
    """The model's :class:`OutputHead`, or ``None`` when its logits are not exactly the plain
    linear output layer applied to the decoder's last hidden state."""
    reference = model if isinstance(model, BaseWithoutAdapters) else None
    base = reference.adapters.model if reference is not None else model
    if not isinstance(base, PreTrainedModel):
        return None
    if base not in _probed:
        _probed[base] = _probe(base)
    found = _probed[base]
    if found is None:
        return None
    decoder, linear, packs = found
    return OutputHead(decoder=decoder, linear=linear, packs=packs, reference=reference)


def _probe(model: PreTrainedModel) -> tuple[torch.nn.Module, torch.nn.Linear, bool] | None:
    config = model.config
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS):
        return None
    linear = model.get_output_embeddings()
    if type(linear) is not torch.nn.Linear:  # subclasses: quantized or adapter-wrapped layers
        return None
    if any(p is not None and type(p) is not torch.nn.Parameter for p in (linear.weight, linear.bias)):
        return None
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        return None
    if not isinstance(decoder, torch.nn.Module) or decoder is model:
        return None
    lengths = PROBE_TOKENS
    total = sum(lengths)
    device = linear.weight.device
    ids = (torch.arange(total, device=device) * 7 + 3) % linear.out_features
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            whole = _inputs(ids[None], torch.arange(total, device=device)[None])
            logits = model(**whole, attention_mask=torch.ones_like(ids[None])).logits
            hidden = decoder(**whole, attention_mask=torch.ones_like(ids[None])).last_hidden_state
            if not torch.equal(linear(hidden), logits) and not _close(linear(hidden), logits, 1e-5):
                return None
            packs = config._attn_implementation in PACKING_ATTENTION and _keeps_packed_apart(
                decoder, ids, lengths
            )
    except Exception:  # a model the decoder cannot run alone: use its logits
        return None
    finally:
        model.train(was_training)
    return decoder, linear, packs


def _keeps_packed_apart(decoder: torch.nn.Module, ids: torch.Tensor, lengths: tuple[int, ...]) -> bool:
    pieces = ids.split(list(lengths))
    positions = torch.cat([torch.arange(len(p), device=ids.device) for p in pieces])
    packed = decoder(**_inputs(ids[None], positions[None]), attention_mask=None).last_hidden_state[0]
    alone = [
        decoder(**_inputs(p[None], positions[: len(p)][None]), attention_mask=None).last_hidden_state[0]
        for p in pieces
    ]
    tolerance = 1e-4 if packed.dtype == torch.float32 else 2e-2
    return _close(packed, torch.cat(alone), tolerance)


def _inputs(ids: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
    return {"input_ids": ids, "position_ids": positions, "use_cache": False}


def _close(got: torch.Tensor, expected: torch.Tensor, relative: float) -> bool:
    error = (got.float() - expected.float()).norm()
    return bool(error <= relative * expected.float().norm().clamp_min(1e-12))


def predicted_tokens(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens of a ``[rows, width]`` batch get a logprob (every token but column 0 and
    padding), and the flat index of the position before each, in row-major order."""
    rows, width = attention_mask.shape
    columns = torch.arange(width, device=attention_mask.device).expand(rows, width)
    predicted = (attention_mask != 0) & (columns >= 1)
    flat_index = torch.arange(rows * width, device=attention_mask.device).view(rows, width)
    return predicted, flat_index[predicted] - 1


def predicted_logprobs(
    head: OutputHead,
    hidden: torch.Tensor,
    source: torch.Tensor,
    targets: torch.Tensor,
    predicted: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """``[rows, width]`` float32 logprobs, 0 except where ``predicted``: there, in row-major order,
    the logprob of ``targets`` after ``hidden`` (flattened to ``[positions, H]``) at ``source``."""
    flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, source)
    picked = head.logprobs(flat, targets, temperature)
    return picked.new_zeros(predicted.shape).masked_scatter(predicted, picked)


def sequence_logprobs(
    model: Any,
    head: OutputHead | None,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    packing: Packing | None = None,
) -> torch.Tensor:
    """Logprob ``[rows, width]`` of each token given the ones before it (column 0 and padding 0).

    Without a ``head``, from the model's full logits (as ``token_logprobs``, padding included).
    With ``packing`` (right-padded rows only), the rows run packed.
    """
    positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    if head is None:
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False
        ).logits
        return token_logprobs(logits, input_ids, temperature)
    if packing is None:
        hidden = head.hidden(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False
        )
        predicted, source = predicted_tokens(attention_mask)
    else:
        # A row's last token predicts nothing: the bins hold the tokens before it.
        inputs = attention_mask.sum(dim=1) - 1
        packed_ids, packed_positions, destination = packing.layout(input_ids, inputs)
        hidden = head.hidden(
            input_ids=packed_ids, position_ids=packed_positions, attention_mask=None, use_cache=False
        )
        columns = torch.arange(input_ids.shape[1], device=input_ids.device)
        predicted = (attention_mask != 0) & (columns >= 1)
        where = torch.full_like(input_ids, -1)
        where[columns[None, :] < inputs[:, None]] = destination
        # Token (row, c) follows the packed position of (row, c - 1).
        source = where[:, :-1][predicted[:, 1:]]
    return predicted_logprobs(head, hidden, source, input_ids[predicted], predicted, temperature)
