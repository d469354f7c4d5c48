#!/usr/bin/env python3
"""A complete PyTorch training loop fed by imagefeed, with a checkpoint it can resume from.

Runs on a CPU on generated data (no download):

    make python                       # builds the wheel and installs it into .venv
    .venv-torch/bin/python examples/train_pytorch.py --data demo-data/py   # any Python with torch

It writes a synthetic ImageFolder tree (10 classes of 32x32 JPEGs, a few broken files among
them), packs it to LMDB, and trains a small CNN for --epochs epochs. Every --checkpoint-every
steps it saves the model, the optimizer and the loader's position; run it again after stopping
it (Ctrl-C, a crash, a preempted job) and it continues with exactly the batches it had not
trained on. Broken files are replaced in their batch and reported by key.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import imagefeed
from imagefeed import transforms as T


def small_cnn(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, classes),
    )


def prepare(data: pathlib.Path) -> pathlib.Path:
    tree, packed = data / "imagefolder", data / "train.lmdb"
    if not tree.exists():
        imagefeed.synthesize(tree, classes=10, per_class=200, size=(32, 32), edge_cases=True)
    if not packed.exists():
        # The pack leaves the broken files out and lists them; the loader below reads the packed
        # file. (Point it at `tree` instead to see bad samples replaced during training.)
        summary = imagefeed.pack(tree, packed, "lmdb")
        print(f"packed {summary['samples']} images, rejected {len(summary['rejected'])}:",
              ", ".join(r["key"] for r in summary["rejected"]))
    return packed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="demo-data/py", type=pathlib.Path)
    p.add_argument("--source", choices=["packed", "folder"], default="packed",
                   help="train from the LMDB file or straight from the folder (with its broken files)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--checkpoint", type=pathlib.Path, default=None)
    args = p.parse_args()

    packed = prepare(args.data)
    path = packed if args.source == "packed" else args.data / "imagefolder"
    checkpoint = args.checkpoint or args.data / "checkpoint.pt"

    loader = imagefeed.Loader(
        path, batch_size=args.batch_size, workers=args.workers, seed=0,
        transform=T.cifar_train(), output="torch", bad_samples="replace", max_bad=0.01,
    )
    model = small_cnn(len(loader.classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    start_epoch, step, resumed = 0, 0, checkpoint.exists()
    if resumed:
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["loader"])  # the next loop continues where it stopped
        start_epoch, step = loader.epoch, saved["step"]
        print(f"resumed at epoch {start_epoch}, step {step}")
    print(loader)

    def save() -> None:
        tmp = checkpoint.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "loader": loader.state_dict(), "step": step}, tmp)
        os.replace(tmp, checkpoint)  # a crash mid-save never leaves a half checkpoint

    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)  # after a restore, the restored epoch goes on where it stopped
        started, seen, correct, total_loss = time.perf_counter(), 0, 0, 0.0
        for images, labels in loader:
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            seen += len(labels)
            correct += (logits.argmax(1) == labels).sum().item()
            total_loss += loss.item() * len(labels)
            for bad in loader.last_bad_samples:
                print(f"  bad sample {bad.key}: {bad.reason} (replaced by sample {bad.replaced_by})")
            if step % args.checkpoint_every == 0:
                save()
        seconds = time.perf_counter() - started
        print(f"epoch {epoch}: loss {total_loss / max(seen, 1):.3f}, train accuracy {correct / max(seen, 1):.1%}, "
              f"{seen / seconds:,.0f} images/s (model included)")
    save()


if __name__ == "__main__":
    main()
