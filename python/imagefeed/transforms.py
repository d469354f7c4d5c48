"""Per-sample transforms, as the loader runs them (in Rust, in its worker threads).

A transform is a description, not code: a geometry step (resize / crop), an optional random
horizontal flip and an optional normalization, followed by the loader's output conversion
(``dtype``, ``layout``). The names and the arithmetic follow torchvision (``Resize``,
``CenterCrop``, ``RandomResizedCrop``, ``RandomHorizontalFlip``, ``Normalize`` after
``ToTensor``), so a torchvision pipeline of these steps maps one to one::

    from imagefeed import transforms as T
    train = T.Compose(
        [T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.Normalize(T.IMAGENET_MEAN, T.IMAGENET_STD)]
    )
    # the same as
    train = T.imagenet_train(224)

Without ``Normalize``, float outputs are ``pixel / 255`` (``ToTensor``); ``uint8`` outputs are
the pixels. Random decisions come from each sample's own generator, seeded by
``(seed, epoch, index)``, so they do not depend on the worker count.
"""

from __future__ import annotations

import copy
import math
import numbers
import operator
from typing import Any, Dict, List, Literal, Optional, Sequence, Set, Tuple, Union

from . import _native, errors

__all__ = [
    "Transform",
    "Compose",
    "Resize",
    "CenterCrop",
    "RandomCrop",
    "RandomResizedCrop",
    "RandomHorizontalFlip",
    "RandomErasing",
    "AutoAugment",
    "RandAugment",
    "TrivialAugmentWide",
    "TimmRandAugment",
    "ColorJitter",
    "RandomGrayscale",
    "GaussianBlur",
    "RandomApply",
    "MixUp",
    "CutMix",
    "RandomChoice",
    "BatchTransform",
    "Normalize",
    "none",
    "cifar_train",
    "imagenet_train",
    "imagenet_mixup_cutmix",
    "imagenet_eval",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

Size = Union[int, Tuple[int, int]]
PaddingMode = Literal["constant", "edge", "reflect", "symmetric"]


def _hw(size: Size, what: str) -> Tuple[int, int]:
    """``size`` as (height, width), torchvision style: an int (NumPy's too) is a square, a
    sequence of one int too."""
    if isinstance(size, (bool, str, bytes)):
        raise errors.ConfigError(f"{what}: size {size!r} must be an int or (height, width)")
    if isinstance(size, numbers.Integral):
        values = [size, size]
    elif isinstance(size, (list, tuple)) and len(size) in (1, 2):
        values = list(size) * (3 - len(size))
    else:
        raise errors.ConfigError(f"{what}: size {size!r} must be an int or (height, width)")
    if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 1 <= v < 2**31 for v in values):
        raise errors.ConfigError(f"{what}: size {size!r} must be positive integers below 2**31")
    return operator.index(values[0]), operator.index(values[1])


class _Step:
    """One step of a :class:`Compose`."""

    def _apply(self, spec: Dict[str, Any]) -> None:  # pragma: no cover - every step overrides it
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def _range(value: Any, name: str, what: str) -> Tuple[float, float]:
    """A ``(min, max)`` pair of numbers (a one-number or three-number ``scale`` was an
    ``IndexError`` or taken in part)."""
    try:
        low, high = value
        return float(low), float(high)
    except (TypeError, ValueError):
        raise errors.ConfigError(f"{what}: {name} {value!r} must be a (min, max) pair of numbers") from None


def _interpolation(mode: Any, antialias: Optional[bool], what: str) -> str:
    """torchvision's ``interpolation`` (an ``InterpolationMode`` or its name) as a name."""
    name = getattr(mode, "value", mode)
    if name not in ("nearest", "bilinear", "bicubic"):
        raise errors.ConfigError(f"{what}: interpolation {mode!r} must be nearest, bilinear or bicubic")
    if antialias is False:
        raise errors.ConfigError(
            f"{what}: antialias=False is not supported: the loader filters as PIL does when "
            "shrinking (torchvision's behaviour on PIL images and its default on tensors)"
        )
    return str(name)


class Resize(_Step):
    """torchvision ``Resize(size, interpolation)``: with an int, the shorter side becomes
    ``size`` (the aspect ratio kept); with ``(height, width)``, every image becomes exactly that
    size. Resampled with ``interpolation`` (``"bilinear"``, the default, ``"bicubic"`` or
    ``"nearest"``; torchvision's ``InterpolationMode`` works too), antialiased as PIL is. A
    ``CenterCrop`` or ``RandomCrop`` may follow the int form."""

    def __init__(
        self, size: Union[Size, Sequence[int]], interpolation: Any = "bilinear", antialias: Optional[bool] = True
    ):
        if isinstance(size, (list, tuple)) and len(size) == 1 and isinstance(size[0], numbers.Integral):
            size = operator.index(size[0])  # torchvision: a one-element sequence is the shorter side
        if isinstance(size, numbers.Integral) and not isinstance(size, bool):
            if not 1 <= int(size) < 2**31:
                raise errors.ConfigError(f"Resize: size {size!r} must be a positive int (the shorter side)")
            self.size: Union[int, Tuple[int, int]] = operator.index(size)
        else:
            self.size = _hw(size, "Resize")  # type: ignore[arg-type]
        self.interpolation = _interpolation(interpolation, antialias, "Resize")

    def _apply(self, spec: Dict[str, Any]) -> None:
        if spec["geometry"] != "native":
            raise errors.ConfigError("Resize must come before any crop, and only once")
        if isinstance(self.size, tuple):
            h, w = self.size
            spec.update(geometry="resize_to", width=w, height=h, interpolation=self.interpolation)
        else:
            spec.update(geometry="resize", short=self.size, interpolation=self.interpolation)


