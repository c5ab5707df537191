"""Split-K candidates for the 2-16-row products of a wide model, in the GEMV's chain.

    PYTHONPATH=. python tools/bench_splitk.py [--shape qwen3-8b] [--rows 1,4] [--configs d64/16384/4,f32/8192/4]
    PYTHONPATH=. python tools/bench_splitk.py --check      # against F.linear first (GPU, bf16 and fp32)

Why split K. The GEMV (kernels/gemv.py) gives each program whole weight rows, so at M rows every
program reads all M input rows (and the residual, for a deferred norm) and normalises them itself:
on Qwen3-8B's gate/up, 12,288 programs of 2 weight rows each. Here a program owns a [BLOCK_N,
BLOCK_K] tile (loaded before the PDL wait, as in the GEMV) and reads only its K slice of the rows;
KSPLIT = K / BLOCK_K programs share an output block. The deferred norm is factored: each program
sums its slice's squares, and the 1 / rms multiplies the finished sums (y = rstd * (x * gamma) W^T).
Each program stores an fp32 partial and bumps its block's arrival count; the last to arrive sums
the partials in order (deterministic, as in paged_decode.py's merge), applies 1 / rms, bias and
SiLU, and resets the count. Two ways to make a partial:
- `d` (tensor cores): the rows padded to 16, acc [BLOCK_N, 16] = tl.dot(W tile, x slice^T);
- `f` (CUDA cores): each row reduced against the tile with FMAs, rows unrolled, as in the GEMV.
A config is kind BLOCK_N / weights per program / warps [/ reduce]; reduce 0 is the correct one,
1 the same with a relaxed atomic and no barrier (wrong in general), 2 no reduction at all (every
program stores its partial and returns: wrong results, the cost of the rest alone).

The chain is tools/bench_gemv.py's: every layer's four products with the norms deferred and SiLU
fused, then the final norm and the LM head, distinct weights per layer, one CUDA graph; the first
column is the engine's GEMV. Measured (README, "Decode step by batch size"; H200, Qwen3-8B): at one
row slower than the GEMV, at 4 rows slower than the engine's whole cuBLAS step, attention included.
Not used by the engine.
"""
import argparse
import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench_gemv import SHAPES, VOCAB, time_graph
from nanograph.kernels.gemv import gemv
from nanograph.kernels.pdl import launch_options, wait_for_previous_kernel
from nanograph.layers.norm import add_rms_norm
from nanograph.layers.norm import rms_norm as ref_rms_norm


