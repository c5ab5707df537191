"""`--data-parallel-size N`: N replicas of the server behind SGLang's model gateway, `smg`.

The models served here fit one GPU, so more GPUs mean more copies of the engine, not a bigger one.
Each replica is an ordinary `nanograph.serve` process on a local port of its own (with its own GPUs
through CUDA_VISIBLE_DEVICES, or all on the CPU), started with this process's own flags. `smg`, a
router from its own package, listens on the front port and sends each request to one replica
under a policy: `cache_aware` (the default) keeps a radix tree of the text it has sent to each
replica and sends a request where the longest prefix of it went, so prompts that share a system
prompt land where its KV blocks are cached; `round_robin` takes turns. This module only starts,
watches and stops processes; the routing, retries and health checks are smg's.

- Start-up: the replicas first; smg only once every replica's /health says 200 (weights loaded,
  graphs captured). smg's own /health says whether the router runs, not whether its workers do,
  so the front port opens, and answers 200, only when all the replicas are ready. (Later, a
  replica that is down shows in smg's /readiness, which counts the healthy ones.)
- A replica that exits is started again on its port. Until it is ready again, a request that
  cannot reach it is retried on another replica (a transport failure takes the worker out of
  routing), and its failed health checks keep it out. Requests the replica was serving when it
  died are lost; none that had not started.
- SIGTERM or Ctrl-C here (or smg's exit): SIGTERM to smg and every replica, SIGKILL to any still
  there STOP_SECONDS later.
"""
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import torch

logger = logging.getLogger("nanograph.serve")
STOP_SECONDS = 10.0
# smg's policies that need nothing of a worker but its answers (its load-aware ones read an
# SGLang server's load endpoint)
ROUTER_POLICIES = ["cache_aware", "round_robin", "prefix_hash", "random"]
# smg's flags besides the workers and the policy: a replica is probed every 2 s; after a SIGTERM
# the replicas end their streams at once, and smg would otherwise wait on for seconds after that.
# cache_aware sends a request away from the replica that holds its prefix once that replica's
# requests in flight exceed the mean by 16 and by 10% (smg's defaults, 64 and 50%, let a burst
# of prompts that share prefixes leave one replica the larger part, the other idle at the end):
# the replicas are identical, and a recomputed prefix costs less than an idle GPU
ROUTER_FLAGS = ["--health-check-interval-secs", "2", "--shutdown-grace-period-secs", "1",
                "--balance-abs-threshold", "16", "--balance-rel-threshold", "1.1",
                "--disable-tokenizer-autoload", "--log-level", "warn"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Replica:
    """One `nanograph.serve` process on 127.0.0.1:port."""
    command: list[str]
    env: dict
    port: int
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self):
        self.process = subprocess.Popen(self.command, env=self.env)
        logger.info("replica %s: pid %d", self.url, self.process.pid)

    def ready(self) -> bool:
        try:
            return urllib.request.urlopen(self.url + "/health", timeout=5).status == 200
        except OSError:  # not listening yet, or 503 while the engine builds
            return False


def replica_envs(size: int, knobs: dict) -> list[dict]:
    """Each replica's environment: its CUDA_VISIBLE_DEVICES (tensor_parallel_size GPUs each), or
    on the CPU its share of the cores."""
    if knobs.get("device", "cuda") == "cpu" or not torch.cuda.is_available():
        threads = str(max(1, os.cpu_count() // size))
        return [{"OMP_NUM_THREADS": threads, **os.environ} for _ in range(size)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    each = knobs.get("tensor_parallel_size", 1)
    if len(gpus) < size * each:
        sys.exit(f"nanograph-serve: {size} replicas of {each} GPU(s) need {size * each} GPUs; "
                 f"{len(gpus)} visible")
    return [{**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus[rank * each:][:each])}
            for rank in range(size)]


def add_replica_flags(parser):
    """The server's flags for replicas (serve/cli.py)."""
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="replicas of the engine behind the smg router on --port")
    parser.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                        help="smg's routing policy (with --data-parallel-size > 1)")


def serve_replicas(args, knobs: dict, argv: list[str]):
    """Run the replicas, and smg in front of them once all are ready, until SIGTERM, Ctrl-C or
    smg's exit. Before smg starts, a replica's exit ends everything (its flags may be wrong);
    after, the replica is started again."""
    if args.shell:
        sys.exit("nanograph-serve: --shell talks to one engine; leave out --data-parallel-size")
    replicas = []
    for env in replica_envs(args.data_parallel_size, knobs):
        port = free_port()
        # the flags given, then the replica's own: of a flag given twice, the last counts
        command = [sys.executable, "-m", "nanograph.serve", *argv,
                   "--host", "127.0.0.1", "--port", str(port), "--data-parallel-size", "1"]
        replicas.append(Replica(command, env, port))
    router = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit())  # (the `finally` stops the children)
    try:
        for replica in replicas:
            replica.start()
        while router is None or router.poll() is None:
            time.sleep(0.2)
            for replica in replicas:
                if replica.process.poll() is None:
                    continue
                if router is None:
                    sys.exit(f"nanograph-serve: the replica on {replica.url} exited before it "
                             f"was ready (status {replica.process.returncode})")
                logger.warning("replica %s exited (status %d): starting it again",
                               replica.url, replica.process.returncode)
                replica.start()
            if router is None and all(replica.ready() for replica in replicas):
                urls = [replica.url for replica in replicas]
                router = subprocess.Popen([
                    sys.executable, "-m", "smg", "launch", "--host", args.host,
                    "--port", str(args.port), "--worker-urls", *urls, "--policy",
                    args.router_policy, "--prometheus-port", str(free_port()), *ROUTER_FLAGS])
                logger.info("smg (pid %d) on %s:%d, policy %s, in front of %s", router.pid,
                            args.host, args.port, args.router_policy, " ".join(urls))
        sys.exit(f"nanograph-serve: the router exited (status {router.returncode})")
    except KeyboardInterrupt:
        pass
    finally:
        stop([router, *(replica.process for replica in replicas)])


def stop(processes: list[subprocess.Popen | None]):
    running = [p for p in processes if p is not None and p.poll() is None]
    for process in running:
        process.terminate()
    deadline = time.monotonic() + STOP_SECONDS
    for process in running:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
