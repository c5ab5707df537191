"""Captured CUDA graphs: record each step shape once, replay it every step.

Why: a decode step of a small model is hundreds of small kernels. Launched one by one from
Python, the CPU cannot keep the GPU busy (at batch 1 the launches take longer than the math).
A CUDA graph records the whole launch sequence once; a replay submits it with one call.

What makes replay possible:
- Static buffers. A graph replays fixed pointers, so every input lives in the runner's
  `StepBuffers` (engine/step.py), one int32 device tensor allocated once for the largest step:
  token ids, positions, slot mapping, context lengths, block tables, the sampling rows' inputs,
  laid out by the graph's shape, so its views never move. Before a replay the runner fills them
  with one host-to-device copy. Input ids may be placeholders for tokens the previous step
  sampled (docs/walkthrough.md): the graph's first op swaps them in from the device.
- Buckets. A graph also fixes its shapes, so a live step runs on the smallest graph that holds
  it. The rows it does not fill are padding, neutralised by slot -1 (their K/V is written
  nowhere), context length 0 (attention reads nothing) and, in the prefill part, chunks of
  length 0 (no queries). Their logits are computed and ignored; nothing reduces across rows.
- One memory pool. Graphs are captured largest first into a shared pool: a smaller graph's
  intermediates fit in memory the larger one already reserved, so the set costs about one
  graph's activations, not the sum. Every graph writes its logits and sampled ids into one
  output pair, read right after the replay.
- Warm-up. Each graph's forward runs once eagerly before capture, so Triton autotuning,
  torch.compile and cuBLAS workspace allocations happen outside the recording.

Which graphs. Keys are (decode rows d, prefill tokens p, variant):
- Decode graphs (p = 0): the ladder 1, 2, 4, 8, then sizes shrinking geometrically by 4/5 down
  from `cuda_graph_max_bs` (default min(max_num_seqs, 512)), multiples of 8 (after
  Megatron-Core): padding at most 25% with a number of graphs logarithmic in the largest batch;
  or `cuda_graph_sizes`. An extension may ask for variants of them (model_runner.py): every
  decode bucket then also gets one graph per variant (LoRA: one per rank bucket), and a step
  names the variant it needs (0 = the base model's).
- Mixed graphs (the decode rows, then prefill chunks: scheduler.py): a grid of decode buckets
  (powers of two) by prefill-token buckets (powers of two from 64 up to `max_num_mixed_tokens`),
  with room for MIXED_PREFILL_CHUNKS chunks. A step's decode rows take the smallest decode bucket
  that holds them and its chunks' tokens the smallest prefill bucket: since the prefill budget
  shrinks as decode rows take seats, d + p stays within `max_num_mixed_tokens` (while
  `max_num_seqs` is well below it), and a larger decode bucket needs only the smaller prefill
  buckets, which keeps the grid to about three times the decode ladder. The prefill kernel's grid
  comes from p, never from the live chunks. Only each chunk's last token (and each decode row) goes
  through the LM head and the sampler. Mixed graphs come in two variants only, 0 and the last
  (an extension lists its variants so that the last can run a step of any other: LoRA's largest
  rank bucket), and only with the triton attention backend (the others size prefill attention on
  the host).
An extension may add graphs of prefill-only shapes of its own (model_runner.py; spec/'s verify
steps): a prefill-only step runs on the smallest of them that holds it, if any.
Other prefill-only steps (nothing decodes), steps above the largest graph and the rest run eagerly,
counted (`stats()`): the hit rates and the padding waste (padded rows or tokens / real ones) say
what the graphs cost and buy. Every tensor-parallel rank computes the same graphs from the same
config and picks the same one for a step, as its collectives require.

Inside a graph the sampler runs too (layers/sampler.py): the sampled ids stay in the runner's
buffer, where the next step resolves its placeholders. What runs outside: filling the host mirror
and its copy, the copy of the ids back to the host, and only where a row asks for them, top-k /
top-p, the min_tokens mask and logprobs, on the graph's logits (model_runner.py).
"""
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from nanograph.engine.step import StepBuffers, StepInput, StepShape

log = logging.getLogger("nanograph")

MIXED_PREFILL_CHUNKS = 8  # prefill chunks a mixed graph holds
MIN_PREFILL_BUCKET = 64   # the smallest prefill-token bucket


