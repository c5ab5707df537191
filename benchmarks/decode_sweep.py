"""--decode-sweep: the time of one decode step by batch size, graph and eager, against its floor.

The step is `runner.run` on a hand-built decode step (runner.py): the forward, the LM head
and sampling at temperature 0.6, for one new token per sequence at a fixed context length
(`--sweep-context-len`), at batch sizes 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (dense at the small
end). One engine serves the whole sweep, with a graph captured for exactly each size, so a
replay pads nothing; the same engine without its graphs gives the eager column. Each size is
held against its floor: the bytes the step must read (every weight once, and the batch's K/V at
that context) / the copy bandwidth measured on this device.

Then batch-1 latency: ms per generated token of one sequence through `generate` (scheduling,
host work and sampling included), against the weights' floor and the graph step at batch 1.
"""
import torch

from benchmarks.harness import Setup, per_token_latency, report_leftover_memory
from benchmarks.report import cell, ms, print_table
from benchmarks.runner import decode_engine_args, decode_step, eager, time_forward
from benchmarks.timing import is_cuda, measure_copy_bandwidth


def sweep_sizes(max_bs: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ...: the powers of two and the sizes halfway between them."""
    return sorted(s for i in range(max_bs.bit_length()) for s in (1 << i, 3 << i) if s <= max_bs)


def sweep_engine(setup: Setup, sizes: list[int], **overrides):
    """One engine for a whole sweep: a graph for exactly each sweep size, and a KV cache just
    big enough for the largest batch at the sweep's context length."""
    engine_args = decode_engine_args(sizes, setup.args.sweep_context_len, is_cuda(setup.device))
    return setup.llm(**engine_args, **overrides)


def weight_read_bytes(model: torch.nn.Module, tied: bool) -> int:
    """Bytes of weights one decode token reads: every parameter once (a tied embedding is read
    once, by the LM head); an untied input embedding only contributes the one row looked up."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # shared tensors once
    emb = dict(model.named_parameters()).get("model.embed_tokens.weight")
    if not tied and emb is not None:
        total -= (emb.shape[0] - 1) * emb.shape[-1] * emb.element_size()
    return total


def kv_read_bytes_per_token(llm, tp: int) -> int:
    """Bytes of K and V one decode step reads per token of context, on one rank."""
    cfg = llm.config.hf_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = max(1, cfg.num_key_value_heads // tp)
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * llm.config.torch_dtype.itemsize


def measure_decode_sweep(llm, setup: Setup) -> dict:
    args, runner = setup.args, llm.runner
    ctx = args.sweep_context_len
    tied = bool(getattr(llm.config.hf_config, "tie_word_embeddings", False))
    weights = weight_read_bytes(runner.model, tied)
    kv_per_token = kv_read_bytes_per_token(llm, args.tp)
    bandwidth = measure_copy_bandwidth(setup.device, args.bandwidth_mib * 2**20)
    # With tensor parallelism only rank 0 would drop its graphs: time the graphs alone.
    time_eager = args.tp == 1 or runner.graphs is None
    rows = []
    for bs in sweep_sizes(args.sweep_max_bs):
        step = decode_step(bs, ctx, runner.block_size)
        graph_s = eager_s = None
        if runner.graphs is not None and runner.graphs.ladder[-1] >= bs:
            graph_s = time_forward(runner, step, setup.device, args.sweep_iters)
        if time_eager:
            with eager(runner):
                eager_s = time_forward(runner, step, setup.device, args.sweep_iters)
        floor_s = (weights + bs * ctx * kv_per_token) / bandwidth
        rows.append({"batch": bs,
                     "graph_ms": ms(graph_s),
                     "eager_ms": ms(eager_s),
                     "floor_ms": ms(floor_s),
                     "speedup": eager_s / graph_s if graph_s and eager_s else None,
                     "graph_vs_floor": graph_s / floor_s if graph_s else None})

    # batch 1: the whole per-token loop (schedule, forward, sample) against the weight-read floor
    prompt_len, new_tokens = args.latency_lengths
    latency = {}
    if runner.graphs is not None:
        latency["graphs"] = per_token_latency(llm, setup, prompt_len, new_tokens, seed=2)
    if time_eager:
        with eager(runner):
            latency["eager"] = per_token_latency(llm, setup, prompt_len, new_tokens, seed=3)
    batch1 = {"prompt_len": prompt_len, "new_tokens": new_tokens, "weight_bytes": weights,
              "kv_bytes_per_token": kv_per_token, "copy_bandwidth_Bps": bandwidth,
              "floor_ms_per_token": weights / bandwidth * 1e3,
              **{f"{k}_ms_per_token": ms(v) for k, v in latency.items()}}
    return {"context_len": ctx, "iters": args.sweep_iters, "rows": rows, "batch1": batch1}


def print_batch1(b: dict, graph_step_ms: float | None) -> None:
    floor = b["floor_ms_per_token"]
    print(f"\nBatch-1 latency (generate: schedule + forward + sample), prompt {b['prompt_len']}, "
          f"{b['new_tokens']} new tokens:")
    for name in ("graphs", "eager"):
        if f"{name}_ms_per_token" not in b:
            continue
        value = b[f"{name}_ms_per_token"]
        if value is None:
            print(f"  {name:<7} too noisy to measure")
            continue
        vs_step = ""
        if graph_step_ms and name == "graphs":
            vs_step = f", {value / graph_step_ms:.2f}x the graph step"
        print(f"  {name:<7} {value:8.3f} ms/token  {1e3 / value:10,.1f} tok/s"
              f"  ({value / floor:.2f}x the floor{vs_step})")
    print(f"  floor   {floor:8.3f} ms/token  {1e3 / floor:10,.1f} tok/s"
          f"  = {b['weight_bytes'] / 2**20:,.1f} MiB of weights"
          f" / {b['copy_bandwidth_Bps'] / 1e9:,.1f} GB/s measured copy bandwidth")


def print_decode_sweep(sweep: dict, cuda: bool) -> None:
    if not cuda:
        print("\n(CPU: no CUDA graphs, the decode sweep times the eager path only)")
    b = sweep["batch1"]
    print_table(f"One decode step (forward and sampling at temperature 0.6), context "
                f"{sweep['context_len']}, {sweep['iters']} iterations; floor = (weights + the "
                f"batch's K/V) / {b['copy_bandwidth_Bps'] / 1e9:,.1f} GB/s",
                ["batch", "graph ms", "eager ms", "speed-up", "floor ms", "graph/floor",
                 "graph tok/s"],
                [[r["batch"],
                  cell(r["graph_ms"]),
                  cell(r["eager_ms"]),
                  cell(r["speedup"], ".2f", "x"),
                  cell(r["floor_ms"]),
                  cell(r["graph_vs_floor"], ".2f", "x"),
                  cell(r["batch"] / r["graph_ms"] * 1e3 if r["graph_ms"] else None, ",.0f")]
                 for r in sweep["rows"]])
    print_batch1(b, sweep["rows"][0]["graph_ms"])


def section_decode_sweep(setup: Setup) -> dict:
    sizes = sweep_sizes(setup.args.sweep_max_bs)
    print(f"  [decode sweep] batches {sizes}, context {setup.args.sweep_context_len} ...",
          flush=True)
    with sweep_engine(setup, sizes) as llm:
        sweep = measure_decode_sweep(llm, setup)
    report_leftover_memory("the decode-sweep engine")
    print_decode_sweep(sweep, is_cuda(setup.device))
    return sweep
