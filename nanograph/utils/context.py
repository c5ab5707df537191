"""Per-step metadata, set by the ModelRunner before each forward pass.

The decoder layers are ordinary nn.Modules whose forward takes only hidden states and positions,
exactly like a training model. Everything attention needs to find the paged KV cache (which
slot each new token writes to, which blocks each sequence owns, how long each context is)
changes every step, so the runner publishes it here and the Attention layers read it. One
global is the simplest honest way to do this: one forward pass runs at a time, and it keeps the
model code free of plumbing.

The tensors in here are views of the runner's static step buffers (engine/step.py), so a CUDA
graph's replay sees whatever the runner copied into them just before; the plain ints (a chunk's
length bound) are fixed per graph.
"""
from dataclasses import dataclass

import torch


@dataclass
class AttentionInputs:
    """Where one part of a step (its decode rows, or its prefill chunks) finds the paged cache."""
    slot_mapping: torch.Tensor    # [tokens] cache slot of each new token, -1 = write nothing
    context_lens: torch.Tensor    # [seqs] keys each sequence attends to (cached + new)
    block_tables: torch.Tensor    # [seqs, max_blocks] int32, -1 past the last block
    cu_seqlens_q: torch.Tensor | None = None  # prefill: [chunks + 1] query offsets
    max_seqlen_q: int = 0                     # prefill: a bound on a chunk's length (static)


@dataclass
class StepMetadata:
    num_decodes: int                        # tokens [0, num_decodes) decode, one a sequence
    slot_mapping: torch.Tensor              # [tokens] the whole step's: both parts' slots
    decode: AttentionInputs | None = None   # the decode rows, if any
    prefill: AttentionInputs | None = None  # the prefill chunks after them, if any


_metadata: StepMetadata | None = None


def set_step_metadata(metadata: StepMetadata | None):
    global _metadata
    _metadata = metadata


def get_step_metadata() -> StepMetadata:
    assert _metadata is not None, "forward called outside ModelRunner (no step metadata set)"
    return _metadata
