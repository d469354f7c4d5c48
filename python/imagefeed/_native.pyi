"""Types of the compiled extension (python/src): the Rust side that imagefeed's Python modules
wrap. Not a public API; use ``imagefeed.Loader``, ``imagefeed.Dataset`` and the functions in
``imagefeed.packing``."""

from os import PathLike
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

_Path = Union[str, PathLike[str]]
# What ``imagefeed._reading.reading_options`` makes: hdf5_images, hdf5_labels, label_base,
# num_classes, allow_missing_shards, storage_options (a list of (key, value) pairs), ranged_reads.
_Reading = Dict[str, Any]
# (index, key, reason, replaced_by, kind, while_replacing)
_BadTuple = Tuple[int, str, str, Optional[int], str, Optional[int]]

__version__: str

class HostArray:
    """Host memory shaped as an array, exported through DLPack (numpy/torch ``from_dlpack``)."""

    @property
    def shape(self) -> List[int]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def data_ptr(self) -> int: ...
    @property
    def views(self) -> int: ...
    def __dlpack__(
        self,
        *,
        stream: Optional[int] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...

class NativeDataset:
    def __init__(
        self,
        paths: Sequence[_Path],
        *,
        reading: Optional[_Reading] = None,
        max_pixels: Optional[int] = None,
    ) -> None: ...
    def __len__(self) -> int: ...
    @property
    def classes(self) -> List[str]: ...
    @property
    def format(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def listing(self) -> Optional[str]: ...
    @property
    def remote(self) -> bool: ...
    def read(self, index: int) -> Tuple[bytes, int, str]: ...
    def key(self, index: int) -> str: ...
    def decode(self, index: int) -> Tuple[HostArray, int, str]: ...
    def keys_and_labels(self) -> List[Tuple[str, int]]: ...

class NativeLoader:
    def __init__(
        self,
        paths: Sequence[_Path],
        *,
        batch_size: int,
        workers: int,
        seed: int,
        prefetch: int,
        shuffle: bool,
        drop_last: bool,
        rank: int,
        world_size: int,
        uneven: str,
        transform: Dict[str, Any],
        dtype: str,
        layout: str,
        bad_samples: str,
        max_bad: Union[int, float, None] = None,
        max_pixels: Optional[int] = None,
        reading: Optional[_Reading] = None,
        pinned_device: Optional[int] = None,
        shard_window: Optional[int] = None,
        scaled_decode: bool = True,
        batch_mix: Optional[Dict[str, Any]] = None,
    ) -> None: ...
    @property
    def num_samples(self) -> int: ...
    @property
    def classes(self) -> List[str]: ...
    @property
    def notices(self) -> List[str]: ...
    @property
    def format(self) -> str: ...
    @property
    def pool_allocations(self) -> int: ...
    @property
    def pinned_buffers(self) -> Optional[Tuple[int, int]]: ...
    @property
    def pool_bytes(self) -> int: ...
    def begin(self, epoch: int) -> int: ...
    def resume(self, state: str) -> Tuple[int, int, bool, Optional[str]]: ...
    @property
    def generation(self) -> int: ...
    def next_batch(
        self, generation: Optional[int] = None
    ) -> Optional[Tuple[HostArray, HostArray, List[int], List[_BadTuple]]]: ...
    def build_batch(
        self, epoch: int, indices: List[int]
    ) -> Tuple[HostArray, HostArray, List[int], List[_BadTuple]]: ...
    def rank_indices(self, epoch: int, continuing: bool = True) -> List[int]: ...
    def samples_per_rank(self, epoch: int, continuing: bool = True) -> int: ...
    def batches_per_rank(self, epoch: int, continuing: bool = True) -> int: ...
    def state(self, epoch: int, *, fresh: bool = False, handed: Optional[int] = None) -> str: ...
    def stop(self, handed: Optional[int] = None, generation: Optional[int] = None) -> None: ...
    def stats(self) -> Dict[str, float]: ...

def pack_dataset(
    source: _Path,
    out: _Path,
    *,
    format: str,
    resize: Optional[int] = None,
    quality: int = 90,
    raw: bool = False,
    strict: bool = False,
    resume: bool = False,
    force: bool = False,
    threads: Optional[int] = None,
    shard_bytes: Optional[int] = None,
    label_base: int = 0,
    part: Optional[Tuple[int, int]] = None,
    max_pixels: Optional[int] = None,
    quiet: bool = False,
    reading: Optional[_Reading] = None,
    restart_markers: bool = False,
    shared_headers: bool = False,
) -> str: ...
def join_parts(
    parts: Sequence[_Path],
    out: _Path,
    *,
    format: str,
    resume: bool = False,
    force: bool = False,
    threads: Optional[int] = None,
    shard_bytes: Optional[int] = None,
    label_base: int = 0,
    shared_headers: bool = False,
    quiet: bool = False,
) -> str: ...
def inspect_dataset(paths: Sequence[_Path], reading: Optional[_Reading] = None) -> str: ...
def verify_dataset(
    paths: Sequence[_Path],
    against: Optional[_Path] = None,
    reading: Optional[_Reading] = None,
) -> str: ...
def _augment_op(
    op: str,
    magnitude: float,
    pixels: bytes,
    width: int,
    height: int,
    fill: Tuple[int, int, int] = (0, 0, 0),
) -> bytes: ...
def _blur_op(kernel: Tuple[int, int], sigma: float, pixels: bytes, width: int, height: int) -> bytes: ...
def _color_op(op: str, factor: float, pixels: bytes, width: int, height: int) -> bytes: ...
def _check_timm_config(config_str: str) -> None: ...
def _timm_op(
    op: str,
    arg: float,
    pixels: bytes,
    width: int,
    height: int,
    fill: Tuple[int, int, int],
    resample: str,
) -> bytes: ...
def synthesize(
    root: _Path,
    *,
    classes: int = 10,
    per_class: int = 100,
    width: int = 64,
    height: int = 48,
    seed: int = 0,
    edge_cases: bool = False,
) -> int: ...

def pack_dataset_main(argv: Sequence[str]) -> int: ...
