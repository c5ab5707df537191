"""bench.py and benchmarks/: the reference workload is nano-vllm's, the helpers compute what they
say, and the quick run works end to end on the CPU."""
import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # bench.py and benchmarks/ live at the repository root, not in the package

import bench  # noqa: E402
from benchmarks import checkpoint, compare, decode_sweep, harness, kv_bandwidth, ladders, lora  # noqa: E402
from benchmarks import mixed_step_cost, peers, serving, serving_dp, serving_http, shapes  # noqa: E402
from benchmarks import timing, workloads  # noqa: E402
from benchmarks.report import RunResult  # noqa: E402


def test_reference_workload_is_nano_vllm_s():
    work = workloads.reference_workload()
    assert work.num_seqs == 256
    assert work.output_tokens == workloads.REFERENCE_OUTPUT_TOKENS == 133_966
    assert all(100 <= len(p) <= 1024 for p in work.prompts)
    assert all(100 <= n <= 1024 for n in work.max_tokens)
    assert all(0 <= t <= 10000 for p in work.prompts for t in p)
    # drawn exactly as nano-vllm's bench.py does, from the global random module
    import random
    from random import randint
    random.seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(256)]
    max_tokens = [randint(100, 1024) for _ in range(256)]
    assert work.prompts == prompts and work.max_tokens == max_tokens


def test_workload_head_keeps_the_first_sequences():
    work = workloads.reference_workload()
    head = work.head(64)
    assert head.prompts == work.prompts[:64] and head.max_tokens == work.max_tokens[:64]


def test_quick_workload_fits_the_tiny_model():
    work = workloads.quick_workload()
    for tiny in ("tiny", "tiny-llama"):
        assert all(0 <= t < shapes.SHAPES[tiny]["vocab_size"] for p in work.prompts for t in p)


def test_ladders_bench_builds():
    assert ladders.ladder_sizes("default", 512) is None  # the engine's own rule
    assert ladders.ladder_sizes("pow2", 512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert ladders.ladder_sizes("pow2", 48) == [1, 2, 4, 8, 16, 32, 48]
    nano = ladders.ladder_sizes("nano-vllm", 512)
    assert nano == [1, 2, 4, 8] + list(range(16, 513, 16)) and len(nano) == 36
    assert ladders.ladder_sizes("nano-vllm", 40) == [1, 2, 4, 8, 16, 32, 40]


def test_sweep_sizes_are_dense_at_the_small_end():
    dense = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert decode_sweep.sweep_sizes(256) == dense
    assert decode_sweep.sweep_sizes(8) == [1, 2, 3, 4, 6, 8]
    assert decode_sweep.sweep_sizes(100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96]


# total parameters of the public checkpoints (model cards), within 2%
PUBLISHED_PARAMS = {"qwen3-0.6b": 0.6e9, "qwen3-1.7b": 1.7e9, "qwen3-4b": 4.0e9, "qwen3-8b": 8.2e9,
                    "llama3.2-1b": 1.24e9, "llama3.1-8b": 8.03e9}


@pytest.mark.parametrize("shape", shapes.BENCH_SHAPES)
def test_shapes_are_the_public_models(shape, tmp_path):
    from transformers import AutoConfig
    path = shapes.write_model_dir(shape, str(tmp_path))
    raw = json.load(open(os.path.join(path, "config.json")))
    cfg = AutoConfig.from_pretrained(path)
    family = "llama" if shape.startswith("llama") else "qwen3"
    assert raw["model_type"] == cfg.model_type == family
    assert raw["architectures"] == [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]]
    hd, h = cfg.head_dim, cfg.hidden_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layer = 2 * h * q + 2 * h * kv + 3 * h * cfg.intermediate_size + 2 * h + (2 * hd if family == "qwen3" else 0)
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    params = embeddings + cfg.num_hidden_layers * layer + h
    assert params == pytest.approx(PUBLISHED_PARAMS[shape], rel=0.02)
    rope = cfg.rope_parameters
    if family == "llama":
        assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500_000.0
        assert rope["factor"] == (32.0 if shape == "llama3.2-1b" else 8.0)
        assert (rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]) == (1, 4, 8192)
    else:
        assert rope["rope_theta"] == 1_000_000.0


def test_timed_call_figures_come_from_graph_stats():
    from nanograph.engine.cuda_graph import GraphStats, decode_shape, mixed_shape
    stats = GraphStats()
    stats.replays.update({decode_shape(8): 5, decode_shape(16): 1, mixed_shape(8, 64): 2})
    stats.real_rows, stats.real_tokens = 50, 100
    stats.eager.update(decode=2, mixed=1)
    before = timing.graph_counters(stats)  # the warm-up's counts
    stats.replays.update({decode_shape(4): 3, decode_shape(16, 16): 1, mixed_shape(8, 64): 1})
    stats.real_rows += 3 * 3 + 12
    stats.real_tokens += 60
    stats.eager.update(decode=1, mixed=1)
    figures = timing.call_figures(before, timing.graph_counters(stats))
    assert figures["replays_per_bucket"] == {4: 3, 16: 1}
    assert figures["decode_steps"] == 5 and figures["graph_replays"] == 4
    assert figures["graph_hit_rate"] == pytest.approx(4 / 5)
    assert figures["padding_waste"] == pytest.approx((3 * 4 + 16 - 21) / 21)
    assert figures["mixed_steps"] == 2 and figures["mixed_graph_hit_rate"] == pytest.approx(1 / 2)
    assert figures["mixed_padding_waste"] == pytest.approx((72 - 60) / 60)


def test_call_figures_count_the_call_s_steps_by_kind():
    from collections import Counter
    before, after = {"steps": Counter(decode=2, prefill=1)}, {"steps": Counter(decode=5, mixed=1, prefill=1)}
    assert timing.call_figures(before, after) == {"steps": {"decode": 3, "mixed": 1, "prefill": 0}}


