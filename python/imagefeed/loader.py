"""``imagefeed.Loader``: the Rust loader as a PyTorch/NumPy iterable."""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any, Dict, Iterator, List, Literal, NamedTuple, Optional, Tuple, Union, cast

from . import _native, errors
from ._reading import DatasetPath, dataset_paths, reading_options
from .reports import LoaderState, LoaderStats
from .transforms import BatchTransform, Transform
from .transforms import none as _no_transform
from .views import LoaderDataset, LoaderSampler

__all__ = ["Loader", "BadSample", "DEFAULT_MAX_BAD"]


class BadSample(NamedTuple):
    """A sample that could not be read or decoded, and what was done about it."""

    index: int  # type: ignore[assignment]  # a field named as tuple's method, as it always was
    """Dataset index."""
    key: str
    """Record key (relative path), or ``#INDEX`` when the record itself was unreadable."""
    reason: str
    """Why it failed."""
    replaced_by: Optional[int]
    """Under ``bad_samples="replace"``: the dataset index that took its slot."""
    kind: str
    """What kind of failure: ``"unreadable"``, ``"corrupt"`` (the stored record is damaged),
    ``"unknown_format"``, ``"too_large"`` (over the pixel limit) or ``"undecodable"``."""
    while_replacing: Optional[int] = None
    """Under ``bad_samples="replace"``: set when this sample was tried as a replacement for that
    dataset index and was bad itself. Reported, but not counted against ``max_bad`` (which counts
    the epoch's own samples, the same whatever the policy)."""


_OUTPUTS = ("torch", "numpy", "dlpack")

#: What iterating a :class:`Loader` gives: torch tensors, NumPy arrays or DLPack capsules.
Output = Literal["torch", "numpy", "dlpack"]
#: A batch's element type (the short names are aliases).
DType = Literal["float32", "float16", "bfloat16", "uint8", "f32", "f16", "bf16", "u8"]
#: A batch's layout (either case).
Layout = Literal["NCHW", "NHWC", "nchw", "nhwc"]
#: What a bad sample does (see :class:`Loader`).
BadSamplePolicy = Literal["replace", "skip", "error"]
#: How an epoch that does not divide by the world size is dealt out.
Uneven = Literal["pad", "drop", "exact"]

#: The bad-sample cap a :class:`Loader` has unless given ``max_bad``: more than 1% of an epoch's
#: samples bad raises :class:`~imagefeed.errors.TooManyBadSamplesError`. Sporadic damage (a few
#: corrupt files) stays within it; losing much of the data for one reason does not.
DEFAULT_MAX_BAD = 0.01


