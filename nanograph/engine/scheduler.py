"""Continuous batching: which sequences run in the next step, and how many tokens each.

Two queues. `waiting` holds sequences that need prefill (new, or preempted); `running` holds
sequences that are decoding. Each step is either a prefill step or a decode step, never both,
so the decode step keeps the fixed shape a CUDA graph needs:

- Prefill first: admit waiting sequences in FIFO order while the step's token budget
  (`max_num_batched_tokens`), the batch limit (`max_num_seqs`) and free blocks allow. A prompt
  longer than the remaining budget is cut into chunks (chunked prefill): the chunk runs now and
  the sequence stays at the head of `waiting`, keeping its blocks, until its last chunk runs.
  Only the head can be part-way through its prefill.
- Otherwise decode: one token for every running sequence. A sequence whose next token needs a
  new block when none is free takes one from the most recently admitted running sequence, which
  is *preempted*: its blocks are freed and it goes back to the front of `waiting`, to be
  recomputed later (by then its prefix may even be cached). The oldest sequences thus always
  make progress, and a single sequence alone always fits (checked at intake), so this never
  deadlocks.

A step's life has two halves, because with overlap scheduling (llm.py) the next step is
scheduled before this one's tokens are back:
- `schedule` decides the step and at once accounts for it as computed: counters advance and
  every sequence whose step samples a token gets a *placeholder* for it, `-1 - row` (the row of
  this step that will sample it). The next step's decode input is then simply the last token,
  placeholder or not, at position len - 1; the model runner swaps placeholders for the sampled
  ids on the device. A sequence whose placeholder is its last token by length (`max_tokens`,
  `max_model_len`) leaves `running` right away: it is never scheduled again.
- `update` gets the step's sampled ids: fills the placeholders, registers the now computed
  blocks in the prefix cache, and finishes sequences. A stop that only the token reveals (EOS, a
  stop id) is seen one step late: the sequence was already scheduled once more; that token is
  dropped (`num_discarded_tokens`) and never reaches the output.
The per-step facts (rows, token counts, where each sampled token goes) live in the `Batch`,
not on the sequences, since the next `schedule` runs before this step's `update`.

LoRA adapters (layers/lora_slots.py) live in `max_loras` GPU slots, so no step may use more adapters
than that. Admission keeps it so: a waiting sequence whose adapter is not already used by a
running one waits while `max_loras` adapters are in use (more adapters than slots are served in
turn). Each step then gets a slot for every adapter it uses: the one the adapter already has,
else a free one, else the least recently used slot whose adapter no running sequence needs; the
load itself (`Batch.lora_loads`) runs on the GPU in stream order, after any step in flight
that still reads the old adapter.
"""
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from nanograph.engine.block_manager import BlockManager
from nanograph.engine.sequence import Sequence, Status


