"""Linear layers that shard themselves for tensor parallelism (Megatron style).

With `tp` ranks, a transformer block needs only two all-reduces:
- column-parallel layers (QKV, gate/up) split their *output* features: each rank computes its
  own heads / its own slice of the MLP, no communication;
- row-parallel layers (attention output, down) split their *input* features: each rank holds a
  partial sum of the full output, and one all-reduce adds them up.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id)` that cuts this rank's
slice out of the full checkpoint tensor, so the loader never needs to know the sharding.
With tp=1 every class degenerates into a plain nn.Linear.

With `enable_lora` each layer also adds its rows' LoRA deltas (layers/lora_slots.py); `load_lora`
cuts this rank's share of an adapter the way `weight_loader` does for the weight.

On CUDA, products of up to 16 rows (decode at small batch) go to kernels/gemv.py, which streams
the weights inside the PDL chain and can apply a deferred RMSNorm to its input (layers/norm.py);
larger ones go to cuBLAS. gemv.py has two kernels. The GEMV reduces each row on CUDA cores, at
least one FMA per weight and row, and holds whole rows (next_pow2(K) elements) in registers: the
fastest at one row, and at two where the model's widest input K is at most 4,096
(`gemv_max_rows`). The tensor-core kernel makes the extra rows almost free and takes the rest,
up to 16 rows. Where the rules come from: docs/experiments.md ("GEMV and tensor-core products").
"""
import torch
import torch.distributed as dist
from torch import nn

from nanograph.layers.lora_slots import linear_with_lora, lora_inputs
from nanograph.layers.norm import DeferredNorm


def gemv_max_rows(widest_input: int):
    """Up to how many rows the CUDA-core GEMV runs a model whose widest product input is
    `widest_input` (the tensor-core kernel takes the rest up to 16): see the docstring above."""
    return 2 if widest_input <= 4096 else 1


def use_gemv(x: torch.Tensor | DeferredNorm):
    """gemv.py's kernels, not cuBLAS. A DeferredNorm is only ever made for them (models/decoder.py
    decides)."""
    return isinstance(x, DeferredNorm) or (x.is_cuda and x.shape[0] <= 16)


def linear(layer, x: torch.Tensor | DeferredNorm, bias=None, silu_and_mul=False,
           residual=None):
    """x W^T + bias with `layer`'s weight W, plus each row's LoRA delta when `layer` is a LoRA
    target (layers/lora_slots.py). gemv.py's kernels also take a DeferredNorm as x and can apply
    the MLP's activation to a [gate | up] product (the cuBLAS path leaves that to the caller);
    they add the delta themselves. Up to `layer.gemv_rows` rows (the model's `gemv_max_rows`)
    they run the CUDA-core GEMV."""
    if not use_gemv(x):
        return linear_with_lora(layer, x, bias)
    from nanograph.kernels.gemv import gemv
    lora = lora_inputs(x, layer, residual)
    norm = x if isinstance(x, DeferredNorm) else DeferredNorm(x)  # (a plain x: no norm)
    return gemv(norm.x, layer.weight, bias, silu_and_mul, norm.weight, norm.eps, norm.residual,
                norm.residual_out, lora, tensor_cores=norm.x.shape[0] > layer.gemv_rows)


def parameter(data, weight_loader):
    """A parameter that carries the `weight_loader` cutting this rank's share out of a checkpoint
    tensor."""
    param = nn.Parameter(data)
    param.weight_loader = weight_loader
    return param


