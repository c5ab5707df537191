"""Linear layers, fused: one product for the projections that read the same input.

Q, K and V all read the normed hidden state, and so do the MLP's gate and up. Each group runs as
one product over its weights stacked by rows, W = [W_q | W_k | W_v] or [W_gate | W_up]: one GEMM
instead of three or two, whose output holds the parts side by side ([tokens, q | k | v]).
`part_sizes` lists the parts' output features, `part_starts` where each starts; a layer of one
part is a plain linear layer (O, down, the LM head).

The checkpoint stores the parts apart (q_proj, k_proj, v_proj), so each parameter carries a
`weight_loader(param, loaded, part)` that copies one part's tensor into its rows; utils/loader.py
calls it. The weights are allocated, never initialised: the loader fills them. Tensor
parallelism cuts these layers from outside, once they are loaded (engine/tp.py).
"""
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T + b, W [sum(part_sizes), in_features]."""

    def __init__(self, in_features: int, part_sizes: list[int], bias=False):
        super().__init__()
        self.part_sizes = part_sizes
        self.weight = nn.Parameter(torch.empty(sum(part_sizes), in_features))
        self.bias = nn.Parameter(torch.empty(sum(part_sizes))) if bias else None
        for param in self.parameters():
            param.weight_loader = self.weight_loader

    @property
    def part_starts(self) -> tuple[int, ...]:
        return (0, *accumulate(self.part_sizes[:-1]))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, part: int):
        """Part `part` of the weight (or bias): its rows, from its own checkpoint tensor."""
        start = self.part_starts[part]
        param.data[start:start + self.part_sizes[part]].copy_(loaded)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)
