"""One step on its way to the device, in the forms it takes there.

    Batch (scheduler.py)      which sequences, how many tokens each, who samples
      -> StepInput            the same as plain lists: tokens, sequences, sampling rows
      -> StepBuffers          those lists in one flat int32 device tensor, laid out by a StepShape
      -> StepMetadata         views of the buffers that attention and the linear layers read
                              (utils/context.py)

`StepInput` is plain data on purpose: the tensor-parallel workers receive it (tp.py), the bench
and the tests build it by hand. `StepBuffers` are static: allocated once for the largest step,
so that a CUDA graph can replay over them (cuda_graph.py); an eager step uses them too, laid out
with its own exact shape, so there is one forward for both (model_runner.py).

Token ids may be placeholders, `-1 - r`: "the token the previous step sampled in its row r",
which the host does not know yet under overlap scheduling (docs/walkthrough.md, "Placeholders",
has a worked example). They resolve on the device (`resolve_placeholders`): the model runner
keeps the last step's sampled ids in a static buffer, row r at index r, until the next step's
forward has read them.

An extension may add to a step without the base path knowing what it adds: `variant` picks one
of its graphs (0 = the base model's), `extras` carries its data from the scheduler to the
runner, and it may declare more fields of the flat buffer (model_runner.py, `RunnerExtension`).
"""
from dataclasses import dataclass, field

import torch

from nanograph.engine.scheduler import Batch


@dataclass
class StepInput:
    """A step as plain lists. Three granularities: tokens, sequences (each a decode row or a
    prefill chunk), and sampling rows (a sequence whose step samples)."""
    num_decodes: int = 0        # sequences [0, num_decodes) decode one token; the rest are chunks
    # per token, all sequences concatenated
    input_ids: list[int] = field(default_factory=list)     # < 0: placeholder
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)  # cache slot of each token
    # per sequence
    context_lens: list[int] = field(default_factory=list)  # keys to attend (cached + new)
    block_tables: list[list[int]] = field(default_factory=list)  # as wide as the widest, -1 past
    cu_seqlens_q: list[int] = field(default_factory=lambda: [0])  # offsets into the tokens
    # per sampling row
    sample_indices: list[int] = field(default_factory=list)  # the token whose logits it samples
    # that token's index in its sequence + 1
    sample_lens: list[int] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)  # 0 = greedy
    seeds: list[int] = field(default_factory=list)   # noise stream (layers/sampler.py), 31 bits
    top_ks: list[int] | None = None       # -1 = off; None: no row uses top-k / top-p
    top_ps: list[float] | None = None
    # top log-probabilities to return, -1 = none; None: no row
    num_logprobs: list[int] | None = None
    banned: list[tuple[int, int]] = field(default_factory=list)  # (row, token) masked: min_tokens
    # prompt logprobs: the tokens whose hidden states score the prompt token after them
    prompt_logprob_positions: list[tuple[int, int]] = field(default_factory=list)  # (seq, position)
    prompt_logprob_indices: list[int] = field(default_factory=list)  # a token's index in the step
    prompt_logprob_targets: list[int] = field(default_factory=list)  # the prompt token it scores
    prompt_logprob_top_n: list[int] = field(default_factory=list)  # its request's N
    # per step
    variant: int = 0                      # which graph variant it needs (Batch.variant)
    extras: dict = field(default_factory=dict)  # what extensions attached (Batch.extras)

    def exact_shape(self):
        """The shape that holds this step and nothing more (an eager step's)."""
        num_decodes = self.num_decodes
        chunk_offsets = self.cu_seqlens_q[num_decodes:]
        chunk_lens = [end - start for start, end in zip(chunk_offsets, chunk_offsets[1:])]
        return StepShape(decodes=num_decodes,
                         prefill_tokens=len(self.input_ids) - num_decodes,
                         chunks=len(self.context_lens) - num_decodes,
                         rows=len(self.temperatures),
                         variant=self.variant,
                         max_chunk=max(chunk_lens, default=0))


