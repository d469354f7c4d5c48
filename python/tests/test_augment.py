"""#33: the automatic augmentations (AutoAugment, RandAugment, TrivialAugmentWide).

Each op against PIL itself, with the calls torchvision's functional ops make on PIL images (the
images of its reference recipes); test_torch.py checks them against torchvision's own
``_apply_op`` where torch is installed. Then the steps in the loader: deterministic for any
worker count, refused where they cannot be what torchvision does.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import FLIP_NORMALIZE
from PIL import Image, ImageEnhance, ImageOps

import imagefeed
from imagefeed import _native
from imagefeed import transforms as T


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """A deterministic photo-like image: smooth colour fields, hard edges and noise."""
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    fields = [
        128 + 100 * np.sin(x / (5 + 7 * c) + y / (11 - 3 * c) + c) * np.cos(y / (9 + 2 * c))
        for c in range(3)
    ]
    image = np.stack(fields, axis=-1)
    image[(x - width / 3) ** 2 + (y - height / 2) ** 2 < (min(width, height) / 4) ** 2] = (230, 40, 20)
    image += rng.normal(0, 12, image.shape)
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8), "RGB")


def ours(op: str, magnitude: float, img: Image.Image, fill=(0, 0, 0)) -> np.ndarray:
    w, h = img.size
    out = _native._augment_op(op, magnitude, img.tobytes(), w, h, fill)
    return np.frombuffer(out, np.uint8).reshape(h, w, 3)


def pil_affine(img: Image.Image, matrix, fill=(0, 0, 0)) -> Image.Image:
    return img.transform(img.size, Image.AFFINE, matrix, Image.NEAREST, fillcolor=fill)


def pil_op(op: str, m: float, img: Image.Image, fill=(0, 0, 0)) -> Image.Image:
    """What torchvision's _apply_op does to a PIL image, written with PIL's own calls."""
    if op in ("ShearX", "ShearY"):
        t = math.tan(math.radians(math.degrees(math.atan(m))))
        return pil_affine(img, (1, t, 0, 0, 1, 0) if op == "ShearX" else (1, 0, 0, t, 1, 0), fill)
    if op in ("TranslateX", "TranslateY"):
        t = int(m)
        return pil_affine(img, (1, 0, -t, 0, 1, 0) if op == "TranslateX" else (1, 0, 0, 0, 1, -t), fill)
    if op == "Rotate":
        return img.rotate(m, Image.NEAREST, fillcolor=fill)
    enhance = {"Brightness": ImageEnhance.Brightness, "Color": ImageEnhance.Color,
               "Contrast": ImageEnhance.Contrast, "Sharpness": ImageEnhance.Sharpness}
    if op in enhance:
        return enhance[op](img).enhance(1.0 + m)
    if op == "Posterize":
        return ImageOps.posterize(img, int(m))
    if op == "Solarize":
        return ImageOps.solarize(img, m)
    if op == "AutoContrast":
        return ImageOps.autocontrast(img)
    if op == "Equalize":
        return ImageOps.equalize(img)
    if op == "Invert":
        return ImageOps.invert(img)
    assert op == "Identity"
    return img


MAGNITUDES = {
    "ShearX": [-0.99, -0.3, -0.033, 0.0, 0.1, 0.5, 0.99],
    "ShearY": [-0.99, -0.2, 0.0, 0.033, 0.3, 0.99],
    "TranslateX": [-32.0, -15.999, -1.0, 0.0, 3.7, 16.0, 101.5],
    "TranslateY": [-79.7, -2.0, 0.0, 1.0, 32.0],
    "Rotate": [-135.0, -90.0, -47.25, -4.5, 0.0, 9.0, 30.0, 90.0, 121.5, 135.0],
    "Brightness": [-0.99, -0.5, -0.033, 0.0, 0.3, 0.99],
    "Color": [-0.99, -0.42, 0.0, 0.066, 0.9],
    "Contrast": [-0.99, -0.6, 0.0, 0.2, 0.99],
    "Sharpness": [-0.99, -0.3, 0.0, 0.5, 0.99],
    "Posterize": [1.0, 2.0, 4.0, 7.0, 8.0],
    "Solarize": [255.0, 246.5, 128.0, 8.5, 0.0],
    "AutoContrast": [0.0],
    "Equalize": [0.0],
    "Invert": [0.0],
    "Identity": [0.0],
}


@pytest.mark.parametrize("size", [(61, 47), (64, 64), (32, 32), (2, 7)])
@pytest.mark.parametrize("op", sorted(MAGNITUDES))
def test_every_op_is_pils(op, size):
    """Every op, at magnitudes across its tables, equals PIL's result exactly."""
    img = photo(*size, seed=len(op))
    for m in MAGNITUDES[op]:
        want = np.asarray(pil_op(op, m, img))
        got = ours(op, m, img)
        diff = np.abs(got.astype(int) - want.astype(int))
        assert (diff == 0).all(), f"{op}({m}) on {size}: {np.count_nonzero(diff)} values differ, max {diff.max()}"


