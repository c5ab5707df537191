"""Where a LoRA decode step's time goes: the same step with parts of the LoRA work taken out.

    python -m tools.lora_ablation [--shape qwen3-0.6b] [--rank 16] [--batches 1,2,4]

On one bench shape (bench.py --shape; dummy bf16 weights), engines alive side by side, each with
graphs for exactly the batches and 4 random adapters of --rank round-robin over the rows:
- `base`: no LoRA at all;
- `lora`: what nanograph runs (on the batch-1 chain: two shrink kernels per layer, each also
  making the next projection's folded h, nanograph/lora/layer.py);
- `no shrink`: every LoRA layer gets a scratch h instead of launching a shrink kernel (the norms
  stay deferred, the GEMVs still add B h): the gap to `lora` is what the shrink kernels cost;
- `no delta`: the shrink kernels run but the GEMVs get no LoRA input: the gap to `lora` is what
  adding B h inside the GEMVs costs.
The last two compute wrong tokens; they exist to be timed. Prints ms per graph step (the best of
3 rounds, in turn) and the ratio to `base`. Meant for the GEMV path (batches up to the shape's
GEMV row limit, nanograph/fast/chain.py); above it the cuBLAS path's expand kernel is not taken out.
"""
import argparse
import tempfile

import torch

from benchmarks.lora import write_lora_adapters
from benchmarks.runner import decode_engine_args, decode_step, time_forward
from benchmarks.shapes import BENCH_SHAPES, write_model_dir
from nanograph import LLM
from nanograph.lora.adapter import read_adapter
from nanograph.lora.layer import LoRALinear

NUM_ADAPTERS, CONTEXT = 4, 512
scratch: dict = {}
SHRINK, GEMV_LORA = LoRALinear.shrink, LoRALinear.gemv_lora


def without_shrink(layer: LoRALinear, x, residual=None):
    """LoRALinear.shrink with a scratch h (a producer's also stands for its fold, so the next
    norm stays deferred): made in the warm-up forward before each capture, so the captured graph
    holds no kernel for it."""
    own_parts, rank = len(layer.part_starts), layer.adapters.rank
    key = (id(layer), x.shape[0], rank)
    if key not in scratch:
        scratch[key] = torch.zeros(x.shape[0], layer.lora_a.shape[1], rank, device=x.device)
    fold = residual is not None and layer.lora_a.shape[1] > own_parts
    return scratch[key][:, :own_parts], (scratch[key][:, own_parts:] if fold else None)


def build(model_dir: str, batches: list[int], rank: int, adapters: list, ablation=None):
    """A runner with graphs for `batches`, captured with `ablation` = "no shrink" / "no delta"
    patched into LoRALinear."""
    if ablation == "no shrink":
        LoRALinear.shrink = without_shrink
    if ablation == "no delta":  # the shrink runs; the GEMV gets no LoRA input
        LoRALinear.gemv_lora = lambda layer, h: None
    try:
        lora = dict(enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=rank) if adapters else {}
        llm = LLM(model_dir, load_format="dummy", dtype="bfloat16",
                  **decode_engine_args(batches, CONTEXT), **lora)
    finally:
        LoRALinear.shrink, LoRALinear.gemv_lora = SHRINK, GEMV_LORA
    for slot, request in enumerate(adapters):
        llm.lora.runner_extension.load(slot, read_adapter(request, llm.config.hf_config, rank))
    return llm.runner


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=BENCH_SHAPES, default="qwen3-0.6b")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 2, 4])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        model_dir = write_model_dir(args.shape, root)
        adapters = write_lora_adapters(model_dir, NUM_ADAPTERS, args.rank, "bfloat16", root)
        runners = {"base": build(model_dir, args.batches, args.rank, []),
                   "lora": build(model_dir, args.batches, args.rank, adapters),
                   "no shrink": build(model_dir, args.batches, args.rank, adapters, "no shrink"),
                   "no delta": build(model_dir, args.batches, args.rank, adapters, "no delta")}
    best = {}
    for _ in range(3):  # in turn, so that a drift of the clocks hits every engine alike
        for bs in args.batches:
            step = decode_step(bs, CONTEXT, runners["base"].block_size)
            slots = [i % NUM_ADAPTERS for i in range(bs)]
            lora_step = decode_step(bs, CONTEXT, runners["base"].block_size, lora_slots=slots,
                                    lora_rank=args.rank)
            for name, runner in runners.items():
                ms = time_forward(runner, step if name == "base" else lora_step, "cuda", 30) * 1e3
                best[name, bs] = min(best.get((name, bs), float("inf")), ms)
    print(f"{args.shape}, rank {args.rank}, {torch.cuda.get_device_name()}: ms per graph step (context {CONTEXT})")
    print(f"{'':18}" + "".join(f"{'batch ' + str(bs):>18}" for bs in args.batches))
    for name in runners:
        print(f"{name:18}" + "".join(f"{best[name, bs]:10.3f} {best[name, bs] / best['base', bs]:5.2f}x"
                                     for bs in args.batches))
