"""--lora N (--lora-rank R): multi-LoRA with N random adapters of rank R, three measurements.

- The decode step (`runner.run`: forward, LM head, sampling) at batches 1, 2, 4, ... 64 and
  the sweep's context, three ways: a base engine; a LoRA engine (max_loras = N, max_lora_rank = R)
  on a batch without adapters; the same with every row on an adapter (round-robin). The two
  engines are alive at once with the same ladder, KV cache and step inputs, and the three columns
  are timed in turn (best of three rounds), so a drift of the clocks hits them alike; the steps
  differ only in their adapter slots and rank bucket.
- The capture cost of the default ladder with max_lora_rank = 64 (the largest rank bucket), next
  to a base engine's. A capture that compiled Triton's LoRA kernels (a first run on the machine)
  is reported apart and the engine built again.
- End to end: the workload's first 64 sequences (at most 128 new tokens, greedy, so that token
  ids compare) through `generate` on each engine, with and without adapters.

The adapters are PEFT directories on all seven projections of every layer, written to the run's
temporary directory; their random values matter only for the token-id check.
"""
import glob
import json
import os
import tempfile

import torch

from benchmarks.decode_sweep import sweep_engine
from benchmarks.harness import Setup, measure_generate, report_leftover_memory
from benchmarks.ladders import ladder_sizes
from benchmarks.report import RunResult, cell, mib, ms, print_table
from benchmarks.runner import decode_step, time_forward
from benchmarks.timing import is_cuda
from benchmarks.workloads import Workload

LORA_CAPTURE_RANK = 64  # the capture figures' max_lora_rank: the largest rank bucket
LORA_E2E = (64, 128)  # end to end: the workload's first 64 sequences, at most 128 new tokens each
# what the figures are held against: Qwen3-0.6B shape on an H100, rank 16, batch <= 64
LORA_TARGETS = {"adapter_vs_base": 1.25, "no_adapter_vs_base": 1.03, "capture_seconds": 15.0,
                "graph_memory_bytes": 2 * 2**30}
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def write_lora_adapters(model_dir: str, n: int, rank: int, dtype: str, root: str,
                        std: float = 0.02) -> list:
    """n PEFT adapter directories of rank `rank` for the model in model_dir, on all seven
    projections of every layer: random weights of std `std` (0.02: as the dummy base weights),
    lora_alpha = 2 rank. The values do not matter for speed, only for the token-id check."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from nanograph.lora.adapter import TARGETS, LoRARequest, module_shapes
    hf = AutoConfig.from_pretrained(model_dir)
    shapes, requests = module_shapes(hf), []
    for a in range(n):
        gen, tensors = torch.Generator().manual_seed(100 + a), {}
        for i in range(hf.num_hidden_layers):
            for module in TARGETS:
                out, inp = shapes[module]
                block = "mlp" if module in MLP_MODULES else "self_attn"
                prefix = f"base_model.model.model.layers.{i}.{block}.{module}"
                for ab, shape in (("A", (rank, inp)), ("B", (out, rank))):
                    weight = (torch.randn(shape, generator=gen) * std).to(getattr(torch, dtype))
                    tensors[f"{prefix}.lora_{ab}.weight"] = weight
        path = tempfile.mkdtemp(prefix=f"lora{a}-", dir=root)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": list(TARGETS), "bias": "none"}, f)
        requests.append(LoRARequest(f"random-r{rank}-{a}", path))
    return requests


def lora_sweep_row(setup: Setup, base, lora, bs: int, rank: int, n: int) -> dict:
    """One batch size: the base engine's step, the LoRA engine's without adapters, and with the
    n adapters round-robin over the rows (slots 0..n-1), each the best of --lora's rounds."""
    context_len = setup.args.sweep_context_len
    step = decode_step(bs, context_len, base.block_size)
    adapter_step = decode_step(bs, context_len, base.block_size,
                               lora_slots=[i % n for i in range(bs)], lora_rank=rank)
    cases = {"base_ms": (base, step), "no_adapter_ms": (lora, step),
             "adapter_ms": (lora, adapter_step)}
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(setup.args.lora_rounds):  # in turn: a drift of the clocks hits the three alike
        for key, (runner, s) in cases.items():
            seconds = time_forward(runner, s, setup.device, setup.args.sweep_iters)
            best[key] = min(best[key], ms(seconds))
    return {"batch": bs, **best,
            "no_adapter_vs_base": best["no_adapter_ms"] / best["base_ms"],
            "adapter_vs_base": best["adapter_ms"] / best["base_ms"]}