def test_geometric_ops_fill_with_the_fill_colour():
    img = photo(40, 30)
    fill = (9, 200, 77)
    for op, m in (("ShearX", 0.5), ("TranslateY", -10.0), ("Rotate", 45.0)):
        np.testing.assert_array_equal(ours(op, m, img, fill), np.asarray(pil_op(op, m, img, fill)))
        assert (ours(op, m, img, fill) == fill).all(axis=-1).any()
    with pytest.raises(imagefeed.ConfigError):
        _native._augment_op("Shear", 0.1, img.tobytes(), 40, 30)
    with pytest.raises(imagefeed.ConfigError):
        _native._augment_op("Invert", 0.0, img.tobytes()[:-1], 40, 30)


# -- in the loader ------------------------------------------------------------------------------


def loader(path, **kw):
    kw.setdefault("batch_size", 16)
    kw.setdefault("workers", 2)
    kw.setdefault("output", "numpy")
    kw.setdefault("rank", 0)
    kw.setdefault("world_size", 1)
    return imagefeed.Loader(path, **kw)


AUGMENTATIONS = [
    T.TrivialAugmentWide(),
    T.RandAugment(),
    T.RandAugment(num_ops=3, magnitude=20, fill=128),
    T.AutoAugment("imagenet"),
    T.AutoAugment("cifar10"),
    T.AutoAugment("svhn"),
]


@pytest.mark.parametrize("augmentation", AUGMENTATIONS, ids=repr)
def test_augmented_batches_are_the_same_for_any_worker_count_and_differ_from_plain(lmdb_path, augmentation):
    transform = T.Compose([T.RandomCrop(24, padding=2), T.RandomHorizontalFlip(), augmentation])
    one = loader(lmdb_path, workers=1, transform=transform, dtype="uint8", layout="NHWC", seed=3)
    three = loader(lmdb_path, workers=3, transform=transform, dtype="uint8", layout="NHWC", seed=3)
    plain = loader(
        lmdb_path,
        workers=2,
        transform=T.Compose([T.RandomCrop(24, padding=2), T.RandomHorizontalFlip()]),
        dtype="uint8",
        layout="NHWC",
        seed=3,
    )
    changed = total = 0
    for (a, la), (b, lb), (p, _) in zip(one, three, plain):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(la, lb)
        changed += int(np.any(a != p, axis=(1, 2, 3)).sum())
        total += len(a)
    # The same crops and flips, then the augmentation: most images change.
    assert total > 0 and changed >= total // 3, (changed, total)


def test_the_flip_comes_before_the_augmentation(lmdb_path):
    """With an augmentation the flip happens on the pixels first (torchvision's order): a
    RandAugment of no ops leaves exactly the mirrored crop."""
    transform = T.Compose([T.CenterCrop(24), T.RandomHorizontalFlip(1.0), T.RandAugment(num_ops=0)])
    flipped = loader(lmdb_path, transform=transform, dtype="uint8", layout="NHWC", shuffle=False)
    plain = loader(lmdb_path, transform=T.Compose([T.CenterCrop(24)]), dtype="uint8", layout="NHWC", shuffle=False)
    for (a, _), (b, _) in zip(flipped, plain):
        np.testing.assert_array_equal(a, b[:, :, ::-1])


def test_presets_and_refusals(lmdb_path):
    # torchvision's reference recipe, as ClassificationPresetTrain builds it.
    ref = T.imagenet_train(176, auto_augment="ta_wide", random_erase=0.1)
    assert ref == T.Compose(
        [
            T.RandomResizedCrop(176),
            T.RandomHorizontalFlip(0.5),
            T.TrivialAugmentWide(),
            T.Normalize(T.IMAGENET_MEAN, T.IMAGENET_STD),
            T.RandomErasing(p=0.1),
        ]
    )
    images, _ = next(iter(loader(lmdb_path, transform=ref)))
    assert images.shape[1:] == (3, 176, 176) and images.dtype == np.float32
    assert T.imagenet_train(auto_augment="ra").spec()["pixel_steps"][0]["magnitude"] == 9
    assert T.imagenet_train(auto_augment="imagenet").spec()["pixel_steps"][0]["policy"] == "imagenet"
    with pytest.raises(ValueError, match="augmix"):
        T.imagenet_train(auto_augment="augmix")
    # A crop or flip after the augmentation runs in that order (the augmentation on the whole
    # image, the flip after it).
    assert T.Compose([T.TrivialAugmentWide(), T.RandomResizedCrop(32)]).spec()["before_geometry"]
    assert T.Compose([T.RandAugment(), T.RandomHorizontalFlip()]).spec()["flip_before_geometry"]
    with pytest.raises(ValueError, match="at most 8"):
        T.Compose([T.RandAugment(), T.TrivialAugmentWide()] * 5)
    for bad in (
        lambda: T.RandAugment(magnitude=31),
        lambda: T.RandAugment(num_ops=-1),
        lambda: T.RandAugment(num_magnitude_bins=1),
        lambda: T.TrivialAugmentWide(interpolation="bilinear"),
        lambda: T.TrivialAugmentWide(fill=256),
        lambda: T.TrivialAugmentWide(fill=(1, 2)),
        lambda: T.AutoAugment("reduced_imagenet"),
    ):
        with pytest.raises(ValueError):
            bad()
    # A scale or ratio that is no pair (one number was an IndexError, three taken in part).
    for bad in (
        lambda: T.RandomResizedCrop(32, scale=(0.5,)),
        lambda: T.RandomResizedCrop(32, ratio=(0.5, 1.0, 2.0)),
        lambda: T.RandomErasing(scale=0.5),
        lambda: T.RandomErasing(ratio=("a", 1)),
    ):
        with pytest.raises(imagefeed.ConfigError, match="must be a \\(min, max\\) pair"):
            bad()
    # The loader itself checks a hand-written description too.
    step = {"kind": "augment", "policy": "rand_augment", "num_ops": 2, "magnitude": 40}
    spec = dict(FLIP_NORMALIZE.spec(), pixel_steps=[step])
    with pytest.raises(imagefeed.ConfigError, match="magnitude"):
        loader(lmdb_path, transform=T.Transform(spec, "hand-written"))