def _distributed_rank() -> Tuple[int, int]:
    """(rank, world_size) from torch.distributed when it is initialised, else RANK/WORLD_SIZE,
    else (0, 1). torch is not imported for this: a process group can only be initialised where
    torch.distributed was imported already (importing torch costs seconds and hundreds of MB to
    a loader that gives NumPy arrays). One of RANK and WORLD_SIZE without the other is an error
    (WORLD_SIZE=1 alone aside), as the arguments are: taken as rank 0, every process of a
    launcher that set only WORLD_SIZE would read the same share and the rest none."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world_size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if (rank is None) != (world_size is None) and world_size != "1":
        given, missing = ("RANK", "WORLD_SIZE") if world_size is None else ("WORLD_SIZE", "RANK")
        raise errors.ConfigError(
            f"{given} is set in the environment but {missing} is not: set both (as torchrun "
            "does), or pass rank= and world_size="
        )
    try:
        return int(rank or "0"), int(world_size or "1")
    except ValueError as e:
        raise errors.ConfigError(f"RANK/WORLD_SIZE are not integers: {e}") from None


class _CudaFeed:
    """Batches to a CUDA device: the host batch (u8 NHWC, in page-locked memory) is copied on a
    side stream, then converted (layout, dtype, normalization) on the trainer's current stream,
    which waits for the copy. The host buffer is kept until its copy has completed; the device
    tensors are the caching allocator's, marked as used by the trainer's stream.

    This runs on torch's own streams, events and allocator rather than on the Rust prefetcher
    (``imagefeed.gpu``): a tensor made here is torch's in every way (``record_stream``, the
    caching allocator, CUDA graphs), and nothing hands device memory across two allocators. The
    Rust feed is what the fake CUDA driver checks; torch's CUDA runtime cannot run on it, so this
    path's ordering (stage one ahead, finish on the current stream, drain on exit) is tested with
    stand-ins (python/tests/test_loader.py) and on a GPU by ``make gpu-check``."""

    def __init__(self, torch: Any, device: str, spec: Dict[str, Any], dtype: str, layout: str):
        if not str(device).startswith("cuda"):
            raise errors.ConfigError(f"device {device!r}: must be \"cpu\" or \"cuda[:N]\"")
        if not torch.cuda.is_available():
            raise errors.CudaError(f"device {device!r}: torch sees no CUDA device")
        self.torch = torch
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                  "uint8": torch.uint8}
        if dtype not in dtypes:
            raise errors.ConfigError(
                f"dtype {dtype!r}: must be \"float32\", \"float16\", \"bfloat16\" or \"uint8\""
            )
        if layout.upper() not in ("NCHW", "NHWC"):
            raise errors.ConfigError(f"layout {layout!r}: must be \"NCHW\" or \"NHWC\"")
        self.dtype = dtypes[dtype]
        self.nchw = layout.upper() == "NCHW"
        self.copy_stream = torch.cuda.Stream(device=self.device)
        mean, std = spec.get("mean"), spec.get("std")
        shape = (1, 3, 1, 1) if self.nchw else (1, 1, 1, 3)
        if self.dtype == torch.uint8:
            if mean is not None:
                raise errors.ConfigError("Normalize needs a float dtype")
            self.scale = self.bias = None
        else:
            # (pixel / 255 - mean) / std == pixel * scale + bias, in float32 as on the CPU.
            mean = torch.tensor(mean if mean is not None else (0.0, 0.0, 0.0), dtype=torch.float32)
            std = torch.tensor(std if std is not None else (1.0, 1.0, 1.0), dtype=torch.float32)
            self.scale = (1.0 / (255.0 * std)).reshape(shape).to(self.device)
            self.bias = (-mean / std).reshape(shape).to(self.device)
        # (copy-done event, host tensors) until each copy has completed.
        self.in_flight: List[Any] = []

    def stage(self, images: Any, labels: Any) -> Tuple[Any, ...]:
        torch = self.torch
        host_images = torch.from_dlpack(images)
        # The labels are ordinary memory: staged through page-locked memory (torch's caching
        # host allocator keeps the block until the copy reading it is done), so the copy is
        # asynchronous instead of stalling this thread while the driver stages it.
        labels = torch.from_dlpack(labels)
        host_labels = torch.empty(labels.shape, dtype=labels.dtype, pin_memory=True)
        host_labels.copy_(labels)
        self.in_flight = [(e, h) for e, h in self.in_flight if not e.query()]
        with torch.cuda.stream(self.copy_stream):
            dev_images = host_images.to(self.device, non_blocking=True)
            dev_labels = host_labels.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        self.in_flight.append((done, (host_images, host_labels)))
        return dev_images, dev_labels, done

    def drain(self) -> None:
        """Waits for every copy still reading a host batch, then lets the host batches go.
        Called when a loop ends, however it ends: the page-locked buffers are freed with the
        loader, and none may be freed while a copy still reads it."""
        if self.in_flight:
            # Every copy was issued on the copy stream. The host batches stay referenced until
            # it has finished: if waiting fails, they are kept (leaked), never freed under a copy.
            self.copy_stream.synchronize()
        self.in_flight = []

    def finish(self, staged: Tuple[Any, ...]) -> Tuple[Any, ...]:
        torch = self.torch
        dev_images, dev_labels, done = staged
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(done)
        # Made on the copy stream, used on the trainer's: the allocator must not reuse them
        # until the trainer's work on them is done.
        dev_images.record_stream(stream)
        dev_labels.record_stream(stream)
        with torch.cuda.stream(stream):
            n, h, w, c = dev_images.shape
            if self.nchw:
                out = torch.empty((n, c, h, w), dtype=self.dtype, device=self.device)
                out.copy_(dev_images.permute(0, 3, 1, 2))
            elif self.dtype == torch.uint8:
                out = dev_images
            else:
                out = dev_images.to(self.dtype)
            if self.scale is not None:
                if self.dtype == torch.float32:
                    out.mul_(self.scale).add_(self.bias)
                else:
                    # float16 / bfloat16: compute in float32 like the CPU path, then round once.
                    out.copy_(out.float().mul_(self.scale).add_(self.bias))
        return out, dev_labels


# What a loop that a newer loop over the same loader superseded raises.
_SUPERSEDED = "this iterator was superseded: a newer loop over the loader started"


class _LoopCount:
    """The batches one loop has handed to the trainer. Each loop has its own, so that a loop
    superseded on another thread cannot count into the newer loop's position."""

    __slots__ = ("handed",)

    def __init__(self) -> None:
        self.handed = 0


