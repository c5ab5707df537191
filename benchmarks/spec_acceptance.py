"""Bench-only: speculative decoding's mechanics at a set acceptance rate, whatever the numerics.

The problem. With dummy weights no proposer guesses anything, so measuring the machinery needs
drafts whose acceptance the bench sets. Drafting the target's own greedy continuation with some
tokens corrupted does not set it: a verify step computes its k + 1 tokens with the prefill
kernels, a decode step with the decode kernels, and on random weights (many near-ties) the two
break ties differently, so the continuation stops being the verify step's own and far fewer
drafts are accepted than set.

The idea: decide acceptance outside the model. `ForcedAcceptanceScheduler`, the speculative
scheduler (nanograph/spec/scheduler.py) with one step added to `update`, rewrites a verify
step's check rows before the speculative rule compares them with the drafts. Per sequence, draft
by draft, a seeded Bernoulli trial at the set rate:
- a success: the row's sampled token becomes the draft, as if the target had sampled it;
- the first failure: the row keeps the target's token (another one, should it equal the draft),
  and the speculative rule rejects that draft and cuts the ones after it, as in any run.
So the engine does exactly the work of a real run at that acceptance (the same verify steps,
rollbacks, switch-off decisions, tokens per step, counters), and the drafts' values do not
matter: `RandomDrafts` drafts k random tokens for every row. The emitted tokens are then not the
model's (accepted drafts are random tokens): only the timings and the counters mean anything.

At per-draft acceptance a, a verify of k drafts accepts j < k of them with probability
a^j (1 - a) and all k with probability a^k: a + a^2 + ... + a^k on average.
`implied_acceptance` inverts that for the spec_decode counters, so it reads as the set rate.
"""
import random

from nanograph.spec.scheduler import SpeculativeScheduler, VerifyBatch


class ForcedAcceptanceScheduler(SpeculativeScheduler):
    """Set by `force_acceptance` on an engine's speculative scheduler."""
    acceptance: float
    vocab_size: int
    trials: random.Random

    def update(self, batch, sampled: list[int], *logprobs):
        if isinstance(batch, VerifyBatch):
            sampled = self.force(batch, list(sampled))
        return super().update(batch, sampled, *logprobs)

    def force(self, batch: VerifyBatch, sampled: list[int]) -> list[int]:
        """`sampled` with each check row's token decided by a trial (see above). The check rows
        are the batch's first rows, each sequence's in the order of its drafts."""
        rejected = set()
        for row, (seq, _, index) in enumerate(batch.rows[:batch.num_draft_tokens]):
            if seq in rejected or index >= len(seq.token_ids):
                continue
            draft = seq.token_ids[index]
            if self.trials.random() < self.acceptance:
                sampled[row] = draft
            else:
                rejected.add(seq)
                if sampled[row] == draft:
                    sampled[row] = (draft + 1) % self.vocab_size
        return sampled


class RandomDrafts:
    """A proposer (prompt lookup's interface, nanograph/spec/ngram.py): k random tokens after
    any tokens."""

    def __init__(self, vocab_size: int, seed: int):
        self.vocab_size = vocab_size
        self.random = random.Random(seed)

    def __call__(self, tokens: list[int], num_speculative_tokens: int) -> list[int]:
        return [self.random.randrange(self.vocab_size) for _ in range(num_speculative_tokens)]


def force_acceptance(llm, acceptance: float, seed: int = 0) -> None:
    """From now on `llm` (an LLM with speculative_config) drafts random tokens and accepts each
    with probability `acceptance` (fresh trials from `seed`)."""
    if not isinstance(llm.scheduler, SpeculativeScheduler):
        raise ValueError("force_acceptance needs an LLM built with speculative_config")
    vocab_size = llm.config.hf_config.vocab_size
    llm.scheduler.__class__ = ForcedAcceptanceScheduler
    llm.scheduler.acceptance, llm.scheduler.vocab_size = acceptance, vocab_size
    llm.scheduler.trials = random.Random(seed)
    llm.spec.drafter.proposer = RandomDrafts(vocab_size, seed)


def implied_acceptance(num_accepted: int, num_draft_tokens: int, num_drafts: int):
    """The per-draft acceptance a at which `num_drafts` verifies of `num_draft_tokens` drafts
    accept `num_accepted` (vLLM's spec_decode counters); None without verifies. A verify of k
    drafts accepts a + ... + a^k = a (1 - a^k) / (1 - a) on average; k is the counters' mean,
    as drafts near a sequence's length limit are fewer."""
    if not num_drafts:
        return None
    mean_accepted, mean_drafts = num_accepted / num_drafts, num_draft_tokens / num_drafts
    low, high = 0.0, 1.0
    for _ in range(40):  # bisection: the mean grows with a
        middle = (low + high) / 2
        if middle * (1 - middle ** mean_drafts) / (1 - middle) < mean_accepted:
            low = middle
        else:
            high = middle
    return (low + high) / 2