# -- ColorJitter and RandomGrayscale ----------------------------------------------------------------


def ours_color(op: str, factor: float, img: Image.Image) -> np.ndarray:
    w, h = img.size
    return np.frombuffer(_native._color_op(op, factor, img.tobytes(), w, h), np.uint8).reshape(h, w, 3)


def pil_hue(img: Image.Image, hue_factor: float) -> np.ndarray:
    """torchvision's adjust_hue on PIL images: PIL's HSV, the hue byte shifted with wrap-around."""
    h, s, v = img.convert("HSV").split()
    np_h = np.array(h, dtype=np.uint8)
    np_h += np.int32(hue_factor * 255).astype(np.uint8)
    return np.asarray(Image.merge("HSV", (Image.fromarray(np_h, "L"), s, v)).convert("RGB"))


@pytest.mark.parametrize("size", [(61, 47), (3, 2)])
def test_colour_adjustments_are_pils(size):
    img = photo(*size, seed=5)
    enhance = {"brightness": ImageEnhance.Brightness, "contrast": ImageEnhance.Contrast,
               "saturation": ImageEnhance.Color}
    for op, cls in enhance.items():
        for factor in (0.0, 0.37, 0.6000000238418579, 1.0, 1.4, 3.0):
            want = np.asarray(cls(img).enhance(factor))
            np.testing.assert_array_equal(ours_color(op, factor, img), want, (op, factor))
    for hue in (-0.5, -0.21, -0.003, 0.0, 0.004, 0.1, 0.5):
        np.testing.assert_array_equal(ours_color("hue", hue, img), pil_hue(img, hue), hue)
    np.testing.assert_array_equal(ours_color("grayscale", 0.0, img), np.asarray(img.convert("L").convert("RGB")))
    # Every byte value through PIL's HSV round trip, not only a photo's.
    noise = np.random.RandomState(1).randint(0, 256, 256 * 256 * 3, np.uint8)
    every = Image.frombytes("RGB", (256, 256), noise.tobytes())
    np.testing.assert_array_equal(ours_color("hue", 0.2, every), pil_hue(every, 0.2))


def test_colour_jitter_and_grayscale_in_the_loader(lmdb_path):
    jitter = T.Compose([T.RandomHorizontalFlip(), T.ColorJitter(0.4, 0.4, 0.4, 0.1), T.RandomGrayscale(0.3)])
    one = loader(lmdb_path, workers=1, transform=jitter, dtype="uint8", layout="NHWC", seed=5)
    three = loader(lmdb_path, workers=3, transform=jitter, dtype="uint8", layout="NHWC", seed=5)
    gray = total = 0
    for (a, _), (b, _) in zip(one, three):
        np.testing.assert_array_equal(a, b)
        gray += int(((a[..., 0] == a[..., 1]) & (a[..., 1] == a[..., 2])).all(axis=(1, 2)).sum())
        total += len(a)
    assert 0.1 * total <= gray <= 0.55 * total, (gray, total)
    # RandomApply([ColorJitter], p) and the order rules.
    assert T.RandomApply([T.ColorJitter(0.8, 0.8, 0.8, 0.2)], p=0.8).step.p == 0.8
    for bad in (
        lambda: T.ColorJitter(-0.1),
        lambda: T.ColorJitter(hue=0.6),
        lambda: T.ColorJitter(brightness=(1.2, 0.8)),
        lambda: T.RandomGrayscale(1.5),
        lambda: T.RandomApply([T.RandomGrayscale()], p=0.5),
    ):
        with pytest.raises((ValueError, TypeError)):
            bad()
    # Pixel steps run in the order listed: gray then a hue shift stays the plain gray (no hue
    # left to shift); a hue shift then gray is another gray.
    def run(*steps):
        out = loader(lmdb_path, transform=T.Compose(list(steps)), dtype="uint8", layout="NHWC", shuffle=False)
        return next(iter(out))[0]

    gray = run(T.RandomGrayscale(1.0))
    np.testing.assert_array_equal(run(T.RandomGrayscale(1.0), T.ColorJitter(hue=(0.3, 0.3))), gray)
    assert not np.array_equal(run(T.ColorJitter(hue=(0.3, 0.3)), T.RandomGrayscale(1.0)), gray)
    # An off jitter (all zeros) changes nothing.
    plain = loader(lmdb_path, transform=T.Compose([]), dtype="uint8", layout="NHWC", shuffle=False)
    off = loader(lmdb_path, transform=T.Compose([T.ColorJitter()]), dtype="uint8", layout="NHWC", shuffle=False)
    for (a, _), (b, _) in zip(plain, off):
        np.testing.assert_array_equal(a, b)


