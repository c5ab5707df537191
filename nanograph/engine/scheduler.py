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
"""
from collections import deque

from nanograph.engine.block_manager import BlockManager
from nanograph.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Returns (sequences of this step, is_prefill). Sets each one's num_scheduled_tokens."""
        batch, budget = [], self.max_num_batched_tokens
        while self.waiting and budget > 0 and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                if not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
            seq.num_scheduled_tokens = min(len(seq) - seq.num_computed_tokens, budget)
            budget -= seq.num_scheduled_tokens
            batch.append(seq)
            if seq.num_computed_tokens + seq.num_scheduled_tokens < len(seq):
                break  # a chunk: the budget is spent, the rest of the prompt goes next step
            self.waiting.popleft()
            seq.status = Status.RUNNING
        if batch:
            self.running.extend(s for s in batch if s.status == Status.RUNNING)
            return batch, True

        while self.running and len(batch) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.append_slot(seq):
                victim = self.running.pop() if self.running else seq
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                seq.num_scheduled_tokens = 1
                batch.append(seq)
        self.running.extendleft(reversed(batch))
        return batch, False

    def preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status, seq.num_computed_tokens = Status.WAITING, 0
        # behind a part-prefilled head, which holds blocks and must finish first
        self.waiting.insert(1 if self.waiting and self.waiting[0].block_table else 0, seq)
        self.num_preemptions += 1

    def update(self, batch: list[Sequence], sampled: list[int], eos_ids: set[int], max_model_len: int) -> list[Sequence]:
        """Account for a finished step; returns the sequences that finished."""
        finished = []
        for seq, token in zip(batch, sampled):
            seq.num_computed_tokens += seq.num_scheduled_tokens
            self.block_manager.register_computed_blocks(seq)
            if seq.num_computed_tokens < len(seq):
                continue  # a prefill chunk: its logits predict nothing new
            seq.token_ids.append(token)
            p = seq.params
            if ((not p.ignore_eos and token in eos_ids) or (p.stop_token_ids and token in p.stop_token_ids)
                    or len(seq) - seq.num_prompt_tokens >= p.max_tokens or len(seq) >= max_model_len):
                seq.status = Status.FINISHED
                self.block_manager.free(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished
