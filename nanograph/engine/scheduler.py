"""Continuous batching: which sequences run in the next step, and how many tokens each.

Two queues. `waiting` holds sequences that need prefill (new, or preempted); `running` holds
sequences that are decoding. A step has a decode part and a prefill part (Sarathi-Serve's
stall-free batching):

- Decode first: one token for every running sequence. A sequence whose next token needs a new
  block when none is free takes one from the most recently admitted running sequence, which is
  *preempted*: its blocks are freed and it goes back to the front of `waiting`, to be recomputed
  later (by then its prefix may even be cached). The oldest sequences thus always make progress,
  and a single sequence alone always fits (checked at intake), so this never deadlocks.
- Then prefill chunks fill the step's token budget: the part-prefilled head of `waiting` first,
  then new prompts in FIFO order while the batch limit (`max_num_seqs`) and free blocks allow.
  A prompt longer than what is left of the budget is cut (chunked prefill): the chunk runs now
  and the sequence stays at the head of `waiting`, keeping its blocks, until its last chunk
  runs. So only the head can be part-way through its prefill. A step that preempted admits no
  new prompt (it would take back the blocks just freed).

The prefill budget is `max_num_batched_tokens` when nothing decodes (a prefill-only step). When
something does, every decoding sequence waits for the whole step, whose time grows with its
tokens, so the prefill part gets less, in proportion to the batch's free seats:
`max_num_mixed_tokens` times the share of `max_num_seqs` not decoding, at least a sixteenth of
it. A nearly empty batch (a burst arriving) fills fast, and filling it is what raises
throughput; in a full batch a new prompt only takes the seat of one that finished, so
prefilling it faster would gain nothing, and small chunks keep the gaps between tokens even
(docs/performance.md has the measurements). And the prefill part takes at most a DRAIN_STEPS-th
of the prompt tokens waiting (the backlog: those of the first `max_num_seqs` sequences in
`waiting`, the ones that could take a seat soon), but never less than an eighth of
`max_num_mixed_tokens`. A burst's backlog is large and leaves the seat rule in charge; under a
steady stream of requests the backlog is a prompt or two, which then goes in small chunks over
several steps, instead of one long step now and then: the gaps between tokens stay even.

A step's life has two halves, because with overlap scheduling (llm.py) the next step is
scheduled before this one's tokens are back:
- `schedule` decides the step and at once accounts for it as computed: counters advance and
  every sequence whose step samples a token gets a *placeholder* for it, `-1 - row` (the
  sampling row of this step that will produce it; docs/walkthrough.md has a worked example). The
  next step's decode input is then simply the last token, placeholder or not; the model runner
  swaps placeholders for the sampled ids on the device. A sequence whose placeholder is its last
  token by length (`max_tokens`, `max_model_len`) leaves `running` right away.
- `update` gets the step's sampled ids: fills the placeholders, registers the now computed
  blocks in the prefix cache, and finishes sequences. A stop that only the token reveals (EOS, a
  stop id, a stop string in llm.py) is seen one step late: the sequence was already scheduled
  once more; that token is dropped (`num_discarded_tokens`) and never reaches the output.
The per-step facts live in the `Batch`, not on the sequences, since the next `schedule` runs
before this step's `update`.

n > 1: a request's other completions wait in its first sequence's `forks` while it computes the
prompt. When its first token comes back (`update`), the prompt's full blocks are in the prefix
cache, and the others go to the front of `waiting`: each starts from those blocks and computes
only the prompt's partial last block (or its last token) before sampling its own first token.
vLLM's V1 engine does the same; without prefix caching (or with prompt_logprobs, which skip
the cache), each computes the whole prompt.

Extensions. A scheduler may be handed a `slots` table: a resource of its own that each step's
sequences need beside KV blocks (lora/slots.py's adapter slots are one). It may refuse a
sequence at admission (`can_admit`) and it annotates each step (`assign`: the step's graph
`variant` and its `extras`, which travel untouched to the model runner's extensions). Without
one (`None`) the scheduler is exactly the above.

Speculative decoding (spec/) replaces the scheduler with a subclass that overrides `commit`
(the step made from the sequences chosen) and extends `update`; its batches (a subclass of
`Batch`) name their own `kind`, and ask with `overlap=False` to be collected before the next
step is scheduled.
"""
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import islice

