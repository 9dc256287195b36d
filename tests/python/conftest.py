"""Fixtures shared by the plugin tests."""

from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM

from python_plugins.quickstart import create_char_tokenizer, create_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded two-layer Llama (hidden size 32) with the quickstart's character tokenizer."""
    directory = tmp_path_factory.mktemp("tiny_model")
    create_tiny_model(directory, hidden_size=32, num_layers=2, num_heads=2, max_positions=64, seed=0)
    return directory


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2: absolute position embeddings, so wrong position ids change its outputs."""
    directory = tmp_path_factory.mktemp("tiny_gpt2")
    tokenizer = create_char_tokenizer(directory)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=64,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_gqa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mistral: two query heads per key/value head and a 5-token sliding window."""
    directory = tmp_path_factory.mktemp("tiny_gqa")
    tokenizer = create_char_tokenizer(directory)
    config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=5,
        max_position_embeddings=64,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def wide_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer GPT-2 with the character tokenizer and 8 unused extra vocabulary entries."""
    directory = tmp_path_factory.mktemp("wide_draft")
    tokenizer = create_char_tokenizer(directory)
    config = GPT2Config(
        vocab_size=len(tokenizer) + 8,
        n_embd=32,
        n_layer=1,
        n_head=4,
        n_positions=64,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(1)
    GPT2LMHeadModel(config).save_pretrained(directory)
    return directory
