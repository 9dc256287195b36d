"""Chunked output-layer logprobs and packed micro-batches give the full-logits path's numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from policy_helpers import make_policy, right_padded
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from python_plugins import hf_policy, output_head
from python_plugins.packing import plan_packing, plan_right_padded
from python_plugins.shared_prefix import plan_shared_prefixes
from python_plugins.value_head import logprobs_and_hidden
from rollout_sdk import GrpoObjective, SftObjective, TokenBatch, TrainBatch
from rollout_sdk.fused_logprobs import chunk_rows, chunked_logprobs
from rollout_sdk.objectives import token_logprobs

# The chunked op


def reference_logprobs(hidden, weight, bias, targets, temperature):
    """``token_logprobs`` on the full logits, shifted so that row ``i`` predicts ``targets[i]``."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logits = torch.cat([logits, logits.new_zeros(1, logits.shape[1])])[None]
    ids = torch.cat([targets.new_zeros(1), targets])[None]
    return token_logprobs(logits, ids, temperature)[0, 1:]


def op_inputs(rows=23, hidden_size=8, vocab=37, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=generator, requires_grad=True)
    b = torch.randn(vocab, generator=generator, requires_grad=True) if bias else None
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    upstream = torch.randn(rows, generator=generator)
    return hidden, weight, b, targets, upstream


def values_and_grads(fn, hidden, weight, bias, targets, upstream, temperature):
    tensors = [t for t in (hidden, weight, bias) if t is not None]
    for t in tensors:
        t.grad = None
    out = fn(hidden, weight, bias, targets, temperature)
    (out * upstream).sum().backward()
    return out.detach(), [t.grad.clone() if t.grad is not None else None for t in tensors]