def test_decode_step_puts_each_sequence_on_blocks_of_its_own():
    from benchmarks.runner import decode_step
    step = decode_step(3, context_len=300, block_size=256)  # 2 blocks a sequence
    assert step.block_tables == [[0, 1], [2, 3], [4, 5]] and step.context_lens == [300] * 3
    assert step.positions == [299] * 3  # in each sequence's second block, at offset 43
    assert step.slot_mapping == [1 * 256 + 43, 3 * 256 + 43, 5 * 256 + 43]
    assert step.variant == 0 and step.extras == {}
    lora_step = decode_step(3, 300, 256, lora_slots=[0, 1, 0], lora_rank=16)  # one token a sequence
    assert (lora_step.extras["lora"].seq_slots, lora_step.variant) == ([0, 1, 0], 16)


def test_busy_share_is_the_union_of_intervals():
    assert timing.busy_share([(5, 6), (0, 2), (1, 3)]) == pytest.approx(4 / 6)
    assert timing.busy_share([(0, 10), (2, 3)]) == 1.0
    assert timing.busy_share([]) is None  # nothing ran on the GPU


def test_ratios_compare_the_same_sequences():
    rows = [RunResult("graphs", 256, 1000, 1.0), RunResult("eager", 256, 1000, 4.0),
            RunResult("graphs, first 32", 32, 100, 1.0), RunResult("HF", 32, 100, 10.0),
            RunResult("HF failed", 32, error="boom")]
    assert compare.same_set_ratios(rows) == [1.0, 0.25, 1.0, 0.1, None]


