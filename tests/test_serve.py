"""The OpenAI-compatible server (nanograph/serve/): a real server on 127.0.0.1, started here as a
subprocess on the tiny text_model checkpoint (a real BPE tokenizer and a chat template), driven by
the official `openai` client and plain HTTP (httpx). Its answers are checked against offline
LLM.generate / LLM.chat on the same weights and knobs: greedy, and sampling with a seed (its own
noise stream, so the batch it lands in does not matter).
"""
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from nanograph import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KNOBS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
MODEL = "tiny"  # --served-model-name
GREEDY = dict(temperature=0.0)
SEEDED = dict(temperature=0.9, top_p=0.9, seed=7)


def as_flags(knobs: dict) -> list[str]:
    return [arg for name, value in knobs.items()
            for arg in (f"--{name.replace('_', '-')}", str(value))]


def server_env() -> dict:
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


# `python -m nanograph.serve`, with the LLM's build held back half a second: the server is seen
# "starting" (/health's 503) before it is ready
SLOW_BUILD = """
import sys, time
import nanograph.serve.engine_thread as engine_thread
from nanograph.serve.cli import main

build = engine_thread.LLM


def slow_build(*args, **kwargs):
    time.sleep(0.5)
    return build(*args, **kwargs)


engine_thread.LLM = slow_build
main(sys.argv[1:])
"""


class Server:
    """`python -m nanograph.serve MODEL --port P FLAGS...` in a subprocess (or `start` instead
    of `-m nanograph.serve`); its log in a file."""

    def __init__(self, model: str, flags: list[str], log_path,
                 start: tuple[str, str] = ("-m", "nanograph.serve")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, *start, model, "--port", str(self.port), *flags]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(command, env=server_env(), stdout=log,
                                         stderr=subprocess.STDOUT)
        self.health = []  # the /health statuses seen while starting, without repeats

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                status = httpx.get(self.url + "/health", timeout=5).status_code
            except httpx.TransportError:  # the port is not open yet
                status = None
            if status is not None and self.health[-1:] != [status]:
                self.health.append(status)
            if status == 200:
                return
            time.sleep(0.02)
        raise AssertionError(f"the server did not become ready:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """The /metrics samples by name, with their labels but the served model's name."""
        text = httpx.get(self.url + "/metrics").text
        samples = [line.rsplit(" ", 1) for line in text.splitlines()
                   if line and not line.startswith("#")]
        model_label = f'model_name="{MODEL}"'
        assert all(model_label in name for name, _ in samples if "{" in name)
        return {re.sub(r"\{,?\}", "", re.sub(f",?{model_label}", "", name).replace("{,", "{")):
                float(value) for name, value in samples}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def lora(adapters):
    return adapters("qwen3")["qv8"]  # for tiny_model("qwen3"): the same weights as text_model's


@pytest.fixture(scope="module")
def server(text_model, lora, tmp_path_factory):
    flags = as_flags(KNOBS) + ["--served-model-name", MODEL, "--max-request-body-bytes", "2000000",
                               "--enable-lora", "--lora-modules", f"qv8={lora.path}"]
    server = Server(text_model("qwen3"), flags, tmp_path_factory.mktemp("serve") / "log",
                    start=("-c", SLOW_BUILD))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def offline(text_model):
    return LLM(text_model("qwen3"), **KNOBS, enable_lora=True)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def generate(llm: LLM, prompt, lora=None, **params) -> dict:
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False, lora_request=lora)[0]


def chat(llm: LLM, messages: list[dict], **params) -> dict:
    return llm.chat(messages, SamplingParams(**params), use_tqdm=False)[0]


# ---- readiness, models, metrics ----------------------------------------------------------------
def test_health_is_503_until_the_engine_is_built_then_200(server):
    assert server.health == [503, 200]
    body = httpx.get(server.url + "/health")
    assert body.status_code == 200