def tp_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size():
    return dist.get_world_size() if dist.is_initialized() else 1


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's rows (output features) split across ranks; output stays sharded."""
    lora_a = lora_b = None  # with enable_lora: the adapter slots (layers/lora_slots.py)
    gemv_rows = 2           # the model's gemv_max_rows (models/decoder.py sets it)
    part_starts = (0,)      # where each fused part's outputs start on this rank

    def __init__(self, in_features: int, out_features: int, bias=False):
        super().__init__()
        assert out_features % tp_size() == 0, \
            f"{out_features} output features don't split over {tp_size()} ranks"
        rows = out_features // tp_size()
        self.weight = parameter(torch.empty(rows, in_features), self.weight_loader)
        self.bias = parameter(torch.empty(rows), self.weight_loader) if bias else None

    def shard_range(self, shard_id):
        """(offset in the local param, rows to take, first row in the checkpoint tensor)."""
        rows = self.weight.shape[0]
        return 0, rows, tp_rank() * rows

    def weight_loader(self, param, loaded, shard_id=None):
        offset, rows, start = self.shard_range(shard_id)
        param.data[offset:offset + rows].copy_(loaded[start:start + rows])

    def load_lora(self, slot: int, shard_id, a, b):
        """All of A (every rank sees the whole input), this rank's rows of B, as for the weight."""
        offset, rows, start = self.shard_range(shard_id)
        self.lora_a[slot, self.part_starts.index(offset), :a.shape[0]] = a
        self.lora_b[slot, offset:offset + rows, :b.shape[1]] = b[start:start + rows]

    def forward(self, x, silu_and_mul=False):
        return linear(self, x, self.bias, silu_and_mul)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one GEMM, e.g. [gate | up] of the MLP.
    Each rank stores [gate_r | up_r], its slice of every part."""

    def __init__(self, in_features: int, output_sizes: list[int], bias=False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)
        self.part_starts = tuple(sum(output_sizes[:i]) // tp_size()
                                 for i in range(len(output_sizes)))

    def shard_range(self, shard_id: int):
        rows = self.output_sizes[shard_id] // tp_size()
        return self.part_starts[shard_id], rows, tp_rank() * rows


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q, K, V projection. Query heads split evenly; KV heads split too, or are replicated
    when there are fewer KV heads than ranks (each rank then keeps the one its queries use)."""

    def __init__(self, hidden: int, head_dim: int, num_heads, num_kv_heads,
                 bias=False):
        tp = tp_size()
        assert num_heads % tp == 0, f"{num_heads} attention heads don't split over {tp} ranks"
        assert num_kv_heads % tp == 0 or tp % num_kv_heads == 0, \
            f"{num_kv_heads} KV heads vs {tp} ranks"
        self.head_dim = head_dim
        self.total_kv_heads = num_kv_heads
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        super().__init__(hidden, (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp, bias)
        q = self.num_heads * head_dim
        kv = self.num_kv_heads * head_dim
        self.part_starts = (0, q, q + kv)

    def shard_range(self, shard_id: str):
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            return 0, q, tp_rank() * q
        # Rank r's query heads map to KV heads from r * total_kv_heads // tp on, in both the
        # split and the replicated case.
        start = tp_rank() * self.total_kv_heads // tp_size() * self.head_dim
        return (q if shard_id == "k" else q + kv), kv, start


class RowParallelLinear(nn.Module):
    """y = x W^T with W's columns (input features) split: each rank's product is a partial sum,
    all-reduced. The bias is added once, after the sum."""
    lora_a = lora_b = None
    gemv_rows = 2
    part_starts = (0,)

    def __init__(self, in_features: int, out_features: int, bias=False):
        super().__init__()
        assert in_features % tp_size() == 0, \
            f"{in_features} input features don't split over {tp_size()} ranks"
        self.weight = parameter(torch.empty(out_features, in_features // tp_size()),
                                self.weight_loader)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None  # whole on every rank

    def weight_loader(self, param, loaded, shard_id=None):
        param.data.copy_(loaded.tensor_split(tp_size(), dim=1)[tp_rank()])

    def load_lora(self, slot: int, shard_id, a, b):
        """This rank's columns of A (its share of the input), all of B: the delta is a partial sum
        too."""
        self.lora_a[slot, 0, :a.shape[0], :self.weight.shape[1]] = \
            a.tensor_split(tp_size(), dim=1)[tp_rank()]
        self.lora_b[slot, :, :b.shape[1]] = b

    def forward(self, x, residual=None):
        """residual: the stream the next norm adds to y, for a LoRA fold (layers/lora_slots.py)."""
        y = linear(self, x, residual=residual)
        if tp_size() > 1:
            dist.all_reduce(y)
        return y if self.bias is None else y + self.bias
