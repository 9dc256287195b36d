"""Memory options of the HF policy: LoRA adapters, quantized frozen weights and the optimizer.

- LoRA (``lora_rank > 0``) wraps the model with PEFT: only the adapters train, export (weight
  sync) and go into checkpoints, and the KL reference is the same model with its adapters
  disabled, so no second copy of the weights is loaded.
- ``quantization`` / ``reference_quantization`` load frozen weights in 8 bits (``"int8"``,
  LLM.int8 with outlier decomposition) or 4 bits (``"nf4"``, NF4 with double quantization,
  as QLoRA) through bitsandbytes' ``Linear8bitLt``/``Linear4bit`` (its CPU backend works too).
- ``optimizer = "adamw_8bit"`` is bitsandbytes' block-wise 8-bit AdamW; ``offload_optimizer``
  keeps the optimizer's state and a copy of the weights it updates in CPU memory
  (:class:`CpuOffloadOptimizer`).

peft and bitsandbytes are imported only when an option needs them. See docs/memory.md.
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from python_plugins.checkpoint_io import host_tensor, tokenizer_files
from rollout_sdk.snapshot import TensorFile

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "DEFAULT_LORA_TARGETS",
    "BaseWithoutAdapters",
    "CpuOffloadOptimizer",
    "LoraAdapters",
    "build_optimizer",
    "check_memory_options",
    "load_model",
    "optimizer_factory",
]

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Adapters are initialised from this seed (in a forked RNG), so every process that builds the
# policy from the same config, trainer ranks and generation workers alike, gets the same ones.
LORA_INIT_SEED = 0
# What PEFT's `save_pretrained` writes: `PeftModel.from_pretrained` and transformers'
# `from_pretrained` (with peft installed) load such a directory on top of its base model.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
QUANTIZATIONS = ("none", "int8", "nf4")


def check_memory_options(config: Any) -> None:
    """Validate the LoRA, quantization and optimizer options of ``HFCausalLM.Config``."""
    if config.lora_rank < 0:
        raise ValueError(f"lora_rank must not be negative (0 trains every weight), got {config.lora_rank}")
    if config.lora_alpha <= 0:
        raise ValueError(f"lora_alpha must be positive, got {config.lora_alpha}")
    if not 0.0 <= config.lora_dropout < 1.0:
        raise ValueError(f"lora_dropout must be in [0, 1), got {config.lora_dropout}")
    if config.lora_rank > 0 and not config.lora_target_modules:
        raise ValueError("lora_target_modules must name at least one module when lora_rank > 0")
    if config.quantization != "none" and config.lora_rank == 0:
        raise ValueError(
            f'quantization = "{config.quantization}" freezes the base weights in '
            f"{8 if config.quantization == 'int8' else 4} bits, so full fine-tuning cannot train them: "
            "set lora_rank > 0 to train LoRA adapters on the quantized base (QLoRA), or quantize "
            "only the frozen KL reference with reference_quantization"
        )
    separate_reference = config.lora_rank == 0 or config.reference_model_path is not None
    if config.reference_quantization != "none" and not separate_reference:
        raise ValueError(
            "reference_quantization applies to a separately loaded reference model, but with "
            "lora_rank > 0 the KL reference is the policy's own base weights with the adapters "
            "disabled (stored as `quantization` says, no second copy); set reference_model_path "
            "to load a separate reference"
        )


def require_safetensors(path: str) -> None:
    """Refuse a model directory without safetensors weights: pickled ones (``pytorch_model.bin``)
    can run code when loaded, and are never loaded."""
    if not any(Path(path).glob("*.safetensors")):
        raise ValueError(
            f"the model at `{path}` has no safetensors weights; pickled ones (pytorch_model.bin) are "
            "never loaded: convert them once with transformers' `save_pretrained`"
        )


def load_model(
    path: str, *, dtype: torch.dtype, device: torch.device, quantization: str = "none"
) -> PreTrainedModel:
    """Load a causal LM onto ``device``, its linear layers in 8 or 4 bits if ``quantization`` says."""
    require_safetensors(path)
    if quantization == "none":
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True).to(device)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {', '.join(QUANTIZATIONS)}")
    _import_bitsandbytes()
    from transformers import BitsAndBytesConfig

    if quantization == "int8":
        quantization_config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        quantization_config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    # Quantized weights cannot be moved with `.to`: they are quantized as they land on the device.
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=dtype,
        quantization_config=quantization_config,
        device_map={"": str(device)},
        use_safetensors=True,
    )
    for module in model.modules():
        # bitsandbytes repacks 4-bit weights for its AVX512-BF16 CPU kernel at the first forward
        # without gradients (generation). That kernel has no backward (adapters below such a
        # layer would silently get no gradient through it) and fails on layers narrower than
        # a quantization block: keep the portable kernels.
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
    if device.type == "cpu":
        _detach_from_checkpoint_file(model)
    return model.requires_grad_(False)


@torch.no_grad()
def _detach_from_checkpoint_file(model: PreTrainedModel) -> None:
    """Copy the unquantized tensors (embeddings, norms) out of the memory-mapped checkpoint.

    On CPU they view the mapped safetensors file, which keeps it mapped, and with it every
    page read while quantizing: the full-precision linear weights would stay resident.
    """
    copies: dict[int, torch.Tensor] = {}
    for param in model.parameters():
        if type(param) is torch.nn.Parameter:  # bitsandbytes' own parameters hold quantized copies
            key = param.data.untyped_storage().data_ptr()
            param.data = copies.setdefault(key, param.data.clone())


class BaseWithoutAdapters:
    """Calls the policy's model with its LoRA adapters disabled (and in eval mode): the frozen base.

    Callable like the model (``config`` included), for the KL reference's forward passes.
    """

    def __init__(self, adapters: LoraAdapters) -> None:
        self.adapters = adapters

    @property
    def config(self) -> Any:
        return self.adapters.model.config

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.adapters.model
        was_training = model.training
        with self.adapters.peft_model.disable_adapter():
            try:
                if was_training:
                    model.eval()
                return model(*args, **kwargs)
            finally:
                if was_training:
                    model.train()


class LoraAdapters:
    """``model`` with PEFT LoRA adapters injected into ``target_modules``; everything else frozen.

    ``model`` stays the transformers model the policy calls (the LoRA layers replace its linear
    layers in place); ``peft_model`` is PEFT's wrapper around it, for disabling the adapters
    and for the adapter directory's config.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        rank: int,
        alpha: float,
        dropout: float,
        target_modules: Sequence[str],
        base_model_path: str,
    ) -> None:
        _import_bitsandbytes()  # before peft, so its quantized layers are known if the base has them
        from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

        _check_targets(model, target_modules)
        base_parameters = sum(_logical_numel(p) for p in model.parameters())
        lora_config = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            lora_dropout=dropout,
            target_modules=list(target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        devices = [model.device] if model.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(LORA_INIT_SEED)
            self.peft_model = get_peft_model(model, lora_config)
        self.model: PreTrainedModel = self.peft_model.get_base_model()
        # The names PEFT saves adapters under (without the adapter's name), and their parameters.
        by_storage = {p.data_ptr(): p for p in self.model.parameters() if p.requires_grad}
        self.saved_names = {
            name: by_storage[tensor.data_ptr()]
            for name, tensor in get_peft_model_state_dict(self.peft_model).items()
        }
        saved_config = copy.deepcopy(self.peft_model.peft_config["default"])
        saved_config.base_model_name_or_path = _resolved(base_model_path)
        saved_config.inference_mode = True
        with tempfile.TemporaryDirectory() as scratch:
            saved_config.save_pretrained(scratch)
            self.config_json = (Path(scratch) / ADAPTER_CONFIG).read_bytes()
        trainable = self.trainable_count()
        # `export_weights` sends float32: 4 bytes per exported parameter.
        self.weight_sync_bytes = 4 * trainable
        _note(
            f"LoRA rank {rank} on {', '.join(target_modules)}: {trainable:,} trainable parameters of "
            f"{base_parameters:,} ({100.0 * trainable / max(base_parameters, 1):.2f}%); a weight sync "
            f"sends {self.weight_sync_bytes:,} bytes instead of {4 * base_parameters:,}"
        )

    def reference(self) -> BaseWithoutAdapters:
        return BaseWithoutAdapters(self)

    def trainable_count(self) -> int:
        return sum(p.numel() for p in self.saved_names.values())

    def files(self, tokenizer: Any) -> dict[str, bytes | TensorFile]:
        """The adapter directory PEFT's ``save_pretrained`` writes, plus the tokenizer's files."""
        files: dict[str, bytes | TensorFile] = {
            ADAPTER_CONFIG: self.config_json,
            **tokenizer_files(tokenizer),
        }
        tensors = {name: host_tensor(p) for name, p in self.saved_names.items()}
        files[ADAPTER_WEIGHTS] = TensorFile(tensors, {"format": "pt"})
        return files

    @torch.no_grad()
    def load(self, directory: Path) -> None:
        """Copy the adapters of ``directory/adapter_model.safetensors`` (as :meth:`files` wrote) in."""
        path = directory / ADAPTER_WEIGHTS
        if not path.is_file():
            found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
            hint = " (it holds full model weights: was it saved with lora_rank = 0?)" if found else ""
            raise FileNotFoundError(f"no LoRA adapters ({ADAPTER_WEIGHTS}) in {directory}{hint}")
        saved = load_file(str(path))
        unknown = sorted(set(saved) - set(self.saved_names))
        if unknown:
            raise ValueError(f"{path}: the model has no adapter `{unknown[0]}` (another lora config?)")
        missing = sorted(set(self.saved_names) - set(saved))
        if missing:
            raise ValueError(f"{path}: adapter `{missing[0]}` is missing")
        for name, tensor in saved.items():
            expected = tuple(self.saved_names[name].shape)
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"{path}: adapter `{name}` has shape {list(tensor.shape)}, the model expects "
                    f"{list(expected)} (another lora_rank?)"
                )
        for name, tensor in saved.items():
            self.saved_names[name].copy_(tensor)