# -- timm's RandAugment ----------------------------------------------------------------------------

TIMM_ARGS = {
    "AutoContrast": [0.0],
    "Equalize": [0.0],
    "Invert": [0.0],
    "Rotate": [-30.0, -27.0, -4.5, 0.0, 13.5, 30.0, 90.0],
    "Posterize": [0.0, 1.0, 3.0, 4.0, 8.0],
    "Solarize": [0.0, 26.0, 128.0, 230.0, 256.0],
    "SolarizeAdd": [0.0, 33.0, 99.0, 110.0],
    "Color": [0.1, 0.46, 1.0, 1.72, 1.9],
    "Contrast": [0.1, 0.19, 1.81, 1.9],
    "Brightness": [0.1, 0.55, 1.9],
    "Sharpness": [0.1, 1.45, 1.9],
    "ShearX": [-0.3, -0.27, 0.0, 0.09, 0.3],
    "ShearY": [-0.3, 0.15, 0.3],
    "TranslateXRel": [-0.45, -0.405, 0.0, 0.135, 0.45],
    "TranslateYRel": [-0.45, 0.2, 0.45],
}

PIL_FILTER = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}


def timm_ours(op, arg, img, fill, resample):
    w, h = img.size
    out = _native._timm_op(op, arg, img.tobytes(), w, h, fill, resample)
    return np.frombuffer(out, np.uint8).reshape(h, w, 3)


def timm_pil(op, arg, img, fill, resample):
    """What timm's op functions (timm/data/auto_augment.py) do, written with PIL's calls."""
    f = PIL_FILTER[resample]
    affine = lambda m: img.transform(img.size, Image.AFFINE, m, resample=f, fillcolor=fill)  # noqa: E731
    w, h = img.size
    enhance = {"Color": ImageEnhance.Color, "Contrast": ImageEnhance.Contrast,
               "Brightness": ImageEnhance.Brightness, "Sharpness": ImageEnhance.Sharpness}
    if op in enhance:
        return enhance[op](img).enhance(arg)
    if op == "SolarizeAdd":
        lut = [min(255, i + int(arg)) if i < 128 else i for i in range(256)]
        return img.point(lut * 3)
    return {
        "AutoContrast": lambda: ImageOps.autocontrast(img),
        "Equalize": lambda: ImageOps.equalize(img),
        "Invert": lambda: ImageOps.invert(img),
        "Rotate": lambda: img.rotate(arg, resample=f, fillcolor=fill),
        # Pillow 11 refuses 0 bits, which timm asks for at the top magnitude of the increasing
        # level; older Pillow kept no bit (black), which the loader does.
        "Posterize": lambda: img if arg >= 8 else (
            ImageOps.posterize(img, int(arg)) if arg >= 1 else Image.new("RGB", img.size)
        ),
        "Solarize": lambda: ImageOps.solarize(img, arg),
        "ShearX": lambda: affine((1, arg, 0, 0, 1, 0)),
        "ShearY": lambda: affine((1, 0, 0, arg, 1, 0)),
        "TranslateXRel": lambda: affine((1, 0, arg * w, 0, 1, 0)),
        "TranslateYRel": lambda: affine((1, 0, 0, 0, 1, arg * h)),
    }[op]()


@pytest.mark.parametrize("resample", ["bilinear", "bicubic"])
@pytest.mark.parametrize("op", sorted(TIMM_ARGS))
def test_every_timm_op_is_pils(op, resample):
    """timm's RandAugment ops, its bilinear and bicubic affine sampling included, equal PIL's
    result value for value (square and not, odd sizes)."""
    fill = (124, 116, 104)
    for size in ((61, 47), (64, 64)):
        img = photo(*size, seed=len(op) + 1)
        for arg in TIMM_ARGS[op]:
            want = np.asarray(timm_pil(op, arg, img, fill, resample))
            got = timm_ours(op, arg, img, fill, resample)
            diff = np.abs(got.astype(int) - want.astype(int))
            assert diff.max() == 0, (op, arg, size, resample, int((diff > 0).sum()), int(diff.max()))


