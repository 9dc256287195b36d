"""Weights handed to ``import_weights`` one tensor at a time (``rollout_sdk.weights.StreamedWeights``)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from policy_helpers import make_policy

from rollout_sdk.weights import StreamedWeights


class Arrivals:
    """Tensors handed over one at a time, counting how many were taken."""

    def __init__(self, tensors: dict[str, np.ndarray], fail_after: int | None = None) -> None:
        self.items = list(tensors.items())
        self.taken = 0
        self.fail_after = fail_after

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        return self

    def __next__(self) -> tuple[str, np.ndarray]:
        if self.taken == self.fail_after:
            raise RuntimeError("the weight version stopped arriving")
        if self.taken == len(self.items):
            raise StopIteration
        self.taken += 1
        return self.items[self.taken - 1]


def tensors(count: int = 4) -> dict[str, np.ndarray]:
    return {f"w{i}": np.full((2, i + 1), float(i), dtype=np.float32) for i in range(count)}


def test_iterating_takes_each_tensor_only_when_it_is_reached():
    arrivals = Arrivals(tensors())
    weights = StreamedWeights(arrivals)
    seen = []
    for name, value in weights.items():
        seen.append(name)
        assert arrivals.taken == len(seen)
        assert value[0, 0] == float(len(seen) - 1)
    assert seen == ["w0", "w1", "w2", "w3"]
    # Read again, from what arrived.
    assert list(weights) == seen


def test_lookups_wait_for_their_name_and_len_for_all():
    arrivals = Arrivals(tensors())
    weights = StreamedWeights(arrivals)
    assert weights["w1"][0, 0] == 1.0
    assert arrivals.taken == 2
    assert "w3" in weights and "w9" not in weights
    with pytest.raises(KeyError):
        weights["w9"]
    assert len(weights) == 4
    # An iteration begun after some arrived still yields every tensor once, in order.
    assert list(StreamedWeights(Arrivals(tensors()))) == ["w0", "w1", "w2", "w3"]


def test_a_broken_transfer_raises_where_it_is_read():
    weights = StreamedWeights(Arrivals(tensors(), fail_after=2))
    names = iter(weights)
    assert [next(names), next(names)] == ["w0", "w1"]
    with pytest.raises(RuntimeError, match="stopped arriving"):
        next(names)


def test_the_hf_policy_copies_each_tensor_as_it_arrives(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    exported = policy.export_weights()
    target = {name: np.full_like(value, 0.5) for name, value in exported.items()}
    params = dict(policy.trainable)
    copied_when_taken = []

    class Watched(Arrivals):
        def __next__(self) -> tuple[str, np.ndarray]:
            # Every tensor handed over before this one is already in its parameter.
            copied_when_taken.append(all(torch.all(params[n] == 0.5) for n, _ in self.items[: self.taken]))
            return super().__next__()

    watched = Watched(target)
    policy.import_weights(StreamedWeights(watched))
    assert all(copied_when_taken) and len(copied_when_taken) == len(target) + 1
    assert all(np.array_equal(target[k], v) for k, v in policy.export_weights().items())


def test_the_hf_policy_reports_a_transfer_that_stopped_short(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    exported = policy.export_weights()
    with pytest.raises(RuntimeError, match="stopped arriving"):
        policy.import_weights(StreamedWeights(Arrivals(exported, fail_after=3)))
    short = dict(list(exported.items())[:-1])
    with pytest.raises(ValueError, match="is missing"):
        policy.import_weights(StreamedWeights(Arrivals(short)))
    unknown = {**exported, "extra.weight": np.zeros(1, dtype=np.float32)}
    with pytest.raises(ValueError, match=r"no parameter `extra\.weight`"):
        policy.import_weights(StreamedWeights(Arrivals(unknown)))


def test_arriving_float32_weights_on_the_cpu_become_the_parameters_without_a_copy(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    received = {name: np.full_like(value, 0.25) for name, value in policy.export_weights().items()}
    for value in received.values():
        value.flags.writeable = False
    policy.import_weights(StreamedWeights(Arrivals(received)))
    params = dict(policy.trainable)
    assert all(params[name].data_ptr() == value.ctypes.data for name, value in received.items())
    # Generation reads them as they are.
    ids = torch.tensor([[1, 2, 3]])
    assert torch.isfinite(policy.model(input_ids=ids).logits).all()
    # Weights at hand are copied: the caller may change its arrays afterwards.
    at_hand = {name: np.full_like(value, 0.5) for name, value in received.items()}
    policy.import_weights(at_hand)
    assert all(params[name].data_ptr() != value.ctypes.data for name, value in at_hand.items())
    assert all(torch.all(params[name] == 0.5) for name in at_hand)