def test_models_lists_the_model_and_its_lora_modules(client):
    assert [model.id for model in client.models.list().data] == [MODEL, "qv8"]
    assert client.models.retrieve("qv8").id == "qv8"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_health_and_http_errors_have_json_bodies(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    for response, status in ((httpx.get(server.url + "/v1/nothing"), 404),
                             (httpx.get(server.url + "/v1/completions"), 405)):
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_metrics_has_vllms_names_and_the_graphs(server, client):
    prompt = "the quick brown fox jumps over the lazy dog. " * 2  # two KV blocks and more
    for _ in range(2):  # the second finds the first's blocks in the prefix cache
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
    names = server.metrics()
    assert names["nanograph:prefix_cache_hit_tokens"] >= 16  # (llm.stats(), read when idle)
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                      "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prompt_tokens", "request_generation_tokens"):
        assert f"nanograph:{histogram}_count" in names
    for counter in ("prompt_tokens_total", "generation_tokens_total",
                    'request_success_total{finished_reason="length"}'):
        assert names[f"nanograph:{counter}"] > 0
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                  "num_kvcache_blocks", "overlap_discarded_tokens"):  # (the last two: stats())
        assert f"nanograph:{gauge}" in names
    assert names["nanograph:num_kvcache_blocks"] == 64
    assert names["nanograph:num_preemptions_total"] == 0
    assert names["nanograph:time_to_first_token_seconds_count"] >= 1
    assert names["nanograph:request_queue_time_seconds_count"] >= 2
    # each request's prompt and generated tokens: 3 each, in the buckets from 4 up
    counts = names["nanograph:request_generation_tokens_count"]
    assert names['nanograph:request_generation_tokens_bucket{le="2.0"}'] < counts
    assert names['nanograph:request_generation_tokens_bucket{le="4.0"}'] == counts


# ---- answers equal the offline engine's ----------------------------------------------------------
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_completions_match_offline_generate(client, offline, sampling):
    prompt = "the quick brown fox"
    want = generate(offline, prompt, max_tokens=12, **sampling)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **sampling)
    assert whole.choices[0].text == want["text"]
    assert whole.choices[0].finish_reason == want["finish_reason"]
    assert whole.usage.completion_tokens == len(want["token_ids"])
    assert whole.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True,
                                            **sampling))
    assert "".join(chunk.choices[0].text for chunk in chunks) == want["text"]
    assert chunks[-1].choices[0].finish_reason == want["finish_reason"]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_chat_matches_offline_chat(client, offline, sampling):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    want = chat(offline, messages, max_tokens=10, **sampling)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                           **sampling)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want["text"]
    assert whole.usage.completion_tokens == len(want["token_ids"])
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                            stream=True, stream_options={"include_usage": True},
                                            **sampling)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want["token_ids"])


def test_token_id_prompts_and_vllms_extra_fields(client, offline):
    prompt = [5, 17, 42, 99, 150]
    extra = dict(top_k=5, min_tokens=6, ignore_eos=True, stop_token_ids=[7],
                 skip_special_tokens=False)
    want = generate(offline, prompt, max_tokens=8, seed=3, **extra)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, seed=3,
                                    extra_body=extra)
    assert got.choices[0].text == want["text"]


def test_model_naming_a_lora_module_selects_the_adapter(client, offline, lora):
    want = generate(offline, "hello world", lora, max_tokens=8, **GREEDY)
    base = generate(offline, "hello world", max_tokens=8, **GREEDY)
    assert want["token_ids"] != base["token_ids"]  # the adapter matters
    got = client.completions.create(model="qv8", prompt="hello world", max_tokens=8, **GREEDY)
    assert got.choices[0].text == want["text"]


