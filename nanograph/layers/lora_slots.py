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
- on CUDA by the BGMV kernels (kernels/bgmv.py): each row gathers its own slot's weights;
  capturable, so each (batch, rank) bucket has its own graph (cuda_graph.py). Where the product
  is one of gemv.py's (up to 16 rows, `lora_inputs`) that kernel adds the delta after a shrink
  kernel (before the activation it applies to [gate | up]); after a cuBLAS product
  (`linear_with_lora`) the expand kernel adds it, in line.
- otherwise (larger prefills, the CPU) in plain torch, every slot over all rows, each row keeping
  its own slot's delta (no host sync, no index lists): the oracle.

Folds: half the shrinks, and the norms stay deferred. At a few rows a decode step is a chain of
dependent kernels, each costing about a microsecond of latency, and four shrinks per layer made a
LoRA step 1.3x the base step. But the QKV and gate/up projections take `norm(v)`, where v = the
output of the projection before them (down of the layer before, O) + the residual stream r, and
that output is linear in its input x: v = (W + B A) x + r, with the producer's own delta. So the
consumer's h = A_c norm(v) = rstd(v) * A' v with A' = A_c diag(norm weight), and
A' v = [A' (W + B A) | A'] [x | r]: a matrix [parts, R, in + hidden] per slot, computed when the
adapter is loaded, that the *producer's* shrink multiplies along with its own A (same input x,
plus r). Its h goes to the consumer through the step metadata (`lora_fold`), and the consumer's
GEMV, which computes rstd(v) for the deferred norm anyway, applies it. Two shrinks per layer
(O's and down's) instead of four, and no norm computed twice. The first layer's QKV (its input
is the embedding), a producer with a bias (A' b would be missing) and tensor parallelism (the
producer's x W^T is a partial sum per rank) have no fold: in a LoRA step their norms run as a
kernel and their consumers shrink the normed x. The cost: each producer's slot buffer grows by
the fold (bf16, max_loras 4, max_lora_rank 64: 273 MiB more on Qwen3-0.6B, 1.24 GiB on
Qwen3-8B), and each adapter load does two matmuls per fold. Measured: docs/performance.md,
"Multi-LoRA"; the side-stream shrink and other attempts: docs/experiments.md.
"""
import torch

from nanograph.layers.norm import DeferredNorm
from nanograph.adapter import Adapter, adapter_weights
from nanograph.utils.context import get_step_metadata

RANK_BUCKETS = (8, 16, 32, 64)


def rank_buckets(max_rank) -> list[int]:
    return [b for b in RANK_BUCKETS if b < max_rank] + [max_rank]


def lora_targets(model):
    return [m for m in model.modules() if hasattr(m, "load_lora")]


def add_lora_buffers(model, max_loras, max_rank):
    """The slots of every target layer; a producer's lora_a also has room for its fold, after its
    own parts."""
    folds = {producer: [consumer] for producer, consumer, _ in model.lora_folds()}
    for layer in lora_targets(model):
        # a producer's A: its own parts, then its consumer's (whose inputs follow its own)
        modules = [layer, *folds.get(layer, [])]
        parts = sum(len(m.part_starts) for m in modules)
        width = sum(m.weight.shape[1] for m in modules)
        layer.lora_a = layer.weight.new_zeros(max_loras, parts, max_rank, width)
        layer.lora_b = layer.weight.new_zeros(max_loras, layer.weight.shape[0], max_rank)


@torch.no_grad()
def load_adapter(model, slot: int, adapter: Adapter):
    for layer in lora_targets(model):
        layer.lora_a[slot], layer.lora_b[slot] = 0, 0
    for path, a, b in adapter_weights(adapter):
        parent, _, name = path.rpartition(".")
        fused, shard_id = model.packed_modules.get(name, (name, None))
        layer = model.get_submodule(f"{parent}.{fused}")
        layer.load_lora(slot, shard_id, a, b)  # (cast to the slots' dtype as they are copied in)
    # [A' (W + B A) | A'], A' = A diag(norm weight)
    for producer, consumer, norm in model.lora_folds():
        k, a, b = producer.weight.shape[1], producer.lora_a[slot, 0].float(), \
            producer.lora_b[slot].float()
        folded = consumer.lora_a[slot].float() * norm.weight.float()  # [parts, R, hidden]
        producer.lora_a[slot, 1:] = torch.cat([folded @ (producer.weight.float() + b @ a[:, :k]),
                                               folded], -1)


def lora_active(layer):
    """Whether `layer` adds LoRA deltas this step: it is a target, and the step has adapters."""
    return getattr(layer, "lora_a", None) is not None and get_step_metadata().lora_rank > 0


def lora_inputs(x: torch.Tensor | DeferredNorm, layer, residual=None):
    """CUDA: the first half of each row's delta, h = x A^T of the row's adapter (kernels/bgmv.py's
    shrink), with what the second half needs: (h, lora_b, slots, part_starts). None when `layer`
    (None: not a LoRA target) adds no delta this step. On the GEMV path (`residual` given) a
    producer's shrink also makes its consumer's folded h, which the consumer then takes, its
    input being a DeferredNorm."""
    if not lora_active(layer):
        return None
    from nanograph.kernels.bgmv import lora_shrink
    md, own = get_step_metadata(), len(layer.part_starts)
    if isinstance(x, DeferredNorm):  # deferred only after a fold (models/decoder.py)
        h, md.lora_fold = md.lora_fold, None
    else:
        fold = residual is not None and layer.lora_a.shape[1] > own
        a = layer.lora_a if fold else layer.lora_a[:, :own, :, :x.shape[1]]
        h = lora_shrink(x, a, md.lora_slots, md.lora_rank, residual if fold else None)
        md.lora_fold = h[:, own:] if fold else None
    return h[:, :own], layer.lora_b, md.lora_slots, layer.part_starts


def linear_with_lora(layer, x, bias):
    """x W^T + bias (cuBLAS) with `layer`'s weight W, plus the LoRA delta of each row's adapter
    when `layer` is a LoRA target: on CUDA in decode (above gemv.py's 16 rows) the shrink kernel
    and, after the product, the expand."""
    y = torch.nn.functional.linear(x, layer.weight, bias)
    if not lora_active(layer):
        return y
    md = get_step_metadata()
    if x.is_cuda and md.prefill is None:
        from nanograph.kernels.bgmv import lora_expand
        lora_expand(y, *lora_inputs(x, layer))
        return y
    parts = list(zip(layer.part_starts, layer.part_starts[1:] + (y.shape[1],)))
    # every slot over every row: each row keeps only its own slot's delta
    for slot in range(layer.lora_a.shape[0]):
        # h: [rows, parts, rank] (a producer's buffers also hold a fold: its own parts and
        # columns only)
        h = torch.einsum("tk,prk->tpr", x,
                         layer.lora_a[slot, :len(parts), :md.lora_rank, :x.shape[1]])
        delta = torch.cat([h[:, p] @ layer.lora_b[slot, s:e, :md.lora_rank].T
                           for p, (s, e) in enumerate(parts)], 1)
        y += delta * (md.lora_slots == slot)[:, None]
    return y
