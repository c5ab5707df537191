"""kernels/bgmv.py's batched multi-LoRA product (shrink then expand, and shrink then the GEMV of
kernels/gemv.py adding the delta itself) against a plain per-row torch loop.

Adapters are stored as the engine stores them: slot s of rank r_s <= rank has A rows and B
columns past r_s zero, a part the adapter does not target is all zero, and one slot that no row
uses is NaN (a row that gathered the wrong slot would turn NaN). Rows with slot -1 must keep
their bits. Every test needs triton (the module's ``triton`` marker: skipped where it does not
import, conftest.py). GPU tests carry the ``gpu`` marker and skip without CUDA; the
``*_interpreter`` tests run tiny shapes in the Triton interpreter (conftest.py turns it on
without CUDA).
"""
import os

import pytest
import torch

pytestmark = pytest.mark.triton
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
requires_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter is on only without CUDA (conftest.py)"
)


def starts_of(part_sizes):
    return tuple(sum(part_sizes[:p]) for p in range(len(part_sizes)))


def reference(x, y, lora_a, lora_b, token_slots, part_starts, rank):
    """The oracle: row by row, part by part, in float32, rounded once into y."""
    out, ends = y.clone(), list(part_starts[1:]) + [y.shape[1]]
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            delta = torch.cat([lora_b[s, start:end, :rank].float() @ (lora_a[s, p, :rank].float() @ x[t].float())
                               for p, (start, end) in enumerate(zip(part_starts, ends))])
            out[t] = (y[t].float() + delta).to(y.dtype)
    return out


