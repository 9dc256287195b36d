"""A policy backed by any local Hugging Face causal language model directory."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer, PreTrainedModel
from transformers.utils import logging as transformers_logging

from python_plugins.batch_generation import generate_batched
from python_plugins.checkpoint_io import load_optimizer, model_files, optimizer_files, tokenizer_files
from python_plugins.decode_matmuls import EngineMatmuls
from python_plugins.distinct_rows import DistinctRows, distinct_rows, take_distinct
from python_plugins.engine_runner import EngineRunner
from python_plugins.hub_cache import resolve_model_path
from python_plugins.model_setup import (
    ADAPTER_CONFIG,
    DEFAULT_LORA_TARGETS,
    CpuOffloadOptimizer,
    LoraAdapters,
    build_optimizer,
    check_memory_options,
    load_model,
)
from python_plugins.output_head import OutputHead, output_head, sequence_logprobs
from python_plugins.packing import Packing, plan_right_padded
from python_plugins.sharded_checkpoint import is_sharded_checkpoint, load_state, state_files
from python_plugins.sharding import check_shardable, gathered_on_rank0, shard_model
from python_plugins.shared_prefix import plan_shared_prefixes, shared_prefix_logprobs
from python_plugins.suffix_packing import packs_suffixes
from python_plugins.value_head import ValueHead, logprobs_and_hidden
from python_plugins.weight_io import (
    float32_copies,
    float32_views,
    import_into_parameters,
    load_safetensors_weights,
)
from rollout_sdk import (
    EngineStep,
    EngineStepOutput,
    Generation,
    GenerationRequest,
    KvLayout,
    Policy,
    SamplingParams,
    Sharding,
    TokenBatch,
    TrainBatch,
)
from rollout_sdk.objectives import first_evaluation_logprobs, needs_reference, needs_values, objective_loss
from rollout_sdk.snapshot import TensorFile, write_snapshot

__all__ = ["HFCausalLM"]

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFCausalLM(Policy):
    """Generation with a KV cache, teacher-forced logprobs and AdamW training of one HF model.

    It also runs the sampling engine's steps over a paged KV cache (``kv_layout``,
    ``allocate_kv``, ``engine_step``), optionally with a draft model for speculative decoding.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        model_path: str
        # Frozen reference for the KL term; defaults to `model_path`. Always the original
        # weights, also after resuming from a checkpoint.
        reference_model_path: str | None = None
        dtype: Literal["float32", "bfloat16", "float16"] = "float32"
        device: str = "cpu"
        weight_decay: float = 0.0
        adam_betas: tuple[float, float] = (0.9, 0.999)
        adam_eps: float = 1e-8
        # 0 disables clipping (the gradient norm is still reported).
        max_grad_norm: float = 1.0
        gradient_checkpointing: bool = False
        # 0 keeps torch's default number of CPU threads.
        torch_threads: int = 0
        # A small causal LM sharing the tokenizer that proposes drafts for the sampling engine's
        # speculative decoding (steps with `draft_with_model`). Never trained.
        draft_model_path: str | None = None
        # Training passes run each distinct prompt once and only the completions per sample
        # (same result; turn off for models whose forward cannot take a KV cache).
        share_prompt_prefix: bool = True
        # Training passes run rows that are the same token for token once (same result; see
        # python_plugins/distinct_rows.py).
        share_identical_rows: bool = True
        # The sampling engine attends the decodes of one prompt's samples over their common
        # prefix once (python_plugins/cascade_attention.py; same result up to float rounding).
        shared_prefix_attention: bool = True
        # The sampling engine's matmuls over few rows (python_plugins/decode_matmuls.py).
        engine_matmuls: EngineMatmuls = "auto"
        # Memory (python_plugins/model_setup.py, docs/memory.md). `lora_rank` > 0 trains only
        # LoRA adapters (PEFT) on the frozen base; 0 is full fine-tuning.
        lora_rank: int = 0
        lora_alpha: float = 16.0
        lora_dropout: float = 0.0
        lora_target_modules: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
        # Frozen base weights in 8 or 4 bits (bitsandbytes; needs lora_rank > 0), and separately
        # the frozen KL reference's.
        quantization: Literal["none", "int8", "nf4"] = "none"
        reference_quantization: Literal["none", "int8", "nf4"] = "none"
        optimizer: Literal["adamw", "adamw_8bit"] = "adamw"
        # Optimizer state (and its copy of the trained weights) in CPU memory; for GPU runs.
        offload_optimizer: bool = False
        # PPO's value head (python_plugins/value_head.py) learns at this fixed rate; unset, at
        # the policy's rate of each update.
        value_learning_rate: float | None = None

        def __post_init__(self) -> None:
            # Hub ids (`org/name`) not on disk are read from the local Hugging Face cache.
            for name in ("model_path", "reference_model_path", "draft_model_path"):
                if getattr(self, name) is not None:
                    setattr(self, name, resolve_model_path(getattr(self, name)))
            for name in ("weight_decay", "adam_eps", "max_grad_norm", "torch_threads"):
                if getattr(self, name) < 0:
                    raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
            check_memory_options(self)

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        # Progress bars for loading and saving shards would interleave with the run's log.
        transformers_logging.disable_progress_bar()
        if config.torch_threads > 0:
            torch.set_num_threads(config.torch_threads)
        self.device = _resolve_device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.model = self._load_model(config.model_path, config.quantization)
        # With LoRA, `self.model` is the same model with adapters in its target layers.
        self.lora: LoraAdapters | None = None
        if config.lora_rank > 0:
            self.lora = LoraAdapters(
                self.model,
                rank=config.lora_rank,
                alpha=config.lora_alpha,
                dropout=config.lora_dropout,
                target_modules=config.lora_target_modules,
                base_model_path=config.model_path,
            )
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.reference: PreTrainedModel | None = None
        self.value_head: ValueHead | None = None
        self.trainable = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        # The engine passes the learning rate of every update to `apply_update`.
        self.optimizer: torch.optim.Optimizer | CpuOffloadOptimizer = build_optimizer(
            [p for _, p in self.trainable], config, self.device
        )
        self.bos_prefix = _default_bos_prefix(self.tokenizer)
        self.eos_ids = self._find_eos_token_ids()
        self.pad_id = _first_not_none(self.tokenizer.pad_token_id, *self.eos_ids, 0)
        self.keeps_last_logits_only = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.draft_model: PreTrainedModel | None = None
        if config.draft_model_path is not None:
            self.draft_model = self._load_model(config.draft_model_path).eval().requires_grad_(False)
        # Set by `shard`; then `checkpoint_keys` names each trainable parameter in checkpoints.
        self.sharding: Sharding | None = None
        self.checkpoint_keys: dict[str, str] = {}

    def _set_training(self, training: bool) -> None:
        # `Module.train` walks every submodule: skip it when the mode is already right, since
        # the engine calls this once per decode step.
        if self.model.training != training:
            self.model.train(training)

    def _load_model(self, path: str, quantization: str = "none") -> PreTrainedModel:
        return load_model(path, dtype=self.dtype, device=self.device, quantization=quantization)

    def _find_eos_token_ids(self) -> list[int]:
        candidates = [
            getattr(self.model.generation_config, "eos_token_id", None),
            self.tokenizer.eos_token_id,
        ]
        ids: list[int] = []
        for value in candidates:
            for token in value if isinstance(value, (list, tuple)) else [value]:
                if token is not None and int(token) not in ids:
                    ids.append(int(token))
        return ids

    # Text

    def encode(self, texts: Sequence[str], *, continuation: bool = False) -> list[list[int]]:
        """Tokenise without special tokens, except the leading BOS a tokenizer adds by default.

        Tokenizers that put a BOS in front of every text (Llama's, for one) get it on prompts,
        because their models expect it, but not on continuations; an EOS is never added.
        """
        if not texts:
            return []
        encoded = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        prefix = [] if continuation else self.bos_prefix
        return [prefix + list(ids) for ids in encoded]

    def decode(self, token_ids: Sequence[Sequence[int]]) -> list[str]:
        if not token_ids:  # batch_decode([]) returns [""] in transformers 5
            return []
        return self.tokenizer.batch_decode(
            [list(map(int, ids)) for ids in token_ids], skip_special_tokens=True
        )

    def eos_token_ids(self) -> list[int]:
        return list(self.eos_ids)

    # Generation and scoring

    @torch.inference_mode()
    def generate(
        self, requests: Sequence[GenerationRequest], params: SamplingParams
    ) -> list[list[Generation]]:
        """Sample every request ``n`` times in one left-padded batch, reusing the KV cache."""
        prompts = [[int(t) for t in request.prompt_ids] for request in requests for _ in range(request.n)]
        if not prompts:
            return [[] for _ in requests]
        if any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("cannot generate from an empty prompt")
        self._set_training(False)
        generations = generate_batched(
            self.model,
            prompts,
            params,
            pad_id=self.pad_id,
            eos_ids=self.eos_ids,
            device=self.device,
            keeps_last_logits_only=self.keeps_last_logits_only,
        )
        groups: list[list[Generation]] = []
        for request in requests:
            groups.append(generations[: request.n])
            generations = generations[request.n :]
        return groups

    @torch.inference_mode()
    def logprobs(self, batch: TokenBatch) -> np.ndarray:
        self._set_training(False)
        input_ids, attention_mask = self._as_tensors(batch.input_ids, batch.attention_mask)
        result = self._token_logprobs(self.model, input_ids, attention_mask, batch.temperature)
        return (result * attention_mask).cpu().numpy().astype(np.float32)

    def _as_tensors(
        self, input_ids: np.ndarray, attention_mask: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # torch.tensor copies, so read-only arrays from the engine are fine.
        return (
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(attention_mask, dtype=torch.long, device=self.device),
        )

    def _token_logprobs(
        self,
        model: PreTrainedModel,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        temperature: float,
        packing: Packing | None = None,
    ) -> torch.Tensor:
        """Per-token logprobs (python_plugins/output_head.py); ``packing`` is used if the model can."""
        head = self._output_head(model)
        if head is None or not head.packs:
            packing = None
        return sequence_logprobs(model, head, input_ids, attention_mask, temperature, packing)

    def _output_head(self, model: PreTrainedModel) -> OutputHead | None:
        """The chunked output layer, or ``None`` to use the model's logits. Sharded, always
        ``None``: FSDP gathers the output layer's weight in the root module's forward pass,
        which running the decoder alone would bypass."""
        return None if self.sharding is not None else output_head(model)

    # Sampling engine

    @functools.cached_property
    def engine_runner(self) -> EngineRunner:
        # Built on first use: for a model it cannot run, `kv_layout` raises NotImplementedError
        # and the engine falls back to `generate`.
        return EngineRunner(
            self.model,
            self.draft_model,
            shared_prefixes=self.config.shared_prefix_attention,
            matmuls=self.config.engine_matmuls,
        )

    def kv_layout(self) -> KvLayout:
        return self.engine_runner.kv_layout()

    def allocate_kv(self, num_slots: int) -> None:
        self.engine_runner.allocate(num_slots)

    def engine_step(self, step: EngineStep) -> EngineStepOutput:
        self._set_training(False)
        return self.engine_runner.step(step)

    # Training

    def train_step(self, batch: TrainBatch) -> Mapping[str, Any]:
        objective = batch.objective
        temperature = getattr(objective, "temperature", 1.0)
        self._set_training(True)
        distinct = self._distinct_rows(batch)
        pass_logprobs = self._logprob_pass(batch, temperature, distinct)
        values = None
        if needs_values(objective):
            input_ids, attention_mask = self._as_tensors(
                *take_distinct(distinct, batch.input_ids, batch.attention_mask)
            )
            head = self._output_head(self.model)
            logprobs, hidden = logprobs_and_hidden(self.model, input_ids, attention_mask, temperature, head)
            values = self._value_head()(hidden)
            if distinct is not None:
                logprobs, values = distinct.spread(logprobs), distinct.spread(values)
        else:
            logprobs = pass_logprobs(self.model)
        ref_logprobs = None
        reference_seconds = 0.0
        if needs_reference(objective):
            started = time.perf_counter()
            with torch.no_grad():
                ref_logprobs = pass_logprobs(self._reference())
            reference_seconds = time.perf_counter() - started
        output = objective_loss(logprobs, batch, ref_logprobs=ref_logprobs, values=values)
        output.loss.backward()
        metrics: dict[str, Any] = {**output.metrics, "reference_seconds": reference_seconds}
        first_logprobs = first_evaluation_logprobs(logprobs, batch)
        if first_logprobs is not None:
            metrics["first_logprobs"] = first_logprobs
        if output.excluded_rows:
            metrics["excluded_rows"] = output.excluded_rows
        return metrics

    def _distinct_rows(self, batch: TrainBatch) -> DistinctRows | None:
        """The micro-batch's distinct rows, where some rows are copies and sharing is on."""
        if not self.config.share_identical_rows:
            return None
        return distinct_rows(batch.input_ids, batch.attention_mask, batch.loss_mask)

    def _logprob_pass(
        self, batch: TrainBatch, temperature: float, distinct: DistinctRows | None
    ) -> Callable[[PreTrainedModel], torch.Tensor]:
        """How a model computes the micro-batch's ``[rows, width]`` logprobs: each of the
        ``distinct`` rows once (python_plugins/distinct_rows.py), each shared prompt once
        (python_plugins/shared_prefix.py), else packed without padding (python_plugins/packing.py)."""
        objective = batch.objective
        # The value head reads every position's hidden state, so PPO runs whole rows. Gradient
        # checkpointing turns the KV cache off inside the model, so nothing to share. Sharded
        # ranks gather weights in every forward pass, with each other: they must all run one
        # per micro-batch, not as many as their prompts' sharing plan asks.
        share = (
            self.config.share_prompt_prefix
            and not self.config.gradient_checkpointing
            and not needs_values(objective)
            and self.sharding is None
        )
        input_ids, attention_mask, loss_mask = take_distinct(
            distinct, batch.input_ids, batch.attention_mask, batch.loss_mask
        )
        plan = (
            plan_shared_prefixes(input_ids, attention_mask, loss_mask, packs_suffixes(self.model.config))
            if share
            else None
        )
        packing = plan_right_padded(attention_mask) if plan is None and self.sharding is None else None

        def pass_logprobs(model: PreTrainedModel) -> torch.Tensor:
            if plan is not None:
                logprobs = shared_prefix_logprobs(
                    model, plan, temperature, self.device, self._output_head(model)
                )
            else:
                tensors = self._as_tensors(input_ids, attention_mask)
                logprobs = self._token_logprobs(model, *tensors, temperature, packing)
            return logprobs if distinct is None else distinct.spread(logprobs)

        return pass_logprobs

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> np.ndarray:
        self._set_training(False)
        distinct = self._distinct_rows(batch)
        input_ids, attention_mask = self._as_tensors(
            *take_distinct(distinct, batch.input_ids, batch.attention_mask)
        )
        head = self._output_head(self.model)
        if head is not None:
            positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
            hidden = head.hidden(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False
            )
        else:
            _, hidden = logprobs_and_hidden(self.model, input_ids, attention_mask, 1.0)
        values = self._value_head()(hidden) * attention_mask
        if distinct is not None:
            values = distinct.spread(values)
        return values.cpu().numpy().astype(np.float32)

    def _value_head(self) -> ValueHead:
        if self.value_head is None:
            self.value_head = ValueHead(
                self.model.config.hidden_size,
                self.device,
                betas=self.config.adam_betas,
                eps=self.config.adam_eps,
                max_grad_norm=self.config.max_grad_norm,
                learning_rate=self.config.value_learning_rate,
            )
        return self.value_head

    def _reference(self) -> PreTrainedModel:
        if self.reference is None and self.lora is not None and self.config.reference_model_path is None:
            # The base weights with the adapters disabled: no second copy of the model.
            self.reference = cast(PreTrainedModel, self.lora.reference())
        if self.reference is None:
            path = self.config.reference_model_path or self.config.model_path
            reference = self._load_model(path, self.config.reference_quantization)
            self.reference = reference.eval().requires_grad_(False)
            if self.sharding is not None:
                # Frozen: gathered block by block for its forward pass, then freed again.
                shard_model(self.reference, dataclasses.replace(self.sharding, reshard_after_forward=True))
        return self.reference

    def apply_update(self, learning_rate: float) -> Mapping[str, float]:
        if learning_rate < 0:
            raise ValueError(f"learning_rate must not be negative, got {learning_rate}")
        grads = [p.grad for _, p in self.trainable if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        if self.config.max_grad_norm > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(
                [p for _, p in self.trainable], self.config.max_grad_norm, grad_norm
            )
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        norm = float(grad_norm)
        metrics = {"grad_norm": norm, "learning_rate": float(learning_rate)}
        # Never step on a non-finite gradient (the engine drops one before it gets here), nor
        # on an exactly zero one (PPO's critic warm-up): Adam's momentum would move the weights.
        if not math.isfinite(norm):
            metrics = {"updates_skipped_nonfinite": 1.0, "learning_rate": float(learning_rate)}
        elif norm > 0.0:
            self.optimizer.step()
        else:
            metrics["updates_skipped_zero_gradient"] = 1.0
        self.optimizer.zero_grad(set_to_none=True)
        if self.value_head is not None:
            metrics.update(self.value_head.apply_update(learning_rate))
        return metrics

    def vocabulary_size(self) -> int:
        """Rows of the input embedding: every token id the model can take is below it."""
        return int(self.model.get_input_embeddings().num_embeddings)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        head = self.value_head.named_parameters() if self.value_head is not None else []
        return [p for _, p in [*self.trainable, *head]]

    # Sharding

    def shard(self, sharding: Sharding) -> list[torch.nn.Module]:
        """FSDP2 over the trainers' group: the model (and the reference, once loaded) sharded per
        decoder block; the optimizer rebuilt over the sharded parameters."""
        if self.sharding is not None:
            raise RuntimeError("the policy is already sharded")
        check_shardable(self.config)
        # Taken before sharding replaces the parameter objects.
        keys = self._checkpoint_keys_unsharded()
        root = shard_model(self.model, sharding)
        self.sharding = sharding
        self.trainable = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        self.checkpoint_keys = {name: keys[name] for name, _ in self.trainable}
        if self.lora is not None:
            by_name = dict(self.trainable)
            self.lora.saved_names = {key: by_name[name] for name, key in self.checkpoint_keys.items()}
        self.optimizer = build_optimizer([p for _, p in self.trainable], self.config, self.device)
        return [root]

    # Weights and checkpoints

    def export_weights(self) -> dict[str, np.ndarray] | Iterator[tuple[str, np.ndarray]]:
        """Copies of the trainable weights (with LoRA, the adapters) as float32 (NumPy has no bfloat16).

        Sharded, each tensor is gathered to rank 0 as the engine asks for it.
        """
        if self.sharding is not None:
            return gathered_on_rank0(self.trainable)
        return float32_copies(self.trainable)

    def weight_views(self) -> dict[str, np.ndarray] | Iterator[tuple[str, np.ndarray]]:
        """``export_weights`` without its copies: a float32 weight on the CPU is lent as a
        read-only view of the parameter itself."""
        if self.sharding is not None:
            return gathered_on_rank0(self.trainable)
        return float32_views(self.trainable)

    def import_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        import_into_parameters(dict(self.trainable), weights)

    def snapshot(self) -> dict[str, bytes | TensorFile]:
        return self._checkpoint_files()

    def save(self, directory: str) -> None:
        write_snapshot(self._checkpoint_files(), directory)

    def _checkpoint_files(self) -> dict[str, bytes | TensorFile]:
        if self.sharding is not None:
            return self._shard_files()
        # With LoRA, `model/` is a PEFT adapter directory on top of `model_path`.
        lora = self.lora
        model = lora.files(self.tokenizer) if lora is not None else model_files(self.model, self.tokenizer)
        files = {f"model/{name}": content for name, content in model.items()}
        files.update(optimizer_files(self.optimizer, [name for name, _ in self.trainable]))
        if self.value_head is not None:
            files.update(self.value_head.files())
        return files

    def _shard_files(self) -> dict[str, bytes | TensorFile]:
        """This rank's rows of the state; rank 0 adds what describes the model (config, tokenizer,
        the adapters' config) and PPO's replicated value head."""
        keyed = [(self.checkpoint_keys[name], p) for name, p in self.trainable]
        files = state_files(keyed, self.optimizer, dist.get_rank(), dist.get_world_size())
        if dist.get_rank() == 0:
            described = tokenizer_files(self.tokenizer)
            if self.lora is not None:
                described[ADAPTER_CONFIG] = self.lora.config_json
            else:
                described.update(model_files(self.model, self.tokenizer, weights=False))
            files.update({f"model/{name}": content for name, content in described.items()})
            if self.value_head is not None:
                files.update(self.value_head.files())
        return files

    def load(self, directory: str) -> None:
        root = Path(directory)
        if self.sharding is not None or is_sharded_checkpoint(root):
            self._load_shards(root)
            return
        if self.lora is not None:
            self.lora.load(root / "model")
        else:
            load_safetensors_weights(self.model, root / "model")
        load_optimizer(root, self.optimizer, [name for name, _ in self.trainable])
        if ValueHead.saved_in(root):
            self._value_head().load(root)

    def _load_shards(self, root: Path) -> None:
        if not is_sharded_checkpoint(root):
            raise ValueError(
                f"{root} was written by replicated trainer ranks; resume it with [train] sharding = "
                '"replicate", or export it (`rollout export`) and start a sharded run from the export'
            )
        if isinstance(self.optimizer, CpuOffloadOptimizer):
            raise ValueError(f"{root} is a sharded checkpoint: resume it without offload_optimizer")
        keys = self.checkpoint_keys or self._checkpoint_keys_unsharded()
        load_state(root, [(keys[name], p) for name, p in self.trainable], self.optimizer)
        if ValueHead.saved_in(root):
            self._value_head().load(root)

    def _checkpoint_keys_unsharded(self) -> dict[str, str]:
        """Each trainable parameter's name in checkpoints: its own, or with LoRA the name PEFT
        saves it under, so that checkpoints read like adapter directories."""
        saved_as = {id(p): name for name, p in (self.lora.saved_names.items() if self.lora else [])}
        return {name: saved_as.get(id(p), name) for name, p in self.trainable}

    def describe(self) -> Mapping[str, Any]:
        facts = {
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "dtype": self.config.dtype,
            "device": str(self.device),
            "sharding": self.sharding.mode if self.sharding is not None else "replicate",
        }
        if self.lora is not None:
            facts["trainable_parameters"] = self.lora.trainable_count()
            facts["quantization"] = self.config.quantization
        return facts

    # Colocated with trainer ranks: see EngineRunner.release_memory
    def release_memory(self) -> None:
        self.engine_runner.release_memory()

    def restore_memory(self) -> None:
        self.engine_runner.restore_memory()


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _default_bos_prefix(tokenizer: Any) -> list[int]:
    """``[bos]`` when the tokenizer puts a BOS in front of texts by default, else ``[]``."""
    bos = tokenizer.bos_token_id
    with_specials = tokenizer("a", add_special_tokens=True)["input_ids"]
    return [bos] if bos is not None and with_specials[:1] == [bos] else []


def _first_not_none(*values: int | None) -> int:
    return next(int(v) for v in values if v is not None)