def test_eight_concurrent_clients_get_what_each_gets_alone(server, client, offline):
    cases = []  # (chat?, prompt, max_tokens, sampling, stream?)
    for i in range(8):
        prompt = ["def parse(line):", "héllo wörld", "the lazy dog", "日本語"][i % 4]
        sampling = dict(temperature=0.8, seed=100 + i) if i % 2 else GREEDY
        cases.append((i % 3 == 0, prompt, 10 + i, sampling, i % 4 < 2))

    def alone(case) -> str:  # offline, one request at a time
        is_chat, prompt, max_tokens, sampling, _ = case
        if is_chat:
            return chat(offline, [{"role": "user", "content": prompt}], max_tokens=max_tokens,
                        **sampling)["text"]
        return generate(offline, prompt, max_tokens=max_tokens, **sampling)["text"]

    def ask(case) -> str:
        is_chat, prompt, max_tokens, sampling, stream = case
        if is_chat:
            got = client.chat.completions.create(model=MODEL, max_tokens=max_tokens, stream=stream,
                                                 messages=[{"role": "user", "content": prompt}],
                                                 **sampling)
            if not stream:
                return got.choices[0].message.content
            return "".join(c.choices[0].delta.content or "" for c in got)
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                        stream=stream, **sampling)
        return "".join(c.choices[0].text for c in got) if stream else got.choices[0].text

    wants = [alone(case) for case in cases]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, cases)) == wants
    assert server.metrics()["nanograph:num_requests_running"] == 0


# ---- n, logprobs, stop in OpenAI's formats -------------------------------------------------------
def test_n_and_logprobs_in_completions_format(client, offline):
    want = generate(offline, "hello", n=2, seed=5, max_tokens=6, logprobs=2)
    got = client.completions.create(model=MODEL, prompt="hello", n=2, seed=5, max_tokens=6,
                                    logprobs=2)
    assert [c.index for c in got.choices] == [0, 1]
    for choice, completion in zip(got.choices, want["outputs"]):
        assert choice.text == completion["text"]
        ids, logprobs = completion["token_ids"], completion["logprobs"]
        assert len(choice.logprobs.tokens) == len(ids)
        sampled = [lp[t] for t, lp in zip(ids, logprobs)]
        assert choice.logprobs.token_logprobs == pytest.approx(sampled)
        # the top 2 and the sampled token, none lost (ids of the same text are told apart)
        for top, entry in zip(choice.logprobs.top_logprobs, logprobs):
            assert sorted(top.values()) == pytest.approx(sorted(entry.values()))
    assert got.usage.completion_tokens == sum(len(c["token_ids"]) for c in want["outputs"])
    texts = ["", ""]
    for chunk in client.completions.create(model=MODEL, prompt="hello", n=2, seed=5, max_tokens=6,
                                           stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c["text"] for c in want["outputs"]]


def test_logprobs_in_chat_format(client, offline):
    messages = [{"role": "user", "content": "hi"}]
    want = chat(offline, messages, max_tokens=5, logprobs=3, **GREEDY)
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                         logprobs=True, top_logprobs=3, **GREEDY)
    entries = got.choices[0].logprobs.content
    assert [e.logprob for e in entries] == pytest.approx(
        [lp[t] for t, lp in zip(want["token_ids"], want["logprobs"])])
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        if entry.token.startswith("bytes:"):  # a piece of a character: its bytes, named
            assert entry.token == "bytes:" + "".join(f"\\x{b:02x}" for b in entry.bytes)
        else:
            assert entry.bytes == list(entry.token.encode())


def test_stop_strings(client, offline):
    free = generate(offline, "the lazy dog", max_tokens=16, **GREEDY)["text"]
    stop = free[4:6]  # somewhere in the middle of the greedy answer
    want = generate(offline, "the lazy dog", max_tokens=16, stop=[stop], **GREEDY)
    assert want["finish_reason"] == "stop"
    for stream in (False, True):
        got = client.completions.create(model=MODEL, prompt="the lazy dog", max_tokens=16,
                                        stop=[stop], stream=stream, **GREEDY)
        chunks = list(got) if stream else [got]
        assert "".join(c.choices[0].text for c in chunks) == want["text"]
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert chunks[-1].choices[0].model_extra["stop_reason"] == stop


# ---- request shapes real tools send ------------------------------------------------------------
def completion_texts(response) -> list[str]:
    return [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]


