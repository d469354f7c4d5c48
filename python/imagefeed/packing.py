"""Packing and checking datasets from Python: what ``pack-dataset`` does on the command line."""

from __future__ import annotations

import json
import os
from typing import Dict, Literal, Optional, Sequence, Tuple, Union

from . import _native, errors
from ._reading import DatasetPath, dataset_paths, reading_options
from .reports import Inspection, PackSummary, VerifyReport

__all__ = ["pack", "join", "inspect", "verify", "synthesize"]

PathLike = Union[str, "os.PathLike[str]"]
#: The formats a pack writes (``"h5"`` and ``"tfrecord"`` are aliases).
PackFormat = Literal["lmdb", "hdf5", "records", "h5", "tfrecord"]


def pack(
    source: PathLike,
    out: PathLike,
    format: PackFormat = "lmdb",
    *,
    resize: Optional[int] = None,
    quality: int = 90,
    raw: bool = False,
    restart_markers: bool = False,
    shared_headers: bool = False,
    strict: bool = False,
    resume: bool = False,
    force: bool = False,
    threads: Optional[int] = None,
    shard_bytes: Optional[int] = None,
    label_base: int = 0,
    part: Optional[Tuple[int, int]] = None,
    max_pixels: Optional[int] = None,
    progress: bool = True,
    hdf5_images: Optional[str] = None,
    hdf5_labels: Optional[str] = None,
    input_label_base: Optional[int] = None,
    num_classes: Optional[int] = None,
    allow_missing_shards: bool = False,
    storage_options: Optional[Dict[str, str]] = None,
    ranged_reads: bool = False,
) -> PackSummary:
    """Packs an ImageFolder tree (one sub-folder per class), or converts any dataset imagefeed
    reads, into ``out`` as ``format`` (``"lmdb"``, ``"hdf5"`` or ``"records"``). A source that
    other tools wrote is read with the options :class:`~imagefeed.Loader` takes
    (``hdf5_images``, ``hdf5_labels``, ``input_label_base``, ``num_classes``,
    ``allow_missing_shards``, ``storage_options``); ``label_base`` is the output's. ``out`` may
    be a URL (``s3://bucket/prefix``): the output is packed locally, then uploaded (nothing
    overwritten without ``force=True``; the manifest last, so a cut-short upload never opens).

    The output is built beside ``out`` and appears under its name only when complete; an
    interrupted pack continues with ``resume=True``. Files that are not usable images are left
    out and listed in the returned summary (``rejected``); ``strict=True`` fails on the first
    one instead. ``force=True`` replaces an existing imagefeed output (never anything else).
    ``resize`` shrinks images whose shorter side is longer (re-encoded at ``quality``); ``raw``
    stores decoded pixels. ``part=(i, n)`` packs the i-th of n shares of the source (join them
    with :func:`join`). A progress bar is drawn on stderr unless
    ``progress=False``.

    Returns the summary the CLI prints (also written beside the output as a report).

    Parameters
    ----------
    source : str or os.PathLike
        An ImageFolder tree, or any dataset imagefeed reads (then converted).
    out : str or os.PathLike
        The output path, or a URL in object storage.
    format : {"lmdb", "hdf5", "records"}, default "lmdb"
        The output format.
    resize : int, optional
        Shrink images whose shorter side is longer than this (re-encoded at ``quality``).
    quality : int, default 90
        JPEG quality of re-encoded images.
    raw : bool, default False
        Store decoded RGB pixels instead of the encoded files.
    restart_markers : bool, default False
        Rewrite each JPEG losslessly (the same pixels) with restart markers every ~32 pixels of
        each row, so that a RandomResizedCrop decodes only the blocks around its crop: crops
        decode faster, whole images ~7% slower, files grow ~2.5% (docs/formats.md).
    shared_headers : bool, default False
        LMDB output: store the bytes before each JPEG's image data (tables and headers, ~620
        bytes a file) once per dataset where files share them: CIFAR-size images pack to about
        a third of the size. imagefeed reads back the original files; other LMDB readers see
        the stored form (docs/formats.md).
    strict : bool, default False
        Fail on the first file that is not a usable image.
    resume, force : bool, default False
        Continue an interrupted pack; replace an existing output of imagefeed's.
    threads : int, optional
        Reading and checking threads (default: one per core).
    shard_bytes : int, optional
        Record shards: close a shard once it holds this many bytes.
    label_base : int, default 0
        Record shards: store ``label + label_base`` (ImageNet TFRecords use 1).
    part : (int, int), optional
        Pack only share ``i`` of ``n`` of the source (join the parts with :func:`join`).
    max_pixels : int, optional
        Decompression-bomb limit (default PIL's, 178,956,970).
    progress : bool, default True
        Draw a progress bar on stderr.
    hdf5_images, hdf5_labels, input_label_base, num_classes, allow_missing_shards, storage_options, ranged_reads
        How to read a source other tools wrote, as :class:`~imagefeed.Loader` takes them.
    """
    resize = errors.optional_whole_number("resize", resize, high=errors.U32_MAX)
    quality = errors.whole_number("quality", quality, high=255)
    threads = errors.optional_whole_number("threads", threads)
    shard_bytes = errors.optional_whole_number("shard_bytes", shard_bytes)
    label_base = errors.whole_number("label_base", label_base, high=errors.U32_MAX)
    max_pixels = errors.optional_whole_number("max_pixels", max_pixels)
    if part is not None:
        index, count = errors.pair("part", part, "index, count")
        part = (errors.whole_number("part index", index), errors.whole_number("part count", count))
    with errors.arguments("pack"):
        summary = _native.pack_dataset(
            os.fsdecode(source),
            os.fsdecode(out),
            format=format,
            resize=resize,
            quality=quality,
            raw=raw,
            restart_markers=restart_markers,
            shared_headers=shared_headers,
            strict=strict,
            resume=resume,
            force=force,
            threads=threads,
            shard_bytes=shard_bytes,
            label_base=label_base,
            part=part,
            max_pixels=max_pixels,
            quiet=not progress,
            reading=reading_options(
                hdf5_images, hdf5_labels, input_label_base, num_classes, allow_missing_shards, storage_options,
                ranged_reads,
            ),
        )
    result: PackSummary = json.loads(summary)
    return result


