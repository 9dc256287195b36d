"""The training/inference mismatch metrics and the rollout correction through the binary.

Rollout's own engine and the trainer compute the same quantity in float32 (temperature-scaled
logprobs before top-p/top-k truncation), so samples of the weights being trained measure next
to no mismatch; with staleness allowed, older samples are measured apart (`stale/...`).
"""

from __future__ import annotations

from pathlib import Path

from tests.e2e.harness import FIXTURES, cluster, launch, metrics, train, write_config

FAMILY_KEYS = ("tokens", "kl_k3", "ratio_mean", "ratio_min", "ratio_max", "ratio_outside_fraction")
KEYS = [f"{family}/{key}" for family in ("mismatch", "stale") for key in FAMILY_KEYS]
# No warm start; a small KL term, so rows of zero advantage are trained (and measured) too.
SHORT = {
    "sft": None,
    "python.paths": [FIXTURES],
    "rewards": [{"plugin": "algorithm_plugins:CharacterShare"}],
    "algorithm": {"kl_coef": 0.001},
    "rollout": {"prompts_per_step": 4, "group_size": 8, "max_new_tokens": 6},
    "train": {"learning_rate": 0.01, "micro_batch_tokens": 256},
}


def assert_on_version_samples_match(lines: list[dict]) -> None:
    for line in lines:
        assert all(key in line for key in KEYS), sorted(line)
        if line["mismatch/tokens"] > 0:
            assert line["mismatch/kl_k3"] < 1e-4, line
            assert 0.97 < line["mismatch/ratio_min"] <= line["mismatch/ratio_max"] < 1.03, line
            assert line["mismatch/ratio_outside_fraction"] == 0.0, line


def test_every_step_measures_the_mismatch_and_tis_trains_two_epochs(tmp_path: Path, artifacts: Path) -> None:
    correction = {"algorithm": {"rollout_correction": "tis", "epochs": 2}}
    lines = train(write_config(tmp_path, artifacts, SHORT, correction, steps=3))
    assert len(lines) == 3
    assert_on_version_samples_match(lines)
    # Every generated token is measured, once.
    assert all(line["mismatch/tokens"] == line["generated_tokens"] for line in lines)
    assert all(line["stale/tokens"] == 0 for line in lines)
    # On version and in float32 the weights are ~1: none reaches the cap of 2.
    assert all(0.97 < line["correction/weight_mean"] < 1.03 for line in lines)
    assert all(line["correction/truncated_fraction"] == 0.0 for line in lines)


def test_stale_samples_are_measured_apart(tmp_path: Path, artifacts: Path) -> None:
    lines = train(write_config(tmp_path, artifacts, SHORT, cluster(1, 1, 1), steps=4))
    assert_on_version_samples_match(lines)
    stale = [line for line in lines if line["stale/tokens"] > 0]
    assert stale, [line["staleness_max"] for line in lines]
    assert all(line["staleness_max"] >= 1 for line in stale)
    # One weight version behind, the stale samples do differ from the trainer.
    assert all(line["stale/kl_k3"] > 0.0 for line in stale)
    assert all(line["mismatch/tokens"] + line["stale/tokens"] == line["generated_tokens"] for line in lines)


def test_two_trainer_ranks_add_up_their_mismatch(tmp_path: Path, artifacts: Path) -> None:
    config = write_config(tmp_path, artifacts, SHORT, cluster(1, 2, 0), steps=2)
    launch(config)
    lines = metrics(tmp_path)
    assert len(lines) == 2
    assert_on_version_samples_match(lines)
    # Every generated token is counted once, over both ranks.
    assert all(line["mismatch/tokens"] == line["generated_tokens"] for line in lines)
