#!/usr/bin/env python3
"""The Python package against the Rust loop it wraps, and against the PyTorch DataLoader.

One run, one dataset, the same settings for all three, in rounds that interleave them so drift
in machine speed falls on every one:

  python  `for images, labels in imagefeed.Loader(...): pass` in this process (torch tensors when
          torch is importable, else NumPy arrays), one untimed warm-up epoch, then timed epochs
  rust    `imagefeed-bench load --json` over the same dataset, settings and epochs
  torch   bench/torch_baseline.py (torchvision ImageFolder + DataLoader) over the ImageFolder
          tree, when --torch-python names a Python with torch and --tree is given

Each round runs every subject for --epochs timed epochs; the table gives the median over all
timed epochs and the ratio of medians, python / rust and python / torch. It also follows the
Python process's RSS over the epochs (flat in steady state) and the loader's buffer
allocations (constant after the first epoch).

  python3 bench/python_loader.py DATASET --bench target/release/imagefeed-bench \\
      --transform cifar --batch-size 256 --workers 2 --epochs 5 --rounds 3 \\
      [--tree IMAGEFOLDER --torch-python .venv-torch/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def python_epochs(args, transform, output):
    import imagefeed

    loader = imagefeed.Loader(
        args.dataset, batch_size=args.batch_size, workers=args.workers, seed=args.seed,
        transform=transform, output=output, bad_samples="skip", rank=0, world_size=1,
        prefetch=args.prefetch, device=args.device,
    )
    sync = lambda: None  # noqa: E731
    if args.device != "cpu":
        import torch

        sync = torch.cuda.synchronize
    rates, rss, allocations = [], [], []
    for epoch in range(args.warmup + args.epochs):
        loader.set_epoch(epoch)
        start = time.perf_counter()
        images = 0
        for _, labels in loader:
            images += len(labels)
        sync()  # CUDA batches: the epoch ends when its last copy and conversion have
        seconds = time.perf_counter() - start
        if epoch >= args.warmup:
            rates.append(images / seconds)
        rss.append(rss_mb())
        allocations.append(loader.stats()["pool_allocations"])
    return rates, rss, allocations


def rust_epochs(args):
    cmd = [args.bench, "load", args.dataset, "--json", "--batch-size", str(args.batch_size),
           "--workers", str(args.workers), "--seed", str(args.seed), "--transform", args.transform,
           "--epochs", str(args.epochs), "--warmup", str(args.warmup), "--bad", "skip"]
    if args.prefetch is not None:
        cmd += ["--prefetch", str(args.prefetch)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rates = []
    for line in out.splitlines():
        event = json.loads(line)
        if event.get("event") == "epoch":
            rates.append(event["images"] / event["seconds"])
    return rates


def torch_epochs(args):
    cmd = [args.torch_python, str(HERE / "torch_baseline.py"), args.tree, "--transform", args.transform,
           "--batch-size", str(args.batch_size), "--workers", str(args.workers),
           "--epochs", str(args.epochs), "--warmup", str(args.warmup), "--seed", str(args.seed)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [e["images"] / e["seconds"] for e in map(json.loads, out.splitlines()) if e.get("event") == "epoch"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset", help="a dataset imagefeed opens (packed file or ImageFolder tree)")
    p.add_argument("--bench", required=True, help="the imagefeed-bench binary (release build)")
    p.add_argument("--transform", choices=["cifar", "imagenet"], default="cifar")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=None, help="default: the Rust default (2 per worker)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=5, help="timed epochs per round and subject")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tree", help="the ImageFolder tree for the PyTorch DataLoader")
    p.add_argument("--torch-python", help="a Python with torch and torchvision")
    p.add_argument("--output", choices=["torch", "numpy", "dlpack"], default=None,
                   help="default: torch when importable, else numpy")
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N]: batches arrive on the GPU (torch output)")
    p.add_argument("--json", help="also write every measurement here")
    args = p.parse_args()

    from imagefeed import transforms as T

    transform = T.cifar_train() if args.transform == "cifar" else T.imagenet_train(224)
    output = args.output
    if args.device != "cpu":
        output = "torch"
    if output is None:
        try:
            import torch  # noqa: F401

            output = "torch"
        except ImportError:
            output = "numpy"
    if args.prefetch is None:
        args.prefetch = 2 * args.workers
    with_torch = bool(args.tree and args.torch_python)

    results = {"python": [], "rust": [], "torch": []}
    rss_per_round, allocations_per_round = [], []
    for r in range(args.rounds):
        rates, rss, allocations = python_epochs(args, transform, output)
        results["python"] += rates
        rss_per_round.append(rss)
        allocations_per_round.append(allocations)
        results["rust"] += rust_epochs(args)
        if with_torch:
            results["torch"] += torch_epochs(args)
        print(f"round {r + 1}/{args.rounds}: python {statistics.median(rates):,.0f}, "
              f"rust {statistics.median(results['rust'][-args.epochs:]):,.0f}"
              + (f", torch {statistics.median(results['torch'][-args.epochs:]):,.0f}" if with_torch else "")
              + " images/s", file=sys.stderr)

    med = {k: statistics.median(v) for k, v in results.items() if v}
    print(f"dataset {args.dataset}, transform {args.transform}, batch {args.batch_size}, "
          f"{args.workers} workers, prefetch {args.prefetch}, output {output} on {args.device}; "
          f"{args.rounds} rounds x {args.epochs} timed epochs (after {args.warmup} warm-up) per subject")
    print("| loop | images/s (median) | range | ratio |")
    print("| --- | --- | --- | --- |")
    for name, label in [("python", f"Python `for images, labels in loader` ({output})"),
                        ("rust", "Rust `imagefeed-bench load`"),
                        ("torch", "PyTorch DataLoader (torch_baseline.py)")]:
        if name not in med:
            continue
        v = results[name]
        ratio = "–" if name == "python" else f"python / {name} = {med['python'] / med[name]:.2f}"
        print(f"| {label} | **{med[name]:,.0f}** | {min(v):,.0f}–{max(v):,.0f} | {ratio} |")
    print(f"Python RSS per epoch (MB), round 1: {', '.join(f'{x:.0f}' for x in rss_per_round[0])}")
    print(f"pool allocations after each epoch, round 1: {allocations_per_round[0]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "output": output, "results": results,
                       "rss_mb": rss_per_round, "pool_allocations": allocations_per_round}, f, indent=1)


if __name__ == "__main__":
    main()