def bucket_ladder(max_bs):
    """1, 2, 4, 8, then sizes shrinking geometrically by 4/5 down from max_bs, multiples of 8."""
    sizes, s = [s for s in (1, 2, 4, 8) if s < max_bs], max_bs
    while s > 8:
        sizes.append(s)
        s = (s * 4 // 5) // 8 * 8  # keep sizes multiples of 8: GEMM tiles like them
    return sorted(set(sizes + [max_bs]))


def find_bucket(ladder: list[int], n: int):
    """Smallest bucket that holds n; None when n is above the ladder (run eager)."""
    return next((bs for bs in ladder if bs >= n), None)


def mixed_grid(max_bs, budget: int):
    """(decode bucket, prefill bucket) pairs that a step of at most `budget` tokens, at least one
    of them decoding and one prefilling, can need; both ladders powers of two (decode rows cost
    little next to prefill tokens, so the coarser ladder pads them for half the graphs)."""
    decode_ladder = [d for d in (1 << i for i in range(32)) if d < max_bs] + [max_bs]
    prefill_ladder = [p for p in (MIN_PREFILL_BUCKET << i for i in range(32))
                      if p < budget] + [budget]
    grid = []
    for smaller, d in zip([0] + decode_ladder, decode_ladder):
        fewest_decodes = smaller + 1  # the fewest decode rows that take bucket d
        if fewest_decodes < budget:
            most_prefill = find_bucket(prefill_ladder, budget - fewest_decodes)
            grid += [(d, p) for p in prefill_ladder if p <= most_prefill]
    return grid


def decode_shape(d: int, variant=0) -> StepShape:
    return StepShape(decodes=d, rows=d, variant=variant)


def mixed_shape(d: int, p: int, variant=0) -> StepShape:
    chunks = MIXED_PREFILL_CHUNKS
    return StepShape(decodes=d, prefill_tokens=p, chunks=chunks, rows=d + chunks, max_chunk=p,
                     variant=variant)


def holds(bucket: StepShape, step: StepShape) -> bool:
    """Whether a prefill-only graph of shape `bucket` can run a prefill-only `step`."""
    return bucket.variant == step.variant and all(
        getattr(bucket, name) >= getattr(step, name)
        for name in ("prefill_tokens", "chunks", "rows", "max_chunk"))


@dataclass
class GraphStats:
    """What the graphs did, step by step: measured, not assumed. Counters only, so that the
    figures of one call are the difference of two snapshots (bench.py)."""
    replays: Counter = field(default_factory=Counter)  # StepShape -> replays
    eager: Counter = field(default_factory=Counter)    # "decode" / "mixed" / "prefill" -> steps
    real_rows: int = 0      # decode rows of real sequences over all decode replays
    real_tokens: int = 0    # tokens of real sequences over all mixed replays

    def as_dict(self):
        decode, mixed = Counter(), Counter()
        for shape, n in self.replays.items():
            if shape.decodes or not shape.prefill_tokens:  # (spec's verify graphs: its own figures)
                (mixed if shape.prefill_tokens else decode)[shape.tokens] += n
        figures = {}
        for kind, prefix, replays, real in (("decode", "", decode, self.real_rows),
                                            ("mixed", "mixed_", mixed, self.real_tokens)):
            count = replays.total()
            steps = count + self.eager[kind]
            figures |= {f"{kind}_steps": steps,
                        f"{prefix}graph_replays": count,
                        f"{prefix}graph_hit_rate": count / max(1, steps),
                        f"{prefix}padding_waste":
                            (sum(t * n for t, n in replays.items()) - real) / max(1, real)}
        return {**figures, "replays_per_bucket": dict(sorted(decode.items()))}


class CudaGraphRunner:
    def __init__(self, config, forward, buffers: StepBuffers, variants=(), shapes=()):
        """`forward(shape)`: the model runner's step on its static `buffers` (model_runner.py);
        `variants`: the decode graphs' variants besides 0; `shapes`: more prefill-only graphs."""
        max_bs = config.cuda_graph_max_bs or min(config.max_num_seqs, 512)
        ladder = config.cuda_graph_sizes or bucket_ladder(max_bs)
        # no decode batch is larger than max_num_seqs
        self.ladder = sorted({bs for bs in ladder if bs <= config.max_num_seqs}
                             or {config.max_num_seqs})
        self.variants = [0, *variants]
        # (only the triton backend sizes its prefill attention on the device: see above)
        self.grid = (mixed_grid(self.ladder[-1], config.max_num_mixed_tokens)
                     if config.attention_backend == "triton" else [])
        self.prefill_shapes = sorted(shapes, key=lambda shape: shape.tokens)
        self.stats = GraphStats()
        self.graphs: dict[StepShape, torch.cuda.CUDAGraph] = {}
        self.capture(forward, buffers)

    def stats_dict(self):
        return {"cuda_graph_sizes": self.ladder,
                "mixed_graph_grid": self.grid,
                "num_graphs": len(self.graphs),
                "capture_seconds": round(self.capture_seconds, 3),
                "graph_memory_bytes": self.graph_memory_bytes,
                **self.stats.as_dict()}

    @torch.inference_mode()
    def capture(self, forward, buffers: StepBuffers):
        start, pool = time.perf_counter(), torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        reserved_before = torch.cuda.memory_reserved()
        shapes = [decode_shape(d, variant) for d in self.ladder for variant in self.variants]
        shapes += [mixed_shape(d, p, variant) for d, p in self.grid
                   for variant in {0, self.variants[-1]}] + self.prefill_shapes
        # largest first
        shapes.sort(key=lambda shape: (shape.tokens, shape.decodes, shape.variant), reverse=True)
        for i, shape in enumerate(tqdm(shapes, desc="Capturing CUDA graphs", leave=False)):
            buffers.fill(StepInput(), shape)  # every row padding
            forward(shape)  # warm-up: compile, autotune, allocate workspaces outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads (NCCL's watchdog polls its events) may keep calling CUDA
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                forward(shape)
            self.graphs[shape] = graph
            log.debug(f"graph {i + 1}/{len(shapes)}: {shape}, the pool now "
                      f"{torch.cuda.memory_reserved() / 2**20:.1f} MiB")
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.graph_memory_bytes = torch.cuda.memory_reserved() - reserved_before
        log.info(f"captured {len(shapes)} CUDA graphs in {self.capture_seconds:.1f} s, "
                 f"{self.graph_memory_bytes / 2**20:.1f} MiB")

    def close(self):
        """Destroy the graphs now, whoever still holds this runner. NCCL counts every graph that
        captured one of its collectives, and destroying the communicator waits for that count to
        reach zero: a graph left alive makes the tensor-parallel shutdown hang."""
        self.graphs.clear()

    def lookup(self, step: StepShape):
        """The smallest graph that holds a step of (exact) shape `step`; None (counted) when it
        runs eager."""
        bucket = None
        if not step.prefill_tokens and (d := find_bucket(self.ladder, step.decodes)) is not None:
            bucket = decode_shape(d, step.variant)
        elif step.decodes and step.chunks <= MIXED_PREFILL_CHUNKS:
            # the grid runs by decode bucket, then prefill bucket, and a larger decode bucket has
            # only the smaller prefill buckets: the first pair that holds the step is the smallest
            fits = [(d, p) for d, p in self.grid if d >= step.decodes and p >= step.prefill_tokens]
            if fits and step.rows <= fits[0][0] + MIXED_PREFILL_CHUNKS:
                # a step of any variant but 0 runs on the last variant's graph (see above)
                variant = self.variants[-1] if step.variant else 0
                bucket = mixed_shape(*fits[0], variant=variant)
        elif not step.decodes:
            bucket = next((shape for shape in self.prefill_shapes if holds(shape, step)), None)
        if bucket is None:
            kind = "decode" if not step.prefill_tokens else "mixed" if step.decodes else "prefill"
            self.stats.eager[kind] += 1
        return bucket

    def replay(self, bucket: StepShape, step: StepShape):
        """Replay the graph of `bucket` for a step of (exact) shape `step`."""
        self.graphs[bucket].replay()
        self.stats.replays[bucket] += 1
        if bucket.prefill_tokens and bucket.decodes:
            self.stats.real_tokens += step.tokens
        else:
            self.stats.real_rows += step.decodes
