"""A generation backend that samples for the policy with weights of its own (e.g. vLLM)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from rollout_sdk.plugin import Plugin
from rollout_sdk.types import Generation, GenerationRequest, SamplingParams

__all__ = ["GenerationEngine"]


class GenerationEngine(Plugin):
    """Samples completions in place of Rollout's own engine (``[engine] backend``).

    The policy plugin stays the run's tokenizer and learner; the engine holds a copy of the
    weights to sample with, loaded at start from the policy's model directory (its ``model``
    option) and replaced by :meth:`load_weights` at every weight version. The engine calls
    these hooks from one Python thread.
    """

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        stop_strings: Sequence[str],
        ignore_eos: bool,
    ) -> list[list[Generation]]:
        """Sample ``request.n`` completions for every request, as ``Policy.generate`` does.

        ``params.stop_token_ids`` already holds the policy's end-of-sequence ids (unless
        ``ignore_eos``). A completion that contains one of ``stop_strings`` once decoded ends
        with the token that completed it. Logprobs are those of the temperature-scaled
        distribution before top-p/top-k truncation, the quantity the trainer computes.
        """
        raise NotImplementedError

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Replace the weights sampled with by ``weights`` (the policy's names and shapes,
        all of them; a ``rollout_sdk.weights.StreamedWeights`` in a weight sync). Nothing
        cached from the previous weights (a prefix cache) may be reused afterwards."""
        raise NotImplementedError

    def release_memory(self) -> None:
        """Free the device memory the engine holds while trainers colocated with it train."""

    def restore_memory(self) -> None:
        """Take back what :meth:`release_memory` freed before the next ``generate``."""