class CenterCrop(_Step):
    """torchvision ``CenterCrop(size)`` (zero padding when the image is smaller)."""

    def __init__(self, size: Size):
        self.size = _hw(size, "CenterCrop")

    def _apply(self, spec: Dict[str, Any]) -> None:
        h, w = self.size
        if spec["geometry"] == "native":
            spec.update(geometry="center_crop", width=w, height=h)
        elif spec["geometry"] == "resize":
            spec.update(geometry="resize_center_crop", width=w, height=h)
        else:
            raise errors.ConfigError("CenterCrop can follow only Resize with an int size (the shorter side)")


class RandomCrop(_Step):
    """torchvision ``RandomCrop(size, padding, pad_if_needed, fill, padding_mode)``: pad, then
    take a ``size`` window at a uniformly drawn offset.

    Parameters
    ----------
    size : int or (int, int)
        The window, ``(height, width)`` or one int for a square.
    padding : int or sequence of 2 or 4 ints, optional
        As torchvision: one int pads every side; ``(a, b)`` pads left/right by ``a`` and
        top/bottom by ``b``; ``(left, top, right, bottom)`` each side.
    pad_if_needed : bool
        Pad a side still shorter than the window by the difference on both ends. Without it an
        image smaller than the window is a bad sample (torchvision raises).
    fill : int or (int, int, int)
        The colour ``"constant"`` padding fills with, in 0..255 pixel values (black by default),
        as torchvision pads the image before ``ToTensor``/``Normalize``.
    padding_mode : {"constant", "edge", "reflect", "symmetric"}
        torchvision's modes: one colour; the edge pixel repeated; mirrored about the edge pixel;
        mirrored with the edge pixel repeated. Padding wider than the image repeats the mirror,
        as torchvision (``numpy.pad``) does for PIL images.
    """

    def __init__(
        self,
        size: Size,
        padding: Union[int, Sequence[int], None] = None,
        pad_if_needed: bool = False,
        fill: Union[int, Sequence[int]] = 0,
        padding_mode: PaddingMode = "constant",
    ):
        self.size = _hw(size, "RandomCrop")
        if padding_mode not in _PADDING_MODES:
            raise errors.ConfigError(
                f"RandomCrop: padding_mode {padding_mode!r} is none of {', '.join(_PADDING_MODES)}"
            )
        self.padding = _padding(padding)
        if not isinstance(pad_if_needed, bool):
            raise errors.ConfigError(f"RandomCrop: pad_if_needed {pad_if_needed!r} must be True or False")
        self.pad_if_needed = pad_if_needed
        self.fill = _fill(fill, "RandomCrop")
        self.padding_mode = padding_mode

    def _apply(self, spec: Dict[str, Any]) -> None:
        # After a Resize (Compose([Resize(256), RandomCrop(224)])) the window is drawn on the
        # resized image; "short" stays in the spec.
        if spec["geometry"] not in ("native", "resize"):
            raise errors.ConfigError("RandomCrop can follow only Resize with an int size (the shorter side)")
        h, w = self.size
        spec.update(
            geometry="random_crop",
            width=w,
            height=h,
            padding=self.padding,
            pad_if_needed=self.pad_if_needed,
            fill=self.fill,
            padding_mode=self.padding_mode,
        )


_PADDING_MODES: Tuple[str, ...] = ("constant", "edge", "reflect", "symmetric")


def _padding(padding: Union[int, Sequence[int], None]) -> Tuple[int, int, int, int]:
    """torchvision's padding forms as (left, top, right, bottom)."""
    if padding is None:
        return (0, 0, 0, 0)
    if isinstance(padding, numbers.Integral):
        values: List[Any] = [padding]
    elif isinstance(padding, (list, tuple)):
        values = list(padding)
    else:
        values = []
    if len(values) not in (1, 2, 4) or any(
        isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= int(v) <= MAX_PADDING for v in values
    ):
        raise errors.ConfigError(
            f"RandomCrop: padding {padding!r} must be an int in 0..{MAX_PADDING} or a sequence of 2 or 4 of them"
        )
    v = [operator.index(x) for x in values]
    if len(v) == 1:
        return (v[0],) * 4
    if len(v) == 2:
        return (v[0], v[1], v[0], v[1])
    return (v[0], v[1], v[2], v[3])


#: The most padding RandomCrop takes on one side (the Rust loader's ``MAX_PADDING``).
MAX_PADDING = 1 << 16


class RandomResizedCrop(_Step):
    """torchvision ``RandomResizedCrop(size, scale, ratio, interpolation)``, antialiased as PIL
    is; ``interpolation`` as for :class:`Resize` (bilinear by default, bicubic for the ViT
    recipes)."""

    def __init__(
        self,
        size: Size,
        scale: Tuple[float, float] = (0.08, 1.0),
        ratio: Tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
        interpolation: Any = "bilinear",
        antialias: Optional[bool] = True,
    ):
        self.size = _hw(size, "RandomResizedCrop")
        self.scale = _range(scale, "scale", "RandomResizedCrop")
        self.ratio = _range(ratio, "ratio", "RandomResizedCrop")
        self.interpolation = _interpolation(interpolation, antialias, "RandomResizedCrop")

    def _apply(self, spec: Dict[str, Any]) -> None:
        if spec["geometry"] != "native":
            raise errors.ConfigError("RandomResizedCrop replaces Resize/CenterCrop: use it alone")
        h, w = self.size
        spec.update(
            geometry="random_resized_crop",
            width=w,
            height=h,
            scale=self.scale,
            ratio=self.ratio,
            interpolation=self.interpolation,
        )


