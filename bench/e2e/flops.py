"""Model FLOPs per token and step, and the machine's matrix-multiply and memory-copy limits."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any


def matmul_shapes(config: Mapping[str, Any]) -> list[tuple[int, int]]:
    """(in, out) of every weight matrix a token passes through: each layer's, then the head's."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    layer = [
        (hidden, heads * head_dim),
        (hidden, kv * head_dim),
        (hidden, kv * head_dim),
        (heads * head_dim, hidden),
        (hidden, inter),
        (hidden, inter),
        (inter, hidden),
    ]
    return layer * config["num_hidden_layers"] + [(hidden, config["vocab_size"])]


def forward_flops_per_token(config: Mapping[str, Any], context: float) -> float:
    """Multiply-adds x 2 of one token's forward pass: the matrices, plus attention over ``context`` keys."""
    matrices = sum(2 * n_in * n_out for n_in, n_out in matmul_shapes(config))
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    attention = 2 * 2 * config["num_hidden_layers"] * heads * head_dim * context
    return matrices + attention


def training_flops(config: Mapping[str, Any], record: Mapping[str, float]) -> float:
    """The training pass's share of :func:`step_model_flops`: forward + backward (3x) over
    every sampled sequence."""
    sequence_tokens = record["sequence_tokens"]
    context = sequence_tokens / max(record["completions"], 1) / 2
    return 3 * forward_flops_per_token(config, context) * sequence_tokens


def step_model_flops(config: Mapping[str, Any], record: Mapping[str, float], kl: bool) -> float:
    """The FLOPs a GRPO step needs, counted the same way for both frameworks (as for MFU).

    Generation: one forward per prompt token of every sample and per generated token; training:
    forward + backward (3x) over every sampled sequence; with a KL term, one reference forward
    over every sequence. Work a framework avoids (shared prompt prefixes, rows without a
    learning signal) is still counted, so a framework that skips it scores higher.
    """
    completions = record["completions"]
    sequence_tokens = record["sequence_tokens"]
    context = sequence_tokens / max(completions, 1) / 2
    per_token = forward_flops_per_token(config, context)
    generation = per_token * sequence_tokens
    training = 3 * per_token * sequence_tokens
    reference = per_token * sequence_tokens if kl else 0.0
    return generation + training + reference


def machine_limits(config: Mapping[str, Any], rows: int, threads: int) -> dict[str, Any]:
    """fp32 GEMM rate at the model's shapes (``rows`` tokens at once) and memory-copy bandwidth."""
    import torch

    torch.set_num_threads(threads)
    shapes = sorted(set(matmul_shapes(config)))
    total_flops = 0.0
    total_seconds = 0.0
    per_shape = {}
    for n_in, n_out in shapes:
        a = torch.randn(rows, n_in)
        b = torch.randn(n_in, n_out)
        seconds = _best_time(lambda a=a, b=b: torch.mm(a, b), min_seconds=0.3)
        flops = 2.0 * rows * n_in * n_out
        count = matmul_shapes(config).count((n_in, n_out))
        total_flops += flops * count
        total_seconds += seconds * count
        per_shape[f"{rows}x{n_in}x{n_out}"] = flops / seconds / 1e9
    source = torch.empty(256 * 1024 * 1024 // 4).normal_()
    target = torch.empty_like(source)
    copy_seconds = _best_time(lambda: target.copy_(source), min_seconds=0.5)
    return {
        "gemm_rows": rows,
        "gemm_gflops_per_shape": per_shape,
        # Weighted by how often each shape occurs in a forward pass: the model's compute bound.
        "gemm_gflops": total_flops / total_seconds / 1e9,
        # Bytes read plus bytes written per second.
        "copy_gbytes_per_second": 2 * source.numel() * 4 / copy_seconds / 1e9,
    }


def forward_gemm_seconds(config: Mapping[str, Any], rows: int) -> float:
    """Seconds one forward pass's weight matmuls alone take over ``rows`` tokens at once: every
    matrix of the model, each with its own weights, in order (so that, as in a real forward
    pass, weights that do not fit in the caches stream from memory), best of repeated runs and
    of the two ways to lay the product out (``x · W``, and ``W · xᵀ`` with one row doubled,
    which the sampling engine uses for few rows: python_plugins/decode_matmuls.py)."""
    import torch

    weights = [torch.randn(n_in, n_out) for n_in, n_out in matmul_shapes(config)]
    transposed = [weight.t().contiguous() for weight in weights]
    inputs = {n_in: torch.randn(max(rows, 2), n_in) for n_in in {w.shape[0] for w in weights}}

    def inputs_first() -> None:
        for weight in weights:
            torch.mm(inputs[weight.shape[0]][:rows], weight)

    def weights_first() -> None:
        for weight in transposed:
            torch.mm(weight, inputs[weight.shape[1]].t())

    return min(_best_time(inputs_first, min_seconds=0.3), _best_time(weights_first, min_seconds=0.3))


def _best_time(function: Callable[[], Any], min_seconds: float) -> float:
    for _ in range(3):
        function()
    best = float("inf")
    deadline = time.perf_counter() + min_seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best
