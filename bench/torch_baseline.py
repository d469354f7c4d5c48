#!/usr/bin/env python3
"""The PyTorch baseline for `imagefeed-bench compare`.

torchvision ImageFolder + torch.utils.data.DataLoader over an ImageFolder tree, with the same
transforms, batch size and worker count as the imagefeed configuration it stands beside, timed
the same way: one untimed warm-up epoch, then one line per timed epoch.

  cifar     RandomHorizontalFlip, ToTensor, Normalize(CIFAR-10 mean/std)      -> f32 NCHW
  cifar-train  RandomCrop(32, padding=4), then as cifar                       -> f32 NCHW
  imagenet  RandomResizedCrop(224), RandomHorizontalFlip, ToTensor,
            Normalize(ImageNet mean/std)                                      -> f32 NCHW
  imagenet-ref  torchvision's reference recipe: RandomResizedCrop(176), RandomHorizontalFlip,
            TrivialAugmentWide, PILToTensor, ConvertImageDtype, Normalize,
            RandomErasing(0.1); RandomChoice([MixUp(0.2), CutMix(1.0)]) in the
            collate_fn, as references/classification/train.py does          -> f32 NCHW
  imagenet-timm  timm's recipe: RandomResizedCrop(224), RandomHorizontalFlip,
            timm's rand_augment_transform("rand-m9-mstd0.5-inc1", mean fill), ToTensor,
            Normalize (timm's posterize patched to take 0 bits as black: Pillow 11+
            raises there, which ends a timm run)                              -> f32 NCHW

Workers are persistent (created once, before the warm-up), which is the fastest way to run the
DataLoader over several epochs. With --cold every file of the tree is evicted from the page cache
(posix_fadvise DONTNEED) before each epoch, outside the timed region.

Output: JSON lines on stdout, the same schema `imagefeed-bench load --json` prints:
  {"event": "start", ...}
  {"event": "epoch", "epoch": E, "images": N, "seconds": S, "bad": 0}
  {"event": "stages", "read_s": .., "decode_s": .., "transform_s": .., "wait_s": ..}
Stage times are summed over workers (measured inside __getitem__ and returned with each sample).
"""

import argparse
import io
import json
import os
import sys
import time

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def emit(**fields):
    print(json.dumps(fields), flush=True)


def evict_tree(root):
    """Drops every file under root from the page cache; returns the number of files."""
    count = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                count += 1
            finally:
                os.close(fd)
    return count


