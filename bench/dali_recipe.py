"""NVIDIA DALI's CPU pipeline for the per-sample steps of torchvision's reference ImageNet
recipe, the peer of ``imagefeed-bench load --transform imagenet-ta``.

DALI-idiomatic: its file reader over an ImageFolder tree, the fused decode + RandomResizedCrop
(``decoders.image_random_crop``, libjpeg-turbo's partial decode), a resize to 176x176, its
``trivial_augment_wide``, then flip + normalize + CHW float32 (``crop_mirror_normalize``), on
the CPU (``device_id=None``). DALI has no RandomErasing or MixUp/CutMix step, so the recipe
stops at the per-sample steps both have.

Prints one line per timed epoch (images/s) and the median, as JSON with ``--json``.

Usage: python bench/dali_recipe.py FOLDER [--threads 2] [--batch-size 64] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings


def build(root: str, threads: int, batch_size: int, seed: int):  # type: ignore[no-untyped-def]
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.auto_aug import trivial_augment

    mean = [0.485 * 255, 0.456 * 255, 0.406 * 255]
    std = [0.229 * 255, 0.224 * 255, 0.225 * 255]

    @pipeline_def(enable_conditionals=True)
    def recipe():  # type: ignore[no-untyped-def]
        jpegs, labels = fn.readers.file(file_root=root, random_shuffle=True, name="files")
        images = fn.decoders.image_random_crop(
            jpegs,
            device="cpu",
            output_type=types.RGB,
            random_area=[0.08, 1.0],
            random_aspect_ratio=[3 / 4, 4 / 3],
        )
        images = fn.resize(images, size=[176, 176])
        images = trivial_augment.trivial_augment_wide(images, shape=[176, 176])
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="CHW",
            mean=mean,
            std=std,
            mirror=fn.random.coin_flip(),
        )
        return images, labels

    pipe = recipe(batch_size=batch_size, num_threads=threads, device_id=None, seed=seed)
    pipe.build()
    return pipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    warnings.simplefilter("ignore", DeprecationWarning)

    pipe = build(args.folder, args.threads, args.batch_size, seed=1)
    size = pipe.epoch_size("files")
    batches = math.ceil(size / args.batch_size)
    rates = []
    for epoch in range(args.epochs + 1):  # the first is a warm-up
        started = time.perf_counter()
        n = 0
        for _ in range(batches):
            images, _labels = pipe.run()
            n += len(images)
        rate = n / (time.perf_counter() - started)
        if epoch > 0:
            rates.append(rate)
            if not args.json:
                print(f"dali epoch {epoch}: {rate:,.0f} img/s")
    median = statistics.median(rates)
    if args.json:
        print(json.dumps({"peer": "dali", "version": _version(), "rates": rates, "median": median}))
    else:
        print(f"dali {_version()} median: {median:,.0f} img/s ({size} images, {args.threads} threads)")


def _version() -> str:
    import nvidia.dali

    return str(nvidia.dali.__version__)


if __name__ == "__main__":
    main()