class RandomHorizontalFlip(_Step):
    """torchvision ``RandomHorizontalFlip(p)``."""

    def __init__(self, p: float = 0.5):
        if not 0.0 <= float(p) <= 1.0:
            raise errors.ConfigError(f"RandomHorizontalFlip: p {p!r} must be in [0, 1]")
        self.p = float(p)

    def _apply(self, spec: Dict[str, Any]) -> None:
        spec["hflip"] = self.p


class RandomErasing(_Step):
    """torchvision ``RandomErasing(p, scale, ratio, value)``: with probability ``p`` a
    rectangle of the finished image is replaced by ``value``, in the units of the
    :class:`Normalize` in the same :class:`Compose` (``0`` after normalization: the mean colour),
    or ``"random"`` standard normal values. As torchvision, it applies after the flip and the
    normalization wherever it stands in the list.

    The rectangle is filled with the pixel that normalizes to ``value``, so outputs are within
    half a level of torchvision's; random values are clamped to what a pixel can hold.
    ``inplace`` is accepted and ignored (the loader writes a new batch anyway).
    """

    def __init__(
        self,
        p: float = 0.5,
        scale: Tuple[float, float] = (0.02, 0.33),
        ratio: Tuple[float, float] = (0.3, 3.3),
        value: Union[float, Sequence[float], str] = 0,
        inplace: bool = False,
    ):
        if not 0.0 <= float(p) <= 1.0:
            raise errors.ConfigError(f"RandomErasing: p {p!r} must be in [0, 1]")
        self.p = float(p)
        self.scale = _range(scale, "scale", "RandomErasing")
        self.ratio = _range(ratio, "ratio", "RandomErasing")
        if not 0.0 <= self.scale[0] <= self.scale[1] <= 1.0:
            raise errors.ConfigError(f"RandomErasing: scale {scale!r} must satisfy 0 <= min <= max <= 1")
        if not 0.0 < self.ratio[0] <= self.ratio[1]:
            raise errors.ConfigError(f"RandomErasing: ratio {ratio!r} must satisfy 0 < min <= max")
        self.value: Union[str, Tuple[float, float, float]]
        if isinstance(value, str):
            if value != "random":
                raise errors.ConfigError(f"RandomErasing: value {value!r} must be a number, 3 numbers or 'random'")
            self.value = "random"
        else:
            values = [float(value)] if isinstance(value, (int, float)) else [float(v) for v in value]
            if len(values) not in (1, 3) or not all(math.isfinite(v) for v in values):
                raise errors.ConfigError(f"RandomErasing: value {value!r} must be a number, 3 numbers or 'random'")
            v = values if len(values) == 3 else values * 3
            self.value = (v[0], v[1], v[2])

    def _apply(self, spec: Dict[str, Any]) -> None:
        spec["erase"] = {"p": self.p, "scale": self.scale, "ratio": self.ratio, "value": self.value}


MAX_PIXEL_STEPS = 8


def _pixel_step(spec: Dict[str, Any], step: Dict[str, Any]) -> None:
    """Appends a step on the cropped and flipped image's pixels, in the order listed."""
    steps = spec.setdefault("pixel_steps", [])
    if len(steps) == MAX_PIXEL_STEPS:
        raise errors.ConfigError(
            f"at most {MAX_PIXEL_STEPS} augmentation, ColorJitter, RandomGrayscale and GaussianBlur steps"
        )
    steps.append(step)


def _nearest_only(mode: Any, what: str) -> None:
    """The automatic augmentations sample with nearest neighbours (torchvision's default)."""
    if getattr(mode, "value", mode) != "nearest":
        raise errors.ConfigError(
            f"{what}: interpolation {mode!r} is not supported: the loader's geometric ops "
            "sample nearest neighbours, torchvision's default for this step"
        )


def _fill(fill: Union[int, Sequence[int], None], what: str) -> Tuple[int, int, int]:
    """torchvision's ``fill`` (None: black; one int or three) as an RGB triple."""
    if fill is None:
        return (0, 0, 0)
    if isinstance(fill, numbers.Number) or isinstance(fill, (str, bytes)):
        values: List[Any] = [fill]
    elif isinstance(fill, (list, tuple)) or type(fill).__name__ == "ndarray":
        values = list(fill)  # type: ignore[arg-type]
    else:
        # A set has no order, a dict's keys are not colours.
        raise errors.ConfigError(f"{what}: fill {fill!r} must be an int in 0..255 or three of them")
    ints: List[int] = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) <= 255:
            raise errors.ConfigError(f"{what}: fill {fill!r} must be an int in 0..255 or three of them")
        ints.append(operator.index(value))
    if len(ints) not in (1, 3):
        raise errors.ConfigError(f"{what}: fill {fill!r} must be an int in 0..255 or three of them")
    v = ints * 3 if len(ints) == 1 else ints
    return (v[0], v[1], v[2])


def _bins(num_magnitude_bins: int, what: str) -> int:
    if isinstance(num_magnitude_bins, bool) or not isinstance(num_magnitude_bins, int) or not (
        2 <= num_magnitude_bins <= 1 << 16
    ):
        raise errors.ConfigError(f"{what}: num_magnitude_bins {num_magnitude_bins!r} must be an int in 2..65536")
    return num_magnitude_bins


class _Augmentation(_Step):
    """An automatic augmentation: it runs on the cropped, resized and flipped image."""

    def _augment(self) -> Dict[str, Any]:  # pragma: no cover - every augmentation overrides it
        raise NotImplementedError

    def _apply(self, spec: Dict[str, Any]) -> None:
        _pixel_step(spec, dict(self._augment(), kind="augment"))