class MixCollate:
    """The reference recipe's collate_fn: default_collate, then MixUp or CutMix on the batch
    (stage times passed through). A class at module level, so workers can unpickle it."""

    def __init__(self, num_classes):
        self.num_classes = num_classes
        self.mix = None

    def __call__(self, batch):
        import torch
        from torchvision.transforms import v2

        if self.mix is None:
            self.mix = v2.RandomChoice(
                [v2.MixUp(alpha=0.2, num_classes=self.num_classes), v2.CutMix(alpha=1.0, num_classes=self.num_classes)]
            )
        images, targets, seconds = torch.utils.data.default_collate(batch)
        images, targets = self.mix(images, targets)
        return images, targets, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="an ImageFolder tree (one sub-folder per class)")
    parser.add_argument("--transform", choices=["cifar", "cifar-train", "imagenet", "imagenet-ref", "imagenet-timm"], default="cifar")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5, help="timed epochs")
    parser.add_argument("--warmup", type=int, default=1, help="untimed epochs first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cold", action="store_true")
    parser.add_argument(
        "--pin-memory",
        action="store_true",
        help="DataLoader(pin_memory=True): batches in page-locked memory, as a GPU trainer uses it",
    )
    args = parser.parse_args()

    try:
        import torch
        import torchvision
        from PIL import Image
        from torchvision import datasets, transforms
    except ImportError as err:
        print(f"error: the PyTorch baseline needs torch and torchvision: {err}", file=sys.stderr)
        return 3

    if args.transform in ("cifar", "cifar-train"):
        crop = [transforms.RandomCrop(32, padding=4)] if args.transform == "cifar-train" else []
        augment = transforms.Compose(
            crop
            + [
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD),
            ]
        )
    elif args.transform == "imagenet-timm":
        try:
            from timm.data import auto_augment
        except ImportError as err:
            print(f"error: imagenet-timm needs timm: {err}", file=sys.stderr)
            return 3
        posterize = auto_augment.posterize

        def posterize_zero_as_black(img, bits, **kwargs):
            return Image.new(img.mode, img.size) if bits < 1 else posterize(img, bits, **kwargs)

        for name in ("Posterize", "PosterizeIncreasing", "PosterizeOriginal"):
            auto_augment.NAME_TO_OP[name] = posterize_zero_as_black
        mean_fill = tuple(min(255, round(255 * m)) for m in IMAGENET_MEAN)
        augment = transforms.Compose(
            [
                transforms.RandomResizedCrop(224),
                transforms.RandomHorizontalFlip(),
                auto_augment.rand_augment_transform(
                    "rand-m9-mstd0.5-inc1", {"translate_const": int(224 * 0.45), "img_mean": mean_fill}
                ),
                transforms.ToTensor(),
                transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        )
    elif args.transform == "imagenet-ref":
        # As torchvision's references/classification/presets.py builds it (PIL backend).
        augment = transforms.Compose(
            [
                transforms.RandomResizedCrop(176),
                transforms.RandomHorizontalFlip(),
                transforms.TrivialAugmentWide(),
                transforms.PILToTensor(),
                transforms.ConvertImageDtype(torch.float),
                transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
                transforms.RandomErasing(p=0.1),
            ]
        )
    else:
        augment = transforms.Compose(
            [
                transforms.RandomResizedCrop(224),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        )

    class TimedImageFolder(datasets.ImageFolder):
        """ImageFolder whose samples carry the seconds spent reading, decoding, transforming."""

        def __getitem__(self, index):
            path, target = self.samples[index]
            t0 = time.perf_counter()
            with open(path, "rb") as f:
                data = f.read()
            t1 = time.perf_counter()
            # What torchvision's default loader does (Image.open, convert("RGB")), from memory.
            image = Image.open(io.BytesIO(data)).convert("RGB")
            t2 = time.perf_counter()
            sample = augment(image)
            t3 = time.perf_counter()
            return sample, target, torch.tensor([t1 - t0, t2 - t1, t3 - t2], dtype=torch.float64)

    dataset = TimedImageFolder(args.root)
    generator = torch.Generator()
    generator.manual_seed(args.seed)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        generator=generator,
        pin_memory=args.pin_memory,
        collate_fn=MixCollate(len(dataset.classes)) if args.transform == "imagenet-ref" else None,
    )
    emit(
        event="start",
        loader="pytorch",
        samples=len(dataset),
        torch=torch.__version__,
        torchvision=torchvision.__version__,
        pil=Image.__version__,
        workers=args.workers,
        batch_size=args.batch_size,
        transform=args.transform,
    )
    stages = torch.zeros(3, dtype=torch.float64)
    wait = 0.0
    for epoch in range(args.warmup + args.epochs):
        timed = epoch >= args.warmup
        if args.cold:
            evict_tree(args.root)
        images = 0
        start = time.perf_counter()
        fetch_start = start
        for batch, labels, seconds in loader:
            fetched = time.perf_counter()
            # Touch the batch the way a trainer would: shape and layout are checked, not copied.
            assert batch.is_contiguous() and batch.dtype == torch.float32 and batch.dim() == 4
            images += batch.shape[0]
            if timed:
                wait += fetched - fetch_start
                stages += seconds.sum(dim=0)
            fetch_start = time.perf_counter()
        secs = time.perf_counter() - start
        if timed:
            emit(event="epoch", epoch=epoch, images=images, seconds=secs, bad=0)
    read_s, decode_s, transform_s = stages.tolist()
    emit(
        event="stages",
        read_s=read_s,
        decode_s=decode_s,
        transform_s=transform_s,
        collate_s=None,
        wait_s=wait,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
