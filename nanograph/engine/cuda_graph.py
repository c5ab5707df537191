"""Captured decode graphs: record each decode batch shape once, replay it every step.

Why: a decode step of a small model is hundreds of small kernels. Launched one by one from
Python, the CPU cannot keep the GPU busy (at batch 1 the launches take longer than the math).
A CUDA graph records the whole launch sequence once; a replay submits it with one call.

What makes replay possible:
- Static buffers. A graph replays fixed pointers, so every input lives in a buffer allocated
  once for the largest bucket: token ids, positions, slot mapping, context lengths, and the
  block tables [max_bs, max_blocks_per_seq]. They are slices of ONE int32 device tensor, so
  `replay` fills a pinned host mirror and makes a single host-to-device copy per step. The
  input ids may be placeholders for tokens the previous step sampled (step.py): the graph's
  first op swaps them in from the device, so a replay never waits for the host to know them.
- Buckets. A graph also fixes the batch size, so we capture a ladder of sizes and run a batch of
  n on the smallest bucket >= n. The rows n..bucket-1 are padding, neutralised by slot -1
  (their K/V is written nowhere) and context length 0 (attention reads nothing); their logits
  are computed and ignored. `padding waste` = padded rows / real rows measures the price;
  batches above the largest bucket run eager.
- One memory pool. Graphs are captured largest first into a shared pool: a smaller graph's
  intermediates fit in memory the larger one already reserved, so the ladder costs about one
  graph's activations, not the sum (`stats()["graph_memory_bytes"]`). Every graph copies
  its logits into one output tensor [largest bucket, vocab], read right after the replay.
- Warm-up. Each bucket runs once eagerly before capture, so Triton autotuning, torch.compile
  and cuBLAS workspace allocations happen outside the recording.

The LM head and the sampler are inside the graph too: each row's temperature and seed are two
more static inputs, and the sampled ids go straight into the token table for the next step
(layers/sampler.py computes its noise, so it needs no random generator state). What still runs
outside the graph each decode step: filling the host mirror and its copy, the non-blocking copy
of the ids back to the host (model_runner.py), and, only for a batch that asks for top-k or
top-p, a second sampling pass on the graph's logits. Inside the graph, at
small batch, each kernel may start before the previous one ends (programmatic dependent
launch, kernels/pdl.py): a graph removes the CPU's launch cost, PDL also hides each kernel's
start-up on the GPU.

The ladder: `cuda_graph_sizes` if given, else 1, 2, 4, 8, then sizes shrinking geometrically
by 4/5 down from the largest (after Megatron-Core's exponentially-decreasing ladder): padding
at most 25% with a number of graphs logarithmic in the largest batch, which is
`cuda_graph_max_bs`, or `min(max_num_seqs, 512)` (bench.py --ladders compares other ladders).
Every tensor-parallel rank computes the same ladder from the same config, as its collectives
require.

The grid with LoRA (`enable_lora`): a graph also fixes how much LoRA work each layer does (none,
or the LoRA kernels over `rank` rank columns, layers/lora_slots.py), so graphs are keyed by (batch
bucket, rank bucket), rank buckets 0, 8, 16, 32, 64 up to `max_lora_rank`; a step replays the
graph of its batch bucket and of the smallest rank bucket that holds its largest adapter rank,
and a step without adapters the rank-0 graph, which has no LoRA kernels at all. Every batch
bucket gets every rank bucket: the grid is the ladder times at most five, and it stays cheap
because the graphs share one pool and one logits output, so each graph adds only its own
workspace. Measured on an H100 (Qwen3-0.6B shape, bench.py --lora, sampler inside the graphs):
the 18 graphs of the default ladder took 1.1 s and 478 MiB, most of it likely the largest graph's
float32 scores [512, vocab]; the 90 of the LoRA grid (max_lora_rank 64) 11.4 s and 542 MiB,
with the cuBLAS path's shrinks on a side stream (since removed), against 8.0 s and 478 MiB before
that stream: presumably its intermediates took pool blocks of their own (not re-measured since).
"""
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from nanograph.engine.step import TokenTable
from nanograph.layers.lora_slots import rank_buckets
from nanograph.layers.sampler import sample_softmax
from nanograph.utils.context import StepMetadata, set_step_metadata