@dataclass(frozen=True)
class StepShape:
    """How a step lies in the buffers, and a CUDA graph's key: tokens [0, decodes) are the decode
    rows and the next prefill_tokens the chunks; sequences [0, decodes) then the chunks; rows the
    sampling rows. What a step does not fill is padding (cuda_graph.py)."""
    decodes: int
    prefill_tokens: int = 0
    chunks: int = 0
    rows: int = 0
    variant: int = 0    # an extension's graph variant (LoRA: the rank bucket); 0 = base model
    max_chunk: int = 0  # a bound on a chunk's length: it sizes the prefill kernel's grid

    @property
    def tokens(self):
        return self.decodes + self.prefill_tokens

    @property
    def seqs(self):
        return self.decodes + self.chunks


def build_step(batch: Batch, block_size) -> StepInput:
    step = StepInput(num_decodes=batch.num_decodes,
                     variant=batch.variant,
                     extras=batch.extras)
    width = max(len(seq.block_table) for seq in batch.seqs)
    for i, (seq, start, num_tokens) in enumerate(zip(batch.seqs, batch.starts, batch.num_tokens)):
        end = start + num_tokens
        if seq.prompt_logprobs is not None:  # the prompt positions before its last, in this chunk
            for position in range(start, min(end, seq.num_prompt_tokens - 1)):
                step.prompt_logprob_positions.append((i, position))
                step.prompt_logprob_indices.append(len(step.input_ids) + position - start)
                step.prompt_logprob_targets.append(seq.token_ids[position + 1])
                step.prompt_logprob_top_n.append(seq.params.prompt_logprobs)
        step.input_ids += seq.token_ids[start:end]
        step.positions += range(start, end)
        table = seq.block_table
        step.slot_mapping += [table[p // block_size] * block_size + p % block_size
                              for p in range(start, end)]
        step.context_lens.append(end)
        step.block_tables.append(table + [-1] * (width - len(table)))
        step.cu_seqlens_q.append(len(step.input_ids))
    params = [seq.params for seq, _, _ in batch.rows]
    for row, (seq, source, index) in enumerate(batch.rows):
        # the token before `index`, among the step's tokens
        step.sample_indices.append(step.cu_seqlens_q[source] + index - 1 - batch.starts[source])
        step.sample_lens.append(index)
        step.temperatures.append(seq.params.temperature)
        step.seeds.append(seq.seed)
        if step.sample_lens[-1] - seq.num_prompt_tokens < seq.params.min_tokens:
            step.banned += [(row, token) for token in seq.stop_ids]
    if any(p.top_k > 0 or p.top_p < 1 for p in params):  # they cost a sort: only when asked
        step.top_ks = [p.top_k for p in params]
        step.top_ps = [p.top_p for p in params]
    if any(p.logprobs is not None for p in params):
        step.num_logprobs = [-1 if p.logprobs is None else p.logprobs for p in params]
    return step


class StepBuffers:
    """A step's inputs on the device: one flat int32 tensor, filled from a pinned host mirror with
    one non-blocking copy. Its fields lie back to back, each as long as the step's shape needs,
    so a small step copies a few hundred bytes; a CUDA graph replays the views of its own shape,
    whose offsets never change. For a shape with d decode rows, p prefill tokens, c chunks and
    r sampling rows:

        | input_ids positions slot_mapping | context_lens | sample_indices ... seeds | cu_seqlens_q | block_tables    |
        |   each d + p (a token's)         |  d + c       |  each r (a row's)        |  c + 1       | (d + c) x width |

    A token's and a sequence's fields hold the decode part at 0 and the prefill part at d, each
    padded after its live entries (`place`); a row's fields hold the live rows first
    (`place_rows`). Padding is neutral: token 0 at position 0, no cache slot, no context, greedy;
    a padded chunk has length 0 (its offset repeats the last live one). An extension may add
    fields (per token, sequence or row, with their padding) after the base ones.

    There are two host mirrors, used in turn: with overlap scheduling the host fills step N+1
    while step N's copy may not have run yet; step N-1, which used the other mirror, has been
    collected by then, so that mirror is free."""

    # field -> (what it is per, its value in padding)
    FIELDS = {"input_ids": ("token", 0), "positions": ("token", 0), "slot_mapping": ("token", -1),
              "context_lens": ("seq", 0), "sample_indices": ("row", 0), "sample_lens": ("row", 0),
              "temperatures": ("row", 0), "seeds": ("row", 0)}

    def __init__(self, max_tokens, max_seqs, max_blocks, device, extra_fields=None):
        self.max_blocks = max_blocks
        self.fields = self.FIELDS | (extra_fields or {})
        largest = StepShape(decodes=max_tokens, chunks=max_seqs, rows=max_seqs)
        size = self.layout(largest)["block_tables"].stop
        self.device_flat = torch.zeros(size, dtype=torch.int32, device=device)
        pinned = torch.device(device).type == "cuda"
        self.host_flats = [torch.zeros(size, dtype=torch.int32, pin_memory=pinned)
                           for _ in range(2)]
        self.turn = 0

    def layout(self, shape: StepShape) -> dict[str, slice]:
        """Where each field of a step of `shape` lies, the query offsets and block tables last."""
        lengths = {"token": shape.tokens, "seq": shape.seqs, "row": shape.rows}
        slices, start = {}, 0
        for name, (per, _) in self.fields.items():
            slices[name] = slice(start, start + lengths[per])
            start += lengths[per]
        slices["cu_seqlens_q"] = slice(start, start + shape.chunks + 1)
        start = slices["cu_seqlens_q"].stop
        slices["block_tables"] = slice(start, start + shape.seqs * self.max_blocks)
        return slices

    def views(self, shape: StepShape, flat: torch.Tensor | None = None):
        """The fields of a step of `shape`, as views of `flat` (default: the device tensor)."""
        flat = self.device_flat if flat is None else flat
        views = {name: flat[where] for name, where in self.layout(shape).items()}
        views["temperatures"] = views["temperatures"].view(torch.float32)
        views["block_tables"] = views["block_tables"].view(shape.seqs, self.max_blocks)
        return views

    def fill(self, step: StepInput, shape: StepShape, extra_values: dict | None = None):
        """Copy `step` (and the values of the extensions' fields) into the layout of `shape`,
        padding what it does not fill, and start the copy to the device."""
        flat = self.host_flats[self.turn]
        self.turn ^= 1
        host = {name: view.numpy() for name, view in self.views(shape, flat).items()}
        num_decodes = step.num_decodes
        # a sampling row's token index in the layout of `shape` (the prefill part starts at d)
        sample_indices = [i if i < num_decodes else i - num_decodes + shape.decodes
                          for i in step.sample_indices]
        values = vars(step) | (extra_values or {}) | {"sample_indices": sample_indices}
        for name, (per, pad) in self.fields.items():
            if name not in values:  # an extension's field it left out this step: all padding
                host[name][:] = pad
            elif per == "row":
                place_rows(host[name], values[name], pad)
            else:
                place(host[name], values[name], num_decodes, shape.decodes, pad)
        # the chunks' query offsets, counted from the prefill part's start; padded chunks are
        # empty: their offsets repeat the last live one
        chunk_offsets = [offset - num_decodes for offset in step.cu_seqlens_q[num_decodes:]]
        place_rows(host["cu_seqlens_q"], chunk_offsets, pad=chunk_offsets[-1])
        tables = host["block_tables"]
        tables[:] = -1  # past each table, and the padded sequences' (never read)
        decode_tables = step.block_tables[:num_decodes]
        chunk_tables = step.block_tables[num_decodes:]
        for part, start in ((decode_tables, 0), (chunk_tables, shape.decodes)):
            if part:
                tables[start:start + len(part), :len(part[0])] = part
        end = self.layout(shape)["block_tables"].stop
        self.device_flat[:end].copy_(flat[:end], non_blocking=True)


def place_rows(view, values: list, pad):
    """values at the start of `view`, padding after them."""
    view[:] = pad
    view[:len(values)] = values


def place(view, values: list, num_decodes: int, decode_bucket: int, pad):
    """A token's or a sequence's field: the decode part of `values` (its first num_decodes) at 0,
    the prefill part at decode_bucket, padding after each."""
    view[:] = pad
    view[:num_decodes] = values[:num_decodes]
    view[decode_bucket:decode_bucket + len(values) - num_decodes] = values[num_decodes:]


def resolve_placeholders(ids: torch.Tensor, last_sampled: torch.Tensor) -> torch.Tensor:
    """`ids` with each placeholder -1 - r replaced by `last_sampled[r]`, the id the last step
    sampled in its row r (on the device: the forward's first op)."""
    return torch.where(ids >= 0, ids, last_sampled[(-1 - ids).clamp(min=0)])
