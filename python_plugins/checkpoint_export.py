"""``rollout export CHECKPOINT DIR``: a checkpoint's policy as a Hugging Face model directory.

A replicated checkpoint's ``policy/model`` already is one (or a PEFT adapter directory with
LoRA); a sharded one's weights are assembled tensor by tensor from the ranks' rows and
written as ``save_pretrained`` writes them: ``model.safetensors``, or numbered files of at
most ``max_file_bytes`` with ``model.safetensors.index.json``. With LoRA the result is the
adapter directory (``adapter_config.json``, ``adapter_model.safetensors``), which
``from_pretrained`` loads on top of its base. The directory appears whole or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from python_plugins.model_setup import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from python_plugins.sharded_checkpoint import ShardedTensors, is_sharded_checkpoint

__all__ = ["export_checkpoint", "main"]

MAX_FILE_BYTES = 2 << 30


def policy_directory(checkpoint: Path) -> Path:
    """The policy's directory of a checkpoint (``CHECKPOINT/policy``), or ``checkpoint`` itself."""
    for candidate in (checkpoint / "policy", checkpoint):
        if (candidate / "model").is_dir():
            return candidate
    raise FileNotFoundError(
        f"{checkpoint} is not a checkpoint: no policy/model directory (pass a run's "
        "checkpoints/step-N directory; multi-agent runs keep one policy per agent under policy/)"
    )


def export_checkpoint(checkpoint: Path, out: Path, max_file_bytes: int = MAX_FILE_BYTES) -> Path:
    """Write the policy of ``checkpoint`` to ``out`` (which must not exist); returns ``out``."""
    source = policy_directory(checkpoint)
    if out.exists():
        raise FileExistsError(f"{out} exists: export into a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for file in (source / "model").iterdir():
            if file.is_file():
                shutil.copy2(file, staging / file.name)
        if is_sharded_checkpoint(source):
            write_weights(ShardedTensors(source), staging, max_file_bytes)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def write_weights(shards: ShardedTensors, directory: Path, max_file_bytes: int) -> None:
    names = [key[len("model/") :] for key in shards.keys() if key.startswith("model/")]
    if (directory / ADAPTER_CONFIG).is_file():
        tensors = {name: shards.rows(f"model/{name}") for name in names}
        save_file(tensors, str(directory / ADAPTER_WEIGHTS), {"format": "pt"})
        return
    parts: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        parts.append(list(pending))
        save_file(pending, str(directory / f"part-{len(parts):05d}.safetensors"), {"format": "pt"})
        pending.clear()

    for name in names:
        tensor = shards.rows(f"model/{name}")
        tensor_bytes = tensor.numel() * tensor.element_size()
        if pending and size + tensor_bytes > max_file_bytes:
            flush()
            size = 0
        pending[name] = tensor
        size += tensor_bytes
    if not parts:
        save_file(pending, str(directory / "model.safetensors"), {"format": "pt"})
        return
    flush()
    weight_map = {}
    for number, part in enumerate(parts, start=1):
        file = f"model-{number:05d}-of-{len(parts):05d}.safetensors"
        (directory / f"part-{number:05d}.safetensors").rename(directory / file)
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: rollout export CHECKPOINT DIR", file=sys.stderr)
        return 2
    out = export_checkpoint(Path(args[0]), Path(args[1]))
    print(f"exported {policy_directory(Path(args[0]))} to {out}")
    return 0