class AutoAugment(_Augmentation):
    """torchvision ``AutoAugment(policy)``: one of the policy's 25 learned pairs of ops, each
    applied with its probability and magnitude. ``policy`` is ``"imagenet"`` (the default),
    ``"cifar10"`` or ``"svhn"``, or torchvision's ``AutoAugmentPolicy``.

    The ops are PIL's (what torchvision runs on the PIL images of its recipes), sampling with
    nearest neighbours; ``fill`` colours the pixels the geometric ops move in (black by default).
    """

    def __init__(
        self,
        policy: Any = "imagenet",
        interpolation: Any = "nearest",
        fill: Union[int, Sequence[int], None] = None,
    ):
        name = getattr(policy, "value", policy)
        if name not in ("imagenet", "cifar10", "svhn"):
            raise errors.ConfigError(f"AutoAugment: policy {policy!r} must be imagenet, cifar10 or svhn")
        _nearest_only(interpolation, "AutoAugment")
        self.policy = str(name)
        self.fill = _fill(fill, "AutoAugment")

    def _augment(self) -> Dict[str, Any]:
        return {"policy": self.policy, "fill": self.fill}


class RandAugment(_Augmentation):
    """torchvision ``RandAugment(num_ops, magnitude, num_magnitude_bins)``: ``num_ops`` ops drawn
    uniformly from the 14, each at bin ``magnitude`` of its table, with a random sign."""

    def __init__(
        self,
        num_ops: int = 2,
        magnitude: int = 9,
        num_magnitude_bins: int = 31,
        interpolation: Any = "nearest",
        fill: Union[int, Sequence[int], None] = None,
    ):
        self.num_magnitude_bins = _bins(num_magnitude_bins, "RandAugment")
        if isinstance(num_ops, bool) or not isinstance(num_ops, int) or not 0 <= num_ops <= 64:
            raise errors.ConfigError(f"RandAugment: num_ops {num_ops!r} must be an int in 0..64")
        if isinstance(magnitude, bool) or not isinstance(magnitude, int) or not 0 <= magnitude < num_magnitude_bins:
            raise errors.ConfigError(
                f"RandAugment: magnitude {magnitude!r} must be an int below num_magnitude_bins ({num_magnitude_bins})"
            )
        _nearest_only(interpolation, "RandAugment")
        self.num_ops = num_ops
        self.magnitude = magnitude
        self.fill = _fill(fill, "RandAugment")

    def _augment(self) -> Dict[str, Any]:
        return {
            "policy": "rand_augment",
            "num_ops": self.num_ops,
            "magnitude": self.magnitude,
            "num_magnitude_bins": self.num_magnitude_bins,
            "fill": self.fill,
        }


class TimmRandAugment(_Step):
    """timm's RandAugment, as ``timm.data.rand_augment_transform(config_str, hparams)`` builds it:
    the augmentation of timm's recipes (DeiT, ConvNeXt, Swin: ``"rand-m9-mstd0.5-inc1"``), with
    timm's own 15 ops and level functions (not torchvision's ``RandAugment``).

    Parameters
    ----------
    config_str : str
        timm's config: ``"rand"`` then ``-``-separated sections ``m`` (magnitude, 0..10 scale),
        ``n`` (ops per image, default 2), ``p`` (each op's probability, default 0.5), ``mstd``
        (magnitude noise: normal standard deviation, or uniform in 0..m above 100), ``mmax``
        (magnitude ceiling, default 10), ``inc`` (1: the level functions that grow with the
        magnitude). Transform sets (``t...``) are not supported.
    fill : int or (int, int, int)
        The colour moved-in pixels take: timm passes the normalization mean in 0..255
        (``img_mean``; ``(124, 116, 104)`` for ImageNet's, the default here).
    interpolation : {"random", "bilinear", "bicubic"}
        How the geometric ops sample: ``"random"`` (timm's default) draws one of the two per op.
    """

    def __init__(
        self,
        config_str: str = "rand-m9-mstd0.5-inc1",
        fill: Union[int, Sequence[int]] = (124, 116, 104),
        interpolation: Any = "random",
    ):
        _timm_config(config_str)
        name = getattr(interpolation, "value", interpolation)
        if name not in ("random", "nearest", "bilinear", "bicubic"):
            raise errors.ConfigError(
                f"TimmRandAugment: interpolation {interpolation!r} is none of random, nearest, bilinear, bicubic"
            )
        self.config_str = config_str
        self.fill = _fill(fill, "TimmRandAugment")
        self.interpolation = str(name)

    def _apply(self, spec: Dict[str, Any]) -> None:
        _pixel_step(
            spec,
            {
                "kind": "timm_rand_augment",
                "config": self.config_str,
                "fill": self.fill,
                "interpolation": self.interpolation,
            },
        )


def _timm_config(config: Any) -> None:
    """Checks a timm RandAugment config as the loader will read it (the loader's own parser):
    a ``ConfigError``, a ``ValueError``, naming what is wrong."""
    if not isinstance(config, str):
        raise errors.ConfigError(f"TimmRandAugment: config {config!r} must be a string such as 'rand-m9-mstd0.5-inc1'")
    _native._check_timm_config(config)


class TrivialAugmentWide(_Augmentation):
    """torchvision ``TrivialAugmentWide(num_magnitude_bins)``: one op drawn uniformly from the
    14, at a uniformly drawn bin of its wide table, with a random sign. The augmentation of
    torchvision's current classification recipe."""

    def __init__(
        self,
        num_magnitude_bins: int = 31,
        interpolation: Any = "nearest",
        fill: Union[int, Sequence[int], None] = None,
    ):
        self.num_magnitude_bins = _bins(num_magnitude_bins, "TrivialAugmentWide")
        _nearest_only(interpolation, "TrivialAugmentWide")
        self.fill = _fill(fill, "TrivialAugmentWide")

    def _augment(self) -> Dict[str, Any]:
        return {
            "policy": "trivial_augment_wide",
            "num_magnitude_bins": self.num_magnitude_bins,
            "fill": self.fill,
        }