def test_timm_rand_augment_runs_in_the_loader_and_refuses_what_timm_would(lmdb_path):
    step = T.TimmRandAugment("rand-m9-mstd0.5-inc1")
    kw = dict(dtype="uint8", layout="NHWC", seed=4)
    one = loader(lmdb_path, workers=1, transform=T.Compose([T.RandomResizedCrop(24), step]), **kw)
    three = loader(lmdb_path, workers=3, transform=T.Compose([T.RandomResizedCrop(24), step]), **kw)
    plain = loader(lmdb_path, workers=1, transform=T.Compose([T.RandomResizedCrop(24)]), **kw)
    changed = total = 0
    for (a, _), (b, _), (c, _) in zip(one, three, plain):
        np.testing.assert_array_equal(a, b)
        changed += int((a != c).any(axis=(1, 2, 3)).sum())
        total += len(a)
    # Two ops at p 0.5: about three images in four change (some ops change nothing).
    assert 0.5 * total < changed < 0.95 * total, (changed, total)
    spec = T.imagenet_train(auto_augment="rand-m9-mstd0.5-inc1").spec()
    assert spec["pixel_steps"][0] == {
        "kind": "timm_rand_augment", "config": "rand-m9-mstd0.5-inc1", "fill": (124, 116, 104),
        "interpolation": "bilinear",  # timm's create_transform default, passed on to its RandAugment
    }
    # Refused when the step is made, not later in the loader: what timm's parser refuses, the
    # forms of numbers it takes that the loader does not, and values out of range.
    for bad in ("augmix-m5", "rand-x3", "rand-mfoo", "rand-tweights", 9, "rand-m9.5", "rand-n2.5",
                "rand-m1e1", "rand-m 9", "rand-m+9", "rand-m9_0", "rand-m\uff19", "rand-m9 ", "rand-n65",
                "rand-p1.5", "rand-m101-mmax101", "rand-inc0.5"):
        with pytest.raises(ValueError):
            T.TimmRandAugment(bad)  # type: ignore[arg-type]
    for good in ("rand-p.5", "rand-m9-mmax0", "rand-m20-mmax5-mmax20", "rand-mstd0-mstd101"):
        T.TimmRandAugment(good)
        loader(lmdb_path, transform=T.Compose([T.TimmRandAugment(good)]))
    with pytest.raises(ValueError):
        T.TimmRandAugment(interpolation="area")  # type: ignore[arg-type]
    # The preset samples the augmentation as the crop, as timm passes a non-random one on.
    bicubic = T.imagenet_train(auto_augment="rand-m9-mstd0.5-inc1", interpolation="bicubic").spec()
    assert bicubic["pixel_steps"][0]["interpolation"] == "bicubic"
    with pytest.raises(ValueError, match="ra_magnitude"):
        T.imagenet_train(auto_augment="rand-m9", ra_magnitude=7)
    nearest = loader(lmdb_path, transform=T.Compose([T.TimmRandAugment("rand-n4-m10-p1", interpolation="nearest")]))
    next(iter(nearest))


# -- steps in any order (Compose) -----------------------------------------------------------------


def test_pixel_steps_listed_before_the_geometry_run_on_the_whole_image(lmdb_path):
    # Contrast blends with the image's mean: before the crop, the whole image's. The jitter
    # draws first either way (CenterCrop draws nothing), so the crop of the jittered whole image
    # is what the loader must give.
    jitter = T.ColorJitter(contrast=0.9)
    kw = dict(dtype="uint8", layout="NHWC", seed=5)
    whole = loader(lmdb_path, transform=T.Compose([jitter]), **kw).dataset
    first = loader(lmdb_path, transform=T.Compose([jitter, T.CenterCrop((12, 16))]), **kw).dataset
    later = loader(lmdb_path, transform=T.Compose([T.CenterCrop((12, 16)), jitter]), **kw).dataset
    differs = 0
    for i in range(16):
        image, _ = whole[i]  # 24 x 32
        want = image[6:18, 8:24]
        np.testing.assert_array_equal(first[i][0], want)
        differs += not np.array_equal(later[i][0], want)
    assert differs > 8, "jittering the crop instead must show"
    # Bit-identical for any worker count, as every other step.
    steps = T.Compose([T.TrivialAugmentWide(), T.RandomHorizontalFlip(), T.RandomResizedCrop(16)])
    one = loader(lmdb_path, workers=1, transform=steps, **kw)
    three = loader(lmdb_path, workers=3, transform=steps, **kw)
    for (a, _), (b, _) in zip(one, three):
        np.testing.assert_array_equal(a, b)
    assert T.Compose([jitter, T.CenterCrop(8)]).spec()["before_geometry"][0]["kind"] == "color_jitter"


def test_a_flip_listed_before_the_crop_flips_the_image_before_it(lmdb_path):
    ds = imagefeed.Dataset(lmdb_path, decode="numpy")
    crop = T.RandomCrop((24, 28), padding=(4, 0, 0, 0))  # padding on the left only
    kw = dict(dtype="uint8", layout="NHWC", seed=2)
    first = loader(lmdb_path, transform=T.Compose([T.RandomHorizontalFlip(1.0), crop]), **kw).dataset
    later = loader(lmdb_path, transform=T.Compose([crop, T.RandomHorizontalFlip(1.0)]), **kw).dataset
    black_left = black_right = 0
    for i in range(24):
        image, _ = ds[i]
        padded = np.pad(image[:, ::-1], ((0, 0), (4, 0), (0, 0)))  # torchvision: pad(hflip(img))
        window = first[i][0]
        assert any(np.array_equal(padded[:, x : x + 28], window) for x in range(9)), i
        black_left += int((window[:, 0] == 0).all())
        black_right += int((later[i][0][:, -1] == 0).all())
    assert black_left and black_right, (black_left, black_right)