def measure_lora_sweep(setup: Setup, adapters: list) -> dict:
    """A base engine and a LoRA engine (max_loras = the adapters, max_lora_rank = their rank),
    alive together with the same ladder (= the sweep sizes) and KV cache, the adapters loaded in
    slots."""
    from nanograph.lora.adapter import read_adapter
    args = setup.args
    sizes = ladder_sizes("pow2", min(64, args.sweep_max_bs))
    # the step's rank bucket: with max_lora_rank = R, R is a bucket (nanograph/lora/slots.py)
    rank = args.lora_rank
    lora_args = dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=args.lora_rank)
    with sweep_engine(setup, sizes) as base, sweep_engine(setup, sizes, **lora_args) as lora:
        for slot, request in enumerate(adapters):
            adapter = read_adapter(request, lora.config.hf_config, args.lora_rank)
            lora.lora.runner_extension.load(slot, adapter)
        rows = [lora_sweep_row(setup, base.runner, lora.runner, bs, rank, len(adapters))
                for bs in sizes]
    report_leftover_memory("the LoRA sweep engines")
    return {"context_len": args.sweep_context_len, "iters": args.sweep_iters,
            "rounds": args.lora_rounds, "rank_bucket": rank, "rows": rows}


def triton_lora_compiles(device: str) -> int:
    """The LoRA kernels' compiles in Triton's on-disk cache (one directory each); 0 on the CPU."""
    if not is_cuda(device):
        return 0
    try:
        from triton import knobs
        root = knobs.cache.dir
    except ImportError:  # Triton < 3.4
        root = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    return sum(len(glob.glob(os.path.join(root, "*", f"_{k}_kernel.json")))
               for k in ("shrink", "expand"))


def capture_engine(setup: Setup, label: str, capture: list, **overrides):
    """An engine with the default ladder, its capture figures appended to `capture`. Built again if
    Triton compiled LoRA kernels during its capture (a first run on this machine): the row the
    targets read is the warm one, the first is kept apart."""
    before = triton_lora_compiles(setup.device)
    llm = setup.llm(**overrides)
    compiles = triton_lora_compiles(setup.device) - before
    stats = llm.stats()
    figures = {k: stats.get(k) for k in ("num_graphs", "capture_seconds", "graph_memory_bytes")}
    capture.append({"engine": label + (", first build" if compiles else ""),
                    "triton_lora_compiles": compiles, **figures})
    if compiles:
        llm.close()
        return capture_engine(setup, label, capture, **overrides)
    return llm


def measure_lora_engines(setup: Setup, adapters: list) -> tuple[list[dict], dict]:
    """Capture figures of a base and a LoRA engine with the default ladder, and on each the
    end-to-end line: greedy, so the token ids with and without adapters can be compared."""
    n, new = LORA_E2E
    head = setup.workload.head(n)
    work = Workload(head.prompts, [min(t, new) for t in head.max_tokens], temperature=0.0)
    capture, rows, tokens = [], [], []

    def e2e(llm, label: str, lora: list = ()):
        outs, seconds, stats = measure_generate(llm, setup, work, lora)
        result = RunResult(label, work.num_seqs, sum(map(len, outs)), seconds, stats=stats)
        rows.append(result.to_dict())
        tokens.append(outs)

    with capture_engine(setup, "base", capture) as llm:
        e2e(llm, "base engine")
    report_leftover_memory("the base engine")
    rank = max(LORA_CAPTURE_RANK, setup.args.lora_rank)
    label = f"LoRA (max_loras {len(adapters)}, max_lora_rank {rank})"
    with capture_engine(setup, label, capture, enable_lora=True, max_loras=len(adapters),
                        max_lora_rank=rank) as llm:
        e2e(llm, "LoRA engine, no adapters")
        e2e(llm, f"LoRA engine, {len(adapters)} adapters round-robin", adapters)
    report_leftover_memory("the LoRA engine")
    base, plain, lora = tokens
    return capture, {"workload": work.summary(), "rows": rows,
                     "changed_by_adapters": sum(a != b for a, b in zip(plain, lora)),
                     "no_adapters_equal_base": sum(a == b for a, b in zip(plain, base))}