def _jitter_range(
    value: Union[float, Sequence[float]], name: str, center: float, bound: Tuple[float, float]
) -> Optional[Tuple[float, float]]:
    """torchvision's ``ColorJitter._check_input``: a number ``x`` is ``[center - x, center + x]``
    (clipped at 0 for the factors), a pair is the range; the range of only ``center`` is off."""
    if isinstance(value, bool):
        raise TypeError(f"ColorJitter: {name} must be a number or a (min, max) pair, not a bool")
    if isinstance(value, numbers.Real):
        if value < 0:
            raise errors.ConfigError(f"ColorJitter: {name} {value!r} must be non-negative")
        low, high = center - float(value), center + float(value)
        if center == 1.0:
            low = max(low, 0.0)
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        low, high = (_real(v, f"ColorJitter: {name}") for v in value)
    else:
        raise TypeError(f"ColorJitter: {name} must be a number or a (min, max) pair, not {value!r}")
    if not (bound[0] <= low <= high <= bound[1]) or not math.isfinite(high):
        raise errors.ConfigError(f"ColorJitter: {name} range ({low}, {high}) must be ordered within {bound}")
    return None if low == high == center else (low, high)


class ColorJitter(_Step):
    """torchvision ``ColorJitter(brightness, contrast, saturation, hue)``: the four adjustments
    in a random order, each factor uniform in its range, with PIL's arithmetic (as torchvision
    runs it on PIL images). A pixel step: it runs where it is listed (see :class:`Compose`)."""

    def __init__(
        self,
        brightness: Union[float, Sequence[float]] = 0,
        contrast: Union[float, Sequence[float]] = 0,
        saturation: Union[float, Sequence[float]] = 0,
        hue: Union[float, Sequence[float]] = 0,
    ):
        inf = float("inf")
        self.brightness = _jitter_range(brightness, "brightness", 1.0, (0.0, inf))
        self.contrast = _jitter_range(contrast, "contrast", 1.0, (0.0, inf))
        self.saturation = _jitter_range(saturation, "saturation", 1.0, (0.0, inf))
        self.hue = _jitter_range(hue, "hue", 0.0, (-0.5, 0.5))
        self.p = 1.0

    def _apply(self, spec: Dict[str, Any]) -> None:
        _pixel_step(spec, {
            "kind": "color_jitter",
            "brightness": self.brightness,
            "contrast": self.contrast,
            "saturation": self.saturation,
            "hue": self.hue,
            "p": self.p,
        })


class GaussianBlur(_Step):
    """torchvision ``GaussianBlur(kernel_size, sigma=(0.1, 2.0))``: sigma drawn uniformly, the
    image convolved with the normalized Gaussian after reflect padding (torchvision's tensor
    arithmetic, as it runs on PIL images too): within one level of torchvision's. ``kernel_size``
    is odd, one int or ``(width, height)``. A pixel step: it runs where it is listed (see
    :class:`Compose`)."""

    def __init__(self, kernel_size: Union[int, Sequence[int]], sigma: Union[float, Sequence[float]] = (0.1, 2.0)):
        sizes = [kernel_size] * 2 if isinstance(kernel_size, int) else list(kernel_size)
        if len(sizes) != 2 or any(
            isinstance(k, bool) or not isinstance(k, int) or k <= 0 or k % 2 == 0 or k > 1024 for k in sizes
        ):
            raise errors.ConfigError(
                f"GaussianBlur: kernel_size {kernel_size!r} must be odd and positive (at most 1024)"
            )
        if isinstance(sigma, (int, float)) and not isinstance(sigma, bool):
            if not 0 < sigma < math.inf:
                raise errors.ConfigError(f"GaussianBlur: sigma {sigma!r} must be positive")
            low = high = float(sigma)
        elif isinstance(sigma, (tuple, list)) and len(sigma) == 2:
            low, high = float(sigma[0]), float(sigma[1])
            if not 0.0 < low <= high < math.inf:
                raise errors.ConfigError(f"GaussianBlur: sigma {sigma!r} must be (min, max) with 0 < min <= max")
        else:
            raise errors.ConfigError(f"GaussianBlur: sigma {sigma!r} must be a number or a (min, max) pair")
        self.kernel_size = (sizes[0], sizes[1])
        self.sigma = (low, high)
        self.p = 1.0

    def _apply(self, spec: Dict[str, Any]) -> None:
        _pixel_step(spec, {"kind": "blur", "kernel": self.kernel_size, "sigma": self.sigma, "p": self.p})


class RandomApply(_Step):
    """torchvision ``RandomApply(transforms, p)``, for one :class:`ColorJitter` or one
    :class:`GaussianBlur` (SimCLR's and BYOL's ``RandomApply([ColorJitter(...)], p=0.8)``,
    ``RandomApply([GaussianBlur(23)], p=0.5)``); anything else is refused."""

    def __init__(self, transforms: Sequence[_Step], p: float = 0.5):
        steps = list(transforms)
        if len(steps) != 1 or not isinstance(steps[0], (ColorJitter, GaussianBlur)):
            raise errors.ConfigError(
                "RandomApply: the loader applies only [ColorJitter(...)] or [GaussianBlur(...)] with a probability"
            )
        if not 0.0 <= float(p) <= 1.0:
            raise errors.ConfigError(f"RandomApply: p {p!r} must be in [0, 1]")
        step = copy.copy(steps[0])
        step.p = float(p)
        self.step: Union[ColorJitter, GaussianBlur] = step

    def _apply(self, spec: Dict[str, Any]) -> None:
        self.step._apply(spec)