def test_compose_refuses_a_flip_across_an_automatic_augmentation():
    ta, flip, crop = T.TrivialAugmentWide(), T.RandomHorizontalFlip(), T.RandomCrop(8)
    for bad in ([flip, ta, crop], [crop, ta, flip], [ta, flip, ta]):
        with pytest.raises(ValueError, match="RandomHorizontalFlip"):
            T.Compose(bad)
    # The orders the loader runs as listed.
    assert "flip_before_geometry" not in T.Compose([flip, ta]).spec()
    spec = T.Compose([ta, flip]).spec()
    assert spec["flip_before_geometry"] and len(spec["before_geometry"]) == 1
    spec = T.Compose([ta, flip, crop, T.ColorJitter(0.2), T.RandomGrayscale()]).spec()
    assert spec["flip_before_geometry"] and [s["kind"] for s in spec["pixel_steps"]] == ["color_jitter", "grayscale"]
    spec = T.Compose([crop, T.ColorJitter(0.2), flip, ta]).spec()
    assert "flip_before_geometry" not in spec and len(spec["pixel_steps"]) == 2
    # A step the loader runs once per sample, listed twice, is refused rather than collapsed.
    for twice in (
        [flip, flip],
        [flip, T.CenterCrop(4), flip],
        [T.Normalize((0.5,) * 3, (0.2,) * 3), T.Normalize((0.5,) * 3, (0.2,) * 3)],
        [T.RandomErasing(), T.RandomErasing()],
    ):
        with pytest.raises(ValueError, match="a second"):
            T.Compose(twice)
    # Resize and its CenterCrop are one step of the loader: nothing may come between them but
    # the flip (then taken from the mirror of the resized image, before the crop).
    with pytest.raises(ValueError, match="follows the Resize"):
        T.Compose([T.Resize(40), T.ColorJitter(0.2), T.CenterCrop(32)])
    assert T.Compose([T.Resize(40), flip, T.CenterCrop(32)]).spec()["flip_before_geometry"]


# -- MixUp and CutMix on the batch ----------------------------------------------------------------


def mixed_epochs(lmdb_path, batch_transform, epochs=1, **kw):
    """(plain images, mixed images, labels, soft labels) per batch, same seed and samples."""
    kw.setdefault("transform", FLIP_NORMALIZE)
    kw.setdefault("batch_size", 8)
    out = []
    for epoch in range(epochs):
        plain = loader(lmdb_path, seed=epoch, **kw)
        mixed = loader(lmdb_path, seed=epoch, batch_transform=batch_transform, **kw)
        for (x, y), (mx, soft) in zip(plain, mixed):
            out.append((x.copy(), mx.copy(), y.copy(), soft.copy()))
    return out


def lam_of(labels, soft):
    """lam from the soft labels: the own class's share where the predecessor's class differs."""
    rolled = np.roll(labels, 1)
    for i in range(len(labels)):
        if labels[i] != rolled[i]:
            return float(soft[i, labels[i]])
    return None


def test_mixup_blends_each_image_with_its_predecessor(lmdb_path):
    batches = mixed_epochs(lmdb_path, T.MixUp(alpha=0.4))
    classes = len(loader(lmdb_path).dataset.classes)
    checked = 0
    for x, mx, y, soft in batches:
        assert soft.dtype == np.float32 and soft.shape == (len(y), classes)
        np.testing.assert_allclose(soft.sum(axis=1), 1.0, atol=1e-6)
        lam = lam_of(y, soft)
        if lam is None:
            continue
        lam32 = np.float32(lam)
        want = np.roll(x, 1, axis=0) * (np.float32(1.0) - lam32) + x * lam32
        np.testing.assert_array_equal(mx, want)
        checked += 1
    assert checked >= len(batches) // 2


def test_cutmix_pastes_one_box_and_labels_follow_its_area(lmdb_path):
    batches = mixed_epochs(lmdb_path, T.CutMix(alpha=1.0), dtype="uint8", layout="NHWC",
                           transform=T.Compose([]))
    boxes = 0
    for x, mx, y, soft in batches:
        rolled = np.roll(x, 1, axis=0)
        h, w = x.shape[1:3]
        # Outside one box every image is its own; inside it, its predecessor's.
        from_prev = np.all(mx == rolled, axis=-1) & np.any(x != rolled, axis=-1)
        changed = np.any(mx != x, axis=-1)
        area = 0
        if changed.any():
            rows, cols = np.nonzero(changed.any(axis=0))
            y1, y2, x1, x2 = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
            np.testing.assert_array_equal(mx[:, y1:y2, x1:x2], rolled[:, y1:y2, x1:x2])
            outside = np.ones((h, w), bool)
            outside[y1:y2, x1:x2] = False
            np.testing.assert_array_equal(mx[:, outside], x[:, outside])
            area = (y2 - y1) * (x2 - x1)
            boxes += 1
            assert from_prev.any()
        lam = lam_of(y, soft)
        if lam is not None and changed.any():
            # The box found may be smaller than the pasted one where images agree at its edge.
            assert lam <= 1 - area / (h * w) + 1e-6


