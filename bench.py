"""bench.py: how fast nanograph generates, what its CUDA graphs buy, and what they cost.

What it measures (each section is a flag; with none, only the reference run):

- reference run (default): the "nano-vllm workload" of DESIGN.md, 256 random prompts of 100-1024
  tokens, each asking for 100-1024 new tokens (temperature 0.6, EOS ignored): 133,966 output
  tokens in all. Throughput = output tokens / wall time of one `generate` call, after a warm-up
  generate. Also prints the engine's graph figures for that call alone (hit rate, padding
  waste, replays per bucket: the graph runner's counters after the call minus before it).
- `--compare`: the same workload on nanograph with CUDA graphs, nanograph eager
  (`enforce_eager=True`) and HF transformers' continuous batching, one after the other in this
  process, each on a freshly built model that is freed before the next one is built. HF runs
  only the first `--hf-seqs` (32) sequences (it is ~30x slower), and its throughput grows with
  the number of concurrent requests, so nanograph with graphs runs those same sequences too (on an
  engine of its own: no prefix-cache hits from the full run): each ratio in the table is between
  two runs of the same sequences. Then the peers: engines that speak vLLM's offline API
  (`LLM(path, ...)`, `llm.generate(prompts, SamplingParams(temperature, max_tokens, ignore_eos))`),
  nano-vllm and vLLM, each in a subprocess of its own (`bench.py --peer-job`) on the whole workload.
  They have no dummy weights, so the shape's random weights are written once as a safetensors
  checkpoint (HF's init; config.json; a word-level tokenizer over the vocabulary, since nano-vllm
  reads EOS from one) that every peer loads. Import them from `--peer-path` (default: every
  directory in `.peers/` next to bench.py, e.g. nano-vllm's source) and the usual sys.path. A
  peer that cannot run here (nano-vllm: Qwen3 only, CUDA only, flash-attn) or does not import is
  a skipped row with the reason.
- `--ladders`: the workload once per bucket ladder: `default` (the engine's own rule),
  `pow2` (1, 2, 4, ..., 512) and `nano-vllm` (1, 2, 4, 8, then every 16 up to 512), the last two
  built here and passed as `cuda_graph_sizes`: graphs captured, capture time, graph memory, hit
  rate, padding waste, throughput.
- `--decode-sweep`: the time of one decode step (the model's forward, no sampling) at batch sizes
  1, 2, 3, 4, 6, 8, 12, 16, 24, ... 256 (dense at the small end) and a fixed context length,
  replayed from a graph captured for exactly that size and run eagerly, each against its floor:
  the bytes the step must read (every weight once, and the batch's K/V at that context) / the
  copy bandwidth measured on this device. Plus batch-1 latency (ms per generated token through
  `generate`: scheduling and sampling included) against the weights' floor and the graph step.
- `--overlap`: overlap scheduling (`LLM(overlap_scheduling=...)`) on and off side by side: the
  workload's throughput, batch-1 ms per generated token (at the workload's temperature 0.6, and
  greedy) next to the graph step at batch 1 of the same engine, and how busy the GPU was in decode-heavy calls (union of its kernel and copy
  intervals under torch.profiler / the span from the first to the last). The profiler slows the
  host, so those are calls of their own after the timed ones. The reference run's engine serves
  the mode it defaults to (on with CUDA); the other mode gets an engine of its own.
- `--lora N` (`--lora-rank R`, default 16): multi-LoRA with N random adapters of rank R (all seven
  projections, PEFT files in the run's temp dir). One decode step (forward only) at batches 1, 2,
  4, ... 64 and the sweep's context: a base engine; a LoRA engine (max_loras=N, max_lora_rank=R)
  on a batch without adapters; the same with every row on an adapter (round-robin). Then the
  capture cost of the default ladder with max_lora_rank=64 next to a base engine's, and the
  workload's first 64 sequences (at most 128 new tokens, greedy so that token ids compare)
  through `generate` on each engine, with and without adapters.
- `--shape a,b,c`: every section once per shape, one shape after the other in this process, each
  engine freed before the next one is built.

Why the numbers are comparable:
- Every engine gets the same prompts (token ids, so no tokenizer is involved) and the same
  per-request output lengths; EOS is disabled everywhere, so the work is fixed by the workload.
- The model is a public shape (`--shape`: Qwen3 0.6B/1.7B/4B/8B, Llama 3.2-1B, Llama 3.1-8B, from
  their HF config.json values) with random weights: speed does not depend on the weights' values,
  and nothing has to be downloaded. Every engine builds the same shape from the same config.json,
  in the same dtype (bf16 on CUDA).
- `--lora`'s two sweep engines are alive at once with the same ladder, KV cache and step inputs, and
  the three columns are timed in turn (best of three rounds), so clock drift hits them alike; the
  steps differ only in their adapter slots and rank bucket. A capture that compiled Triton kernels
  (a first run on the machine) is reported apart and the engine built again.
- Only the generation is timed: model building, KV-cache allocation, graph capture and a warm-up
  are outside the clock, for every engine alike (they are reported separately where they matter).
  A peer's subprocess times its own generate call the same way (the same warm-up workload first)
  and prints the figures as one JSON line that bench reads.
- HF's `generate_batch` takes a single `max_new_tokens` for all requests, so bench drives its
  `ContinuousBatchingManager` directly (`init_continuous_batching`, `add_request(...,
  max_new_tokens=n)`, `get_result`), which is what `generate_batch` does underneath, with each
  request's own length.

`--attention-backend triton,flash_attn` runs every section asked for once per backend, one after
the other in this process, each on an engine of its own (default `auto`: see layers/attention.py).

`--quick --device cpu` runs every section on a tiny model of each shape's family (Qwen3 or Llama 3)
and a tiny workload in float32, for CI (graph-only and profiled parts are skipped on the CPU, with
a note). `--json PATH` writes every figure, `--plot PATH` draws decode latency vs batch size and
the throughput bars (needs matplotlib).
"""
import argparse
import gc
import glob
import inspect
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

REFERENCE_OUTPUT_TOKENS = 133_966


# Model shapes built from a config.json alone (load_format="dummy"): no download needed. The values
# are those of the public HF configs.
def llama3_rope(factor: float) -> dict:
    return dict(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)


_QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, head_dim=128,
              num_key_value_heads=8, rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
              eos_token_id=151645, bos_token_id=151643)
_LLAMA3 = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, num_key_value_heads=8,
               rope_theta=500_000.0, max_position_embeddings=131072, rms_norm_eps=1e-5, eos_token_id=128001,
               bos_token_id=128000)
SHAPES = {
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=False),
    "llama3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, head_dim=64, tie_word_embeddings=True, rope_scaling=llama3_rope(32.0)),
    "llama3.1-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, head_dim=128, tie_word_embeddings=False, rope_scaling=llama3_rope(8.0)),
    # --quick: small enough that the whole bench runs in seconds on two CPU cores
    "tiny": dict(_QWEN3, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                 eos_token_id=1, bos_token_id=0, tie_word_embeddings=True),
    "tiny-llama": dict(_LLAMA3, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=16384,
                       eos_token_id=1, bos_token_id=0, tie_word_embeddings=True, rope_scaling=llama3_rope(32.0)),
}
BENCH_SHAPES = [name for name in SHAPES if not name.startswith("tiny")]
LADDER_POLICIES = ("default", "pow2", "nano-vllm")
LADDER_MAX_BS = 512  # the engine's largest graph batch here: min(max_num_seqs = 512, 512)


def quick_shape(shape: str) -> str:
    """The tiny model of a shape's family, for --quick."""
    return "tiny-llama" if SHAPES[shape]["model_type"] == "llama" else "tiny"