def print_lora(report: dict, cuda: bool) -> None:
    sweep, t = report["sweep"], LORA_TARGETS
    print_table(f"Multi-LoRA decode step ({'graph' if cuda else 'CPU: eager'}, forward and "
                f"sampling), context {sweep['context_len']}, best of {sweep['rounds']} rounds of "
                f"{sweep['iters']} steps; {report['adapters']} random adapters of rank "
                f"{report['rank']} round-robin over the rows. Targets (Qwen3-0.6B shape, H100, "
                f"rank 16): adapters / base <= {t['adapter_vs_base']}x, no adapters / base "
                f"<= {t['no_adapter_vs_base']}x",
                ["batch", "base ms", "LoRA engine, no adapters ms", "adapters ms",
                 "no adapters / base", "adapters / base"],
                [[x["batch"],
                  cell(x["base_ms"]),
                  cell(x["no_adapter_ms"]),
                  cell(x["adapter_ms"]),
                  cell(x["no_adapter_vs_base"], ".3f", "x"),
                  cell(x["adapter_vs_base"], ".3f", "x")] for x in sweep["rows"]])
    if cuda:
        print_table(f"Graph capture, default ladder. Targets (the LoRA engine): capture <= "
                    f"{t['capture_seconds']:.0f} s, graph memory <= {mib(t['graph_memory_bytes'])} "
                    "MiB. A first build whose capture compiled LoRA kernels (Triton JIT, cached on "
                    "disk for later runs) is shown apart",
                    ["engine", "graphs", "capture s", "graph MiB", "LoRA kernel compiles"],
                    [[c["engine"],
                      c["num_graphs"],
                      f"{c['capture_seconds']:.2f}",
                      mib(c["graph_memory_bytes"]),
                      c["triton_lora_compiles"]] for c in report["capture"]])
    else:
        print("\n(CPU: no CUDA graphs, capture figures skipped)")
    e2e, w = report["e2e"], report["e2e"]["workload"]
    without_adapters = e2e["rows"][1]["tokens_per_s"]
    print_table(f"Multi-LoRA end to end: the workload's first {w['num_seqs']} sequences, at most "
                f"{LORA_E2E[1]} new tokens each, greedy ({w['output_tokens']:,} output tokens), "
                "default ladder",
                ["engine", "output tokens", "seconds", "tok/s", "vs LoRA engine, no adapters"],
                [[x["engine"],
                  f"{x['output_tokens']:,}",
                  f"{x['seconds']:.2f}",
                  f"{x['tokens_per_s']:,.0f}",
                  f"{x['tokens_per_s'] / without_adapters:.3f}x"] for x in e2e["rows"]])
    print(f"  token ids: the adapters change {e2e['changed_by_adapters']} of {w['num_seqs']} "
          f"sequences; without adapters the LoRA engine's equal the base engine's in "
          f"{e2e['no_adapters_equal_base']} of {w['num_seqs']}")


def section_lora(setup: Setup) -> dict:
    args = setup.args
    if args.tp > 1:
        print("\n(--lora skipped: the sweep keeps two engines side by side, which needs --tp 1)")
        return {"skipped": "needs --tp 1"}
    print(f"  [LoRA] {args.lora} random adapters of rank {args.lora_rank}: sweep, capture, "
          "end to end ...", flush=True)
    # --quick: 10x larger, or they would not change the tiny model's greedy tokens (its residual
    # stream is mostly the token's embedding, so it repeats its last prompt token)
    adapters = write_lora_adapters(setup.model_dir, args.lora, args.lora_rank, setup.dtype,
                                   setup.tmp, std=0.2 if args.quick else 0.02)
    report = {"adapters": args.lora, "rank": args.lora_rank, "targets": LORA_TARGETS,
              "sweep": measure_lora_sweep(setup, adapters)}
    capture, report["e2e"] = measure_lora_engines(setup, adapters)
    if not is_cuda(setup.device):
        capture = {"skipped": "no CUDA graphs on the CPU"}
    report["capture"] = capture
    print_lora(report, is_cuda(setup.device))
    return report