def join(
    parts: Sequence[PathLike],
    out: PathLike,
    format: PackFormat = "lmdb",
    *,
    resume: bool = False,
    force: bool = False,
    threads: Optional[int] = None,
    shard_bytes: Optional[int] = None,
    label_base: int = 0,
    shared_headers: bool = False,
    progress: bool = True,
) -> PackSummary:
    """Joins the parts of a split pack (``pack(src, part_i, part=(i, n))`` for each i, in any
    order, e.g. one per job of an array) into ``out``: the same dataset an unsplit pack would
    have written. Payloads are copied, not decoded again. Give the options of the output side
    the parts were packed with (``shard_bytes``, ``label_base`` for records).

    Parameters
    ----------
    parts : sequence of str or os.PathLike
        Every part, once each, in any order.
    out : str or os.PathLike
        The joined dataset's path.
    format : {"lmdb", "hdf5", "records"}, default "lmdb"
        The output format.
    resume, force : bool, default False
        Continue an interrupted join; replace an existing output of imagefeed's.
    threads : int, optional
        Copying threads (default: one per core).
    shard_bytes : int, optional
        Record shards: close a shard once it holds this many bytes.
    label_base : int, default 0
        Record shards: store ``label + label_base``.
    shared_headers : bool, default False
        LMDB output: store the JPEG headers files share once, as :func:`pack` does.
    progress : bool, default True
        Draw a progress bar on stderr.

    Returns
    -------
    PackSummary
        What :func:`pack` returns, for the joined dataset.
    """
    if isinstance(parts, (str, bytes, os.PathLike)):
        # A path is a sequence too: of its characters, the first of them "/".
        raise errors.ConfigError(
            f"join takes a list of parts, not one path ({os.fspath(parts)!r}): "
            "join([part0, part1, ...], out)"
        )
    threads = errors.optional_whole_number("threads", threads)
    shard_bytes = errors.optional_whole_number("shard_bytes", shard_bytes)
    label_base = errors.whole_number("label_base", label_base, high=errors.U32_MAX)
    with errors.arguments("join"):
        summary = _native.join_parts(
            [os.fsdecode(p) for p in parts], os.fsdecode(out), format=format, resume=resume, force=force,
            threads=threads, shard_bytes=shard_bytes, label_base=label_base,
            shared_headers=shared_headers, quiet=not progress,
        )
    result: PackSummary = json.loads(summary)
    return result


