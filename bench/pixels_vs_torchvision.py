#!/usr/bin/env python3
"""How far imagefeed's eval pixels are from torchvision's, value by value.

    .venv-torch/bin/python bench/pixels_vs_torchvision.py IMAGEFOLDER [--whole-decode]

Runs `Resize(256)` + `CenterCrop(224)` over an ImageFolder tree twice, through imagefeed's
`Loader` (uint8, in order) and through torchvision's `ImageFolder` on PIL images, and prints
the mean absolute difference, the share of values within one level, and the five images that
differ most. Needs torch, torchvision and the imagefeed wheel in one environment.
"""

import argparse

import numpy as np
import torchvision.transforms as tvt
from torchvision.datasets import ImageFolder

import imagefeed
from imagefeed import transforms as T


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root")
    p.add_argument("--whole-decode", action="store_true", help="scaled_decode=False")
    p.add_argument("--resize", type=int, default=256)
    p.add_argument("--crop", type=int, default=224)
    args = p.parse_args()
    theirs_ds = ImageFolder(args.root, tvt.Compose([tvt.Resize(args.resize), tvt.CenterCrop(args.crop),
                                                    tvt.PILToTensor()]))
    loader = imagefeed.Loader(args.root, batch_size=50, workers=2, shuffle=False, output="numpy",
                              dtype="uint8", layout="NCHW", rank=0, world_size=1,
                              transform=T.Compose([T.Resize(args.resize), T.CenterCrop(args.crop)]),
                              scaled_decode=not args.whole_decode)
    ours = np.concatenate([images.copy() for images, _ in loader]).astype(int)
    theirs = np.stack([theirs_ds[i][0].numpy() for i in range(len(theirs_ds))]).astype(int)
    d = np.abs(ours - theirs)
    print(f"{len(d)} images, scaled_decode={not args.whole_decode}: mean difference "
          f"{d.mean():.3f}/255, within one level {(d <= 1).mean():.3%}, "
          f"more than two levels off {(d > 2).mean():.2%}")
    per_image = d.reshape(len(d), -1).mean(1)
    for i in np.argsort(-per_image)[:5]:
        print(f"  {per_image[i]:.2f}/255  {theirs_ds.samples[i][0]}")


if __name__ == "__main__":
    main()