def test_mixup_lam_is_beta_distributed_and_batches_do_not_depend_on_workers(lmdb_path):
    lams = []
    for _, _, y, soft in mixed_epochs(lmdb_path, T.MixUp(alpha=0.2), epochs=8, batch_size=2):
        lam = lam_of(y, soft)
        if lam is not None:
            lams.append(lam)
    assert len(lams) > 150
    reference = np.random.RandomState(0).beta(0.2, 0.2, 20000)
    grid = np.union1d(lams, reference)
    cdf = [np.searchsorted(np.sort(v), grid, "right") / len(v) for v in (lams, reference)]
    assert np.abs(cdf[0] - cdf[1]).max() < 0.15, np.abs(cdf[0] - cdf[1]).max()
    choice = T.imagenet_mixup_cutmix()
    one = loader(lmdb_path, workers=1, seed=2, batch_transform=choice, transform=FLIP_NORMALIZE)
    three = loader(lmdb_path, workers=3, seed=2, batch_transform=choice, transform=FLIP_NORMALIZE)
    for (a, sa), (b, sb) in zip(one, three):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(sa, sb)


def test_batch_transform_refusals(lmdb_path):
    for bad in (
        lambda: T.MixUp(alpha=0),
        lambda: T.CutMix(alpha=float("inf")),
        lambda: T.MixUp(num_classes=0),
        lambda: T.RandomChoice([T.MixUp(), T.MixUp()]),
        lambda: T.RandomChoice([T.MixUp(), T.CutMix()], p=[0.3, 0.7]),
        lambda: T.RandomChoice([T.MixUp(num_classes=3), T.CutMix(num_classes=4)]),
    ):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(imagefeed.ConfigError):
        loader(lmdb_path, transform=FLIP_NORMALIZE, batch_transform=T.MixUp)  # the class, not one
    # The reference preset carries its batch step; giving another one too is refused.
    ref = T.imagenet_train(32, auto_augment="ta_wide", random_erase=0.1, mixup=0.2, cutmix=1.0)
    images, soft = next(iter(loader(lmdb_path, transform=ref)))
    assert images.shape[1:] == (3, 32, 32) and soft.dtype == np.float32 and soft.ndim == 2
    np.testing.assert_allclose(soft.sum(axis=1), 1.0, atol=1e-6)
    with pytest.raises(imagefeed.ConfigError, match="already mixes"):
        loader(lmdb_path, transform=ref, batch_transform=T.MixUp())
    # Fewer classes than the dataset's 3.
    with pytest.raises(imagefeed.ConfigError, match="num_classes"):
        loader(lmdb_path, transform=FLIP_NORMALIZE, batch_transform=T.MixUp(num_classes=2))


# -- GaussianBlur ---------------------------------------------------------------------------------


def ours_blur(kernel, sigma, img: Image.Image) -> np.ndarray:
    w, h = img.size
    return np.frombuffer(_native._blur_op(kernel, sigma, img.tobytes(), w, h), np.uint8).reshape(h, w, 3)


