"""imagefeed: feeds images to PyTorch training fast, reproducibly, and without crashing on bad data.

::

    import imagefeed
    loader = imagefeed.Loader("train.lmdb", batch_size=256, workers=8, seed=0,
                              transform=imagefeed.transforms.imagenet_train(224))
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:
            ...

- :class:`Loader`: batches built by Rust worker threads, handed over as zero-copy tensors, with
  exact mid-epoch resume (``state_dict``) and bad-sample reports.
- :class:`Dataset`: a map-style dataset for existing ``DataLoader`` pipelines.
- :func:`pack`, :func:`inspect`, :func:`verify`: packing and checking, as ``pack-dataset`` does.
- :mod:`imagefeed.transforms`, :mod:`imagefeed.errors`, :mod:`imagefeed.reports` (the typed
  shapes of the reports returned as dicts).
"""

from . import errors, reports, transforms
from ._native import __version__
from .dataset import Dataset
from .errors import *  # noqa: F403 - the exception classes, listed in errors.__all__
from .loader import DEFAULT_MAX_BAD, BadSample, Loader
from .packing import inspect, join, pack, synthesize, verify
from .views import LoaderDataset, LoaderSampler

__all__ = [
    "__version__",
    "Loader",
    "BadSample",
    "DEFAULT_MAX_BAD",
    "Dataset",
    "LoaderDataset",
    "LoaderSampler",
    "pack",
    "join",
    "inspect",
    "verify",
    "synthesize",
    "transforms",
    "errors",
    "reports",
    *errors.__all__,
]
