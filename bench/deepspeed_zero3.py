"""Two-rank DeepSpeed ZeRO-3 check on CPU (issue 18 item 8).

DeepSpeed is installed outside the project venv (see docs/deepspeed.md):

    /work/main/.venv/bin/python -m pip install --target /tmp/ds_site --no-deps \
        deepspeed hjson py-cpuinfo msgpack einops
    /work/main/.venv/bin/python -m pip install --target /tmp/ds_ninja --no-deps ninja

Run (two ranks, gloo, DeepSpeed CPU accelerator):

    PATH=/tmp/ds_ninja/bin:$PATH PYTHONPATH=/tmp/ds_site DS_ACCELERATOR=cpu \
    TORCH_EXTENSIONS_DIR=/tmp/ds_ext OMP_NUM_THREADS=1 \
    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 \
        bench/deepspeed_zero3.py [--offload-optimizer] [--zero-init] [--dtype bf16]

Each rank prints one JSON line: per-rank step losses, the global losses of a
single-process torch AdamW reference on the concatenated batch, the largest
parameter difference against that reference, and whether the parameters are
partitioned (ZeRO-3 keeps ds_numel / world elements per rank).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections.abc import Iterable
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

LR = 1e-3
BATCH, SEQ = 2, 16


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 128, (BATCH, SEQ), generator=g)


def make_optimizer(kind: str, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    # Plain torch optimizers: DeepSpeed's FusedAdam / DeepSpeedCPUAdam are C++ ops.
    if kind == "cpuadam":  # JIT-compiles the cpu_adam op on first use
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=LR, adamw_mode=True, weight_decay=0.01)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=LR)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--offload-optimizer", action="store_true")
    ap.add_argument("--zero-init", action="store_true", help="build under deepspeed.zero.Init")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--optimizer", choices=["adamw", "sgd", "cpuadam"], default="adamw")
    return ap.parse_args()


def deepspeed_config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        # DeepSpeed 0.19.8 defaults gradient_clipping to 1.0; the reference clips nothing.
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if args.offload_optimizer:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        # Otherwise 0.19.8 refuses any client optimizer but DeepSpeedCPUAdam.
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def partition_sizes(engine: Any) -> dict[str, Any]:
    """How many elements the model has, this rank keeps, and holds outside a forward pass."""
    params = list(engine.module.parameters())
    full = sum(p.ds_numel for p in params)
    local = sum(p.ds_tensor.numel() for p in params)
    held = sum(p.numel() for p in params)
    return {
        "ds_numel_total": full,
        "local_partition_numel": local,
        "param_numel_outside_forward": held,
        "partitioned": local * dist.get_world_size() >= full and local < full and held == 0,
    }


def train(engine: Any, steps: int) -> tuple[list[float], list[float]]:
    """This rank's loss per step, and the mean over the ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, global_losses = [], []
    for step in range(steps):
        ids = batch(rank, step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(round(loss.item(), 6))
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        global_losses.append(round(mean.item() / world, 6))
    return losses, global_losses


def compare_with_reference(
    engine: Any,
    reference: LlamaForCausalLM,
    initial: dict[str, torch.Tensor],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Trains `reference` in one process on every rank's batches and compares the updates.

    Same data, one process: the mean of equal-size per-rank means equals the mean over the
    concatenated batch, so AdamW must track ZeRO-3.
    """
    world = dist.get_world_size()
    ref_kind = "adamw" if args.optimizer == "cpuadam" else args.optimizer
    ref_opt = make_optimizer(ref_kind, reference.parameters())
    ref_losses = []
    for step in range(args.steps):
        ids = torch.cat([batch(r, step) for r in range(world)])
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(round(loss.item(), 6))
    # Adam turns float noise in near-zero gradients into visible update
    # differences on single elements, so compare whole updates by norm.
    max_diff, err_sq, upd_sq = 0.0, 0.0, 0.0
    named_ref = dict(reference.named_parameters())
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            ours = p.detach().float()
            ref = named_ref[name].detach().float()
            max_diff = max(max_diff, (ours - ref).abs().max().item())
            err_sq += (ours - ref).pow(2).sum().item()
            upd_sq += (ref - initial[name].float()).pow(2).sum().item()
    rel = (err_sq / upd_sq) ** 0.5
    # bf16 params round each update (ulp ~1e-4 at |w| ~ 0.02 vs lr 1e-3).
    tol = 1e-3 if args.dtype == "fp32" else 0.2
    return {
        "reference_losses": ref_losses,
        "max_param_diff_vs_reference": max_diff,
        "relative_update_error": rel,
        "matches_reference": rel < tol,
    }


def main() -> int:
    args = parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    ds_config = deepspeed_config(args)
    if args.zero_init:
        # Parameters are partitioned as each module is constructed; HF's
        # _init_weights then sees empty shards, so no reference is computed.
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = build_model()
        reference, initial = None, {}
    else:
        model = build_model()
        reference = copy.deepcopy(model)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = make_optimizer(args.optimizer, model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    sizes = partition_sizes(engine)
    losses, global_losses = train(engine, args.steps)
    out = {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "deepspeed": deepspeed.__version__,
        "dtype": args.dtype,
        "offload_optimizer": args.offload_optimizer,
        "zero_init": args.zero_init,
        "optimizer": type(engine.optimizer).__name__,
        "inner_optimizer": type(engine.optimizer.optimizer).__name__,
        **sizes,
        "losses": losses,
        "global_losses": global_losses,
    }
    ok = sizes["partitioned"]
    if reference is not None:
        out.update(compare_with_reference(engine, reference, initial, args))
        ok = ok and out["matches_reference"]

    print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