def test_list_prompts_equal_the_single_prompts(client, offline):
    """OpenAI's prompt lists (langchain, lm-eval): a choice per prompt and completion, in order."""
    texts, ids = ["the lazy dog", "hello world"], [[5, 17, 42], [99, 150]]
    for prompts in (texts, ids):
        want = [c["text"] for prompt in prompts
                for c in generate(offline, prompt, n=2, max_tokens=6, **SEEDED)["outputs"]]
        got = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, **SEEDED)
        assert [c.index for c in got.choices] == [0, 1, 2, 3]
        assert completion_texts(got) == want
        streamed = ["", "", "", ""]
        for chunk in client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6,
                                               stream=True, **SEEDED):
            streamed[chunk.choices[0].index] += chunk.choices[0].text
        assert streamed == want
    assert got.usage.prompt_tokens == 3 + 2


def test_echo_puts_the_prompt_first(client, offline):
    want = generate(offline, "the lazy dog", max_tokens=4, **GREEDY)
    got = client.completions.create(model=MODEL, prompt="the lazy dog", max_tokens=4, echo=True,
                                    **GREEDY)
    assert got.choices[0].text == "the lazy dog" + want["text"]


def test_echo_logprobs_equal_hf_log_softmax(client, text_model):
    """lm-eval's loglikelihood request: each prompt token's logprob (the first None) and the top
    1, from the prompt's own logits, as HF computes them."""
    from transformers import AutoModelForCausalLM
    prompt = [5, 17, 42, 99, 150, 7, 230]
    got = client.completions.create(model=MODEL, prompt=[prompt], max_tokens=1, echo=True,
                                    logprobs=1, temperature=0)
    model = AutoModelForCausalLM.from_pretrained(text_model("qwen3"), dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    want = [logprobs[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    logprobs_got = got.choices[0].logprobs
    assert logprobs_got.token_logprobs[0] is None and logprobs_got.top_logprobs[0] is None
    assert logprobs_got.token_logprobs[1:len(prompt)] == pytest.approx(want, abs=1e-4)
    for i in range(1, len(prompt)):  # the prompt's token and the best one
        top = logprobs_got.top_logprobs[i]
        assert max(top.values()) == pytest.approx(logprobs[i - 1].max().item(), abs=1e-4)
        assert logprobs_got.token_logprobs[i] in top.values()
    assert len(logprobs_got.tokens) == len(prompt) + 1  # and the one generated


def test_continuous_usage_stats_puts_usage_on_every_chunk(client, offline):
    want = generate(offline, "hello", max_tokens=6, ignore_eos=True, **GREEDY)
    chunks = list(client.completions.create(
        model=MODEL, prompt="hello", max_tokens=6, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    assert all(chunk.usage is not None for chunk in chunks)
    completion_tokens = [chunk.usage.completion_tokens for chunk in chunks]
    assert completion_tokens == sorted(completion_tokens)
    assert completion_tokens[-1] == len(want["token_ids"]) == 6


def test_chat_content_parts_and_fields_that_change_nothing(client, offline):
    """guidellm's content parts; fields OpenAI accepts that change nothing here."""
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""},
                {"role": "user", "content": "again"}]
    want = chat(offline, messages, max_tokens=6, **GREEDY)["text"]
    parts = [messages[0] | {"content": [{"type": "text", "text": "hello"}]},
             messages[1] | {"content": None}, messages[2]]
    got = client.chat.completions.create(
        model=MODEL, messages=parts, max_tokens=6, store=False, metadata={"run": "1"},
        parallel_tool_calls=True, user="me", stream_options=None, **GREEDY)
    assert got.choices[0].message.content == want
    assert got.id.startswith("chatcmpl-")


def test_chat_without_a_template_points_to_completions(text_model):
    from transformers import AutoTokenizer
    from nanograph.serve.protocol import ChatRequest
    tokenizer = AutoTokenizer.from_pretrained(text_model("qwen3"))
    tokenizer.chat_template = None
    request = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(ValueError, match="no chat template: use /v1/completions"):
        request.prepare(tokenizer, max_model_len=256)


def test_max_tokens_past_the_context_is_refused_like_openai(server):
    response = httpx.post(server.url + "/v1/completions",
                          json={"prompt": [5] * 250, "max_tokens": 7})  # max_model_len=256
    assert response.status_code == 400
    assert "maximum context length is 256 tokens" in response.json()["error"]["message"]
    fits = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * 250, "max_tokens": 6})
    assert fits.status_code == 200


def test_logprobs_of_byte_level_tokens_are_their_bytes(client, offline):
    """Sampled freely, the tiny model's tokens are mostly single bytes of the byte-level
    vocabulary, many of them pieces of a character: each entry has its token's own bytes
    (joined, they decode as HF decodes the ids), and a piece's text names its bytes."""
    messages, params = [{"role": "user", "content": "hi"}], dict(max_tokens=24, temperature=1.0,
                                                                  seed=1)
    want = chat(offline, messages, ignore_eos=True, **params)["token_ids"]
    got = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True,
                                         extra_body={"ignore_eos": True}, **params)
    entries = got.choices[0].logprobs.content
    assert len(entries) == len(want)
    assert any(entry.token.startswith("bytes:") for entry in entries)
    assert "\ufffd" not in "".join(entry.token for entry in entries)
    joined = b"".join(bytes(entry.bytes) for entry in entries)
    assert joined.decode(errors="replace") == offline.tokenizer.decode(want)


