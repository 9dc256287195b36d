"""The model-runner side of the sampling engine for Hugging Face causal LMs.

The Rust engine schedules; :class:`EngineRunner` runs one :class:`rollout_sdk.EngineStep`:
slot copies, the optional draft model's proposals, the target's forward pass over the packed
tokens (through :mod:`python_plugins.paged_attention`) and sampling with speculative
verification (:mod:`python_plugins.engine_sampling`).
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Iterator

import numpy as np
import torch
from transformers import PreTrainedModel

from python_plugins.decode_matmuls import EngineMatmuls, engine_forward, install_engine_matmuls
from python_plugins.engine_inputs import StepLayout, check_step
from python_plugins.engine_sampling import RowSampling, propose, verify
from python_plugins.paged_attention import (
    AttentionPlan,
    CacheGeometry,
    PagedKvCache,
    has_sliding_windows,
    paged_forward,
)
from rollout_sdk import EngineStep, EngineStepOutput, KvLayout

__all__ = ["EngineRunner", "PagedModel", "available_memory", "releases_memory"]


class PagedModel:
    """One model and its paged KV cache."""

    def __init__(
        self, model: PreTrainedModel, shared_prefixes: bool = True, matmuls: EngineMatmuls = "auto"
    ) -> None:
        if not model._supports_attention_backend:
            raise NotImplementedError(
                f"{type(model).__name__} does not take its attention from transformers' "
                "AttentionInterface, so the sampling engine cannot run it"
            )
        if "logits_to_keep" not in inspect.signature(model.forward).parameters:
            raise NotImplementedError(
                f"{type(model).__name__}.forward has no `logits_to_keep`, which the sampling engine needs"
            )
        self.model = model
        install_engine_matmuls(model, matmuls)
        text_config = model.config.get_text_config()
        self.geometry = CacheGeometry.of(model.config)
        #: Whether decodes forked from one prompt read their common prefix once.
        self.shares_prefixes = shared_prefixes and not has_sliding_windows(model.config)
        self.vocab_size: int = text_config.vocab_size
        self.max_positions: int = text_config.max_position_embeddings
        self.cache: PagedKvCache | None = None
        self._released_slots = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def bytes_per_slot(self) -> int:
        return self.geometry.elements_per_slot() * self.dtype.itemsize

    def allocate(self, num_slots: int) -> None:
        self.cache = None  # release the old cache before allocating the new one
        self.cache = PagedKvCache(self.geometry, num_slots, self.model.device, self.dtype)

    def release(self) -> None:
        """Drop the KV cache (remembering its size) and move the weights to the host."""
        if self.cache is not None:
            self._released_slots = self.cache.num_slots
        self.cache = None
        self.model.to("cpu")

    def restore(self, device: torch.device) -> None:
        """Move the weights back to ``device`` and allocate an empty cache of the old size."""
        self.model.to(device)
        if self._released_slots:
            self.allocate(self._released_slots)
            self._released_slots = 0

    def logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan, at: torch.Tensor
    ) -> torch.Tensor:
        """Run the packed tokens as one sequence; the logits ``[len(at), vocab]`` of tokens ``at``."""
        assert self.cache is not None
        inputs = {"input_ids": input_ids[None], "position_ids": positions[None], "use_cache": False}
        with paged_forward(self.model, self.cache, plan), engine_forward():
            return self.model(**inputs, logits_to_keep=at).logits[0]


class EngineRunner:
    """Runs engine steps for a target model and an optional draft model sharing its slots."""

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel | None = None,
        shared_prefixes: bool = True,
        matmuls: EngineMatmuls = "auto",
    ) -> None:
        self.target = PagedModel(target, shared_prefixes, matmuls)
        self.draft = PagedModel(draft, shared_prefixes, matmuls) if draft is not None else None
        self.device = target.device
        self._forward_seconds = 0.0

    def _models(self) -> Iterator[PagedModel]:
        yield self.target
        if self.draft is not None:
            yield self.draft

    def kv_layout(self) -> KvLayout:
        """The target's geometry; with a draft model, the memory is shared in proportion.

        Both caches hold the same slots, so the engine's ``available_bytes // bytes_per_slot``
        must count the draft model's bytes per slot too: the available bytes are scaled by the
        target's share of them.
        """
        geometry = self.target.geometry
        own, total = self.target.bytes_per_slot(), sum(m.bytes_per_slot() for m in self._models())
        return KvLayout(
            num_layers=geometry.num_layers,
            num_kv_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim,
            dtype_bytes=self.target.dtype.itemsize,
            max_positions=min(m.max_positions for m in self._models()),
            available_bytes=available_memory(self.device) * own // total,
        )

    def allocate(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"allocate_kv: num_slots must be positive, got {num_slots}")
        for model in self._models():
            model.allocate(num_slots)

    def release_memory(self) -> bool:
        """Free the device memory generation holds: KV caches dropped, weights moved to the host.

        For a worker colocated with trainer ranks, before they step. Returns whether anything
        was freed: only on a CUDA device (on the host, nothing would be gained).
        """
        if not releases_memory(self.device):
            return False
        for model in self._models():
            model.release()
        # Hand the freed blocks back to the driver, so that other processes can use them.
        torch.cuda.empty_cache()
        return True

    def restore_memory(self) -> bool:
        """Undo :meth:`release_memory`: weights back on the device, empty caches of the old size."""
        if not releases_memory(self.device):
            return False
        for model in self._models():
            model.restore(self.device)
        return True

    @torch.inference_mode()
    def step(self, step: EngineStep) -> EngineStepOutput:
        cache = self.target.cache
        if cache is None:
            raise RuntimeError("engine_step before allocate_kv: the KV cache is not allocated")
        layout = check_step(
            step,
            num_slots=cache.num_slots,
            vocab_size=self.target.vocab_size,
            max_positions=min(m.max_positions for m in self._models()),
            has_draft_model=self.draft is not None,
        )
        self._forward_seconds = 0.0
        if len(step.copy_from) > 0:
            sources, targets = self._tensor(step.copy_from), self._tensor(step.copy_to)
            for model in self._models():
                assert model.cache is not None
                model.cache.copy_slots(sources, targets)
        input_ids, positions = self._tensor(step.input_ids), self._tensor(step.positions)
        sampling = RowSampling.of(step.temperature, step.top_p, step.top_k, self.device)
        uniforms = torch.tensor(step.uniforms, dtype=torch.float32, device=self.device)
        draft_lens = self._tensor(step.draft_lens)

        draft_probs = None
        if self.draft is not None:
            draft_probs = self._run_draft_model(self.draft, step, layout, input_ids, sampling, uniforms)
        plan = AttentionPlan(
            slot_mapping=step.slot_mapping,
            query_start=step.query_start,
            context_slots=step.context_slots,
            context_lens=step.context_lens,
            device=self.device,
            shared_prefixes=self.target.shares_prefixes,
        )
        read, row_of_read = np.unique(layout.logit_tokens, return_inverse=True)
        logits = self._logits(self.target, input_ids, positions, plan, self._tensor(read))
        logits = logits[self._tensor(row_of_read.reshape(-1))].view(
            *layout.logit_tokens.shape, logits.shape[-1]
        )
        drafts = input_ids[self._tensor(layout.draft_tokens)]
        tokens, logprobs, counts = verify(logits, drafts, draft_lens, sampling, uniforms, draft_probs)
        return EngineStepOutput(
            tokens=tokens.cpu().numpy(),
            logprobs=logprobs.cpu().numpy(),
            counts=counts.cpu().numpy(),
            forward_seconds=self._forward_seconds,
        )

    def _run_draft_model(
        self,
        draft: PagedModel,
        step: EngineStep,
        layout: StepLayout,
        input_ids: torch.Tensor,
        sampling: RowSampling,
        uniforms: torch.Tensor,
    ) -> torch.Tensor | None:
        """Keep the draft model's cache in step; with ``draft_with_model``, fill in the drafts.

        The draft model first runs the step's known tokens. Then, one decode forward per draft
        position, the rows still drafting feed their latest draft (writing its key/value, so the
        draft cache is complete even when every draft is accepted) and propose the next.
        Returns the proposal distributions ``[R, K, vocab]``, or ``None`` without proposals.
        """
        pending = layout.sequence_draft_lens if step.draft_with_model else np.zeros_like(layout.query_lens)
        known = np.flatnonzero(step.input_ids >= 0) if step.draft_with_model else np.arange(len(input_ids))
        known_start = np.concatenate([[0], np.cumsum(layout.query_lens - pending)])
        plan = AttentionPlan(
            slot_mapping=step.slot_mapping[known],
            query_start=known_start,
            context_slots=step.context_slots,
            context_lens=step.context_lens - pending,
            device=self.device,
            shared_prefixes=draft.shares_prefixes,
        )
        draft_lens = step.draft_lens if step.draft_with_model else np.zeros_like(step.draft_lens)
        proposing = np.flatnonzero(draft_lens > 0)
        known_ids, known_positions = self._tensor(known), self._tensor(step.positions[known])
        last_known = self._tensor(known_start[step.sample_seq[proposing] + 1] - 1)
        logits = self._logits(draft, input_ids[known_ids], known_positions, plan, last_known)
        if len(proposing) == 0:
            return None

        rows, max_drafts = layout.draft_tokens.shape
        draft_probs = torch.zeros((rows, max_drafts, self.target.vocab_size), device=self.device)
        for index in range(max_drafts):
            selected = self._tensor(proposing)
            fitted = _fit_vocab(logits, self.target.vocab_size)
            tokens, probs = propose(fitted, sampling.select(selected), uniforms[selected, index, 2])
            draft_probs[selected, index] = probs
            token_index = self._tensor(layout.draft_tokens[proposing, index])
            input_ids[token_index] = tokens
            # Feed this draft to the draft model; the rows with more drafts read the next logits.
            sequences = step.sample_seq[proposing]
            feed = AttentionPlan(
                slot_mapping=step.slot_mapping[layout.draft_tokens[proposing, index]],
                query_start=np.arange(len(proposing) + 1),
                context_slots=step.context_slots[sequences],
                context_lens=step.context_lens[sequences] - draft_lens[proposing] + index + 1,
                device=self.device,
                shared_prefixes=draft.shares_prefixes,
            )
            continuing = draft_lens[proposing] > index + 1
            logits = self._logits(
                draft,
                tokens,
                self._tensor(step.positions[layout.draft_tokens[proposing, index]]),
                feed,
                self._tensor(np.flatnonzero(continuing)),
            )
            proposing = proposing[continuing]
        return draft_probs

    def _logits(
        self,
        model: PagedModel,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        at: torch.Tensor,
    ) -> torch.Tensor:
        started = time.perf_counter()
        logits = model.logits(input_ids, positions, plan, at)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._forward_seconds += time.perf_counter() - started
        return logits

    def _tensor(self, values: np.ndarray) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A draft model's logits over the target's vocabulary: padded with -inf or cut."""
    return torch.nn.functional.pad(logits.float(), (0, vocab_size - logits.shape[-1]), value=float("-inf"))


def releases_memory(device: torch.device) -> bool:
    """Whether releasing generation memory frees anything: only a CUDA device is shared with
    trainer processes (on the host, every process has its own memory anyway)."""
    return device.type == "cuda"


def available_memory(device: torch.device) -> int:
    """Free bytes on ``device``: CUDA's free memory, else the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
