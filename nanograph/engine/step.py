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
    is_prefill: bool
    input_ids: list[int]        # the tokens computed this step, all sequences concatenated (< 0: placeholder)
    positions: list[int]
    slot_mapping: list[int]     # cache slot of each of those tokens
    context_lens: list[int]     # per sequence: keys to attend (cached + computed before + new)
    block_tables: list[list[int]]   # one row per sequence, all as wide as the widest, -1 past its blocks
    cu_seqlens_q: list[int]     # per sequence offsets into input_ids (len = sequences + 1)
    temperatures: list[float]   # per sequence, 0 = greedy
    seeds: list[int]            # per sequence: its noise stream (layers/sampler.py), 31 bits: int32 buffers
    top_ks: list[int] | None = None          # per sequence, -1 = off; None: no row uses top-k / top-p
    top_ps: list[float] | None = None
    lora_slots: list[int] | None = None   # per sequence: its adapter's slot, -1 (or None for all) = none
    lora_rank: int = 0                    # the step's LoRA rank bucket, 0 = no adapters
    lora_loads: list = field(default_factory=list)  # (slot, Adapter) to load first (scheduler.py)


def build_step(batch: Batch, block_size: int) -> StepInput:
    params = [seq.params for seq in batch.seqs]
    top = any(p.top_k > 0 or p.top_p < 1 for p in params)  # top-k / top-p cost a sort: only when some row asks
    step = StepInput(batch.is_prefill, [], [], [], [], [], [0], [p.temperature for p in params],
                     [seq.seed & 0x7FFFFFFF for seq in batch.seqs], [p.top_k for p in params] if top else None,
                     [p.top_p for p in params] if top else None, batch.lora_slots, batch.lora_rank, batch.lora_loads)
    width = max(len(seq.block_table) for seq in batch.seqs)
    for row, seq in enumerate(batch.seqs):
        start, end = batch.starts[row], batch.starts[row] + batch.num_tokens[row]
        step.input_ids += seq.token_ids[start:end]
        step.positions += range(start, end)
        step.slot_mapping += [seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        step.context_lens.append(end)
        step.block_tables.append(seq.block_table + [-1] * (width - len(seq.block_table)))
        step.cu_seqlens_q.append(len(step.input_ids))
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
