"""End to end: data transforms, callbacks and draft-model speculation, through the `rollout`
binary (plugins from tests/fixtures/binary_plugins.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_sdk.startup import GPU_DRIVER_NODES
from tests.e2e.harness import FIXTURES, metrics, read_jsonl, rollout, run, write_config

FIXTURE_PATHS = {"python.paths": [FIXTURES]}


# ---------------------------------------------------------------------------------------------
# [[data.transforms]]

RECORDS = [
    {"question": "1+2=", "answer": "3"},
    {"question": "9+1=", "answer": "10"},
    {"question": "4+4=", "answer": "8"},
    {"question": "2+9=", "answer": "11"},
]
# The built-in Template wraps the question, then the fixture drops prompts with a 9 and tags the
# rest: the tag only survives if the fixture ran second (Template rewrites the whole prompt).
TRANSFORMS = {
    "data.transforms": [
        {"plugin": "python_plugins.data:Template", "options": {"template": "({question})"}},
        {"plugin": "binary_plugins:DropAndTag", "options": {"drop": "9", "tag": "sum "}},
    ]
}
KEPT = ["sum (1+2=)", "sum (4+4=)"]


def test_data_transforms_run_in_order_and_drop_records(tmp_path: Path, artifacts: Path) -> None:
    data = tmp_path / "records.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    config = write_config(
        tmp_path, artifacts, FIXTURE_PATHS, TRANSFORMS, {"data.options.path": data}, steps=2
    )
    assert str(data) in config.read_text()

    checked = rollout("check", config, cwd=config.parent)
    match = re.search(r"data\s+(\d+) records, .*first prompt (\".*\")$", checked.stdout, re.MULTILINE)
    assert match, checked.stdout
    assert int(match.group(1)) == len(KEPT)
    assert json.loads(match.group(2)) == KEPT[0]

    # Two prompts a step from two records: each step draws every kept record.
    run(config, "--set", "run.log_samples=8")
    samples = read_jsonl(tmp_path / "out" / "samples.jsonl")
    assert len(samples) == 2 * 8
    assert sorted({sample["prompt"] for sample in samples}) == KEPT
    assert not [s["prompt"] for s in samples if "9" in s["prompt"]], "a dropped record was sampled"
    # The transformed prompt is what the policy read, not only what was logged.
    tokenizer = AutoTokenizer.from_pretrained(artifacts / "model")
    for sample in samples:
        prompt_ids = [
            t for t, generated in zip(sample["tokens"], sample["generated"], strict=True) if not generated
        ]
        assert tokenizer.decode(prompt_ids) == sample["prompt"]


# ---------------------------------------------------------------------------------------------
# [[callbacks]]


def callbacks(failing: Path, recording: Path) -> dict:
    # The failing callback comes first: the one after it must still see every hook.
    return {
        "callbacks": [
            {"plugin": "binary_plugins:FailingHooks", "options": {"path": failing}},
            {"plugin": "binary_plugins:RecordHooks", "options": {"path": recording}},
        ]
    }


def test_callbacks_see_every_hook_and_a_raising_one_is_switched_off(tmp_path: Path, artifacts: Path) -> None:
    failing, recording = tmp_path / "failing.jsonl", tmp_path / "recording.jsonl"
    out = tmp_path / "out"
    config = write_config(tmp_path, artifacts, FIXTURE_PATHS, callbacks(failing, recording), steps=3)
    result = run(config)
    assert "done: 3 steps" in result.stdout
    lines = metrics(tmp_path)
    assert [line["step"] for line in lines] == [1, 2, 3]

    events = read_jsonl(recording)
    order = [(e["event"], e.get("step")) for e in events]
    assert order[0] == ("run_start", None) and order[-1] == ("run_end", None)
    assert [step for event, step in order if event == "step_end"] == [1, 2, 3]
    # SFT ends with a checkpoint (step 0); `[checkpoint] every = 2`, and the run's end. They are
    # written in the background: each is reported once committed, after its step ended.
    assert [step for event, step in order if event == "checkpoint"] == [0, 2, 3]
    for step in (2, 3):
        assert order.index(("step_end", step)) < order.index(("checkpoint", step))
    start = events[0]
    assert start["total_steps"] == 3 and start["config_steps"] == 3
    assert start["start_step"] == 0
    assert start["name"] == "e2e" and Path(start["output_dir"]) == out

    step_ends = [e for e in events if e["event"] == "step_end"]
    assert [e["metrics"]["reward_mean"] for e in step_ends] == [line["reward_mean"] for line in lines]
    assert [e["metrics"] for e in step_ends] == lines, "on_step_end gets the metrics.jsonl line"

    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    for event in checkpoints:
        name = f"step-{event['step']:08d}"
        assert Path(event["path"]) == out / "checkpoints" / name
        # Complete when the hook runs: state, manifest, and `latest` naming it.
        assert event["is_dir"] and event["has_manifest"], event
        assert event["state_step"] == event["step"]
        assert event["latest"] == name
    last = Path(checkpoints[-1]["path"])
    assert last.is_dir() and json.loads((last / "state.json").read_text())["step"] == 3

    end = events[-1]["summary"]
    assert end["steps_completed"] == 3 and end["interrupted"] is False
    assert Path(end["checkpoint"]) == last
    assert json.loads((out / "summary.json").read_text())["checkpoint"] == end["checkpoint"]

    # The raising callback got its first on_step_end and nothing after: it was switched off.
    failing_events = [(e["event"], e.get("step")) for e in read_jsonl(failing)]
    assert failing_events[0] == ("run_start", None) and failing_events[-1] == ("step_end", 1)
    assert set(failing_events[1:-1]) <= {("checkpoint", 0)}
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, result.stderr
    assert "plugin `binary_plugins:FailingHooks`" in errors[0]
    assert "failed in `on_step_end`" in errors[0]
    assert "deliberate callback failure at step 1" in errors[0]
    assert "Traceback" in result.stderr
    assert "this callback is switched off for the rest of the run" in result.stderr


# ---------------------------------------------------------------------------------------------
# [engine.speculation] method = "draft_model"

DRAFT_MODEL = {"engine.speculation.method": "draft_model"}
GREEDY = (
    "--set",
    "rollout.temperature=0",
    "--set",
    "rollout.max_new_tokens=12",
    "--set",
    "rollout.ignore_eos=true",
    "--limit",
    "8",
)


@pytest.fixture(scope="module")
def draft_model(artifacts: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's first layer alone (same embeddings, head and tokenizer): a smaller model
    whose greedy tokens agree with the target's only sometimes, so drafts are both accepted
    and rejected."""
    directory = tmp_path_factory.mktemp("draft")
    model = AutoModelForCausalLM.from_pretrained(artifacts / "model")
    assert model.config.num_hidden_layers == 2
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(artifacts / "model").save_pretrained(directory)
    return directory


