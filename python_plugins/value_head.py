"""PPO's critic on the policy: a small MLP on the policy model's last hidden state.

The head reads the hidden states detached, so value learning never moves the policy (also
during the critic's warm-up), and has its own AdamW. It is created when PPO first asks for
values, with a fixed seed so every trainer rank builds the same one, and is saved under
``value_head/`` in checkpoints (weights and optimizer state, safetensors + JSON).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from python_plugins.checkpoint_io import host_tensor, load_optimizer, optimizer_files
from python_plugins.output_head import OutputHead, predicted_logprobs, predicted_tokens
from rollout_sdk.objectives import token_logprobs
from rollout_sdk.snapshot import TensorFile

__all__ = ["ValueHead", "logprobs_and_hidden"]

DIRECTORY = "value_head"
WEIGHTS_FILE = "weights.safetensors"
INIT_SEED = 0


class ValueHead:
    """``hidden [B, T, H] -> values [B, T]``, column ``t`` the value of the state before token ``t``."""

    def __init__(
        self,
        hidden_size: int,
        device: torch.device,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        max_grad_norm: float = 1.0,
        learning_rate: float | None = None,
    ) -> None:
        generator = torch.Generator().manual_seed(INIT_SEED)
        first, last = torch.nn.Linear(hidden_size, hidden_size), torch.nn.Linear(hidden_size, 1)
        with torch.no_grad():
            first.weight.normal_(0.0, hidden_size**-0.5, generator=generator)
            first.bias.zero_()
            # Values start at exactly 0: the first advantages are the plain returns.
            last.weight.zero_()
            last.bias.zero_()
        self.module = torch.nn.Sequential(first, torch.nn.Tanh(), last).to(device)
        parameters = self.module.parameters()
        self.optimizer = torch.optim.AdamW(parameters, lr=0.0, betas=betas, eps=eps, weight_decay=0.0)
        self.max_grad_norm = max_grad_norm
        self.learning_rate = learning_rate

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        values = self.module(hidden[:, :-1].detach().float()).squeeze(-1)
        return torch.nn.functional.pad(values, (1, 0))

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(f"{DIRECTORY}.{name}", p) for name, p in self.module.named_parameters()]

    def apply_update(self, learning_rate: float) -> dict[str, float]:
        """One AdamW step at ``learning_rate`` (or the head's own fixed rate, if it has one)."""
        parameters = list(self.module.parameters())
        grads = [p.grad for p in parameters if p.grad is not None]
        if not grads:
            return {}
        norm = torch.nn.utils.get_total_norm(grads)
        if not torch.isfinite(norm):
            # As the policy's: a NaN or infinite gradient never reaches the weights.
            self.optimizer.zero_grad(set_to_none=True)
            return {"updates_skipped_nonfinite": 1.0}
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(parameters, self.max_grad_norm, norm)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate if self.learning_rate is not None else learning_rate
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"value_grad_norm": float(norm)}

    def files(self) -> dict[str, bytes | TensorFile]:
        names = [name for name, _ in self.named_parameters()]
        weights = TensorFile({name: host_tensor(p) for name, p in self.named_parameters()})
        files: dict[str, bytes | TensorFile] = {f"{DIRECTORY}/{WEIGHTS_FILE}": weights}
        for name, content in optimizer_files(self.optimizer, names).items():
            files[f"{DIRECTORY}/{name}"] = content
        return files

    @staticmethod
    def saved_in(checkpoint: Path) -> bool:
        return (checkpoint / DIRECTORY / WEIGHTS_FILE).is_file()

    @torch.no_grad()
    def load(self, checkpoint: Path) -> None:
        directory = checkpoint / DIRECTORY
        saved = load_file(str(directory / WEIGHTS_FILE))
        current = dict(self.named_parameters())
        if set(saved) != set(current):
            raise ValueError(f"{directory}: value head tensors {sorted(saved)}, expected {sorted(current)}")
        for name, tensor in saved.items():
            if tensor.shape != current[name].shape:
                raise ValueError(
                    f"{directory}: `{name}` has shape {list(tensor.shape)}, the head expects "
                    f"{list(current[name].shape)} (a checkpoint of another model?)"
                )
            current[name].copy_(tensor)
        load_optimizer(directory, self.optimizer, [name for name, _ in self.named_parameters()])


def logprobs_and_hidden(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    head: OutputHead | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs (as ``token_logprobs``) and the last layer's hidden states.

    With ``head``, the logprobs come from the chunked output layer (0 at padding) instead of the
    model's logits (:mod:`python_plugins.output_head`).
    """
    positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    if head is not None:
        hidden = head.hidden(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False
        )
        predicted, source = predicted_tokens(attention_mask)
        logprobs = predicted_logprobs(head, hidden, source, input_ids[predicted], predicted, temperature)
        return logprobs, hidden
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        use_cache=False,
        output_hidden_states=True,
    )
    return token_logprobs(output.logits, input_ids, temperature), output.hidden_states[-1]
