"""The exceptions imagefeed raises.

Every error from the Rust library arrives as one of these, with the message the library wrote
(naming the file, the record key and the reason) and, as attributes, what that message names:
``path``, ``key``, ``index`` and ``reason`` where the error has them (``None`` otherwise), and a
few more on the classes below. Catch :class:`Error` for everything imagefeed raises.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Iterator, List, Optional, Tuple

__all__ = [
    "Error",
    "DataError",
    "DatasetNotFoundError",
    "FileError",
    "IncompleteDatasetError",
    "DatasetChangedError",
    "ShardSetError",
    "UnsupportedDataError",
    "CacheFullError",
    "BadSampleError",
    "TooManyBadSamplesError",
    "ShapeMismatchError",
    "RejectedFileError",
    "OutputExistsError",
    "ConfigError",
    "StateMismatchError",
    "CudaError",
    "OutOfMemoryError",
    "PoolGrowthWarning",
    "ResumeWarning",
    "RankWarning",
]


class Error(Exception):
    """Base class of every imagefeed error."""

    # The path or URL as given (a list for a dataset opened from several files).
    path: str | list[str] | None = None
    key: str | None = None
    index: int | None = None
    reason: str | None = None


class DataError(Error):
    """A dataset, record or image is unreadable or malformed."""


class DatasetNotFoundError(DataError, FileNotFoundError):
    """The path does not exist."""


class FileError(Error, OSError):
    """An operating-system error on a file (``errno`` is set when the system gave one)."""



class DatasetChangedError(DataError):
    """The dataset's file (or object in storage) changed after it was opened: replaced or
    rewritten, so reading on would mix two versions. Open the dataset again."""


class IncompleteDatasetError(DataError):
    """The dataset was never finished: an interrupted or failed pack (resume it, or pack again)."""


class ShardSetError(DataError):
    """The shard files named are not one whole set: several sets in one directory (pick one
    with a pattern such as ``"DIR/train-*"``), members missing (``missing`` lists them;
    ``allow_missing_shards=True`` reads the rest on purpose), or, raised by a new ``Loader``,
    shards cut short that lost more records than ``max_bad`` allows (``max_bad=None`` reads
    the rest on purpose)."""

    missing: List[str] = []


class UnsupportedDataError(DataError):
    """The dataset stores its records in a way this build cannot read (an HDF5 compression
    filter without a plugin, say): raised at open, with what to do, instead of every record
    reading as bad."""


class CacheFullError(Error, OSError):
    """The cache directory (``IMAGEFEED_CACHE_DIR``) has no room for an entry, within
    ``IMAGEFEED_CACHE_LIMIT`` or the disk's free space."""


class BadSampleError(DataError):
    """A sample could not be read or decoded (``bad_samples="error"``).

    ``kind`` says what kind of failure (see :class:`imagefeed.BadSample`) when the loader
    raised it."""

    kind: str | None = None


class TooManyBadSamplesError(BadSampleError):
    """More bad samples in an epoch than ``max_bad`` allows.

    ``count`` bad samples after ``seen`` samples, over ``limit``; ``key``/``index``/``reason`` are
    the last bad sample's, and ``keys`` (set by the loader) lists every bad key of the epoch.
    """

    count: int | None = None
    seen: int | None = None
    limit: str | None = None
    keys: List[str] = []


class ShapeMismatchError(DataError):
    """Images of different sizes in one batch with no resizing transform (``first_key`` and ``key``)."""

    first_key: str | None = None


class RejectedFileError(DataError):
    """A strict pack stopped at a file that is not a usable image."""


class OutputExistsError(Error, FileExistsError):
    """The output exists (pass ``force=True`` to replace an imagefeed output), or is not ours to replace."""


class ConfigError(Error, ValueError):
    """Settings no loader or pack can run with."""


class StateMismatchError(ConfigError):
    """A ``state_dict`` saved with other settings or another dataset: ``setting`` was ``saved``, is ``current``."""

    setting: str | None = None
    saved: str | None = None
    current: str | None = None


class CudaError(Error):
    """No usable CUDA driver or device, or a CUDA call failed."""


class OutOfMemoryError(Error, MemoryError):
    """Memory for a batch could not be had (``bytes`` of it): out of memory or over ``ulimit -v``."""

    bytes: int | None = None


class PoolGrowthWarning(UserWarning):
    """Batches kept alive from Python make the loader allocate new batch buffers (correct, but uses memory)."""


class RankWarning(UserWarning):
    """A :class:`~imagefeed.Loader` given ``world_size`` runs in a ``torch.distributed`` process group
    of another size."""


class ResumeWarning(UserWarning):
    """``Loader.set_epoch`` named another epoch than the one ``load_state_dict`` restored a position
    in: the restored position was dropped."""


U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


def whole_number(name: str, value: object, *, low: int = 0, high: int = U64_MAX) -> int:
    """``value`` as an ``int`` in ``low..=high`` (Python and NumPy integers; never a bool), else a
    :class:`ConfigError` naming the setting ``name``."""
    if not isinstance(value, bool) and hasattr(type(value), "__index__"):
        number = operator.index(value)  # type: ignore[arg-type]
        if low <= number <= high:
            return number
    raise ConfigError(f"{name} {value!r}: must be an int in {low}..{high}")


def pair(name: str, value: Any, what: str) -> Tuple[object, object]:
    """``value`` as its two items (anything of length two but a string: a tuple, a list, a
    NumPy array), else a :class:`ConfigError` naming the setting ``name`` and ``what`` the
    two are."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise ConfigError(f"{name} {value!r}: must be a pair ({what})")
    return value[0], value[1]


def optional_whole_number(name: str, value: object, *, low: int = 0, high: int = U64_MAX) -> Optional[int]:
    """:func:`whole_number`, with ``None`` passed through."""
    return None if value is None else whole_number(name, value, low=low, high=high)


@contextlib.contextmanager
def arguments(what: str) -> Iterator[None]:
    """Turns the conversion errors of arguments handed to the native layer (an int out of range,
    a value of the wrong type) into a :class:`ConfigError` naming ``what`` was called."""
    try:
        yield
    except (OverflowError, TypeError) as e:
        raise ConfigError(f"invalid {what} argument: {e}") from None
