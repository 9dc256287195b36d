"""The sampling engine's weight-first matmuls: same products, chosen by a fixed rule, engine only."""

from __future__ import annotations

import pytest
import torch
from policy_helpers import make_policy

from python_plugins import decode_matmuls
from python_plugins.decode_matmuls import (
    WEIGHT_FIRST_MAX_ROWS,
    engine_forward,
    install_engine_matmuls,
    weight_first_linear,
)


@pytest.mark.parametrize("shape", [(1, 512), (2, 512), (1, 7, 512), (3, 1, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_weight_first_is_the_linear_product(shape, bias):
    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(512, 96, bias=bias)
    x = torch.randn(*shape, generator=generator)
    got = weight_first_linear(x, layer.weight, layer.bias)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


class _Recorder:
    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, x, weight, bias):
        self.rows.append(x.numel() // x.shape[-1])
        return torch.nn.functional.linear(x, weight, bias)


def _model(*sizes: tuple[int, int]) -> torch.nn.Sequential:
    return torch.nn.Sequential(*(torch.nn.Linear(n_in, n_out, bias=False) for n_in, n_out in sizes))


@pytest.mark.parametrize("mode", ["auto", "weight_first_tail"])
def test_the_tail_rule_picks_large_host_matrices_and_few_rows_inside_the_engine_only(monkeypatch, mode):
    monkeypatch.setattr(decode_matmuls, "host_gains_from_weight_first", lambda: True)
    recorder = _Recorder()
    monkeypatch.setattr(decode_matmuls, "weight_first_linear", recorder)
    model = _model((512, 512), (512, 64), (64, 512))
    assert install_engine_matmuls(model, mode) == 1  # the 512x64 and 64x512 ones are small
    assert install_engine_matmuls(_model((512, 512)).to(torch.bfloat16), mode) == 0
    big = model[0]
    few, many = torch.randn(3, 512), torch.randn(WEIGHT_FIRST_MAX_ROWS + 1, 512)
    big(few)  # outside the engine: nn.Linear
    assert recorder.rows == []
    with engine_forward():
        big(few)
        big(many)
        model[1](few)
    assert recorder.rows == [3]


def test_auto_keeps_nn_linear_on_a_host_that_does_not_gain(monkeypatch):
    monkeypatch.setattr(decode_matmuls, "host_gains_from_weight_first", lambda: False)
    recorder = _Recorder()
    monkeypatch.setattr(decode_matmuls, "weight_first_linear", recorder)
    model, forced = _model((512, 512)), _model((512, 512))
    assert install_engine_matmuls(model, "auto") == 0
    assert install_engine_matmuls(forced, "weight_first_tail") == 1
    with engine_forward():
        model(torch.randn(2, 512))
        forced(torch.randn(2, 512))
    assert recorder.rows == [2]


@pytest.mark.parametrize(
    ("cpuinfo", "vendor"),
    [
        ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n", "AuthenticAMD"),
        ("vendor_id\t: GenuineIntel\n\nprocessor\t: 1\nvendor_id\t: AuthenticAMD\n", "GenuineIntel"),
        ("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n", None),
    ],
)
def test_cpu_vendor_is_the_first_processors(cpuinfo, vendor):
    assert decode_matmuls.cpu_vendor(cpuinfo) == vendor


def test_outside_the_engine_the_layer_is_nn_linear_bit_for_bit_with_its_gradients():
    torch.manual_seed(0)
    model = _model((512, 512))
    reference = _model((512, 512))
    reference.load_state_dict(model.state_dict())
    install_engine_matmuls(model, "weight_first")
    x = torch.randn(4, 512)
    out, expected = model(x), reference(x)
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert torch.equal(model[0].weight.grad, reference[0].weight.grad)


def test_forced_modes(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(decode_matmuls, "weight_first_linear", recorder)
    forced, plain = _model((8, 8)), _model((512, 512))
    assert install_engine_matmuls(forced, "weight_first") == 1
    assert install_engine_matmuls(plain, "linear") == 0
    with engine_forward():
        forced(torch.randn(2 * WEIGHT_FIRST_MAX_ROWS, 8))
        plain(torch.randn(2, 512))
    assert recorder.rows == [2 * WEIGHT_FIRST_MAX_ROWS]
    with pytest.raises(ValueError, match="engine_matmuls"):
        install_engine_matmuls(plain, "fastest")  # type: ignore[arg-type]


def test_the_policy_option_reaches_the_engine(tiny_model_dir):
    policy = make_policy(tiny_model_dir, engine_matmuls="weight_first")
    runner = policy.engine_runner
    linears = [m for m in runner.target.model.modules() if type(m) is torch.nn.Linear]
    assert linears and all("forward" in vars(m) for m in linears)
    with pytest.raises(ValueError, match="engine_matmuls"):
        make_policy(tiny_model_dir, engine_matmuls="fastest")
