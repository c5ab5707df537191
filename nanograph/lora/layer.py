"""Multi-LoRA in the linear layers: the wrapper that adds each row's delta, and adapter loads.

`LoRALinear` wraps one of the model's linear layers (QKV, O, gate/up, down: installed by
runner.py, by swapping modules) and holds two buffers with `max_loras` adapters side by side,
the *slots* (R = max_lora_rank):
- `lora_a [slots, parts, R, in]`: the A of each part of a fused layer (q, k, v; gate, up),
  its rank zero-padded to R;
- `lora_b [slots, out, R]`: each output feature's row of the B of the part it belongs to, with
  the adapter's scaling folded in.
A part the adapter does not target stays zero and adds nothing. Loading an adapter into a slot
zeroes the slot, then copies each part in; under tensor parallelism the base layer cuts this
rank's share as it cut its weight (engine/tp.py): a column-parallel layer keeps all of A and its
rows of B (`shard_rows`); a row-parallel layer keeps its columns of A (`shard_columns`) and all
of B, so its delta is a partial sum that the layer's all-reduce (`reduce`) completes.

Each row of a step names its slot (-1: the base model), and the step's rank is a rank bucket
(slots.py); all LoRA layers read them from one `StepAdapters`, bound by the runner before each
forward. A step without adapters has rank 0: the wrapper is then the base layer. The delta
`y += (x A^T) B^T` of each row is computed
- on CUDA by the BGMV kernels (kernels/bgmv.py), decode rows and prefill chunks alike: each
  row gathers its own slot's weights; capturable, so each (batch, rank) bucket has its own
  graph. The shrink makes h = x A^T, the expand adds B h to the product in place. The batch-1
  chain (fast/) calls the shrink itself and hands h to its GEMV, which adds the delta
  (`shrink`, `gemv_lora`);
- on the CPU in plain torch, every slot over all rows, each row keeping its own slot's delta
  (no host sync, no index lists): the oracle.

Folds: half the shrinks, and the norms stay deferred. On the batch-1 chain a decode step is a
chain of dependent kernels, each costing about a microsecond of latency, and four shrinks per
layer made a LoRA step 1.3x the base step. But the QKV and gate/up projections take `norm(v)`,
where v = the output of the projection before them (down of the layer before, O) + the residual
stream r, and that output is linear in its input x: v = (W + B A) x + r, with the producer's own
delta. So the consumer's h = A_c norm(v) = rstd(v) * A' v with A' = A_c diag(norm weight), and
A' v = [A' (W + B A) | A'] [x | r]: a matrix [parts, R, in + hidden] per slot, computed when the
adapter is loaded, that the *producer's* shrink multiplies along with its own A (same input x,
plus r). The chain hands its h to the consumer's GEMV, which computes rstd(v) for the deferred
norm anyway and applies it. Two shrinks per layer (O's and down's) instead of four, and no
norm computed twice. The first layer's QKV (its input is the embedding), a producer with a bias
(A' b would be missing) and tensor parallelism (the producer's x W^T is a partial sum per rank)
have no fold: in a LoRA step their norms run as a kernel and their consumers shrink the normed
x. The cost: each producer's slot buffer grows by the fold (docs/performance.md, "Multi-LoRA"),
and each adapter load does two matmuls per fold.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanograph.layers.linear import Linear
from nanograph.lora.adapter import Adapter, adapter_weights

PREFILL_ROWS = 16  # rows a BGMV program takes in a step with prefill chunks (kernels/bgmv.py)


@dataclass
class StepAdapters:
    """The current step's adapters, as every LoRA layer reads them (runner.py binds them)."""
    slots: torch.Tensor | None = None  # [tokens] int32: each token's adapter slot, -1 = none
    rank: int = 0                      # the step's rank bucket, 0 = no adapters
    rows_per_program: int = 1          # a BGMV program's rows: PREFILL_ROWS with prefill chunks


