"""Per-step metadata, set by the ModelRunner before each forward pass.

The decoder layers are ordinary nn.Modules whose forward takes only hidden states and positions,
exactly like a training model. Everything attention needs to find the paged KV cache (which
slot each new token writes to, which blocks each sequence owns, how long each context is), and
which LoRA adapter each token uses, changes every step, so the runner publishes it here and the
Attention and linear layers read it. One global is the simplest honest way to do this: one
forward pass runs at a time, and it keeps the model code free of plumbing.

Under CUDA graphs the tensors in here are the graph runner's *static buffers*, so a replay sees
whatever the runner copied into them just before; the plain ints (the LoRA rank) are fixed per
graph.
"""
from dataclasses import dataclass

import torch


@dataclass
class StepMetadata:
    num_decodes: int                  # tokens (and sequences) [0, num_decodes) decode, one each
    slot_mapping: torch.Tensor        # [num_tokens] cache slot of each new token, -1 = write nothing
    context_lens: torch.Tensor        # [num_seqs] keys each sequence attends to (cached + new)
    block_tables: torch.Tensor        # [num_seqs, max_blocks] int32, -1 past the last block
    # the prefill part (the chunks after the decode rows), when there is one
    cu_seqlens_q: torch.Tensor | None = None    # [chunks + 1] offsets within the prefill part
    max_seqlen_q: int = 0                       # a bound on a chunk's length (a graph's: static)
    lora_rank: int = 0                          # rank bucket of the step's adapters, 0 = no LoRA
    lora_slots: torch.Tensor | None = None      # [num_tokens] int32 adapter slot of each token
    lora_fold: torch.Tensor | None = None       # a producer's folded h for the next LoRA layer

    @property
    def is_decode(self) -> bool:
        """Every token decodes (no prefill part)."""
        return self.num_decodes == len(self.slot_mapping)


_metadata: StepMetadata | None = None


def set_step_metadata(metadata: StepMetadata | None) -> None:
    global _metadata
    _metadata = metadata


def get_step_metadata() -> StepMetadata:
    assert _metadata is not None, "forward called outside ModelRunner (no step metadata set)"
    return _metadata
