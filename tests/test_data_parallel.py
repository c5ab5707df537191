"""--data-parallel-size: two replicas of the server behind SGLang's router (smg), on the CPU, with
the bundled demo model: `python -m nanograph.serve DEMO --data-parallel-size 2` started here on
127.0.0.1, driven through its front port with the official `openai` client, each replica read
through its own /metrics (their URLs and process ids are in the launcher's log).
"""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from nanograph import LLM, SamplingParams

pytest.importorskip("smg")

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "nanograph" / "pretrained" / "pycoder")
KNOBS = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=128,
             max_model_len=512)
MODEL = "pycoder"  # --served-model-name
PROMPTS = ["def read_config(path):\n", "class Stack:\n    def __init__(self):\n", "import re\n",
           "def fibonacci(n):\n", "for line in open(path):\n", "def main():\n    args = "]
SYSTEM = ("# You are a careful Python programmer. Write short functions with docstrings,\n"
          "# type hints and no global state. Prefer the standard library; never print.\n"
          "# Every function below parses one line of a configuration file and returns\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Front:
    """The launcher: `python -m nanograph.serve DEMO --data-parallel-size 2 ...`, its log in a
    file. `health` notes, at the first 200 of the front port's /health, each replica's."""

    def __init__(self, log_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        flags = [arg for name, value in KNOBS.items()
                 for arg in (f"--{name.replace('_', '-')}", str(value))]
        command = [sys.executable, "-m", "nanograph.serve", DEMO, "--data-parallel-size", "2",
                   "--port", str(self.port), "--served-model-name", MODEL, *flags]
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        with open(log_path, "w") as log:
            # (one thread each: the replicas share the machine's few cores)
            env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
            self.proc = subprocess.Popen(command, env=env,
                                         stdout=log, stderr=subprocess.STDOUT)
        self.replica_health_at_open = None

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def replicas(self) -> dict[str, list[int]]:
        """Each replica's URL -> the process ids it has had, oldest first."""
        pids = {}
        for url, pid in re.findall(r"replica (\S+): pid (\d+)", self.log()):
            pids.setdefault(url, []).append(int(pid))
        return pids

    def children(self) -> list[int]:
        router = [int(pid) for pid in re.findall(r"smg \(pid (\d+)\)", self.log())]
        return router + [pid for pids in self.replicas().values() for pid in pids]

    def wait_ready(self, timeout: float = 240):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if status(self.url) == 200:
                self.replica_health_at_open = [status(url) for url in self.replicas()]
                # smg registers its workers a moment after its port opens (docs/serving.md)
                assert wait_until(lambda: len(httpx.get(self.url + "/workers").json()["workers"])
                                  == 2, timeout=60)
                return
            time.sleep(0.05)
        raise AssertionError(f"the front port did not become ready:\n{self.log()[-5000:]}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.children():  # (after a failed test: nothing left behind)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def status(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def metrics(url: str) -> dict[str, float]:
    """A replica's /metrics samples labelled by the model's name alone (or by nothing), by name."""
    text = httpx.get(url + "/metrics").text
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    only_model = f'{{model_name="{MODEL}"}}'
    return {name.replace(only_model, ""): float(value) for name, value in samples
            if "{" not in name.replace(only_model, "")}


def served(front: Front) -> dict[str, float]:
    """Requests each replica has finished, by URL."""
    return {url: metrics(url)["nanograph:e2e_request_latency_seconds_count"]
            for url in front.replicas()}


def wait_until(condition, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    front = Front(tmp_path_factory.mktemp("data_parallel") / "log")
    try:
        front.wait_ready()
        yield front
    finally:
        front.stop()


@pytest.fixture(scope="module")
def client(front):
    return openai.OpenAI(base_url=front.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    return LLM(DEMO, **KNOBS)


def greedy(llm: LLM, prompts: list[str], max_tokens: int = 12) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [out["text"] for out in llm.generate(prompts, params, use_tqdm=False)]


def complete_all(client, prompts: list[str], max_tokens: int = 12) -> list[str]:
    """The prompts sent at once, each on its own connection; their texts, in order."""
    def one(prompt):
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                           temperature=0)
        return answer.choices[0].text
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_the_front_port_opens_when_every_replica_is_ready(front, client):
    assert front.replica_health_at_open == [200, 200]
    assert [model.id for model in client.models.list()] == [MODEL]
    for url in front.replicas():  # every replica: vLLM's gauge names, for routers
        names = metrics(url)
        for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
            assert names[f"vllm:{name}"] == names[f"nanograph:{name}"] == 0


def test_concurrent_requests_get_offline_greedy_text_from_both_replicas(front, client, offline):
    before = served(front)
    assert complete_all(client, PROMPTS) == greedy(offline, PROMPTS)
    after = served(front)
    assert sum(after.values()) - sum(before.values()) == len(PROMPTS)  # each served once
    assert all(after[url] > before[url] for url in after)


def test_a_shared_prefix_lands_on_one_replica(front, client, offline):
    users = [SYSTEM + f"def parse_{name}(line: str) -> " for name in ("port", "host", "path")]
    before = {url: metrics(url) for url in front.replicas()}
    for prompt in users:  # one after another: each finds the ones before in the router's tree
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        assert answer.choices[0].text == greedy(offline, [prompt], 4)[0]
    hits = {}
    for url, then in before.items():
        now = metrics(url)
        count = "nanograph:e2e_request_latency_seconds_count"
        hits[now[count] - then[count]] = (now["nanograph:prefix_cache_hit_tokens"]
                                          - then["nanograph:prefix_cache_hit_tokens"])
    assert sorted(hits) == [0, len(users)]  # all three on one replica, none on the other
    assert hits[0] == 0
    system_blocks = len(offline.tokenizer.encode(SYSTEM)) // KNOBS["kvcache_block_size"]
    assert system_blocks >= 2
    # the second and third found at least the system prompt's full blocks in its cache
    assert hits[len(users)] >= 2 * system_blocks * KNOBS["kvcache_block_size"]


def test_a_killed_replica_loses_no_request_that_had_not_started(front, client, offline):
    pinned = [SYSTEM.replace("one line", f"line {i}") + "def parse(line):\n" for i in range(3)]
    before = served(front)
    client.completions.create(model=MODEL, prompt=pinned[0], max_tokens=2, temperature=0)
    victim = next(url for url, count in served(front).items() if count > before[url])
    os.kill(front.replicas()[victim][-1], signal.SIGKILL)
    # sent after the kill: the router would send the first three to the dead replica
    prompts = pinned + PROMPTS[:3]
    assert complete_all(client, prompts) == greedy(offline, prompts)
    # the launcher starts it again on its port, and it is ready again
    assert wait_until(lambda: len(front.replicas()[victim]) == 2 and status(victim) == 200)
    assert front.proc.poll() is None


def test_sigterm_stops_every_process_it_started(front):
    children = front.children()
    assert len(children) == 4  # smg, two replicas, one replica started again
    front.proc.send_signal(signal.SIGTERM)
    front.proc.wait(timeout=30)
    assert not [pid for pid in children if alive(pid)]
    assert status(front.url) is None  # the front port is closed
