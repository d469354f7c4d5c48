#!/usr/bin/env python3
"""pytorch/examples' ImageNet training script, fed by imagefeed: DDP, resume, exact evaluation.

The structure is pytorch/examples' `imagenet/main.py` (spawned ranks, DistributedDataParallel,
`train_sampler.set_epoch`, checkpoints at each epoch's end, `validate` with meters reduced over
the ranks and the samples the distributed sampler left out evaluated by every rank through
`Subset(val_loader.dataset, ...)`). Only the lines marked `# imagefeed` differ: the two
loaders replace ImageFolder + DistributedSampler + DataLoader; nothing else was edited.

Runs on CPUs over gloo, on any tree with train/ and val/ ImageFolders (made when missing):

    .venv-torch/bin/python examples/imagenet_ddp.py demo-data/ddp --world-size 2 --epochs 2

`--exact` evaluates with `uneven="exact"` instead: every validation sample on exactly one rank,
summed with all_reduce, no leftover loop.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.utils.data import Subset

import imagefeed  # imagefeed
from imagefeed import transforms as T  # imagefeed


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", type=pathlib.Path, help="folder with train/ and val/")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("-b", "--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("-j", "--workers", type=int, default=2, help="loader threads per rank")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--resume", type=pathlib.Path, default=None)
    p.add_argument("--checkpoint", type=pathlib.Path, default=None)
    p.add_argument("--size", type=int, default=32, help="crop size")
    p.add_argument("--exact", action="store_true", help='evaluate with uneven="exact"')
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_data(root: pathlib.Path) -> None:
    """A small ImageNet-shaped pair of trees: 8 classes, 40 + 13 images each (104 val images,
    which do not divide between 3 or 5 ranks: the leftover path is exercised). Both come from
    the same generator and seed, so val repeats train's first images: a check of the plumbing,
    not of generalization."""
    for split, per_class, seed in (("train", 40, 1), ("val", 13, 1)):
        if not (root / split).exists():
            imagefeed.synthesize(root / split, classes=8, per_class=per_class, size=(48, 40), seed=seed)


def small_resnet(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes),
    )


class AverageMeter:
    """Sum and count, reducible over the ranks (as pytorch/examples' meter)."""

    def __init__(self) -> None:
        self.sum, self.count = 0.0, 0

    def update(self, value: float, n: int) -> None:
        self.sum += value * n
        self.count += n

    def all_reduce(self) -> None:
        total = torch.tensor([self.sum, float(self.count)], dtype=torch.float64)
        dist.all_reduce(total, dist.ReduceOp.SUM)
        self.sum, self.count = total[0].item(), int(total[1].item())

    @property
    def avg(self) -> float:
        return self.sum / max(self.count, 1)


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    return (output.argmax(1) == target).float().mean().item() * 100.0


def main_worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    torch.manual_seed(args.seed)
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])  # imagefeed
    train_loader = imagefeed.Loader(  # imagefeed
        args.data / "train", batch_size=args.batch_size, workers=args.workers, seed=args.seed,
        transform=T.Compose([T.RandomResizedCrop(args.size), T.RandomHorizontalFlip(), normalize]),
    )
    train_sampler = train_loader.sampler  # imagefeed
    val_loader = imagefeed.Loader(  # imagefeed
        args.data / "val", batch_size=args.batch_size, workers=args.workers, shuffle=False,
        uneven="exact" if args.exact else "drop",  # drop: DistributedSampler(drop_last=True)
        transform=T.Compose([T.Resize(args.size + args.size // 7), T.CenterCrop(args.size), normalize]),
    )
    model = nn.parallel.DistributedDataParallel(small_resnet(len(train_loader.dataset.classes)))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    start_epoch, best_acc1 = 0, 0.0
    if args.resume is not None and args.resume.exists():
        checkpoint = torch.load(args.resume, weights_only=False)
        start_epoch, best_acc1 = checkpoint["epoch"], checkpoint["best_acc1"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        train_loader.load_state_dict(checkpoint["loader"])  # imagefeed
        if rank == 0:
            print(f"=> resumed from {args.resume} (epoch {start_epoch})")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, rank)
        acc1 = validate(val_loader, model, criterion, args, rank)
        best_acc1 = max(acc1, best_acc1)
        if rank == 0 and args.checkpoint is not None:
            state = {"epoch": epoch + 1, "state_dict": model.state_dict(), "best_acc1": best_acc1,
                     "optimizer": optimizer.state_dict(), "loader": train_loader.state_dict()}
            tmp = args.checkpoint.with_suffix(".tmp")
            torch.save(state, tmp)
            shutil.move(tmp, args.checkpoint)
    # Every rank leaves together: a rank tearing gloo down while another is still saving the
    # checkpoint can abort in gloo's threads ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def train(loader, model, criterion, optimizer, epoch: int, rank: int) -> None:
    model.train()
    losses, top1 = AverageMeter(), AverageMeter()
    for images, target in loader:
        output = model(images)
        loss = criterion(output, target)
        losses.update(loss.item(), images.size(0))
        top1.update(accuracy(output, target), images.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if rank == 0:
        print(f"epoch {epoch}: train loss {losses.avg:.3f}, Acc@1 {top1.avg:.1f} over {top1.count} samples on rank 0")


def validate(val_loader, model, criterion, args, rank: int) -> float:
    def run_validate(loader) -> None:
        with torch.no_grad():
            for images, target in loader:
                output = model(images)
                losses.update(criterion(output, target).item(), images.size(0))
                top1.update(accuracy(output, target), images.size(0))

    losses, top1 = AverageMeter(), AverageMeter()
    model.eval()
    run_validate(val_loader)
    top1.all_reduce()
    losses.all_reduce()
    if len(val_loader.sampler) * args.world_size < len(val_loader.dataset):
        # The samples DistributedSampler(drop_last=True) left out, evaluated on every rank (and
        # counted once: added after the reduction), as pytorch/examples does.
        aux_val_dataset = Subset(val_loader.dataset,
                                 range(len(val_loader.sampler) * args.world_size, len(val_loader.dataset)))
        aux_val_loader = torch.utils.data.DataLoader(aux_val_dataset, batch_size=args.batch_size,
                                                     shuffle=False, num_workers=0)
        run_validate(aux_val_loader)
    if rank == 0:
        print(f" * Acc@1 {top1.avg:.3f} over {top1.count} of {len(val_loader.dataset)} validation samples")
    return top1.avg


def main(argv=None) -> None:
    args = parse_args(argv)
    make_data(args.data)
    if args.checkpoint is None:
        args.checkpoint = args.data / "checkpoint.pth.tar"
    mp.spawn(main_worker, nprocs=args.world_size, args=(args,))


if __name__ == "__main__":
    main()
