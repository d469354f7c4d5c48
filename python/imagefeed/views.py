"""``Loader.dataset`` and ``Loader.sampler``: the views of a loader that PyTorch training scripts
reach for (``len(loader.dataset)``, ``loader.sampler.set_epoch``, exact distributed evaluation of
the samples a sampler left out)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

from . import _native, errors
from ._reading import ImageFolderListing, labelled_listing, sample_index

if TYPE_CHECKING:
    from .loader import Loader

__all__ = ["LoaderDataset", "LoaderSampler"]


class LoaderSampler:
    """Which samples an epoch gives this rank, with the attributes of PyTorch's
    ``DistributedSampler``.

    ``len(sampler)`` is the number of samples an epoch gives this rank (padding included under
    ``uneven="pad"``; under ``uneven="exact"`` the first ``len(dataset) % world_size`` ranks
    get one more than the rest); iterating gives their dataset indices, in the order the
    epoch's batches hold them (before bad-sample replacement), for the loader's
    :attr:`~imagefeed.Loader.epoch`. After :meth:`~imagefeed.Loader.load_state_dict` restored
    a position inside that epoch, the loop gives only the rest of this list; a state saved at
    another world size or batch size deals out again only the samples no rank had been given,
    and the list is then that part of the epoch (what the loop gives, whole). ``set_epoch`` is
    the loader's.
    """

    def __init__(self, loader: "Loader"):
        self._loader = loader

    def __len__(self) -> int:
        self._loader._check_ranks(settle=False)
        return self._loader._native.samples_per_rank(self._loader.epoch, self._loader._continuing())

    def __iter__(self) -> Iterator[int]:
        self._loader._check_ranks(settle=False)
        return iter(self._loader._native.rank_indices(self._loader.epoch, self._loader._continuing()))

    def set_epoch(self, epoch: int) -> None:
        """The loader's :meth:`~imagefeed.Loader.set_epoch`."""
        self._loader.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The epoch of the loop in progress, else the one the next loop runs."""
        return self._loader.epoch

    @property
    def num_samples(self) -> int:
        """``len(sampler)``, as ``DistributedSampler`` names it."""
        return len(self)

    @property
    def num_replicas(self) -> int:
        """The world size."""
        self._loader._check_ranks(settle=False)
        return self._loader.world_size

    @property
    def rank(self) -> int:
        """This process's rank."""
        self._loader._check_ranks(settle=False)
        return self._loader.rank

    @property
    def total_size(self) -> int:
        """Samples an epoch gives all ranks together: the dataset's length under
        ``uneven="exact"``, a multiple of the world size under ``"pad"`` and ``"drop"``."""
        loader = self._loader
        if loader._native_args["uneven"] == "exact":
            return loader.num_samples
        return len(self) * self.num_replicas

    @property
    def shuffle(self) -> bool:
        """Whether each epoch is shuffled."""
        return bool(self._loader._native_args["shuffle"])

    @property
    def seed(self) -> int:
        """The loader's seed."""
        return self._loader.seed

    @property
    def drop_last(self) -> bool:
        """True when the samples that do not divide between ranks are dropped
        (``uneven="drop"``), as ``DistributedSampler(drop_last=True)``."""
        return bool(self._loader._native_args["uneven"] == "drop")

    def __repr__(self) -> str:
        return (
            f"imagefeed.LoaderSampler(rank {self.rank}/{self.num_replicas}, {len(self)} samples, "
            f"uneven={self._loader._native_args['uneven']!r}, epoch {self.epoch})"
        )


class LoaderDataset(ImageFolderListing):
    """The loader's samples one at a time: ``dataset[i]`` is ``(image, label)`` with ``image``
    exactly the slot the loader's batches give sample ``i`` in the current epoch (the same
    transform, random draws, dtype and layout; a CPU tensor, or a NumPy array when the loader
    does not give torch tensors) and ``label`` an ``int``. So
    ``DataLoader(Subset(loader.dataset, rest))`` evaluates the samples a sampler left out with
    the loader's own pixels, as pytorch/examples' ImageNet script does.

    ``classes``, ``class_to_idx``, ``samples``, ``imgs`` and ``targets`` are
    ``torchvision.datasets.ImageFolder``'s: ``samples`` lists ``(path, label)`` (for a packed
    file, the key each record was packed from). Listing them for a packed file reads every
    record once (for one in object storage, that downloads it); an image folder lists them
    without reading a file.

    The view is picklable and fork-safe (each process opens the dataset itself); a pickled copy
    keeps the epoch it was pickled in. Bad samples follow the loader's policy: ``"replace"``
    gives the replacement, ``"skip"`` raises :class:`~imagefeed.errors.BadSampleError`.
    """

    def __init__(self, loader: "Loader"):
        self._loader: Optional["Loader"] = loader
        self._paths = loader._paths
        self._len = loader.num_samples
        self.classes: List[str] = list(loader.classes)
        self.class_to_idx: Dict[str, int] = {name: i for i, name in enumerate(self.classes)}
        self._torch_output = loader._output == "torch"
        self._epoch = loader.epoch
        self._seed = loader.seed
        self._args = dict(loader._native_args)
        # One sample at a time in the calling thread, with the transform as given (a CUDA
        # loader's GPU normalization included), in heap memory.
        spec = loader.transform.spec()
        self._args.update(
            batch_size=1, workers=0, prefetch=1, transform=spec, dtype=loader._dtype,
            layout=loader._layout, pinned_device=None, max_bad=None,
        )
        self._native: Optional[_native.NativeLoader] = None
        self._pid: Optional[int] = None
        self._listing: Optional[List[Tuple[str, int]]] = None

    def _handle(self) -> "_native.NativeLoader":
        loader = self._loader
        if loader is not None and loader.seed != self._seed:
            self._seed, self._native = loader.seed, None  # a state restored another seed
        if self._native is None or self._pid != os.getpid():
            args = dict(self._args, seed=self._seed)
            with errors.arguments("Loader.dataset"):
                self._native = _native.NativeLoader(self._paths, rank=0, world_size=1, **args)
            self._pid = os.getpid()
        return self._native

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Tuple[Any, int]:
        index = sample_index(index, self._len) % self._len
        epoch = self._loader.epoch if self._loader is not None else self._epoch
        images, labels, samples, bad = self._handle().build_batch(epoch, [index])
        if not samples:
            # A skipped sample: the batch came back empty, its report says why.
            key, reason = (str(bad[0][1]), str(bad[0][2])) if bad else (f"#{index}", "unreadable")
            error = errors.BadSampleError(f"sample {index} ({key}): {reason}")
            error.index, error.key, error.reason = index, key, reason
            raise error
        if self._torch_output:
            import torch  # noqa: PLC0415

            image, label = torch.from_dlpack(images)[0], torch.from_dlpack(labels)[0]
        else:
            import numpy  # noqa: PLC0415

            image, label = numpy.from_dlpack(images)[0], numpy.from_dlpack(labels)[0]
        return image, int(label)

    def _list(self) -> List[Tuple[str, int]]:
        if self._listing is None:
            reading = self._args.get("reading")
            with errors.arguments("Loader.dataset"):
                native = _native.NativeDataset(self._paths, reading=reading)
            self._listing = labelled_listing(native, self._paths)
        return self._listing

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        if self._loader is not None:
            state["_epoch"] = self._loader.epoch
            state["_seed"] = self._loader.seed
        state["_loader"] = None
        state["_native"] = None
        state["_pid"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"imagefeed.LoaderDataset({len(self)} samples, {len(self.classes)} classes)"