def optimizer_factory(config: Any) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    """Builds the optimizer ``config`` names over given parameters, at learning rate 0.

    The engine passes the rate of every update to ``apply_update``.
    """

    def build(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        options = {"lr": 0.0, "betas": config.adam_betas, "eps": config.adam_eps}
        if config.optimizer == "adamw_8bit":
            # Tensors under 4096 elements keep 32-bit state (bitsandbytes' `min_8bit_size`).
            return _adamw_8bit_class()(params, weight_decay=config.weight_decay, **options)
        # One kernel over all parameters instead of a few per tensor (same update).
        return torch.optim.AdamW(params, weight_decay=config.weight_decay, fused=True, **options)

    return build


def build_optimizer(
    params: Sequence[torch.nn.Parameter], config: Any, device: torch.device
) -> torch.optim.Optimizer | CpuOffloadOptimizer:
    """AdamW or 8-bit AdamW over ``params``, its state in CPU memory with ``offload_optimizer``."""
    build = optimizer_factory(config)
    if not config.offload_optimizer:
        return build(list(params))
    if device.type == "cpu":
        _note(
            "offload_optimizer: the policy runs on the CPU, where the optimizer state already is; "
            "nothing to offload (the option matters for GPU runs)"
        )
        return build(list(params))
    return CpuOffloadOptimizer(params, build)


class CpuOffloadOptimizer:
    """Runs ``build``'s optimizer in CPU memory over host copies of the device ``params``.

    Each step copies the device gradients to the host, steps there and copies the updated
    weights back: the optimizer state (AdamW's two moments, 8 bytes per weight in float32)
    never takes device memory. A host copy is refreshed from its parameter whenever something
    else changed the parameter in place (loading a checkpoint, ``import_weights``), which the
    tensor's version counter tells. ``state_dict``/``load_state_dict``/``param_groups`` are
    the inner optimizer's, so checkpoints look the same as without offloading.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    ) -> None:
        self.params = list(params)
        self.pinned = torch.cuda.is_available() and any(p.is_cuda for p in self.params)
        self.host = [torch.nn.Parameter(self._host_copy(p)) for p in self.params]
        self.versions = [p._version for p in self.params]
        self.optimizer = build(self.host)

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pinned)
        return host.copy_(tensor.detach())

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Mapping[Any, Any]:
        return self.optimizer.state

    @torch.no_grad()
    def step(self) -> None:
        for index, (param, host) in enumerate(zip(self.params, self.host, strict=True)):
            if param._version != self.versions[index]:
                host.copy_(param)
            if param.grad is None:
                host.grad = None
                continue
            if host.grad is None:
                host.grad = self._host_copy(param.grad)
            else:
                host.grad.copy_(param.grad, non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.synchronize()
        self.optimizer.step()
        for index, (param, host) in enumerate(zip(self.params, self.host, strict=True)):
            param.copy_(host, non_blocking=self.pinned)
            self.versions[index] = param._version
        if self.pinned:
            torch.cuda.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


@functools.cache
def _adamw_8bit_class() -> type[torch.optim.Optimizer]:
    _import_bitsandbytes()
    import bitsandbytes as bnb

    class AdamW8bit(bnb.optim.AdamW8bit):
        """bitsandbytes' 8-bit AdamW with a flat ``state_dict``.

        bitsandbytes nests its quantized moments and their scales under one key per parameter
        (for FSDP); flat, they are plain tensors that ``checkpoint_io`` stores as safetensors.
        Its ``load_state_dict`` takes either form.
        """

        def state_dict(self) -> dict[str, Any]:
            state = super().state_dict()
            for values in state["state"].values():
                values.update(values.pop(self._FSDP_WRAPPED_QUANT_STATE_KEY, {}))
            return state

    return AdamW8bit


def _check_targets(model: PreTrainedModel, targets: Sequence[str]) -> None:
    """A clear error for targets that match no module (a name, or the end of a dotted path)."""
    names = [name for name, _ in model.named_modules() if name]
    unknown = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if unknown:
        linear = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in model.named_modules()
                # bitsandbytes' quantized layers are `nn.Linear`s too; GPT-2 uses `Conv1D`.
                if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
            }
        )
        raise ValueError(
            f"lora_target_modules: {type(model).__name__} has no module named "
            f"{', '.join(f'`{t}`' for t in unknown)}; its linear layers are {', '.join(linear)}"
        )


def _logical_numel(param: torch.Tensor) -> int:
    """Weights a parameter stands for (a packed 4-bit one holds two per byte)."""
    quant_state = getattr(param, "quant_state", None)
    return int(torch.Size(quant_state.shape).numel()) if quant_state is not None else param.numel()


def _resolved(path: str) -> str:
    local = Path(path)
    return str(local.resolve()) if local.exists() else path


_BNB_NOISE = (
    # Logged at every forward of an int8 layer; that they compute in float16 is in docs/memory.md.
    "MatMul8bitLt: inputs will be cast",
    # An optional faster CPU kernel, fetched from a model hub that is not needed.
    "Failed to load CPU gemm_4bit_forward",
)


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_BNB_NOISE)


_NOISE_FILTER = _DropNoise()


def _import_bitsandbytes() -> None:
    """Import bitsandbytes with its per-forward and optional-kernel warnings filtered out."""
    for name in ("bitsandbytes.autograd._functions", "bitsandbytes.backends.cpu.ops"):
        logging.getLogger(name).addFilter(_NOISE_FILTER)  # a no-op when already there
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ImportError(
            'quantization and optimizer = "adamw_8bit" need bitsandbytes: pip install -r requirements.txt'
        ) from err


def _note(message: str) -> None:
    print(f"HFCausalLM: {message}", file=sys.stderr, flush=True)
