"""Fixtures shared by the plugin tests."""

from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

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
