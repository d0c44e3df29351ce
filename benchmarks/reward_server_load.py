"""Load test of the reward server (``python -m rlhf_lightning serve-reward``) on the loopback address: N concurrent
clients x M requests each, of mixed sizes, one oversized request among them; bounded in count and in time.

    python benchmarks/reward_server_load.py                          # 8 clients x 25 requests, GPT-2 small shape
    python benchmarks/reward_server_load.py --clients 32 --requests 10 --server-cores 0
    python benchmarks/reward_server_load.py --dry-run                # tiny and quick: the command works

The server serves a random reward adapter on a random base built here (nothing from a hub), with a bearer token,
as a user would expose it. Each request is first scored alone, one after another (the reference); then the clients
send them all at once, in shuffled order, with ``RemoteReward``'s layout (padded rows and their attention mask) so
that the server joins them into shared batches. Printed: requests per second, p50/p99 latency, requests lost (an
error or a missing answer: must be 0), answers equal to the single-request ones (to float rounding, 1e-5: must be
all), the oversized request's answer (must be 413), and the server's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.fixtures import model_dir, prepare_workdir, reward_dir  # noqa: E402
from harness.settings import Settings  # noqa: E402

TOKEN = "load-test-token"
TOLERANCE = 1e-5  # joined batches round differently from a request scored alone


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="the base's GPT-2 preset (harness.settings.PRESETS)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--requests", type=int, default=25, help="requests per client")
    parser.add_argument("--sizes", default="1,4,16,64", help="rows per request, drawn uniformly")
    parser.add_argument("--length", type=int, default=96, help="tokens per row at most (prompt + response)")
    parser.add_argument("--max-batch-size", type=int, default=64, help="the server's max_batch_size")
    parser.add_argument("--max-body-mb", type=float, default=4.0, help="the server's max_body_mb")
    parser.add_argument("--server-cores", default="", help="taskset the server to these cores (e.g. 0)")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds the concurrent phase may take")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="", help="the model's folder (default: a temporary one)")
    parser.add_argument("--dry-run", action="store_true", help="tiny model, 3 clients x 4 requests")
    return parser.parse_args(argv)


def start_server(args: argparse.Namespace, settings: Settings) -> tuple[subprocess.Popen, str]:
    """The server on a free loopback port, with a token; its process and address."""
    reward = json.dumps({"class_path": "rlhf_lightning.AdapterReward", "init_args": {"path": str(reward_dir(settings))}})
    command = [sys.executable, "-m", "rlhf_lightning", "serve-reward", "--base", str(model_dir(settings)),
               "--reward", reward, "--port", "0", "--max_batch_size", str(args.max_batch_size),
               "--max_body_mb", str(args.max_body_mb), "--device", "cpu"]
    if args.server_cores:
        command = ["taskset", "-c", args.server_cores, *command]
    env = {**os.environ, "RLHF_LIGHTNING_REWARD_TOKEN": TOKEN, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ready = process.stdout.readline()
    if " at http://" not in ready:
        process.kill()
        raise SystemExit(f"the server did not start: {ready!r}\n{process.communicate()[1][-3000:]}")
    return process, ready.split(" at ", 1)[1].split()[0]


def make_requests(args: argparse.Namespace, vocab: int, pad: int, count: int) -> list[dict[str, Any]]:
    """``count`` request bodies as RemoteReward lays them out: left-padded rows of one width and their mask."""
    draw = random.Random(args.seed)
    sizes = [int(size) for size in args.sizes.split(",")]
    bodies = []
    for _ in range(count):
        rows = draw.choice(sizes)
        width = draw.randint(args.length // 2, args.length)
        input_ids, masks = [], []
        for _ in range(rows):
            length = draw.randint(4, width)
            input_ids.append([pad] * (width - length) + [draw.randrange(vocab - 1) for _ in range(length)])
            masks.append([0] * (width - length) + [1] * length)
        bodies.append({"prompts": ["p"] * rows, "completions": ["c"] * rows, "input_ids": input_ids,
                       "attention_mask": masks})
    return bodies


def peak_memory_mib(pid: int) -> float:
    """The process's peak resident memory (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.dry_run:
        args.preset, args.clients, args.requests, args.length, args.sizes = "tiny", 3, 4, 16, "1,2,4"
    with tempfile.TemporaryDirectory() as scratch:
        settings = Settings(preset=args.preset, workdir=args.workdir or scratch, seed=args.seed)
        Path(settings.workdir).mkdir(parents=True, exist_ok=True)
        prepare_workdir(settings)
        process, url = start_server(args, settings)
        try:
            return measure(args, settings, process, url)
        finally:
            process.terminate()
            process.communicate(timeout=60)


