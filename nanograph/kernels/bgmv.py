"""The multi-LoRA delta of a step on CUDA: y[t] += B[s] (A[s] x[t]), s = the row's slot.

BGMV (batched gather matrix-vector, as in Punica): every row of the step may use another
adapter, so there is no shared weight to batch a GEMM over. Instead each row's programs gather
their own adapter's weights by the row's slot (`token_slots[t]`) and do a matrix-vector product
with them. The adapters live in `max_loras` slots of stacked, zero-padded weights (lora_a
[S, P, R, K], lora_b [S, N, R], the scaling folded into B), so gathering is an index into the
slot dimension. In decode the few adapters of a step are read once from DRAM and then from L2
by every row that uses them.

Why two products, shrink then expand. B A is a rank-r matrix: multiplying x by A first gives r
numbers per row and part (r is 8-64), and B expands them to N outputs: 2 (P K + N) r flops per
row instead of the 2 K N of a materialised delta weight. The r numbers h[t, p, :] are the only
thing both halves share, so they go through a small fp32 scratch [T, P, rank]: "shrink" (grid
rows x parts x rank blocks) computes them, "expand" (grid rows x output tiles) reads the h of
the part that owns each output feature (a fused layer's outputs are its parts stacked: q|k|v,
gate|up) and adds the delta to y in fp32, rounding once. Where the product itself is one of
gemv.py's kernels (a few rows), that kernel does the expand as it computes y (one kernel fewer).
There the shrink of the O and down projections also computes a fold (lora/layer.py):
parts after the layer's own whose A rows span [x | residual], K + RES_K columns, and give the h
of the projection after the next norm (gate/up, the next layer's q/k/v) but for the norm's
1 / rms, which that product applies; the A of the own parts is zero past K. The rank is not a
tensor dimension of the launch but a constexpr: one compile per rank bucket (8, 16, 32, 64), and
each bucket reads only the first `rank` columns of the R-padded weights, so a step of rank-8
adapters does not pay for `max_lora_rank` = 64. Columns between an adapter's own rank and the
bucket are zeros, add 0.

Rows without an adapter (slot -1: base-model requests, and the padding rows of a graph bucket)
read no adapter weights (their masks are empty) and are skipped after the PDL wait: their h
stays unwritten (the products mask it by slot too) and y keeps its bits. Each program waits
even when it has nothing to do, so the chain's ordering holds.

Rows per program. In decode every row is another sequence, often of another adapter, and a
program takes one row: the most programs, the shortest chain. A prefill chunk's tokens all use
their sequence's adapter, and a program per token would gather the same tiles once per token
(at rank 64, about 3 MB of A and B a token and layer on Qwen3-0.6B, from L2). So in a step
with prefill chunks a program takes ROWS consecutive rows (lora/layer.py's PREFILL_ROWS) and
gathers a tile again only where the adapter changes. A row's arithmetic does not depend on
ROWS, so neither does its result. Nothing on the host depends on the slots:
the grid comes from static shapes (T, N, K, rank), which makes both kernels capturable in a CUDA
graph and replayable with new slots. Both join the PDL chain (pdl.py): the slot and the adapter
weights are loaded before the wait; x, h and y after it.

Like gemv.py, a program holds whole rows (A's [BLOCK_R, K], B's [BLOCK_N, rank]) in registers,
and a row's result does not depend on how many rows the step has.
"""
import torch
import triton
import triton.language as tl

from nanograph.kernels.gemv import lora_b_tile, lora_h_tile
from nanograph.kernels.pdl import launch_options, wait_for_previous_kernel

SHRINK_TILE = 8192  # A's weight elements a shrink program
EXPAND_TILE = 4096  # B's weight elements an expand program
NUM_WARPS = 4