@triton.jit
def output_rows(pid, N, SILU_AND_MUL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program pid's outputs and weight rows; with SILU_AND_MUL gate row o and up row N + o side by
    side, as in the GEMV."""
    if SILU_AND_MUL:
        outs = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        w_rows = tl.reshape(tl.join(outs, outs + N), [BLOCK_N])
    else:
        outs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = outs
    return outs, w_rows, N * (2 if SILU_AND_MUL else 1)


@triton.jit
def store_outputs(acc, ss, bias, out_ptr, rows, outs, M, N, K, eps, stride_om, NORM: tl.constexpr,
                  SILU_AND_MUL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [ROWS, BLOCK_N] finished: the deferred norm's 1 / rms (ss: the rows' sums of squares), bias,
    SiLU(gate) * up, stored."""
    if NORM:
        acc = acc * tl.rsqrt(ss / K + eps)[:, None]
    y = acc + bias[None, :]
    dtype = out_ptr.dtype.element_ty
    if SILU_AND_MUL:
        gate, up = tl.split(tl.reshape(y, [ROWS, BLOCK_N // 2, 2]))
        gate = gate.to(dtype).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + outs[None, :], y.to(dtype),
             mask=(rows[:, None] < M) & (outs[None, :] < N))


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, residual_ptr, norm_w_ptr, residual_out_ptr, eps,
                   part_ptr, ss_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_rm, stride_rom,
                   HAS_BIAS: tl.constexpr, SILU_AND_MUL: tl.constexpr, NORM: tl.constexpr,
                   ADD_RESIDUAL: tl.constexpr, DOT: tl.constexpr, REDUCE: tl.constexpr, KSPLIT: tl.constexpr,
                   KSPLIT_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    outs, w_rows, num_w_rows = output_rows(pid_n, N, SILU_AND_MUL, BLOCK_N)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + w_rows[:, None] * stride_wn + cols[None, :],
                mask=(w_rows[:, None] < num_w_rows) & (cols[None, :] < K), other=0.0)
    bias = tl.load(bias_ptr + w_rows, mask=w_rows < num_w_rows * HAS_BIAS, other=0.0).to(tl.float32)
    norm_w = tl.load(norm_w_ptr + cols, mask=cols < K * NORM, other=0.0)
    wait_for_previous_kernel(PDL)

    rows = tl.arange(0, ROWS)
    ss = tl.zeros([ROWS], tl.float32)
    if DOT:
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        if ADD_RESIDUAL:
            x += tl.load(residual_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
            tl.store(residual_out_ptr + rows[:, None] * stride_rom + cols[None, :], x,
                     mask=(rows[:, None] < M * (pid_n == 0)) & (cols[None, :] < K))
        if NORM:
            ss = tl.sum(x.to(tl.float32) * x.to(tl.float32), 1)
            x = norm_w[None, :] * x
        acc = tl.trans(tl.dot(w, tl.trans(x.to(w.dtype)), input_precision=DOT_PRECISION))  # [ROWS, BLOCK_N]
    else:
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        for m in tl.static_range(ROWS):
            in_row = cols < K * (M > m)
            x = tl.load(x_ptr + m * stride_xm + cols, mask=in_row, other=0.0)
            if ADD_RESIDUAL:
                x += tl.load(residual_ptr + m * stride_rm + cols, mask=in_row, other=0.0)
                tl.store(residual_out_ptr + m * stride_rom + cols, x, mask=cols < K * (M > m) * (pid_n == 0))
            if NORM:
                ss = tl.where(rows == m, tl.sum(x.to(tl.float32) * x.to(tl.float32), 0), ss)
                x = norm_w * x
            acc = tl.where(rows[:, None] == m, tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)[None, :], acc)

    if KSPLIT > 1:
        n_idx = tl.arange(0, BLOCK_N)
        first = pid_n * KSPLIT * ROWS * BLOCK_N  # partials [n blocks, KSPLIT, ROWS, BLOCK_N]
        tl.store(part_ptr + first + (pid_k * ROWS + rows[:, None]) * BLOCK_N + n_idx[None, :], acc,
                 mask=rows[:, None] < M)
        tl.store(ss_ptr + (pid_n * KSPLIT + pid_k) * ROWS + rows, ss, mask=rows < M)
        if REDUCE == 2:
            return
        if REDUCE == 0:
            tl.debug_barrier()
            if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel") != KSPLIT - 1:
                return
        elif tl.atomic_add(count_ptr + pid_n, 1, sem="relaxed") != KSPLIT - 1:
            return
        ks = tl.arange(0, KSPLIT_PAD)
        used = (rows[None, :] < M) & (ks[:, None] < KSPLIT)
        acc = tl.sum(tl.load(part_ptr + first + (ks[:, None, None] * ROWS + rows[None, :, None]) * BLOCK_N
                             + n_idx[None, None, :], mask=used[:, :, None], other=0.0), 0)
        ss = tl.sum(tl.load(ss_ptr + pid_n * KSPLIT * ROWS + ks[:, None] * ROWS + rows[None, :], mask=used,
                            other=0.0), 0)
        tl.store(count_ptr + pid_n, 0)
    store_outputs(acc, ss, bias, out_ptr, rows, outs, M, N, K, eps, stride_om, NORM, SILU_AND_MUL, ROWS, BLOCK_N)


CONFIG = dict(dot=True, block_n=64, tile=16384, warps=4, reduce=0)  # set by the sweep


@functools.cache
def scratch(device: torch.device):
    """Partials, partial sums of squares and arrival counts, shared by every launch (the chain is serial)."""
    return (torch.empty(64 << 20, dtype=torch.float32, device=device),
            torch.empty(1 << 20, dtype=torch.float32, device=device),
            torch.zeros(1 << 20, dtype=torch.int32, device=device))


def splitk(x, weight, bias=None, silu_and_mul=False, norm_weight=None, eps=0.0, residual=None, residual_out=None):
    """As kernels/gemv.py's gemv (no LoRA), with CONFIG's split-K kernel."""
    (m, k), c = x.shape, CONFIG
    n = weight.shape[0] // (2 if silu_and_mul else 1)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_k = min(triton.next_power_of_2(k), c["tile"] // c["block_n"])
    ksplit, n_blocks = triton.cdiv(k, block_k), triton.cdiv(weight.shape[0], c["block_n"])
    rows = 16 if c["dot"] else triton.next_power_of_2(m)  # tl.dot needs 16
    part, ss, count = scratch(x.device)
    assert m <= 16 and n_blocks * ksplit * rows * c["block_n"] <= part.numel() and n_blocks <= count.numel()
    r, r_out = (residual, residual_out) if residual is not None else (x, out)
    _splitk_kernel[(n_blocks, ksplit)](
        x, weight, weight if bias is None else bias, out, r, weight if norm_weight is None else norm_weight, r_out,
        eps, part, ss, count, m, n, k, x.stride(0), weight.stride(0), out.stride(0), r.stride(0), r_out.stride(0),
        HAS_BIAS=bias is not None, SILU_AND_MUL=silu_and_mul, NORM=norm_weight is not None,
        ADD_RESIDUAL=residual is not None, DOT=c["dot"], REDUCE=c["reduce"], KSPLIT=ksplit,
        KSPLIT_PAD=triton.next_power_of_2(ksplit), ROWS=rows, BLOCK_N=c["block_n"], BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=c["warps"],
        **launch_options(x.device))
    return out


def chain(x, weights, q_width, product):
    """tools/bench_gemv.py's chain with `product` (gemv or splitk) for every linear layer."""
    layers, head, norm_w = weights
    h, residual = x, torch.zeros_like(x)
    for qkv, o, gate_up, down in layers:
        residual_out = torch.empty_like(residual)
        h = product(product(h, qkv, None, False, norm_w, 1e-6, residual, residual_out)[:, :q_width], o)
        residual, residual_out = residual_out, torch.empty_like(residual)
        h = product(product(h, gate_up, None, True, norm_w, 1e-6, residual, residual_out), down)
        residual = residual_out
    return product(add_rms_norm(h, residual, norm_w, 1e-6)[0], head)


def check(device: str, product) -> int:
    """product (splitk, tools/bench_tc.py's tc) against F.linear (and the MLP's activation) on the same
    inputs; returns the failures."""
    failures = 0
    for dtype in (torch.bfloat16, torch.float32) if device == "cuda" else (torch.float32,):
        for rows, n, k, silu, norm in [(r, n, k, s, nm) for r in (1, 3, 16) for n, k in ((40, 24), (96, 1000))
                                       for s in (False, True) for nm in (False, True)]:
            gen = torch.Generator().manual_seed(rows * n + k)
            x = torch.randn(rows, k + 3, generator=gen)[:, :k].to(dtype)
            w = (torch.randn((2 if silu else 1) * n, k, generator=gen) / k ** 0.5).to(dtype)
            b = torch.randn(w.shape[0], generator=gen).to(dtype)
            r = torch.randn(rows, k, generator=gen).to(dtype) if norm else None
            norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype) if norm else None
            ref = F.linear((ref_rms_norm(x + r, norm_w, 1e-6) if norm else x).float(), w.float(), b.float())
            if silu:
                gate, up = ref.to(dtype).float().chunk(2, -1)
                ref = (F.silu(gate).to(dtype).float() * up)
            to = lambda t: None if t is None else t.to(device)
            r_out = torch.full((rows, k), float("nan"), dtype=dtype, device=device) if norm else None
            out = product(to(x), to(w), to(b), silu, to(norm_w), 1e-6, to(r), r_out).cpu().float()
            err = ((out - ref).norm() / ref.norm()).item()
            if err > (2e-2 if dtype == torch.bfloat16 else 1e-4) or (norm and not torch.equal(r_out.cpu(), x + r)):
                failures += 1
                print(f"FAIL {product.__name__} {dtype} rows {rows} n {n} k {k} silu {silu} norm {norm}: rel err {err:.1e}")
    return failures


def parse_config(text: str) -> dict:
    kind, *numbers = text[0], *map(int, text[1:].split("/"))
    block_n, tile, warps, reduce = (numbers + [0])[:4]
    return dict(dot=kind == "d", block_n=block_n, tile=tile, warps=warps, reduce=reduce)


def main(product, config: dict, parse, default_configs: str, check_overrides=None) -> None:
    """The command line of this tool and of tools/bench_tc.py: `product`'s check (for each config parsed by
    `parse` into `config`, with check_overrides), then the chain per shape and row count, GEMV first."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-8b", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--configs", default=default_configs)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    texts = args.configs.split(",")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.check:
        failures = 0
        for text in texts:
            config.update(parse(text), **(check_overrides or {}))
            failures += (config_failures := check(device, product))
            print(f"check {text}: {config_failures} failures")
        print(f"check: {failures} failures")
    for shape in args.shape.split(",") if device == "cuda" else []:
        hidden, qkv, q, inter, layers = SHAPES[shape]
        mk = lambda n, k: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        weights = ([(mk(qkv, hidden), mk(hidden, q), mk(2 * inter, hidden), mk(hidden, inter)) for _ in range(layers)],
                   mk(VOCAB, hidden), (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16))
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
            ms, ref = time_graph(lambda x: chain(x, weights, q, gemv), x)
            line = f"{shape} rows {rows:2d}: gemv {ms:.3f} ms"
            for text in texts:
                config.update(parse(text))
                ms, out = time_graph(lambda x: chain(x, weights, q, product), x)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                line += f" | {text} {ms:.3f} (vs gemv {err:.0e})"
            print(line, flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(splitk, CONFIG, parse_config, "d64/16384/4,d32/8192/4,f32/8192/4,f8/8192/4", check_overrides=dict(reduce=0))
