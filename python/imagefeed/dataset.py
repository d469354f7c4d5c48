"""``imagefeed.Dataset``: a map-style dataset over any file imagefeed reads, for pipelines that
keep ``torch.utils.data.DataLoader`` and torchvision transforms: a drop-in for
``torchvision.datasets.ImageFolder``."""

from __future__ import annotations

import io
import os
from typing import Any, Callable, Dict, List, Literal, Optional, Tuple

from . import _native, errors
from ._reading import (
    DatasetPath,
    ImageFolderListing,
    dataset_paths,
    labelled_listing,
    reading_options,
    sample_index,
)

__all__ = ["Dataset"]

_DECODES = ("pil", "numpy", "bytes", None)

# torchvision's IMG_EXTENSIONS: the files an ImageFolder (and imagefeed's folder reader) take.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class Dataset(ImageFolderListing):
    """``ds[i] -> (sample, label)`` over a packed file or folder, safe in DataLoader workers: a
    drop-in for ``torchvision.datasets.ImageFolder(root, transform, target_transform)``.

    Over an image folder it takes the same files, in the same order, with the same labels and
    pixels as ImageFolder (torchvision's extension list, matched case-insensitively; class
    directories and sub-directories reached through symlinks followed; each image opened by
    PIL and converted with ``convert("RGB")``, so grayscale, palette, alpha, CMYK and 16-bit
    files come out as ImageFolder gives them). ``classes``, ``class_to_idx``, ``samples``,
    ``imgs``, ``targets`` and ``find_classes`` are ImageFolder's; for a packed file ``samples``
    lists ``(key, label)``, the key being the path the record was packed from (listing them
    reads every record once).

    ``decode`` chooses the sample: ``"pil"`` (the default) a ``PIL.Image`` in RGB, as
    ImageFolder's loader gives; ``"numpy"`` an RGB ``uint8`` array ``(height, width, 3)`` decoded
    by libjpeg-turbo; ``"bytes"`` (or ``None``) the stored bytes (an encoded image, or raw
    pixels for a raw pack). ``transform`` and ``target_transform`` are applied to the sample and
    the label, as in torchvision.

    The file is opened lazily in each process that reads it, and again after a fork, so the
    dataset can be passed to ``DataLoader(num_workers=N)`` (forked or spawned workers) without
    sharing an LMDB or HDF5 handle between processes. Pickling keeps only the path, the options
    and what identifies the dataset first opened: a process that opens the path again and finds
    another dataset there (replaced or rewritten since, so indices would mean other samples)
    raises :class:`~imagefeed.DatasetChangedError` rather than read it. For a local dataset that
    is its format, sample count, classes, fingerprint (eight probed records) and, for an image
    folder or one of imagefeed's packs, every record's key and label or checksum; for one in
    object storage the format, count and classes (probing would download shards), and each
    shard is fetched only as the version listed when the process opened it.

    Parameters
    ----------
    root : str, os.PathLike or sequence of them
        An image folder, a packed file or shard directory, a shard pattern or list, or a URL.
    transform : callable, optional
        Applied to each sample (torchvision's transforms work as with ImageFolder).
    target_transform : callable, optional
        Applied to each label.
    decode : {"pil", "numpy", "bytes", None}, default "pil"
        What a sample is (see above).
    hdf5_images, hdf5_labels : str, optional
        An h5py file's dataset names (default ``images``, ``labels``).
    label_base, num_classes : int, optional
        TFRecords without a manifest: the smallest label, the class count.
    allow_missing_shards : bool, default False
        Read a shard set with members missing, on purpose.
    storage_options : dict of str to str, optional
        Object-storage client options over the environment's.
    ranged_reads : bool, default False
        In object storage, read each record with a ranged GET instead of fetching whole shards.
    max_pixels : int, optional
        Decompression-bomb limit for ``decode="numpy"`` (default PIL's, 178,956,970).
    """

    def __init__(
        self,
        root: DatasetPath,
        transform: Optional[Callable[[Any], Any]] = None,
        target_transform: Optional[Callable[[int], Any]] = None,
        *,
        decode: Optional[Literal["pil", "numpy", "bytes"]] = "pil",
        hdf5_images: Optional[str] = None,
        hdf5_labels: Optional[str] = None,
        label_base: Optional[int] = None,
        num_classes: Optional[int] = None,
        allow_missing_shards: bool = False,
        storage_options: Optional[Dict[str, str]] = None,
        ranged_reads: bool = False,
        max_pixels: Optional[int] = None,
    ):
        if decode not in _DECODES:
            raise errors.ConfigError(f"decode {decode!r}: must be \"pil\", \"numpy\" or \"bytes\"")
        if decode == "pil":
            try:
                import PIL.Image  # noqa: F401, PLC0415
            except ImportError:
                raise errors.ConfigError(
                    "decode=\"pil\" (the default) needs Pillow: pip install pillow, or pass "
                    "decode=\"numpy\" or decode=\"bytes\""
                ) from None
        self._paths = dataset_paths(root)
        self.path = self._paths[0] if len(self._paths) == 1 else list(self._paths)
        self.root = os.fspath(self.path) if not isinstance(self.path, list) else self.path
        self.decode = "bytes" if decode is None else decode
        self.extensions = IMG_EXTENSIONS
        self.transform = transform
        self.target_transform = target_transform
        self._options: Dict[str, Any] = dict(
            reading=reading_options(
                hdf5_images, hdf5_labels, label_base, num_classes, allow_missing_shards,
                storage_options, ranged_reads,
            ),
            max_pixels=max_pixels,
        )
        self._native: Optional[_native.NativeDataset] = None
        self._pid: Optional[int] = None
        self._identity: Optional[Dict[str, Any]] = None
        # Open once here so a wrong path fails at construction, and len()/classes are known.
        with errors.arguments("Dataset"):
            native = self._handle()
        self._len = len(native)
        self.classes: List[str] = native.classes
        self.class_to_idx: Dict[str, int] = {name: i for i, name in enumerate(self.classes)}
        self.format: str = native.format
        self._identity = self._identity_of(native)
        self._listing: Optional[List[Tuple[str, int]]] = None

    def _identity_of(self, native: "_native.NativeDataset") -> Dict[str, Any]:
        identity: Dict[str, Any] = {
            "format": native.format, "samples": len(native), "classes": native.classes,
        }
        if not native.remote:
            identity["fingerprint"] = native.fingerprint
            listing = native.listing
            if listing is not None:
                identity["listing"] = listing
        return identity

    def _handle(self) -> "_native.NativeDataset":
        pid = os.getpid()
        if self._native is None or self._pid != pid:
            # First use in this process (or a forked child): never reuse the parent's handle.
            native = _native.NativeDataset(self._paths, **self._options)
            changed = self._changed(native) if self._identity is not None else None
            if changed is not None:
                del native  # not kept alive by the traceback: the file stays closed
                raise changed
            self._native = native
            self._pid = pid
        return self._native

    def _changed(self, native: "_native.NativeDataset") -> Optional[errors.DatasetChangedError]:
        """The error for a reopened path that holds another dataset than the one first opened;
        None when it holds the same."""
        assert self._identity is not None
        found = self._identity_of(native)
        differ = [name for name, value in self._identity.items() if found.get(name) != value]
        if not differ:
            return None
        what = {
            "format": f"format {self._identity['format']} -> {found['format']}",
            "samples": f"{self._identity['samples']} -> {found['samples']} samples",
            "classes": "other classes",
            "fingerprint": "other records at the probed positions",
            "listing": "other keys, labels or checksums of its records",
        }
        reason = ", ".join(what[name] for name in differ)
        error = errors.DatasetChangedError(
            f"{self.path}: changed since the dataset was opened ({reason}); open it again"
        )
        error.path, error.reason = str(self.path), reason
        return error

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Tuple[Any, Any]:
        index = sample_index(index, self._len)
        native = self._handle()
        if self.decode == "numpy":
            import numpy  # noqa: PLC0415

            array, label, _key = native.decode(index)
            sample: Any = numpy.from_dlpack(array)
        else:
            payload, label, _key = native.read(index)
            sample = payload
            if self.decode == "pil":
                from PIL import Image  # noqa: PLC0415

                try:
                    sample = Image.open(io.BytesIO(payload)).convert("RGB")
                except Exception as e:  # PIL's own errors, a decompression bomb among them
                    bad = errors.BadSampleError(f"sample {index} ({_key}): PIL: {e}")
                    bad.index, bad.key, bad.reason, bad.path = index, _key, str(e), self.path
                    raise bad from e
        if self.transform is not None:
            sample = self.transform(sample)
        target: Any = label
        if self.target_transform is not None:
            target = self.target_transform(label)
        return sample, target

    def key(self, index: int) -> str:
        """The record's key (its path relative to the source root)."""
        return self._handle().key(index)

    # -- ImageFolder's attributes ----------------------------------------------------------------

    def _list(self) -> List[Tuple[str, int]]:
        if self._listing is None:
            self._listing = labelled_listing(self._handle(), self._paths)
        return self._listing

    @staticmethod
    def find_classes(directory: "str | os.PathLike[str]") -> Tuple[List[str], Dict[str, int]]:
        """The class directories of an ImageFolder tree, as ImageFolder finds them: the
        sub-directories of ``directory`` (symlinks followed), sorted by name."""
        classes = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())
        if not classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
        return classes, {name: i for i, name in enumerate(classes)}

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_native"] = None
        state["_pid"] = None
        state["_listing"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"imagefeed.Dataset({self.path!r}, {self.format}, {self._len} samples, {len(self.classes)} classes)"