class LoRALinear(nn.Module):
    """`base` (a linear layer) plus each row's LoRA delta. A producer of a fold (see above) holds
    its consumer's folded A after its own parts."""

    def __init__(self, base: Linear, adapters: StepAdapters, max_loras: int, max_rank: int,
                 fold_consumer: nn.Module | None = None):
        super().__init__()
        self.base = base
        self.adapters = adapters
        # a row-parallel layer (engine/tp.py): its product is a partial sum, all-reduced by
        # `reduce`, which then adds the bias; the delta goes in before
        self.row_parallel = hasattr(base, "reduce")
        if self.row_parallel:
            self.reduce = base.reduce
        self.part_starts = base.part_starts
        folded = [] if fold_consumer is None else [fold_consumer]
        parts = sum(len(m.part_starts) for m in [base, *folded])
        width = sum(m.weight.shape[1] for m in [base, *folded])
        self.lora_a = base.weight.new_zeros(max_loras, parts, max_rank, width)
        self.lora_b = base.weight.new_zeros(max_loras, base.weight.shape[0], max_rank)

    @property
    def weight(self):
        return self.base.weight

    @property
    def bias(self):
        return self.base.bias

    def forward(self, x):
        y = F.linear(x, self.weight, None if self.row_parallel else self.bias)
        if self.adapters.rank:
            self.add_delta(x, y)
        return self.reduce(y) if self.row_parallel else y

    def add_delta(self, x, y):
        """y += each row's delta, in place."""
        if x.is_cuda:
            from nanograph.kernels.bgmv import lora_expand
            h, _ = self.shrink(x)
            lora_expand(y, *self.gemv_lora(h), self.adapters.rows_per_program)
            return
        rank, slots = self.adapters.rank, self.adapters.slots
        own_parts = len(self.part_starts)
        part_ends = self.part_starts[1:] + (y.shape[1],)
        # every slot over every row: each row keeps only its own slot's delta
        for slot in range(self.lora_a.shape[0]):
            a = self.lora_a[slot, :own_parts, :rank, :x.shape[1]]  # (not a fold's parts)
            h = torch.einsum("tk,prk->tpr", x, a)  # [rows, parts, rank]
            delta = torch.cat([h[:, part] @ self.lora_b[slot, start:end, :rank].T
                               for part, (start, end) in enumerate(zip(self.part_starts,
                                                                       part_ends))], 1)
            y += delta * (slots == slot)[:, None]

    def shrink(self, x, residual=None):
        """CUDA: h = x A^T of each row's adapter [rows, parts, rank] (kernels/bgmv.py), and with
        `residual` given, a producer's folded h for its consumer too: (own h, folded h or
        None)."""
        from nanograph.kernels.bgmv import lora_shrink
        own_parts = len(self.part_starts)
        fold = residual is not None and self.lora_a.shape[1] > own_parts
        a = self.lora_a if fold else self.lora_a[:, :own_parts, :, :x.shape[1]]
        h = lora_shrink(x, a, self.adapters.slots, self.adapters.rank,
                        residual if fold else None, self.adapters.rows_per_program)
        return h[:, :own_parts], (h[:, own_parts:] if fold else None)

    def gemv_lora(self, h):
        """What kernels/gemv.py (and bgmv's expand) take to add the delta B h."""
        return h, self.lora_b, self.adapters.slots, self.part_starts

    def load(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor):
        """One part's A [r, in] and B [out, r] into `slot`: this rank's share, as for the weight."""
        if hasattr(self.base, "shard_columns"):  # row-parallel: its columns of A, all of B
            a = self.base.shard_columns(a)
        if hasattr(self.base, "shard_rows"):  # column-parallel: all of A, its rows of B
            b = self.base.shard_rows(b, part)
        start = self.part_starts[part]
        self.lora_a[slot, part, :a.shape[0], :a.shape[1]] = a
        self.lora_b[slot, start:start + b.shape[0], :b.shape[1]] = b


def fold_triples(model) -> list[tuple[nn.Module, nn.Module, nn.Module]]:
    """(producer, consumer, norm) of every fold: the consumer's input is norm(the producer's
    output + the residual stream). Only for a producer without bias whose output is whole: a
    row-parallel producer's (engine/tp.py) is a partial sum."""
    layers = model.model.layers
    triples = [(layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.post_attention_layernorm)
               for layer in layers]
    triples += [(before.mlp.down_proj, after.self_attn.qkv_proj, after.input_layernorm)
                for before, after in zip(layers, layers[1:])]
    return [(producer, consumer, norm) for producer, consumer, norm in triples
            if producer.bias is None and not hasattr(producer, "reduce")]


@torch.no_grad()
def load_adapter(model, slot: int, adapter: Adapter, folds):
    """Read `adapter` from disk into `slot` of every LoRA layer, and make its folds."""
    for layer in model.modules():
        if isinstance(layer, LoRALinear):
            layer.lora_a[slot], layer.lora_b[slot] = 0, 0
    for path, a, b in adapter_weights(adapter):
        parent, _, name = path.rpartition(".")
        fused, part = model.packed_modules.get(name, (name, 0))
        layer = model.get_submodule(f"{parent}.{fused}")
        layer.load(slot, part, a, b)  # (cast to the slots' dtype as they are copied in)
    # [A' (W + B A) | A'], A' = A diag(norm weight)
    for producer, consumer, norm in folds:
        in_features = producer.weight.shape[1]
        a = producer.lora_a[slot, 0].float()
        b = producer.lora_b[slot].float()
        folded = consumer.lora_a[slot].float() * norm.weight.float()  # [parts, R, hidden]
        producer_matrix = producer.weight.float() + b @ a[:, :in_features]
        producer.lora_a[slot, 1:] = torch.cat([folded @ producer_matrix, folded], -1)
