"""Colocated generation: the HF policy releases its KV cache and weights while trainer ranks
step on its device, and takes them back before generating (only on CUDA; on the host it is a
no-op, which is what runs here without a GPU)."""

from __future__ import annotations

import pytest
import torch
from engine_driver import DriverOptions, EngineDriver
from policy_helpers import PROMPTS, make_policy

from python_plugins.engine_runner import releases_memory
from rollout_sdk import Policy


def test_only_a_cuda_device_is_worth_releasing():
    assert releases_memory(torch.device("cuda", 0))
    assert not releases_memory(torch.device("cpu"))


def test_the_sdk_default_keeps_everything():
    # A policy that does not implement them keeps its memory (the Rust host calls them too).
    assert Policy.release_memory(object.__new__(Policy)) is None
    assert Policy.restore_memory(object.__new__(Policy)) is None


def test_on_the_host_release_and_restore_leave_the_engine_as_it_was(tiny_model_dir):
    policy = make_policy(tiny_model_dir, device="cpu")
    driver = EngineDriver(policy, DriverOptions())
    prompts = policy.encode(PROMPTS)
    before = [[c.tokens for c in group] for group in driver.generate(prompts)]
    cache = policy.engine_runner.target.cache
    assert not policy.engine_runner.release_memory()
    policy.release_memory()
    assert policy.engine_runner.target.cache is cache, "the cache was kept"
    assert all(p.device.type == "cpu" for p in policy.model.parameters())
    policy.restore_memory()
    after = [[c.tokens for c in group] for group in driver.generate(prompts)]
    assert after == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_cache_and_weights_leave_the_device_and_come_back(tiny_model_dir):
    policy = make_policy(tiny_model_dir, device="cuda")
    driver = EngineDriver(policy, DriverOptions())
    prompts = policy.encode(PROMPTS)
    before = [[c.tokens for c in group] for group in driver.generate(prompts)]
    runner = policy.engine_runner
    slots = runner.target.cache.num_slots
    held = torch.cuda.memory_allocated()
    policy.release_memory()
    assert runner.target.cache is None
    assert all(p.device.type == "cpu" for p in policy.model.parameters())
    assert torch.cuda.memory_allocated() < held
    policy.restore_memory()
    assert runner.target.cache is not None and runner.target.cache.num_slots == slots
    assert all(p.device.type == "cuda" for p in policy.model.parameters())
    # Greedy completions are the same with the cache reallocated (the engine is told to
    # forget cached prefixes; this driver never reuses them).
    after = [[c.tokens for c in group] for group in driver.generate(prompts)]
    assert after == before