def test_gaussian_blur_is_the_reflect_padded_2d_convolution():
    """Against the definition torchvision computes (a 2-D float32 convolution of the reflect
    padded image with the outer product of the 1-D kernels, rounded half to even): every value
    within one level, nearly all equal."""
    img = photo(61, 47, seed=9)
    x = np.asarray(img).astype(np.float32)
    for (kx, ky), sigma in (((3, 3), 0.5), ((5, 9), 1.7), ((23, 23), 2.0), ((1, 7), 1.0)):
        def k1(n, sigma=sigma):
            t = np.linspace(-(n - 1) * 0.5, (n - 1) * 0.5, n, dtype=np.float32)
            pdf = np.exp(np.float32(-0.5) * (t / np.float32(sigma)) ** 2)
            return pdf / pdf.sum()

        kernel = np.outer(k1(ky), k1(kx)).astype(np.float32)
        padded = np.pad(x, ((ky // 2, ky // 2), (kx // 2, kx // 2), (0, 0)), mode="reflect")
        want = np.zeros_like(x)
        for dy in range(ky):
            for dx in range(kx):
                want += kernel[dy, dx] * padded[dy:dy + x.shape[0], dx:dx + x.shape[1]]
        want = np.clip(np.round(want), 0, 255)
        got = ours_blur((kx, ky), sigma, img).astype(np.float32)
        diff = np.abs(got - want)
        assert diff.max() <= 1 and (diff == 0).mean() >= 0.99, ((kx, ky), sigma, diff.max(), (diff == 0).mean())


def test_gaussian_blur_in_the_loader(lmdb_path):
    blur = T.Compose([T.RandomHorizontalFlip(), T.RandomApply([T.GaussianBlur(5, sigma=(0.5, 2.0))], p=0.7)])
    one = loader(lmdb_path, workers=1, transform=blur, dtype="uint8", layout="NHWC", seed=6)
    three = loader(lmdb_path, workers=3, transform=blur, dtype="uint8", layout="NHWC", seed=6)
    for (a, _), (b, _) in zip(one, three):
        np.testing.assert_array_equal(a, b)
    for bad in (
        lambda: T.GaussianBlur(4),
        lambda: T.GaussianBlur(0),
        lambda: T.GaussianBlur(3, sigma=0),
        lambda: T.GaussianBlur(3, sigma=(2.0, 1.0)),
    ):
        with pytest.raises(ValueError):
            bad()


def test_batch_steps_keep_map_style_access_empty_batches_and_numpy_scalars(lmdb_path, tmp_path):
    """Found by a hostile try: loader.dataset[i] under a batch step, empty batches' labels,
    NumPy scalars as parameters, values that were silently dropped."""
    mixed = loader(lmdb_path, transform=FLIP_NORMALIZE, batch_transform=T.MixUp(alpha=0.2))
    image, label = mixed.dataset[3]
    plain_image, plain_label = loader(lmdb_path, transform=FLIP_NORMALIZE).dataset[3]
    assert isinstance(label, int) and label == plain_label
    np.testing.assert_array_equal(image, plain_image)
    # A batch whose only sample is bad and skipped: labels [0, classes], not [0, 0].
    imagefeed.synthesize(tmp_path / "tree", classes=2, per_class=2, edge_cases=True)
    skip = loader(tmp_path / "tree", batch_size=1, bad_samples="skip", max_bad=None, shuffle=False,
                  transform=T.Compose([T.CenterCrop(8)]), batch_transform=T.CutMix())
    classes = len(skip.dataset.classes)
    shapes = {labels.shape for _, labels in skip}
    assert (0, classes) in shapes and (1, classes) in shapes, shapes
    # NumPy scalars are numbers.
    assert T.MixUp(alpha=np.float32(0.2)).alpha == pytest.approx(0.2)
    assert T.CutMix(num_classes=np.int64(3)).num_classes == 3
    assert T.ColorJitter(brightness=np.float32(0.4)).brightness is not None
    assert T.TrivialAugmentWide(fill=np.uint8(3)).fill == (3, 3, 3)
    for bad in (
        lambda: T.MixUp(alpha=1.7e308),
        lambda: T.AutoAugment(fill=1.0),
        lambda: T.ColorJitter(brightness=(True, 2)),
        lambda: T.ColorJitter(brightness=("a", 2)),
        lambda: T.RandomGrayscale("0.5"),
        lambda: T.RandomChoice([T.MixUp(), T.CutMix()], p=[0, 0]),
        lambda: T.imagenet_train(mixup=float("nan")),
        lambda: T.imagenet_train(cutmix=-1),
        lambda: T.imagenet_train(random_erase=float("nan")),
    ):
        with pytest.raises((ValueError, TypeError)):
            bad()
    with pytest.raises(imagefeed.ConfigError, match="ratio"):
        loader(lmdb_path, transform=T.Compose([T.RandomResizedCrop(8, ratio=(math.inf, math.inf))]))


def test_the_new_steps_resume_mid_epoch_to_the_same_batches(lmdb_path):
    """Steps before the crop, a flip before it, padding modes and timm's RandAugment: a loader
    resumed from a mid-epoch state_dict gives exactly the batches the first one had left."""
    steps = T.Compose([
        T.ColorJitter(0.3, 0.3),
        T.RandomHorizontalFlip(),
        T.RandomCrop(20, padding=4, padding_mode="reflect"),
        T.TimmRandAugment("rand-m9-mstd0.5-inc1"),
        T.RandomGrayscale(0.2),
    ])
    kw = dict(transform=steps, dtype="uint8", layout="NHWC", seed=21, batch_size=8)
    first = loader(lmdb_path, workers=2, **kw)
    batches = iter(first)
    for _ in range(3):
        next(batches)
    state = first.state_dict()
    rest = [images.copy() for images, _ in batches]
    resumed = loader(lmdb_path, workers=3, **kw)
    resumed.load_state_dict(state)
    again = [images.copy() for images, _ in resumed]
    assert len(rest) == len(again) > 0
    for a, b in zip(rest, again):
        np.testing.assert_array_equal(a, b)
    # Another transform is refused by the saved state (its fingerprint names the steps).
    other = loader(lmdb_path, workers=1, **{**kw, "transform": T.Compose([T.RandomCrop(20, padding=4)])})
    with pytest.raises(imagefeed.StateMismatchError):
        other.load_state_dict(state)


def test_bad_transform_settings_raise_config_error_and_normalize_takes_one_number():
    # A hostile try: constructors raised plain ValueError where the docs promise imagefeed.Error
    # subclasses, and Normalize(0.5, 0.5), which torchvision broadcasts, a TypeError.
    for bad in (
        lambda: T.Normalize((float("nan"),) * 3, (0.5,) * 3),
        lambda: T.RandomResizedCrop(0),
        lambda: T.MixUp(alpha=float("nan")),
        lambda: T.RandomHorizontalFlip(2.0),
        lambda: T.Normalize(0.5, 0.0),
    ):
        with pytest.raises(imagefeed.ConfigError):
            bad()
    assert T.Normalize(0.5, 0.25).mean == (0.5, 0.5, 0.5)
    assert T.Normalize(0.5, 0.25).std == (0.25, 0.25, 0.25)
