"""Linear layers that shard themselves for tensor parallelism (Megatron style).

With `tp` ranks, a transformer block needs only two all-reduces:
- column-parallel layers (QKV, gate/up) split their *output* features: each rank computes its
  own heads / its own slice of the MLP, no communication;
- row-parallel layers (attention output, down) split their *input* features: each rank holds a
  partial sum of the full output, and one all-reduce (`reduce`) adds them up.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id)` that cuts this rank's
slice out of the full checkpoint tensor, so the loader never needs to know the sharding.
A fused layer (QKV, gate/up) also says where each of its parts starts on this rank
(`part_starts`). With tp=1 every class degenerates into a plain nn.Linear.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


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
    """y = x W^T + b with W's rows (output features) split across ranks; output stays sharded."""
    part_starts = (0,)  # where each fused part's outputs start on this rank

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

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


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
    """y = x W^T + b with W's columns (input features) split: each rank's product is a partial
    sum, all-reduced. The bias is added once, after the sum."""
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

    def forward(self, x):
        return self.reduce(F.linear(x, self.weight))

    def reduce(self, partial: torch.Tensor):
        """The ranks' partial products summed (in place), then the bias."""
        if tp_size() > 1:
            dist.all_reduce(partial)
        return partial if self.bias is None else partial + self.bias
