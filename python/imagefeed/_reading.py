"""How a dataset is named and read: one place for the options every call that opens a dataset
takes (``Loader``, ``Dataset``, ``inspect``, ``verify``, ``pack``), as the CLI's commands share
theirs."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

from . import errors

if TYPE_CHECKING:
    from . import _native

PathLike = Union[str, "os.PathLike[str]"]
#: A dataset: one path (a file, a directory, or a pattern such as ``"DIR/train-*"``), or a list
#: of shard files read as one dataset.
DatasetPath = Union[PathLike, Sequence[PathLike]]


def dataset_paths(path: DatasetPath) -> List[str]:
    """The path (or paths) a dataset argument names, as strings."""
    if isinstance(path, (str, bytes, os.PathLike)):
        return [os.fsdecode(os.fspath(path))]
    try:
        paths = [os.fsdecode(os.fspath(p)) for p in path]
    except TypeError:
        raise errors.ConfigError(
            f"path {path!r}: a path, a pattern, or a list of shard files"
        ) from None
    if not paths:
        raise errors.ConfigError("path: an empty list of files")
    return paths


def reading_options(
    hdf5_images: Optional[str] = None,
    hdf5_labels: Optional[str] = None,
    label_base: Optional[int] = None,
    num_classes: Optional[int] = None,
    allow_missing_shards: bool = False,
    storage_options: Optional[Dict[str, str]] = None,
    ranged_reads: bool = False,
) -> Dict[str, object]:
    """The reading options as the native calls take them (checked there):

    - ``hdf5_images``/``hdf5_labels``: the datasets of an h5py file holding images and labels;
    - ``label_base``: TFRecord shards without an imagefeed manifest store class + this
      (ImageNet TFRecords: 1); ``num_classes``: their class count (else found by a scan);
    - ``allow_missing_shards``: read a set of shards (``NAME-NNNNN-of-TTTTT``) with members
      missing, on purpose, instead of raising :class:`~imagefeed.errors.ShardSetError`;
    - ``storage_options``: object storage client options over the environment's, in
      object_store's names (``{"aws_endpoint": "http://127.0.0.1:9000",
      "aws_access_key_id": ..., "aws_secret_access_key": ...}``; ``max_retries`` and
      ``retry_timeout`` in seconds bound transfers' retries);
    - ``ranged_reads``: a dataset in object storage is read record by record, one ranged GET
      each, instead of its shards being fetched whole into the cache (record shards with their
      index; other formats in object storage raise :class:`~imagefeed.errors.ConfigError`).
      Each read waits a round trip; a worker starts its batch's reads together.
    """
    for flag, setting in (("allow_missing_shards", allow_missing_shards), ("ranged_reads", ranged_reads)):
        if not isinstance(setting, bool):
            raise errors.ConfigError(f"{flag} {setting!r}: must be True or False")
    label_base = errors.optional_whole_number("label_base", label_base, high=errors.U32_MAX)
    num_classes = errors.optional_whole_number("num_classes", num_classes)
    if storage_options is not None and (
        not isinstance(storage_options, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in storage_options.items())
    ):
        raise errors.ConfigError(f"storage_options {storage_options!r}: must be a dict of str to str")
    return dict(
        hdf5_images=hdf5_images,
        hdf5_labels=hdf5_labels,
        label_base=label_base,
        num_classes=num_classes,
        allow_missing_shards=allow_missing_shards,
        storage_options=sorted((storage_options or {}).items()),
        ranged_reads=ranged_reads,
    )


def sample_index(index: Any, length: int) -> int:
    """``index`` as an ``int`` in ``-length..length`` (negative counts from the end), taken as a
    list takes it: ``TypeError`` for what is not an integer, ``IndexError`` out of range."""
    if isinstance(index, bool) or not isinstance(index, int):
        try:
            index = index.__index__()
        except AttributeError:
            raise TypeError(f"dataset indices must be integers, not {type(index).__name__}") from None
    if not -length <= index < length:
        raise IndexError(f"index {index} is out of range for a dataset of {length} samples")
    return int(index)


def labelled_listing(native: "_native.NativeDataset", paths: Sequence[str]) -> List[Tuple[str, int]]:
    """Every record's ``(path, label)``: an image folder's file paths, else the keys the records
    were packed from (reading every record once)."""
    listing = native.keys_and_labels()
    if native.format == "folder" and len(paths) == 1:
        root = os.fspath(paths[0])
        listing = [(os.path.join(root, key), label) for key, label in listing]
    return listing


class ImageFolderListing:
    """ImageFolder's ``samples``, ``imgs`` and ``targets``, from the class's ``_list()``."""

    def _list(self) -> List[Tuple[str, int]]:
        raise NotImplementedError

    @property
    def samples(self) -> List[Tuple[str, int]]:
        """``(path, label)`` of every sample in index order: the file's path for an image
        folder (as ImageFolder's ``samples``), the key it was packed from for a packed file."""
        return list(self._list())

    @property
    def imgs(self) -> List[Tuple[str, int]]:
        """The same as :attr:`samples` (ImageFolder's older name)."""
        return self.samples

    @property
    def targets(self) -> List[int]:
        """Every sample's label, in index order."""
        return [label for _, label in self._list()]
