"""A small pure-Python stand-in for the Rust sampling engine, to drive ``Policy.engine_step``.

It does what the scheduler does, simply: block tables over a shuffled free list, prompts
prefilled in chunks under a token budget, groups that prefill their prompt once and fork
(children share the prompt's full blocks and copy the partly filled last one), drafts from
a function of the tokens or from the policy's draft model, and per-sample uniforms that depend
only on the seed, the sample and the position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from rollout_sdk import EngineStep, Policy

Drafter = Callable[[list[int]], list[int]]


@dataclass(frozen=True)
class DriverOptions:
    max_new_tokens: int = 12
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    #: Prefill each group's prompt once and fork its completions from it.
    share_prompts: bool = False
    #: Query tokens per step at most (decodes first); None schedules whole prompts.
    token_budget: int | None = None
    #: Drafts per decode: from `drafter`, or from the policy's draft model when it is None.
    max_drafts: int = 0
    drafter: Drafter | None = None
    block_size: int = 4
    num_blocks: int = 256


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class DriverStats:
    drafted: int = 0
    accepted: int = 0
    copies: int = 0
    mixed_steps: int = 0  # steps with both prefill chunks and decodes


@dataclass
class _Sequence:
    tokens: list[int]
    blocks: list[int]
    #: Completions sampled from this sequence: one, or the whole group before the fork.
    samples: list[int]
    computed: int = 0
    #: Leading blocks shared with the rest of the group (never freed: the test cache is big
    #: enough that this is simpler than reference counting).
    shared_blocks: int = 0
    pending_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.tokens) - 1


class EngineDriver:
    def __init__(self, policy: Policy, options: DriverOptions) -> None:
        self.policy = policy
        self.options = options
        self.eos = set(policy.eos_token_ids())
        policy.allocate_kv(options.num_blocks * options.block_size)
        self.free_blocks = list(np.random.default_rng(options.seed).permutation(options.num_blocks))
        self.stats = DriverStats()

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int = 1, first_sample: int = 0
    ) -> list[list[Completion]]:
        """``n`` completions per prompt, ``completions[prompt][i]``.

        Samples are numbered from ``first_sample`` on; a sample's uniforms depend on its number.
        """
        self.first_sample = first_sample
        self.completions = [Completion() for _ in range(len(prompts) * n)]
        self.finished = [False] * len(self.completions)
        sequences: list[_Sequence] = []
        for index, prompt in enumerate(prompts):
            samples = list(range(index * n, (index + 1) * n))
            groups = [samples] if self.options.share_prompts else [[sample] for sample in samples]
            for group in groups:
                sequences.append(_Sequence(tokens=list(prompt), blocks=[], samples=group))
        while sequences:
            sequences = self._step(sequences)
        return [self.completions[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _slot(self, sequence: _Sequence, position: int) -> int:
        size = self.options.block_size
        return sequence.blocks[position // size] * size + position % size

    def _step(self, sequences: list[_Sequence]) -> list[_Sequence]:
        scheduled = self._schedule(sequences)
        step, rows, copies = self._engine_step(scheduled)
        output = self.policy.engine_step(step)
        self.stats.copies += len(copies)
        for sequence, fed, _ in scheduled:
            sequence.computed += fed
        emitted: dict[int, list[int]] = {}
        for row, (index, sample, drafts) in enumerate(rows):
            count = int(output.counts[row])
            self.stats.drafted += drafts
            self.stats.accepted += count - 1
            tokens = [int(t) for t in output.tokens[row, :count]]
            emitted[sample] = self._record(sample, tokens, [float(x) for x in output.logprobs[row, :count]])
            sequence = scheduled[index][0]
            if len(sequence.samples) == 1:
                sequence.computed += count - 1  # accepted drafts are in the cache
        return self._survivors(sequences, emitted)

    def _schedule(self, sequences: list[_Sequence]) -> list[tuple[_Sequence, int, list[int]]]:
        """This step's sequences, each with the tokens it feeds and its drafts: every decode,
        then prefills while the token budget lasts."""
        budget = self.options.token_budget if self.options.token_budget is not None else 1 << 30
        decodes = [s for s in sequences if not s.prefilling]
        prefills = [s for s in sequences if s.prefilling]
        scheduled: list[tuple[_Sequence, int, list[int]]] = []
        for sequence in decodes:
            drafts = self._drafts(sequence)
            scheduled.append((sequence, 1, drafts))
            budget -= 1 + len(drafts)
        for sequence in prefills:
            if budget <= 0:
                break
            count = min(len(sequence.tokens) - sequence.computed, budget)
            scheduled.append((sequence, count, []))
            budget -= count
        self.stats.mixed_steps += bool(decodes) and any(s.prefilling for s, _, _ in scheduled)
        return scheduled

    def _engine_step(
        self, scheduled: list[tuple[_Sequence, int, list[int]]]
    ) -> tuple[EngineStep, list[tuple[int, int, int]], list[tuple[int, int]]]:
        """The step's arrays, its sampled rows (sequence index, sample, drafts) and the KV
        copies it carries."""
        options = self.options
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        contexts: list[list[int]] = []
        rows: list[tuple[int, int, int]] = []
        copies: list[tuple[int, int]] = []
        for index, (sequence, fed, drafts) in enumerate(scheduled):
            end = sequence.computed + fed + len(drafts)
            self._reserve(sequence, end)
            copies += sequence.pending_copies
            sequence.pending_copies = []
            ids += sequence.tokens[sequence.computed : sequence.computed + fed] + drafts
            positions += range(sequence.computed, end)
            slots += [self._slot(sequence, p) for p in range(sequence.computed, end)]
            query_start.append(len(ids))
            contexts.append([self._slot(sequence, p) for p in range(end)])
            if sequence.computed + fed == len(sequence.tokens):
                rows += [(index, sample, len(drafts)) for sample in sequence.samples]
        width = max(len(c) for c in contexts)
        max_drafts = max((drafts for _, _, drafts in rows), default=0)
        step = EngineStep(
            input_ids=np.asarray(ids, dtype=np.int64),
            positions=np.asarray(positions, dtype=np.int64),
            slot_mapping=np.asarray(slots, dtype=np.int64),
            query_start=np.asarray(query_start, dtype=np.int64),
            context_slots=np.asarray([c + [0] * (width - len(c)) for c in contexts], dtype=np.int64),
            context_lens=np.asarray([len(c) for c in contexts], dtype=np.int64),
            sample_seq=np.asarray([r[0] for r in rows], dtype=np.int64),
            draft_lens=np.asarray([r[2] for r in rows], dtype=np.int64),
            temperature=np.full(len(rows), options.temperature, dtype=np.float32),
            top_p=np.full(len(rows), options.top_p, dtype=np.float32),
            top_k=np.full(len(rows), options.top_k, dtype=np.int64),
            uniforms=np.asarray(
                [
                    self.uniforms(sample, len(self.completions[sample].tokens), max_drafts + 1)
                    for _, sample, _ in rows
                ]
            ).reshape(len(rows), max_drafts + 1, 3),
            copy_from=np.asarray([source for source, _ in copies], dtype=np.int64),
            copy_to=np.asarray([target for _, target in copies], dtype=np.int64),
            draft_with_model=options.drafter is None and max_drafts > 0,
        )
        return step, rows, copies

    def _survivors(self, sequences: list[_Sequence], emitted: dict[int, list[int]]) -> list[_Sequence]:
        """The sequences that go on after this step (a sampled group forks into its samples);
        a finished one's own blocks go back to the free list."""
        survivors: list[_Sequence] = []
        for sequence in sequences:
            if sequence.samples[0] not in emitted:  # not sampled in this step
                survivors.append(sequence)
                continue
            if len(sequence.samples) > 1:
                survivors += self._fork(sequence, emitted)
            elif not self.finished[sequence.samples[0]]:
                sequence.tokens += emitted[sequence.samples[0]]
                survivors.append(sequence)
            else:
                self.free_blocks += sequence.blocks[sequence.shared_blocks :]
        return survivors

    def uniforms(self, sample: int, position: int, count: int) -> np.ndarray:
        """``[count, 3]`` uniforms of ``sample`` from completion position ``position`` on."""
        return np.stack(
            [
                np.random.default_rng([self.options.seed, self.first_sample + sample, p]).random(3)
                for p in range(position, position + count)
            ]
        )

    def _drafts(self, sequence: _Sequence) -> list[int]:
        options = self.options
        if len(sequence.samples) > 1:
            return []  # a group's shared prompt: its rows each sample their own first token
        completion = self.completions[sequence.samples[0]]
        room = options.max_new_tokens - len(completion.tokens) - 1
        limit = min(options.max_drafts, room)
        if limit <= 0:
            return []
        if options.drafter is None:
            return [-1] * limit  # placeholders: the draft model proposes them
        return options.drafter(sequence.tokens)[:limit]

    def _record(self, sample: int, tokens: list[int], logprobs: list[float]) -> list[int]:
        completion = self.completions[sample]
        for token, logprob in zip(tokens, logprobs, strict=True):
            completion.tokens.append(token)
            completion.logprobs.append(logprob)
            if token in self.eos or len(completion.tokens) == self.options.max_new_tokens:
                self.finished[sample] = True
                break
        return tokens[: len(completion.tokens)] if self.finished[sample] else tokens

    def _fork(self, parent: _Sequence, emitted: dict[int, list[int]]) -> list[_Sequence]:
        """One sequence per unfinished sample, sharing the prompt's full blocks."""
        size = self.options.block_size
        full, partial = divmod(parent.computed, size)
        children = []
        for sample in parent.samples:
            if self.finished[sample]:
                continue
            child = _Sequence(
                tokens=parent.tokens + emitted[sample],
                blocks=parent.blocks[:full],
                samples=[sample],
                computed=parent.computed,
                shared_blocks=full,
            )
            if partial:
                child.blocks.append(self.free_blocks.pop())
                child.pending_copies = [
                    (parent.blocks[full] * size + i, child.blocks[full] * size + i) for i in range(partial)
                ]
            children.append(child)
        return children

    def _reserve(self, sequence: _Sequence, length: int) -> None:
        while len(sequence.blocks) * self.options.block_size < length:
            sequence.blocks.append(self.free_blocks.pop())


def prompt_lookup(ngram: int = 2, count: int = 4) -> Drafter:
    """Drafts that continue the latest earlier occurrence of the last ``ngram`` tokens."""

    def drafter(tokens: list[int]) -> list[int]:
        tail = tokens[-ngram:]
        for start in range(len(tokens) - ngram - 1, -1, -1):
            if tokens[start : start + ngram] == tail:
                return tokens[start + ngram : start + ngram + count]
        return []

    return drafter