# ---- bad requests ------------------------------------------------------------------------------
LONG = "the quick brown fox " * 100  # far over max_model_len=256 tokens
BAD = {  # name: (endpoint, body, status, param)
    "malformed json": ("completions", b'{"prompt": "x",', 400, None),
    "not an object": ("completions", [1, 2], 400, None),
    "missing prompt": ("completions", {"model": MODEL}, 400, "prompt"),
    "missing messages": ("chat/completions", {"model": MODEL}, 400, "messages"),
    "wrong type": ("completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    "bad temperature": ("completions", {"prompt": "x", "temperature": -1}, 400, None),
    "bad top_p": ("chat/completions", {"messages": [], "top_p": 0}, 400, None),
    "zero max_tokens": ("completions", {"prompt": "x", "max_tokens": 0}, 400, None),
    "min over max": ("completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, None),
    "unknown field": ("completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    "presence_penalty": ("completions", {"prompt": "x", "presence_penalty": 0.5}, 400,
                         "presence_penalty"),
    "logit_bias": ("chat/completions", {"messages": [], "logit_bias": {"5": 10}}, 400,
                   "logit_bias"),
    "tools": ("chat/completions", {"messages": [], "tools": []}, 400, "tools"),
    "response_format": ("chat/completions", {"messages": [], "response_format": {}}, 400,
                        "response_format"),
    "suffix": ("completions", {"prompt": "x", "suffix": "end"}, 400, "suffix"),
    "best_of > n": ("completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    "prompt of floats": ("completions", {"prompt": [1.0, 2.0]}, 400, "prompt"),
    "empty prompt in a list": ("completions", {"prompt": [[5], []]}, 400, None),
    "max_tokens as a string": ("completions", {"prompt": "x", "max_tokens": "5"}, 400,
                               "max_tokens"),
    "stream as a string": ("chat/completions", {"messages": [], "stream": "yes"}, 400, "stream"),
    "max_tokens past the context": ("completions", {"prompt": "x", "max_tokens": 10**6}, 400,
                                    None),
    "chat_template_kwargs tokenize": ("chat/completions",
                                      {"messages": [{"role": "user", "content": "hi"}],
                                       "chat_template_kwargs": {"tokenize": True}}, 400, None),
    "image part": ("chat/completions",
                   {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
                   "messages"),
    "top_logprobs alone": ("chat/completions", {"messages": [], "top_logprobs": 2}, 400, None),
    "stream_options alone": ("completions", {"prompt": "x", "stream_options": {}}, 400, None),
    "too-long prompt": ("completions", {"prompt": LONG, "stream": True}, 400, None),
    "id outside vocab": ("completions", {"prompt": [3, 100000]}, 400, None),
    "stop id outside vocab": ("completions", {"prompt": "x", "stop_token_ids": [10**5]}, 400, None),
    "n above 128 (OpenAI's limit)": ("completions", {"prompt": "x", "n": 100000}, 400, "n"),
    "unknown model": ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_requests_are_400s_with_openais_error_body(server, name):
    endpoint, body, status, param = BAD[name]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}/v1/{endpoint}", content=content,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_bad_requests_never_reach_the_engine(server):
    before = server.metrics()["nanograph:e2e_request_latency_seconds_count"]
    for name in ("zero max_tokens", "unknown field", "presence_penalty", "too-long prompt"):
        endpoint, body, _, _ = BAD[name]
        assert httpx.post(f"{server.url}/v1/{endpoint}", json=body).status_code == 400
    assert server.metrics()["nanograph:e2e_request_latency_seconds_count"] == before


# ---- faults: a request never kills the server ----------------------------------------------------
RAISES_ON_UNKNOWN_ROLES = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                           "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                           "{{ m['content'] }}{% endfor %}")
FAULTS = {  # name: (chat body, what the 400 says)
    "template raises": ({"messages": [{"role": "narrator", "content": "hi"}],
                         "chat_template_kwargs": {"chat_template": RAISES_ON_UNKNOWN_ROLES}},
                        "unknown role narrator"),
    "tokenize kwarg": ({"messages": [{"role": "user", "content": "hi"}],
                        "chat_template_kwargs": {"tokenize": True}}, "tokenize"),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_a_fault_in_a_request_is_its_400_and_the_server_goes_on(server, client, name):
    body, why = FAULTS[name]
    response = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 3})
    assert response.status_code == 400 and why in response.json()["error"]["message"]
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3)
    assert again.choices[0].finish_reason == "length"


def test_a_huge_body_is_a_413_at_once_and_a_long_prompt_freezes_no_stream(server):
    """The server's limit is 2 MB here; a prompt of 1.3 MB takes the tokenizer seconds, in a
    worker thread: the stream beside it goes on."""
    arrivals = []

    def stream():
        body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
            arrivals.extend(time.monotonic() for line in r.iter_lines() if line)

    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream)
        assert wait_until(lambda: len(arrivals) > 3)
        start = time.monotonic()
        huge = httpx.post(server.url + "/v1/completions", content=b" " * 3_000_000,
                          headers={"content-type": "application/json"})
        assert huge.status_code == 413 and time.monotonic() - start < 1
        start = time.monotonic()
        long = httpx.post(server.url + "/v1/completions",
                          json={"prompt": "the quick brown fox jumps over the lazy dog. " * 30000},
                          timeout=60)
        tokenized = time.monotonic() - start
        assert long.status_code == 400 and "maximum context length" in long.text
        streaming.result()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(arrivals) > 50 and tokenized > 1 and max(gaps) < tokenized / 3, (tokenized, gaps)


# ---- disconnects, failures, shutdown -------------------------------------------------------------
def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_a_client_that_disconnects_has_its_request_aborted(server):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 240, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
        data = (line for line in r.iter_lines() if line)
        assert all(next(data).startswith("data: ") for _ in range(3))
        metrics = server.metrics()
        assert metrics["nanograph:num_requests_running"] == 1
        assert metrics["nanograph:kv_cache_usage_perc"] > 0
        # the same under vLLM's names, which routers read
        assert metrics["vllm:num_requests_running"] == 1
        for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            assert metrics[name] == metrics["nanograph:kv_cache_usage_perc"]
    # the stream is closed: the request is aborted, its blocks free at once
    idle = {"nanograph:num_requests_running": 0, "nanograph:kv_cache_usage_perc": 0}
    assert wait_until(lambda: idle.items() <= server.metrics().items())
    generated = server.metrics()["nanograph:generation_tokens_total"]
    time.sleep(0.2)
    assert server.metrics()["nanograph:generation_tokens_total"] == generated
    # not streamed: the client gives up waiting, long before the 240 tokens are done
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.05)
    assert wait_until(lambda: idle.items() <= server.metrics().items())
    assert server.metrics()["nanograph:generation_tokens_total"] - generated < 240


