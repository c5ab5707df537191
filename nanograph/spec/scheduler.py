"""The scheduler with drafts: decode rows become verify chunks, rejected drafts are cut.

A subclass of the base scheduler (engine/scheduler.py), installed by llm.py in its place. It
changes a step at two points:
- `commit`: the drafter (drafter.py) may give each decode row guesses of the tokens after its
  last one. They are appended to its tokens, as many as its length limits and a free block
  allow (drafts never preempt), and the row becomes a prefill chunk of 1 + drafts tokens over
  its cache, every token of which samples: the target's own token at each draft's index (those
  check rows come before the base path's rows, one per sequence at its end). Such a step is
  collected before the next is scheduled (`overlap=False`): its sequences' lengths are unknown
  until then.
  Until it is, `Sequence.drafts_from` hides the drafts from the completion's text: the step
  before it may still be in flight, and collected first (drafter.py, "The last token in
  flight").
- `update`: the first draft its row contradicts is replaced by the row's token and everything
  after it cut (tokens, computed count, blocks), before the base path's update, so the prefix
  cache and the block table only ever hold tokens the target chose. Then the drafter counts.
"""
from dataclasses import dataclass, field

from nanograph.engine.scheduler import Batch, Scheduler
from nanograph.engine.sequence import Sequence, Status


@dataclass
class VerifyBatch(Batch):
    """A step that checks drafts: every sequence a chunk of its last token and its drafts."""
    num_draft_tokens: int = 0
    proposed: dict = field(default_factory=dict)  # sequence -> the drafts it was offered
    kind = "verify"  # (for the scheduler's step counters)


class SpeculativeScheduler(Scheduler):
    def __init__(self, *args, drafter, **kwargs):
        super().__init__(*args, **kwargs)
        self.drafter = drafter

    def commit(self, decodes: list[Sequence], prefills: list[tuple[Sequence, int]]) -> Batch:
        proposed = self.drafter.propose(decodes, prefills)
        if proposed is None:  # a plain step (may overlap the next)
            return super().commit(decodes, prefills)
        num_drafts = [self.add_drafts(seq, proposed.get(seq, [])) for seq in decodes]
        if not any(num_drafts):  # no room for them: a plain step too
            return super().commit(decodes, prefills)
        batch = VerifyBatch(seqs=decodes,  # (the drafter drafts only where nothing prefills)
                            num_decodes=0,
                            num_tokens=[1 + count for count in num_drafts],
                            num_draft_tokens=sum(num_drafts),
                            proposed=proposed,
                            overlap=False)
        # each draft's index is sampled by the token before it: (sequence, its index, the index)
        checks = [(seq, i, index) for i, (seq, count) in enumerate(zip(decodes, num_drafts))
                  for index in range(len(seq) - count, len(seq))]
        self.account(batch)
        batch.rows = checks + batch.rows
        for row, (seq, _, index) in enumerate(batch.rows):  # placeholders name their new rows
            if seq.token_ids[index] < 0:
                seq.token_ids[index] = -1 - row
        self.steps[batch.kind] += 1
        return batch

    def add_drafts(self, seq: Sequence, drafts: list[int]) -> int:
        """Append what fits of `drafts` to `seq`; how many did. They stop a token short of its
        length limit, so that only the target's own tokens can reach it (the base path's check
        in `account` then sees the sequence as it would without drafts)."""
        limit = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
        seq.token_ids += drafts[:max(limit - len(seq) - 2, 0)]
        if not self.block_manager.append_slot(seq):
            seq.truncate(seq.num_computed_tokens + 1)
        count = len(seq) - seq.num_computed_tokens - 1
        if count:  # hidden from its text until checked (a step in flight may be collected first)
            seq.drafts_from = len(seq) - count
        return count

    def update(self, batch: Batch, sampled: list[int], *logprobs):
        self.drafter.payoff.tick(batch.kind)  # (the steps' prices: payoff.py)
        if not isinstance(batch, VerifyBatch):  # a plain step: no drafts among its rows
            return super().update(batch, sampled, *logprobs)
        for seq in batch.seqs:
            seq.drafts_from = None  # checked now
        for (seq, _, index), token in zip(batch.rows, sampled):
            live = seq.status != Status.FINISHED and index < len(seq)
            if live and 0 <= seq.token_ids[index] != token:  # a draft (>= 0), contradicted
                self.reject_drafts(seq, index, token)
        updated = super().update(batch, sampled, *logprobs)
        self.drafter.verified(batch)
        return updated

    def reject_drafts(self, seq: Sequence, index: int, token: int):
        """The target sampled `token` where `seq` holds a draft: it replaces the draft, and the
        drafts after it go, with their K/V (recomputed from `index` on) and their blocks."""
        seq.truncate(index)
        seq.token_ids.append(token)
        seq.num_computed_tokens = min(seq.num_computed_tokens, index)
        self.block_manager.free(seq, keep=seq.num_blocks)
