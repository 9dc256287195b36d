"""The model plugin: generation, teacher-forced logprobs, training and weights."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rollout_sdk.engine import EngineStep, EngineStepOutput, KvLayout
from rollout_sdk.plugin import Plugin
from rollout_sdk.snapshot import Snapshot
from rollout_sdk.types import (
    Generation,
    GenerationRequest,
    SamplingParams,
    Sharding,
    TokenBatch,
    TrainBatch,
)

__all__ = ["Policy"]


class Policy(Plugin):
    """A trainable language model.

    The engine calls these hooks from one Python thread, in batches. Arrays follow the
    conventions of :mod:`rollout_sdk.types`. A training update is one or more ``train_step``
    calls (gradient accumulation over micro-batches) followed by one ``apply_update``.
    """

    def encode(self, texts: Sequence[str], *, continuation: bool = False) -> list[list[int]]:
        """Tokenise texts without adding an end-of-sequence token.

        A prompt (``continuation=False``) starts a sequence and gets whatever prefix the model
        expects (e.g. a BOS token); a continuation (an environment's observation appended to
        an episode's context) gets no prefix.
        """
        raise NotImplementedError

    def decode(self, token_ids: Sequence[Sequence[int]]) -> list[str]:
        """Turn generated ids back into text, dropping special tokens."""
        raise NotImplementedError

    def eos_token_ids(self) -> list[int]:
        """Ids that end a generation."""
        raise NotImplementedError

    def generate(
        self, requests: Sequence[GenerationRequest], params: SamplingParams
    ) -> list[list[Generation]]:
        """Sample ``request.n`` completions for every request, with per-token logprobs."""
        raise NotImplementedError

    def vocabulary_size(self) -> int:
        """How many token ids the model takes (ids ``0..vocabulary_size``).

        The engine checks every token id against it before the model sees one: a worker's
        completions, a tokenizer's ids, every micro-batch on the trainer. Without it (the
        default raises ``NotImplementedError``) the engine reads ``vocab_size`` from the
        ``config.json`` under the policy's ``model_path`` option, and refuses to start if
        there is none.
        """
        raise NotImplementedError

    def logprobs(self, batch: TokenBatch) -> np.ndarray:
        """Per-token logprobs ``[batch, time]`` of ``batch.input_ids`` (column 0 is 0)."""
        raise NotImplementedError

    def train_step(self, batch: TrainBatch) -> Mapping[str, Any]:
        """Forward and backward on one micro-batch, accumulating gradients.

        Returns metrics averaged over the micro-batch's masked tokens (at least ``loss``);
        the engine averages them over micro-batches by tokens, except names ending in
        ``_seconds``, which it adds up. It may add ``excluded_rows``, a list of the row
        indices it left out of the loss because their loss was not finite
        (``rollout_sdk.objectives.objective_loss`` does so): the engine counts them
        (``samples_excluded_nonfinite``) and, in a distributed run, sends away the generation
        worker that produced them. A ``loss`` that is not finite drops the whole update.

        The raw mismatch measurements (``mismatch/...`` and ``stale/...`` sums, counts and
        extremes of ``rollout_sdk.objectives.mismatch_metrics``) are combined by their own
        rules, from the first epoch only. With a rollout correction on, it may add
        ``first_logprobs``, the ``[batch, time]`` float32 logprobs of this first evaluation
        (``rollout_sdk.objectives.first_evaluation_logprobs``): later epochs receive them
        back as ``batch.first_logprobs``.
        """
        raise NotImplementedError

    def values(self, batch: TrainBatch) -> np.ndarray:
        """The value head's predictions ``[batch, time]`` (no gradient): column ``t`` is the
        value of the state before token ``t`` (column 0 unused), as for logprobs.

        Only PPO calls it, before each update; ``train_step`` then trains the same head on
        ``batch.returns``. Raise ``NotImplementedError`` (the default) if the policy has none.
        """
        raise NotImplementedError

    def apply_update(self, learning_rate: float) -> Mapping[str, float]:
        """Apply the accumulated gradients with ``learning_rate`` and clear them.

        The engine owns the schedule (warm-up, SFT vs RL rates) and passes the rate of every
        update. Returns update metrics such as ``grad_norm``.
        """
        raise NotImplementedError

    def export_weights(self) -> Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]]:
        """The current weights by parameter name, as safetensors would store them.

        A mapping, or an iterable of ``(name, array)`` pairs that the engine consumes one at a
        time (a sharded policy gathers each tensor as it is asked for).
        """
        raise NotImplementedError

    def weight_views(self) -> Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]]:
        """What ``export_weights`` returns, for the engine's weight sync: the arrays may be
        read-only views of the live parameters. A trainer serving generation workers sends
        their bytes from them in place, and copies them only before the next hook that may
        change the weights (``apply_update``, ``load``, ``release_memory``), so change the
        parameters in those hooks only. Defaults to ``export_weights``.
        """
        return self.export_weights()

    def import_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Replace the current weights (names and shapes as ``export_weights`` returns).

        The arrays are read-only views of the bytes as they arrived (copy one to change it).
        In a weight sync ``weights`` is a ``rollout_sdk.weights.StreamedWeights``: iterating
        it takes each tensor in when it is reached, so copy tensors in that loop rather than
        checking all names first (which takes every tensor in first).
        """
        raise NotImplementedError

    def trainable_parameters(self) -> list[Any]:
        """The ``torch.nn.Parameter`` objects ``apply_update`` steps, in a fixed order.

        Needed for data-parallel training (``[cluster] trainers > 1``): their gradients are
        all-reduced across trainer ranks between the micro-batches and ``apply_update``.
        """
        raise NotImplementedError

    def shard(self, sharding: Sharding) -> list[Any]:
        """Shard the model over the trainers' process group (``[train] sharding = "fsdp"``).

        Called once on every trainer rank, after the group is joined and before any training
        or checkpoint loading. Returns the sharded root modules (FSDP2 ``FSDPModule``s), whose
        gradient synchronisation the engine turns off for all but the last micro-batch of an
        update. From then on ``trainable_parameters`` may be ``DTensor``s, ``export_weights``
        may yield ``(name, array)`` pairs (full tensors on rank 0 only, every rank taking part
        in the gathers), and ``snapshot``/``save`` write this rank's shard of the state.
        Raise ``NotImplementedError`` (the default) if the policy cannot be sharded.
        """
        raise NotImplementedError

    def save(self, directory: str) -> None:
        """Write the model (``directory/model``, loadable by ``from_pretrained``) and optimizer.

        Only safetensors and JSON: never pickle. The engine makes the directory atomic.
        """
        raise NotImplementedError

    def snapshot(self) -> Snapshot:
        """The files ``save`` would write: relative path -> ``bytes`` or ``TensorFile``.

        Lets the engine write checkpoints in the background while training goes on: it copies
        the tensors before this returns (see :mod:`rollout_sdk.snapshot`), so they may view
        live memory. Raise ``NotImplementedError`` (the default) to have the engine call
        ``save`` instead, which pauses training meanwhile.
        """
        raise NotImplementedError

    def load(self, directory: str) -> None:
        """Restore what ``save`` wrote, optimizer state included."""
        raise NotImplementedError

    def kv_layout(self) -> KvLayout:
        """The cache geometry, for policies the sampling engine can drive.

        Raise ``NotImplementedError`` (the default) to have the engine call ``generate``.
        """
        raise NotImplementedError

    def allocate_kv(self, num_slots: int) -> None:
        """Allocate (or reallocate) the paged KV cache: ``num_slots`` tokens in every layer."""
        raise NotImplementedError

    def engine_step(self, step: EngineStep) -> EngineStepOutput:
        """Run one forward pass of the engine's batch and sample (see :mod:`rollout_sdk.engine`)."""
        raise NotImplementedError

    def release_memory(self) -> None:
        """Free the device memory generation holds (KV cache, weights) until ``restore_memory``.

        Called on generation workers that share their devices with trainer ranks
        (``[cluster.devices] colocate = true``) before every update. The default keeps
        everything.
        """

    def restore_memory(self) -> None:
        """Take back what ``release_memory`` freed, before the next generation."""

    def describe(self) -> Mapping[str, Any]:
        """Facts for logs and the run summary (parameter count, dtype, device...)."""
        return {}