class RandomGrayscale(_Step):
    """torchvision ``RandomGrayscale(p)``: with probability ``p`` PIL's gray in all three
    channels. A pixel step: it runs where it is listed (see :class:`Compose`)."""

    def __init__(self, p: float = 0.1):
        if not 0.0 <= _real(p, "RandomGrayscale: p") <= 1.0:
            raise errors.ConfigError(f"RandomGrayscale: p {p!r} must be in [0, 1]")
        self.p = float(p)

    def _apply(self, spec: Dict[str, Any]) -> None:
        _pixel_step(spec, {"kind": "grayscale", "p": self.p})


class Normalize(_Step):
    """torchvision ``Normalize(mean, std)`` after ``ToTensor`` (statistics on the 0..1 scale)."""

    def __init__(self, mean: Union[float, Sequence[float]], std: Union[float, Sequence[float]]):
        # One number stands for all three channels, as torchvision's broadcast reads it.
        means: Sequence[float] = (mean,) * 3 if isinstance(mean, numbers.Real) else mean  # type: ignore[assignment]
        stds: Sequence[float] = (std,) * 3 if isinstance(std, numbers.Real) else std  # type: ignore[assignment]
        mean, std = means, stds
        if len(mean) != 3 or len(std) != 3:
            raise errors.ConfigError("Normalize: mean and std need three values (RGB)")
        if not all(math.isfinite(float(m)) for m in mean):
            raise errors.ConfigError(f"Normalize: mean {tuple(mean)!r} must be finite")
        if not all(math.isfinite(float(s)) and float(s) >= 1e-6 for s in std):
            raise errors.ConfigError(f"Normalize: std {tuple(std)!r} must be finite and at least 1e-6")
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)

    def _apply(self, spec: Dict[str, Any]) -> None:
        spec.update(mean=self.mean, std=self.std)


class Transform:
    """A whole per-sample transform; build one with :class:`Compose` or a preset."""

    def __init__(self, spec: Dict[str, Any], name: str):
        self._spec = dict(spec)
        self._name = name

    def spec(self) -> Dict[str, Any]:
        """The description the Rust loader takes."""
        return dict(self._spec)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Transform) and self._spec == other._spec

    def __repr__(self) -> str:
        return self._name


def _is_geometry(step: _Step) -> bool:
    return isinstance(step, (Resize, CenterCrop, RandomCrop, RandomResizedCrop))


class Compose(Transform):
    """A chain of steps, run in the order listed, as torchvision's ``Compose``: at most one
    geometry (``Resize`` [+ ``CenterCrop``], ``CenterCrop``, ``RandomCrop`` or
    ``RandomResizedCrop``), ``RandomHorizontalFlip``, and up to 8 pixel steps before or after the
    geometry: ``AutoAugment``, ``RandAugment``, ``TrivialAugmentWide``, ``ColorJitter``,
    ``RandomGrayscale``, ``GaussianBlur`` (the last two kinds also inside ``RandomApply([...],
    p)``). ``Normalize`` and ``RandomErasing`` may be listed anywhere (they apply to the finished
    image, as torchvision's do after ``ToTensor``).

    Pixel steps listed before the geometry run on the whole decoded image (which is then decoded
    at full size: slower than after it, as in torchvision). The flip runs where it is listed,
    except that it cannot cross an automatic augmentation (whose shears, translations and
    rotations do not commute with it) on the same side of the geometry: ``[TrivialAugmentWide(),
    RandomHorizontalFlip()]`` after the crop is refused, list the flip first."""

    def __init__(self, steps: Sequence[_Step]):
        spec: Dict[str, Any] = {"geometry": "native", "hflip": 0.0}
        before_geometry: Optional[int] = None  # pixel steps listed before the geometry
        flip_at: Optional[int] = None  # the flip's place among the pixel steps
        flip_before_geometry = False
        seen_once: Set[type] = set()
        for step in steps:
            if not isinstance(step, _Step):
                raise TypeError(
                    f"{step!r} is not an imagefeed transform step; the loader runs only "
                    "Resize, CenterCrop, RandomCrop, RandomResizedCrop, RandomHorizontalFlip, "
                    "AutoAugment, RandAugment, TrivialAugmentWide, TimmRandAugment, ColorJitter, RandomApply, "
                    "RandomGrayscale, GaussianBlur, Normalize and RandomErasing "
                    "(for arbitrary Python transforms use imagefeed.Dataset with a DataLoader)"
                )
            once = (RandomHorizontalFlip, Normalize, RandomErasing)
            kind = next((k for k in once if isinstance(step, k)), None)
            if kind is not None:
                if kind in seen_once:
                    raise errors.ConfigError(
                        f"a second {kind.__name__}: the loader runs it once per sample "
                        "(two flips would cancel, two normalizations compound in torchvision); "
                        "list it once"
                    )
                seen_once.add(kind)
            listed = len(spec.get("pixel_steps", []))
            if _is_geometry(step):
                if before_geometry is not None and listed != before_geometry:
                    raise errors.ConfigError(
                        f"{type(step).__name__} after a pixel step that follows the Resize: the "
                        "loader resizes and crops in one step, list the pixel steps before or after both"
                    )
                before_geometry = listed
                flip_before_geometry = flip_at is not None
            elif isinstance(step, RandomHorizontalFlip):
                flip_at = listed
            step._apply(spec)
        pixel = spec.pop("pixel_steps", [])
        moving = [i for i, s in enumerate(pixel) if s["kind"] in ("augment", "timm_rand_augment")]
        if before_geometry is None:
            # No geometry: the flip goes before the pixel steps (the fast form) unless an
            # automatic augmentation is listed before it; then after them all.
            before_geometry = len(pixel) if flip_at is not None and any(i < flip_at for i in moving) else 0
            flip_before_geometry = before_geometry > 0
        if flip_at is not None:
            # The loader flips right before the geometry, or right after it.
            lo, hi = (flip_at, before_geometry) if flip_before_geometry else (before_geometry, flip_at)
            if any(lo <= i < hi for i in moving):
                raise errors.ConfigError(
                    "RandomHorizontalFlip and an automatic augmentation are listed in an order the "
                    "loader cannot run (the flip happens right before or right after the crop): "
                    "list the flip next to the crop"
                )
        if pixel[:before_geometry]:
            spec["before_geometry"] = pixel[:before_geometry]
        if pixel[before_geometry:]:
            spec["pixel_steps"] = pixel[before_geometry:]
        if flip_before_geometry and spec["hflip"] > 0:
            spec["flip_before_geometry"] = True
        super().__init__(spec, f"Compose({list(steps)!r})")


