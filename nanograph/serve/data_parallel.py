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
  so the front port opens, and answers 200, only when all the replicas are ready.
- A replica that exits is started again on its port. Until it is ready, smg sends nothing there:
  a request that cannot reach it is retried on another replica (a transport failure takes the
  worker out of routing), and its failed health checks keep it out. Requests the replica was
  serving when it died are lost; none that had not started.
- SIGTERM or Ctrl-C here (or smg's exit): SIGTERM to smg and every replica, SIGKILL to any still
  there STOP_SECONDS later. The replicas end their streams at once, so smg is given a short grace
  period for the requests in flight (by default it waits on after they have ended).
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
# smg's policies that need nothing from a worker but its answers (the load-aware ones read
# SGLang's own load endpoint)
ROUTER_POLICIES = ["cache_aware", "round_robin", "prefix_hash", "consistent_hashing", "random"]


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


def replica_devices(size: int, knobs: dict) -> list[str | None]:
    """Each replica's CUDA_VISIBLE_DEVICES (tensor_parallel_size GPUs each); None on the CPU."""
    if knobs.get("device", "cuda") == "cpu" or not torch.cuda.is_available():
        return [None] * size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    per_replica = knobs.get("tensor_parallel_size", 1)
    if len(gpus) < size * per_replica:
        sys.exit(f"nanograph-serve: {size} replicas of {per_replica} GPU(s) need "
                 f"{size * per_replica} GPUs; {len(gpus)} visible")
    return [",".join(gpus[rank * per_replica:(rank + 1) * per_replica]) for rank in range(size)]


def serve_replicas(args, knobs: dict, argv: list[str]):
    """Run the replicas and smg in front of them until SIGTERM, Ctrl-C or smg's exit."""
    if args.shell:
        sys.exit("nanograph-serve: --shell talks to one engine; leave out --data-parallel-size")
    replicas = []
    for devices in replica_devices(args.data_parallel_size, knobs):
        port = free_port()
        # the flags given, then the replica's own: a flag given twice takes its last value
        command = [sys.executable, "-m", "nanograph.serve", *argv,
                   "--host", "127.0.0.1", "--port", str(port), "--data-parallel-size", "1"]
        env = dict(os.environ) if devices is None else {**os.environ,
                                                        "CUDA_VISIBLE_DEVICES": devices}
        replicas.append(Replica(command, env, port))
    router = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit())  # (the `finally` stops the children)
    try:
        for replica in replicas:
            replica.start()
        starting = replicas
        while starting:
            for replica in starting:
                if replica.process.poll() is not None:
                    sys.exit(f"nanograph-serve: the replica on {replica.url} exited before it "
                             f"was ready (status {replica.process.returncode})")
            starting = [replica for replica in starting if not replica.ready()]
            time.sleep(0.1)
        router = subprocess.Popen(
            [sys.executable, "-m", "smg", "launch", "--host", args.host, "--port", str(args.port),
             "--worker-urls", *[replica.url for replica in replicas],
             "--policy", args.router_policy, "--prometheus-port", str(free_port()),
             "--health-check-interval-secs", "2", "--shutdown-grace-period-secs", "1",
             "--disable-tokenizer-autoload", "--log-level", "warn"])
        logger.info("smg (pid %d) on %s:%d, policy %s, in front of %s", router.pid, args.host,
                    args.port, args.router_policy, " ".join(r.url for r in replicas))
        while router.poll() is None:
            time.sleep(0.5)
            for replica in replicas:
                if replica.process.poll() is not None:
                    logger.warning("replica %s exited (status %d): starting it again",
                                   replica.url, replica.process.returncode)
                    replica.start()
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