@dataclass
class Batch:
    """One scheduled step."""
    seqs: list[Sequence]
    is_prefill: bool
    starts: list[int]       # per sequence: its first token computed this step (num_computed_tokens before)
    num_tokens: list[int]   # per sequence: tokens computed this step (a prefill chunk, or 1)
    samples: list[bool]     # per sequence: whether this step samples its next token (False: a chunk)
    lora_slots: list[int] | None = None                  # per sequence: adapter slot, -1 = none; None: no adapters
    lora_rank: int = 0                                   # rank bucket of the step's adapters, 0 = none
    lora_loads: list = field(default_factory=list)       # (slot, Adapter) to load before this step


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_ids: frozenset[int] = frozenset(), max_model_len: int = 1 << 30, max_loras: int = 0,
                 lora_ranks: tuple[int, ...] = ()):
        self.block_manager = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.eos_ids, self.max_model_len = eos_ids, max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = self.num_discarded_tokens = 0
        self.max_loras, self.lora_ranks = max_loras, lora_ranks
        self.slot_of: OrderedDict = OrderedDict()  # Adapter -> slot, least recently used first

    def schedule(self) -> Batch | None:
        """The next step (None: nothing can run until an in-flight step is collected)."""
        seqs, counts, budget = [], [], self.max_num_batched_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.adapter and len(self.adapters_in_use([seq])) > self.max_loras:
                break  # its adapter would need a slot more than there are
            if not seq.block_table:
                if seq.num_blocks > self.block_manager.num_free_blocks:
                    break
                self.block_manager.allocate(seq)
            counts.append(min(len(seq) - seq.num_computed_tokens, budget))
            budget -= counts[-1]
            seqs.append(seq)
            if seq.num_computed_tokens + counts[-1] < len(seq):
                break  # a chunk: the budget is spent, the rest of the prompt goes next step
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)  # counts towards max_num_seqs (and its adapter towards max_loras) from here
        if seqs:
            return self.account(Batch(seqs, True, [], counts, []))

        while self.running and len(seqs) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.append_slot(seq):
                victim = self.running.pop() if self.running else seq
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                seqs.append(seq)
        self.running.extendleft(reversed(seqs))
        return self.account(Batch(seqs, False, [], [1] * len(seqs), [])) if seqs else None

    def adapters_in_use(self, seqs) -> set:
        return {s.adapter for s in (*self.running, *seqs) if s.adapter}

    def assign_slots(self, batch: Batch) -> None:
        if not (adapters := {s.adapter for s in batch.seqs if s.adapter}):
            return  # the base model's step: no slots, rank 0
        for adapter in adapters:
            if adapter not in self.slot_of:
                slot = len(self.slot_of)  # slots are taken in order and only ever change hands
                if slot == self.max_loras:  # all taken: admission guarantees one whose adapter no running seq needs
                    in_use = self.adapters_in_use(batch.seqs)
                    slot = self.slot_of.pop(next(a for a in self.slot_of if a not in in_use))
                self.slot_of[adapter] = slot
                batch.lora_loads.append((slot, adapter))
            self.slot_of.move_to_end(adapter)
        batch.lora_slots = [self.slot_of[s.adapter] if s.adapter else -1 for s in batch.seqs]
        batch.lora_rank = next(r for r in self.lora_ranks if r >= max(a.rank for a in adapters))

    def account(self, batch: Batch) -> Batch:
        """Treat `batch` as computed: give it adapter slots, advance the counters, give each
        sampling row a placeholder."""
        self.assign_slots(batch)
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            batch.starts.append(seq.num_computed_tokens)
            seq.num_computed_tokens += n
            # a prefill chunk (not the prompt's end) samples nothing: its logits predict nothing
            batch.samples.append(seq.num_computed_tokens == len(seq))
            if batch.samples[-1]:
                seq.token_ids.append(-1 - row)
                if self.at_length_limit(seq, len(seq)):
                    self.running.remove(seq)  # its last token is decided: finishes in update()
        return batch

    def at_length_limit(self, seq: Sequence, length: int) -> bool:
        """Whether a sequence of `length` tokens has no room for another (max_tokens, max_model_len)."""
        return length - seq.num_prompt_tokens >= seq.params.max_tokens or length >= self.max_model_len

    def preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status, seq.num_computed_tokens = Status.WAITING, 0
        # behind a part-prefilled head, which holds blocks and must finish first
        self.waiting.insert(1 if self.waiting and self.waiting[0].block_table else 0, seq)
        self.num_preemptions += 1

    def update(self, batch: Batch, sampled: list[int]) -> list[Sequence]:
        """Account for a collected step; returns the sequences that finished."""
        finished = []
        for row, (seq, token) in enumerate(zip(batch.seqs, sampled)):
            if seq.status == Status.FINISHED:
                self.num_discarded_tokens += batch.samples[row]  # stopped by a token one step late
                continue
            end = batch.starts[row] + batch.num_tokens[row]  # computed after this step: the sampled token's index
            # blocks this step completed (none if it was preempted since: its counter went back to 0)
            self.block_manager.register_computed_blocks(seq, min(end, seq.num_computed_tokens))
            if not batch.samples[row]:
                continue
            seq.token_ids[end] = token
            p = seq.params
            if ((not p.ignore_eos and token in self.eos_ids) or (p.stop_token_ids and token in p.stop_token_ids)
                    or self.at_length_limit(seq, end + 1)):
                del seq.token_ids[end + 1:]  # a placeholder of the step already scheduled after this one
                self.finish(seq)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence) -> None:
        """Done or aborted: free its blocks, take it off whichever queue holds it."""
        seq.status = Status.FINISHED
        self.block_manager.free(seq)
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