def test_quick_bench_runs_end_to_end(tmp_path):
    """The CLI: the reference run, --compare with HF on a subset, --overlap."""
    out = tmp_path / "b.json"
    proc = subprocess.run([sys.executable, "bench.py", "--quick", "--device", "cpu", "--compare", "--overlap",
                           "--hf-seqs", "4", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"meta", "workload", "shapes"} <= set(report) and list(report["shapes"]) == ["qwen3-0.6b"]
    shape = report["shapes"]["qwen3-0.6b"]
    assert {"run", "compare", "overlap"} <= set(shape)
    work = workloads.quick_workload()
    requested, subset = work.output_tokens, work.head(4).output_tokens
    assert report["workload"]["output_tokens"] == requested

    run = shape["run"]
    assert run["output_tokens"] == requested  # ignore_eos: every request runs to its max_tokens
    assert run["tokens_per_s"] > 0 and run["error"] is None

    graphs, eager, graphs_subset, hf, *peer_rows = shape["compare"]["rows"]
    assert [p["engine"].split()[0] for p in peer_rows] == [peer.name for peer in peers.PEERS]
    for p in peer_rows:  # no peer runs on a CPU: each is a skipped row with its reason
        assert p["error"].startswith("skipped: ") and p["vs_nanograph"] is None, p["error"]
    assert graphs == run and "eager" in eager["engine"] and eager["output_tokens"] == requested
    # HF runs the first 4 sequences, and so does nanograph: the ratios compare the same sequences
    assert graphs_subset["engine"].endswith("first 4 sequences") and hf["engine"].startswith("HF")
    assert hf["error"] is None, hf["error"]
    assert graphs_subset["num_seqs"] == hf["num_seqs"] == 4
    assert graphs_subset["output_tokens"] == hf["output_tokens"] == subset
    assert graphs["vs_nanograph"] == graphs_subset["vs_nanograph"] == 1.0
    assert eager["vs_nanograph"] == pytest.approx(eager["tokens_per_s"] / graphs["tokens_per_s"])
    assert hf["vs_nanograph"] == pytest.approx(hf["tokens_per_s"] / graphs_subset["tokens_per_s"])

    on, off = shape["overlap"]["rows"]
    assert (on["stats"]["overlap_scheduling"], off["stats"]["overlap_scheduling"]) == (True, False)
    assert run["engine"] in (on["engine"], off["engine"])  # the reference run serves its default mode
    for row in (on, off):
        assert row["output_tokens"] == requested
        assert row["stats"].get("overlap_discarded_tokens", 0) == 0  # EOS ignored: no stop is seen late
        assert {"ms_per_token", "greedy_ms_per_token"} <= set(row["probe"])
        assert not {"gpu_busy_batch1", "gpu_busy_workload", "graph_step_ms"} & set(row["probe"])  # CPU
    assert "busy shares skipped" in proc.stdout


def test_attention_backends_run_one_after_the_other(monkeypatch):
    """--attention-backend a,b: every section once per backend, each engine built with its backend."""
    built = []
    monkeypatch.setattr(bench, "run_sections", lambda setup: built.append(setup.llm().config.attention_backend) or {})
    report = bench.main(["--quick", "--device", "cpu", "--run", "--attention-backend", "torch,triton"])
    assert list(report["shapes"]) == ["qwen3-0.6b (torch)", "qwen3-0.6b (triton)"] and built == ["torch", "triton"]


def test_quick_decode_sweep_covers_several_shapes():
    report = bench.main(["--quick", "--device", "cpu", "--decode-sweep", "--sweep-iters", "1",
                         "--shape", "qwen3-0.6b,llama3.2-1b"])
    assert list(report["shapes"]) == ["qwen3-0.6b", "llama3.2-1b"]
    for shape in report["shapes"].values():
        assert set(shape) == {"decode_sweep"}
        sweep = shape["decode_sweep"]
        rows, b = sweep["rows"], sweep["batch1"]
        assert [r["batch"] for r in rows] == [1, 2, 3, 4, 6, 8]
        assert b["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32
        for r in rows:
            assert r["graph_ms"] is None and r["eager_ms"] > 0  # CPU: no graphs
            kv = r["batch"] * sweep["context_len"] * b["kv_bytes_per_token"]
            assert r["floor_ms"] == pytest.approx((b["weight_bytes"] + kv) / b["copy_bandwidth_Bps"] * 1e3)


def test_lora_adapters_are_peft_directories_the_engine_accepts(tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig

    from nanograph.lora.adapter import TARGETS, read_adapter
    model = shapes.write_model_dir("tiny", str(tmp_path))
    hf = AutoConfig.from_pretrained(model)
    requests = lora.write_lora_adapters(model, 2, 8, "bfloat16", str(tmp_path))
    assert len({r.path for r in requests}) == 2
    for request in requests:
        adapter = read_adapter(request, hf, max_rank=8)  # config and every tensor's target and shape checked
        assert adapter.rank == 8 and adapter.scaling == 2.0
        with safe_open(os.path.join(request.path, "adapter_model.safetensors"), framework="pt") as f:
            names = set(f.keys())
            assert {f.get_tensor(name).dtype for name in names} == {torch.bfloat16}
        modules = {(int(name.split(".")[4]), name.split(".")[6]) for name in names}
        assert modules == {(i, m) for i in range(hf.num_hidden_layers) for m in TARGETS}  # all seven, every layer
        assert len(names) == 2 * len(modules)  # lora_A and lora_B each
    with pytest.raises(ValueError, match="above max_lora_rank"):
        read_adapter(requests[0], hf, max_rank=4)


def test_lora_flags():
    assert bench.parse_args(["--lora", "2"]).run_default is False  # --lora alone runs only its section
    args = bench.parse_args(["--all"])
    assert (args.lora, args.lora_rank) == (4, 16)
    assert bench.parse_args(["--all", "--lora", "2", "--lora-rank", "8"]).lora == 2


def test_serving_flags():
    assert bench.parse_args(["--serving"]).run_default is False  # alone, only its section runs
    assert bench.parse_args(["--all"]).serving is True
    assert bench.parse_args(["--serving-http"]).run_default is False
    assert bench.parse_args(["--all"]).serving_http is True


class FakeClient:
    """A Client whose every request gets `per_step` tokens a step until it has its max_tokens."""

    def __init__(self, per_step=1):
        self.per_step, self.left, self.done = per_step, {}, {}

    def add(self, prompt, params):
        key = len(self.left)
        self.left[key], self.done[key] = params.max_tokens, 0
        return key

    def step(self, timeout=None):
        time.sleep(0.001)
        out = []
        for key in [k for k, n in self.left.items() if n]:
            new = min(self.per_step, self.left[key])
            self.left[key] -= new
            self.done[key] += new
            out.append((key, self.done[key]))
        return out

    def busy(self):
        return any(self.left.values())


def test_drive_traces_what_a_client_sees():
    """Arrivals in the future are waited for (and that wait is no step's interval); several tokens
    in one step are one gap then zero gaps; TTFT counts from the arrival, not from the send."""
    work = workloads.Workload([[1], [2]], [3, 2])
    trace = serving.drive(FakeClient(), work, arrivals=[0.0, 0.1])
    assert trace.output_tokens == 5 and set(trace.arrival.values()) == {0.0, 0.1}
    assert trace.token_steps == {0: [0, 1, 2], 1: [3, 4]}  # request 0 had finished: an idle wait
    assert trace.gaps(trace.token_steps) == [1, 1, 1]
    assert trace.seconds >= 0.1 and len(trace.step_intervals) == 3  # 5 steps, one wait between
    assert max(trace.step_intervals) < 0.09 and all(t < 0.09 for t in trace.ttfts())
    two = serving.drive(FakeClient(per_step=2), workloads.Workload([[1]], [3]), [0.0])
    assert two.token_steps == {0: [0, 0, 1]} and two.gaps(two.token_times)[0] == 0.0


def test_tokens_count_when_the_client_says_they_came():
    """A client that stamps its tokens (HttpClient: when each chunk arrived) is taken at its word:
    two tokens in one poll are two times, not one."""
    trace = serving.LatencyTrace()
    trace.arrive("r", 0.0)
    trace.stepped(0.5, [("r", 1, trace.start + 0.1), ("r", 2, trace.start + 0.3)])
    trace.stepped(0.6, [("r", 3)])  # without a time: when the step returned
    assert trace.token_times["r"] == pytest.approx([0.1, 0.3, 0.6])
    assert trace.token_steps["r"] == [0, 0, 1]


def test_a_request_sent_after_its_arrival_counts_from_its_send():
    """A client that sends later than `add` (HttpClient, from its own event loop) says when,
    with an entry of 0 tokens: TTFT counts from there; gaps and steps are not changed by it."""
    trace = serving.LatencyTrace()
    trace.arrive("r", 0.0)
    trace.stepped(0.5, [("r", 0, trace.start + 0.2), ("r", 1, trace.start + 0.3)])
    trace.stepped(0.6, [("r", 2, trace.start + 0.55)])
    assert trace.ttfts() == pytest.approx([0.1])
    assert trace.token_times["r"] == pytest.approx([0.3, 0.55])
    assert trace.token_steps["r"] == [0, 1] and trace.output_tokens == 2


def test_server_flags_are_the_engine_knobs():
    knobs = dict(device="cpu", max_num_seqs=512, enable_prefix_caching=False, enforce_eager=True)
    assert serving_http.as_flags(knobs) == ["--device", "cpu", "--max-num-seqs", "512",
                                            "--no-enable-prefix-caching", "--enforce-eager"]


def chunk(text: str) -> bytes:
    """`text` as one chunk of a chunked HTTP/1.1 body."""
    return f"{len(text):x}\r\n{text}\r\n".encode()


def test_the_http_client_reads_each_event_of_a_chunked_sse_body():
    async def read(body: bytes) -> list:
        reader = asyncio.StreamReader()
        reader.feed_data(body)
        reader.feed_eof()
        return [json.loads(data) async for data in serving_http.events(reader)]

    events = [chunk('data: {"a": 1}\n\n'), chunk('data: {"b": [2]}\n\n')]
    done = chunk("data: [DONE]\n\n") + b"0\r\n\r\n"
    assert asyncio.run(read(b"".join(events) + done)) == [{"a": 1}, {"b": [2]}]
    with pytest.raises(RuntimeError, match="without data: \\[DONE\\]"):
        asyncio.run(read(b"".join(events)))  # the server went away mid-stream


class FakeServer:
    """An HTTP/1.1 server on 127.0.0.1 on a thread of its own: each request's JSON body goes to
    `bodies`, and `respond(body)` gives the bytes of the answer (status line on); `connections`
    counts the connections it accepted."""

    def __init__(self, respond):
        self.respond, self.connections, self.bodies = respond, [], []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self.serve, "127.0.0.1", 0), self.loop).result()
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def serve(self, reader, writer):
        self.connections.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError):  # (the client closing)
            while True:  # (until the client closes: readuntil raises)
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.bodies.append(json.loads(await reader.readexactly(length)))
                writer.write(self.respond(self.bodies[-1]))

    def close(self):
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)