def measure(args: argparse.Namespace, settings: Settings, process: subprocess.Popen, url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    info = httpx.get(f"{url}/info", headers=headers).json()
    vocab, pad = info["tokenizer"]["size"], info["tokenizer"]["size"] - 1
    bodies = make_requests(args, vocab - 1, pad, args.clients * args.requests)
    with httpx.Client(headers=headers, timeout=120) as client:
        alone = [client.post(f"{url}/score", json=body).json()["scores"] for body in bodies]
    order = list(range(len(bodies)))
    random.Random(args.seed + 1).shuffle(order)
    answers: dict[int, list[float]] = {}
    latencies: list[float] = []
    lost: list[str] = []
    deadline = time.monotonic() + args.deadline
    oversized = {"prompts": ["p"] * 4, "completions": ["x" * int(args.max_body_mb * 2**20 / 3)] * 4}
    oversized_status: list[int] = []

    def client_loop(share: list[int], send_oversized: bool) -> None:
        with httpx.Client(headers=headers, timeout=120) as client:
            for position, index in enumerate(share):
                if send_oversized and position == len(share) // 2:
                    oversized_status.append(client.post(f"{url}/score", json=oversized).status_code)
                if time.monotonic() > deadline:
                    lost.append(f"request {index}: not sent before the deadline")
                    continue
                start = time.perf_counter()
                try:
                    response = client.post(f"{url}/score", json=bodies[index])
                except httpx.HTTPError as error:
                    lost.append(f"request {index}: {type(error).__name__}: {error}")
                    continue
                latencies.append(time.perf_counter() - start)
                if response.status_code != 200:
                    lost.append(f"request {index}: HTTP {response.status_code}: {response.text[:200]}")
                    continue
                answers[index] = response.json()["scores"]

    shares = [order[client::args.clients] for client in range(args.clients)]
    threads = [threading.Thread(target=client_loop, args=(share, client == 0)) for client, share in enumerate(shares)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    gaps = [max(abs(a - b) for a, b in zip(answers[index], alone[index], strict=True)) for index in answers]
    equal = sum(gap <= TOLERANCE for gap in gaps)
    latencies.sort()
    served = httpx.get(f"{url}/info", headers=headers).json()["served"]
    result = {
        "requests": len(bodies), "rows": sum(len(body["completions"]) for body in bodies),
        "requests_per_second": len(answers) / elapsed, "rows_per_second": sum(len(a) for a in answers.values()) / elapsed,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else None,
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None,
        "lost": len(lost), "equal": equal, "answered": len(answers), "max_gap": max(gaps, default=0.0),
        "oversized_status": oversized_status[0] if oversized_status else None,
        "server_peak_mib": peak_memory_mib(process.pid), "batches": served["batches"],
        "settings": {key: value for key, value in vars(args).items() if key != "workdir"},
    }
    print(f"reward server load test: {args.clients} clients x {args.requests} requests of {args.sizes} rows "
          f"(<= {args.length} tokens), preset {args.preset}, max_batch_size {args.max_batch_size}")
    print(f"  requests/s            {result['requests_per_second']:.1f} ({result['rows_per_second']:.0f} rows/s, "
          f"{served['batches']} batches served in all)")
    print(f"  latency p50 / p99     {result['p50_ms']:.0f} ms / {result['p99_ms']:.0f} ms")
    print(f"  requests lost         {len(lost)} of {len(bodies)}" + (f" (first: {lost[0]})" if lost else ""))
    print(f"  equal to alone        {equal} of {len(answers)} (largest gap {result['max_gap']:.2e}, tolerance "
          f"{TOLERANCE:g})")
    print(f"  oversized request     HTTP {result['oversized_status']}")
    print(f"  server peak memory    {result['server_peak_mib']:.0f} MiB")
    print(json.dumps(result))
    ok = not lost and equal == len(bodies) and result["oversized_status"] == 413
    if not ok:
        raise SystemExit("the load test failed: see above")
    return result


if __name__ == "__main__":
    main()
