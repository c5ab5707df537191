"""Captured CUDA graphs: record each step shape once, replay it every step.

Why: a decode step of a small model is hundreds of small kernels. Launched one by one from
Python, the CPU cannot keep the GPU busy (at batch 1 the launches take longer than the math).
A CUDA graph records the whole launch sequence once; a replay submits it with one call.

What makes replay possible:
- Static buffers. A graph replays fixed pointers, so every input lives in a buffer allocated
  once for the largest graph: token ids, positions, slot mapping, context lengths, the block
  tables [max sequences, max_blocks_per_seq], the sampling rows' inputs. They are slices of ONE
  int32 device tensor, so `replay` fills a pinned host mirror and makes a single host-to-device
  copy per step. Input ids may be placeholders for tokens the previous step sampled
  (docs/walkthrough.md): the graph's first op swaps them in from the device.
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

Which graphs. Keys are (decode rows d, prefill tokens p, LoRA rank bucket):
- Decode graphs (p = 0): the ladder 1, 2, 4, 8, then sizes shrinking geometrically by 4/5 down
  from `cuda_graph_max_bs` (default min(max_num_seqs, 512)), multiples of 8 (after
  Megatron-Core): padding at most 25% with a number of graphs logarithmic in the largest batch;
  or `cuda_graph_sizes`. With `enable_lora` every decode bucket also gets one graph per rank
  bucket (8, 16, 32, 64 up to `max_lora_rank`; layers/lora_slots.py): a step takes the smallest
  that holds its largest adapter rank, and a step without adapters the rank-0 graph.
- Mixed graphs (the decode rows, then prefill chunks: scheduler.py): a grid of decode buckets
  by prefill-token buckets, powers of two from 64 up to the mixed-step budget, with room for
  MIXED_PREFILL_CHUNKS chunks. A step's decode rows take the smallest decode bucket that holds
  them and its chunks' tokens the smallest prefill bucket: since d + p stays within the budget,
  a larger decode bucket needs only the smaller prefill buckets, which keeps the grid to about
  three times the decode ladder. The prefill kernel's grid comes from p, never from the live
  chunks. Only each chunk's last token (and each decode row) goes through the LM head and the
  sampler. Mixed graphs run the base model only (a step with adapters runs eagerly), and only
  with the triton attention backend (the others size prefill attention on the host).
Prefill-only steps (nothing decodes), steps above the largest graph and the rest run eagerly,
counted (`stats()`): the hit rates and the padding waste (padded rows or tokens / real ones) say
what the graphs cost and buy. Every tensor-parallel rank computes the same graphs from the same
config and picks the same one for a step, as its collectives require.

Inside a graph the sampler runs too (layers/sampler.py): the sampled ids go straight into the
token table for the next step. What runs outside: filling the host mirror and its copy, the
copy of the ids back to the host, and only where a row asks for them, top-k / top-p, the
min_tokens mask and logprobs, on the graph's logits (model_runner.py).
"""
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from nanograph.engine.step import StepInput, TokenTable
from nanograph.layers.lora_slots import rank_buckets
from nanograph.layers.sampler import sample_softmax
from nanograph.utils.context import StepMetadata, set_step_metadata

log = logging.getLogger("nanograph")

MIXED_PREFILL_CHUNKS = 8  # prefill chunks a mixed graph holds
MIN_PREFILL_BUCKET = 64   # the smallest prefill-token bucket