@triton.jit
def _shrink_kernel(x_ptr, residual_ptr, a_ptr, h_ptr, slots_ptr, T, K, RES_K,
                   stride_xt, stride_rt, stride_as, stride_ap, stride_ar,
                   RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   ROWS: tl.constexpr, PDL: tl.constexpr):
    """h[t, p, r] = A[slot, p, r, :] . x[t] for BLOCK_R ranks r of part p, for ROWS rows t from
    the program's first. With RES_K > 0 a row is [x[t] | residual[t]], K + RES_K columns (a
    fold, lora/layer.py; the A of the layer's own parts is zero past K)."""
    first = tl.program_id(0) * ROWS
    p = tl.program_id(1)
    ranks = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + p * stride_ap + ranks[:, None] * stride_ar + cols[None, :]
    in_k = cols[None, :] < K + RES_K
    slot = tl.load(slots_ptr + first).to(tl.int64)
    # no ranks at all without an adapter
    a = tl.load(a_rows + slot * stride_as, mask=(ranks[:, None] < RANK * (slot >= 0)) & in_k,
                other=0.0)
    wait_for_previous_kernel(PDL)
    for i in range(ROWS):
        t = first + i
        row_slot = tl.load(slots_ptr + t, mask=t < T, other=-1).to(tl.int64)
        if row_slot >= 0:  # (a row without an adapter does nothing)
            if row_slot != slot:  # another adapter: its tile replaces the last
                slot = row_slot
                a = tl.load(a_rows + slot * stride_as, mask=(ranks[:, None] < RANK) & in_k,
                            other=0.0)
            x = tl.load(x_ptr + t * stride_xt + cols, mask=cols < K, other=0.0)
            x += tl.load(residual_ptr + t * stride_rt + cols - K,
                         mask=(cols >= K) & (cols < K + RES_K), other=0.0)
            h = tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], 1)
            tl.store(h_ptr + (t * tl.num_programs(1) + p) * RANK + ranks, h, mask=ranks < RANK)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, slots_ptr, y_ptr, T, N, stride_ht, stride_bs, stride_bn, stride_yt,
                   PART_STARTS: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
                   BLOCK_N: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    """y[t, o] += B[slot, o, :RANK] . h[t, part(o)] for BLOCK_N outputs o, for ROWS rows t from
    the program's first."""
    first = tl.program_id(0) * ROWS
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + first).to(tl.int64)
    b = lora_b_tile(b_ptr, slot, outs, N, stride_bs, stride_bn, RANK, RANK_PAD)
    wait_for_previous_kernel(PDL)
    for i in range(ROWS):
        t = first + i
        row_slot = tl.load(slots_ptr + t, mask=t < T, other=-1).to(tl.int64)
        if row_slot >= 0:  # (a row without an adapter keeps its bits)
            if row_slot != slot:  # another adapter: its tile replaces the last
                slot = row_slot
                b = lora_b_tile(b_ptr, slot, outs, N, stride_bs, stride_bn, RANK, RANK_PAD)
            h = lora_h_tile(h_ptr + t * stride_ht, slot, outs, PART_STARTS, RANK, RANK_PAD)
            delta = tl.sum(b.to(tl.float32) * h, 1)
            y = tl.load(y_ptr + t * stride_yt + outs, mask=outs < N)
            tl.store(y_ptr + t * stride_yt + outs, (y.to(tl.float32) + delta).to(y.dtype),
                     mask=outs < N)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, rank: int,
                residual: torch.Tensor | None = None, rows_per_program: int = 1) -> torch.Tensor:
    """h [T, P, rank] float32, h[t, p] = lora_a[s, p, :rank] x[t] with s = token_slots[t] (rows
    with slot -1 are left unwritten). x: [T, K]; lora_a: [S, P, R, K (+ residual's width)];
    token_slots: [T] int32; 1 <= rank <= R: only the first `rank` rank columns are read (one
    compile per value). With a residual [T, K2] every part multiplies [x | residual] (a fold,
    lora/layer.py; the layer's own parts are zero past K)."""
    num_rows, k = x.shape
    res_k = 0 if residual is None else residual.shape[1]
    assert x.stride(-1) == lora_a.stride(-1) == 1 and lora_a.shape[3] == k + res_k
    assert 1 <= rank <= lora_a.shape[2]
    h = torch.empty(num_rows, lora_a.shape[1], rank, dtype=torch.float32, device=x.device)
    block_k = triton.next_power_of_2(k + res_k)
    block_r = max(1, min(triton.next_power_of_2(rank), SHRINK_TILE // block_k))
    r = x if residual is None else residual
    grid = (triton.cdiv(num_rows, rows_per_program), lora_a.shape[1], triton.cdiv(rank, block_r))
    _shrink_kernel[grid](
        x, r, lora_a, h, token_slots, num_rows, k, res_k,
        x.stride(0), r.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        RANK=rank, BLOCK_R=block_r, BLOCK_K=block_k, ROWS=rows_per_program, num_warps=NUM_WARPS,
        **launch_options(x.device))
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                part_starts: tuple[int, ...], rows_per_program: int = 1) -> None:
    """In place: y[t, o] += lora_b[s, o, :rank] h[t, part(o)] for every row t with s =
    token_slots[t] >= 0 (rows with -1 are left untouched). y: [T, N]; h: [T, P, rank]
    (lora_shrink's); lora_b: [S, N, R] (scaling folded in); part_starts: P ints, where each
    part's outputs start (the first is 0)."""
    num_rows, n = y.shape
    rank = h.shape[2]
    assert y.stride(-1) == lora_b.stride(-1) == 1 and h.shape[:2] == (num_rows, len(part_starts))
    rank_pad = triton.next_power_of_2(rank)
    block_n = max(1, min(EXPAND_TILE // rank_pad, triton.next_power_of_2(n)))
    _expand_kernel[(triton.cdiv(num_rows, rows_per_program), triton.cdiv(n, block_n))](
        h, lora_b, token_slots, y, num_rows, n,
        h.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        PART_STARTS=tuple(part_starts), RANK=rank, RANK_PAD=rank_pad, BLOCK_N=block_n,
        ROWS=rows_per_program, num_warps=NUM_WARPS, **launch_options(y.device))