def test_a_fault_at_intake_or_in_a_step_is_a_500_and_the_server_goes_on(text_model, caplog):
    """In-process: the engine thread and the app, with add_request (as a corrupt adapter's
    SafetensorError would) and then launches made to fail."""
    from safetensors import SafetensorError
    from nanograph.serve.api import create_app
    from nanograph.serve.engine_thread import EngineThread
    engine = EngineThread(text_model("qwen3"), KNOBS, MODEL)
    engine.thread.start()
    assert wait_until(engine.ready.is_set, timeout=120)
    launch, failures = engine.llm.runner.launch, [RuntimeError("device on fire")] * 2
    add_request = engine.llm.add_request
    intake = [SafetensorError("header too large"), None, SafetensorError("header too large")]

    def flaky_launch(batch):
        if failures:
            raise failures.pop()
        return launch(batch)

    def flaky_add(*args):
        if intake and intake.pop(0) is not None:
            raise SafetensorError("header too large")
        return add_request(*args)

    engine.llm.add_request = flaky_add
    body = {"prompt": "hello", "max_tokens": 5}

    async def requests():
        transport = httpx.ASGITransport(app=create_app(engine, MODEL, {}))
        async with httpx.AsyncClient(transport=transport, base_url="http://serve") as http:
            for prompt in ("hello", ["hello", "again"]):  # two prompts: the second fails
                failed = await http.post("/v1/completions", json={**body, "prompt": prompt})
                assert failed.status_code == 500
                assert "header too large" in failed.json()["error"]["message"]
            engine.llm.runner.launch = flaky_launch
            failed = await http.post("/v1/completions", json=body)
            assert failed.status_code == 500
            assert "device on fire" in failed.json()["error"]["message"]
            streamed = await http.post("/v1/completions", json={**body, "stream": True})
            events = [line for line in streamed.text.split("\n\n") if line]
            assert "device on fire" in events[0] and events[-1] == "data: [DONE]"
            assert (await http.post("/v1/completions", json=body)).status_code == 200

    try:
        asyncio.run(requests())
        # the first prompt of the refused pair was taken back; each fault logged with its trace
        assert not engine.llm.has_unfinished_requests()
        logged = [r for r in caplog.records if r.name == "nanograph.serve" and r.exc_info]
        assert len(logged) == 4 and "SafetensorError" in caplog.text
    finally:
        engine.stop()
        engine.thread.join(timeout=30)
    assert not engine.thread.is_alive() and engine.error is None