def inspect(
    path: DatasetPath,
    *,
    hdf5_images: Optional[str] = None,
    hdf5_labels: Optional[str] = None,
    label_base: Optional[int] = None,
    num_classes: Optional[int] = None,
    storage_options: Optional[Dict[str, str]] = None,
    ranged_reads: bool = False,
) -> Inspection:
    """What ``pack-dataset inspect`` shows: format, completeness (``missing_shards`` when a set
    lacks members), classes and their counts, image sizes, payload bytes, bad records. Takes the
    reading options :class:`~imagefeed.Loader` takes; ``report["whole"]`` is True when the
    dataset is complete and every record read. An interrupted pack of ours is reported
    incomplete (LMDB) or refused saying how to finish it (HDF5, records).

    Parameters
    ----------
    path : str, os.PathLike or sequence of them
        A dataset file or directory, a shard pattern or list, or a URL.
    hdf5_images, hdf5_labels, label_base, num_classes, storage_options, ranged_reads
        How to read a dataset other tools wrote, as :class:`~imagefeed.Loader` takes them.
        Shards missing from a set are reported (``missing_shards``), never refused.

    Returns
    -------
    Inspection
        The report (``imagefeed.reports.Inspection``).
    """
    reading = reading_options(
        hdf5_images, hdf5_labels, label_base, num_classes, storage_options=storage_options,
        ranged_reads=ranged_reads,
    )
    with errors.arguments("inspect"):
        report: Inspection = json.loads(_native.inspect_dataset(dataset_paths(path), reading))
    report["whole"] = bool(report.get("complete")) and not report.get("bad_record_count")
    return report


def verify(
    path: DatasetPath,
    against: Optional[PathLike] = None,
    *,
    hdf5_images: Optional[str] = None,
    hdf5_labels: Optional[str] = None,
    label_base: Optional[int] = None,
    num_classes: Optional[int] = None,
    allow_missing_shards: bool = False,
    storage_options: Optional[Dict[str, str]] = None,
    ranged_reads: bool = False,
) -> VerifyReport:
    """Decodes every record (and, with ``against``, compares each with the ImageFolder tree it
    was packed from). Takes the reading options :class:`~imagefeed.Loader` takes.

    Parameters
    ----------
    path : str, os.PathLike or sequence of them
        A dataset file or directory, a shard pattern or list, or a URL.
    against : str or os.PathLike, optional
        The ImageFolder tree the dataset was packed from: every record must be its file
        (byte for byte; pixel for pixel for raw, resized or ``restart_markers`` packs), with
        its label, in its order, and no file missing.
    hdf5_images, hdf5_labels, label_base, num_classes, allow_missing_shards, storage_options, ranged_reads
        How to read a dataset other tools wrote, as :class:`~imagefeed.Loader` takes them.

    Returns
    -------
    VerifyReport
        The report; ``report["ok"]`` is True when no problem was found.
    """
    reading = reading_options(
        hdf5_images, hdf5_labels, label_base, num_classes, allow_missing_shards, storage_options,
        ranged_reads,
    )
    with errors.arguments("verify"):
        report: VerifyReport = json.loads(
            _native.verify_dataset(dataset_paths(path), None if against is None else os.fsdecode(against), reading)
        )
    report["ok"] = not report.get("problem_count")
    return report


def synthesize(
    root: PathLike,
    *,
    classes: int = 10,
    per_class: int = 100,
    size: Tuple[int, int] = (64, 48),
    seed: int = 0,
    edge_cases: bool = False,
) -> int:
    """Writes a synthetic ImageFolder tree of ``classes`` x ``per_class`` JPEGs of ``size``
    (width, height) under ``root`` (what ``pack-dataset synth`` makes: deterministic for a seed).
    ``edge_cases`` adds grayscale, CMYK, progressive and PNG files and broken ones (truncated,
    empty, text, a decompression bomb).

    Parameters
    ----------
    root : str or os.PathLike
        Where the tree goes (created; files at the names it writes are replaced).
    classes, per_class : int, default 10 and 100
        Class folders, and images in each.
    size : (int, int), default (64, 48)
        Width and height of every image.
    seed : int, default 0
        The tree is a function of the seed.
    edge_cases : bool, default False
        Add the unusual and broken files listed above.

    Returns
    -------
    int
        The number of image files written.
    """
    width, height = errors.pair("size", size, "width, height")
    width = errors.whole_number("width", width, high=errors.U32_MAX)
    height = errors.whole_number("height", height, high=errors.U32_MAX)
    with errors.arguments("synthesize"):
        return _native.synthesize(
            os.fsdecode(root), classes=errors.whole_number("classes", classes),
            per_class=errors.whole_number("per_class", per_class), width=width, height=height,
            seed=errors.whole_number("seed", seed), edge_cases=edge_cases,
        )