def three_tokens_streamed(body) -> bytes:
    events = [{"choices": [{"text": f"t{i}"}]} for i in range(3)]
    events.append({"choices": [], "usage": {"completion_tokens": 3}})
    body = b"".join(chunk(f"data: {json.dumps(e)}\n\n") for e in events)
    return (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body
            + chunk("data: [DONE]\n\n") + b"0\r\n\r\n")


def three_tokens_at_once(body) -> bytes:
    data = json.dumps({"choices": [{"text": "t0t1t2"}], "usage": {"completion_tokens": 3}})
    return f"HTTP/1.1 200 OK\r\ncontent-length: {len(data)}\r\n\r\n{data}".encode()


def three_tokens_at_once_chunked(body) -> bytes:
    data = json.dumps({"choices": [{"text": "t0t1t2"}], "usage": {"completion_tokens": 3}})
    return (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            + chunk(data[:10]) + chunk(data[10:]) + b"0\r\n\r\n")


def entries_of_four_requests(client) -> list[list]:
    """Four requests one after another: each one's (tokens so far) entries, checked to come after
    the moment it was added."""
    params = SimpleNamespace(max_tokens=3, temperature=0.0, ignore_eos=True)
    counts = []
    for _ in range(4):
        added = time.perf_counter()
        client.add([1, 2], params)
        entries = []
        while client.busy():
            entries += client.step()
        assert added <= entries[0][2] <= entries[1][2]
        counts.append([count for _, count, _ in entries])
    return counts


@pytest.mark.parametrize("options, prompt", [({}, [1, 2]),
                                             ({"model": "m", "text_prompts": True}, "t1 t2")])
def test_the_http_client_reuses_a_connection_whose_stream_has_ended(options, prompt):
    """Requests one after another go over one kept-alive connection: the client reads each
    chunked body to its end (the `0` chunk), and counts every token of every stream, after the
    moment it sent the request. Each body has the prompt as token ids, or as the word-level
    tokenizer's text with the model named (for a router)."""
    server = FakeServer(three_tokens_streamed)
    with serving_http.HttpClient(server.url, **options) as client:
        assert entries_of_four_requests(client) == [[0, 1, 2, 3]] * 4  # sent, then its tokens
    assert len(server.connections) == 1
    sent = [(body["prompt"], body.get("model"), body["stream"]) for body in server.bodies]
    assert sent == [(prompt, options.get("model"), True)] * 4
    server.close()


@pytest.mark.parametrize("respond", [three_tokens_at_once, three_tokens_at_once_chunked])
def test_the_http_client_without_streams_counts_a_response_s_tokens_at_once(respond):
    """`stream=False`: each request asks for one response (of a known length, or chunked as a
    router may send it); its usage count arrives in one entry after the one of its sending, and
    the connection is used again."""
    server = FakeServer(respond)
    with serving_http.HttpClient(server.url, stream=False) as client:
        assert entries_of_four_requests(client) == [[0, 3]] * 4
    assert len(server.connections) == 1
    assert [body["stream"] for body in server.bodies] == [False] * 4
    assert all("stream_options" not in body for body in server.bodies)
    server.close()


