"""bench.py: how fast nanograph generates, what its CUDA graphs buy, and what they cost.

    python bench.py                                      # the reference workload
    python bench.py --compare --overlap                  # against eager, HF, the peers; overlap
    python bench.py --decode-sweep --shape qwen3-8b      # one decode step by batch size
    python bench.py --quick --device cpu --all           # every section, tiny, on a CPU (CI)

The reference workload is nano-vllm's: 256 random prompts of 100-1024 token ids, each asking for
100-1024 new tokens (temperature 0.6, EOS ignored), 133,966 output tokens in all, on a public
model shape with random weights (Qwen3-0.6B by default; bf16). Throughput = output tokens / wall
time of one `generate` call, after a warm-up. Each section is a flag; with none, only the
reference run. benchmarks/<section>.py has its code and says why its figures compare.

- (default, `--run`): the reference workload's throughput, and the graph figures of that call
  (hit rate, padding waste, replays per bucket).
- `--compare`: the same workload on nanograph eager, HF transformers' continuous batching (its
  first `--hf-seqs` sequences, against nanograph on the same ones) and the engines that speak
  vLLM's offline API (nano-vllm, vLLM: from `.peers/` or `--peer-path`), one table with ratios.
- `--overlap`: overlap scheduling on and off: throughput, batch-1 ms per generated token, and
  how busy the GPU was.
- `--ladders`: the workload under each bucket ladder (the engine's, powers of two, nano-vllm's):
  graphs, capture time and memory, hit rate, padding waste, throughput.
- `--decode-sweep`: one decode step (forward, LM head, sampling) by batch size, graph and eager,
  each against the time to read its bytes; batch-1 latency through `generate`.
- `--lora N` (`--lora-rank R`): N random adapters: the decode step with and without them, the
  graph capture cost, and end to end.
- `--serving`: a server's view through the engine step API (continuous admission, long prompts,
  Poisson arrivals): tokens/s, time to first token, inter-token latency, under the decode-first
  rule and the old prefill-first one side by side.
- `--serving-http`: its Poisson workloads in process and through the OpenAI-compatible server on
  127.0.0.1 (a subprocess): tokens/s, TTFT and ITL side by side, the HTTP layer's cost.
- `--serving-http --data-parallel-size N`: instead, one replica against N behind SGLang's router
  (smg) under cache_aware and round_robin: the Poisson workloads, a shared-prefix one (again on
  caches that hold half its system prompts) and a saturating one, with each server's
  prefix-cache hit rate.
- `--spec`: speculative decoding: the mechanics at a forced acceptance of 0, 0.5, 0.7, 0.9 by
  batch size (tokens/s against plain decoding, against issue 55's targets), and prompt lookup on
  the demo model's Python; `--spec-batches 1` for the batch-1 cells alone.
- `--kv-bandwidth`: the split-KV decode kernel alone on the shape's attention: achieved K/V
  bytes a second at batch 64/256/512 and context 512/1k/4k, a cache of the model's dtype and an
  fp8 one, against the measured copy bandwidth (issue 54's target beside its row).
- `--mixed-step-cost`: a decode step of 64 sequences at context ~1,000 through `LLM.step()`,
  alone and beside 16-512 prefill tokens: each row's time, its ratio to the decode-only step,
  the steps' kinds and graphs (issue 54's target beside the 16-token row).
- `--logprobs N`: every sequence of the workload asks for its top-N logprobs (what they cost).
- `--all`: `--decode-sweep --compare --ladders --overlap --lora 4 --serving --serving-http`.

`--shape a,b` runs every section once per shape, `--attention-backend a,b` once per backend,
`--kv-cache-dtype auto,fp8` once per KV cache dtype (side by side in one call),
`--model` on a real checkpoint instead of a shape. `--quick --device cpu` runs every section on a
tiny model and workload in float32 (graph-only and profiled parts skipped, with a note). `--json
PATH` writes every figure; `--plot PATH` draws decode latency and throughput (needs matplotlib).
"""
import argparse
import glob
import itertools
import json
import os
import sys
import tempfile

from benchmarks.compare import section_compare
from benchmarks.decode_sweep import section_decode_sweep
from benchmarks.harness import Setup, build_setup, meta
from benchmarks.kv_bandwidth import section_kv_bandwidth
from benchmarks.ladders import section_ladders
from benchmarks.lora import section_lora
from benchmarks.mixed_step_cost import section_mixed_step_cost
from benchmarks.overlap import section_overlap
from benchmarks.peers import PEER_DIR, peer_job
from benchmarks.plot import write_plot
from benchmarks.run import section_run
from benchmarks.serving import section_serving
from benchmarks.serving_dp import section_data_parallel
from benchmarks.serving_http import section_serving_http
from benchmarks.shapes import BENCH_SHAPES
from benchmarks.spec import section_spec
from benchmarks.workloads import REFERENCE_OUTPUT_TOKENS


