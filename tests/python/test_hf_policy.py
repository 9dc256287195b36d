"""HFCausalLM against the SDK contract and against Hugging Face's own generate/from_pretrained."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from policy_helpers import LR, PAIRS, PROMPTS, grpo_batch, make_policy, requests, right_padded, sft_batch
from tokenizers import processors
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from python_plugins.quickstart import create_char_tokenizer, create_tiny_model
from rollout_sdk import (
    ConfigError,
    GenerationRequest,
    GrpoObjective,
    SamplingParams,
    TokenBatch,
    TrainBatch,
)
from rollout_sdk.snapshot import write_snapshot
from rollout_sdk.testing import PluginCheckError, check_policy


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_gpt2_dir"])
def test_check_policy(model, request):
    check_policy(make_policy(request.getfixturevalue(model)), PROMPTS, max_new_tokens=8)


def test_describe_and_special_tokens(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert policy.describe() == {
        "parameters": sum(p.numel() for p in policy.model.parameters()),
        "dtype": "float32",
        "device": "cpu",
        "sharding": "replicate",
    }
    assert policy.eos_token_ids() == [tokenizer.eos_token_id]
    assert policy.encode(["12+3="]) == [tokenizer("12+3=", add_special_tokens=False)["input_ids"]]
    assert policy.decode([[*policy.encode(["12+3="])[0], tokenizer.eos_token_id]]) == ["12+3="]
    # No sequences, no texts (a step whose groups were all dropped decodes nothing).
    assert policy.encode([]) == [] and policy.decode([]) == []


def test_encode_keeps_a_default_bos_but_no_other_special_tokens(tmp_path):
    create_tiny_model(tmp_path, hidden_size=16, num_layers=1, num_heads=2)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    backend = tokenizer.backend_tokenizer
    bos = tokenizer.eos_token_id
    backend.post_processor = processors.TemplateProcessing(
        single="<eos> $A <eos>", special_tokens=[("<eos>", bos)]
    )
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", bos_token="<eos>").save_pretrained(
        tmp_path
    )
    policy = make_policy(tmp_path)
    plain = tokenizer("12", add_special_tokens=False)["input_ids"]
    assert policy.encode(["12"]) == [[bos, *plain]]
    assert policy.decode(policy.encode(["12"])) == ["12"]


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_gpt2_dir"])
def test_greedy_generation_matches_hf_generate(model, request):
    model_dir = request.getfixturevalue(model)
    policy = make_policy(model_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    groups = policy.generate(requests(policy), params)
    for request, (generation,) in zip(requests(policy), groups, strict=True):
        prompt = torch.as_tensor(request.prompt_ids).unsqueeze(0)
        expected = hf_model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12
        )[0, prompt.shape[1] :]
        expected = expected.tolist()
        if generation.finish_reason == "stop":
            expected = expected[: expected.index(policy.eos_token_ids()[0]) + 1]
        assert generation.token_ids.tolist() == expected


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_gpt2_dir"])
def test_sampled_logprobs_match_teacher_forcing_before_truncation(model, request):
    policy = make_policy(request.getfixturevalue(model))
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=5, top_p=0.8, seed=3)
    reqs = requests(policy, n=3)
    groups = policy.generate(reqs, params)
    sequences = [[*r.prompt_ids, *g.token_ids] for r, group in zip(reqs, groups, strict=True) for g in group]
    ids, mask = right_padded(sequences)
    teacher = policy.logprobs(TokenBatch(input_ids=ids, attention_mask=mask, temperature=0.7))
    assert teacher.dtype == np.float32
    assert np.all(teacher[mask == 0] == 0)
    row = 0
    for request, group in zip(reqs, groups, strict=True):
        for generation in group:
            start = len(request.prompt_ids)
            got = teacher[row, start : start + len(generation.token_ids)]
            np.testing.assert_allclose(generation.logprobs, got, atol=1e-4)
            row += 1


def test_stop_token_ends_the_completion_and_is_included(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    free = policy.generate(requests(policy, ["12+34="]), greedy)[0][0].token_ids.tolist()
    stop = free[2]
    stopped = policy.generate(
        requests(policy, ["12+34="]),
        SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop,)),
    )[0][0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids.tolist() == free[: free.index(stop) + 1]


def test_rows_finish_independently(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    free = policy.generate(requests(policy), SamplingParams(max_new_tokens=6, temperature=0.0))
    stop = int(free[0][0].token_ids[0])
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(stop,))
    for (unstopped,), (generation,) in zip(free, policy.generate(requests(policy), params), strict=True):
        tokens = unstopped.token_ids.tolist()
        if stop in tokens:
            assert generation.finish_reason == "stop"
            assert generation.token_ids.tolist() == tokens[: tokens.index(stop) + 1]
        else:
            assert generation.finish_reason == "length"
            assert generation.token_ids.tolist() == tokens
            assert len(tokens) == 6
    assert free[0][0].finish_reason == "length"


def test_top_k_one_equals_greedy(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    greedy = policy.generate(requests(policy), SamplingParams(max_new_tokens=8, temperature=0.0))
    top1 = policy.generate(
        requests(policy), SamplingParams(max_new_tokens=8, temperature=1.0, top_k=1, seed=9)
    )
    for (a,), (b,) in zip(greedy, top1, strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)


def test_sampling_depends_on_the_seed(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    a = policy.generate(requests(policy, n=4), SamplingParams(max_new_tokens=8, seed=1))
    b = policy.generate(requests(policy, n=4), SamplingParams(max_new_tokens=8, seed=2))
    flat = (
        [g.token_ids.tolist() for group in a for g in group],
        [g.token_ids.tolist() for group in b for g in group],
    )
    assert flat[0] != flat[1]


def test_sft_steps_reduce_the_loss(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    batch = sft_batch(policy, PAIRS)
    losses = []
    for _ in range(25):
        losses.append(policy.train_step(batch)["loss"])
        update = policy.apply_update(LR)
    assert losses[-1] < 0.5 * losses[0]
    assert update["learning_rate"] == LR
    assert update["grad_norm"] > 0


def test_gradients_accumulate_until_apply_update(tiny_model_dir):
    whole = make_policy(tiny_model_dir, max_grad_norm=0.0)
    split = make_policy(tiny_model_dir, max_grad_norm=0.0)
    batch = sft_batch(whole, PAIRS)
    whole.train_step(batch)
    whole_norm = whole.apply_update(LR)["grad_norm"]
    total_tokens = float(batch.loss_mask.sum())
    for rows in (slice(0, 2), slice(2, 4)):
        split.train_step(
            TrainBatch(
                input_ids=batch.input_ids[rows],
                attention_mask=batch.attention_mask[rows],
                loss_mask=batch.loss_mask[rows],
                advantages=batch.advantages[rows],
                old_logprobs=batch.old_logprobs[rows],
                loss_scale=1.0 / total_tokens,
                objective=batch.objective,
            )
        )
    assert split.apply_update(LR)["grad_norm"] == pytest.approx(whole_norm, rel=1e-4)


def test_gradient_clipping_shrinks_the_update(tiny_model_dir):
    # With a large Adam epsilon the update is proportional to the (clipped) gradient.
    changes = {}
    for max_grad_norm in (0.0, 1e-6):
        policy = make_policy(tiny_model_dir, adam_eps=1.0, max_grad_norm=max_grad_norm)
        before = policy.export_weights()
        policy.train_step(sft_batch(policy, PAIRS))
        assert policy.apply_update(LR)["grad_norm"] > 1e-3
        assert all(p.grad is None for _, p in policy.trainable)
        after = policy.export_weights()
        changes[max_grad_norm] = max(float(np.abs(after[k] - before[k]).max()) for k in before)
    assert 0 < changes[1e-6] < 1e-3 * changes[0.0]


def test_kl_is_zero_before_updates_and_positive_after(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    objective = GrpoObjective(kl_coef=0.1)
    assert policy.reference is None
    first = policy.train_step(grpo_batch(policy, objective))
    assert policy.reference is not None
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)
    policy.apply_update(LR)
    for _ in range(3):
        policy.train_step(grpo_batch(policy, objective))
        policy.apply_update(LR)
    assert policy.train_step(grpo_batch(policy, objective))["kl"] > 1e-4


def test_reference_stays_the_original_model_after_resume(tiny_model_dir, tmp_path):
    trained = make_policy(tiny_model_dir)
    for _ in range(3):
        trained.train_step(sft_batch(trained, PAIRS))
        trained.apply_update(LR)
    trained.save(str(tmp_path))
    resumed = make_policy(tiny_model_dir)
    resumed.load(str(tmp_path))
    assert resumed.train_step(grpo_batch(resumed, GrpoObjective(kl_coef=0.1)))["kl"] > 1e-4


def test_saved_model_loads_with_from_pretrained(tiny_model_dir, tmp_path):
    policy = make_policy(tiny_model_dir)
    policy.train_step(sft_batch(policy, PAIRS))
    policy.apply_update(LR)
    policy.save(str(tmp_path))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    ids = torch.tensor(tokenizer(["12+34=46"], add_special_tokens=False)["input_ids"])
    policy.model.eval()
    with torch.no_grad():
        assert torch.equal(policy.model(ids).logits, reloaded(ids).logits)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert not torch.equal(original(ids).logits, reloaded(ids).logits)


def test_resume_continues_bit_identically(tiny_model_dir, tmp_path):
    uninterrupted = make_policy(tiny_model_dir)
    batch = sft_batch(uninterrupted, PAIRS)
    for _ in range(2):
        uninterrupted.train_step(batch)
        uninterrupted.apply_update(LR)
    uninterrupted.save(str(tmp_path))
    torch.manual_seed(1234)  # the checkpoint must restore torch's RNG, whatever happened since
    resumed = make_policy(tiny_model_dir)
    resumed.load(str(tmp_path))
    for policy in (uninterrupted, resumed):
        policy.train_step(batch)
        policy.apply_update(LR)
    expected, got = uninterrupted.export_weights(), resumed.export_weights()
    assert all(np.array_equal(expected[name], got[name]) for name in expected)
    fresh_optimizer = make_policy(tmp_path / "model")
    fresh_optimizer.train_step(batch)
    fresh_optimizer.apply_update(LR)
    assert not all(np.array_equal(expected[n], w) for n, w in fresh_optimizer.export_weights().items())


def test_save_writes_only_safetensors_and_json(tiny_model_dir, tmp_path):
    policy = make_policy(tiny_model_dir)
    policy.train_step(sft_batch(policy, PAIRS))
    policy.apply_update(LR)
    policy.save(str(tmp_path))
    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert {"optimizer.safetensors", "optimizer.json", "model.safetensors"} <= {path.name for path in files}
    for path in files:
        assert path.suffix in {".safetensors", ".json"}, path
        head = path.read_bytes()[:2]
        assert head[:1] != b"\x80" and head != b"PK", f"{path} looks like a pickle or torch zip"


def test_written_snapshot_is_what_save_writes(tiny_model_dir, tmp_path):
    policy = make_policy(tiny_model_dir)
    policy.train_step(sft_batch(policy, PAIRS))
    policy.apply_update(LR)
    write_snapshot(policy.snapshot(), tmp_path / "snapshot")
    policy.save(str(tmp_path / "saved"))
    saved = sorted(p.relative_to(tmp_path / "saved") for p in (tmp_path / "saved").rglob("*") if p.is_file())
    assert saved == sorted(
        p.relative_to(tmp_path / "snapshot") for p in (tmp_path / "snapshot").rglob("*") if p.is_file()
    )
    assert {"model/model.safetensors", "optimizer.safetensors", "model/config.json"} <= {
        p.as_posix() for p in saved
    }
    for name in saved:
        assert (tmp_path / "saved" / name).read_bytes() == (tmp_path / "snapshot" / name).read_bytes(), name


def test_snapshot_tensors_view_the_live_weights_on_cpu(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    model_file = policy.snapshot()["model/model.safetensors"]
    embedding = model_file.tensors["model.embed_tokens.weight"]
    assert embedding.dtype == "F32" and embedding.shape == tuple(policy.model.model.embed_tokens.weight.shape)
    before = bytes(embedding.data)
    with torch.no_grad():
        policy.model.model.embed_tokens.weight.add_(1.0)
    assert bytes(embedding.data) != before, "expected a view: the engine copies it, the policy need not"


def test_snapshot_of_tied_embeddings_loads_with_from_pretrained(tiny_gpt2_dir, tmp_path):
    policy = make_policy(tiny_gpt2_dir)
    assert policy.model.lm_head.weight.data_ptr() == policy.model.transformer.wte.weight.data_ptr()
    policy.train_step(sft_batch(policy, PAIRS))
    policy.apply_update(LR)
    policy.save(str(tmp_path))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    policy.model.eval()
    with torch.no_grad():
        assert torch.equal(policy.model(ids).logits, reloaded(ids).logits)
    resumed = make_policy(tiny_gpt2_dir)
    resumed.load(str(tmp_path))
    expected, got = policy.export_weights(), resumed.export_weights()
    assert all(np.array_equal(expected[name], got[name]) for name in expected)


def test_import_weights_validates_names_and_shapes(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    weights = policy.export_weights()
    name = "model.layers.0.mlp.up_proj.weight"
    wrong_shape = {**weights, name: np.zeros((3, 3), dtype=np.float32)}
    with pytest.raises(ValueError, match=re.escape(f"`{name}` has shape")):
        policy.import_weights(wrong_shape)
    with pytest.raises(ValueError, match=r"no parameter `extra\.weight`"):
        policy.import_weights({**weights, "extra.weight": np.zeros(1, dtype=np.float32)})
    with pytest.raises(ValueError, match=re.escape(f"`{name}` is missing")):
        policy.import_weights({k: v for k, v in weights.items() if k != name})
    assert all(np.array_equal(weights[k], v) for k, v in policy.export_weights().items())


def test_export_is_a_copy(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    weights = policy.export_weights()
    weights["lm_head.weight"][:] = 0.0
    assert np.any(policy.export_weights()["lm_head.weight"] != 0.0)


def test_bfloat16_weights_export_as_float32_and_round_trip(tiny_model_dir):
    policy = make_policy(tiny_model_dir, dtype="bfloat16")
    assert policy.model.dtype == torch.bfloat16
    weights = policy.export_weights()
    assert all(w.dtype == np.float32 for w in weights.values())
    policy.import_weights({k: np.zeros_like(v) for k, v in weights.items()})
    policy.import_weights(weights)
    assert all(np.array_equal(weights[k], v) for k, v in policy.export_weights().items())


def test_gradient_checkpointing_changes_nothing_observable(tiny_model_dir):
    plain = make_policy(tiny_model_dir)
    checkpointed = make_policy(tiny_model_dir, gradient_checkpointing=True)
    assert checkpointed.model.is_gradient_checkpointing
    params = SamplingParams(max_new_tokens=6, seed=4)
    for policy in (plain, checkpointed):
        policy.train_step(sft_batch(policy, PAIRS))
        policy.apply_update(LR)
    a, b = plain.generate(requests(plain), params), checkpointed.generate(requests(checkpointed), params)
    assert [g.token_ids.tolist() for (g,) in a] == [g.token_ids.tolist() for (g,) in b]
    assert checkpointed.train_step(sft_batch(checkpointed, PAIRS))["loss"] == pytest.approx(
        plain.train_step(sft_batch(plain, PAIRS))["loss"], rel=1e-5
    )


def test_tied_embeddings_save_and_load(tmp_path):
    model_dir = tmp_path / "tied"
    tokenizer = create_char_tokenizer(model_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(model_dir)
    policy = make_policy(model_dir)
    assert policy.model.lm_head.weight is policy.model.model.embed_tokens.weight
    policy.train_step(sft_batch(policy, PAIRS))
    policy.apply_update(LR)
    trained = policy.export_weights()
    policy.save(str(tmp_path / "checkpoint"))
    policy.import_weights({k: np.zeros_like(v) for k, v in trained.items()})
    policy.load(str(tmp_path / "checkpoint"))
    assert all(np.array_equal(trained[k], v) for k, v in policy.export_weights().items())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"adam_betas": [0.9, 0.99, 0.9]}, "expected 2 values, got 3"),
        ({"dtype": "float64"}, "float32"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"learning_rate": 1e-3}, "unknown option"),
        ({"max_grad_norm": "1"}, "expected a number"),
    ],
)
def test_config_is_validated(tiny_model_dir, options, message):
    with pytest.raises(ConfigError, match=message):
        make_policy(tiny_model_dir, **options)


def test_adam_betas_are_used(tiny_model_dir):
    policy = make_policy(tiny_model_dir, adam_betas=[0.8, 0.9], weight_decay=0.01, adam_eps=1e-6)
    group = policy.optimizer.param_groups[0]
    assert group["betas"] == (0.8, 0.9)
    assert group["weight_decay"] == 0.01
    assert group["eps"] == 1e-6


def test_negative_learning_rate_is_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match="learning_rate"):
        make_policy(tiny_model_dir).apply_update(-1.0)


def test_empty_prompt_is_rejected(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    with pytest.raises(ValueError, match="empty prompt"):
        policy.generate([GenerationRequest(prompt_ids=np.zeros(0, dtype=np.int64))], SamplingParams())


def test_check_policy_rejects_a_snapshot_that_is_not_a_copy(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    policy.snapshot = make_policy(tiny_model_dir).snapshot  # another model's, never trained
    with pytest.raises(PluginCheckError, match="snapshot"):
        check_policy(policy, PROMPTS, max_new_tokens=8)


def test_pickled_weights_are_never_loaded(tiny_model_dir, tmp_path):
    """A model directory with only `pytorch_model.bin` (a pickle, which can run code when
    loaded) is refused before transformers sees it."""
    pickled = tmp_path / "pickled"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config.save_pretrained(pickled)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(pickled)
    assert not list(pickled.glob("*.safetensors"))
    with pytest.raises(ValueError, match="no safetensors weights; pickled ones"):
        make_policy(str(pickled))


def test_weight_views_lend_the_parameters_read_only(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    copies, views = policy.export_weights(), policy.weight_views()
    assert set(copies) == set(views)
    assert all(np.array_equal(copies[k], v) for k, v in views.items())
    parameter = dict(policy.trainable)["lm_head.weight"]
    assert np.shares_memory(views["lm_head.weight"], parameter.detach().numpy())
    with pytest.raises(ValueError, match="read-only"):
        views["lm_head.weight"][:] = 0.0