class BatchTransform:
    """A step on the finished batch (``imagefeed.Loader(batch_transform=...)``): :class:`MixUp`,
    :class:`CutMix`, or :class:`RandomChoice` of the two."""

    def spec(self) -> Dict[str, Any]:  # pragma: no cover - every batch step overrides it
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchTransform) and self.spec() == other.spec()

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def _real(value: Any, what: str) -> float:
    """A real number (Python's or NumPy's; not a bool or a string) as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number, not {value!r}")
    return float(value)


def _integer(value: Any, what: str) -> int:
    """An integer (Python's or NumPy's; not a bool) as an int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, not {value!r}")
    return operator.index(value)


def _alpha(alpha: float, what: str) -> float:
    value = _real(alpha, f"{what}: alpha")
    if not 0 < value <= 1e12:
        raise errors.ConfigError(f"{what}: alpha {alpha!r} must be positive and at most 1e12")
    return value


def _classes(num_classes: Optional[int], what: str) -> Optional[int]:
    if num_classes is None:
        return None
    value = _integer(num_classes, f"{what}: num_classes")
    if not 1 <= value <= 1 << 20:
        raise errors.ConfigError(f"{what}: num_classes {num_classes!r} must be in 1..1048576 (or None)")
    return value


class MixUp(BatchTransform):
    """torchvision ``transforms.v2.MixUp(alpha, num_classes)`` on each batch: every image blended
    with the one before it in the batch (``roll(1, 0)``), ``lam ~ Beta(alpha, alpha)`` per
    batch, and the labels become ``float32 [n, num_classes]`` probabilities mixed the same way.
    ``num_classes=None`` takes the dataset's class count."""

    def __init__(self, *, alpha: float = 1.0, num_classes: Optional[int] = None):
        self.alpha = _alpha(alpha, "MixUp")
        self.num_classes = _classes(num_classes, "MixUp")

    def spec(self) -> Dict[str, Any]:
        return {"mixup_alpha": self.alpha, "cutmix_alpha": None, "num_classes": self.num_classes}


class CutMix(BatchTransform):
    """torchvision ``transforms.v2.CutMix(alpha, num_classes)`` on each batch: a box of the image
    before it in the batch pasted into every image (its sides ``sqrt(1 - lam)`` of the image's,
    ``lam ~ Beta(alpha, alpha)``), the labels mixed by the pasted area."""

    def __init__(self, *, alpha: float = 1.0, num_classes: Optional[int] = None):
        self.alpha = _alpha(alpha, "CutMix")
        self.num_classes = _classes(num_classes, "CutMix")

    def spec(self) -> Dict[str, Any]:
        return {"mixup_alpha": None, "cutmix_alpha": self.alpha, "num_classes": self.num_classes}


class RandomChoice(BatchTransform):
    """torchvision ``transforms.v2.RandomChoice([MixUp(...), CutMix(...)])``, as its
    classification reference uses it: one of the two, with equal odds, for each batch."""

    def __init__(self, transforms: Sequence[BatchTransform], p: Optional[Sequence[float]] = None):
        steps = list(transforms)
        mixups = [s for s in steps if isinstance(s, MixUp)]
        cutmixes = [s for s in steps if isinstance(s, CutMix)]
        if len(steps) != 2 or len(mixups) != 1 or len(cutmixes) != 1:
            raise errors.ConfigError("RandomChoice: the loader chooses only between one MixUp and one CutMix")
        if p is not None and (
            len(p) != 2 or not 0 < float(p[0]) < math.inf or float(p[0]) != float(p[1])
        ):
            raise errors.ConfigError(f"RandomChoice: p {p!r}: only equal, positive odds are supported")
        if mixups[0].num_classes != cutmixes[0].num_classes:
            raise errors.ConfigError("RandomChoice: MixUp and CutMix must have the same num_classes")
        self.mixup, self.cutmix = mixups[0], cutmixes[0]

    def spec(self) -> Dict[str, Any]:
        return {
            "mixup_alpha": self.mixup.alpha,
            "cutmix_alpha": self.cutmix.alpha,
            "num_classes": self.mixup.num_classes,
        }


def imagenet_mixup_cutmix(mixup_alpha: float = 0.2, cutmix_alpha: float = 1.0) -> BatchTransform:
    """The batch step of torchvision's classification reference (``--mixup-alpha 0.2
    --cutmix-alpha 1.0``): ``RandomChoice([MixUp(alpha=0.2), CutMix(alpha=1.0)])``.

    Parameters
    ----------
    mixup_alpha, cutmix_alpha : float, default 0.2 and 1.0
        :class:`MixUp`'s and :class:`CutMix`'s Beta-distribution alphas.

    Returns
    -------
    BatchTransform
        What :class:`~imagefeed.Loader` takes as ``batch_transform``.
    """
    return RandomChoice([MixUp(alpha=mixup_alpha), CutMix(alpha=cutmix_alpha)])


def none() -> Transform:
    """Decode only: native size (every image of a batch must then have the same size)."""
    return Compose([])