def make_inputs(gen, num_rows, k, part_sizes, max_rank, rank, dtype, poison_past_rank=False):
    """Four slots: 0 has rank `rank`, 1 a smaller rank and no last part (if there are several),
    2 rank 1, 3 is NaN and unused. Strided x and y rows, as slices of wider buffers are."""
    num_parts, n, starts = len(part_sizes), sum(part_sizes), starts_of(part_sizes)
    lora_a = torch.zeros(4, num_parts, max_rank, k)
    lora_b = torch.zeros(4, n, max_rank)
    for s, r in enumerate([rank, max(1, rank // 2), 1]):
        lora_a[s, :, :r] = torch.randn(num_parts, r, k, generator=gen) / k**0.5
        lora_b[s, :, :r] = torch.randn(n, r, generator=gen) / r**0.5
    if num_parts > 1:
        lora_a[1, -1], lora_b[1, starts[-1]:] = 0, 0
    lora_a[3], lora_b[3] = float("nan"), float("nan")
    if poison_past_rank:  # the kernel must not even read the columns past the rank bucket
        lora_a[:, :, rank:], lora_b[:, :, rank:] = float("nan"), float("nan")
    lora_b *= 0.5 + torch.rand(4, 1, 1, generator=gen)  # the engine folds each adapter's scaling into B
    slots = torch.randint(-1, 3, (num_rows,), generator=gen, dtype=torch.int32)
    slots[0] = 0
    if num_rows > 1:
        slots[-1] = -1
    x = torch.randn(num_rows, k + 3, generator=gen).to(dtype)[:, :k]
    y = torch.randn(num_rows, n + 5, generator=gen).to(dtype)[:, :n]
    return x, y, lora_a.to(dtype), lora_b.to(dtype), slots


def lora_bgmv(x, y, lora_a, lora_b, slots, starts, rank, rows_per_program=1):
    """The cuBLAS path's delta: shrink, then expand into y."""
    from nanograph.kernels.bgmv import lora_expand, lora_shrink
    h = lora_shrink(x, lora_a, slots, rank, rows_per_program=rows_per_program)
    lora_expand(y, h, lora_b, slots, starts, rows_per_program)


# a prefill step's slots: runs of one adapter (a chunk each), base-model chunks between them
PREFILL_SLOTS = [-1] * 3 + [0] * 7 + [2] * 9 + [-1] * 2 + [1] * 5 + [0] * 11


def check_lora_bgmv(device, dtype, num_rows, k, part_sizes, max_rank, rank, seed=0, poison_past_rank=False,
                    rows_per_program=1, slot_list=None):
    """Against the oracle; with rows_per_program > 1 also bit for bit against one row a program."""
    gen = torch.Generator().manual_seed(seed + num_rows * 1000 + k)
    x, y, lora_a, lora_b, slots = make_inputs(gen, num_rows, k, part_sizes, max_rank, rank, dtype, poison_past_rank)
    if slot_list is not None:
        slots = torch.tensor(slot_list, dtype=torch.int32)
    starts = starts_of(part_sizes)
    ref = reference(x, y, lora_a, lora_b, slots, starts, rank)
    outs = []
    for rows in sorted({1, rows_per_program}):
        out = torch.zeros(num_rows, y.shape[1] + 5, dtype=dtype, device=device)[:, :y.shape[1]]  # strided, as y
        out.copy_(y)
        lora_bgmv(x.to(device), out, lora_a.to(device), lora_b.to(device), slots.to(device), starts, rank, rows)
        outs.append(out.cpu())
    assert_close_delta(outs[-1], ref, y, slots, dtype)
    assert torch.equal(outs[0], outs[-1])


def assert_close_delta(out, ref, y, slots, dtype):
    """Rows without an adapter bit for bit as before; the others' deltas as the oracle's."""
    none = slots.cpu() < 0
    assert torch.equal(out[none], y[none])
    delta, ref_delta = out.float() - y.float(), ref.float() - y.float()
    assert torch.isfinite(delta).all() and ref_delta[~none].abs().max() > 0.1
    err = ((delta - ref_delta).norm() / ref_delta.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


def check_gemv_lora(device, dtype, num_rows, k, part_sizes, deferred, rank=8, max_rank=16, tensor_cores=False):
    """The GEMV path: a shrink, then the GEMV (or, tensor_cores, the other kernel of gemv.py) that adds the delta itself, against F.linear plus the
    oracle's delta on the GEMV's input (x, or with deferred="norm" rms_norm(x + residual)); with two
    equal parts ([gate | up]) the GEMV also applies the MLP's activation to the sum, as in the
    model. The deferred norm's h comes as in the engine, from a fold (lora/layer.py): x is the
    output p W_p^T of a producer with input p, and the producer's shrink multiplies [p | residual]
    by its folded parts (A diag(norm weight)) [W_p | I]; the GEMV takes those parts (a strided view
    past the producer's own) and applies the norm's 1 / rms. Slot -1 rows must get exactly the
    GEMV's product without LoRA."""
    from nanograph.kernels.gemv import gemv
    from nanograph.kernels.bgmv import lora_shrink
    from nanograph.layers.norm import rms_norm
    from nanograph.models.decoder import silu_and_mul

    gen = torch.Generator().manual_seed(num_rows * 100 + k)
    x, _, lora_a, lora_b, slots = make_inputs(gen, num_rows, k, part_sizes, max_rank, rank, dtype)
    n, starts = sum(part_sizes), starts_of(part_sizes)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    norm = deferred == "norm"
    if norm:
        k_p = k + 8  # the producer's input width
        producer_in = torch.randn(num_rows, k_p, generator=gen).to(dtype)
        w_p = (torch.randn(k, k_p, generator=gen) / k_p**0.5).to(dtype)
        x = (producer_in.float() @ w_p.float().T).to(dtype)
        residual = torch.randn(num_rows, k, generator=gen).to(dtype)
        norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
        folded = lora_a.float() * norm_w.float()  # [slots, parts, R, k]
        fold_a = torch.zeros(4, 1 + len(part_sizes), max_rank, k_p + k)  # part 0: the producer's own (none here)
        fold_a[:, 1:] = torch.cat([folded @ w_p.float(), folded], -1)
    x_in = rms_norm(x + residual, norm_w, 1e-6) if norm else x
    product = torch.nn.functional.linear(x_in.float(), w.float())
    ref = reference(x_in.float(), product, lora_a.float(), lora_b.float(), slots, starts, rank)
    gate_up = len(part_sizes) == 2 and part_sizes[0] == part_sizes[1]
    if gate_up:
        ref, product = (silu_and_mul(t.to(dtype)).float() for t in (ref, product))

    to = lambda t: None if t is None else t.to(device)
    if norm:
        r_out = torch.empty(num_rows, k, dtype=dtype, device=device)
        args = (to(x), to(w), None, gate_up, to(norm_w), 1e-6, to(residual), r_out)
        h = lora_shrink(to(producer_in), to(fold_a.to(dtype)), to(slots), rank, to(residual))[:, 1:]
    else:
        args = (to(x), to(w), None, gate_up)
        h = lora_shrink(to(x), to(lora_a), to(slots), rank)
    out = gemv(*args, lora=(h, to(lora_b), to(slots), starts), tensor_cores=tensor_cores).cpu()
    base = gemv(*args, tensor_cores=tensor_cores).cpu()
    none = slots < 0
    assert torch.equal(out[none], base[none])
    assert (ref - product)[~none].abs().max() > 0.1  # the adapters change the output
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


# ---------------------------------------------------------------- GPU tests


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_rows,tensor_cores", [(1, False), (2, False), (3, False), (4, False), (2, True),
                                                   (5, True), (16, True)])
@pytest.mark.parametrize("k,part_sizes,deferred", [(1024, (2048, 1024, 1024), "norm"), (1024, (3072, 3072), "norm"),
                                                  (2048, (1024,), None), (3072, (1024,), None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_lora(num_rows, tensor_cores, k, part_sizes, deferred, dtype):
    """The Qwen3-0.6B shapes (QKV and gate/up with the deferred norm, gate/up also with the activation,
    o, down), max_lora_rank 64, rank 16."""
    check_gemv_lora("cuda", dtype, num_rows, k, part_sizes, deferred, 16, 64, tensor_cores)



@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_rows", [1, 7, 16, 64])
@pytest.mark.parametrize("k,part_sizes", [(1024, (2048, 1024, 1024)), (1024, (3072, 3072)), (3072, (1024,))])
def test_lora_bgmv(num_rows, k, part_sizes):
    """The Qwen3-0.6B shapes (QKV, gate/up, down) with max_lora_rank 64 in the rank-16 bucket."""
    check_lora_bgmv("cuda", torch.bfloat16, num_rows, k, part_sizes, 64, 16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rank", [8, 64])
def test_lora_bgmv_ranks(rank):
    check_lora_bgmv("cuda", torch.bfloat16, 33, 1024, (2048, 1024, 1024), 64, rank, poison_past_rank=rank < 64)


@pytest.mark.gpu
@requires_cuda
def test_lora_bgmv_cuda_graph_replay():
    """Capture once, replay with new slots and inputs (same shapes): nothing about one step may be
    baked into the graph."""
    gen = torch.Generator().manual_seed(7)
    num_rows, k, part_sizes, starts = 16, 1024, (2048, 1024, 1024), starts_of((2048, 1024, 1024))
    static = [t.cuda() for t in make_inputs(gen, num_rows, k, part_sizes, 64, 16, torch.bfloat16)]
    x, y, lora_a, lora_b, slots = static

    stream = torch.cuda.Stream()  # warm up (compile) off the default stream before capture
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        lora_bgmv(x, y, lora_a, lora_b, slots, starts, 16)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_bgmv(x, y, lora_a, lora_b, slots, starts, 16)

    for slot_list in ([-1] * 16, [2, -1, 0, 1] * 4, [0] * 16, None):  # None: random, as make_inputs draws them
        new = make_inputs(gen, num_rows, k, part_sizes, 64, 16, torch.bfloat16)
        new_x, new_y, new_slots = new[0], new[1], new[4] if slot_list is None else torch.tensor(slot_list).int()
        for buffer, value in zip((x, y, slots), (new_x, new_y, new_slots)):
            buffer.copy_(value)
        ref = reference(new_x, new_y, *(t.cpu() for t in (lora_a, lora_b)), new_slots, starts, 16)
        graph.replay()
        if (new_slots < 0).all():
            assert torch.equal(y.cpu(), new_y)
        else:
            assert_close_delta(y.cpu(), ref, new_y, new_slots, torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("slot_list", [None, PREFILL_SLOTS * 8])
def test_lora_bgmv_rows_per_program(slot_list):
    """A prefill step's rows, 16 a program: each program gathers an adapter's weights once for its
    rows of that adapter (random slots: a gather nearly every row)."""
    check_lora_bgmv("cuda", torch.bfloat16, 296, 1024, (2048, 1024, 1024), 64, 16, poison_past_rank=True,
                    rows_per_program=16, slot_list=slot_list)


# ---------------------------------------------------------------- interpreter (CPU) tests


@requires_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 3, 16, 37])
@pytest.mark.parametrize("k,part_sizes", [(96, (40,)), (32, (48, 24)), (72, (40, 17, 23))])
def test_lora_bgmv_interpreter(dtype, num_rows, k, part_sizes):
    check_lora_bgmv("cpu", dtype, num_rows, k, part_sizes, 16, 8)


@requires_interpreter
@pytest.mark.parametrize("num_rows,tensor_cores", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("k,part_sizes,deferred", [(24, (40, 17, 23), "norm"), (32, (24, 24), None),
                                                  (40, (24,), None)])
def test_gemv_lora_interpreter(num_rows, tensor_cores, k, part_sizes, deferred):
    check_gemv_lora("cpu", torch.float32, num_rows, k, part_sizes, deferred, tensor_cores=tensor_cores)


@requires_interpreter
@pytest.mark.parametrize("rows_per_program", [4, 16])
@pytest.mark.parametrize("slot_list", [None, PREFILL_SLOTS])
def test_lora_bgmv_rows_per_program_interpreter(rows_per_program, slot_list):
    """Several rows a program (the last program's rows past the step's end), adapters changing and
    rows without one inside a program, NaN past the rank bucket."""
    check_lora_bgmv("cpu", torch.float32, 37, 72, (40, 17, 23), 16, 8, poison_past_rank=True,
                    rows_per_program=rows_per_program, slot_list=slot_list)


@requires_interpreter
def test_lora_bgmv_rank_is_max_rank_interpreter():
    """rank == R, not a power of two: every column is read, the padded lanes are masked."""
    check_lora_bgmv("cpu", torch.float32, 5, 48, (40, 17, 23), 12, 12)


@requires_interpreter
def test_lora_bgmv_small_tiles_interpreter(monkeypatch):
    """Several rank blocks per part and output tiles that straddle parts; NaN past the rank bucket."""
    from nanograph.kernels import bgmv

    monkeypatch.setattr(bgmv, "SHRINK_TILE", 256)
    monkeypatch.setattr(bgmv, "EXPAND_TILE", 128)
    check_lora_bgmv("cpu", torch.float32, 6, 64, (40, 17, 23), 32, 16, poison_past_rank=True)