log = logging.getLogger("nanograph")


def bucket_ladder(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then sizes shrinking geometrically by 4/5 down from max_bs, multiples of 8."""
    sizes, s = [s for s in (1, 2, 4, 8) if s < max_bs], max_bs
    while s > 8:
        sizes.append(s)
        s = (s * 4 // 5) // 8 * 8  # keep sizes multiples of 8: GEMM tiles like them
    return sorted(set(sizes + [max_bs]))


def find_bucket(ladder: list[int], n: int) -> int | None:
    """Smallest bucket that holds n rows; None when n is above the ladder (run eager)."""
    return next((bs for bs in ladder if bs >= n), None)


class DecodeBuffers:
    """The static inputs of every graph, as views into one flat int32 device tensor, filled from
    a pinned host mirror (numpy views for cheap filling) with one non-blocking copy per step.

    There are two mirrors, used in turn. With overlap scheduling the host fills step N+1's inputs
    while step N's copy may not have run yet; by then step N-1, which used the other mirror, has
    been collected, so its copy is done and that mirror is free to overwrite."""

    # the 1-D fields, each with its value in a padding row: token 0 at position 0, no cache slot,
    # no context, no adapter, greedy (the block tables follow them; temperatures are float32 bits)
    FIELDS = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "context_lens": 0, "lora_slots": -1,
              "temperatures": 0, "seeds": 0}

    def __init__(self, max_bs: int, max_blocks: int, device):
        self.max_bs, self.max_blocks = max_bs, max_blocks
        size = max_bs * (len(self.FIELDS) + max_blocks)
        self.device_flat = torch.zeros(size, dtype=torch.int32, device=device)
        pin = torch.device(device).type == "cuda"
        self.host_flats = [torch.zeros(size, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.hosts = [{name: view.numpy() for name, view in self._views(flat).items()} for flat in self.host_flats]
        self.dev, self.turn = self._views(self.device_flat), 0
        for name, pad in self.FIELDS.items():  # what the captures run on: all rows padding
            self.dev[name].fill_(pad)

    def _views(self, flat):
        n = self.max_bs
        views = {name: flat[i * n:(i + 1) * n] for i, name in enumerate(self.FIELDS)}
        views["temperatures"] = views["temperatures"].view(torch.float32)
        views["block_tables"] = flat[len(self.FIELDS) * n:].reshape(n, self.max_blocks)
        return views

    def fill(self, step, bucket: int) -> None:
        n, host, flat = len(step.input_ids), self.hosts[self.turn], self.host_flats[self.turn]
        self.turn ^= 1
        for name, pad in self.FIELDS.items():
            host[name][:n] = getattr(step, name) or pad  # lora_slots None: no adapters
            host[name][n:bucket] = pad                   # rows n..bucket-1 are padding
        host["block_tables"][:n, :len(step.block_tables[0])] = step.block_tables
        # one copy: the 1-D fields, then the block-table rows of the bucket, which follow them
        end = self.max_bs * len(self.FIELDS) + bucket * self.max_blocks
        self.device_flat[:end].copy_(flat[:end], non_blocking=True)


@dataclass
class GraphStats:
    """What the graphs did, step by step: measured, not assumed. Counters only, so that the
    figures of one call are the difference of two snapshots (bench.py)."""
    replays: Counter = field(default_factory=Counter)   # (batch bucket, LoRA rank bucket) -> replays
    eager_steps: int = 0                                # decode batches above the largest bucket
    real_rows: int = 0                                  # rows of real sequences over all replays

    def as_dict(self) -> dict:
        per_bucket = sum((Counter({bucket: n}) for (bucket, _), n in self.replays.items()), Counter())
        replayed, padded_rows = per_bucket.total(), sum(b * n for b, n in per_bucket.items()) - self.real_rows
        return {"decode_steps": replayed + self.eager_steps, "graph_replays": replayed,
                "graph_hit_rate": replayed / max(1, replayed + self.eager_steps),
                "padding_waste": padded_rows / max(1, self.real_rows),
                "replays_per_bucket": dict(sorted(per_bucket.items())),
                "replays_per_lora_bucket": {f"{b}x{r}": n for (b, r), n in sorted(self.replays.items()) if r}}


class CudaGraphRunner:
    def __init__(self, model, config, device: torch.device, tokens: TokenTable):
        self.model, self.tokens = model, tokens  # not the ModelRunner: no cycle keeping the cache alive
        max_bs = config.cuda_graph_max_bs or min(config.max_num_seqs, 512)
        self.ladder = sorted(set(config.cuda_graph_sizes or bucket_ladder(max_bs)))
        self.ranks = [0] + (rank_buckets(config.max_lora_rank) if config.enable_lora else [])
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (batch bucket, LoRA rank bucket) -> graph
        # every graph's outputs, copied in: logits [max_bs, vocab] and the ids sampled from them
        self.logits = torch.empty(self.ladder[-1], config.hf_config.vocab_size, dtype=config.torch_dtype, device=device)
        self.sampled = torch.zeros(self.ladder[-1], dtype=torch.int64, device=device)
        self.stats = GraphStats()
        max_blocks = -(-config.max_model_len // config.kvcache_block_size)
        self.buffers = DecodeBuffers(self.ladder[-1], max_blocks, device)
        self.capture()

    def stats_dict(self) -> dict:
        return {"cuda_graph_sizes": self.ladder, "lora_rank_buckets": self.ranks[1:], "num_graphs": len(self.graphs),
                "capture_seconds": round(self.capture_seconds, 3), "graph_memory_bytes": self.graph_memory_bytes,
                **self.stats.as_dict()}

    def forward(self, bs: int, rank: int) -> None:
        dev = self.buffers.dev
        set_step_metadata(StepMetadata(False, dev["slot_mapping"][:bs], dev["context_lens"][:bs],
                                       dev["block_tables"][:bs], lora_rank=rank, lora_slots=dev["lora_slots"][:bs]))
        hidden = self.model(self.tokens.resolve(dev["input_ids"][:bs]), dev["positions"][:bs])
        self.logits[:bs] = self.model.compute_logits(hidden)
        self.sampled[:bs] = sample_softmax(self.logits[:bs], dev["temperatures"][:bs], dev["seeds"][:bs], dev["context_lens"][:bs])
        self.tokens.put(self.sampled[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        start, pool = time.perf_counter(), torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        grid = [(bs, rank) for bs in self.ladder[::-1] for rank in self.ranks[::-1]]
        for bs, rank in tqdm(grid, desc="Capturing decode graphs", leave=False):
            self.forward(bs, rank)  # warm-up: compile, autotune, allocate workspaces outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads (NCCL's watchdog polls its events) may keep calling CUDA
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.forward(bs, rank)
            self.graphs[bs, rank] = graph
        torch.cuda.synchronize()
        set_step_metadata(None)
        self.capture_seconds = time.perf_counter() - start
        self.graph_memory_bytes = torch.cuda.memory_reserved() - reserved
        log.info("captured %d decode graphs in %.1f s, %.1f MiB", len(grid), self.capture_seconds,
                 self.graph_memory_bytes / 2**20)

    def close(self) -> None:
        """Destroy the graphs now, whoever still holds this runner. NCCL counts every graph that
        captured one of its collectives, and destroying the communicator waits for that count to
        reach zero: a graph left alive makes the tensor-parallel shutdown hang."""
        self.graphs.clear()

    def replay(self, step) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step's logits and sampled ids from its graph; None (counted) when it must run eager."""
        n = len(step.input_ids)
        if (bucket := find_bucket(self.ladder, n)) is None:
            self.stats.eager_steps += 1
            return None
        self.buffers.fill(step, bucket)
        self.graphs[bucket, step.lora_rank].replay()
        self.stats.replays[bucket, step.lora_rank] += 1
        self.stats.real_rows += n
        return self.logits[:n], self.sampled[:n]