from nanograph.engine.block_manager import BlockManager
from nanograph.engine.sequence import Sequence, Status

DRAIN_STEPS = 8  # a mixed step prefills at most 1 / DRAIN_STEPS of the backlog (see above)


@dataclass
class Batch:
    """One scheduled step: the decode part, then the prefill part."""
    # the first num_decodes decode one token each, the rest are prefill chunks
    seqs: list[Sequence]
    num_decodes: int
    num_tokens: list[int]   # per sequence: tokens computed this step (1 in the decode part)
    starts: list[int] = field(default_factory=list)  # per sequence: num_computed_tokens before
    # per sampling row: who gets its token, the index in seqs of the sequence whose logits it
    # samples, and the index in its sequence of the token it samples
    rows: list[tuple[Sequence, int, int]] = field(default_factory=list)
    variant: int = 0  # which of the runner's graph variants the step needs; 0 = the base model's
    extras: dict = field(default_factory=dict)  # what the slots table attached, for the runner
    overlap: bool = True  # False: collect it before scheduling the next step (llm.py)

    @property
    def kind(self):
        if self.num_decodes == len(self.seqs):
            return "decode"
        return "mixed" if self.num_decodes else "prefill"


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs, max_num_batched_tokens,
                 max_num_mixed_tokens=None, max_model_len=1 << 30, slots=None):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_mixed_tokens = max_num_mixed_tokens or max_num_batched_tokens
        self.max_model_len = max_model_len
        self.slots = slots  # an extension's slot table (see above), None = none
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_discarded_tokens = 0
        self.steps = Counter()  # "decode" / "mixed" / "prefill" -> steps scheduled

    def schedule(self):
        """The next step (None: nothing can run until an in-flight step is collected)."""
        preemptions = self.num_preemptions
        decodes = self.schedule_decodes()
        budget = self.prefill_budget(len(decodes)) if decodes else self.max_num_batched_tokens
        # a step that preempted admits no new prompt
        admit = self.num_preemptions == preemptions
        prefills = self.schedule_prefills(budget, admit)
        return self.commit(decodes, prefills) if decodes or prefills else None

    def commit(self, decodes: list[Sequence], prefills: list[tuple[Sequence, int]]) -> Batch:
        """The step of `decodes` (one token each) and `prefills`: made, accounted for as
        computed, counted."""
        batch = Batch(seqs=decodes + [seq for seq, _ in prefills],
                      num_decodes=len(decodes),
                      num_tokens=[1] * len(decodes) + [chunk for _, chunk in prefills])
        self.account(batch)
        self.steps[batch.kind] += 1
        return batch

    def prefill_budget(self, num_decodes: int) -> int:
        """A mixed step's prefill tokens: `max_num_mixed_tokens` by the share of free seats,
        at least a sixteenth of it; and a DRAIN_STEPS-th of the prompt tokens waiting, at least
        an eighth of `max_num_mixed_tokens` (see above)."""
        budget = self.max_num_mixed_tokens
        free_seats = self.max_num_seqs - num_decodes  # (< 0 under a lowered limit: the floor)
        by_seats = max(budget * free_seats // self.max_num_seqs, budget // 16)
        # (the sequences that could take a seat soon: a bounded walk, whatever waits)
        backlog = sum(len(seq) - seq.num_computed_tokens
                      for seq in islice(self.waiting, self.max_num_seqs))
        return min(by_seats, max(backlog // DRAIN_STEPS, budget // 8))

    def schedule_decodes(self):
        """Every running sequence, each with room for one more token (preempting for it)."""
        seqs = []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.append_slot(seq):
                victim = self.running.pop() if self.running else seq
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                seqs.append(seq)
        self.running.extend(seqs)
        return seqs

    def schedule_prefills(self, budget: int, admit=True):
        """(sequence, chunk) pairs from the head of `waiting` within `budget` tokens; only the
        part-prefilled head, unless `admit`."""
        chunks = []
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not seq.block_table:
                if not (admit and self.can_admit(seq)):
                    break
                self.block_manager.allocate(seq)
            chunk = min(len(seq) - seq.num_computed_tokens, budget)
            budget -= chunk
            chunks.append((seq, chunk))
            if seq.num_computed_tokens + chunk < len(seq):
                break  # a chunk: the budget is spent, the rest of the prompt goes next step
            self.waiting.popleft()
            seq.status = Status.RUNNING
            # counts towards max_num_seqs (and towards the slots table's limits) from here
            self.running.append(seq)
        return chunks

    def can_admit(self, seq: Sequence):
        """Room for `seq`: a seat, the slots table's say, blocks."""
        return (len(self.running) < self.max_num_seqs
                and (self.slots is None or self.slots.can_admit(seq, self.running))
                and seq.num_blocks <= self.block_manager.num_free_blocks)

    def account(self, batch: Batch):
        """Treat `batch` as computed: the slots table's say, counters advanced, a placeholder for
        each sampling row."""
        if self.slots is not None:
            self.slots.assign(batch, self.running)
        for i, (seq, num_tokens) in enumerate(zip(batch.seqs, batch.num_tokens)):
            batch.starts.append(seq.num_computed_tokens)
            seq.num_computed_tokens += num_tokens
            if seq.num_computed_tokens < len(seq):
                continue  # a prefill chunk (not the prompt's end) samples nothing
            seq.token_ids.append(-1 - len(batch.rows))
            batch.rows.append((seq, i, len(seq) - 1))
            if self.at_length_limit(seq, len(seq)):
                self.running.remove(seq)  # its last token is decided: finishes in update()

    def at_length_limit(self, seq: Sequence, length: int):
        """Whether a sequence of `length` tokens has no room for another (max_tokens,
        max_model_len)."""
        return length - seq.num_prompt_tokens >= seq.params.max_tokens \
            or length >= self.max_model_len

    def preempt(self, seq: Sequence):
        self.block_manager.free(seq)
        seq.status, seq.num_computed_tokens = Status.WAITING, 0
        self.requeue(seq)
        self.num_preemptions += 1

    def requeue(self, seq: Sequence):
        """To the front of `waiting`, behind a part-prefilled head (it holds blocks and must
        finish first)."""
        self.waiting.insert(1 if self.waiting and self.waiting[0].block_table else 0, seq)

    def update(self, batch: Batch, sampled: list[int], logprobs: list[dict | None] | None = None,
               prompt_logprobs: list[tuple[tuple[int, int], dict]] | None = None):
        """Account for a collected step: each row's token (and its logprobs, when asked) into its
        sequence, and the prompt logprobs it computed, each ((index in seqs, position p), the
        entry of the token after p). Returns the sequences that got a token (finished ones with
        their reason)."""
        for (index, position), entry in prompt_logprobs or ():
            # (a recompute after preemption writes the same entries again)
            batch.seqs[index].prompt_logprobs[position + 1] = entry
        for seq, start, num_tokens in zip(batch.seqs, batch.starts, batch.num_tokens):
            # blocks this step completed (none if it was preempted since: its counter went
            # back to 0)
            if seq.status != Status.FINISHED:
                computed = min(start + num_tokens, seq.num_computed_tokens)
                self.block_manager.register_computed_blocks(seq, computed)
        updated = []
        for row, ((seq, _, index), token) in enumerate(zip(batch.rows, sampled)):
            if seq.status == Status.FINISHED:
                self.num_discarded_tokens += 1  # stopped by a token one step late (or a draft's)
                continue
            if index >= len(seq.token_ids):
                continue  # past its end: a draft's check after a rejected draft (spec/)
            seq.token_ids[index] = token
            for child in reversed(seq.forks):  # its prompt's blocks are cached: they start
                self.requeue(child)
            seq.forks = []
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs[row])
            if token in seq.stop_ids:
                stop_id = token if token in (seq.params.stop_token_ids or ()) else None
                seq.truncate(index + 1)  # (drafts after it, spec/)
                self.finish(seq, "stop", stop_id)
            elif self.at_length_limit(seq, index + 1):
                self.finish(seq, "length")
            updated.append(seq)
        return updated

    def finish(self, seq: Sequence, reason="abort", stop_reason: int | str | None = None):
        """Done or aborted: drop the placeholders of steps scheduled after its last token, free its
        blocks (and its forks'), take it off whichever queue holds it."""
        if seq.status == Status.FINISHED:
            return
        while seq.token_ids[-1] < 0:  # placeholders of steps scheduled after its last token
            seq.token_ids.pop()
        seq.status = Status.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.block_manager.free(seq)
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        for child in seq.forks:
            self.finish(child, reason)
