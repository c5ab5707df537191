"""Token embedding and LM head.

The embedding is row `id` of its weight [vocab, hidden] for each token id; the LM head is a
linear layer [vocab, hidden] (layers/linear.py) giving each row's logits. A tied LM head shares
the embedding's weight tensor. Tensor parallelism splits both over the vocabulary, from outside
(engine/tp.py).
"""
import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))  # filled by the loader

    def forward(self, ids):
        return F.embedding(ids, self.weight)
