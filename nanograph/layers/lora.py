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
- on CUDA by the BGMV kernels (kernels/lora.py): each row gathers its own slot's weights;
  capturable, so each (batch, rank) bucket has its own graph (cuda_graph.py). Where the product
  is the few-row GEMV (`lora_inputs`) the GEMV adds the delta itself after the shrink kernel, so
  LoRA keeps the deferred norms (and, at one row, the activation fused into the [gate | up]
  GEMV: kernels/gemv.py says why not at more); after a cuBLAS product (`add_lora`) the expand
  kernel adds it;
- otherwise (larger prefills, the CPU) in plain torch, every slot over all rows, each row keeping
  its own slot's delta (no host sync, no index lists): the oracle.
"""
import torch

from nanograph.layers.norm import DeferredNorm
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


def lora_inputs(x: torch.Tensor | DeferredNorm, layer) -> tuple | None:
    """CUDA: the first half of each row's delta, h = x A^T of the row's adapter (kernels/lora.py's
    shrink, which also applies a deferred norm), with what the second half needs:
    (h, lora_b, slots, part_starts). None when `layer` (None: not a LoRA target) adds no delta this step."""
    if getattr(layer, "lora_a", None) is None or get_step_metadata().lora_rank == 0:
        return None
    from nanograph.kernels.lora import lora_shrink
    md, x = get_step_metadata(), x if isinstance(x, DeferredNorm) else DeferredNorm(x)
    h = lora_shrink(x.x, layer.lora_a, md.lora_slots, md.lora_rank, x.weight, x.eps, x.residual)
    return h, layer.lora_b, md.lora_slots, layer.part_starts


def add_lora(x: torch.Tensor, y: torch.Tensor, layer) -> torch.Tensor:
    """y (= x W^T of `layer`, None: not a LoRA target) plus the LoRA delta of each row's adapter, in place."""
    if getattr(layer, "lora_a", None) is None or get_step_metadata().lora_rank == 0:
        return y
    md = get_step_metadata()
    if y.is_cuda and not md.is_prefill:
        from nanograph.kernels.lora import lora_expand
        lora_expand(y, *lora_inputs(x, layer))
        return y
    parts = list(zip(layer.part_starts, layer.part_starts[1:] + (y.shape[1],)))
    for slot in range(layer.lora_a.shape[0]):  # every slot over every row: each row keeps only its own slot's delta
        h = torch.einsum("tk,prk->tpr", x, layer.lora_a[slot, :, :md.lora_rank])  # [rows, parts, rank]
        delta = torch.cat([h[:, p] @ layer.lora_b[slot, s:e, :md.lora_rank].T for p, (s, e) in enumerate(parts)], 1)
        y += delta * (md.lora_slots == slot)[:, None]
    return y