def bucket_ladder(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then sizes shrinking geometrically by 4/5 down from max_bs, multiples of 8."""
    sizes, s = [s for s in (1, 2, 4, 8) if s < max_bs], max_bs
    while s > 8:
        sizes.append(s)
        s = (s * 4 // 5) // 8 * 8  # keep sizes multiples of 8: GEMM tiles like them
    return sorted(set(sizes + [max_bs]))


def find_bucket(ladder: list[int], n: int) -> int | None:
    """Smallest bucket that holds n; None when n is above the ladder (run eager)."""
    return next((bs for bs in ladder if bs >= n), None)


def mixed_grid(decode_ladder: list[int], budget: int) -> list[tuple[int, int]]:
    """(decode bucket, prefill bucket) pairs that a step of at most `budget` tokens, at least one
    of them decoding and one prefilling, can need."""
    prefill_ladder = [p for p in (MIN_PREFILL_BUCKET << i for i in range(32)) if p < budget] + [budget]
    grid = []
    for smaller, d in zip([0] + decode_ladder, decode_ladder):
        fewest_decodes = smaller + 1  # the fewest decode rows that take bucket d
        if fewest_decodes < budget:
            most_prefill = find_bucket(prefill_ladder, budget - fewest_decodes)
            grid += [(d, p) for p in prefill_ladder if p <= most_prefill]
    return grid


class StepBuffers:
    """The static inputs of every graph, as views into one flat int32 device tensor, filled from
    a pinned host mirror (numpy views for cheap filling) with one non-blocking copy per step.

    Layout of a graph (d, p): tokens [0, d) are the decode rows and [d, d + p) the prefill
    part; sequences [0, d) the decode rows and [d, d + chunks) the chunks; the sampling rows are
    the step's own, in order, padded to d + chunks. There are two mirrors, used in turn: with
    overlap scheduling the host fills step N+1 while step N's copy may not have run yet; step
    N-1, which used the other mirror, has been collected by then, so that mirror is free."""

    # field -> (what it is per, its value in padding): token 0 at position 0, no cache slot, no
    # context, no adapter, greedy; a padded chunk ends where the last real one does (below)
    FIELDS = {"input_ids": ("token", 0), "positions": ("token", 0), "slot_mapping": ("token", -1),
              "lora_slots": ("token", -1), "context_lens": ("seq", 0), "sample_indices": ("row", 0),
              "sample_lens": ("row", 0), "temperatures": ("row", 0), "seeds": ("row", 0),
              "cu_seqlens_q": ("chunk", 0)}

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device):
        self.max_blocks = max_blocks
        self.lengths = {"token": max_tokens, "seq": max_seqs, "row": max_seqs,
                        "chunk": MIXED_PREFILL_CHUNKS + 1}
        self.table_start = sum(self.lengths[per] for per, _ in self.FIELDS.values())
        size = self.table_start + max_seqs * max_blocks
        self.device_flat = torch.zeros(size, dtype=torch.int32, device=device)
        pin = torch.device(device).type == "cuda"
        self.host_flats = [torch.zeros(size, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.hosts = [{name: view.numpy() for name, view in self._views(flat).items()}
                      for flat in self.host_flats]
        self.dev = self._views(self.device_flat)
        self.turn = 0
        for name, (_, pad) in self.FIELDS.items():  # what the captures run on: all rows padding
            self.dev[name].fill_(pad)

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        views, start = {}, 0
        for name, (per, _) in self.FIELDS.items():
            views[name] = flat[start:start + self.lengths[per]]
            start += self.lengths[per]
        views["temperatures"] = views["temperatures"].view(torch.float32)
        views["block_tables"] = flat[self.table_start:].view(-1, self.max_blocks)
        return views

    def fill(self, step: StepInput, d: int, p: int) -> None:
        """Copy `step` into the layout of graph (d, p), padding what it does not fill."""
        host, flat = self.hosts[self.turn], self.host_flats[self.turn]
        self.turn ^= 1
        n = step.num_decodes
        chunks = MIXED_PREFILL_CHUNKS if p else 0
        extent = {"token": p, "seq": chunks}
        values = {  # per sequence in decode = per token; a mixed graph has no adapters
            "lora_slots": step.lora_slots or [-1] * len(step.input_ids),
            "sample_indices": [i if i < n else i - n + d for i in step.sample_indices]}
        for name, (per, pad) in self.FIELDS.items():
            live = values[name] if name in values else getattr(step, name)
            view = host[name]
            if per == "row":
                view[:len(live)] = live
                view[len(live):d + chunks] = pad
            elif per != "chunk":  # the decode part at 0, the prefill part at d
                view[:n] = live[:n]
                view[n:d] = pad
                rest = live[n:]
                view[d:d + len(rest)] = rest
                view[d + len(rest):d + extent[per]] = pad
        if p:  # the chunks' offsets within the prefill part; padded ones have length 0
            offsets = [offset - n for offset in step.cu_seqlens_q[n:]]
            host["cu_seqlens_q"][:len(offsets)] = offsets
            host["cu_seqlens_q"][len(offsets):chunks + 1] = offsets[-1]
        width = len(step.block_tables[0])
        host["block_tables"][:n, :width] = step.block_tables[:n]
        if p:
            host["block_tables"][d:d + len(step.block_tables) - n, :width] = step.block_tables[n:]
        end = self.table_start + (d + chunks) * self.max_blocks
        self.device_flat[:end].copy_(flat[:end], non_blocking=True)


@dataclass
class GraphStats:
    """What the graphs did, step by step: measured, not assumed. Counters only, so that the
    figures of one call are the difference of two snapshots (bench.py)."""
    replays: Counter = field(default_factory=Counter)  # (decode rows, prefill tokens, rank) -> replays
    eager: Counter = field(default_factory=Counter)    # "decode" / "mixed" / "prefill" -> steps
    real_rows: int = 0      # decode rows of real sequences over all decode replays
    real_tokens: int = 0    # tokens of real sequences over all mixed replays

    def as_dict(self) -> dict:
        decode = Counter()
        mixed = Counter()
        for (d, p, _), n in self.replays.items():
            (mixed if p else decode)[d + p] += n
        decode_replays, mixed_replays = decode.total(), mixed.total()
        padded_rows = sum(b * n for b, n in decode.items()) - self.real_rows
        padded_tokens = sum(t * n for t, n in mixed.items()) - self.real_tokens
        lora = {f"{d}x{r}": n for (d, p, r), n in sorted(self.replays.items()) if r}
        return {"decode_steps": decode_replays + self.eager["decode"],
                "graph_replays": decode_replays,
                "graph_hit_rate": decode_replays / max(1, decode_replays + self.eager["decode"]),
                "padding_waste": padded_rows / max(1, self.real_rows),
                "replays_per_bucket": dict(sorted(decode.items())),
                "replays_per_lora_bucket": lora,
                "mixed_steps": mixed_replays + self.eager["mixed"],
                "mixed_graph_replays": mixed_replays,
                "mixed_graph_hit_rate": mixed_replays / max(1, mixed_replays + self.eager["mixed"]),
                "mixed_padding_waste": padded_tokens / max(1, self.real_tokens)}


class CudaGraphRunner:
    def __init__(self, model, config, device: torch.device, tokens: TokenTable):
        self.model, self.tokens = model, tokens  # not the ModelRunner: no cycle keeping the cache alive
        max_bs = config.cuda_graph_max_bs or min(config.max_num_seqs, 512)
        self.ladder = sorted(set(config.cuda_graph_sizes or bucket_ladder(max_bs)))
        self.ranks = [0] + (rank_buckets(config.max_lora_rank) if config.enable_lora else [])
        self.grid = []
        if config.attention_backend == "triton":
            self.grid = mixed_grid(self.ladder, config.max_num_mixed_tokens)
        self.mixed_ladder = sorted({d for d, _ in self.grid})
        max_rows = self.ladder[-1] + (MIXED_PREFILL_CHUNKS if self.grid else 0)
        max_tokens = max([self.ladder[-1]] + [d + p for d, p in self.grid])
        # every graph's outputs: logits [rows, vocab] and the ids sampled from them
        vocab = config.hf_config.vocab_size
        self.logits = torch.empty(max_rows, vocab, dtype=config.torch_dtype, device=device)
        self.sampled = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.stats = GraphStats()
        max_blocks = -(-config.max_model_len // config.kvcache_block_size)
        self.buffers = StepBuffers(max_tokens, max_rows, max_blocks, device)
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.capture()

    def stats_dict(self) -> dict:
        return {"cuda_graph_sizes": self.ladder,
                "mixed_graph_grid": self.grid,
                "lora_rank_buckets": self.ranks[1:],
                "num_graphs": len(self.graphs),
                "capture_seconds": round(self.capture_seconds, 3),
                "graph_memory_bytes": self.graph_memory_bytes,
                **self.stats.as_dict()}

    def forward(self, d: int, p: int, rank: int) -> None:
        """The step of graph (d, p, rank) on the static buffers: logits, sampled ids, token table."""
        dev = self.buffers.dev
        tokens, rows = d + p, d + (MIXED_PREFILL_CHUNKS if p else 0)
        md = StepMetadata(num_decodes=d,
                          slot_mapping=dev["slot_mapping"][:tokens],
                          context_lens=dev["context_lens"][:rows],
                          block_tables=dev["block_tables"][:rows],
                          lora_rank=rank,
                          lora_slots=dev["lora_slots"][:tokens])
        if p:
            md.cu_seqlens_q, md.max_seqlen_q = dev["cu_seqlens_q"], p
        set_step_metadata(md)
        hidden = self.model(self.tokens.resolve(dev["input_ids"][:tokens]), dev["positions"][:tokens])
        if p:  # a decode graph's rows are its tokens
            hidden = hidden[dev["sample_indices"][:rows]]
        self.logits[:rows] = self.model.compute_logits(hidden)
        self.sampled[:rows] = sample_softmax(self.logits[:rows], dev["temperatures"][:rows],
                                             dev["seeds"][:rows], dev["sample_lens"][:rows])
        self.tokens.put(self.sampled[:rows])

    @torch.inference_mode()
    def capture(self) -> None:
        start, pool = time.perf_counter(), torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        reserved_before = reserved
        keys = [(d, 0, rank) for d in self.ladder for rank in self.ranks]
        keys += [(d, p, 0) for d, p in self.grid]
        keys.sort(key=lambda key: (key[0] + key[1], key), reverse=True)  # largest first
        for i, key in enumerate(tqdm(keys, desc="Capturing CUDA graphs", leave=False)):
            self.forward(*key)  # warm-up: compile, autotune, allocate workspaces outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads (NCCL's watchdog polls its events) may keep calling CUDA
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.forward(*key)
            self.graphs[key] = graph
            now_reserved, now_allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
            log.debug("graph %d/%d (%d decode rows + %d prefill tokens, rank %d): pool reserved "
                      "%.1f MiB (+%.1f), allocated %.1f MiB (+%.1f)", i + 1, len(keys), *key,
                      now_reserved / 2**20, (now_reserved - reserved) / 2**20,
                      now_allocated / 2**20, (now_allocated - allocated) / 2**20)
            reserved, allocated = now_reserved, now_allocated
        torch.cuda.synchronize()
        set_step_metadata(None)
        self.capture_seconds = time.perf_counter() - start
        self.graph_memory_bytes = torch.cuda.memory_reserved() - reserved_before
        log.info("captured %d CUDA graphs (%d mixed) in %.1f s, %.1f MiB", len(keys), len(self.grid),
                 self.capture_seconds, self.graph_memory_bytes / 2**20)

    def close(self) -> None:
        """Destroy the graphs now, whoever still holds this runner. NCCL counts every graph that
        captured one of its collectives, and destroying the communicator waits for that count to
        reach zero: a graph left alive makes the tensor-parallel shutdown hang."""
        self.graphs.clear()

    def graph_for(self, step: StepInput) -> tuple[int, int, int] | None:
        """The smallest graph that holds `step`, or None."""
        n = step.num_decodes
        prefill_tokens = len(step.input_ids) - n
        if prefill_tokens == 0:
            d = find_bucket(self.ladder, n)
            return None if d is None else (d, 0, step.lora_rank)
        chunks = len(step.context_lens) - n
        if n == 0 or step.lora_rank or chunks > MIXED_PREFILL_CHUNKS:
            return None
        d = find_bucket(self.mixed_ladder, n)
        p = find_bucket([p for dd, p in self.grid if dd == d], prefill_tokens)
        if p is None or len(step.temperatures) > d + MIXED_PREFILL_CHUNKS:
            return None
        return d, p, 0

    def replay(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's logits and sampled ids from its graph; None (counted) when it runs eager."""
        key = self.graph_for(step)
        if key is None:
            kind = "decode" if len(step.input_ids) == step.num_decodes else "mixed"
            self.stats.eager["prefill" if step.num_decodes == 0 else kind] += 1
            return None
        d, p, _ = key
        self.buffers.fill(step, d, p)
        self.graphs[key].replay()
        self.stats.replays[key] += 1
        if p:
            self.stats.real_tokens += len(step.input_ids)
        else:
            self.stats.real_rows += step.num_decodes
        rows = len(step.temperatures)
        return self.logits[:rows], self.sampled[:rows]
