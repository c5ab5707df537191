"""The batch-1 decode chain: decode at a few rows as one chain of weight-streaming kernels (an
extension, installed on CUDA; docs/walkthrough.md, "The batch-1 chain").

At batch 1 a decode step reads every weight once to do 2 flops per weight: its time is the
weight bytes over DRAM bandwidth plus each kernel's start-up, and a small model's step is
hundreds of dependent kernels. chain.py runs the same textbook model (models/decoder.py) with
three changes, up to 16 tokens a step, and hands anything larger back to the textbook code:
- every product is kernels/gemv.py's: a GEMV streaming its weights inside the programmatic
  dependent launch chain (kernels/pdl.py) for one or two rows, a tensor-core kernel above;
- each RMSNorm is deferred into the product that reads its output, and [gate | up] applies
  SiLU(gate) * up itself: one dependent kernel fewer each;
- with LoRA (lora/), each product adds its rows' deltas itself, and a fold carries the next
  product's h, so the norms stay deferred in a LoRA step too (lora/layer.py).
"""
from nanograph.fast.chain import FastDecodeChain

__all__ = ["FastDecodeChain"]