# `python -m nanograph.serve`, with an LLM whose steps fail and close it (as a tensor-parallel
# worker's death does): the engine cannot go on
BROKEN_ENGINE = """
import sys
import nanograph.serve.engine_thread as engine_thread
from nanograph.serve.cli import main


class BrokenLLM(engine_thread.LLM):
    def step(self):
        self.close()
        raise RuntimeError("the worker died")


engine_thread.LLM = BrokenLLM
main(sys.argv[1:])
"""


def test_an_engine_that_cannot_go_on_ends_the_process_non_zero(text_model, tmp_path):
    server = Server(text_model("qwen3"), as_flags(KNOBS), tmp_path / "log",
                    start=("-c", BROKEN_ENGINE))
    try:
        server.wait_ready()
        failed = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
        assert failed.status_code == 500 and "the worker died" in failed.text
        assert server.proc.wait(timeout=15) == 1
        assert "nanograph-serve: the engine failed" in server.log()
    finally:
        server.stop()


def test_start_up_errors_exit_at_once_before_the_engine_starts(text_model, lora, tmp_path):
    """A port in use, a missing or damaged LoRA module: a clear message, a failed exit at once,
    before the engine starts."""
    damaged = tmp_path / "damaged"
    shutil.copytree(lora.path, damaged)
    (damaged / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for flags, why in ((["--port", port], "address already in use"),
                           (["--lora-modules", f"gone={tmp_path / 'gone'}"], "not found"),
                           (["--lora-modules", f"bad={damaged}"], "damaged")):
            command = [sys.executable, "-m", "nanograph.serve", text_model("qwen3"),
                       *as_flags(KNOBS), *flags]
            done = subprocess.run(command, env=server_env(), capture_output=True, text=True,
                                  timeout=120)
            # (3: uvicorn's exit status for a start-up failure; not 134, an abort)
            assert done.returncode in (1, 3) and why in done.stderr.lower(), done.stderr
            assert "engine ready" not in done.stderr


def test_shell_refuses_a_model_without_a_chat_template(text_model, tmp_path):
    shutil.copytree(text_model("qwen3"), tmp_path / "plain")
    (tmp_path / "plain" / "chat_template.jinja").unlink()
    command = [sys.executable, "-m", "nanograph.serve", str(tmp_path / "plain"), "--shell",
               *as_flags(KNOBS)]
    done = subprocess.run(command, input="hello\n", env=server_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "--shell needs a chat template" in done.stderr
    assert "> " not in done.stdout


def test_shell_chats_in_the_terminal(text_model, tmp_path):
    knobs = {**KNOBS, "max_model_len": 64}
    command = [sys.executable, "-m", "nanograph.serve", text_model("qwen3"), "--shell",
               *as_flags(knobs)]
    done = subprocess.run(command, input="hello\n/reset\nhi again\n/exit\n", env=server_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "/reset forgets" in done.stdout and "(conversation reset)" in done.stdout
    assert done.stdout.count("> ") >= 4  # four prompts: two turns, /reset, /exit


def test_sigterm_stops_the_server_within_seconds(server):
    """Last: it stops the module's server. An open stream ends with an error event, a request
    waiting for its whole answer gets a 503."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 240, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=30)
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            assert wait_until(lambda: server.metrics()["nanograph:num_requests_running"] == 2)
            start = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert whole.result().status_code == 503
    assert "shutting down" in rest[-2] and rest[-1] == "data: [DONE]"
    server.proc.wait(timeout=10)
    assert time.monotonic() - start < 5
    assert "Finished server process" in server.log()


# ---- GPU: the server with CUDA graphs ----------------------------------------------------------
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  tie_word_embeddings=True, rope_theta=1_000_000.0, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, eos_token_id=151645, bos_token_id=151643)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_server_replays_graphs_under_concurrent_requests_gpu(tmp_path):
    from transformers import AutoConfig
    AutoConfig.for_model("qwen3", **QWEN3_0_6B).save_pretrained(tmp_path / "qwen3-0.6b")
    flags = ["--load-format", "dummy", "--max-model-len", "1024", "--cuda-graph-max-bs", "16",
             "--gpu-memory-utilization", "0.5", "--served-model-name", MODEL]
    server = Server(str(tmp_path / "qwen3-0.6b"), flags, tmp_path / "log")
    try:
        server.wait_ready(timeout=300)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

        def one(i: int):
            prompt = [(7 * i + j) % 150000 for j in range(20 + 10 * i)]
            got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=64,
                                            stream=i % 2 == 0, extra_body={"ignore_eos": True})
            chunks = list(got) if i % 2 == 0 else [got]
            return chunks[-1].choices[0].finish_reason

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(8))) == ["length"] * 8
        metrics = server.metrics()
        assert metrics["nanograph:num_graphs"] > 0
        assert metrics["nanograph:graph_hit_rate"] > 0
        assert metrics["nanograph:generation_tokens_total"] == 8 * 64
        assert metrics["nanograph:num_requests_running"] == 0
        print({k: v for k, v in metrics.items() if "graph" in k})
    finally:
        server.stop()