def shape_list(text: str) -> list[str]:
    names = text.split(",")
    unknown = [name for name in names if name not in BENCH_SHAPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown shape(s) {', '.join(unknown)} "
                                         f"(known: {', '.join(BENCH_SHAPES)})")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=shape_list, default=["qwen3-0.6b"],
                   help=f"model shape(s) with random weights, comma-separated, each running every "
                        f"section in turn ({', '.join(BENCH_SHAPES)}; default qwen3-0.6b)")
    p.add_argument("--model", help="a real checkpoint (local dir or hub id) instead of --shape")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", help="default bfloat16 (float32 with --quick)")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--kv-cache-dtype", type=lambda t: t.split(","), default=["auto"],
                   help="comma-separated: run every section once per KV cache dtype (auto,fp8)")
    p.add_argument("--attention-backend", type=lambda t: t.split(","), default=["auto"],
                   help="comma-separated: run every section once per backend, in this process "
                        "(e.g. triton,flash_attn)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--num-kvcache-blocks", type=int,
                   help="fix the KV cache size (default: from memory)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model and workload (CI); every section runs, tiny")
    # the sections
    p.add_argument("--compare", action="store_true",
                   help="nanograph graphs vs eager vs HF transformers vs the peers (nano-vllm, "
                        "vLLM) that import")
    p.add_argument("--run", action="store_true",
                   help="the reference workload (the default when no section is named)")
    p.add_argument("--ladders", action="store_true", help="the workload under each bucket ladder")
    p.add_argument("--decode-sweep", action="store_true",
                   help="decode-step latency vs batch size, graph vs eager")
    p.add_argument("--overlap", action="store_true",
                   help="overlap scheduling on vs off: throughput, batch 1, GPU busy")
    p.add_argument("--lora", type=int, default=0, metavar="N",
                   help="multi-LoRA with N random adapters: decode sweep with/without adapters, "
                        "capture, end to end")
    p.add_argument("--lora-rank", type=int, default=16, metavar="R",
                   help="the --lora adapters' rank (default 16)")
    p.add_argument("--serving", action="store_true",
                   help="serving latency through the step API (TTFT, ITL, tokens/s), decode-first "
                        "vs prefill-first scheduling")
    p.add_argument("--serving-http", action="store_true",
                   help="the serving section's Poisson workloads in process and through the "
                        "server on 127.0.0.1 (TTFT, ITL, tokens/s)")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="--serving-http: one replica against N behind the smg router instead "
                        "(Poisson and shared-prefix workloads, cache_aware and round_robin)")
    p.add_argument("--spec", action="store_true",
                   help="speculative decoding: the mechanics at a forced acceptance by batch, "
                        "and prompt lookup on the demo model")
    p.add_argument("--kv-bandwidth", action="store_true",
                   help="the split-KV decode kernel's K/V bytes/s against the copy bandwidth")
    p.add_argument("--mixed-step-cost", action="store_true",
                   help="a decode step alone and beside 16-512 prefill tokens (LLM.step())")
    p.add_argument("--all", action="store_true",
                   help="--decode-sweep --compare --ladders --overlap --lora 4 --serving "
                        "--serving-http")
    # the sections' settings
    p.add_argument("--hf-seqs", type=int, default=32,
                   help="HF runs the first N sequences of the workload (default 32; 256 = all of "
                        "it; 0 = skip HF)")
    p.add_argument("--hf-timeout", type=float, default=300.0,
                   help="give up on HF after this many seconds")
    peer_dirs = sorted(glob.glob(os.path.join(PEER_DIR, "*")))
    p.add_argument("--peer-path", default=os.pathsep.join(peer_dirs),
                   help=f"prepended to the peers' PYTHONPATH ({os.pathsep}-separated; default: the "
                        f"directories in {PEER_DIR})")
    p.add_argument("--peer-timeout", type=float, default=600.0,
                   help="give up on a peer's subprocess after this many seconds "
                        "(start-up included)")
    p.add_argument("--logprobs", type=int, metavar="N",
                   help="every sequence of the workload asks for its top-N logprobs")
    p.add_argument("--mixed-budgets", type=lambda t: [int(b) for b in t.split(",")],
                   help="--serving: rerun its targeted workloads under these max_num_mixed_tokens")
    p.add_argument("--spec-batches", type=lambda t: [int(b) for b in t.split(",")],
                   help="--spec: these batch sizes only (default 1,4,16,64; 1,4 with --quick)")
    p.add_argument("--sweep-max-bs", type=int,
                   help="largest decode-sweep batch (default 256, 8 with --quick)")
    p.add_argument("--sweep-context-len", type=int,
                   help="decode-sweep context length (default 512, 32 with --quick)")
    p.add_argument("--sweep-iters", type=int,
                   help="timed steps per size (default 20, 3 with --quick)")
    p.add_argument("--json", help="write every figure to this JSON file")
    p.add_argument("--plot", help="write a PNG: decode latency vs batch and throughput bars "
                                  "(needs matplotlib)")
    args = p.parse_args(argv)
    if args.lora < 0 or args.lora_rank < 1:
        p.error("--lora N needs N >= 0 and --lora-rank R >= 1")
    if args.all:
        args.decode_sweep = args.compare = args.ladders = args.overlap = args.serving = True
        args.serving_http = True
        args.lora = args.lora or 4
    other_sections = (args.ladders or args.decode_sweep or args.lora or args.serving
                      or args.serving_http or args.spec or args.kv_bandwidth
                      or args.mixed_step_cost)
    args.run_default = args.run or args.compare or args.overlap or not other_sections
    args.sweep_max_bs = args.sweep_max_bs or (8 if args.quick else 256)
    args.sweep_context_len = args.sweep_context_len or (32 if args.quick else 512)
    args.sweep_iters = args.sweep_iters or (3 if args.quick else 20)
    args.lora_rounds = 1 if args.quick else 3  # --lora sweep: the best of this many rounds
    args.bandwidth_mib = 64 if args.quick else 1024
    # batch-1 latency: prompt length, new tokens
    args.latency_lengths = (8, 16) if args.quick else (128, 128)
    if args.quick:
        args.max_model_len = min(args.max_model_len, 256)
    return args