def cifar_train() -> Transform:
    """CIFAR training as torchvision's tutorials and most papers do it: ``RandomCrop(32,
    padding=4)``, random flip, CIFAR-10 normalization."""
    return Compose(
        [RandomCrop(32, padding=4), RandomHorizontalFlip(0.5), Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    )


def imagenet_train(
    size: int = 224,
    *,
    auto_augment: Optional[str] = None,
    random_erase: float = 0.0,
    interpolation: Any = "bilinear",
    ra_magnitude: Optional[int] = None,
    mixup: float = 0.0,
    cutmix: float = 0.0,
) -> Transform:
    """ImageNet training as torchvision's classification reference (``ClassificationPresetTrain``)
    builds it: ``RandomResizedCrop(size, interpolation)``, random flip, then the automatic
    augmentation ``auto_augment`` names (``"ta_wide"``: :class:`TrivialAugmentWide`, ``"ra"``:
    :class:`RandAugment` at ``ra_magnitude`` (default 9), ``"imagenet"``, ``"cifar10"``, ``"svhn"``:
    :class:`AutoAugment`; a timm config such as ``"rand-m9-mstd0.5-inc1"``:
    :class:`TimmRandAugment`; None: none), ImageNet normalization, and :class:`RandomErasing` with
    probability ``random_erase`` when it is above 0.

    ``mixup`` and ``cutmix`` above 0 add the reference's batch step (its ``--mixup-alpha``,
    ``--cutmix-alpha``): :class:`MixUp` and/or :class:`CutMix` with those alphas, one of them
    for each batch when both are set, over the dataset's classes; the loader's labels are then
    ``float32 [n, classes]``.

    With the defaults, ``RandomResizedCrop(size)``, flip and normalization: the classic recipe.
    The reference's current recipe is ``imagenet_train(176, auto_augment="ta_wide",
    random_erase=0.1, mixup=0.2, cutmix=1.0)``.

    Parameters
    ----------
    size : int, default 224
        The crop's output side.
    auto_augment : str, optional
        ``"ta_wide"``, ``"ra"``, ``"imagenet"``, ``"cifar10"``, ``"svhn"`` or a timm
        RandAugment config; None for no automatic augmentation.
    random_erase : float, default 0.0
        :class:`RandomErasing`'s probability (0: no erasing).
    interpolation : str or torchvision InterpolationMode, default "bilinear"
        The crop's resampling (``"bilinear"``, ``"bicubic"``, ``"nearest"``).
    ra_magnitude : int, optional
        :class:`RandAugment`'s magnitude for ``auto_augment="ra"`` (default 9).
    mixup, cutmix : float, default 0.0
        The batch step's alphas (0: off).

    Returns
    -------
    Transform
        What :class:`~imagefeed.Loader` takes as ``transform``.
    """
    for name, value, top in (("mixup", mixup, 1e12), ("cutmix", cutmix, 1e12), ("random_erase", random_erase, 1.0)):
        if not 0.0 <= _real(value, f"imagenet_train: {name}") <= top:
            raise errors.ConfigError(f"imagenet_train: {name} {value!r} must be in 0..{top:g} (0: off)")
    steps: List[_Step] = [RandomResizedCrop(size, interpolation=interpolation), RandomHorizontalFlip(0.5)]
    if auto_augment == "ta_wide":
        steps.append(TrivialAugmentWide())
    elif auto_augment == "ra":
        steps.append(RandAugment(magnitude=9 if ra_magnitude is None else ra_magnitude))
    elif auto_augment in ("imagenet", "cifar10", "svhn"):
        steps.append(AutoAugment(auto_augment))
    elif isinstance(auto_augment, str) and auto_augment.split("-")[0] == "rand":
        # timm's create_transform: its RandAugment, filling with the normalization mean and
        # sampling as the crop does (timm passes a non-random interpolation on).
        if ra_magnitude is not None:
            raise errors.ConfigError("imagenet_train: ra_magnitude is for 'ra'; a timm config gives its own ('m9')")
        steps.append(
            TimmRandAugment(
                auto_augment,
                fill=tuple(min(255, round(255 * m)) for m in IMAGENET_MEAN),
                interpolation=steps[0].interpolation,  # type: ignore[attr-defined]
            )
        )
    elif auto_augment is not None:
        raise errors.ConfigError(
            f"imagenet_train: auto_augment {auto_augment!r} must be None, 'ta_wide', 'ra', "
            "'imagenet', 'cifar10', 'svhn' or a timm RandAugment config ('rand-m9-mstd0.5-inc1'; "
            "torchvision's 'augmix' is not supported)"
        )
    steps.append(Normalize(IMAGENET_MEAN, IMAGENET_STD))
    if random_erase > 0:
        steps.append(RandomErasing(p=random_erase))
    composed = Compose(steps)
    batch: Optional[BatchTransform] = None
    if mixup > 0 and cutmix > 0:
        batch = RandomChoice([MixUp(alpha=mixup), CutMix(alpha=cutmix)])
    elif mixup > 0:
        batch = MixUp(alpha=mixup)
    elif cutmix > 0:
        batch = CutMix(alpha=cutmix)
    if batch is None:
        return composed
    return Transform(dict(composed.spec(), batch_mix=batch.spec()), f"{composed!r} + {batch!r}")


def imagenet_eval(size: int = 224, resize: int = 256) -> Transform:
    """ImageNet evaluation: ``Resize(resize)``, ``CenterCrop(size)``, ImageNet normalization.

    Parameters
    ----------
    size : int, default 224
        The center crop's side.
    resize : int, default 256
        The shorter side after the resize, before the crop.

    Returns
    -------
    Transform
        What :class:`~imagefeed.Loader` takes as ``transform``.
    """
    return Compose([Resize(resize), CenterCrop(size), Normalize(IMAGENET_MEAN, IMAGENET_STD)])