# ---- workload ----------------------------------------------------------------------------------
@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    temperature: float = 0.6

    @property
    def num_seqs(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def head(self, n: int) -> "Workload":
        return Workload(self.prompts[:n], self.max_tokens[:n], self.temperature)

    def sampling_params(self):
        from nanograph import SamplingParams
        return [SamplingParams(temperature=self.temperature, ignore_eos=True, max_tokens=n) for n in self.max_tokens]

    def summary(self) -> dict:
        return {"num_seqs": self.num_seqs, "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens}


def make_workload(num_seqs: int = 256, min_input_len: int = 100, max_input_len: int = 1024, min_output_len: int = 100,
                  max_output_len: int = 1024, max_token_id: int = 10000, seed: int = 0) -> Workload:
    """nano-vllm's bench.py draws, in this order: all prompts, then all output lengths."""
    rng = random.Random(seed)  # same stream as random.seed(seed) + random.randint
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(min_input_len, max_input_len))]
               for _ in range(num_seqs)]
    max_tokens = [rng.randint(min_output_len, max_output_len) for _ in range(num_seqs)]
    return Workload(prompts, max_tokens)


def reference_workload() -> Workload:
    return make_workload()


def quick_workload() -> Workload:
    return make_workload(num_seqs=8, min_input_len=8, max_input_len=32, min_output_len=4, max_output_len=16,
                         max_token_id=SHAPES["tiny"]["vocab_size"] - 1)


def warmup_workload(quick: bool, max_token_id: int) -> Workload:
    """A few sequences of the same kind on another random stream (so no prefix-cache hits on
    the timed prompts): exercises prefill, decode, sampling and the allocator before the clock."""
    if quick:  # the quick workload's own shape: on a CPU every new matmul shape costs a first-time setup
        return make_workload(8, 8, 32, 4, 16, max_token_id, seed=1)
    return make_workload(16, 100, 1024, 32, 32, max_token_id, seed=1)


def ladder_sizes(policy: str, max_bs: int) -> list[int] | None:
    """The `cuda_graph_sizes` of a --ladders policy; None: the engine's own rule
    (nanograph.engine.cuda_graph.bucket_ladder). Every ladder ends at max_bs."""
    if policy == "pow2":
        return sorted({1 << i for i in range(max_bs.bit_length())} | {max_bs})
    if policy == "nano-vllm":
        return sorted({s for s in (1, 2, 4, 8) if s < max_bs} | set(range(16, max_bs, 16)) | {max_bs})
    return None