class Loader:
    """Batches of a dataset, built by Rust worker threads, delivered as tensors without a copy.

    ``path`` is anything imagefeed opens: an imagefeed LMDB, HDF5 file or record-shard
    directory, an ImageFolder tree, a py-lmdb (folder2lmdb) file, an h5py file
    (``hdf5_images``/``hdf5_labels`` name its datasets), TFRecord shards (a directory holding
    one set, a pattern such as ``"DIR/train-*"``, or a list of files). For TFRecord shards
    without an imagefeed manifest, ``label_base`` is what their labels start at (ImageNet
    TFRecords: 1) and ``num_classes`` their class count (else found by a scan); a set with
    shards missing raises :class:`~imagefeed.errors.ShardSetError` unless
    ``allow_missing_shards=True``.

    Iterating gives ``(images, labels)``: ``images`` is ``[n, 3, h, w]`` (``layout="NCHW"``) or
    ``[n, h, w, 3]`` of ``dtype`` (``"float32"``, ``"float16"``, ``"bfloat16"``: the float32
    values rounded to nearest-even, torch or DLPack output only; or ``"uint8"``), C-contiguous,
    viewing the loader's batch buffer; ``labels`` is ``int64 [n]``, or, with a
    ``batch_transform`` (:class:`~imagefeed.transforms.MixUp`, ``CutMix`` or ``RandomChoice`` of
    the two, as torchvision's ``transforms.v2``; drawn per batch from the seed, epoch and batch
    position), ``float32 [n, num_classes]`` class probabilities. ``output`` chooses torch
    tensors, NumPy arrays, or the raw DLPack objects.
    A batch's buffer goes back to the loader's pool when the last reference to the tensor is
    dropped, so tensors kept across steps stay intact (the pool grows instead, with a
    :class:`~imagefeed.errors.PoolGrowthWarning` once).

    Each ``for`` loop over the loader runs one epoch: epoch ``set_epoch(e)`` if it was called
    since the last loop, else the one after the last loop's (the first loop runs epoch 0). The
    batches of an epoch depend only on ``seed`` (``None``: drawn at random, kept in ``.seed``
    and in ``state_dict()``), the epoch, the dataset and the settings, never
    on ``workers`` or ``prefetch``. ``workers=0`` builds each batch in the thread that asks for
    it, as a DataLoader with ``num_workers=0`` does (Ctrl-C then takes effect once the batch
    being built is done). ``state_dict()`` at any point (mid-epoch included) and
    ``load_state_dict()`` in a new process continue with exactly the batches that were not
    delivered; a state saved with other settings or another dataset raises
    :class:`~imagefeed.errors.StateMismatchError`.

    Bad samples (unreadable or undecodable records) are handled per ``bad_samples``: ``"skip"``
    (the batch is shorter; empty, with no sample, when all of its samples are bad, so that every
    rank still takes the same number of steps: use ``"replace"`` for training), ``"replace"``
    (another sample, chosen deterministically, takes the slot) or ``"error"`` (raise
    :class:`~imagefeed.errors.BadSampleError`). More than ``max_bad``
    bad samples in one epoch (an int count or a float fraction of the epoch; by default
    :data:`DEFAULT_MAX_BAD`, 1%) raises :class:`~imagefeed.errors.TooManyBadSamplesError` naming
    the last one, so an epoch that lost much of its data never ends as if it were complete;
    ``max_bad=None`` lifts the cap. The ``bad_samples``
    attribute lists the epoch's bad samples (:class:`BadSample`), ``last_bad_samples`` the last
    batch's.

    ``device="cuda"`` (or ``"cuda:N"``, torch output only) delivers CUDA tensors: the workers
    write ``uint8`` NHWC batches into page-locked memory (allocated when the loader is made, not
    during the first batches), each batch and its labels (staged through page-locked memory) are
    copied on a side CUDA stream one batch ahead, overlapping the trainer's compute, and the batch
    is converted to ``dtype`` / ``layout`` and normalized on the GPU. That conversion is queued on
    the stream that is current (``torch.cuda.current_stream()``) when the loop asks for the
    batch, and that stream waits for the copy: run the step on that stream, or make another one
    wait for it. Device tensors come from torch's caching allocator, marked as used by that
    stream, so tensors kept across steps stay intact.

    ``scaled_decode`` (default True) decodes a JPEG that will be shrunk at libjpeg-turbo's
    smallest DCT scale that keeps the output's resolution, as PIL's ``draft`` would: fast, but a
    few levels from torchvision's pixels (which come from a full decode). ``scaled_decode=False``
    decodes every image whole before resizing, as torchvision does with PIL, so that batches
    match ``torchvision.transforms`` to within one level: use it for evaluation against a model
    trained with torchvision's pipeline (docs/python.md gives both differences, measured).

    ``shard_window=w`` (TFRecord and WebDataset shards) shuffles within windows of ``w`` shards,
    the shards permuted each epoch, instead of over the whole dataset: an epoch then reads a
    bounded set of shards at a time, with every guarantee above unchanged.

    ``rank``/``world_size`` shard the epoch (None: from torch.distributed when it is
    initialised, else the RANK and WORLD_SIZE variables, else one rank; looked up again until the
    first epoch starts, so a loader made before ``init_process_group`` shards as the process
    group says): every rank gets the same number of batches (``uneven="pad"`` repeats a few
    samples, ``"drop"`` leaves them out), or, with ``uneven="exact"`` (for evaluation), every
    sample exactly once over all ranks, the first ``num_samples % world_size`` ranks one sample
    (so at most one batch) more than the rest. Given explicitly, they are kept, with a
    :class:`~imagefeed.errors.RankWarning` when the process group's size differs.

    ``loader.sampler`` (:class:`~imagefeed.views.LoaderSampler`) tells which samples an epoch
    gives this rank, with ``DistributedSampler``'s attributes; ``loader.dataset``
    (:class:`~imagefeed.views.LoaderDataset`) gives them one at a time, with ImageFolder's
    ``classes``, ``class_to_idx``, ``samples`` and ``targets``.

    Parameters
    ----------
    path : str, os.PathLike or sequence of them
        The dataset (see above); a URL (``s3://...``) for one in object storage.
    batch_size : int, default 256
        Samples per batch. (The Rust ``LoaderConfig`` defaults to 32, a value for tests; 256 is
        what image-classification recipes use.)
    workers : int, default 4
        Worker threads decoding and transforming (0: in the calling thread).
    seed : int or None, default 0
        Shuffling and every random draw; ``None`` draws one (kept in ``.seed``).
    prefetch : int, optional
        Batches in flight; default two per worker.
    transform : imagefeed.transforms.Transform, optional
        The per-sample steps (:mod:`imagefeed.transforms`); default: decode only.
    output : {"torch", "numpy", "dlpack"}, default "torch"
        What the batches are.
    device : str, default "cpu"
        ``"cuda"`` or ``"cuda:N"``: batches on the GPU (see above).
    dtype : {"float32", "float16", "bfloat16", "uint8"}, default "float32"
        The images' element type (``"bfloat16"``: torch or DLPack output only).
    layout : {"NCHW", "NHWC"}, default "NCHW"
        The images' layout.
    shuffle : bool, default True
        Shuffle each epoch (from ``seed`` and the epoch).
    drop_last : bool, default False
        Leave out the last, short batch.
    bad_samples : {"replace", "skip", "error"}, default "replace"
        What a bad sample does (see above). (The Rust ``LoaderConfig`` defaults to skip.)
    max_bad : int, float or None, default DEFAULT_MAX_BAD
        Bad samples an epoch may hold before it raises: a count, a fraction, or None.
    rank, world_size : int, optional
        This process's rank and the number of ranks (both or neither; see above).
    uneven : {"pad", "drop", "exact"}, default "pad"
        How an epoch that does not divide by ``world_size`` is dealt out.
    max_pixels : int, optional
        Decompression-bomb limit per image (default 178,956,970, PIL's).
    hdf5_images, hdf5_labels : str, optional
        An h5py file's dataset names (default ``images``, ``labels``).
    label_base, num_classes : int, optional
        TFRecords without a manifest: the smallest label, the class count.
    allow_missing_shards : bool, default False
        Read a shard set with members missing, on purpose.
    storage_options : dict of str to str, optional
        Object-storage client options over the environment's (``aws_endpoint``, ...).
    ranged_reads : bool, default False
        In object storage, read each record with a ranged GET instead of fetching whole shards.
    shard_window : int, optional
        Shuffle within windows of this many shards (see above).
    scaled_decode : bool, default True
        Decode JPEGs at a reduced DCT scale where the output allows (see above).
    batch_transform : imagefeed.transforms.BatchTransform, optional
        MixUp, CutMix or RandomChoice of the two, on each finished batch.
    """

    def __init__(
        self,
        path: DatasetPath,
        *,
        batch_size: int = 256,
        workers: int = 4,
        seed: Optional[int] = 0,
        prefetch: Optional[int] = None,
        transform: Optional[Transform] = None,
        output: Output = "torch",
        device: str = "cpu",
        dtype: DType = "float32",
        layout: Layout = "NCHW",
        shuffle: bool = True,
        drop_last: bool = False,
        bad_samples: BadSamplePolicy = "replace",
        max_bad: Union[int, float, None] = DEFAULT_MAX_BAD,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        uneven: Uneven = "pad",
        max_pixels: Optional[int] = None,
        hdf5_images: Optional[str] = None,
        hdf5_labels: Optional[str] = None,
        label_base: Optional[int] = None,
        num_classes: Optional[int] = None,
        allow_missing_shards: bool = False,
        storage_options: Optional[Dict[str, str]] = None,
        ranged_reads: bool = False,
        shard_window: Optional[int] = None,
        scaled_decode: bool = True,
        batch_transform: Optional[BatchTransform] = None,
    ):
        paths = dataset_paths(path)
        reading = reading_options(
            hdf5_images, hdf5_labels, label_base, num_classes, allow_missing_shards, storage_options,
            ranged_reads,
        )
        if output not in _OUTPUTS:
            raise errors.ConfigError(f"output {output!r}: must be one of {', '.join(_OUTPUTS)}")
        if not isinstance(device, str) or not (device == "cpu" or device.startswith("cuda")):
            raise errors.ConfigError(f"device {device!r}: must be \"cpu\" or \"cuda[:N]\"")
        if transform is None:
            transform = _no_transform()
        if not isinstance(transform, Transform):
            hint = (
                ": wrap the step in T.Compose([...])"
                if type(transform).__module__ == "imagefeed.transforms"
                else " (see imagefeed.transforms)"
            )
            raise errors.ConfigError(f"transform {transform!r} is not an imagefeed transform{hint}")
        if batch_transform is not None and not isinstance(batch_transform, BatchTransform):
            raise errors.ConfigError(
                f"batch_transform {batch_transform!r} is not an imagefeed batch step "
                "(T.MixUp, T.CutMix or T.RandomChoice of the two)"
            )
        if (rank is None) != (world_size is None):
            raise errors.ConfigError("give both rank and world_size, or neither")
        ranks_given = rank is not None
        if rank is None or world_size is None:
            rank, world_size = _distributed_rank()
        seed_given = seed is not None
        if seed is None:
            # Drawn, as torch draws its base seed: kept in .seed and in state_dict(), and taken
            # back from a state restored into a loader whose seed was drawn too.
            seed = int.from_bytes(os.urandom(8), "little")
        batch_size = errors.whole_number("batch_size", batch_size)
        workers = errors.whole_number("workers", workers)
        seed = errors.whole_number("seed", seed)
        rank = errors.whole_number("rank", rank)
        world_size = errors.whole_number("world_size", world_size, low=1)
        for name, value in (("shuffle", shuffle), ("drop_last", drop_last), ("scaled_decode", scaled_decode)):
            if not isinstance(value, bool):
                raise errors.ConfigError(f"{name} {value!r}: must be True or False")
        prefetch = errors.optional_whole_number("prefetch", prefetch)
        max_pixels = errors.optional_whole_number("max_pixels", max_pixels)
        shard_window = errors.optional_whole_number("shard_window", shard_window)
        for name, text in (("dtype", dtype), ("layout", layout), ("uneven", uneven), ("bad_samples", bad_samples)):
            if not isinstance(text, str):
                raise errors.ConfigError(f"{name} {text!r}: must be a string")
        if dtype in ("bfloat16", "bf16") and output == "numpy":
            raise errors.ConfigError(
                "dtype=\"bfloat16\" needs output=\"torch\" (or \"dlpack\"): NumPy has no bfloat16"
            )
        if prefetch is None:
            prefetch = 2 * max(workers, 1)
        self._output = output
        self._torch = None
        self._numpy = None
        self._cuda: Optional[_CudaFeed] = None
        if output == "torch" or device != "cpu":
            try:
                import torch  # noqa: PLC0415 - only needed for torch output
            except ImportError:
                if device != "cpu":
                    raise errors.CudaError(f"device {device!r} needs torch (with CUDA) installed") from None
                raise errors.ConfigError("output=\"torch\" needs torch installed (or use output=\"numpy\")") from None
            self._torch = torch
        elif output == "numpy":
            import numpy  # noqa: PLC0415 - only needed for numpy output

            self._numpy = numpy
        spec = transform.spec()
        # A preset's batch step (T.imagenet_train(mixup=..., cutmix=...)).
        preset_mix = spec.pop("batch_mix", None)
        if preset_mix is not None and batch_transform is not None:
            raise errors.ConfigError(
                "the transform's preset already mixes batches (mixup/cutmix): leave out batch_transform"
            )
        batch_mix = preset_mix if batch_transform is None else batch_transform.spec()
        host_dtype, host_layout, pinned_device = dtype, layout, None
        if device != "cpu":
            if output != "torch":
                raise errors.ConfigError(f"device {device!r} gives torch tensors: use output=\"torch\"")
            self._cuda = _CudaFeed(self._torch, device, spec, dtype, layout)
            pinned_device = self._cuda.device.index
            # The workers write u8 NHWC into page-locked memory; the GPU converts and normalizes.
            # RandomErasing's value stays in the normalized units it was given in.
            if "erase" in spec and "mean" in spec:
                spec["erase"] = dict(spec["erase"], mean=spec["mean"], std=spec["std"])
            spec = {k: v for k, v in spec.items() if k not in ("mean", "std")}
            host_dtype, host_layout = "uint8", "NHWC"
        # What the native loader is made from, kept to make it again for other ranks.
        self._native_args: Dict[str, Any] = dict(
            batch_size=batch_size,
            workers=workers,
            seed=seed,
            prefetch=prefetch,
            shuffle=shuffle,
            drop_last=drop_last,
            uneven=uneven,
            transform=spec,
            dtype=host_dtype,
            layout=host_layout,
            bad_samples=bad_samples,
            max_bad=max_bad,
            max_pixels=max_pixels,
            reading=reading,
            pinned_device=pinned_device,
            shard_window=shard_window,
            scaled_decode=scaled_decode,
            batch_mix=batch_mix,
        )
        self._paths = paths
        self._dtype, self._layout = dtype, layout
        self._native = self._make_native(rank, world_size)
        self._dataset_view: Optional[LoaderDataset] = None
        self.batch_size = batch_size
        self.seed = seed
        self._seed_given = seed_given
        self.device = device
        self.rank = rank
        self.world_size = world_size
        # Ranks found (not given) are looked up again until the first epoch starts: a loader
        # made before init_process_group must not read the whole dataset on every rank.
        self._ranks_given = ranks_given
        self._ranks_settled = False
        self._rank_warned = False
        # The state load_state_dict restored, until an epoch starts (a remade loader resumes it).
        self._restored: Optional[str] = None
        # The epoch whose end load_state_dict restored: set_epoch(it) makes the next loop an
        # empty one of that epoch (`_empty_loop`).
        self._restored_end: Optional[int] = None
        self._empty_loop: Optional[int] = None
        self.transform = transform
        self.bad_sample_policy = bad_samples
        self._epoch_set: Optional[int] = None
        self._next_epoch = 0
        self._epoch: Optional[int] = None
        self._resumed = False
        self._bad: List[BadSample] = []
        self._last_bad: List[BadSample] = []
        # Each loop gets a generation: an old, abandoned iterator must not stop a newer loop.
        self._gen = 0
        # What a restore could not know (Loader::resume_notice), until the ranks are settled.
        self._resume_notice: Optional[str] = None
        # The batches the current loop handed to the trainer (each loop counts in its own).
        self._count = _LoopCount()
        self._pid = os.getpid()
        # Buffers a loader needs with nothing kept: one per batch in flight, the one being
        # handed over, and the one the trainer is using (with a GPU: two being copied).
        self._steady_buffers = prefetch + 2 + (2 if self._cuda is not None else 0)
        self._warned = False

    def _make_native(self, rank: int, world_size: int, seed: Optional[int] = None) -> "_native.NativeLoader":
        args = dict(self._native_args)
        if seed is not None:
            args["seed"] = seed
        with errors.arguments("Loader"):
            return _native.NativeLoader(self._paths, rank=rank, world_size=world_size, **args)

    def _check_ranks(self, settle: bool) -> None:
        """Until the first epoch starts (``settle``: it is starting), ranks that were found rather
        than given are found again, and the loader is remade for them when they changed
        (``init_process_group`` ran after the loader was made), a restored position going with
        it. Ranks given explicitly are kept; a process group of another size is warned about,
        as is one set up after the ranks were settled."""
        dist = sys.modules.get("torch.distributed")
        group = None
        if dist is not None and dist.is_available() and dist.is_initialized():
            group = (dist.get_rank(), dist.get_world_size())
        if self._ranks_settled:
            if (settle and not self._ranks_given and not self._rank_warned and group is not None
                    and group != (self.rank, self.world_size)):
                self._rank_warned = True
                warnings.warn(
                    f"imagefeed.Loader took rank {self.rank} of {self.world_size} when its first "
                    f"epoch started, but the torch.distributed process group now says rank "
                    f"{group[0]} of {group[1]}: make the Loader after init_process_group (or "
                    "pass rank and world_size)",
                    errors.RankWarning,
                    stacklevel=3,
                )
            return
        if self._ranks_given:
            if settle:
                self._ranks_settled = True
                if group is not None and group[1] != self.world_size:
                    warnings.warn(
                        f"imagefeed.Loader was given world_size={self.world_size}, but the "
                        f"torch.distributed process group has {group[1]} ranks: each rank reads "
                        f"1/{self.world_size} of the dataset (leave rank and world_size out to "
                        "take them from the process group)",
                        errors.RankWarning,
                        stacklevel=3,
                    )
            return
        rank, world_size = _distributed_rank()
        if (rank, world_size) != (self.rank, self.world_size):
            native = self._make_native(rank, world_size)
            if self._restored is not None:
                # Continue the restored position at these ranks (an elastic resume).
                self._resume_notice = native.resume(self._restored)[3]
            self._native = native
            self.rank, self.world_size = rank, world_size
        if settle:
            self._ranks_settled = True
            if self._resume_notice is not None:
                # Said once the ranks it depends on are known.
                notice, self._resume_notice = self._resume_notice, None
                warnings.warn(notice, errors.ResumeWarning, stacklevel=3)

    # -- the epoch -------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Makes the next ``for`` loop run epoch ``epoch`` (as ``DistributedSampler.set_epoch``).

        After :meth:`load_state_dict` restored a position inside an epoch, ``set_epoch`` with that
        same epoch keeps it: the usual ``for epoch in range(start, end): loader.set_epoch(epoch)``
        continues mid-epoch, with exactly the batches not yet trained on (a position at the
        epoch's end gives an empty loop, then the next epoch). Another epoch drops the restored
        position, with a :class:`~imagefeed.errors.ResumeWarning`, and starts that epoch from its
        first batch."""
        # Every epoch a loop can run (a loop after epoch 2**64 - 2 ran 2**64 - 1, which this
        # refused).
        epoch = errors.whole_number("epoch", epoch)
        self._empty_loop = None
        if self._restored_end is not None:
            if epoch == self._restored_end:
                # The restored position is this epoch's end: its loop has nothing left to give,
                # and the next loop runs the epoch after it.
                self._empty_loop = epoch
                return
            self._restored_end = None
        if self._resumed:
            if epoch == self._epoch:
                return
            warnings.warn(
                f"imagefeed.Loader.set_epoch({epoch}) after load_state_dict() restored a position "
                f"inside epoch {self._epoch}: that position is dropped and epoch {epoch} starts "
                "from its first batch",
                errors.ResumeWarning,
                stacklevel=2,
            )
        self._epoch_set = epoch
        self._resumed = False

    @property
    def epoch(self) -> int:
        """The epoch of the loop in progress, or of the last one run (the epoch just finished,
        for logging after the loop); the one ``set_epoch`` chose or a restored state holds, once
        either is called; before any loop, the one the first loop runs."""
        if self._empty_loop is not None:
            return self._empty_loop
        if self._epoch_set is not None and not self._resumed:
            return self._epoch_set
        if self._epoch is not None:
            return self._epoch
        return self._next_epoch

    def _continuing(self) -> bool:
        """Whether :attr:`epoch`'s loop is the epoch in progress, restored or last run, rather
        than one ``set_epoch`` asked for, which begins that epoch whole."""
        return self._epoch_set is None

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise errors.ConfigError(
                "this Loader was made in another process: its worker threads do not survive a "
                "fork; make the Loader in the process that iterates it (imagefeed.Dataset is the "
                "fork-safe, picklable one)"
            )

    def __len__(self) -> int:
        """Batches per epoch on this rank: of the whole epoch (after a restore, the loop gives
        only the batches not yet delivered), or, after a restore of a state saved at another
        world size or batch size, of the part of the epoch dealt out again (the loop gives them
        all)."""
        self._check_ranks(settle=False)
        return self._native.batches_per_rank(self.epoch, self._continuing())

    def __iter__(self) -> Iterator[Tuple[Any, Any]]:
        self._check_process()
        self._check_ranks(settle=True)
        self._restored = None
        self._restored_end = None
        if self._empty_loop is not None:
            self._epoch, self._empty_loop = self._empty_loop, None
            self._epoch_set = None
            self._next_epoch = self._epoch + 1
            return iter(())
        if self._resumed:
            self._resumed = False
            ticket = self._native.generation
        else:
            epoch = self._epoch_set if self._epoch_set is not None else self._next_epoch
            self._epoch_set = None
            if epoch >= 2**64:
                raise errors.ConfigError(f"epoch {epoch}: past the last epoch there is (2**64 - 1)")
            ticket = self._native.begin(epoch)
            self._count = _LoopCount()
            self._gen += 1
            self._epoch = epoch
            self._bad = []
        assert self._epoch is not None  # set by begin() or by load_state_dict()
        self._next_epoch = self._epoch + 1
        return self._batches(self._gen, self._count, ticket)

    def _batches(self, gen: int, count: "_LoopCount", ticket: int) -> Iterator[Tuple[Any, Any]]:
        """The loop started as generation ``gen`` (``ticket`` on the native side), counting the
        batches it hands over in ``count``. A loop superseded by a newer one, even on another
        thread between its check and its call, gets no batch of the newer loop and adds
        nothing to its count."""
        native = self._native
        convert = self._convert
        cuda = self._cuda
        pending = None  # CUDA: the batch whose copy is under way, not handed over yet
        # count.handed counts the batches handed to the trainer in this epoch. The native side
        # counts the batches it returned; the difference (a batch held when an exception hits,
        # one staged ahead on the GPU) is left out of the position. It is counted right before
        # each `yield`, with no call in between, so no signal handler can run between the two.
        try:
            while True:
                # A fork's child copy of a loop under way: the workers stayed in the parent.
                self._check_process()
                if gen != self._gen:
                    raise errors.ConfigError(_SUPERSEDED)
                try:
                    parts = native.next_batch(ticket)
                except errors.TooManyBadSamplesError as e:
                    e.keys = [b.key for b in self._bad] + ([e.key] if e.key is not None else [])
                    raise
                except errors.ConfigError as e:
                    if e.reason == _SUPERSEDED:  # the native side's check: one message for both
                        raise errors.ConfigError(_SUPERSEDED) from None
                    raise
                if parts is None:
                    break
                images, labels, _samples, bad = parts
                if bad:
                    self._last_bad = [BadSample(*b) for b in bad]
                    self._bad.extend(self._last_bad)
                elif self._last_bad:
                    self._last_bad = []
                if not self._warned and native.pool_allocations > self._steady_buffers:
                    self._warn_growth()
                if cuda is None:
                    item = (convert(images), convert(labels))
                    count.handed += 1
                    yield item
                    continue
                # One batch ahead: this batch's copy is issued before the previous one is
                # handed over, so it runs while the trainer computes on that one.
                staged = cuda.stage(images, labels)
                if pending is None:
                    pending = staged
                    continue
                item = cuda.finish(pending)
                pending = staged
                count.handed += 1
                yield item
            if pending is not None:
                assert cuda is not None  # only a CUDA feed stages a batch
                item, pending = cuda.finish(pending), None
                count.handed += 1
                yield item
        finally:
            try:
                # A loop left early (break, an exception, Ctrl-C) cancels the batches in flight
                # and keeps the position for state_dict(), without batches never handed over.
                if gen == self._gen and os.getpid() == self._pid:
                    native.stop(count.handed, ticket)
            finally:
                if cuda is not None and os.getpid() == self._pid:
                    cuda.drain()

    def _convert(self, array: Any) -> Any:
        if self._torch is not None:
            return self._torch.from_dlpack(array)
        if self._numpy is not None:
            return self._numpy.from_dlpack(array)
        return array

    @property
    def pinned_buffers(self) -> Optional[Tuple[int, int]]:
        """With a CUDA device: (page-locked batch buffers, heap fallbacks) allocated so far."""
        return self._native.pinned_buffers

    def _warn_growth(self) -> None:
        self._warned = True
        warnings.warn(
            f"imagefeed.Loader: {self._native.pool_allocations} batch buffers allocated, more than "
            f"the {self._steady_buffers} the loader itself needs: batches are being kept alive "
            "from Python (e.g. appended to a list). They stay correct; the pool grows instead. "
            "Keep .clone() copies, or drop references, to bound memory.",
            errors.PoolGrowthWarning,
            stacklevel=3,
        )

    # -- resume ----------------------------------------------------------------------------

    def state_dict(self) -> LoaderState:
        """Where the loader stands: the next batch the current epoch would give the trainer
        (after a finished epoch, the start of the next one; after ``set_epoch(e)``, the start of
        epoch ``e``). Plain JSON types, for ``torch.save``."""
        self._check_process()
        self._check_ranks(settle=False)
        fresh = self._epoch_set is not None and not self._resumed
        state = self._native.state(self.epoch, fresh=fresh, handed=self._count.handed)
        return {"imagefeed_loader_state": json.loads(state)}

    def load_state_dict(self, state: Union[LoaderState, Dict[str, Any]]) -> None:
        """Makes the next ``for`` loop continue the saved epoch at its next batch. Raises
        :class:`~imagefeed.errors.StateMismatchError` when the state was saved with another seed
        (a loader made with ``seed=None`` takes the saved one), shuffle, ``drop_last``,
        ``uneven``, transform (output dtype and layout included), bad-sample policy, shard
        window or dataset. The rank, world size and batch size may differ: the samples no rank
        had been given are dealt out again. Under ``uneven="exact"``, a state a shorter rank
        saved after its last batch, resumed on another rank or at another world size, warns with
        a :class:`~imagefeed.errors.ResumeWarning` (the longer ranks' last batches come again if
        they had been taken): resume from rank 0's state."""
        self._check_process()
        self._check_ranks(settle=False)
        if not isinstance(state, dict) or not isinstance(state.get("imagefeed_loader_state"), dict):
            raise errors.ConfigError("not an imagefeed Loader.state_dict()")
        inner = json.dumps(dict(state["imagefeed_loader_state"]))
        saved_seed: Any = state["imagefeed_loader_state"].get("seed")
        native = self._native
        if (not self._seed_given and isinstance(saved_seed, int) and not isinstance(saved_seed, bool)
                and 0 <= saved_seed < 2**64 and saved_seed != self.seed):
            # This loader drew its seed: the run being resumed drew another, which it continues.
            native = self._make_native(self.rank, self.world_size, seed=saved_seed)
        # Nothing changes until the state is accepted: a refused state leaves the loader as it was.
        epoch, remaining, over, notice = native.resume(inner)
        self._resume_notice = None
        if notice is not None:
            if self._ranks_given or self._ranks_settled:
                warnings.warn(notice, errors.ResumeWarning, stacklevel=2)
            else:
                # The ranks may still change (init_process_group after this): said when the
                # first epoch settles them, for the ranks it runs at.
                self._resume_notice = notice
        if native is not self._native:
            self._native.stop(self._count.handed)
            self._native = native
            self._native_args["seed"] = saved_seed
            self.seed = saved_seed
        self._count = _LoopCount()
        self._gen += 1
        self._empty_loop = None
        self._restored = inner
        self._bad = []
        if remaining == 0 and over:
            # A finished epoch: the next loop runs the one after it (set_epoch with the
            # finished one gives an empty loop first). (A rank with no batch left of an epoch
            # other ranks are still in runs it, empty, like them: the branch below.)
            native.stop()
            self._resumed = False
            self._epoch_set = None
            self._next_epoch = epoch + 1
            self._epoch = None
            self._restored_end = epoch
            return
        self._restored_end = None
        self._epoch = epoch
        self._epoch_set = None
        self._resumed = True

    # -- reports ---------------------------------------------------------------------------

    @property
    def bad_samples(self) -> List[BadSample]:
        """Bad samples met so far in the current epoch (in this process), in order."""
        return list(self._bad)

    @property
    def last_bad_samples(self) -> List[BadSample]:
        """Bad samples in the last batch delivered."""
        return list(self._last_bad)

    @property
    def classes(self) -> List[str]:
        """Class names, indexed by label."""
        return self._native.classes

    @property
    def num_samples(self) -> int:
        """Samples in the dataset (all ranks)."""
        return self._native.num_samples

    @property
    def dataset(self) -> LoaderDataset:
        """The loader's samples one at a time, as a map-style dataset with ImageFolder's
        attributes (:class:`~imagefeed.views.LoaderDataset`)."""
        if self._dataset_view is None:
            self._dataset_view = LoaderDataset(self)
        return self._dataset_view

    @property
    def sampler(self) -> LoaderSampler:
        """Which samples an epoch gives this rank (:class:`~imagefeed.views.LoaderSampler`)."""
        return LoaderSampler(self)

    def stats(self) -> LoaderStats:
        """Stage times (seconds, summed over workers), counts, and the pool's allocations."""
        s: Dict[str, Any] = dict(self._native.stats())
        s["pool_allocations"] = self._native.pool_allocations
        s["pool_bytes"] = self._native.pool_bytes
        return cast(LoaderStats, s)

    def __repr__(self) -> str:
        return (
            f"imagefeed.Loader({self._native.format}, {self.num_samples} samples, "
            f"batch_size={self.batch_size}, rank {self.rank}/{self.world_size}, "
            f"{len(self)} batches/epoch, transform={self.transform!r})"
        )