def run_sections(setup: Setup) -> dict:
    """Every section asked for, on one shape."""
    args, report = setup.args, {}
    if args.decode_sweep:
        report["decode_sweep"] = section_decode_sweep(setup)
    if args.run_default:
        run = section_run(setup)
        if args.compare:
            report["compare"] = {"rows": [r.to_dict() for r in section_compare(setup, run)]}
        if args.overlap:
            report["overlap"] = {"rows": [r.to_dict() for r in section_overlap(setup, run)]}
        report["run"] = run.to_dict()  # after --compare, which sets its ratio
    if args.lora:
        report["lora"] = section_lora(setup)
    if args.ladders:
        report["ladders"] = section_ladders(setup)
    if args.serving:
        report["serving"] = section_serving(setup)
    if args.spec:
        report["spec"] = section_spec(setup)
    if args.kv_bandwidth:
        report["kv_bandwidth"] = section_kv_bandwidth(setup)
    if args.mixed_step_cost:
        report["mixed_step_cost"] = section_mixed_step_cost(setup)
    if args.serving_http and args.data_parallel_size > 1:
        report["serving_http"] = section_data_parallel(setup)
    elif args.serving_http:
        report["serving_http"] = section_serving_http(setup)
    return report


def main(argv=None) -> dict:
    args = parse_args(argv)
    names = [args.model] if args.model else args.shape
    with tempfile.TemporaryDirectory(prefix="nanograph-bench-") as tmp:
        setups = [build_setup(args, tmp, name) for name in names]
        m, w = meta(setups[0], names), setups[0].workload
        report = {"meta": m, "workload": w.summary(), "shapes": {}}
        tiny = " (--quick: tiny models)" if args.quick else ""
        print(f"nanograph bench: {', '.join(names)}{tiny} ({setups[0].load_format} weights, "
              f"{m['dtype']}) on {m['device_name']}, "
              f"tp={args.tp}; torch {m['torch']}, transformers {m['transformers']}")
        reference = ""
        if w.output_tokens == REFERENCE_OUTPUT_TOKENS:
            reference = " (the reference workload)"
        logprobs = ""
        if w.logprobs is not None:
            logprobs = f", each asking for top-{w.logprobs} logprobs"
        print(f"workload: {w.num_seqs} sequences, {w.prompt_tokens:,} prompt tokens, "
              f"{w.output_tokens:,} output tokens{reference}{logprobs}")
        for setup in setups:
            for backend, kv_dtype in itertools.product(args.attention_backend, args.kv_cache_dtype):
                setup.attention_backend, setup.kv_cache_dtype = backend, kv_dtype
                key = setup.name
                if len(args.attention_backend) > 1:
                    key = f"{key} ({backend})"
                if len(args.kv_cache_dtype) > 1:
                    key = f"{key} (KV {kv_dtype})"
                if len(setups) > 1 or key != setup.name:
                    print(f"\n==== {key} ====")
                report["shapes"][key] = run_sections(setup)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"\nfigures written to {args.json}")
    if args.plot:
        write_plot(args.plot, report)
    return report


if __name__ == "__main__":
    if sys.argv[1:2] == ["--peer-job"]:  # a peer's subprocess (benchmarks/peers.py)
        peer_job(sys.argv[2])
    else:
        main()