def test_the_shared_prefix_workload_and_its_text(tmp_path):
    """--data-parallel-size's shared-prefix workload: each system prompt followed by its users'
    turns, in a shuffled order; a run's salt is every prompt's first token; a prompt as text is
    the same tokens for the server's word-level tokenizer."""
    from transformers import AutoConfig, AutoTokenizer
    setup = harness.build_setup(bench.parse_args(["--quick", "--device", "cpu"]), str(tmp_path),
                                "qwen3-0.6b")
    sizes = serving_dp.QUICK_SHARED
    run = serving_dp.shared_prefix_run(setup, sizes)
    prompts = run.workload.prompts
    systems = {tuple(prompt[:sizes.system_len]) for prompt in prompts}
    assert len(prompts) == sizes.systems * sizes.users and len(systems) == sizes.systems
    for system in systems:
        users = [p[sizes.system_len:] for p in prompts if tuple(p[:sizes.system_len]) == system]
        assert len(users) == sizes.users
        assert all(sizes.user_lens[0] <= len(user) <= sizes.user_lens[1] for user in users)
    firsts = [tuple(p[:sizes.system_len]) for p in prompts]
    assert firsts != sorted(firsts, key=lambda system: firsts.index(system))  # shuffled
    assert run.arrivals == sorted(run.arrivals) and run.fits(serving.QUICK.max_model_len - 1)
    salted = serving_dp.salted(run, 7).workload.prompts
    assert salted == [[7] + prompt for prompt in prompts]
    checkpoint.write_tokenizer(str(tmp_path / "tok"), AutoConfig.from_pretrained(setup.model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert tokenizer.encode(" ".join(f"t{t}" for t in salted[0])) == salted[0]


def test_the_saturation_workload_arrives_at_once_with_equal_lengths(tmp_path):
    """--data-parallel-size's saturation run: every request at t=0, each asking for the same
    number of tokens (no tail), prompts within their bounds, sent without streams."""
    setup = harness.build_setup(bench.parse_args(["--quick", "--device", "cpu"]), str(tmp_path),
                                "qwen3-0.6b")
    sizes = serving_dp.FULL_SATURATION
    run = serving_dp.saturation_run(setup, sizes)
    assert run.arrivals == [0.0] * sizes.requests and not run.streamed
    assert run.workload.max_tokens == [sizes.output_len] * sizes.requests
    lengths = [len(prompt) for prompt in run.workload.prompts]
    assert sizes.prompt_lens[0] <= min(lengths) < max(lengths) <= sizes.prompt_lens[1]


def test_the_shared_prefix_contrast_caches_half_the_system_prompts(tmp_path):
    """The contrast run: the shared-prefix workload at t=0, on replicas whose caches hold half
    the system prompts' blocks and the running requests' headroom."""
    setup = harness.build_setup(bench.parse_args(["--quick", "--device", "cpu"]), str(tmp_path),
                                "qwen3-0.6b")
    sizes = serving_dp.FULL_SHARED  # 32 system prompts of 1,024 tokens: 4 blocks of 256 each
    assert serving_dp.contrast_blocks(sizes, 256) == 64 + serving_dp.HEADROOM_BLOCKS
    run = serving_dp.contrast_run(setup, serving_dp.QUICK_SHARED)
    shared = serving_dp.shared_prefix_run(setup, serving_dp.QUICK_SHARED)
    assert run.workload == shared.workload and run.arrivals == [0.0] * len(shared.arrivals)


def test_a_replicas_row_reads_each_replicas_counters():
    """A row's hit rate is the replicas' hits over their prompt tokens in the run; the busiest
    share, the largest replica's part of those prompt tokens."""
    before = [(10.0, 100.0), (0.0, 50.0)]   # (prefix-cache hit tokens, prompt tokens) each
    after = [(70.0, 400.0), (30.0, 150.0)]  # this run: (60, 300) and (30, 100)
    row = serving_dp.ReplicasResult.of("2 replicas", None, before, after)
    assert row.hit_rate == pytest.approx(90 / 400)
    assert row.busiest_share == pytest.approx(300 / 400)


def test_the_http_target_is_itl_p99_and_ttft_p50():
    """At most 1.2x the in-process ITL p99, and TTFT p50 within two in-process steps."""
    local = SimpleNamespace(itl_p99=1.0, ttft_p50=5.0, step_p50=1.0)
    met = serving_http.TARGET_HTTP.met
    assert met(SimpleNamespace(itl_p99=1.2, ttft_p50=7.0), local)
    assert not met(SimpleNamespace(itl_p99=1.25, ttft_p50=6.0), local)
    assert not met(SimpleNamespace(itl_p99=1.1, ttft_p50=7.5), local)


def test_quick_serving_http_section(tmp_path):
    """--serving-http on the CPU: each Poisson workload in process and through a server
    subprocess; every request finishes both ways, with every token counted over HTTP."""
    out = tmp_path / "b.json"
    bench.main(["--quick", "--device", "cpu", "--serving-http", "--json", str(out)])
    section = json.loads(out.read_text())["shapes"]["qwen3-0.6b"]["serving_http"]
    assert "--no-enable-prefix-caching" in section["server_flags"]
    assert section["server_startup_seconds"] > 0
    rows, reference = section["runs"], workloads.quick_workload()
    assert [r["workload"] for r in rows] == ["Poisson 10 req/s, 8 requests",
                                             "Poisson 40 req/s, 8 requests"]
    for row in rows:
        local, http = row["in_process"], row["http"]
        for r in (local, http):
            assert (r["requests"], r["output_tokens"]) == (8, reference.output_tokens)
            assert r["tokens_per_s"] > 0
            for key in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
                assert r[key] > 0, key
        assert http["step_p50"] is None and local["step_p50"] > 0  # over HTTP a step is a poll
        for key in ("itl_p99", "ttft_p50"):
            assert row[f"{key}_http_vs_in_process"] == pytest.approx(http[key] / local[key])
        assert row["met"] is None  # judged on full GPU runs only
    assert rows[0]["target"].startswith("ITL p99 over HTTP <= 1.2x") and rows[1]["target"] is None


def test_importing_bench_leaves_triton_alone():
    """Triton's interpreter is a choice a process makes once (TRITON_INTERPRET before triton's
    first import): importing bench.py sets nothing and imports no kernel for --kv-bandwidth."""
    script = ("import os, sys, bench; print(os.environ.get('TRITON_INTERPRET'), "
              "[m for m in sys.modules if m.startswith('nanograph.kernels')])")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "None []"


@pytest.mark.triton
def test_quick_kv_bandwidth_section(tmp_path, monkeypatch):
    """--kv-bandwidth on a CPU as a user runs it (no TRITON_INTERPRET in bench's process): the
    tiny shape's attention in Triton's interpreter, in the tool's process; bench's own process
    keeps its environment."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (conftest sets it for the kernels)
    out = tmp_path / "b.json"
    bench.main(["--quick", "--device", "cpu", "--kv-bandwidth", "--json", str(out)])
    assert "TRITON_INTERPRET" not in os.environ
    shape = json.loads(out.read_text())["shapes"]["qwen3-0.6b"]
    assert set(shape) == {"kv_bandwidth"}  # alone, only its section runs
    section = shape["kv_bandwidth"]
    tiny = shapes.SHAPES["tiny"]
    assert (section["heads"], section["kv_heads"], section["head_dim"]) == (4, 2, 16)
    assert (section["block_size"], section["table_width"]) == (256, 1)  # max_model_len 256
    rows, copy_bandwidth = section["rows"], section["copy_bandwidth_Bps"]
    assert [(r["cache"], r["batch"], r["context"]) for r in rows] == \
        [(cache, 5, context) for cache in ("fp32", "fp8") for context in (40, 300)]
    assert copy_bandwidth > 0
    for r in rows:
        assert r["ms"] > 0 and r["bytes_per_s"] > 0
        element = 4 if r["cache"] == "fp32" else 1
        kv_bytes = r["batch"] * r["context"] * tiny["num_key_value_heads"] * tiny["head_dim"] * 2 * element
        assert r["bytes_per_s"] * r["ms"] / 1e3 == pytest.approx(kv_bytes)
        assert r["of_copy"] == pytest.approx(r["bytes_per_s"] / copy_bandwidth)
        assert not r["fused"] and r["splits"] >= 1 and r["target"] is None  # no target row here
    fp32, fp8 = rows[0], rows[2]
    assert fp8["keys_per_tile"] == 2 * fp32["keys_per_tile"]  # the same bytes a tile


def test_the_kv_bandwidth_target_is_80_percent_of_copy_at_batch_256_context_1k():
    row = {"cache": "bf16", "batch": 256, "context": 1024, "of_copy": 0.80}
    assert kv_bandwidth.TARGET.cell(row, judge=True) == ">= 80% of copy: met"
    assert kv_bandwidth.TARGET.cell(row | {"of_copy": 0.79}, judge=True) == ">= 80% of copy: MISSED"
    assert kv_bandwidth.TARGET.cell(row, judge=False) == ">= 80% of copy: -"
    for other in ({"cache": "fp8"}, {"batch": 512}, {"context": 4096}):
        assert kv_bandwidth.TARGET.cell(row | other, judge=True) == ""


def test_quick_mixed_step_cost_section(tmp_path):
    """--mixed-step-cost on a CPU: the decode-only row and one row a prefill size, each row's
    steps all of the kind it claims, with every sequence decoding in every step."""
    out = tmp_path / "b.json"
    bench.main(["--quick", "--device", "cpu", "--mixed-step-cost", "--json", str(out)])
    shape = json.loads(out.read_text())["shapes"]["qwen3-0.6b"]
    assert set(shape) == {"mixed_step_cost"}
    section, scale = shape["mixed_step_cost"], mixed_step_cost.QUICK
    assert (section["decodes"], section["steps"]) == (scale.decodes, scale.steps)
    assert section["max_model_len"] == scale.engine_knobs()["max_model_len"]
    rows = section["rows"]
    assert [r["prefill_tokens"] for r in rows] == [0, *scale.prefill_tokens]
    assert rows[0]["vs_decode_only"] == 1.0
    for r in rows:
        kind = "mixed" if r["prefill_tokens"] else "decode"
        assert r["steps"] == {"decode": 0, "mixed": 0, "prefill": 0} | {kind: scale.steps}
        assert r["decode_rows"] == [scale.decodes] and r["preemptions"] == 0
        assert r["prefill_tokens_a_step"] == [r["prefill_tokens"]]
        assert r["graphs"] == {"eager": scale.steps}  # no CUDA graphs on a CPU
        assert r["as_claimed"] and r["target"] is None  # the target is for 64 decode rows
        assert r["ms_p50"] > 0 and r["ms_mean"] > 0
        assert r["vs_decode_only"] == pytest.approx(r["ms_p50"] / rows[0]["ms_p50"])


def test_a_row_whose_sequences_finish_is_not_as_claimed(tiny_model, monkeypatch):
    """The check catches the tool's old fault: decoding sequences that reach their max_tokens
    during the rows leave fewer decode rows than the row claims."""
    from nanograph import LLM
    scale = mixed_step_cost.Scale(3, 16, (4, 8), 3)
    # one prefill step, 2 + 3 decode steps, then the 10th token in the second row's timed steps
    monkeypatch.setattr(mixed_step_cost.Scale, "new_tokens", property(lambda self: 10))
    with LLM(tiny_model("qwen3"), **scale.engine_knobs()) as llm:
        rows = mixed_step_cost.measure_mixed_steps(llm, scale, 100, judge=False)
    assert rows[0]["as_claimed"] and rows[0]["decode_rows"] == [3]
    assert not rows[1]["as_claimed"] and rows[1]["decode_rows"] == [0, 3]
    assert rows[1]["steps"]["prefill"] > 0


def test_the_mixed_step_target_is_64_decodes_and_16_tokens_within_1_1x():
    row = {"prefill_tokens": 16, "vs_decode_only": 1.10}
    assert mixed_step_cost.target_cell(row, 64, judge=True) == "<= 1.10x: met"
    assert mixed_step_cost.target_cell(row | {"vs_decode_only": 1.11}, 64, judge=True) == \
        "<= 1.10x: MISSED"
    assert mixed_step_cost.target_cell(row, 32, judge=True) == ""
    assert mixed_step_cost.target_cell(row | {"prefill_tokens": 64}, 64, judge=True) == ""


def test_quick_serving_section(tmp_path):
    """--serving on the CPU: every workload under both rules, every figure, the ratio rows."""
    out = tmp_path / "b.json"
    bench.main(["--quick", "--device", "cpu", "--serving", "--json", str(out)])
    shape = json.loads(out.read_text())["shapes"]["qwen3-0.6b"]
    assert set(shape) == {"serving"}
    section = shape["serving"]
    assert section["engine"]["num_graphs"] is None and section["skipped"] == []
    runs, ratios = section["runs"], section["ratios"]
    names = [r["workload"] for r in ratios]
    assert names[:4] == ["reference, 4 seqs", "reference, 512 seqs", "long prompts, 4 seqs",
                         "long prompts, 512 seqs"]
    assert names[4:] == ["Poisson 10 req/s, 8 requests", "Poisson 40 req/s, 8 requests"]
    assert [(r["workload"], r["rule"]) for r in runs] == \
        [(name, rule) for name in names for rule in ("decode-first", "prefill-first")]
    reference = workloads.quick_workload()
    for r in runs:
        if r["workload"].startswith(("reference", "Poisson")):
            assert (r["requests"], r["output_tokens"]) == (8, reference.output_tokens)
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0
        for key in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "itl_max", "step_p50"):
            assert r[key] > 0, key
        assert r["itl_p50"] <= r["itl_p99"] <= r["itl_max"] and r["ttft_p50"] <= r["ttft_p99"]
        assert r["itl_p99_vs_p50"] == pytest.approx(r["itl_p99"] / r["itl_p50"])
        assert r["itl_max_vs_p50"] == pytest.approx(r["itl_max"] / r["itl_p50"])
        assert set(r["steps"]) == {"decode", "mixed", "prefill"} and r["steps"]["prefill"] > 0
        assert r["mixed_graph_hit_rate"] is None and r["graph_hit_rate"] is None  # no graphs
        if r["rule"] == "prefill-first":
            assert r["steps"]["mixed"] == 0
        else:  # a decoding sequence gets a token every step
            assert r["gap_steps_max"] == 1
    for row, new, old in zip(ratios, runs[::2], runs[1::2]):
        assert row["tokens_per_s"] == pytest.approx(new["tokens_per_s"] / old["tokens_per_s"])
        assert row["itl_p99"] == pytest.approx(new["itl_p99"] / old["itl_p99"])
        assert row["met"] is None  # targets are judged on full GPU runs only
    assert ratios[0]["target"].startswith("ITL p99 <= 1.5x p50")


def test_decode_first_keeps_decoding_while_a_long_prompt_prefills(tmp_path):
    """A long prompt arrives while another request decodes: decode-first gives the decoding one a
    token every step (longest gap 1 step); prefill-first stops it for the prompt's prefill steps."""
    setup = harness.build_setup(bench.parse_args(["--quick", "--device", "cpu"]), str(tmp_path),
                                "qwen3-0.6b")
    short, long = [5] * 8, list(range(2, 202))  # the long one: two prefill steps of <= 128 tokens
    run = serving.ServingRun("a long prompt arrives", workloads.Workload([short, long], [200, 4]),
                             max_num_seqs=4, arrivals=[0.0, 0.02])  # 200 steps take longer
    with serving.serving_engine(setup, serving.QUICK) as llm:
        new, old = (serving.run_rule(llm, setup, run, rule) for rule in serving.RULES)
    assert (new.rule, old.rule) == ("decode-first", "prefill-first")
    assert new.output_tokens == old.output_tokens == 204
    assert new.gap_steps_max == 1 < old.gap_steps_max
    assert new.steps["mixed"] >= 200 // 32 and old.steps["mixed"] == 0 and old.steps["prefill"] >= 2


def test_quick_lora_section(tmp_path):
    """--lora on the CPU: the sweep's three columns (eager), no capture figures, and the end-to-end
    line, where the adapters change the greedy tokens and the LoRA engine without them does not."""
    out = tmp_path / "b.json"
    bench.main(["--quick", "--device", "cpu", "--lora", "2", "--lora-rank", "8", "--sweep-max-bs", "4",
                "--sweep-iters", "1", "--json", str(out)])
    shape = json.loads(out.read_text())["shapes"]["qwen3-0.6b"]
    assert set(shape) == {"lora"}
    section = shape["lora"]
    assert (section["adapters"], section["rank"], section["sweep"]["rank_bucket"]) == (2, 8, 8)
    rows = section["sweep"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2, 4]
    for r in rows:
        assert min(r["base_ms"], r["no_adapter_ms"], r["adapter_ms"]) > 0
        assert r["adapter_vs_base"] == pytest.approx(r["adapter_ms"] / r["base_ms"])
        assert r["no_adapter_vs_base"] == pytest.approx(r["no_adapter_ms"] / r["base_ms"])
    assert "skipped" in section["capture"]  # no CUDA graphs on the CPU
    e2e, work = section["e2e"], workloads.quick_workload()
    assert [r["engine"] for r in e2e["rows"]] == ["base engine", "LoRA engine, no adapters",
                                                  "LoRA engine, 2 adapters round-robin"]
    assert all(r["output_tokens"] == work.output_tokens and r["tokens_per_s"] > 0 for r in e2e["rows"])
    assert e2e["changed_by_adapters"] == work.num_seqs  # every sequence has an adapter, and it matters
    assert e2e["no_adapters_equal_base"] == work.num_seqs  # float32 on the CPU: the same tokens


# A stand-in for a peer engine: vLLM's offline API on nanograph (CPU), logging what it was given.
# As nanovllm, it returns dicts and takes token-id lists; as vllm, it takes {"prompt_token_ids": ids}
# and returns RequestOutput-like objects.
FAKE_PEER = """
import json, os
from types import SimpleNamespace

import nanograph
from nanograph import SamplingParams
from transformers import AutoConfig, AutoTokenizer

VLLM = __name__ == "vllm"
__version__ = "0.0-fake" if VLLM else None


def log(**entry):
    with open(os.environ["FAKE_PEER_LOG"], "a") as f:
        f.write(json.dumps(dict(entry, peer=__name__)) + "\\n")


class LLM:
    def __init__(self, model, **kwargs):
        tokenizer = AutoTokenizer.from_pretrained(model)  # as nano-vllm does, for EOS
        log(model=model, kwargs=kwargs, files=sorted(os.listdir(model)), vocab=len(tokenizer),
            eos=tokenizer.eos_token_id, dtype=str(AutoConfig.from_pretrained(model).dtype))
        self.llm = nanograph.LLM(model, device="cpu", **kwargs)

    def generate(self, prompts, params, use_tqdm=True):
        if VLLM:
            prompts = [p["prompt_token_ids"] for p in prompts]
        log(prompts=prompts, max_tokens=[p.max_tokens for p in params], temperature=[p.temperature for p in params],
            ignore_eos=[p.ignore_eos for p in params])
        outs = self.llm.generate(prompts, params, use_tqdm=use_tqdm)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=o["token_ids"])]) for o in outs] if VLLM else outs
"""


def test_peers_get_the_same_checkpoint_and_workload(tmp_path, monkeypatch):
    """--compare's peers, with fake nanovllm and vllm modules on --peer-path: the checkpoint is written
    once and loaded by both, each gets the warm-up and then the workload (same prompts, lengths,
    temperature, EOS ignored), and each prints a row that lands in the table with its ratio."""
    for module in ("nanovllm", "vllm"):
        (tmp_path / "peers" / module).mkdir(parents=True)
        (tmp_path / "peers" / module / "__init__.py").write_text(FAKE_PEER)
    log, out = tmp_path / "log.jsonl", tmp_path / "b.json"
    monkeypatch.setenv("FAKE_PEER_LOG", str(log))
    written, write = [], checkpoint.write_checkpoint
    monkeypatch.setattr(checkpoint, "write_checkpoint",
                        lambda setup: written.append(write(setup)) or written[-1])
    # the fakes run on the CPU
    on_cpu = [dataclasses.replace(p, cuda_only=False) for p in peers.PEERS]
    monkeypatch.setattr(peers, "PEERS", on_cpu)
    bench.main(["--quick", "--device", "cpu", "--compare", "--hf-seqs", "0", "--peer-path", str(tmp_path / "peers"),
                "--json", str(out)])

    assert len(written) == 1
    checkpoint_dir = written[0]
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    work = workloads.quick_workload()
    warm = workloads.warmup_workload(True, shapes.SHAPES["tiny"]["vocab_size"] - 1)
    for module in ("nanovllm", "vllm"):
        init, warmup, timed = [e for e in entries if e["peer"] == module]
        files = init.pop("files")
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
        assert init == {"peer": module, "model": checkpoint_dir, "vocab": 512, "eos": 1,
                        "dtype": "torch.float32",
                        "kwargs": {"dtype": "float32", "max_model_len": 256, "tensor_parallel_size": 1}}
        for call, w in ((warmup, warm), (timed, work)):
            assert call["prompts"] == w.prompts and call["max_tokens"] == w.max_tokens
            assert set(call["temperature"]) == {0.6} and set(call["ignore_eos"]) == {True}

    rows = json.loads(out.read_text())["shapes"]["qwen3-0.6b"]["compare"]["rows"]
    graphs, eager, hf, nano, vllm = rows
    assert hf["error"].startswith("skipped")
    assert (nano["engine"], vllm["engine"]) == ("nano-vllm", "vLLM 0.0-fake")
    for row in (nano, vllm):
        assert row["error"] is None and row["note"] == ""
        assert (row["num_seqs"], row["output_tokens"]) == (work.num_seqs, work.output_tokens)
        assert row["seconds"] > 0 and row["vs_nanograph"] == pytest.approx(row["tokens_per_s"] / graphs["tokens_per_s"])


def test_peers_that_cannot_run_are_skipped_rows(tmp_path):
    """Skipped rows with their reasons, and no ratio: a peer that does not import (its subprocess says
    so), and nano-vllm on a Llama shape or on the CPU (bench knows without starting one)."""
    args = bench.parse_args(["--quick", "--device", "cpu", "--peer-path", str(tmp_path)])
    qwen = harness.build_setup(args, str(tmp_path), "qwen3-0.6b")
    llama = harness.build_setup(args, str(tmp_path), "llama3.2-1b")
    missing = peers.run_peer(qwen, peers.Peer("missing", "no_such_peer_engine"), qwen.model_dir)
    assert missing.error == ("skipped: no_such_peer_engine does not import: ModuleNotFoundError: "
                             "No module named 'no_such_peer_engine'")
    nano = peers.PEERS[0]  # no subprocess for these two: nano-vllm runs Qwen3 only, on CUDA only
    llama_row = peers.run_peer(llama, nano, llama.model_dir)
    assert llama_row.error == "skipped: implements qwen3 only, not llama"
    cpu = peers.run_peer(qwen, nano, qwen.model_dir)
    assert cpu.error == "skipped: runs on CUDA only"
    graphs = RunResult("graphs", 8, 10, 1.0)
    assert compare.same_set_ratios([graphs, missing, cpu]) == [1.0, None, None]


def test_a_repeated_workload_reports_each_figures_median():
    """median_run: each latency figure is the middle run's, figure by figure (not one run's row),
    a figure a path lacks stays None, and the counts stay."""
    def run(seconds, ttft, itl_p99, step):
        return serving.ServingResult("w", "decode-first", 512, 8, 100, seconds, ttft, 2 * ttft,
                                     0.001, itl_p99, 3 * itl_p99, 4, step, {}, None, None)
    runs = [run(2.0, 0.009, 0.0015, None), run(1.0, 0.007, 0.0030, None),
            run(3.0, 0.008, 0.0010, None)]
    median = serving_http.median_run(runs)
    assert (median.seconds, median.ttft_p50, median.ttft_p99) == (2.0, 0.008, 0.016)
    assert (median.itl_p99, median.itl_max) == (0.0015, pytest.approx(0.0045))
    assert median.step_p50 is None and (median.requests, median.output_tokens) == (8, 100)
    assert median.tokens_per_s == 50.0
