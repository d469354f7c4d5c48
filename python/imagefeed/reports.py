"""The shapes of the reports imagefeed returns as plain dicts: what :func:`~imagefeed.pack`,
:func:`~imagefeed.join`, :func:`~imagefeed.inspect`, :func:`~imagefeed.verify`,
:meth:`Loader.stats <imagefeed.Loader.stats>` and :meth:`Loader.state_dict
<imagefeed.Loader.state_dict>` give. They are ``TypedDict`` s: at run time ordinary dicts (JSON
types, for logging and ``torch.save``), to a type checker their keys and value types."""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, TypedDict

__all__ = [
    "Rejection",
    "PackSummary",
    "ClassCount",
    "Spread",
    "SizeCount",
    "SharedHeaders",
    "BadRecord",
    "Inspection",
    "Problem",
    "VerifyReport",
    "LoaderStats",
    "LoaderState",
]


class Rejection(TypedDict):
    """A source file left out of a pack: its key (path under the source) and why."""

    key: str
    reason: str


class _PackSummaryOptional(TypedDict, total=False):
    notices: List[str]
    """What opening the source reported (e.g. an index built for a TFRecord shard)."""


class PackSummary(_PackSummaryOptional):
    """What :func:`~imagefeed.pack` and :func:`~imagefeed.join` return (and write beside the
    output as ``OUT.report.json``)."""

    source: str
    output: str
    format: str
    samples: int
    classes: int
    payload_bytes: int
    file_bytes: int
    rejected: List[Rejection]
    skipped_non_images: int
    dropped_records: int
    """Records of a dataset source left out (unreadable or not images); 0 for a folder."""
    resumed_from: int
    seconds: float
    images_per_sec: float


class ClassCount(TypedDict):
    name: str
    count: int


class Spread(TypedDict):
    """Minimum, median (the lower middle) and maximum of a dimension."""

    min: int
    median: int
    max: int


class SizeCount(TypedDict):
    width: int
    height: int
    count: int


class BadRecord(TypedDict):
    """A record that could not be read or parsed: its index, key (``#index`` if unreadable) and
    why."""

    index: int
    key: str
    reason: str


class SharedHeaders(TypedDict):
    """The JPEG headers an LMDB packed with ``shared_headers=True`` stores once for its samples:
    how many, their bytes, and how many fail their check (each sample using one is a bad
    record)."""

    headers: int
    bytes: int
    damaged: int


class _InspectionOptional(TypedDict, total=False):
    notices: List[str]
    shared_headers: SharedHeaders
    """Present for an LMDB packed with ``shared_headers=True``."""
    missing_shards: List[str]
    """Members missing from the dataset's shard set (the first of them)."""
    missing_shard_count: int
    empty_shards: int
    cut_shards: int
    short_shards: int
    """Shards holding under half the samples the set's others hold (a TFRecord or tar set, the
    last shard not compared): a shard cut between two records looks so. ``complete`` stays
    true (uneven shards are legal); the notices name them."""


class Inspection(_InspectionOptional):
    """What :func:`~imagefeed.inspect` returns."""

    path: str
    format: str
    complete: bool
    """False for an interrupted pack or a shard set with members missing, empty or cut."""
    num_samples: int
    payload: str
    """``"encoded"`` (image files as packed) or ``"raw-rgb8"`` (decoded pixels)."""
    resized_short_side: Optional[int]
    restart_markers: bool
    """True when the JPEGs were rewritten with restart markers at pack time (same pixels)."""
    classes: List[ClassCount]
    payload_bytes: int
    file_bytes: int
    width: Spread
    height: Spread
    common_sizes: List[SizeCount]
    payload_formats: Dict[str, int]
    bad_records: List[BadRecord]
    """The first 1,000 records that could not be read or parsed."""
    bad_record_count: int
    """How many records could not be read or parsed in all."""
    rejected_at_pack: Optional[int]
    whole: bool
    """True when the dataset is complete and every record read (added in Python)."""


class Problem(TypedDict):
    """One thing wrong: the record's index (None when not about one record), its key or source
    path, its kind (``"unreadable"``: the record could not be read; ``"undecodable"``: its
    image does not decode; ``"mismatch"``: the dataset differs from its source tree), and what
    is wrong."""

    index: Optional[int]
    key: str
    kind: Literal["unreadable", "undecodable", "mismatch"]
    problem: str


class VerifyReport(TypedDict):
    """What :func:`~imagefeed.verify` returns."""

    dataset: str
    against: Optional[str]
    checked: int
    source_rejects: int
    problems: List[Problem]
    """The first 1,000 problems, by record."""
    problem_count: int
    """How many problems were found in all."""
    ok: bool
    """True when no problem was found (added in Python)."""


class LoaderStats(TypedDict):
    """What :meth:`Loader.stats <imagefeed.Loader.stats>` returns: stage times in seconds,
    summed over workers, and counts."""

    read_s: float
    decode_s: float
    transform_s: float
    collate_s: float
    wait_s: float
    samples: int
    batches: int
    bad_samples: int
    #: Samples whose JPEG was decoded together with others of its batch (small JPEGs that
    #: share their headers, such as CIFAR's: the same pixels, less fixed cost per image).
    stacked: int
    pool_allocations: int
    pool_bytes: int


class LoaderState(TypedDict):
    """What :meth:`Loader.state_dict <imagefeed.Loader.state_dict>` returns: the position in
    JSON types, under one key (its fields are the loader's, versioned)."""

    imagefeed_loader_state: Dict[str, Any]