@pytest.mark.parametrize("chunk", [1, 4, 5, 23, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [True, False])
def test_chunked_op_matches_full_logits(chunk, temperature, bias):
    inputs = op_inputs(bias=bias)

    def chunked(h, w, b, t, temp):
        return chunked_logprobs(h, w, b, t, temp, chunk=chunk)

    got, got_grads = values_and_grads(chunked, *inputs, temperature)
    expected, expected_grads = values_and_grads(reference_logprobs, *inputs, temperature)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert len(got_grads) == (3 if bias else 2)
    for a, b in zip(got_grads, expected_grads, strict=True):
        assert a is not None and a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_frozen_weight_gets_no_gradient_and_no_grad_mode_gives_the_same_values():
    hidden, weight, bias, targets, upstream = op_inputs()
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    out = chunked_logprobs(hidden, weight, bias, targets, 0.7, chunk=6)
    (out * upstream).sum().backward()
    assert weight.grad is None and bias.grad is None
    expected = hidden.detach().clone().requires_grad_(True)
    (reference_logprobs(expected, weight, bias, targets, 0.7) * upstream).sum().backward()
    torch.testing.assert_close(hidden.grad, expected.grad, rtol=1e-5, atol=1e-6)
    with torch.inference_mode():
        inferred = chunked_logprobs(hidden, weight, bias, targets, 0.7, chunk=6)
    assert not inferred.requires_grad
    torch.testing.assert_close(inferred, out.detach(), rtol=0, atol=0)


def test_chunk_rows_keep_float32_logits_within_the_budget():
    assert chunk_rows(1000, chunk_bytes=64_000) == 16
    assert chunk_rows(151_936) * 151_936 * 4 <= 64 * 2**20
    assert chunk_rows(10**9) == 1


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an operation returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tokens_by_vocab_tensor_is_saved_or_computed():
    rows, hidden_size, vocab, chunk = 64, 4, 2000, 8
    hidden, weight, bias, targets, upstream = op_inputs(rows, hidden_size, vocab)
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    def run(fn) -> int:
        recorder = LargestTensor()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
            (fn() * upstream).sum().backward()
        return recorder.largest

    largest = run(lambda: chunked_logprobs(hidden, weight, bias, targets, 0.7, chunk=chunk))
    assert saved and all(torch.Size(s).numel() < rows * vocab / 4 for s in saved), saved
    assert largest <= chunk * vocab < rows * vocab
    # The check can fail: the full-logits path holds [rows, vocab].
    assert run(lambda: reference_logprobs(hidden, weight, bias, targets, 0.7)) >= rows * vocab


# Packing


def test_first_fit_decreasing_into_bins_of_the_longest_row():
    packing = plan_packing([9, 3, 5, 4, 2, 6], width=10)
    assert packing is not None
    assert (packing.bins, packing.capacity) == (4, 9)
    # 9 | 6+3 | 5+4 | 2
    assert packing.row_bin == [0, 1, 2, 2, 3, 1]
    assert packing.row_offset == [0, 6, 0, 5, 0, 0]
    assert plan_packing([9, 9, 8], width=9) is None, "saves under 15%"
    assert plan_packing([0, 3], width=3) is None


def test_the_layout_restarts_positions_per_sequence():
    ids, mask = right_padded([[11, 12, 13, 14, 15], [21, 22, 23], [31, 32]])
    packing = plan_right_padded(mask, min_saving=0.0)
    # Each row's last token predicts nothing, so the bins hold 4, 2 and 1 tokens.
    assert packing is not None and (packing.bins, packing.capacity) == (2, 4)
    inputs = torch.as_tensor(mask.sum(1) - 1)
    packed, positions, destination = packing.layout(torch.as_tensor(ids), inputs)
    assert packed.tolist() == [[11, 12, 13, 14], [21, 22, 31, 0]]
    assert positions.tolist() == [[0, 1, 2, 3], [0, 1, 0, 0]]
    assert destination.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert plan_right_padded(right_padded([[11, 12], [21]])[1], min_saving=0.0) is None, "a row with no input"
    left = np.flip(mask, axis=1).copy()
    assert plan_right_padded(left, min_saving=0.0) is None, "left-padded rows are not packed"


# The policy


def ragged_batch(objective) -> TrainBatch:
    """Three prompts with completions of 1 to 7 tokens, and the first one's of 20: rows of
    16 to 35 tokens, packed into 5 bins (two with two rows), and prompts worth sharing."""
    rng = np.random.default_rng(0)
    prompts = [[1, *rng.integers(3, 40, size=n).tolist()] for n in (14, 12, 16)]
    rows = [(p, rng.integers(3, 40, size=int(n)).tolist()) for p in prompts for n in rng.integers(1, 8, 2)]
    rows.append((prompts[0], rng.integers(3, 40, size=20).tolist()))
    ids, attention = right_padded([p + c for p, c in rows])
    loss = np.zeros(ids.shape, dtype=np.float32)
    for row, (p, c) in enumerate(rows):
        loss[row, len(p) : len(p) + len(c)] = 1
    return TrainBatch(
        input_ids=ids,
        attention_mask=attention,
        loss_mask=loss,
        advantages=(rng.standard_normal(ids.shape) * loss).astype(np.float32),
        old_logprobs=np.full(ids.shape, -3.0, dtype=np.float32),
        loss_scale=float(1.0 / loss.sum()),
        objective=objective,
    )


def full_logits_head(model):
    return None


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_gpt2_dir", "tiny_gqa_dir"])
@pytest.mark.parametrize(
    "objective",
    [GrpoObjective(kl_coef=0.1, temperature=0.7), SftObjective()],
    ids=["grpo_kl", "sft"],
)
def test_train_step_packed_unpacked_shared_and_full_logits_agree(model, objective, request, monkeypatch):
    model_dir = request.getfixturevalue(model)
    batch = ragged_batch(objective)
    packing = plan_right_padded(batch.attention_mask)
    assert packing is not None and packing.bins < batch.input_ids.shape[0], "some bin holds two rows"
    assert plan_shared_prefixes(batch.input_ids, batch.attention_mask, batch.loss_mask) is not None
    packed_calls = []
    plain = hf_policy.sequence_logprobs

    def spy(model, head, input_ids, attention_mask, temperature, packing=None):
        packed_calls.append(packing is not None)
        return plain(model, head, input_ids, attention_mask, temperature, packing)

    def step(share: bool, pack: bool = True, fused: bool = True):
        with monkeypatch.context() as patch:
            patch.setattr(hf_policy, "sequence_logprobs", spy)
            if not pack:
                patch.setattr(hf_policy, "plan_right_padded", lambda *_: None)
            if not fused:
                patch.setattr(hf_policy, "output_head", full_logits_head)
            policy = make_policy(model_dir, share_prompt_prefix=share)
            for module in policy.model.modules():  # GPT-2's dropout would draw different masks
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
            metrics = policy.train_step(batch)
        grads = [p.grad.clone() for p in policy.model.parameters() if p.grad is not None]
        assert len(grads) == sum(1 for p in policy.model.parameters() if p.requires_grad)
        return metrics, grads

    packed = step(share=False)
    assert packed_calls and all(packed_calls), "the micro-batch ran packed"
    packed_calls.clear()
    unpacked = step(share=False, pack=False)
    assert packed_calls and not any(packed_calls)
    old = step(share=False, pack=False, fused=False)
    packed_calls.clear()
    shared = step(share=True)
    assert not packed_calls, "the shared-prefix path ran"
    for metrics, grads in (unpacked, old, shared):
        assert metrics.keys() == packed[0].keys()
        for key in packed[0]:
            if key != "reference_seconds":
                assert packed[0][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
        for a, b in zip(packed[1], grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def left_padded(sequences: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ids, mask = right_padded([s[::-1] for s in sequences])
    return np.flip(ids, axis=1).copy(), np.flip(mask, axis=1).copy()


def test_logprobs_are_unchanged_from_the_full_logits(tiny_model_dir, tiny_gpt2_dir):
    for model_dir in (tiny_model_dir, tiny_gpt2_dir):
        policy = make_policy(model_dir)
        assert output_head.output_head(policy.model) is not None
        sequences = [[1, 5, 9, 7, 3, 22], [1, 4], [1, 30, 31, 8]]
        for input_ids, attention in (right_padded(sequences), left_padded(sequences)):
            got = policy.logprobs(TokenBatch(input_ids=input_ids, attention_mask=attention, temperature=0.7))
            t_ids, t_mask = torch.as_tensor(input_ids), torch.as_tensor(attention)
            with torch.no_grad():
                logits = policy.model(
                    input_ids=t_ids,
                    attention_mask=t_mask,
                    position_ids=(t_mask.cumsum(-1) - 1).clamp_min(0),
                    use_cache=False,
                ).logits
            expected = (token_logprobs(logits, t_ids, 0.7) * t_mask).numpy()
            assert np.count_nonzero(got) == np.count_nonzero(attention[:, 1:])
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_ppo_logprobs_and_hidden_match_the_full_logits(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    ids, mask = right_padded([[1, 5, 9, 7, 3, 22], [1, 4], [1, 30, 31, 8]])
    ids, mask = torch.as_tensor(ids), torch.as_tensor(mask)
    head = output_head.output_head(policy.model)
    assert head is not None
    got, got_hidden = logprobs_and_hidden(policy.model, ids, mask, 0.7, head)
    expected, hidden = logprobs_and_hidden(policy.model, ids, mask, 0.7)
    torch.testing.assert_close(got, expected * mask, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_hidden, hidden, rtol=0, atol=0)


def test_models_whose_logits_are_not_the_linear_layer_use_the_logits():
    small = {"vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    torch.manual_seed(0)
    assert output_head.output_head(LlamaForCausalLM(LlamaConfig(intermediate_size=32, **small))) is not None
    gemma = Gemma2ForCausalLM(
        Gemma2Config(
            intermediate_size=32, num_key_value_heads=1, head_dim=8, final_logit_softcapping=30.0, **small
        )
    )
    assert output_head.output_head(gemma) is None

    class ScaledLogits(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output.logits = output.logits * 2.0
            return output

    assert output_head.output_head(ScaledLogits(LlamaConfig(intermediate_size=32, **small))) is None

    class Wrapped(torch.nn.Linear):
        pass

    llama = LlamaForCausalLM(LlamaConfig(intermediate_size=32, **small))
    llama.lm_head.__class__ = Wrapped
    assert output_head.output_head(llama) is None
