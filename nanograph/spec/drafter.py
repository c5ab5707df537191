"""The scheduler's drafter: prompt-lookup drafts for the decode rows, and when not to draft.

The scheduler (scheduler.py) asks `propose` for each step's decode rows, appends the
drafts to their tokens and turns the rows into verify chunks; after the step, `update` cuts each
sequence at its first rejected draft and calls `verified`, where the drafter counts what was
accepted (vLLM's `spec_decode_*` counters) and what a verify gives a row. The drafts
themselves come from `lookup`: prompt lookup here, a draft model in its subclass
(draft_model.py); the rest is the same for both.

Drafting costs: a verify row computes 1 + k tokens where a decode row computes one, and a step
with drafts is collected before the next is scheduled (its sequences' lengths depend on what is
accepted), so it loses overlap scheduling. It pays where a step's time is reading the weights
(small batches) and drafts are often right. So, per step:
- no drafts in a step with prefill chunks (it runs on the mixed graphs, which have no verify
  rows), nor with more than `disable_by_batch_size` decode rows (vLLM's name; there the step is
  compute-bound, and k + 1 tokens a row cost about k + 1 times one);
- on the clock (payoff.py, `disable_by_payoff`): no drafts while the tokens a verify gives a row
  do not pay for the verify's measured price, but for a probe now and then. Whether drafts pay
  depends on the model, the GPU, the host and the text at once; the clock sees all of them.
  A lookup that finds nothing to copy costs no verify: the next step looks again.
A step in which no row gets drafts returns None: a plain step, overlapped as usual.

The last token in flight. Under overlap scheduling a decoding sequence's last token is usually
still being sampled by the step in flight (a placeholder, engine/step.py) when the next step is
scheduled. Waiting for it would cost a step collected before the next one each time drafting
starts. Instead such a sequence is drafted from the tokens before it, one draft more, and the
first draft, the guess of the token in flight, is dropped: the rest continue that guess. The
verify step then goes out while the step before it is still running (its chunk's first token a
placeholder like any decode row's), and if the guess was wrong its drafts are simply rejected.
"""
from dataclasses import dataclass
from functools import partial

from nanograph.engine.sequence import Status
from nanograph.spec.ngram import propose_ngram
from nanograph.spec.payoff import Payoff, running_mean


@dataclass
class SpeculativeConfig:
    """`LLM(speculative_config={...})`, vLLM's keys, checked by `parse`."""
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int = 2  # where drafts stop paying: docs/performance.md
    disable_by_payoff: bool = True  # no drafts while they do not pay on the clock (payoff.py)
    method: str = "ngram"           # or "draft_model", implied by "model"
    model: str | None = None        # the draft model's path (draft_model.py)

    @classmethod
    def parse(cls, values, block_size: int):
        """From the user's dict; ValueError naming the key for anything bad."""
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(values).__name__}")
        known = set(cls.__dataclass_fields__)
        if (unknown := sorted(set(values) - known)):
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} "
                             f"(known: {sorted(known)})")
        method = values.get("method", "draft_model" if "model" in values else "ngram")
        if method not in ("ngram", "draft_model"):
            raise ValueError("speculative_config['method'] must be 'ngram' or 'draft_model', "
                             f"got {method!r}")
        if (method == "draft_model") != isinstance(values.get("model"), str):
            raise ValueError("speculative_config['model'], a draft model's path, goes with method "
                             f"'draft_model' and only with it: got {values.get('model')!r} "
                             f"with method {method!r}")
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config needs 'num_speculative_tokens'")
        config = cls(**values | {"method": method})
        if config.disable_by_payoff not in (True, False):
            raise ValueError("speculative_config['disable_by_payoff'] must be a bool, got "
                             f"{config.disable_by_payoff!r}")
        for key, low, high in (("num_speculative_tokens", 1, block_size - 1),
                               ("prompt_lookup_max", 1, 64),
                               ("prompt_lookup_min", 1, config.prompt_lookup_max),
                               ("disable_by_batch_size", 1, 1 << 20)):
            value = getattr(config, key)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(
                    f"speculative_config[{key!r}] must be an int in [{low}, {high}], got {value!r}")
        return config


class NgramDrafter:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        # (token ids, k) -> up to k drafts
        self.proposer = partial(propose_ngram, prompt_lookup_min=config.prompt_lookup_min,
                                prompt_lookup_max=config.prompt_lookup_max)
        self.payoff = Payoff()
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    def propose(self, decodes: list, prefills: list) -> dict | None:
        """Drafts for the decode rows that get some: {sequence: drafts}; None: a plain step."""
        if prefills or len(decodes) > self.config.disable_by_batch_size:
            return None
        if self.config.disable_by_payoff and not self.payoff.allows():
            return None
        # 1 where the last token is a placeholder, in flight: draft from the tokens before it,
        # one more, the first a guess of that token (dropped)
        guessed = [int(seq.token_ids[-1] < 0) for seq in decodes]
        histories = [seq.token_ids[:len(seq) - guess] for seq, guess in zip(decodes, guessed)]
        counts = [self.config.num_speculative_tokens + guess for guess in guessed]
        drafts = {seq: tokens[guess:]
                  for seq, guess, tokens in zip(decodes, guessed, self.lookup(histories, counts))
                  if tokens}  # (a lookup that finds nothing: the next step looks again)
        return drafts or None

    def lookup(self, histories: list[list[int]], counts: list[int]) -> list[list[int]]:
        """Up to counts[i] drafts (or none) after token list histories[i]: prompt lookup
        (ngram.py), or the bench's."""
        return [self.proposer(history, count) for history, count in zip(histories, counts)]

    def verified(self, batch):
        """After the scheduler's update of the verify step `batch`: count what its drafts got."""
        for seq, start, num_tokens in zip(batch.seqs, batch.starts, batch.num_tokens):
            drafts = batch.proposed.get(seq, [])[:num_tokens - 1]  # (the scheduler may cut them)
            if not drafts or seq.status == Status.FINISHED:  # (its token in flight ended it)
                continue
            kept = seq.token_ids[start + 1:start + 1 + len(drafts)]
            accepted = next((j for j, (a, b) in enumerate(zip(drafts, kept)) if a != b), len(kept))
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += accepted
            self.payoff.tokens = running_mean(self.payoff.tokens, 1 + accepted)

    def close(self):
        """Nothing to free here (the draft model's drafter frees its engine)."""

    def stats(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                # tokens a sequence gets per verify: its accepted drafts and the target's own
                "spec_decode_mean_accepted_length":
                    1 + self.num_accepted_tokens / max(self.num_drafts, 1)}