def generate(config: Path, output: Path, *args: str) -> tuple[list[dict], dict]:
    result = rollout("generate", config, *GREEDY, "--output", output, *args, cwd=config.parent)
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    return read_jsonl(output), stats


def test_draft_model_speculation_trains_and_keeps_greedy_tokens(
    tmp_path: Path, artifacts: Path, draft_model: Path
) -> None:
    draft_option = f"policy.options.draft_model_path={draft_model}"
    config = write_config(tmp_path, artifacts, DRAFT_MODEL, steps=3)
    run(config, "--set", draft_option)
    lines = metrics(tmp_path)
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        drafted, accepted = line["engine/drafted_tokens"], line["engine/accepted_tokens"]
        assert drafted > 0
        assert 0 <= accepted <= drafted
        assert line["engine/acceptance_rate"] == pytest.approx(accepted / drafted)

    speculative, with_drafts = generate(config, tmp_path / "speculative.jsonl", "--set", draft_option)
    plain, without = generate(config, tmp_path / "plain.jsonl", "--set", 'engine.speculation.method="off"')
    assert "engine/drafted_tokens" not in without
    # Both paths of the verifier ran: some drafts were accepted, some rejected.
    assert 0 < with_drafts["engine/accepted_tokens"] < with_drafts["engine/drafted_tokens"]
    # Accepted drafts save decode steps.
    assert with_drafts["engine/steps"] < without["engine/steps"]
    assert len(speculative) == len(plain) == 8 * 4
    assert [c["token_ids"] for c in speculative] == [c["token_ids"] for c in plain]
    assert all(len(c["token_ids"]) == 12 for c in plain)
    for fast, slow in zip(speculative, plain, strict=True):
        assert torch.allclose(torch.tensor(fast["logprobs"]), torch.tensor(slow["logprobs"]), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The process's runtime: its allocator, and Triton on a host without a GPU


def test_plugins_in_the_binary_allocate_through_its_jemalloc_and_without_triton(
    tmp_path: Path, artifacts: Path
) -> None:
    probe = tmp_path / "runtime.jsonl"
    plugins = {"callbacks": [{"plugin": "binary_plugins:RecordRuntime", "options": {"path": probe}}]}
    config = write_config(tmp_path, artifacts, FIXTURE_PATHS, plugins, steps=1)
    rollout("check", config, cwd=config.parent)
    [seen] = read_jsonl(probe)
    # `malloc` as CPython, torch and ctypes resolve it is the binary's own, not libc's.
    assert seen["process_malloc"] != seen["libc_malloc"]
    # jemalloc rounds 1 MiB to its size class exactly; glibc would add its chunk header.
    assert seen["usable_size_of_1_mib"] == 1 << 20
    # The binary's jemalloc options apply: a large freed block stays for reuse, not purged at
    # once (jemalloc's default for blocks of 8 MiB and more, and glibc's above its threshold).
    assert seen["kept_of_freed_32_mib"] >= 16 << 20
    gpu_host = any(Path(node).exists() for node in GPU_DRIVER_NODES)
    assert seen["triton_loaded"] is gpu_host, "Triton loaded without a GPU driver, or held back with one"
