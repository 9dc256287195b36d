"""vLLM as the generation backend (``[engine] backend = "vllm"``, docs/vllm.md).

vLLM runs inside the process that loads it (the engine core in-process, one worker), so its
model is reachable from here: every weight version is copied into it in place with vLLM's
``reload_weights`` (through :class:`RolloutWorkerExtension`), with no restart and no file.

Logprobs are made the trainer's quantity exactly: the model's logits are divided by the
run's temperature inside vLLM (its ``LogitsProcessor.scale``) and vLLM samples those at
temperature 1 and reports ``raw_logprobs``, the log-softmax of the scaled logits before
top-p/top-k truncation. Sampling at temperature 1 from logits divided by T, then truncated,
is sampling at temperature T with the same truncation.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rollout_sdk.generation_engine import GenerationEngine
from rollout_sdk.types import Generation, GenerationRequest, SamplingParams

__all__ = ["RolloutWorkerExtension", "VllmEngine"]

# The engine core runs in this process: `rollout` embeds Python, so `sys.executable` is not an
# interpreter that vLLM could start its engine process with.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# vLLM logs to stdout by default. Standard output is a command's output (`rollout generate`'s
# JSON), and a worker whose stdout is a pipe nobody reads would block on vLLM's next log line;
# logs go to standard error, with Rollout's own.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

_SEED_SPAN = 1 << 62
_CPU_KV_CACHE_BYTES = 1 << 30
# What `VllmEngine` passes to `vllm.LLM` itself: the logprob semantics and weight updates
# depend on them.
_OWN_ARGUMENTS = frozenset(
    {"model", "logprobs_mode", "worker_extension_cls", "enable_sleep_mode", "enable_prefix_caching"}
)


class RolloutWorkerExtension:
    """Methods vLLM adds to its worker (``worker_extension_cls``), called through
    ``LLM.collective_rpc``."""

    model_runner: Any

    def rollout_load_weights(self, weights: Iterable[tuple[str, Any]]) -> int:
        """Loads ``(name, tensor)`` pairs in place with vLLM's ``reload_weights``: the
        model's ``load_weights`` (which fuses the checkpoint's q/k/v and gate/up projections)
        followed by the processing vLLM did after the first load (e.g. the CPU kernels'
        repacking); returns how many were given."""
        import torch

        count = 0

        def tensors() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, value in weights:
                count += 1
                yield name, torch.as_tensor(value)

        with warnings.catch_warnings():
            # A weight sync's arrays are read-only views of the received bytes; vLLM copies them.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            self.model_runner.reload_weights(weights_iterator=tensors())
        return count

    def rollout_set_logits_scale(self, scale: float) -> None:
        self.model_runner.model.logits_processor.scale = scale


class VllmEngine(GenerationEngine):
    """Samples with vLLM in this process; see the module docstring."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        # The Hugging Face model directory vLLM loads first (the policy's `model_path`).
        model: str
        # "auto" takes the model's; "float32" makes its logprobs comparable to a float32 trainer.
        dtype: str = "auto"
        # 0: the model's own context length.
        max_model_len: int = 0
        # Run the model eagerly (no torch.compile or CUDA graphs): faster to start, slower to run.
        enforce_eager: bool = False
        # KV-cache bytes; 0 lets vLLM size it from `gpu_memory_utilization` on a GPU, and is
        # 1 GiB on a CPU (where vLLM would take that share of the host's memory).
        kv_cache_bytes: int = 0
        gpu_memory_utilization: float = 0.5
        max_num_seqs: int = 256
        prefix_caching: bool = True
        # Colocated on a GPU with the trainer: free the weights and KV cache while it trains.
        sleep_mode: bool = False
        seed: int = 0
        # Any other `vllm.LLM` keyword argument (`tensor_parallel_size` is refused: one worker;
        # the arguments this backend sets itself are refused too).
        engine_args: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        from vllm import LLM

        if config.sleep_mode and not _has_cuda():
            raise ValueError("sleep_mode needs a CUDA device: vLLM cannot sleep on the CPU")
        if int(config.engine_args.get("tensor_parallel_size", 1)) != 1:
            raise ValueError(
                "tensor_parallel_size must be 1: weights are loaded into vLLM's one in-process worker"
            )
        owned = sorted(set(config.engine_args) & _OWN_ARGUMENTS)
        if owned:
            raise ValueError(f"engine_args may not set {', '.join(owned)}: the vLLM backend sets them itself")
        arguments: dict[str, Any] = {
            **config.engine_args,
            "model": config.model,
            "dtype": config.dtype,
            "enforce_eager": config.enforce_eager,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "max_num_seqs": config.max_num_seqs,
            "enable_prefix_caching": config.prefix_caching,
            "enable_sleep_mode": config.sleep_mode,
            "seed": config.seed,
            "logprobs_mode": "raw_logprobs",
            "worker_extension_cls": f"{__name__}.RolloutWorkerExtension",
        }
        if config.max_model_len > 0:
            arguments["max_model_len"] = config.max_model_len
        kv_cache_bytes = config.kv_cache_bytes or (0 if _has_cuda() else _CPU_KV_CACHE_BYTES)
        if kv_cache_bytes > 0:
            arguments["kv_cache_memory_bytes"] = kv_cache_bytes
        self.llm = LLM(**arguments)
        self._logits_scale = 1.0
        self._asleep = False

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        stop_strings: Sequence[str] = (),
        ignore_eos: bool = False,
    ) -> list[list[Generation]]:
        from vllm.inputs import TokensPrompt

        greedy = params.temperature <= 0.0
        self._set_logits_scale(1.0 if greedy else 1.0 / params.temperature)
        # vLLM samples a greedy request once (n=1): a greedy group is n requests.
        copies = [1 if not greedy else r.n for r in requests]
        prompts, sampling = [], []
        for index, (request, count) in enumerate(zip(requests, copies, strict=True)):
            prompt = TokensPrompt(prompt_token_ids=[int(t) for t in request.prompt_ids])
            n = request.n // count
            for _ in range(count):
                prompts.append(prompt)
                sampling.append(self._sampling_params(params, n, index, greedy, stop_strings, ignore_eos))
        outputs = iter(self.llm.generate(prompts, sampling, use_tqdm=False))
        return [[_generation(c) for _ in range(count) for c in next(outputs).outputs] for count in copies]

    def _sampling_params(
        self,
        params: SamplingParams,
        n: int,
        index: int,
        greedy: bool,
        stop_strings: Sequence[str],
        ignore_eos: bool,
    ) -> Any:
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            n=n,
            temperature=0.0 if greedy else 1.0,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            stop=list(stop_strings) or None,
            include_stop_str_in_output=True,
            ignore_eos=ignore_eos,
            logprobs=0,
            seed=(params.seed * 1_000_003 + index) % _SEED_SPAN,
            skip_special_tokens=True,
        )

    def _set_logits_scale(self, scale: float) -> None:
        if scale != self._logits_scale:
            self.llm.collective_rpc("rollout_set_logits_scale", args=(scale,))
            self._logits_scale = scale

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        loaded = self.llm.collective_rpc("rollout_load_weights", args=(weights.items(),))
        if loaded and loaded[0] == 0:
            raise ValueError("a weight version with no tensors")
        # The KV of cached prefixes was computed with the previous weights.
        self.llm.reset_prefix_cache()

    def prompt_logprobs(
        self, sequences: Sequence[Sequence[int]], temperature: float = 1.0
    ) -> list[np.ndarray]:
        """Each sequence's per-token logprobs as vLLM's model scores it (position 0 is 0), at
        ``temperature``: the teacher-forced quantity the trainer computes."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        self._set_logits_scale(1.0 / temperature)
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=[int(t) for t in s]) for s in sequences],
            VllmSamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
            use_tqdm=False,
        )
        scored = []
        for sequence, output in zip(sequences, outputs, strict=True):
            values = [0.0]
            for token, entry in zip(sequence[1:], output.prompt_logprobs[1:], strict=True):
                values.append(entry[int(token)].logprob)
            scored.append(np.asarray(values, dtype=np.float32))
        return scored

    def release_memory(self) -> None:
        if self.config.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def restore_memory(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _generation(completion: Any) -> Generation:
    """A vLLM ``CompletionOutput`` as a ``Generation``: its token ids as sampled, each with
    the logprob of the sampled token."""
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended a completion with finish_reason={completion.finish_reason!r}")
    token_ids = np.asarray(completion.token_ids, dtype=np.int64)
    logprobs = np.asarray(
        [step[int(token)].logprob for token, step in zip(token_ids, completion.logprobs, strict=True)],
        dtype=np.float32,
    )
    return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=completion.finish_reason)
