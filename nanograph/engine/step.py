"""One step's inputs as plain data, and the one input that never leaves the device.

`StepInput` is what a scheduled `Batch` (scheduler.py) becomes before it meets the device:
plain lists of the tokens to compute, their positions and cache slots, each sequence's context
length and block table, and how it samples (temperature, seed, top-k / top-p). Plain data on
purpose: the single-GPU runner, the graph buffers, the tensor-parallel control message (tp.py),
bench and the tests all read the same thing.

Token ids may be placeholders. With overlap scheduling a decode step is built before the host
has the previous step's tokens, so a sequence's input token can be `-1 - r`: "whatever the
previous step sampled in its row r". Those tokens are on the device already, in the runner's
*token table*: `arange(vocab + rows)`, whose last entries are overwritten each step with the
sampled ids, row r at index -1 - r. Every id then resolves with one gather, `table[ids]`: a
real id indexes itself, a placeholder counts from the end. That gather is the first op of the
forward (inside the CUDA graph for replays), so no step waits for the host.
"""
from dataclasses import dataclass, field

import torch

from nanograph.engine.scheduler import Batch


@dataclass
class StepInput:
    """A step as plain lists. Three granularities: tokens, sequences (each a decode row or a
    prefill chunk), and sampling rows (a sequence whose step samples, plus one per fork)."""
    num_decodes: int = 0        # sequences [0, num_decodes) decode one token; the rest are chunks
    # per token, all sequences concatenated
    input_ids: list[int] = field(default_factory=list)     # < 0: placeholder (see above)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)  # cache slot of each token
    # per sequence
    context_lens: list[int] = field(default_factory=list)  # keys to attend (cached + new)
    block_tables: list[list[int]] = field(default_factory=list)  # as wide as the widest, -1 past
    cu_seqlens_q: list[int] = field(default_factory=lambda: [0])  # offsets into the tokens
    lora_slots: list[int] | None = None   # its adapter's slot, -1 = none; None: no adapters
    # per sampling row
    sample_indices: list[int] = field(default_factory=list)  # the token whose logits it samples
    sample_lens: list[int] = field(default_factory=list)     # that token's index in its sequence + 1
    temperatures: list[float] = field(default_factory=list)  # 0 = greedy
    seeds: list[int] = field(default_factory=list)   # noise stream (layers/sampler.py), 31 bits
    top_ks: list[int] | None = None       # -1 = off; None: no row uses top-k / top-p
    top_ps: list[float] | None = None
    num_logprobs: list[int] | None = None  # top log-probabilities to return, -1 = none; None: no row
    banned_rows: list[int] = field(default_factory=list)  # (row, token) pairs masked: min_tokens
    banned_ids: list[int] = field(default_factory=list)
    # per step
    copy_from: list[int] = field(default_factory=list)  # KV blocks copied after the forward (forks)
    copy_to: list[int] = field(default_factory=list)
    lora_rank: int = 0                    # the step's LoRA rank bucket, 0 = no adapters
    lora_loads: list = field(default_factory=list)  # (slot, Adapter) to load first (scheduler.py)

    @property
    def needs_logits(self) -> bool:
        """Whether some row's sampling needs the logits after the graph: top-k / top-p, a mask."""
        return self.top_ks is not None or bool(self.banned_rows)


def build_step(batch: Batch, block_size: int) -> StepInput:
    step = StepInput(num_decodes=batch.num_decodes,
                     lora_slots=batch.lora_slots,
                     lora_rank=batch.lora_rank,
                     lora_loads=batch.lora_loads)
    width = max(len(seq.block_table) for seq in batch.seqs)
    for seq, start, n in zip(batch.seqs, batch.starts, batch.num_tokens):
        end = start + n
        step.input_ids += seq.token_ids[start:end]
        step.positions += range(start, end)
        table = seq.block_table
        step.slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        step.context_lens.append(end)
        step.block_tables.append(table + [-1] * (width - len(table)))
        step.cu_seqlens_q.append(len(step.input_ids))
    params = [seq.params for seq in batch.rows]
    for row, (seq, source) in enumerate(zip(batch.rows, batch.row_sources)):
        step.sample_indices.append(step.cu_seqlens_q[source + 1] - 1)
        step.sample_lens.append(step.context_lens[source])
        step.temperatures.append(seq.params.temperature)
        step.seeds.append(seq.seed & 0x7FFFFFFF)
        if step.sample_lens[-1] - seq.num_prompt_tokens < seq.params.min_tokens:
            step.banned_ids += seq.stop_ids
            step.banned_rows += [row] * len(seq.stop_ids)
    if any(p.top_k > 0 or p.top_p < 1 for p in params):  # they cost a sort: only when asked
        step.top_ks = [p.top_k for p in params]
        step.top_ps = [p.top_p for p in params]
    if any(p.logprobs is not None for p in params):
        step.num_logprobs = [-1 if p.logprobs is None else p.logprobs for p in params]
    step.copy_from = [src for src, _ in batch.block_copies]
    step.copy_to = [dst for _, dst in batch.block_copies]
    return step


class TokenTable:
    """arange(vocab + max_rows): ids index themselves, placeholder -1 - r the last step's row r."""

    def __init__(self, vocab_size: int, max_rows: int, device):
        self.ids = torch.arange(vocab_size + max_rows, device=device)
        self.rows = torch.arange(vocab_size + max_rows - 1, vocab_size - 1, -1, device=device)  # row r -> -1 - r

    def resolve(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ids[ids]

    def put(self, sampled: torch.Tensor) -> None:
        """Keep a step's sampled ids for the next step's placeholders."""
        self.ids.index_copy_(0, self.rows[:len(sampled)], sampled)
