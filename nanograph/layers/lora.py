"""Multi-LoRA in the linear layers: adapter slots, and the delta each row adds.

With `enable_lora`, every linear layer an adapter may target (QKV, O, gate/up, down) gets two
buffers that hold `max_loras` adapters side by side, the *slots* (R = max_lora_rank):
- `lora_a [slots, parts, R, in]`: the A of each part of a fused layer (q, k, v; gate, up),
  its rank zero-padded to R;
- `lora_b [slots, out, R]`: each output feature's row of the B of the part it belongs to, with
  the adapter's scaling folded in.
A part the adapter does not target stays zero and adds nothing. Loading an adapter into a slot
zeroes the slot, then lets each layer cut its own tensor-parallel share, as for its weight:
a column-parallel layer keeps all of A and its rows of B; a row-parallel layer keeps its columns
of A and all of B, so its delta is a partial sum that the layer's all-reduce completes.

Each row of a step names its slot (-1: the base model), and the step's rank is the smallest
rank bucket that holds all its adapters; a step without adapters has rank 0: no LoRA work at
all. The delta `y += (x A^T) B^T` of each row is computed
- in decode on CUDA by the BGMV kernel (kernels/lora.py): each row gathers its own slot's
  weights; capturable, so each (batch, rank) bucket has its own graph (cuda_graph.py);
- otherwise (prefill, the CPU) in plain torch, per slot, over the rows that use it: the oracle.
"""
import torch

from nanograph.lora import Adapter, adapter_weights
from nanograph.utils.context import get_step_metadata

RANK_BUCKETS = (8, 16, 32, 64)


def rank_buckets(max_rank: int) -> list[int]:
    return [b for b in RANK_BUCKETS if b < max_rank] + [max_rank]


def lora_targets(model) -> list:
    return [m for m in model.modules() if hasattr(m, "load_lora")]


def add_lora_buffers(model, max_loras: int, max_rank: int) -> None:
    for layer in lora_targets(model):
        out, inp = layer.weight.shape
        layer.lora_a = layer.weight.new_zeros(max_loras, len(layer.part_starts), max_rank, inp)
        layer.lora_b = layer.weight.new_zeros(max_loras, out, max_rank)


@torch.no_grad()
def load_adapter(model, slot: int, adapter: Adapter) -> None:
    for layer in lora_targets(model):
        layer.lora_a[slot], layer.lora_b[slot] = 0, 0
    for i, name, a, b in adapter_weights(adapter):
        fused, shard_id = model.packed_modules.get(name, (name, None))
        block = model.model.layers[i]
        layer = getattr(block.self_attn if hasattr(block.self_attn, fused) else block.mlp, fused)
        layer.load_lora(slot, shard_id, a.to(layer.weight.dtype), b.to(layer.weight.dtype))


def add_lora(x: torch.Tensor, y: torch.Tensor, layer) -> torch.Tensor:
    """y (= x W^T of `layer`) plus the LoRA delta of each row's adapter, in place."""
    md = get_step_metadata()
    if layer.lora_a is None or md.lora_rank == 0:
        return y
    rank = md.lora_rank
    if y.is_cuda and not md.is_prefill:
        from nanograph.kernels.lora import lora_bgmv
        lora_bgmv(x, y, layer.lora_a, layer.lora_b, md.lora_slots, layer.part_starts, rank)
        return y
    parts = list(zip(layer.part_starts, layer.part_starts[1:] + (y.shape[1],)))
    for slot, rows in md.lora_rows:
        h = torch.einsum("tk,prk->tpr", x[rows], layer.lora_a[slot, :, :rank])  # [rows, parts, rank]
        delta = torch.cat([h[:, p] @ layer.lora_b[slot, start:end, :rank].T for p, (start, end) in enumerate(parts)], 1)
        y.index_put_((rows,), delta, accumulate=True)
    return y