def sweep_sizes(max_bs: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ...: the powers of two and the sizes halfway between them."""
    return sorted(s for i in range(max_bs.bit_length()) for s in (1 << i, 3 << i) if s <= max_bs)


# ---- results and tables --------------------------------------------------------------------------
@dataclass
class RunResult:
    engine: str
    num_seqs: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    note: str = ""
    error: str | None = None
    stats: dict = field(default_factory=dict)
    probe: dict = field(default_factory=dict)     # --overlap: batch-1 and GPU-busy figures of the same engine
    vs_nanograph: float | None = None             # --compare: tok/s over nanograph's (graphs) on the same sequences

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 and not self.error else 0.0

    def to_dict(self) -> dict:
        return dict(asdict(self), tokens_per_s=self.tokens_per_s)


def print_table(title: str, headers: list[str], rows: list[list]) -> None:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    print(f"\n{title}\n{line}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print(line)
    for row in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    print(line)


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def cell(value, spec: str = ".3f", suffix: str = "") -> str:
    """A table cell: the value formatted, or '-' where there is none."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


# ---- device helpers ----------------------------------------------------------------------------
def is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def synchronize(device: str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def seconds_per_call(fn, device: str, iters: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def measure_copy_bandwidth(device: str, nbytes: int, iters: int = 10) -> float:
    """Bytes moved per second by a device-to-device copy (each copy reads n and writes n bytes)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = seconds_per_call(lambda: dst.copy_(src), device, iters)
    del src, dst
    free_memory()
    return 2 * nbytes / seconds


def weight_read_bytes(model: torch.nn.Module, tied: bool) -> int:
    """Bytes of weights one decode token reads: every parameter once (a tied embedding is read
    once, by the LM head); an untied input embedding only contributes the one row looked up."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # shared tensors counted once
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


def busy_share(spans: list[tuple[float, float]]) -> float | None:
    """The union of the intervals' lengths / the span from the first start to the last end."""
    if not spans:
        return None
    spans = sorted(spans)
    busy, reach = 0.0, spans[0][0]
    for start, end in spans:
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return busy / (reach - spans[0][0]) if reach > spans[0][0] else None


def gpu_busy_share(llm, prompts: list[list[int]], new_tokens: int) -> float | None:
    """Share of a generate call's GPU span during which a kernel or a copy ran (torch.profiler)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from nanograph import SamplingParams
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=new_tokens)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    return busy_share([(e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == DeviceType.CUDA])


# ---- the model directory -----------------------------------------------------------------------
def write_model_dir(shape: str, root: str) -> str:
    """config.json of a shape, with its model_type and architectures, as HF would write it."""
    from transformers import AutoConfig
    config = dict(SHAPES[shape])
    path = os.path.join(root, shape)
    AutoConfig.for_model(config.pop("model_type"), **config).save_pretrained(path)
    return path


# ---- nanograph ---------------------------------------------------------------------------------
@dataclass
class Setup:
    """Everything the sections share for one shape: where the model is, how to build engines, the workload."""
    args: argparse.Namespace
    name: str
    model_dir: str
    load_format: str
    device: str
    dtype: str
    workload: Workload
    warmup: Workload
    max_token_id: int
    tmp: str  # the run's temporary directory (model configs, LoRA adapters)
    attention_backend: str = "auto"  # one of --attention-backend's, set by main for each in turn

    def llm(self, **overrides):
        from nanograph import LLM
        kwargs = dict(load_format=self.load_format, dtype=self.dtype, device=self.device,
                      max_model_len=self.args.max_model_len, tensor_parallel_size=self.args.tp,
                      attention_backend=self.attention_backend)
        if self.args.num_kvcache_blocks:
            kwargs["num_kvcache_blocks"] = self.args.num_kvcache_blocks
        kwargs.update(overrides)
        return LLM(self.model_dir, **kwargs)


def report_leftover_memory(what: str) -> None:
    """After an engine is freed, the next one sizes its KV cache from free memory: say so if
    something (a reference cycle, a cache) kept a lot of device memory alive."""
    free_memory()
    if torch.cuda.is_available() and torch.cuda.memory_allocated() > 256 * 2**20:
        print(f"  (warning: {mib(torch.cuda.memory_allocated())} MiB still allocated after freeing {what})")


CALL_COUNTERS = ("prefix_cache_hit_tokens", "preemptions", "overlap_discarded_tokens")


def graph_counters(stats) -> dict:
    """The cumulative counters of a GraphStats (nanograph/engine/cuda_graph.py)."""
    return {"replays": Counter(stats.replays), "eager_steps": stats.eager_steps, "real_rows": stats.real_rows}


def counters(llm) -> dict:
    """The engine's cumulative counters, to take their difference around one call."""
    stats = llm.stats()
    out = {key: stats[key] for key in CALL_COUNTERS if key in stats}
    if llm.runner.graphs is not None:
        out.update(graph_counters(llm.runner.graphs.stats))
    return out


def call_figures(before: dict, after: dict) -> dict:
    """The figures of one call alone, from the counters before and after it."""
    out = {key: after[key] - before[key] for key in CALL_COUNTERS if key in after}
    if "replays" in after:
        from nanograph.engine.cuda_graph import GraphStats
        call = GraphStats(replays=after["replays"] - before["replays"],  # Counter subtraction drops unused buckets
                          eager_steps=after["eager_steps"] - before["eager_steps"],
                          real_rows=after["real_rows"] - before["real_rows"])
        out.update({k: v for k, v in call.as_dict().items() if k not in ("capture_seconds", "graph_memory_bytes")})
    return out


def round_robin(adapters: list, n: int) -> list | None:
    """lora_request for n prompts: the adapters in turn; None (every prompt on the base model) without any."""
    return [adapters[i % len(adapters)] for i in range(n)] if adapters else None


def time_generate(llm, workload: Workload, device: str, adapters: list = ()) -> tuple[list[list[int]], float]:
    params = workload.sampling_params()
    synchronize(device)
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=False, lora_request=round_robin(adapters, workload.num_seqs))
    synchronize(device)
    seconds = time.perf_counter() - start
    return [o["token_ids"] for o in outs], seconds


def measure_generate(llm, setup: Setup, workload: Workload, adapters: list = ()) -> tuple[list[list[int]], float, dict]:
    """Warm up, then time one generate of the workload (the adapters round-robin over the
    prompts, in both): (output token ids, seconds, its stats)."""
    warm = setup.warmup
    llm.generate(warm.prompts, warm.sampling_params(), use_tqdm=False,
                 lora_request=round_robin(adapters, warm.num_seqs))
    before = counters(llm)
    outs, seconds = time_generate(llm, workload, setup.device, adapters)
    stats = dict(llm.stats(), overlap_scheduling=llm.config.overlap_scheduling)
    stats.update(call_figures(before, counters(llm)))
    return outs, seconds, stats


def overlap_probe(llm, setup: Setup) -> dict:
    """After the timed call, on the same engine: batch-1 ms per generated token, the graph step
    at batch 1, and (CUDA) the GPU's busy share in two decode-heavy profiled calls: one sequence,
    and the workload's sequences with their prompts cut to 16 tokens (one prefill step)."""
    args, runner = setup.args, llm.runner
    prompt_len, new_tokens = args.latency_lengths
    probe = {"ms_per_token": ms(per_token_latency(llm, setup, prompt_len, new_tokens, seed=2)),
             "greedy_ms_per_token": ms(per_token_latency(llm, setup, prompt_len, new_tokens, seed=5, temperature=0))}
    if is_cuda(setup.device):
        prompt = [random.Random(4).randint(0, setup.max_token_id) for _ in range(prompt_len)]
        probe["gpu_busy_batch1"] = gpu_busy_share(llm, [prompt], new_tokens)
        probe["gpu_busy_workload"] = gpu_busy_share(llm, [p[:16] for p in setup.workload.prompts], new_tokens // 2)
    if runner.graphs is not None:  # last: it writes K/V into blocks it does not own
        step = decode_step(1, args.sweep_context_len, runner.block_size)
        probe["graph_step_ms"] = ms(time_forward(runner, step, setup.device, args.sweep_iters))
        for key in ("ms_per_token", "greedy_ms_per_token"):
            probe[key.replace("ms_per_token", "vs_step")] = probe[key] / probe["graph_step_ms"] if probe[key] else None
    return probe


def run_nanograph(setup: Setup, label: str, workload: Workload, probe: bool = False, **overrides) -> RunResult:
    """Build an engine, measure, free the engine (it lives only in this frame, so that its device
    memory is back before the next engine sizes its KV cache)."""
    print(f"  [{label}] building the engine, warming up, timing {workload.num_seqs} sequences ...", flush=True)
    llm = setup.llm(**overrides)
    try:
        outs, seconds, stats = measure_generate(llm, setup, workload)
        tokens = sum(map(len, outs))
        probed = overlap_probe(llm, setup) if probe else {}
    finally:
        llm.close()
        del llm
        report_leftover_memory(label)
    note = ""
    if tokens != workload.output_tokens:
        note = f"expected {workload.output_tokens} output tokens"
    return RunResult(label, workload.num_seqs, tokens, seconds, note, stats=stats, probe=probed)


def print_run(result: RunResult, workload: Workload) -> None:
    s = result.stats
    print(f"\n{result.engine}: {workload.num_seqs} sequences, {workload.prompt_tokens:,} prompt tokens")
    print(f"  output tokens {result.output_tokens:,} (requested {workload.output_tokens:,})"
          f"   time {result.seconds:.2f} s   throughput {result.tokens_per_s:,.0f} tok/s"
          f"   overlap scheduling {on_off(s.get('overlap_scheduling'))}")
    if "graph_hit_rate" in s:
        print(f"  graphs {s.get('num_graphs', 0)} {s.get('cuda_graph_sizes', [])}")
        print(f"  capture {s.get('capture_seconds', 0):.2f} s   graph memory {mib(s.get('graph_memory_bytes', 0))} MiB")
        print(f"  this call: decode steps {s['decode_steps']}   hit rate {s['graph_hit_rate']:.1%}"
              f"   padding waste {s['padding_waste']:.1%}   replays per bucket {s['replays_per_bucket']}")
    else:
        print("  no CUDA graphs on this device")
    discarded = f"   overlap discarded tokens {s['overlap_discarded_tokens']}" if "overlap_discarded_tokens" in s else ""
    print(f"  KV blocks {s.get('num_kvcache_blocks')}   preemptions {s.get('preemptions')}"
          f"   prefix-cache hit tokens {s.get('prefix_cache_hit_tokens')}{discarded}"
          f"   attention {s.get('attention_backend')}")


# ---- HF transformers continuous batching -------------------------------------------------------
def load_hf_model(setup: Setup, attn_implementation: str):
    from transformers import AutoConfig, AutoModelForCausalLM
    dtype = getattr(torch, setup.dtype)
    if setup.load_format == "dummy":
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(setup.model_dir)
        with torch.device(setup.device):  # random init right where it runs (an 8B init on the CPU is slow)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    else:
        model = AutoModelForCausalLM.from_pretrained(setup.model_dir, dtype=dtype,
                                                     attn_implementation=attn_implementation)
    return model.to(setup.device).eval()


def hf_manager(model, setup: Setup, workload: Workload):
    """A started ContinuousBatchingManager with sampling like nanograph's and EOS disabled."""
    from transformers import GenerationConfig
    gen = GenerationConfig(do_sample=workload.temperature > 0, temperature=workload.temperature, top_k=0, top_p=1.0,
                           eos_token_id=None, pad_token_id=0, max_new_tokens=max(workload.max_tokens))
    kwargs = {}
    params = inspect.signature(model.init_continuous_batching).parameters
    if not is_cuda(setup.device) and "continuous_batching_config" in params:
        # HF sizes its cache from memory; on a CPU that means minutes of zero-filling: keep it small
        from transformers import ContinuousBatchingConfig
        longest = max(len(p) + n for p, n in zip(workload.prompts, workload.max_tokens))
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
            num_blocks=workload.num_seqs * -(-longest // 256) + 8, max_batch_tokens=512)
    if "workload_hints" in params:  # what generate_batch passes, so HF sizes itself as it would there
        try:
            from transformers.generation.continuous_batching.utils import WorkloadHints
            kwargs["workload_hints"] = WorkloadHints(
                max_prompt_length=max(map(len, workload.prompts)), max_generated_length=max(workload.max_tokens),
                num_requests=workload.num_seqs)
        except ImportError:
            pass
    manager = model.init_continuous_batching(generation_config=gen, **kwargs)
    if hasattr(manager, "warmup"):
        manager.warmup()
    manager.start()
    return manager


def hf_generate(manager, workload: Workload, prefix: str, timeout_s: float) -> tuple[int, float, str | None]:
    """Submit every request with its own max_new_tokens, wait for all; (tokens, seconds, error)."""
    start = time.perf_counter()
    pending = set()
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.max_tokens)):
        request_id = f"{prefix}{i}"
        manager.add_request(prompt, request_id=request_id, max_new_tokens=n)
        pending.add(request_id)
    tokens, errors = 0, []
    while pending:
        result = manager.get_result(timeout=1)
        if result is None:
            if not getattr(manager, "is_running", lambda: True)():
                return tokens, time.perf_counter() - start, "generation thread stopped unexpectedly"
            if time.perf_counter() - start > timeout_s:
                done = workload.num_seqs - len(pending)
                return tokens, time.perf_counter() - start, f"timed out after {timeout_s:.0f} s ({done}/{workload.num_seqs} done)"
            continue
        if result.request_id not in pending or not result.is_finished():
            continue
        pending.discard(result.request_id)
        tokens += len(result.generated_tokens)
        if getattr(result, "error", None):
            errors.append(str(result.error))
    seconds = time.perf_counter() - start
    return tokens, seconds, (f"{len(errors)} request(s) failed: {errors[0]}" if errors else None)


def run_hf(setup: Setup, workload: Workload) -> RunResult:
    """HF transformers' continuous batching on the same shape and workload. Never raises: a
    failure becomes the row's error."""
    import transformers
    label = f"HF transformers {transformers.__version__} (continuous batching)"
    subset = workload.head(setup.args.hf_seqs)
    note = "" if subset.num_seqs == workload.num_seqs else f"first {subset.num_seqs} of {workload.num_seqs} sequences"
    if subset.num_seqs == 0:
        return RunResult(label, error="skipped (--hf-seqs 0)")
    model = manager = None
    errors = []
    print(f"  [{label}] building the model, warming up, timing {subset.num_seqs} sequences ...", flush=True)
    try:
        for impl in ("paged|sdpa", "sdpa", "paged|eager"):
            try:
                model = load_hf_model(setup, impl)
                manager = hf_manager(model, setup, subset)
                break
            except Exception as e:  # this implementation name is not known to this version: try the next
                errors.append(f"{impl}: {type(e).__name__}: {e}")
                model = manager = None
                free_memory()
        if manager is None:
            return RunResult(label, subset.num_seqs, note=note, error=" | ".join(errors))
        label += f" [{model.config._attn_implementation}]"
        _, _, err = hf_generate(manager, setup.warmup, "warmup-", setup.args.hf_timeout)
        if err:
            return RunResult(label, subset.num_seqs, note=note, error=f"warm-up: {err}")
        tokens, seconds, err = hf_generate(manager, subset, "req-", setup.args.hf_timeout)
        if not err and tokens != subset.output_tokens:
            note = "; ".join(filter(None, [note, f"{tokens} of {subset.output_tokens} requested tokens"]))
        return RunResult(label, subset.num_seqs, tokens, seconds, note, err)
    except Exception as e:
        return RunResult(label, subset.num_seqs, note=note, error=f"{type(e).__name__}: {e}")
    finally:
        if manager is not None:
            try:  # a hard stop fails whatever is still pending (after a time-out) instead of finishing it
                hard = {"hard_stop": True} if "hard_stop" in inspect.signature(manager.stop).parameters else {}
                manager.stop(block=True, timeout=30, **hard)
            except Exception as e:
                print(f"  (HF manager did not stop cleanly: {type(e).__name__}: {e})")
        del manager, model
        report_leftover_memory("the HF model")


# ---- peers: engines that speak vLLM's offline API, each in a subprocess ------------------------
@dataclass
class Peer:
    name: str
    module: str                     # `from <module> import LLM, SamplingParams`
    model_types: tuple = ()         # the model types it implements (empty: any)
    cuda_only: bool = False
    prompt_dicts: bool = False      # token-id prompts as {"prompt_token_ids": ids} (vLLM), else the list itself


PEERS = [Peer("nano-vllm", "nanovllm", model_types=("qwen3",), cuda_only=True),  # flash-attn, NCCL, CUDA graphs
         Peer("vLLM", "vllm", prompt_dicts=True)]
PEER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".peers")  # e.g. .peers/nano-vllm (a source tree)
PEER_TAG = "bench peer result: "  # the subprocess's one line of figures: PEER_TAG + JSON


def write_checkpoint(setup: Setup) -> str:
    """The shape's random weights as a checkpoint the peers load: HF's random init (seed 0) in the
    run's dtype, saved as safetensors with its config.json (whose `dtype` nano-vllm builds the model
    in), and a word-level tokenizer, "t0" .. "t<vocab-1>", with the config's EOS and BOS (nano-vllm
    reads EOS from a tokenizer; the prompts are token ids, so nothing else uses it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    path = os.path.join(setup.tmp, f"{setup.name}-checkpoint")
    print(f"  [peers] writing the random-weight checkpoint to {path} ...", flush=True)
    model = load_hf_model(setup, "sdpa")
    model.save_pretrained(path)
    config = model.config
    del model
    report_leftover_memory("the checkpoint's model")
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config.vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=f"t{config.eos_token_id}",
                            bos_token=f"t{config.bos_token_id}").save_pretrained(path)
    return path


def run_peer(setup: Setup, peer: Peer, checkpoint: str) -> RunResult:
    """One peer on the whole workload, in a subprocess (its own CUDA context, all its memory back
    when it exits). Never raises: a peer that cannot run here (the model type, the device) or does
    not import is a skipped row, any other failure the row's error (the tail of its stderr printed)."""
    args, work = setup.args, setup.workload
    with open(os.path.join(checkpoint, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    if peer.model_types and model_type not in peer.model_types:
        return RunResult(peer.name, work.num_seqs, error=f"skipped: implements {', '.join(peer.model_types)} only, "
                                                         f"not {model_type}")
    if peer.cuda_only and not is_cuda(setup.device):
        return RunResult(peer.name, work.num_seqs, error="skipped: runs on CUDA only")
    job = {"module": peer.module, "prompt_dicts": peer.prompt_dicts, "model": checkpoint,
           "engine_args": {"dtype": setup.dtype, "max_model_len": args.max_model_len, "tensor_parallel_size": args.tp},
           "warmup": asdict(setup.warmup), "workload": asdict(work)}
    job_path = os.path.join(setup.tmp, f"{setup.name}-{peer.module}-job.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [args.peer_path, os.environ.get("PYTHONPATH")])))
    print(f"  [{peer.name}] in a subprocess: building the engine, warming up, timing {work.num_seqs} sequences ...",
          flush=True)
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--peer-job", job_path], env=env,
                              capture_output=True, text=True, timeout=args.peer_timeout)
    except subprocess.TimeoutExpired:
        return RunResult(peer.name, work.num_seqs, error=f"timed out after {args.peer_timeout:.0f} s")
    results = [line[len(PEER_TAG):] for line in proc.stdout.splitlines() if line.startswith(PEER_TAG)]
    if proc.returncode or not results:
        tail = proc.stderr.strip().splitlines()[-20:] or ["no output"]
        print("\n".join(f"    | {line}" for line in tail))
        return RunResult(peer.name, work.num_seqs, error=f"exit status {proc.returncode}: {tail[-1]}")
    result = json.loads(results[-1])
    if "skipped" in result:
        return RunResult(peer.name, work.num_seqs, error=f"skipped: {result['skipped']}")
    label = " ".join(filter(None, [peer.name, result["version"]]))
    note = "" if result["output_tokens"] == work.output_tokens else f"expected {work.output_tokens} output tokens"
    return RunResult(label, work.num_seqs, result["output_tokens"], result["seconds"], note)


def peer_job(job_path: str) -> None:
    """The peer's side (`python bench.py --peer-job JOB`): import it, build its LLM on the checkpoint,
    generate the warm-up workload, time one generate of the workload; print PEER_TAG + JSON."""
    import importlib
    with open(job_path) as f:
        job = json.load(f)
    try:
        peer = importlib.import_module(job["module"])
    except Exception as e:  # not installed, or a dependency missing (nano-vllm imports flash_attn)
        print(PEER_TAG + json.dumps({"skipped": f"{job['module']} does not import: {type(e).__name__}: {e}"}))
        return
    llm = peer.LLM(job["model"], **job["engine_args"])

    def generate(work: dict) -> int:
        prompts = [{"prompt_token_ids": p} if job["prompt_dicts"] else p for p in work["prompts"]]
        params = [peer.SamplingParams(temperature=work["temperature"], ignore_eos=True, max_tokens=n)
                  for n in work["max_tokens"]]
        outs = llm.generate(prompts, params, use_tqdm=False)  # nano-vllm: dicts; vLLM: RequestOutputs
        return sum(len(o["token_ids"] if isinstance(o, dict) else o.outputs[0].token_ids) for o in outs)

    generate(job["warmup"])
    start = time.perf_counter()
    tokens = generate(job["workload"])
    seconds = time.perf_counter() - start
    print(PEER_TAG + json.dumps({"version": getattr(peer, "__version__", None), "seconds": seconds,
                                 "output_tokens": tokens}), flush=True)


# ---- sections ----------------------------------------------------------------------------------
def section_run(setup: Setup) -> RunResult:
    label = "nanograph (CUDA graphs)" if is_cuda(setup.device) else "nanograph (CPU, no graphs)"
    result = run_nanograph(setup, label, setup.workload, probe=setup.args.overlap)
    print_run(result, setup.workload)
    return result


def same_set_ratios(rows: list[RunResult]) -> list[float | None]:
    """Each row's tok/s over that of the first row that ran the same number of (leading)
    sequences: nanograph's with graphs, which comes first in each set."""
    base = {}
    for r in rows:
        base.setdefault(r.num_seqs, r.tokens_per_s)
    return [r.tokens_per_s / base[r.num_seqs] if base[r.num_seqs] and not r.error else None for r in rows]


def section_compare(setup: Setup, graphs: RunResult) -> list[RunResult]:
    rows = [graphs, run_nanograph(setup, "nanograph (eager)", setup.workload, enforce_eager=True)]
    subset = setup.workload.head(setup.args.hf_seqs)
    if 0 < subset.num_seqs < setup.workload.num_seqs:  # HF's sequences, on nanograph too
        rows.append(run_nanograph(setup, f"{graphs.engine}, first {subset.num_seqs} sequences", subset))
    rows.append(run_hf(setup, setup.workload))
    checkpoint = setup.model_dir if setup.load_format != "dummy" else write_checkpoint(setup)  # once, for every peer
    rows += [run_peer(setup, peer, checkpoint) for peer in PEERS]
    for r, ratio in zip(rows, same_set_ratios(rows)):
        r.vs_nanograph = ratio
    print_table("Throughput (tok/s = output tokens / generate wall time); each ratio is against nanograph with "
                "graphs on the same sequences",
                ["engine", "seqs", "output tokens", "seconds", "tok/s", "vs nanograph", "note"],
                [[r.engine, r.num_seqs, f"{r.output_tokens:,}", f"{r.seconds:.2f}",
                  f"{r.tokens_per_s:,.0f}" if not r.error else "-", cell(r.vs_nanograph, ".3f", "x"),
                  (r.error if r.error.startswith("skipped") else f"ERROR {r.error}") if r.error else r.note]
                 for r in rows])
    return rows


def section_overlap(setup: Setup, run: RunResult) -> list[RunResult]:
    """Overlap scheduling on and off: `run` is one of the two, the other mode gets an engine here."""
    other = not run.stats["overlap_scheduling"]
    rows = [run, run_nanograph(setup, f"nanograph, overlap {on_off(other)}", setup.workload, probe=True,
                               overlap_scheduling=other)]
    rows.sort(key=lambda r: not r.stats["overlap_scheduling"])  # on first
    (prompt_len, new_tokens), n = setup.args.latency_lengths, setup.workload.num_seqs
    print_table("Overlap scheduling, same workload; batch 1: ms per generated token through generate (temperature "
                "0.6, and greedy), and the graph step alone",
                ["overlap", "tok/s", "batch-1 ms/token", "greedy ms/token", "graph step b1 ms", "ms/token / step",
                 "greedy / step", "GPU busy, 1 seq", f"GPU busy, {n} seqs", "discarded tokens"],
                [[on_off(r.stats["overlap_scheduling"]), f"{r.tokens_per_s:,.0f}", cell(r.probe["ms_per_token"]),
                  cell(r.probe["greedy_ms_per_token"]), cell(r.probe.get("graph_step_ms")),
                  cell(r.probe.get("vs_step"), ".2f", "x"), cell(r.probe.get("greedy_vs_step"), ".2f", "x"),
                  cell(r.probe.get("gpu_busy_batch1"), ".1%"), cell(r.probe.get("gpu_busy_workload"), ".1%"),
                  r.stats.get("overlap_discarded_tokens", "-")] for r in rows])
    if is_cuda(setup.device):
        print(f"  GPU busy: union of kernel and copy intervals / span from the first to the last, under torch.profiler,"
              f" in calls after the timed ones (the profiler slows the host): 1 sequence (prompt {prompt_len}, "
              f"{new_tokens} new tokens), and the workload's {n} with prompts cut to 16 tokens, {new_tokens // 2} new")
    else:
        print("  (CPU: no graph step and no GPU to profile: busy shares skipped)")
    return rows


def section_ladders(setup: Setup) -> list[RunResult]:
    rows = []
    for policy in LADDER_POLICIES:
        print(f"  ladder {policy} ...", flush=True)
        rows.append(run_nanograph(setup, policy, setup.workload,
                                  cuda_graph_sizes=ladder_sizes(policy, LADDER_MAX_BS)))
    print_table("Bucket ladders, same workload (graph figures of the timed call)",
                ["ladder", "graphs", "capture s", "graph MiB", "hit rate", "padding", "tok/s", "sizes"],
                [[r.engine, r.stats.get("num_graphs"), f"{r.stats.get('capture_seconds', 0):.2f}",
                  mib(r.stats.get("graph_memory_bytes", 0)), f"{r.stats.get('graph_hit_rate', 0):.1%}",
                  f"{r.stats.get('padding_waste', 0):.1%}", f"{r.tokens_per_s:,.0f}",
                  r.stats.get("cuda_graph_sizes")] for r in rows])
    return rows


def decode_step(batch: int, context_len: int, block_size: int):
    """One decode token per sequence at position context_len - 1, each sequence on its own
    consecutive blocks (the cache content does not matter for timing)."""
    from nanograph.engine.model_runner import StepInput
    blocks = -(-context_len // block_size)
    tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(batch)]
    pos = context_len - 1
    return StepInput(is_prefill=False, input_ids=[1] * batch, positions=[pos] * batch,
                     slot_mapping=[t[pos // block_size] * block_size + pos % block_size for t in tables],
                     context_lens=[context_len] * batch, block_tables=tables,
                     cu_seqlens_q=list(range(batch + 1)), temperatures=[0.6] * batch, seeds=list(range(batch)))


@contextmanager
def eager(runner):
    """Run the same engine without its graphs: exactly the path enforce_eager=True takes."""
    graphs, runner.graphs = runner.graphs, None
    try:
        yield
    finally:
        runner.graphs = graphs


def time_forward(runner, step, device: str, iters: int) -> float:
    return seconds_per_call(lambda: runner.forward(step), device, iters, warmup=3)


def per_token_latency(llm, setup: Setup, prompt_len: int, new_tokens: int, seed: int,
                      temperature: float = 0.6) -> float | None:
    """Seconds per generated token of one sequence: (generate n tokens - generate 1) / (n - 1).
    Subtracting the 1-token run removes the prefill; fresh random prompts avoid prefix-cache hits;
    the best of three runs of each filters out noise. None if noise still wins (a loaded CPU).
    Temperature 0.6 as in the workload, 0 for greedy (the sampler runs inside the decode graph either way)."""
    from nanograph import SamplingParams
    rng = random.Random(seed)

    def once(n: int) -> float:
        prompt = [rng.randint(0, setup.max_token_id) for _ in range(prompt_len)]
        params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n)
        synchronize(setup.device)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        synchronize(setup.device)
        return time.perf_counter() - start

    once(new_tokens)  # warm-up
    one = min(once(1) for _ in range(3))
    many = min(once(new_tokens) for _ in range(3))
    return (many - one) / (new_tokens - 1) if many > one else None


def sweep_engine(setup: Setup, sizes: list[int], **overrides):
    """One engine for a whole sweep: a graph for exactly each sweep size, and a KV cache just
    big enough for the largest batch at the sweep's context length."""
    block_size = 256  # the engine's default kvcache_block_size
    blocks = sizes[-1] * -(-setup.args.sweep_context_len // block_size)
    return setup.llm(num_kvcache_blocks=blocks, kvcache_block_size=block_size,
                     cuda_graph_sizes=sizes if is_cuda(setup.device) else None, **overrides)


def measure_decode_sweep(llm, setup: Setup) -> dict:
    args, runner = setup.args, llm.runner
    ctx = args.sweep_context_len
    weights = weight_read_bytes(runner.model, bool(getattr(llm.config.hf_config, "tie_word_embeddings", False)))
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
        rows.append({"batch": bs, "graph_ms": ms(graph_s), "eager_ms": ms(eager_s), "floor_ms": ms(floor_s),
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


def print_decode_sweep(sweep: dict, cuda: bool) -> None:
    if not cuda:
        print("\n(CPU: no CUDA graphs, the decode sweep times the eager path only)")
    b = sweep["batch1"]
    print_table(f"One decode step (forward and sampling at temperature 0.6), context {sweep['context_len']}, {sweep['iters']} iterations; "
                f"floor = (weights + the batch's K/V) / {b['copy_bandwidth_Bps'] / 1e9:,.1f} GB/s",
                ["batch", "graph ms", "eager ms", "speed-up", "floor ms", "graph/floor", "graph tok/s"],
                [[r["batch"], cell(r["graph_ms"]), cell(r["eager_ms"]), cell(r["speedup"], ".2f", "x"),
                  cell(r["floor_ms"]), cell(r["graph_vs_floor"], ".2f", "x"),
                  cell(r["batch"] / r["graph_ms"] * 1e3 if r["graph_ms"] else None, ",.0f")] for r in sweep["rows"]])
    floor, step1 = b["floor_ms_per_token"], sweep["rows"][0]["graph_ms"]
    print(f"\nBatch-1 latency (generate: schedule + forward + sample), prompt {b['prompt_len']}, "
          f"{b['new_tokens']} new tokens:")
    for name in ("graphs", "eager"):
        if f"{name}_ms_per_token" not in b:
            continue
        value = b[f"{name}_ms_per_token"]
        if value is None:
            print(f"  {name:<7} too noisy to measure")
        else:
            vs_step = f", {value / step1:.2f}x the graph step" if step1 and name == "graphs" else ""
            print(f"  {name:<7} {value:8.3f} ms/token  {1e3 / value:10,.1f} tok/s  ({value / floor:.2f}x the floor{vs_step})")
    print(f"  floor   {floor:8.3f} ms/token  {1e3 / floor:10,.1f} tok/s  = {b['weight_bytes'] / 2**20:,.1f} MiB "
          f"of weights / {b['copy_bandwidth_Bps'] / 1e9:,.1f} GB/s measured copy bandwidth")


def section_decode_sweep(setup: Setup) -> dict:
    sizes = sweep_sizes(setup.args.sweep_max_bs)
    print(f"  [decode sweep] batches {sizes}, context {setup.args.sweep_context_len} ...", flush=True)
    with sweep_engine(setup, sizes) as llm:
        sweep = measure_decode_sweep(llm, setup)
    report_leftover_memory("the decode-sweep engine")
    print_decode_sweep(sweep, is_cuda(setup.device))
    return sweep


# ---- multi-LoRA --------------------------------------------------------------------------------
LORA_CAPTURE_RANK = 64      # the capture figures' max_lora_rank (issue 13's target)
LORA_E2E = (64, 128)        # end-to-end: the workload's first 64 sequences, at most 128 new tokens each
LORA_TARGETS = {"adapter_vs_base": 1.25, "no_adapter_vs_base": 1.03, "capture_seconds": 15.0,
                "graph_memory_bytes": 2 * 2**30}  # Qwen3-0.6B shape on an H100, rank 16, batch <= 64


def write_lora_adapters(model_dir: str, n: int, rank: int, dtype: str, root: str, std: float = 0.02) -> list:
    """n PEFT adapter directories of rank `rank` for the model in model_dir, on all seven
    projections of every layer: random weights of std `std` (0.02: as the dummy base weights),
    lora_alpha = 2 rank. The values do not matter for speed, only for the token-id check."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from nanograph.adapter import TARGETS, LoRARequest, module_shapes
    hf = AutoConfig.from_pretrained(model_dir)
    shapes, requests = module_shapes(hf), []
    for a in range(n):
        gen, tensors = torch.Generator().manual_seed(100 + a), {}
        for i in range(hf.num_hidden_layers):
            for module in TARGETS:
                out, inp = shapes[module]
                block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                for ab, shape in (("A", (rank, inp)), ("B", (out, rank))):
                    weight = (torch.randn(shape, generator=gen) * std).to(getattr(torch, dtype))
                    tensors[f"base_model.model.model.layers.{i}.{block}.{module}.lora_{ab}.weight"] = weight
        path = tempfile.mkdtemp(prefix=f"lora{a}-", dir=root)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                       "bias": "none"}, f)
        requests.append(LoRARequest(f"random-r{rank}-{a}", path))
    return requests


def lora_sweep_row(setup: Setup, base, lora, bs: int, rank: int, n: int) -> dict:
    """One batch size: the base engine's step, the LoRA engine's without adapters, and with the
    n adapters round-robin over the rows (slots 0..n-1), each the best of --lora's rounds."""
    from dataclasses import replace
    step = decode_step(bs, setup.args.sweep_context_len, base.block_size)
    cases = {"base_ms": (base, step), "no_adapter_ms": (lora, step),
             "adapter_ms": (lora, replace(step, lora_slots=[i % n for i in range(bs)], lora_rank=rank))}
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(setup.args.lora_rounds):  # in turn: a drift of the clocks hits the three alike
        for key, (runner, s) in cases.items():
            best[key] = min(best[key], ms(time_forward(runner, s, setup.device, setup.args.sweep_iters)))
    return {"batch": bs, **best, "no_adapter_vs_base": best["no_adapter_ms"] / best["base_ms"],
            "adapter_vs_base": best["adapter_ms"] / best["base_ms"]}


def measure_lora_sweep(setup: Setup, adapters: list) -> dict:
    """A base engine and a LoRA engine (max_loras = the adapters, max_lora_rank = their rank), alive
    together with the same ladder (= the sweep sizes) and KV cache, the adapters loaded in slots."""
    from nanograph.layers.lora_slots import load_adapter
    from nanograph.adapter import read_adapter
    args = setup.args
    sizes = ladder_sizes("pow2", min(64, args.sweep_max_bs))
    rank = args.lora_rank  # the step's rank bucket: with max_lora_rank = R, R is a bucket (layers/lora_slots.py)
    with sweep_engine(setup, sizes) as base, sweep_engine(setup, sizes, enable_lora=True, max_loras=len(adapters),
                                                           max_lora_rank=args.lora_rank) as lora:
        for slot, request in enumerate(adapters):
            load_adapter(lora.runner.model, slot, read_adapter(request, lora.config.hf_config, args.lora_rank))
        rows = [lora_sweep_row(setup, base.runner, lora.runner, bs, rank, len(adapters)) for bs in sizes]
    report_leftover_memory("the LoRA sweep engines")
    return {"context_len": args.sweep_context_len, "iters": args.sweep_iters, "rounds": args.lora_rounds,
            "rank_bucket": rank, "rows": rows}


def triton_lora_compiles(device: str) -> int:
    """The LoRA kernels' compiles in Triton's on-disk cache (one directory each); 0 on the CPU."""
    if not is_cuda(device):
        return 0
    try:
        from triton import knobs
        root = knobs.cache.dir
    except ImportError:  # Triton < 3.4
        root = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    return sum(len(glob.glob(os.path.join(root, "*", f"_{k}_kernel.json"))) for k in ("shrink", "expand"))


def capture_engine(setup: Setup, label: str, capture: list, **overrides):
    """An engine with the default ladder, its capture figures appended to `capture`. Built again if
    Triton compiled LoRA kernels during its capture (a first run on this machine): the row the
    targets read is the warm one, the first is kept apart."""
    before = triton_lora_compiles(setup.device)
    llm = setup.llm(**overrides)
    compiles = triton_lora_compiles(setup.device) - before
    stats = llm.stats()
    capture.append({"engine": label + (", first build" if compiles else ""), "triton_lora_compiles": compiles,
                    **{k: stats.get(k) for k in ("num_graphs", "capture_seconds", "graph_memory_bytes")}})
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
        rows.append(RunResult(label, work.num_seqs, sum(map(len, outs)), seconds, stats=stats).to_dict())
        tokens.append(outs)
    with capture_engine(setup, "base", capture) as llm:
        e2e(llm, "base engine")
    report_leftover_memory("the base engine")
    rank = max(LORA_CAPTURE_RANK, setup.args.lora_rank)
    with capture_engine(setup, f"LoRA (max_loras {len(adapters)}, max_lora_rank {rank})", capture, enable_lora=True,
                        max_loras=len(adapters), max_lora_rank=rank) as llm:
        e2e(llm, "LoRA engine, no adapters")
        e2e(llm, f"LoRA engine, {len(adapters)} adapters round-robin", adapters)
    report_leftover_memory("the LoRA engine")
    base, plain, lora = tokens
    return capture, {"workload": work.summary(), "rows": rows,
                     "changed_by_adapters": sum(a != b for a, b in zip(plain, lora)),
                     "no_adapters_equal_base": sum(a == b for a, b in zip(plain, base))}


def print_lora(report: dict, cuda: bool) -> None:
    sweep, t = report["sweep"], LORA_TARGETS
    print_table(f"Multi-LoRA decode step ({'graph' if cuda else 'CPU: eager'}, forward only), context "
                f"{sweep['context_len']}, best of {sweep['rounds']} rounds of {sweep['iters']} steps; "
                f"{report['adapters']} random adapters of rank {report['rank']} round-robin over the rows. Targets "
                f"(Qwen3-0.6B shape, H100, rank 16): adapters / base <= {t['adapter_vs_base']}x, no adapters / base "
                f"<= {t['no_adapter_vs_base']}x",
                ["batch", "base ms", "LoRA engine, no adapters ms", "adapters ms", "no adapters / base",
                 "adapters / base"],
                [[x["batch"], cell(x["base_ms"]), cell(x["no_adapter_ms"]), cell(x["adapter_ms"]),
                  cell(x["no_adapter_vs_base"], ".3f", "x"), cell(x["adapter_vs_base"], ".3f", "x")]
                 for x in sweep["rows"]])
    if cuda:
        print_table(f"Graph capture, default ladder. Targets (the LoRA engine): capture <= {t['capture_seconds']:.0f} "
                    f"s, graph memory <= {mib(t['graph_memory_bytes'])} MiB. A first build whose capture compiled "
                    "LoRA kernels (Triton JIT, cached on disk for later runs) is shown apart",
                    ["engine", "graphs", "capture s", "graph MiB", "LoRA kernel compiles"],
                    [[c["engine"], c["num_graphs"], f"{c['capture_seconds']:.2f}", mib(c["graph_memory_bytes"]),
                      c["triton_lora_compiles"]] for c in report["capture"]])
    else:
        print("\n(CPU: no CUDA graphs, capture figures skipped)")
    e2e, w = report["e2e"], report["e2e"]["workload"]
    print_table(f"Multi-LoRA end to end: the workload's first {w['num_seqs']} sequences, at most {LORA_E2E[1]} new "
                f"tokens each, greedy ({w['output_tokens']:,} output tokens), default ladder",
                ["engine", "output tokens", "seconds", "tok/s", "vs LoRA engine, no adapters"],
                [[x["engine"], f"{x['output_tokens']:,}", f"{x['seconds']:.2f}", f"{x['tokens_per_s']:,.0f}",
                  f"{x['tokens_per_s'] / e2e['rows'][1]['tokens_per_s']:.3f}x"] for x in e2e["rows"]])
    print(f"  token ids: the adapters change {e2e['changed_by_adapters']} of {w['num_seqs']} sequences; without "
          f"adapters the LoRA engine's equal the base engine's in {e2e['no_adapters_equal_base']} of {w['num_seqs']}")


def section_lora(setup: Setup) -> dict:
    args = setup.args
    if args.tp > 1:
        print("\n(--lora skipped: the sweep keeps two engines side by side, which needs --tp 1)")
        return {"skipped": "needs --tp 1"}
    print(f"  [LoRA] {args.lora} random adapters of rank {args.lora_rank}: sweep, capture, end to end ...", flush=True)
    # --quick: 10x larger, or they would not change the tiny model's greedy tokens (its residual stream is
    # mostly the token's embedding, so it repeats its last prompt token)
    adapters = write_lora_adapters(setup.model_dir, args.lora, args.lora_rank, setup.dtype, setup.tmp,
                                   std=0.2 if args.quick else 0.02)
    report = {"adapters": args.lora, "rank": args.lora_rank, "targets": LORA_TARGETS,
              "sweep": measure_lora_sweep(setup, adapters)}
    capture, report["e2e"] = measure_lora_engines(setup, adapters)
    report["capture"] = capture if is_cuda(setup.device) else {"skipped": "no CUDA graphs on the CPU"}
    print_lora(report, is_cuda(setup.device))
    return report


# ---- plot --------------------------------------------------------------------------------------
def throughput_bars(shapes: dict) -> list[tuple[str, float]]:
    bars = []
    for name, report in shapes.items():
        prefix = f"{name}: " if len(shapes) > 1 else ""
        rows = list(report.get("compare", {}).get("rows") or ([report["run"]] if "run" in report else []))
        rows += [r for r in report.get("overlap", {}).get("rows", []) if r["engine"] != report["run"]["engine"]]
        rows += [dict(r, engine=f"ladder {r['engine']}") for r in report.get("ladders", {}).get("rows", [])]
        bars += [(prefix + r["engine"].split(" [")[0].replace(" (continuous batching)", "")
                  + (f" ({r['note']})" if r["note"] else ""), r["tokens_per_s"]) for r in rows if not r["error"]]
    return bars


def write_plot(path: str, report: dict) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(--plot skipped: matplotlib is not installed; pip install matplotlib)")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    shapes = report["shapes"]
    sweeps = {name: r["decode_sweep"] for name, r in shapes.items() if r.get("decode_sweep", {}).get("rows")}
    for name, sweep in sweeps.items():
        prefix = f"{name}, " if len(shapes) > 1 else ""
        for key, style, what in (("graph_ms", "o-", "CUDA graph"), ("eager_ms", "s--", "eager")):
            points = [(r["batch"], r[key]) for r in sweep["rows"] if r[key]]
            if points:
                left.plot(*zip(*points), style, label=prefix + what)
    if sweeps:
        batches = sorted({r["batch"] for sweep in sweeps.values() for r in sweep["rows"]})
        left.set_xscale("log", base=2)
        left.set_xticks(batches, [str(b) for b in batches], fontsize=7)
        left.set_xlabel("batch size")
        left.set_ylabel("ms per decode step")
        left.set_title(f"Decode step latency, context {next(iter(sweeps.values()))['context_len']}")
        left.legend(fontsize=7)
        left.grid(True, alpha=0.3)
    else:
        left.text(0.5, 0.5, "decode sweep not run", ha="center", va="center")
        left.set_axis_off()
    bars = throughput_bars(shapes)
    if bars:
        names, values = zip(*bars)
        right.barh(range(len(values)), values)
        right.set_yticks(range(len(values)), names)
        right.invert_yaxis()
        right.set_xlabel("output tokens / s")
        right.set_title("Throughput, reference workload" if not report["meta"]["quick"] else "Throughput (quick)")
        for i, v in enumerate(values):
            right.text(v, i, f" {v:,.0f}", va="center")
        right.set_xlim(0, max(values) * 1.2 or 1)
    else:
        right.text(0.5, 0.5, "no throughput run", ha="center", va="center")
        right.set_axis_off()
    fig.suptitle(f"nanograph bench: {', '.join(shapes)} on {report['meta']['device_name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot written to {path}")


# ---- main --------------------------------------------------------------------------------------
def shape_list(text: str) -> list[str]:
    names = text.split(",")
    unknown = [name for name in names if name not in BENCH_SHAPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown shape(s) {', '.join(unknown)} (known: {', '.join(BENCH_SHAPES)})")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=shape_list, default=["qwen3-0.6b"],
                   help=f"model shape(s) with random weights, comma-separated, each running every section in turn "
                        f"({', '.join(BENCH_SHAPES)}; default qwen3-0.6b)")
    p.add_argument("--model", help="a real checkpoint (local dir or hub id) instead of --shape")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", help="default bfloat16 (float32 with --quick)")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--attention-backend", type=lambda t: t.split(","), default=["auto"],
                   help="comma-separated: run every section once per backend, in this process (e.g. triton,flash_attn)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--num-kvcache-blocks", type=int, help="fix the KV cache size (default: from memory)")
    p.add_argument("--quick", action="store_true", help="tiny model and workload (CI); every section runs, tiny")
    p.add_argument("--compare", action="store_true",
                   help="nanograph graphs vs eager vs HF transformers vs the peers (nano-vllm, vLLM) that import")
    p.add_argument("--run", action="store_true", help="the reference workload (the default when no section is named)")
    p.add_argument("--ladders", action="store_true", help="the workload under each bucket ladder")
    p.add_argument("--decode-sweep", action="store_true", help="decode-step latency vs batch size, graph vs eager")
    p.add_argument("--overlap", action="store_true", help="overlap scheduling on vs off: throughput, batch 1, GPU busy")
    p.add_argument("--lora", type=int, default=0, metavar="N",
                   help="multi-LoRA with N random adapters: decode sweep with/without adapters, capture, end to end")
    p.add_argument("--lora-rank", type=int, default=16, metavar="R", help="the --lora adapters' rank (default 16)")
    p.add_argument("--all", action="store_true", help="--decode-sweep --compare --ladders --overlap --lora 4")
    p.add_argument("--hf-seqs", type=int, default=32,
                   help="HF runs the first N sequences of the workload (default 32; 256 = all of it; 0 = skip HF)")
    p.add_argument("--hf-timeout", type=float, default=300.0, help="give up on HF after this many seconds")
    p.add_argument("--peer-path", default=os.pathsep.join(sorted(glob.glob(os.path.join(PEER_DIR, "*")))),
                   help=f"prepended to the peers' PYTHONPATH ({os.pathsep}-separated; default: the directories in "
                        f"{PEER_DIR})")
    p.add_argument("--peer-timeout", type=float, default=600.0, help="give up on a peer's subprocess after this many "
                                                                      "seconds (start-up included)")
    p.add_argument("--sweep-max-bs", type=int, help="largest decode-sweep batch (default 256, 8 with --quick)")
    p.add_argument("--sweep-context-len", type=int, help="decode-sweep context length (default 512, 32 with --quick)")
    p.add_argument("--sweep-iters", type=int, help="timed steps per size (default 20, 3 with --quick)")
    p.add_argument("--json", help="write every figure to this JSON file")
    p.add_argument("--plot", help="write a PNG: decode latency vs batch and throughput bars (needs matplotlib)")
    args = p.parse_args(argv)
    if args.lora < 0 or args.lora_rank < 1:
        p.error("--lora N needs N >= 0 and --lora-rank R >= 1")
    if args.all:
        args.decode_sweep = args.compare = args.ladders = args.overlap = True
        args.lora = args.lora or 4
    args.run_default = args.run or args.compare or args.overlap or not (args.ladders or args.decode_sweep or args.lora)
    args.sweep_max_bs = args.sweep_max_bs or (8 if args.quick else 256)
    args.sweep_context_len = args.sweep_context_len or (32 if args.quick else 512)
    args.sweep_iters = args.sweep_iters or (3 if args.quick else 20)
    args.lora_rounds = 1 if args.quick else 3  # --lora sweep: best of this many rounds of the three columns
    args.bandwidth_mib = 64 if args.quick else 1024
    args.latency_lengths = (8, 16) if args.quick else (128, 128)  # batch-1 latency: prompt, new tokens
    if args.quick:
        args.max_model_len = min(args.max_model_len, 256)
    return args


def build_setup(args: argparse.Namespace, tmp: str, name: str) -> Setup:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("float32" if args.quick else "bfloat16")
    if args.model:
        from transformers import AutoConfig
        model_dir, load_format = args.model, "auto"
        if not os.path.isdir(model_dir):
            from nanograph.utils.loader import resolve_model_dir
            model_dir = resolve_model_dir(model_dir)
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    else:
        shape = quick_shape(name) if args.quick else name
        model_dir, load_format = write_model_dir(shape, tmp), "dummy"
        vocab = SHAPES[shape]["vocab_size"]
    max_token_id = min(10000, vocab - 1)
    workload = quick_workload() if args.quick else make_workload(max_token_id=max_token_id)
    if not args.quick and max_token_id == 10000:
        total = workload.output_tokens
        assert total == REFERENCE_OUTPUT_TOKENS, f"reference workload has {total} output tokens, not {REFERENCE_OUTPUT_TOKENS}"
    return Setup(args, name, model_dir, load_format, device, dtype, workload,
                 warmup_workload(args.quick, max_token_id), max_token_id, tmp)


def meta(setup: Setup, names: list[str]) -> dict:
    import transformers
    cuda = is_cuda(setup.device)
    return {"models": names, "load_format": setup.load_format, "device": setup.device, "dtype": setup.dtype,
            "tp": setup.args.tp, "quick": setup.args.quick, "max_model_len": setup.args.max_model_len,
            "device_name": torch.cuda.get_device_name(setup.device) if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}


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
        if is_cuda(setup.device):
            report["ladders"] = {"rows": [r.to_dict() for r in section_ladders(setup)]}
        else:
            print("\n(ladders skipped: bucket ladders are CUDA graphs, and there are none on the CPU)")
            report["ladders"] = {"skipped": "no CUDA graphs on the CPU"}
    return report


def main(argv=None) -> dict:
    args = parse_args(argv)
    names = [args.model] if args.model else args.shape
    with tempfile.TemporaryDirectory(prefix="nanograph-bench-") as tmp:
        setups = [build_setup(args, tmp, name) for name in names]
        m, w = meta(setups[0], names), setups[0].workload
        report = {"meta": m, "workload": w.summary(), "shapes": {}}
        print(f"nanograph bench: {', '.join(names)}{' (--quick: tiny models)' if args.quick else ''} "
              f"({setups[0].load_format} weights, {m['dtype']}) on {m['device_name']}, tp={args.tp}; "
              f"torch {m['torch']}, transformers {m['transformers']}")
        print(f"workload: {w.num_seqs} sequences, {w.prompt_tokens:,} prompt tokens, {w.output_tokens:,} output tokens"
              + (" (the reference workload)" if w.output_tokens == REFERENCE_OUTPUT_TOKENS else ""))
        for setup in setups:
            for backend in args.attention_backend:
                setup.attention_backend = backend
                key = setup.name if len(args.attention_backend) == 1 else f"{setup.name} ({backend})"
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
    if sys.argv[1:2] == ["--peer-job"]:  # a peer's subprocess (run_peer)
        peer_job(sys.argv[2])
    else:
        main()
