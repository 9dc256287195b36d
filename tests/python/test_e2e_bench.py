"""The arithmetic and bookkeeping of ``bench/e2e_vs_trl`` (the benchmark itself is not a test)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from bench.e2e import flops, report, runs

CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 50,
}


def test_matmul_shapes_cover_every_weight_matrix_of_a_llama() -> None:
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, tie_word_embeddings=False))
    matrices = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name)
    assert sum(n_in * n_out for n_in, n_out in flops.matmul_shapes(CONFIG)) == matrices


def test_step_flops_count_generation_training_and_the_reference() -> None:
    record = {"completions": 4, "sequence_tokens": 40}
    per_token = flops.forward_flops_per_token(CONFIG, context=5)
    assert per_token > 2 * sum(a * b for a, b in flops.matmul_shapes(CONFIG))
    assert flops.step_model_flops(CONFIG, record, kl=False) == pytest.approx(4 * per_token * 40)
    assert flops.step_model_flops(CONFIG, record, kl=True) == pytest.approx(5 * per_token * 40)


def test_steps_are_timed_between_consecutive_step_ends(tmp_path: Path) -> None:
    rollout = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "elapsed_seconds": 1.0, "generate_seconds": 0.4, "score_seconds": 0.1,
         "train_seconds": 0.3, "reference_seconds": 0.1, "step_seconds": 0.8, "completions": 8,
         "generated_tokens": 20, "sequence_tokens": 60, "reward_mean": 0.5},
        {"step": 2, "elapsed_seconds": 3.0, "generate_seconds": 1.0, "score_seconds": 0.1,
         "train_seconds": 0.5, "reference_seconds": 0.2, "step_seconds": 1.7, "completions": 8,
         "generated_tokens": 30, "sequence_tokens": 70, "reward_mean": 0.25},
    ]  # fmt: skip
    rollout.write_text("".join(json.dumps(line) + "\n" for line in lines))
    first, second = runs.read_steps("rollout", rollout)
    assert first["step_seconds"] == pytest.approx(1.0)
    assert second["step_seconds"] == pytest.approx(2.0)
    assert second["logprob_seconds"] == pytest.approx(0.2)
    assert second["train_seconds"] == pytest.approx(0.3)
    assert second["other_seconds"] == pytest.approx(2.0 - 1.0 - 0.1 - 0.2 - 0.3)

    trl = tmp_path / "trl.jsonl"
    record = {
        "step": 1, "elapsed_seconds": 0.5, "generate_seconds": 0.2, "reward_seconds": 0.01,
        "logprob_seconds": 0.0, "train_seconds": 0.2, "sync_seconds": 0.0, "completions": 8,
        "generated_tokens": 16, "prompt_tokens": 40, "step_seconds": 0.45, "reward_mean": 0.1,
    }  # fmt: skip
    trl.write_text(json.dumps(record) + "\n" + json.dumps({"summary": True}) + "\n")
    (only,) = runs.read_steps("trl", trl)
    assert only["sequence_tokens"] == 56
    assert only["other_seconds"] == pytest.approx(0.5 - 0.41)


def test_summary_takes_medians_after_the_warm_up() -> None:
    steps = [
        {"completions": 8, "generated_tokens": 16, "sequence_tokens": 64, "step_seconds": seconds,
         "reward_mean": 0.5, **{f"{name}_seconds": seconds / 6 for name in runs.PHASES}}
        for seconds in (10.0, 1.0, 2.0, 4.0)
    ]  # fmt: skip
    summary = runs.summarise(steps, warmup=1, model_config=CONFIG, kl=False, gemm_gflops=1.0)
    assert summary["measured_steps"] == 3
    assert summary["step_seconds"] == 2.0
    assert summary["completions_per_second"] == 4.0
    assert summary["generated_tokens_per_second"] == 8.0
    step_flops = flops.step_model_flops(CONFIG, steps[0], kl=False)
    assert summary["compute_bound_fraction"] == pytest.approx(step_flops / 1e9 / 2.0)
    # Training is 3 of the 4 forward-pass equivalents without KL, over a sixth of the step.
    assert summary["train_compute_bound_fraction"] == pytest.approx(step_flops * 0.75 / 1e9 / (2.0 / 6))


def test_ratios_and_headline_use_rollout_over_trl() -> None:
    def run(cps: float, rss: int) -> dict:
        return {
            "completions_per_second": cps,
            "generated_tokens_per_second": 2 * cps,
            "peak_rss_bytes": rss,
            "step_seconds": 64 / cps,
            "compute_bound_fraction": cps / 1000,
            "train_compute_bound_fraction": cps / 500,
            "phase_seconds": dict.fromkeys(runs.PHASES, 1.0),
        }

    pairs = []
    for rollout_cps, trl_cps in ((300.0, 100.0), (200.0, 100.0), (500.0, 100.0)):
        pair = {"rollout": run(rollout_cps, 600), "trl": run(trl_cps, 1000)}
        pair["ratios"] = report.pair_ratios(pair["rollout"], pair["trl"])
        pairs.append(pair)
    assert pairs[0]["ratios"]["throughput_ratio"] == 3.0
    assert pairs[0]["ratios"]["memory_ratio"] == 0.6
    headline = report.headline(pairs)
    assert headline["throughput_ratio"] == 3.0
    assert headline["throughput_ratio_per_repeat"] == [3.0, 2.0, 5.0]
    assert headline["completions_per_second"] == {"rollout": 300.0, "trl": 100.0}


def test_generated_configs_are_valid_toml(tmp_path: Path) -> None:
    spec = runs.RunSpec("rollout", "tiny", tmp_path / "model", 0.04, "bf16", 15, "label")
    command, metrics = runs.rollout_command(
        spec, Path("rollout"), tmp_path, tmp_path / "data.jsonl", runs.Workload()
    )
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((tmp_path / "configs" / "label.toml").read_text())
    assert command[-2:] == [str(tmp_path / "configs" / "label.toml"), "--overwrite"]
    assert metrics == tmp_path / "runs" / "label" / "metrics.jsonl"
    assert config["rollout"]["prompts_per_step"] * config["rollout"]["group_size"] == 64
    assert config["rollout"]["max_new_tokens"] == 32
    assert config["algorithm"]["kl_coef"] == 0.04
    assert config["policy"]["options"]["dtype"] == "bfloat16"
    assert config["rewards"] == [{"plugin": "python_plugins.rewards:ExactMatch"}]


def test_an_overlapped_rollout_run_samples_one_step_ahead_on_half_the_threads(tmp_path: Path) -> None:
    spec = runs.RunSpec("rollout", "tiny", tmp_path / "model", 0.0, "fp32", 15, "label", overlap=True)
    runs.rollout_command(spec, Path("rollout"), tmp_path, tmp_path / "data.jsonl", runs.Workload())
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((tmp_path / "configs" / "label.toml").read_text())
    assert config["cluster"] == {"max_staleness": 1}
    assert config["policy"]["options"]["torch_threads"] == runs.Workload().threads // 2
    synchronous = dataclasses.replace(spec, overlap=False, label="sync")
    runs.rollout_command(synchronous, Path("rollout"), tmp_path, tmp_path / "data.jsonl", runs.Workload())
    config = tomllib.loads((tmp_path / "configs" / "sync.toml").read_text())
    assert "cluster" not in config
    assert config["policy"]["options"]["torch_threads"] == runs.Workload().threads


def test_docs_section_is_replaced_between_the_markers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"intro\n{report.BEGIN}\nold\n{report.END}\noutro\n")
    monkeypatch.setattr(report, "DOCS", doc)
    report.write_docs("new table")
    assert doc.read_text() == f"intro\n{report.BEGIN}\nnew table\n{report.END}\noutro\n"


def test_learning_verdict_compares_the_second_halves() -> None:
    flat = [0.2, 0.4] * 10
    better = [0.0] * 10 + [0.5, 0.7] * 5
    assert report.learning_verdict(better, flat)["not_worse"]
    assert report.learning_verdict(flat, flat)["difference"] == 0.0
    much_worse = [0.0] * 10 + [0.0, 0.1] * 5
    verdict = report.learning_verdict(much_worse, flat)
    assert verdict["difference"] == pytest.approx(0.05 - 0.3)
    assert not verdict["not_worse"]


def host_results(cpu: str, date: str, tiny_ratio: float, **extra: object) -> dict[str, object]:
    figures = {key: 0.5 for key in report.HOST_FIGURES}
    return {
        "date": date,
        "command": "bench/e2e_vs_trl",
        "machine": {"cpu": cpu, "cores": 2},
        "tiny": {**figures, "throughput_ratio": tiny_ratio, "completions_per_second": {}},
        "learning": {"verdicts": {"tiny": {"not_worse": True}}},
        **extra,
    }


def test_a_run_on_one_host_keeps_the_latest_figures_of_the_others() -> None:
    amd = host_results("AMD EPYC", "2026-12-05", 3.1)
    # The first run on Intel carries AMD's figures over.
    hosts = report.other_hosts(amd, "Intel Xeon")
    assert list(hosts) == ["AMD EPYC"]
    assert hosts["AMD EPYC"]["tiny"]["throughput_ratio"] == 3.1
    assert hosts["AMD EPYC"]["date"] == "2026-12-05"
    assert hosts["AMD EPYC"]["learning_not_worse"] == {"tiny": True}
    assert "small" not in hosts["AMD EPYC"]
    # A second run on Intel keeps them; a run back on AMD replaces AMD's and keeps Intel's.
    intel = host_results("Intel Xeon", "2026-12-06", 2.3, other_hosts=hosts)
    assert report.other_hosts(intel, "Intel Xeon") == hosts
    back_on_amd = report.other_hosts(intel, "AMD EPYC")
    assert list(back_on_amd) == ["Intel Xeon"]
    assert back_on_amd["Intel Xeon"]["tiny"]["throughput_ratio"] == 2.3
    assert report.other_hosts(None, "AMD EPYC") == {}


def test_the_other_hosts_figures_are_named_in_the_docs() -> None:
    amd = host_results("AMD EPYC", "2026-12-05", 3.1)
    lines = report._other_host_lines({"other_hosts": report.other_hosts(amd, "Intel Xeon")})
    assert "AMD EPYC" in lines[0] and "tiny 3.10x" in lines[0] and "2026-12-05" in lines[0]
