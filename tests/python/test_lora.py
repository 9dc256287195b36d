"""HFCausalLM's memory options: LoRA adapters, quantized frozen weights, 8-bit and offloaded AdamW."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from engine_driver import DriverOptions, EngineDriver
from peft import PeftModel
from policy_helpers import LR, PAIRS, PROMPTS, grpo_batch, make_policy, requests, right_padded, sft_batch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from python_plugins.model_setup import BaseWithoutAdapters, CpuOffloadOptimizer, optimizer_factory
from rollout_sdk import ConfigError, GrpoObjective, SamplingParams, TokenBatch
from rollout_sdk.snapshot import write_snapshot
from rollout_sdk.testing import check_policy

LORA = {"lora_rank": 4, "lora_alpha": 8.0}
# Every linear layer of the tiny Llama, so that the 8-bit optimizer has adapters of 4096
# elements or more (bitsandbytes keeps 32-bit state for smaller tensors).
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def train(policy, steps: int = 3) -> None:
    batch = sft_batch(policy, PAIRS)
    for _ in range(steps):
        policy.train_step(batch)
        policy.apply_update(LR)


def sequences(policy) -> TokenBatch:
    ids, mask = right_padded(policy.encode(["12+34=46", "7+8=15", "what is 99+1? 100"]))
    return TokenBatch(input_ids=ids, attention_mask=mask)


def base_logprobs(model_dir, batch: TokenBatch) -> np.ndarray:
    policy = make_policy(model_dir)
    return policy.logprobs(batch)


def test_only_the_adapters_train(tiny_model_dir):
    policy = make_policy(tiny_model_dir, **LORA)
    names = [name for name, _ in policy.trainable]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert {m for n in names for m in ("q_proj", "k_proj", "v_proj", "o_proj") if f".{m}." in n} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    }
    optimized = [p for group in policy.optimizer.param_groups for p in group["params"]]
    assert [id(p) for p in optimized] == [id(p) for p in policy.trainable_parameters()]
    assert [id(p) for p in policy.trainable_parameters()] == [id(p) for _, p in policy.trainable]
    frozen_before = {n: t.clone() for n, t in policy.model.state_dict().items() if ".lora_" not in n}
    adapters_before = policy.export_weights()
    train(policy)
    after = policy.model.state_dict()
    assert all(torch.equal(frozen_before[n], after[n]) for n in frozen_before)
    adapters_after = policy.export_weights()
    assert set(adapters_after) == set(names)
    assert all(not np.array_equal(adapters_before[n], adapters_after[n]) for n in names)
    assert policy.describe()["trainable_parameters"] == sum(p.numel() for _, p in policy.trainable)


def test_adapters_start_as_the_base_model_and_identically_in_every_process(tiny_model_dir):
    batch = sequences(make_policy(tiny_model_dir))
    torch.manual_seed(1)
    first = make_policy(tiny_model_dir, **LORA)
    torch.manual_seed(2)
    second = make_policy(tiny_model_dir, **LORA)
    a, b = first.export_weights(), second.export_weights()
    assert all(np.array_equal(a[n], b[n]) for n in a), "adapter init must not depend on the global RNG"
    np.testing.assert_array_equal(first.logprobs(batch), base_logprobs(tiny_model_dir, batch))


def test_reference_is_the_base_model_with_adapters_disabled(tiny_model_dir):
    policy = make_policy(tiny_model_dir, **LORA)
    objective = GrpoObjective(kl_coef=0.1)
    assert policy.train_step(grpo_batch(policy, objective))["kl"] == pytest.approx(0.0, abs=1e-7)
    assert isinstance(policy.reference, BaseWithoutAdapters), "no second copy of the model"
    policy.apply_update(LR)
    train(policy)
    assert policy.train_step(grpo_batch(policy, objective))["kl"] > 1e-4
    policy.optimizer.zero_grad()
    batch = sequences(policy)
    ids = torch.as_tensor(batch.input_ids)
    mask = torch.as_tensor(batch.attention_mask)
    with torch.no_grad():
        reference = policy._token_logprobs(policy._reference(), ids, mask, 1.0) * mask
    np.testing.assert_allclose(reference.numpy(), base_logprobs(tiny_model_dir, batch), atol=1e-6)
    assert not np.allclose(policy.logprobs(batch), reference.numpy(), atol=1e-3), "the adapters trained"
    # The reference pass leaves the adapters on and trainable.
    assert all(p.requires_grad for _, p in policy.trainable)
    np.testing.assert_array_equal(policy.logprobs(batch), policy.logprobs(batch))


def test_an_explicit_reference_model_path_is_loaded_separately(tiny_model_dir):
    policy = make_policy(tiny_model_dir, reference_model_path=str(tiny_model_dir), **LORA)
    policy.train_step(grpo_batch(policy, GrpoObjective(kl_coef=0.1)))
    assert not isinstance(policy.reference, BaseWithoutAdapters)
    assert not any(p.requires_grad for p in policy.reference.parameters())


def test_export_and_import_send_only_the_adapters(tiny_model_dir):
    trainer = make_policy(tiny_model_dir, **LORA)
    worker = make_policy(tiny_model_dir, **LORA)
    full = make_policy(tiny_model_dir).export_weights()
    train(trainer)
    weights = trainer.export_weights()
    adapter_bytes = sum(w.nbytes for w in weights.values())
    full_bytes = sum(w.nbytes for w in full.values())
    # rank 4 on 4 projections of 2 layers (32 x 32): 2 * 4 * (4 * 32 + 32 * 4) float32 values.
    assert adapter_bytes == 2 * 4 * (4 * 32 + 32 * 4) * 4 == 8192
    assert adapter_bytes < full_bytes / 10, (adapter_bytes, full_bytes)
    batch = sequences(trainer)
    assert not np.array_equal(worker.logprobs(batch), trainer.logprobs(batch))
    worker.import_weights(weights)
    np.testing.assert_array_equal(worker.logprobs(batch), trainer.logprobs(batch))
    params = SamplingParams(max_new_tokens=6, seed=5)
    assert [g.token_ids.tolist() for (g,) in worker.generate(requests(worker), params)] == [
        g.token_ids.tolist() for (g,) in trainer.generate(requests(trainer), params)
    ]
    name = next(iter(weights))
    with pytest.raises(ValueError, match=re.escape(f"`{name}` is missing")):
        worker.import_weights({k: v for k, v in weights.items() if k != name})
    with pytest.raises(ValueError, match=r"no parameter `model\.layers\.0\.mlp\.up_proj\.weight`"):
        worker.import_weights(
            {**weights, "model.layers.0.mlp.up_proj.weight": full["model.layers.0.mlp.up_proj.weight"]}
        )


@pytest.mark.parametrize(
    "options",
    [
        LORA,
        {**LORA, "optimizer": "adamw_8bit", "lora_target_modules": ALL_LINEAR, "lora_rank": 32},
        {**LORA, "quantization": "nf4"},
        {"optimizer": "adamw_8bit"},
    ],
    ids=["lora", "lora-adamw8bit", "qlora-nf4", "full-adamw8bit"],
)
def test_resume_continues_bit_identically(tiny_model_dir, tmp_path, options):
    uninterrupted = make_policy(tiny_model_dir, **options)
    batch = sft_batch(uninterrupted, PAIRS)
    for _ in range(2):
        uninterrupted.train_step(batch)
        uninterrupted.apply_update(LR)
    uninterrupted.save(str(tmp_path))
    at_checkpoint = uninterrupted.export_weights()
    torch.manual_seed(1234)  # the checkpoint must restore torch's RNG, whatever happened since
    resumed = make_policy(tiny_model_dir, **options)
    resumed.load(str(tmp_path))
    for policy in (uninterrupted, resumed):
        policy.train_step(batch)
        policy.apply_update(LR)
    expected, got = uninterrupted.export_weights(), resumed.export_weights()
    assert all(np.array_equal(expected[name], got[name]) for name in expected)
    if options.get("optimizer") == "adamw_8bit":
        state = resumed.optimizer.state_dict()["state"]
        tensors = [v for values in state.values() for v in values.values() if torch.is_tensor(v)]
        assert any(v.dtype == torch.uint8 for v in tensors), "some moments should be 8-bit"
    # The same weights with a fresh optimizer continue differently: the state was restored.
    fresh_optimizer = make_policy(tiny_model_dir, **options)
    fresh_optimizer.import_weights(at_checkpoint)
    fresh_optimizer.train_step(batch)
    fresh_optimizer.apply_update(LR)
    assert not all(np.array_equal(expected[n], w) for n, w in fresh_optimizer.export_weights().items())


def test_lora_checkpoint_is_a_peft_adapter_directory(tiny_model_dir, tmp_path):
    policy = make_policy(tiny_model_dir, **LORA)
    train(policy)
    policy.save(str(tmp_path))
    files = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert {"model/adapter_config.json", "model/adapter_model.safetensors", "optimizer.safetensors"} <= files
    assert "model/model.safetensors" not in files and "model/config.json" not in files
    assert all(name.endswith((".json", ".safetensors")) for name in files)
    adapters = load_file(tmp_path / "model" / "adapter_model.safetensors")
    assert all(".lora_A." in n or ".lora_B." in n for n in adapters)
    config = json.loads((tmp_path / "model" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    ids = torch.tensor([policy.encode(["12+34=46"])[0]])
    policy.model.eval()
    with torch.no_grad():
        expected = policy.model(ids).logits
        # transformers loads an adapter directory on top of its base model (peft installed) ...
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
        assert torch.equal(loaded(ids).logits, expected)
        # ... and PEFT merges it into a plain model.
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        merged = PeftModel.from_pretrained(base, tmp_path / "model").merge_and_unload().eval()
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-5, rtol=0)


def test_lora_snapshot_is_what_save_writes(tiny_model_dir, tmp_path):
    policy = make_policy(tiny_model_dir, **LORA)
    train(policy, steps=1)
    write_snapshot(policy.snapshot(), tmp_path / "snapshot")
    policy.save(str(tmp_path / "saved"))
    saved = sorted(p.relative_to(tmp_path / "saved") for p in (tmp_path / "saved").rglob("*") if p.is_file())
    assert saved == sorted(
        p.relative_to(tmp_path / "snapshot") for p in (tmp_path / "snapshot").rglob("*") if p.is_file()
    )
    for name in saved:
        assert (tmp_path / "saved" / name).read_bytes() == (tmp_path / "snapshot" / name).read_bytes(), name


def test_checkpoints_of_another_kind_are_refused_clearly(tiny_model_dir, tmp_path):
    full = make_policy(tiny_model_dir)
    full.save(str(tmp_path / "full"))
    with pytest.raises(FileNotFoundError, match=r"no LoRA adapters .*lora_rank = 0"):
        make_policy(tiny_model_dir, **LORA).load(str(tmp_path / "full"))
    make_policy(tiny_model_dir, **LORA).save(str(tmp_path / "rank4"))
    shapes = r"has shape \[4, 32\], the model expects \[8, 32\] \(another lora_rank\?\)"
    with pytest.raises(ValueError, match=shapes):
        make_policy(tiny_model_dir, lora_rank=8).load(str(tmp_path / "rank4"))


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_check_policy_with_a_quantized_base(tiny_model_dir, quantization):
    check_policy(make_policy(tiny_model_dir, quantization=quantization, **LORA), PROMPTS, max_new_tokens=8)


@pytest.mark.parametrize("quantization", ["none", "int8", "nf4"])
def test_the_sampling_engine_runs_lora_and_quantized_models(tiny_model_dir, quantization):
    policy = make_policy(tiny_model_dir, quantization=quantization, **LORA)
    train(policy, steps=2)
    prompts = policy.encode(PROMPTS)
    options = DriverOptions(share_prompts=True, block_size=4, temperature=0.8, seed=3)
    groups = EngineDriver(policy, options).generate(prompts, n=2)
    completions = [(p, c) for p, group in zip(prompts, groups, strict=True) for c in group]
    ids, mask = right_padded([p + c.tokens for p, c in completions])
    teacher = policy.logprobs(TokenBatch(input_ids=ids, attention_mask=mask, temperature=0.8))
    for row, (prompt, completion) in enumerate(completions):
        got = teacher[row, len(prompt) : len(prompt) + len(completion.tokens)]
        np.testing.assert_allclose(completion.logprobs, got, atol=1e-4)


@pytest.mark.parametrize(("quantization", "atol"), [("int8", 0.01), ("nf4", 0.1)])
def test_quantized_logprobs_are_close_to_full_precision(tiny_model_dir, quantization, atol):
    batch = sequences(make_policy(tiny_model_dir))
    exact = base_logprobs(tiny_model_dir, batch)
    mask = batch.attention_mask.astype(bool)
    mask[:, 0] = False
    # The policy's frozen base (QLoRA), before any update ...
    qlora = make_policy(tiny_model_dir, quantization=quantization, **LORA)
    policy_error = np.abs(qlora.logprobs(batch) - exact)[mask]
    # ... and a quantized frozen reference next to a full-precision policy.
    policy = make_policy(tiny_model_dir, reference_quantization=quantization)
    ids, attention = torch.as_tensor(batch.input_ids), torch.as_tensor(batch.attention_mask)
    with torch.no_grad():
        reference = policy._token_logprobs(policy._reference(), ids, attention, 1.0).numpy()
    reference_error = np.abs(reference - exact)[mask]
    assert type(policy.reference.model.layers[0].self_attn.q_proj).__name__ in {"Linear8bitLt", "Linear4bit"}
    for error in (policy_error, reference_error):
        assert 0 < error.max() < atol, (quantization, error.max())
        assert error.mean() < atol / 5


def test_qlora_trains_like_lora_and_its_kl_starts_at_zero(tiny_model_dir):
    curves = {}
    for quantization in ("none", "nf4"):
        policy = make_policy(tiny_model_dir, quantization=quantization, **LORA)
        batch = sft_batch(policy, PAIRS)
        curves[quantization] = [policy.train_step(batch)["loss"]]
        for _ in range(10):
            policy.apply_update(LR)
            curves[quantization].append(policy.train_step(batch)["loss"])
    assert curves["nf4"][-1] < curves["nf4"][0] - 0.3
    assert np.allclose(curves["nf4"], curves["none"], atol=0.05), curves
    fresh = make_policy(tiny_model_dir, quantization="nf4", **LORA)
    assert fresh.train_step(grpo_batch(fresh, GrpoObjective(kl_coef=0.1)))["kl"] == pytest.approx(
        0.0, abs=1e-7
    )


def test_nf4_gradients_do_not_depend_on_generating_first(tiny_model_dir):
    # bitsandbytes repacks 4-bit weights for a CPU kernel without a backward at the first
    # no-grad forward; the policy turns that off, or the adapters' gradients would differ.
    def gradients(generate_first: bool) -> dict[str, torch.Tensor]:
        policy = make_policy(tiny_model_dir, quantization="nf4", **LORA)
        with torch.no_grad():
            for name, param in policy.trainable:
                if ".lora_B." in name:
                    param.normal_(generator=torch.Generator().manual_seed(0))
        if generate_first:
            policy.generate(requests(policy), SamplingParams(max_new_tokens=3))
        policy.train_step(sft_batch(policy, PAIRS))
        return {name: param.grad.clone() for name, param in policy.trainable}

    plain, after_generation = gradients(False), gradients(True)
    assert all(torch.equal(plain[n], after_generation[n]) for n in plain)


def test_8bit_adamw_trains(tiny_model_dir):
    policy = make_policy(tiny_model_dir, optimizer="adamw_8bit")
    batch = sft_batch(policy, PAIRS)
    losses = []
    for _ in range(25):
        losses.append(policy.train_step(batch)["loss"])
        policy.apply_update(LR)
    assert losses[-1] < 0.5 * losses[0]
    quantized = [
        name
        for name, param in policy.trainable
        if policy.optimizer.state[param].get("state1", torch.empty(0)).dtype == torch.uint8
    ]
    assert "model.layers.0.mlp.up_proj.weight" in quantized


def test_offload_optimizer_is_a_noted_no_op_on_cpu(tiny_model_dir, capfd):
    policy = make_policy(tiny_model_dir, offload_optimizer=True)
    assert isinstance(policy.optimizer, torch.optim.AdamW)
    assert "nothing to offload" in capfd.readouterr().err
    train(policy, steps=1)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit"])
def test_cpu_offload_optimizer_steps_exactly_like_the_plain_one(tiny_model_dir, optimizer):
    # Its logic on CPU "devices": host copies, gradient and weight copies, refresh, state dict.
    plain = make_policy(tiny_model_dir, optimizer=optimizer)
    offloaded = make_policy(tiny_model_dir, optimizer=optimizer)
    params = [p for _, p in offloaded.trainable]
    offloaded.optimizer = CpuOffloadOptimizer(params, optimizer_factory(offloaded.config))
    assert all(h.data_ptr() != p.data_ptr() for h, p in zip(offloaded.optimizer.host, params, strict=True))
    start = plain.export_weights()
    for policy in (plain, offloaded):
        train(policy, steps=2)
    expected = plain.export_weights()
    assert all(np.array_equal(expected[n], w) for n, w in offloaded.export_weights().items())
    # A weight changed outside the optimizer (a loaded checkpoint) reaches its host copy.
    for policy in (plain, offloaded):
        policy.import_weights(start)
        train(policy, steps=1)
    expected = plain.export_weights()
    assert all(np.array_equal(expected[n], w) for n, w in offloaded.export_weights().items())
    state = offloaded.optimizer.state_dict()
    assert state["state"] and all(
        v.device.type == "cpu"
        for values in state["state"].values()
        for v in values.values()
        if torch.is_tensor(v)
    )
    offloaded.optimizer.load_state_dict(plain.optimizer.state_dict())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"quantization": "nf4"}, "set lora_rank > 0"),
        ({"quantization": "int4"}, "must be one of 'none', 'int8', 'nf4'"),
        ({"optimizer": "sgd"}, "must be one of 'adamw', 'adamw_8bit'"),
        ({"lora_rank": -1}, "lora_rank must not be negative"),
        ({"lora_rank": 4, "lora_alpha": 0.0}, "lora_alpha must be positive"),
        ({"lora_rank": 4, "lora_dropout": 1.0}, r"lora_dropout must be in \[0, 1\)"),
        ({"lora_rank": 4, "lora_target_modules": []}, "must name at least one module"),
        ({"lora_rank": 4, "reference_quantization": "int8"}, "set reference_model_path"),
        ({"lora_rank": 4, "lora_target_modules": "q_proj"}, "expected an array"),
    ],
)
def test_config_errors_are_clear(tiny_model_dir, options, message):
    with pytest.raises(ConfigError, match=message):
        make_policy(tiny_model_dir, **options)


def test_unknown_target_modules_name_the_model_s_linear_layers(tiny_model_dir):
    with pytest.raises(ValueError, match=r"no module named `c_attn`; its linear layers are .*q_proj"):
        make_policy(tiny_model_dir, lora_rank=4, lora_target_modules=["q_proj", "c_attn"])


def test_quantized_reference_with_full_fine_tuning_and_lora_with_an_explicit_reference(tiny_model_dir):
    for options in (
        {"reference_quantization": "int8"},
        {**LORA, "reference_model_path": str(tiny_model_dir), "reference_quantization": "nf4"},
    ):
        policy = make_policy(tiny_model_dir, **options)
        assert policy.train_step(grpo_batch(policy, GrpoObjective(kl_coef=0.1)))["kl"] < 1e-2
