"""imagefeed.Loader from Python: batches, zero copy, determinism, resume, sharding, bad samples,
errors and Ctrl-C. NumPy output (no torch needed); tests/test_torch.py covers torch output."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
from conftest import FIXTURE_TREE, FLIP_NORMALIZE, default_sigint, epoch_digest

import imagefeed
from imagefeed import transforms as T


def loader(path, **kw):
    kw.setdefault("batch_size", 16)
    kw.setdefault("workers", 2)
    kw.setdefault("output", "numpy")
    kw.setdefault("transform", FLIP_NORMALIZE)
    kw.setdefault("rank", 0)
    kw.setdefault("world_size", 1)
    return imagefeed.Loader(path, **kw)


# -- batches ------------------------------------------------------------------------------------


def test_batches_have_the_shape_dtype_strides_and_labels_of_the_epoch(lmdb_path):
    l = loader(lmdb_path, batch_size=32)
    assert len(l) == 8  # 240 samples / 32, last batch short
    assert l.classes == [f"class{i:02d}" for i in range(6)]
    sizes, labels = [], []
    for images, y in l:
        n = len(y)
        assert images.shape == (n, 3, 24, 32)
        assert images.dtype == np.float32 and y.dtype == np.int64
        assert images.flags["C_CONTIGUOUS"]
        assert images.strides == (3 * 24 * 32 * 4, 24 * 32 * 4, 32 * 4, 4)
        sizes.append(n)
        labels.extend(y.tolist())
    assert sizes == [32] * 7 + [16]
    # Every sample once: each class's 40 images.
    assert sorted(labels) == sorted([c for c in range(6) for _ in range(40)])


def test_uint8_nhwc_holds_the_decoded_pixels(lmdb_path):
    l = loader(lmdb_path, transform=T.none(), dtype="uint8", layout="NHWC", shuffle=False)
    ds = imagefeed.Dataset(lmdb_path, decode="numpy")
    images, labels = next(iter(l))
    assert images.shape == (16, 24, 32, 3) and images.dtype == np.uint8
    for i in range(16):
        pixels, label = ds[i]
        np.testing.assert_array_equal(images[i], pixels)
        assert labels[i] == label


def test_float16_and_normalization_match_the_float32_output(lmdb_path):
    a = next(iter(loader(lmdb_path, dtype="float32", shuffle=False)))[0]
    b = next(iter(loader(lmdb_path, dtype="float16", shuffle=False)))[0]
    assert b.dtype == np.float16
    np.testing.assert_allclose(b.astype(np.float32), a, atol=2e-2)
    # Normalized with the CIFAR statistics: (x/255 - mean)/std spans about [-2, 2.1].
    assert a.min() < -1.5 and a.max() > 1.5


# -- zero copy ----------------------------------------------------------------------------------


def test_arrays_view_the_pool_buffer_and_buffers_are_reused(lmdb_path):
    l = loader(lmdb_path, output="dlpack", prefetch=2)
    pointers = set()
    with warnings.catch_warnings():
        warnings.simplefilter("error", imagefeed.PoolGrowthWarning)
        for _epoch in range(3):
            for images, labels in l:
                array = np.from_dlpack(images)
                assert array.ctypes.data == images.data_ptr, "the array is a view, not a copy"
                assert np.from_dlpack(labels).ctypes.data == labels.data_ptr
                pointers.add(images.data_ptr)
                del array, images, labels
    # Three epochs of 15 batches went through a handful of buffers: never more than the loader
    # needs with nothing kept (prefetch + 2), however far the workers run ahead of this loop (a
    # 16-core machine allocated its third in the second epoch, so no count per epoch is fixed).
    allocations = l.stats()["pool_allocations"]
    assert len(pointers) <= allocations <= 2 + 2


def test_kept_arrays_stay_intact_and_the_pool_grows_with_one_warning(lmdb_path):
    reference = [(x.copy(), y.copy()) for x, y in loader(lmdb_path)]
    l = loader(lmdb_path, prefetch=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = list(l)  # every batch kept alive
        kept += list(loader(lmdb_path, prefetch=2))  # a second loader, its own warning
    growth = [w for w in caught if issubclass(w.category, imagefeed.PoolGrowthWarning)]
    assert len(growth) == 2, [str(w.message) for w in caught]
    assert "kept alive" in str(growth[0].message)
    assert l.stats()["pool_allocations"] == len(l)
    for (x, y), (rx, ry) in zip(kept, reference):
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)
    # Released arrays give their buffers back: the next epoch allocates nothing new.
    del kept
    gc.collect()
    before = l.stats()["pool_allocations"]
    for _ in l:
        pass
    assert l.stats()["pool_allocations"] == before


def test_dlpack_refuses_what_it_cannot_do(lmdb_path):
    images, _ = next(iter(loader(lmdb_path, output="dlpack")))
    assert images.__dlpack_device__() == (1, 0)
    with pytest.raises(BufferError):
        images.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        images.__dlpack__(dl_device=(2, 0))
    with pytest.raises(ValueError):
        images.__dlpack__(stream=1)
    # An unconsumed capsule is freed by its destructor (no leak, no crash); versioned ones too.
    capsule = images.__dlpack__(max_version=(1, 0))
    assert "dltensor_versioned" in repr(capsule)
    assert images.views == 2
    del capsule
    gc.collect()
    assert images.views == 1


# -- determinism, resume, sharding --------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 4])
def test_epoch_digests_equal_the_rust_loaders(lmdb_path, bench, workers):
    l = loader(lmdb_path, batch_size=32, workers=workers, seed=5, bad_samples="skip")
    out = subprocess.run(
        [bench, "load", str(lmdb_path), "--workers", str(workers), "--batch-size", "32",
         "--epochs", "2", "--seed", "5", "--transform", "cifar", "--digest"],
        check=True, capture_output=True, text=True,
    ).stdout
    rust = re.findall(r"sha256 ([0-9a-f]{64})", out)
    assert len(rust) == 2, out
    python = []
    for epoch in range(2):
        l.set_epoch(epoch)
        python.append(epoch_digest(l))
    assert python == rust
    assert python[0] != python[1], "epochs are shuffled differently"


def test_the_stream_does_not_depend_on_workers_or_prefetch(lmdb_path):
    digests = {epoch_digest(loader(lmdb_path, workers=w, prefetch=p, seed=9, transform=T.imagenet_train(16)))
               for w, p in [(1, 1), (2, 4), (4, 2), (0, 2)]}
    assert len(digests) == 1, "workers=0 (built in the calling thread) included"


def test_epochs_advance_by_themselves_and_set_epoch_picks_one(lmdb_path):
    l = loader(lmdb_path, seed=1)
    first, second = epoch_digest(l), epoch_digest(l)
    assert first != second
    l.set_epoch(0)
    assert epoch_digest(l) == first
    assert l.epoch == 0


RESUME_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    import imagefeed
    from imagefeed import transforms as T
    from conftest import epoch_digest
    l = imagefeed.Loader({path!r}, batch_size=16, workers=3, output="numpy", seed=11,
                         transform=T.imagenet_train(16), rank=0, world_size=1)
    l.load_state_dict(json.loads(sys.stdin.read()))
    print(epoch_digest(l))
    print(epoch_digest(l))
    """
)


def test_a_state_dict_resumes_the_exact_remaining_batches_in_a_new_process(lmdb_path):
    def make():
        return loader(lmdb_path, workers=2, seed=11, transform=T.imagenet_train(16))

    l = make()
    l.set_epoch(3)
    full = [(x.copy(), y.copy()) for x, y in l]
    next_epoch = epoch_digest(l)

    l = make()
    l.set_epoch(3)
    it = iter(l)
    for _ in range(6):
        next(it)
    state = l.state_dict()
    json.dumps(state)  # plain JSON types
    assert state["imagefeed_loader_state"]["epoch"] == 3
    assert state["imagefeed_loader_state"]["next_batch"] == 6
    del it

    script = RESUME_SCRIPT.format(tests=str(__import__("pathlib").Path(__file__).parent), path=str(lmdb_path))
    out = subprocess.run([sys.executable, "-c", script], input=json.dumps(state), check=True,
                         capture_output=True, text=True).stdout.split()
    assert out[0] == epoch_digest(full[6:]), "the new process gave exactly the batches after the sixth"
    assert out[1] == next_epoch, "and then the next epoch"


def test_the_usual_set_epoch_loop_after_a_restore_continues_mid_epoch(lmdb_path):
    """#32 finding 1: the README's loop (``for epoch in range(start, end): loader.set_epoch(epoch)``)
    after ``load_state_dict`` used to restart the restored epoch from its first batch, training
    on its first batches twice without a word."""
    reference = loader(lmdb_path, seed=5)
    reference.set_epoch(2)
    full = [(x.copy(), y.copy()) for x, y in reference]
    reference.set_epoch(3)
    after = epoch_digest(reference)

    l = loader(lmdb_path, seed=5)
    l.set_epoch(2)
    it = iter(l)
    for _ in range(4):
        next(it)
    state = l.state_dict()
    del it
    start_epoch = state["imagefeed_loader_state"]["epoch"]  # what a script keeps beside it

    resumed = loader(lmdb_path, seed=5)
    resumed.load_state_dict(state)
    got = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loop the README shows warns about nothing
        for epoch in range(start_epoch, start_epoch + 2):
            resumed.set_epoch(epoch)
            got[epoch] = [(x.copy(), y.copy()) for x, y in resumed]
    assert epoch_digest(got[2]) == epoch_digest(full[4:]), "the rest of epoch 2, not all of it"
    assert epoch_digest(got[3]) == after


def test_a_state_saved_at_an_epochs_end_resumes_the_usual_loop_with_the_next_epoch(lmdb_path):
    """Found by review: a checkpoint taken after an epoch's last batch, restored, then the loop's
    set_epoch(e) replayed all of epoch e. Its loop is empty now, and the next one is e + 1."""
    l = loader(lmdb_path, seed=6)
    l.set_epoch(0)
    for _ in l:
        pass
    state = l.state_dict()
    start_epoch = state["imagefeed_loader_state"]["epoch"]
    assert start_epoch == 0
    reference = loader(lmdb_path, seed=6)
    reference.set_epoch(1)
    after = epoch_digest(reference)
    resumed = loader(lmdb_path, seed=6)
    resumed.load_state_dict(state)
    got = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for epoch in range(start_epoch, start_epoch + 2):
            resumed.set_epoch(epoch)
            assert resumed.epoch == epoch
            got[epoch] = [(x.copy(), y.copy()) for x, y in resumed]
    assert got[0] == [], "epoch 0 had no batch left"
    assert epoch_digest(got[1]) == after
    # Without set_epoch, the next loop is epoch 1 as before.
    plain = loader(lmdb_path, seed=6)
    plain.load_state_dict(state)
    assert plain.epoch == 1 and epoch_digest(plain) == after


def test_a_refused_state_leaves_the_loader_as_it_was(lmdb_path, tmp_path):
    """Found by review: a loader made with seed=None took the seed of a state it then refused
    (another dataset), and its checkpoints no longer described what it trained on."""
    l = loader(lmdb_path, seed=None)
    drawn = l.seed
    it = iter(l)
    next(it)
    next(it)
    before = l.state_dict()
    other_tree = tmp_path / "other"
    imagefeed.synthesize(other_tree, classes=2, per_class=8, size=(32, 24), seed=1)
    foreign = loader(other_tree, seed=123).state_dict()
    with pytest.raises(imagefeed.StateMismatchError):
        l.load_state_dict(foreign)
    assert l.seed == drawn
    assert l.state_dict() == before
    next(it)  # the loop in progress goes on
    assert l.state_dict()["imagefeed_loader_state"]["next_batch"] == 3


def test_set_epoch_with_another_epoch_after_a_restore_warns_and_starts_that_epoch(lmdb_path):
    l = loader(lmdb_path, seed=5)
    l.set_epoch(2)
    it = iter(l)
    next(it)
    state = l.state_dict()
    del it
    resumed = loader(lmdb_path, seed=5)
    resumed.load_state_dict(state)
    with pytest.warns(imagefeed.ResumeWarning, match="epoch 2"):
        resumed.set_epoch(7)
    assert resumed.epoch == 7
    reference = loader(lmdb_path, seed=5)
    reference.set_epoch(7)
    assert epoch_digest(resumed) == epoch_digest(reference)


def test_seed_none_draws_a_seed_that_state_dict_carries_into_a_new_loader(lmdb_path):
    """#32 finding 6: seed=None (as torch users write it) was refused."""
    a, b = loader(lmdb_path, seed=None), loader(lmdb_path, seed=None)
    assert isinstance(a.seed, int) and 0 <= a.seed < 2**64
    assert a.seed != b.seed, "each loader draws its own"
    a.set_epoch(1)
    it = iter(a)
    first = [(x.copy(), y.copy()) for _, (x, y) in zip(range(3), it)]
    state = a.state_dict()
    del it
    assert state["imagefeed_loader_state"]["seed"] == a.seed
    reference = loader(lmdb_path, seed=a.seed)
    reference.set_epoch(1)
    whole = [(x.copy(), y.copy()) for x, y in reference]
    # A new run made with seed=None takes the saved seed back and continues the epoch.
    b.load_state_dict(state)
    assert b.seed == a.seed
    assert epoch_digest(first + [(x.copy(), y.copy()) for x, y in b]) == epoch_digest(whole)
    # A seed given explicitly is kept, and a state of another seed still refused.
    with pytest.raises(imagefeed.StateMismatchError):
        loader(lmdb_path, seed=a.seed ^ 1).load_state_dict(state)


def test_a_state_from_a_finished_epoch_starts_the_next_one(lmdb_path):
    l = loader(lmdb_path, seed=2)
    epoch_digest(l)
    state = l.state_dict()
    expected = epoch_digest(l)
    fresh = loader(lmdb_path, seed=2)
    fresh.load_state_dict(state)
    assert epoch_digest(fresh) == expected


def test_a_state_from_other_settings_is_refused_naming_the_setting(lmdb_path):
    state = loader(lmdb_path, seed=1).state_dict()
    with pytest.raises(imagefeed.StateMismatchError) as e:
        loader(lmdb_path, seed=2).load_state_dict(state)
    assert (e.value.setting, e.value.saved, e.value.current) == ("seed", "1", "2")
    with pytest.raises(imagefeed.StateMismatchError) as e:
        loader(lmdb_path, seed=1, shuffle=False).load_state_dict(state)
    assert e.value.setting == "shuffle"
    with pytest.raises(imagefeed.ConfigError):
        loader(lmdb_path).load_state_dict({"something": "else"})


@pytest.mark.parametrize(
    "key, value, said",
    [("seed", None, "seed: invalid type: null"), ("epoch", 2**64, "epoch: invalid type"),
     ("next_batch", float("nan"), "next_batch: "), ("start", -1, "start: invalid value"),
     ("rank", 2, "rank (2) must be below its world size (1)")],
)
def test_a_damaged_state_is_refused_naming_its_key(lmdb_path, key, value, said):
    # A hostile try met "invalid type: null, expected u64 at line 1 column 27", the place in a
    # JSON text it never saw.
    state = loader(lmdb_path, seed=1).state_dict()
    state["imagefeed_loader_state"][key] = value
    with pytest.raises(imagefeed.ConfigError) as e:
        loader(lmdb_path, seed=1).load_state_dict(state)
    assert said in str(e.value) and "column" not in str(e.value), str(e.value)
    del state["imagefeed_loader_state"][key]
    with pytest.raises(imagefeed.ConfigError, match=f"missing field `{key}`"):
        loader(lmdb_path, seed=1).load_state_dict(state)


def test_a_state_resumes_at_another_batch_size_mid_epoch_or_at_its_end(lmdb_path):
    """#32 finding 4: a checkpoint refused a loader of another batch size, even at an epoch's end."""
    def labels_of(batches):
        return [(x[i].tobytes(), int(y[i])) for x, y in batches for i in range(len(y))]

    reference = loader(lmdb_path, seed=4, batch_size=16, transform=T.none(), output="numpy")
    reference.set_epoch(2)
    whole = labels_of((x.copy(), y.copy()) for x, y in reference)
    l = loader(lmdb_path, seed=4, batch_size=16, transform=T.none(), output="numpy")
    l.set_epoch(2)
    it = iter(l)
    first = [(x.copy(), y.copy()) for x, y in (next(it) for _ in range(5))]
    state = l.state_dict()
    del it
    bigger = loader(lmdb_path, seed=4, batch_size=24, transform=T.none(), output="numpy")
    bigger.load_state_dict(state)
    rest = [(x.copy(), y.copy()) for x, y in bigger]
    assert all(len(y) <= 24 for _, y in rest)
    assert labels_of(first) + labels_of(rest) == whole, "the epoch's order, each sample once"
    # At an epoch's end any batch size starts the next epoch.
    epoch_digest(l)
    ended = l.state_dict()
    other = loader(lmdb_path, seed=4, batch_size=40, transform=T.none(), output="numpy")
    other.load_state_dict(ended)
    assert other.epoch == 4, "epoch 3 ran to its end: the next one"
    forged = json.loads(json.dumps(state))
    forged["imagefeed_loader_state"]["next_batch"] = "x"
    with pytest.raises(imagefeed.ConfigError):
        loader(lmdb_path, seed=1).load_state_dict(forged)


def test_two_ranks_cover_the_epoch_with_equal_batch_counts(lmdb_path):
    seen, counts = [], []
    for rank in range(2):
        l = loader(lmdb_path, batch_size=7, rank=rank, world_size=2, output="dlpack", transform=T.none(),
                   dtype="uint8", layout="NHWC")
        n = 0
        for images, _labels in l:
            seen.append(np.from_dlpack(images).copy())
            n += 1
        counts.append(n)
        assert n == len(l)
    assert counts[0] == counts[1]
    images = np.concatenate(seen)
    assert len(images) == 240  # 120 per rank, no padding needed
    unique = {im.tobytes() for im in images}
    assert len(unique) == 240, "no sample given to both ranks"


def test_uneven_exact_gives_every_sample_once_over_ranks_that_differ_by_one(lmdb_path):
    # 240 samples over 7 ranks: ranks 0-1 take 35, ranks 2-6 take 34 (batches of 5: 7 and 7).
    seen, counts = [], []
    for rank in range(7):
        l = loader(lmdb_path, batch_size=5, rank=rank, world_size=7, uneven="exact",
                   transform=T.none(), dtype="uint8", layout="NHWC")
        assert len(l.sampler) == (35 if rank < 2 else 34) == l.sampler.num_samples
        assert l.sampler.total_size == 240 and l.sampler.num_replicas == 7
        indices = list(l.sampler)
        got = []
        for images, _labels in l:
            got.extend(im.tobytes() for im in images)
        assert len(got) == len(indices) == len(l.sampler)
        seen.extend(indices)
        counts.append(len(got))
        # The sampler's indices are the samples the batches hold, in order.
        whole = l.dataset
        assert [whole[i][0].tobytes() for i in indices] == got
    assert sorted(seen) == list(range(240)), "every sample exactly once"
    with pytest.raises(imagefeed.ConfigError, match="exact"):
        loader(lmdb_path, uneven="even")


def test_a_rank_left_without_a_share_of_a_resumed_epoch_runs_it_empty_beside_the_others(lmdb_path):
    """Hostile finding: a mid-epoch state restored at a larger world size under
    uneven="exact", where some ranks get nothing of the rest, made those ranks start the next
    epoch at once (samples given twice, ranks on different epochs)."""
    first = loader(lmdb_path, batch_size=16, uneven="exact", transform=T.none(), dtype="uint8", layout="NHWC")
    it = iter(first)
    seen = [next(it)[0].copy() for _ in range(14)]  # 224 of 240 samples
    state = first.state_dict()
    del it
    rest, epochs = [], set()
    for rank in range(20):  # 16 samples left over 20 ranks: ranks 16-19 get none
        l = loader(lmdb_path, batch_size=16, uneven="exact", transform=T.none(), dtype="uint8",
                   layout="NHWC", rank=rank, world_size=20)
        l.load_state_dict(state)
        assert l.epoch == 0, rank
        got = [im.tobytes() for images, _ in l for im in images]
        assert len(got) == (1 if rank < 16 else 0), rank
        rest.extend(got)
        epochs.add(l.epoch)
        assert sum(1 for _ in l) == len(l) and l.epoch == 1, "the next loop is epoch 1 everywhere"
    before = {im.tobytes() for batch in seen for im in batch}
    assert len(rest) == len(set(rest)) == 16 and not before & set(rest)
    assert len(before | set(rest)) == 240 and epochs == {0}


def test_after_an_elastic_restore_the_sampler_lists_what_the_loop_gives(lmdb_path):
    """Hostile finding: restored at another world size, loader.sampler still listed the whole
    epoch's deal at the new size, of which the loop gave none in order (the rest is dealt out
    again)."""
    plain = dict(transform=T.none(), dtype="uint8", layout="NHWC", batch_size=8)
    first = loader(lmdb_path, world_size=2, uneven="drop", **plain)
    it = iter(first)
    for _ in range(2):
        next(it)
    state = first.state_dict()
    del it
    given = []
    for rank in range(3):
        l = loader(lmdb_path, rank=rank, world_size=3, uneven="drop", **plain)
        whole = list(l.sampler)
        l.load_state_dict(state)
        listed = list(l.sampler)
        assert listed != whole[-len(listed):], "a re-deal, not a tail of the whole epoch's list"
        assert len(l.sampler) == len(listed) and len(l) == -(-len(listed) // 8)
        got = [im.tobytes() for images, _ in l for im in images]
        assert got == [l.dataset[i][0].tobytes() for i in listed], rank
        assert list(l.sampler) == listed, "the finished part's epoch still lists its part"
        given.extend(listed)
        l.set_epoch(1)
        fresh = loader(lmdb_path, rank=rank, world_size=3, uneven="drop", **plain)
        fresh.set_epoch(1)
        assert list(l.sampler) == list(fresh.sampler) and len(l) == len(fresh)
    # 32 samples given before the state (2 batches of 8 on 2 ranks; not a multiple of 3, so the
    # new deal is no tail of the old one): the rest of the 240, each once, less what "drop"
    # leaves out.
    assert len(given) == len(set(given)) == 240 - 32 - (240 - 32) % 3


def test_a_shorter_ranks_state_from_its_last_batch_warns_where_it_repeats_a_batch(lmdb_path):
    """Hostile finding: under uneven="exact" a shorter rank's state after its last batch says
    the longer ranks still have theirs; loaded elsewhere it gives them again if they had taken
    them (chained through elastic restarts, one sample came eight times). Now a ResumeWarning."""
    # 240 samples over 7 ranks in batches of 34: ranks 0-1 take 35 (two batches), ranks 2-6
    # take 34 (one).
    def at(rank, world_size=7):
        return loader(lmdb_path, batch_size=34, rank=rank, world_size=world_size, uneven="exact")

    short = at(6)
    assert len(short) == 1 and len(at(0)) == 2
    for _ in short:
        pass
    state = short.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        at(6).load_state_dict(state)  # its own rank: nothing left, nothing unknown
    # Rank 0's second batch (one sample) comes whether or not rank 0 had taken it; rank 3 has
    # none left; at world size 2 the two samples left go one to each rank.
    for other, sizes in ((at(0), [1]), (at(3), []), (at(0, world_size=2), [1])):
        with pytest.warns(imagefeed.ResumeWarning, match="rank 6 of 7 after its last batch"):
            other.load_state_dict(state)
        assert [len(labels) for _, labels in other] == sizes
    longest = at(0)
    for _ in longest:
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        at(6).load_state_dict(longest.state_dict())


def test_a_resume_notice_waits_for_the_ranks_the_first_epoch_settles(lmdb_path, monkeypatch):
    """Review finding: the exact-split notice was judged for the ranks known when the state was
    loaded, which may be provisional (a Loader made before init_process_group)."""
    short = loader(lmdb_path, batch_size=34, rank=6, world_size=7, uneven="exact")
    for _ in short:
        pass
    state = short.state_dict()
    for rank, warns in ((6, False), (0, True)):
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        l = imagefeed.Loader(lmdb_path, batch_size=34, uneven="exact", output="numpy",
                             transform=FLIP_NORMALIZE)  # rank 0 of 1, until the first epoch
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            l.load_state_dict(state)
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "7")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sizes = [len(y) for _, y in l]
        said = [w for w in caught if issubclass(w.category, imagefeed.ResumeWarning)]
        assert (len(said), sizes) == ((1, [1]) if warns else (0, [])), (rank, said)


def test_after_an_elastic_part_a_new_loop_of_that_epoch_lists_the_whole_epoch(lmdb_path):
    """Review finding: once a restored part had run, set_epoch(same epoch) begins that epoch
    whole, but the sampler and len() still described the part."""
    plain = dict(transform=T.none(), dtype="uint8", layout="NHWC", batch_size=8, uneven="drop")
    first = loader(lmdb_path, world_size=2, **plain)
    it = iter(first)
    for _ in range(3):  # 48 samples given: 64 a rank left at world size 3, 8 batches of 10
        next(it)
    state = first.state_dict()
    del it
    l = loader(lmdb_path, rank=1, world_size=3, **plain)
    whole, whole_len = list(l.sampler), len(l)
    l.load_state_dict(state)
    part = list(l.sampler)
    assert len(part) < len(whole) and len(l) < whole_len
    assert sum(len(y) for _, y in l) == len(part)
    assert list(l.sampler) == part, "the part just run"
    l.set_epoch(0)  # the same epoch again: a new loop, the whole epoch
    assert list(l.sampler) == whole and len(l) == whole_len
    assert sum(len(y) for _, y in l) == len(whole)


def test_a_superseded_loops_end_puts_nothing_of_the_new_loop_aside(lmdb_path):
    """Review finding: a loop's end (its `finally`) checks that no newer loop began, then puts
    the epoch aside; a loop begun on another thread between the two lost its epoch. The
    window is made deterministic: the new loop begins from inside the old loop's call."""
    l = loader(lmdb_path, seed=2)
    proxy = _NextLoopInside(l, "stop")
    old = iter(l)
    next(old)
    proxy.armed = True
    old.close()  # its end: the check passes, the new loop begins, then its stop() call
    assert proxy.new_loop is not None
    rest = sum(1 for _ in proxy.new_loop)
    assert 1 + rest == len(l), "the new loop kept its epoch"
    assert l.state_dict()["imagefeed_loader_state"]["next_batch"] == len(l)


def test_the_sampler_names_the_padding_and_follows_set_epoch(lmdb_path):
    # 240 samples over 7 ranks, padded: 35 each, 5 samples given twice.
    per_rank = []
    for rank in range(7):
        l = loader(lmdb_path, rank=rank, world_size=7)
        assert len(l.sampler) == 35 and l.sampler.total_size == 245 and not l.sampler.drop_last
        per_rank.append(list(l.sampler))
    everything = sum(per_rank, [])
    assert sorted(set(everything)) == list(range(240)) and len(everything) == 245
    l = loader(lmdb_path, rank=3, world_size=7, uneven="drop")
    assert len(l.sampler) == 34 and l.sampler.drop_last
    first = list(l.sampler)
    l.sampler.set_epoch(4)
    assert l.epoch == 4 == l.sampler.epoch and list(l.sampler) != first
    got = [int(i) for _, labels in l for i in labels]
    assert got == [l.dataset.targets[i] for i in l.sampler]


def test_the_dataset_view_is_the_loaders_samples_with_imagefolders_attributes(lmdb_path, tree):
    import pickle

    l = loader(lmdb_path, batch_size=8, transform=FLIP_NORMALIZE, seed=5)
    d = l.dataset
    assert len(d) == 240 == l.num_samples
    assert d.classes == l.classes and d.class_to_idx == {c: i for i, c in enumerate(l.classes)}
    folder = imagefeed.Loader(tree, output="numpy", rank=0, world_size=1).dataset
    assert [os.path.relpath(p, tree) for p, _ in folder.samples] == [k for k, _ in d.samples]
    assert folder.targets == d.targets == [t for _, t in d.imgs]
    assert all(os.path.isfile(p) for p, _ in folder.samples[:5])
    # Item i is the slot the epoch's batches give sample i: random crop and flip included.
    l.set_epoch(2)
    images, labels = next(iter(l))
    native_first = l._native.rank_indices(2)[:8]
    for slot, index in enumerate(native_first):
        image, label = d[index]
        assert image.dtype == np.float32 and image.shape == images.shape[1:] == (3, 24, 32)
        assert np.array_equal(image, images[slot]) and label == labels[slot]
    assert d[-240][1] == d[0][1]
    with pytest.raises(IndexError):
        d[240]
    # Picklable, keeping the epoch it was pickled in; a copy reads the same pixels.
    copy = pickle.loads(pickle.dumps(d))
    assert np.array_equal(copy[native_first[0]][0], images[0])


def test_the_dataset_view_works_in_forked_dataloader_style_children(lmdb_path):
    import multiprocessing

    l = loader(lmdb_path, transform=T.Compose([T.Resize(16), T.CenterCrop(16)]))
    d = l.dataset
    expected = [d[i][0].tobytes() for i in (0, 7, 100)]
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        got = pool.map(_item_bytes, [(d, i) for i in (0, 7, 100)])
    assert got == expected


def _item_bytes(args):
    d, index = args
    return d[index][0].tobytes()


def test_a_skipped_bad_sample_read_through_the_dataset_view_raises_naming_it():
    l = fixture_loader(bad_samples="skip", max_bad=None)
    keys = [os.path.relpath(p, FIXTURE_TREE) for p, _ in l.dataset.samples]
    bad = keys.index("class01/bad-text.jpg")
    with pytest.raises(imagefeed.BadSampleError) as info:
        l.dataset[bad]
    assert info.value.key == "class01/bad-text.jpg" and info.value.index == bad
    for _ in l:
        pass
    reasons = {b.key: b.reason for b in l.bad_samples}
    assert info.value.reason == reasons["class01/bad-text.jpg"] != "None"
    replaced = fixture_loader(bad_samples="replace", max_bad=None).dataset[bad]
    assert replaced[0].shape == (3, 8, 8)


def test_rank_comes_from_the_environment(lmdb_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    l = imagefeed.Loader(lmdb_path, batch_size=8, output="numpy")
    assert (l.rank, l.world_size) == (1, 3)
    assert len(l) == 10  # 80 samples on this rank
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(imagefeed.ConfigError):
        imagefeed.Loader(lmdb_path, output="numpy")
    # One without the other: every process of such a launch would take rank 0 (a hostile try
    # saw WORLD_SIZE=4 alone read the same quarter in each process, silently).
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(imagefeed.ConfigError, match="RANK"):
        imagefeed.Loader(lmdb_path, output="numpy")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert imagefeed.Loader(lmdb_path, output="numpy").world_size == 1
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(imagefeed.ConfigError, match="WORLD_SIZE"):
        imagefeed.Loader(lmdb_path, output="numpy")
    # Given as arguments, the environment is not read.
    assert imagefeed.Loader(lmdb_path, output="numpy", rank=0, world_size=2).world_size == 2


class _FakeDistributed:
    """Stands in for torch.distributed (found through sys.modules, as the loader looks for it)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.world_size


def test_a_loader_made_before_init_process_group_shards_as_the_group_says(lmdb_path, monkeypatch):
    """#32 finding 3: ranks were fixed when the loader was made, so one made before
    init_process_group read the whole dataset on every rank, without a word."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    l = imagefeed.Loader(lmdb_path, batch_size=8, output="numpy", transform=T.none())
    assert (l.rank, l.world_size, len(l)) == (0, 1, 30)
    monkeypatch.setitem(sys.modules, "torch.distributed", _FakeDistributed(1, 2))
    assert len(l) == 15 and (l.rank, l.world_size) == (1, 2), "len() before the epoch sees it"
    got = epoch_digest(l)
    explicit = imagefeed.Loader(lmdb_path, batch_size=8, output="numpy", transform=T.none(),
                                rank=1, world_size=2)
    assert got == epoch_digest(explicit), "the same half of the epoch as rank=1, world_size=2"
    # Once an epoch has started, the ranks stay.
    monkeypatch.setitem(sys.modules, "torch.distributed", _FakeDistributed(0, 3))
    assert (l.rank, l.world_size, len(l)) == (1, 2, 15)


def test_ranks_follow_a_process_group_set_up_after_a_restore_and_warn_once_settled(
        lmdb_path, monkeypatch):
    """Found by review: restoring a checkpoint settled the ranks (a group set up after it was
    missed), and ranks settled before a group existed went on silently."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    saver = imagefeed.Loader(lmdb_path, batch_size=8, output="numpy", transform=T.none(), rank=1,
                             world_size=2)
    it = iter(saver)
    next(it)
    state = saver.state_dict()
    del it
    l = imagefeed.Loader(lmdb_path, batch_size=8, output="numpy", transform=T.none())
    l.load_state_dict(state)
    monkeypatch.setitem(sys.modules, "torch.distributed", _FakeDistributed(1, 2))
    rest = [(x.copy(), y.copy()) for x, y in l]
    assert (l.rank, l.world_size) == (1, 2)
    assert len(rest) == 14, "the rest of rank 1's epoch at world size 2"
    # Ranks settled when the first epoch started, before any group: a later group is warned of.
    monkeypatch.delitem(sys.modules, "torch.distributed")
    early = imagefeed.Loader(lmdb_path, batch_size=8, output="numpy", transform=T.none())
    next(iter(early))
    monkeypatch.setitem(sys.modules, "torch.distributed", _FakeDistributed(0, 2))
    with pytest.warns(imagefeed.RankWarning, match="after init_process_group"):
        next(iter(early))


def test_ranks_given_against_a_process_group_of_another_size_warn(lmdb_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.distributed", _FakeDistributed(0, 4))
    l = imagefeed.Loader(lmdb_path, batch_size=8, output="numpy", transform=T.none(), rank=0,
                         world_size=2)
    with pytest.warns(imagefeed.RankWarning, match="has 4 ranks"):
        next(iter(l))
    assert (l.rank, l.world_size) == (0, 2)
    same = imagefeed.Loader(lmdb_path, batch_size=8, output="numpy", transform=T.none(), rank=0,
                            world_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        next(iter(same))


# -- bad samples --------------------------------------------------------------------------------

BAD_KEYS = {"class01/bad-truncated.jpg", "class01/bad-bomb.jpg", "class01/bad-empty.jpg", "class01/bad-text.jpg"}


def fixture_loader(**kw):
    kw.setdefault("transform", T.Compose([T.Resize(8), T.CenterCrop(8)]))
    kw.setdefault("batch_size", 4)
    # 4 of the tree's 20 files are broken: far over the default cap, which is tested below.
    kw.setdefault("max_bad", None)
    return loader(FIXTURE_TREE, **kw)


def test_by_default_an_epoch_that_loses_more_than_one_percent_raises():
    assert imagefeed.DEFAULT_MAX_BAD == 0.01
    l = loader(FIXTURE_TREE, transform=T.Compose([T.Resize(8), T.CenterCrop(8)]), batch_size=4,
               bad_samples="skip")
    with pytest.raises(imagefeed.TooManyBadSamplesError) as e:
        for _ in l:
            pass
    assert e.value.key in BAD_KEYS


def test_skip_reports_every_bad_sample_by_key_and_shortens_batches():
    l = fixture_loader(bad_samples="skip")
    total = sum(len(y) for _, y in l)
    assert {b.key for b in l.bad_samples} == BAD_KEYS
    assert total == l.num_samples - 4
    reasons = {b.key: b.reason for b in l.bad_samples}
    assert "empty" in reasons["class01/bad-empty.jpg"]
    kinds = {b.key: b.kind for b in l.bad_samples}
    assert kinds == {
        "class01/bad-bomb.jpg": "too_large",
        "class01/bad-empty.jpg": "undecodable",
        "class01/bad-text.jpg": "unknown_format",
        "class01/bad-truncated.jpg": "undecodable",
    }
    assert all(b.replaced_by is None for b in l.bad_samples)


def test_replace_keeps_batches_full_and_says_what_replaced_what():
    l = fixture_loader(bad_samples="replace")
    sizes = [len(y) for _, y in l]
    assert sum(sizes) == l.num_samples
    seen = l.bad_samples
    assert {b.key for b in seen} == BAD_KEYS
    # A candidate that is itself bad is reported too (replaced_by None); the slot goes to a good one.
    replaced = [b for b in seen if b.replaced_by is not None]
    assert replaced
    assert all(b.replaced_by not in {s.index for s in seen} for b in replaced)


def test_last_bad_samples_belong_to_the_last_batch():
    l = fixture_loader(bad_samples="skip", batch_size=1, shuffle=False)
    per_batch = []
    for _ in l:
        per_batch.append([b.key for b in l.last_bad_samples])
    assert sorted(k for keys in per_batch for k in keys) == sorted(BAD_KEYS)
    assert all(len(keys) <= 1 for keys in per_batch)


def test_the_error_policy_raises_naming_the_key():
    with pytest.raises(imagefeed.BadSampleError) as e:
        for _ in fixture_loader(bad_samples="error"):
            pass
    assert e.value.key in BAD_KEYS
    assert e.value.key in str(e.value)
    assert e.value.kind in {"too_large", "undecodable", "unknown_format"}


def test_max_bad_raises_naming_every_bad_key():
    l = fixture_loader(bad_samples="skip", max_bad=1, shuffle=False, batch_size=1)
    with pytest.raises(imagefeed.TooManyBadSamplesError) as e:
        for _ in l:
            pass
    assert e.value.count == 2
    assert len(e.value.keys) == 2 and set(e.value.keys) <= BAD_KEYS
    assert e.value.keys[-1] == e.value.key
    assert e.value.kind in {"too_large", "undecodable", "unknown_format"}
    # A fraction works too, and a generous one lets the epoch finish.
    assert sum(len(y) for _, y in fixture_loader(bad_samples="skip", max_bad=0.5)) == 16


def test_max_bad_counts_numpy_integers_and_the_same_samples_under_every_policy():
    # Found by a hostile review: np.int64(1) was taken as the fraction 1.0 (no cap at all), and
    # under "replace" candidates found bad while replacing counted, so max_bad=4 (the tree's
    # true number of bad files) raised.
    with pytest.raises(imagefeed.TooManyBadSamplesError):
        for _ in fixture_loader(bad_samples="skip", max_bad=np.int64(1), shuffle=False):
            pass
    for policy in ["skip", "replace"]:
        for cap in [4, np.uint8(4), 0.2]:
            l = fixture_loader(bad_samples=policy, max_bad=cap, shuffle=False)
            for _ in l:
                pass
            own = [b for b in l.bad_samples if b.while_replacing is None]
            assert len(own) == 4
    for bad in [-1, 2**64, np.int64(-3)]:
        with pytest.raises(imagefeed.ConfigError, match="count"):
            fixture_loader(max_bad=bad)
    # A string is shown as one (it read "max_bad 1", like the count it is not).
    with pytest.raises(imagefeed.ConfigError, match="max_bad '1': a count"):
        fixture_loader(max_bad="1")


# -- errors -------------------------------------------------------------------------------------


def test_every_error_is_an_imagefeed_exception_with_the_path(tmp_path, lmdb_path):
    with pytest.raises(imagefeed.DatasetNotFoundError) as e:
        loader(tmp_path / "missing.lmdb")
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, imagefeed.Error)
    assert e.value.path.endswith("missing.lmdb")

    text = tmp_path / "notes.lmdb"
    text.write_text("not a dataset")
    with pytest.raises(imagefeed.DataError) as e:
        loader(text)
    assert "notes.lmdb" in str(e.value)

    interrupted = tmp_path / "half.lmdb"
    (tmp_path / "half.lmdb.partial").write_bytes(lmdb_path.read_bytes())
    with pytest.raises(imagefeed.IncompleteDatasetError) as e:
        loader(interrupted)
    assert "resume=True" in e.value.reason and "resume=True" in str(e.value)

    for bad in [dict(batch_size=0), dict(workers=-1), dict(dtype="int7"), dict(layout="CHWN"),
                dict(bad_samples="ignore"), dict(uneven="wrap"), dict(max_bad=True), dict(output="jax"),
                dict(rank=2, world_size=2), dict(rank=1), dict(transform="imagenet")]:
        with pytest.raises(imagefeed.ConfigError):
            loader(lmdb_path, **bad)
    # A world of no ranks is named as such, not as rank 0 outside 0..0.
    for world_size in (0, -1):
        with pytest.raises(imagefeed.ConfigError, match=r"world_size -?[01]: must be an int in 1\.\."):
            loader(lmdb_path, rank=0, world_size=world_size)
    assert issubclass(imagefeed.ConfigError, ValueError)

    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:  # without torch, or without a device: a CudaError saying which
        with pytest.raises(imagefeed.CudaError):
            loader(lmdb_path, device="cuda", output="torch")


def test_mixed_sizes_without_a_resize_name_both_keys(tmp_path):
    root = tmp_path / "mixed"
    imagefeed.synthesize(root / "a", classes=2, per_class=2, size=(16, 16))
    imagefeed.synthesize(root / "b", classes=2, per_class=2, size=(20, 16))
    for cls in ("class00", "class01"):
        for f in (root / "b" / cls).iterdir():
            f.rename(root / "a" / cls / ("b-" + f.name))
    with pytest.raises(imagefeed.errors.ShapeMismatchError) as e:
        for _ in loader(root / "a", batch_size=8, transform=T.none(), shuffle=False):
            pass
    assert e.value.key and e.value.first_key


def test_transforms_refuse_impossible_chains():
    with pytest.raises(ValueError):
        T.Compose([T.RandomResizedCrop(8), T.Resize(4)])
    with pytest.raises(ValueError):
        T.Compose([T.CenterCrop(8), T.Resize(4)])
    with pytest.raises(TypeError):
        T.Compose([lambda x: x])
    with pytest.raises(ValueError):
        T.Normalize((0.5, 0.5), (1, 1, 1))
    with pytest.raises(ValueError):
        T.RandomHorizontalFlip(2)
    assert T.imagenet_eval(224) == T.Compose(
        [T.Resize(256), T.CenterCrop(224), T.Normalize(T.IMAGENET_MEAN, T.IMAGENET_STD)]
    )


class _NextLoopInside:
    """Stands in for loader ``l``'s native side: once ``armed``, its call ``method`` first begins
    a new loop over ``l`` (``new_loop``, whose first images are kept in ``first``), then goes
    through. The window between a loop's check and its call, made deterministic."""

    def __init__(self, l, method):
        self._real, self._loader, self._method = l._native, l, method
        self.armed = False
        self.new_loop = None
        self.first = None
        l._native = self

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name != self._method:
            return attr

        def call(*args):
            if self.armed:
                self.armed = False
                self.new_loop = iter(self._loader)
                self.first = next(self.new_loop)[0].copy()
            return attr(*args)

        return call


def test_a_loop_superseded_between_its_check_and_its_call_takes_no_batch_of_the_new_one(lmdb_path):
    """Hostile finding: a loop on another thread, superseded after its check and before its
    call for the next batch, took a batch of the new epoch; the new loop never saw it and
    state_dict() counted it as trained. The window is made deterministic here: the new loop
    starts from inside the old loop's call."""
    plain = dict(seed=4, transform=T.none(), dtype="uint8", layout="NHWC")
    reference = loader(lmdb_path, **plain)
    reference.set_epoch(1)
    expected = [images.copy() for images, _ in reference]

    l = loader(lmdb_path, **plain)
    proxy = _NextLoopInside(l, "next_batch")  # the new loop runs epoch 1
    old = iter(l)
    next(old)
    proxy.armed = True
    with pytest.raises(imagefeed.ConfigError) as e:
        next(old)
    # Said as the loop's own check says it (the native check's message had a prefix of its own).
    assert str(e.value) == "this iterator was superseded: a newer loop over the loader started"
    rest = [images.copy() for images, _ in proxy.new_loop]
    got = [proxy.first, *rest]
    assert len(got) == len(expected) and all(np.array_equal(a, b) for a, b in zip(got, expected))
    state = l.state_dict()["imagefeed_loader_state"]
    assert (state["epoch"], state["next_batch"]) == (1, len(expected))


def test_breaking_out_keeps_the_position_and_an_old_iterator_cannot_disturb_a_new_loop(lmdb_path):
    l = loader(lmdb_path, seed=4)
    old = iter(l)
    next(old)
    next(old)
    assert l.state_dict()["imagefeed_loader_state"]["next_batch"] == 2
    new = iter(l)  # the next epoch
    next(new)
    with pytest.raises(imagefeed.ConfigError) as e:
        next(old)
    assert str(e.value) == "this iterator was superseded: a newer loop over the loader started"
    del old
    gc.collect()
    assert l.state_dict()["imagefeed_loader_state"]["next_batch"] == 1
    assert sum(1 for _ in new) == len(l) - 1


# -- Ctrl-C -------------------------------------------------------------------------------------

INTERRUPT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import imagefeed
    from imagefeed import transforms as T
    l = imagefeed.Loader({path!r}, batch_size=48, workers=1, prefetch=1, output="numpy",
                         transform=T.imagenet_train(224), rank=0, world_size=1)
    for epoch in range(1000):
        for i, (x, y) in enumerate(l):
            print("batch", flush=True)
    """
)


def test_ctrl_c_while_waiting_for_a_batch_raises_keyboardinterrupt_and_stops(big_tree):
    # Large images, one worker, big batches: the main thread spends its time waiting in Rust.
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPT_SCRIPT.format(path=str(big_tree))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    try:
        assert proc.stdout.readline().strip() == "batch"
        time.sleep(0.2)  # now waiting for the next batch
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - sent
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in err, err
    assert proc.returncode != 0
    assert elapsed < 5, f"took {elapsed:.1f} s to stop"


def test_a_batch_fetched_but_never_handed_over_is_not_counted_as_delivered(lmdb_path):
    # Ctrl-C can land after the native call returned a batch and before `yield` hands it over;
    # an exception raised while converting the batch stands in for it, deterministically.
    l = loader(lmdb_path, seed=8)
    calls = 0
    convert = l._convert

    def interrupting(array):
        nonlocal calls
        calls += 1
        if calls == 2 * 5 + 1:  # the sixth batch's images
            raise KeyboardInterrupt
        return convert(array)

    l._convert = interrupting
    delivered = []
    with pytest.raises(KeyboardInterrupt):
        for x, y in l:
            delivered.append((x.copy(), y.copy()))
    assert len(delivered) == 5
    state = l.state_dict()
    assert state["imagefeed_loader_state"]["next_batch"] == 5
    resumed = loader(lmdb_path, seed=8)
    resumed.load_state_dict(state)
    reference = loader(lmdb_path, seed=8)
    assert epoch_digest(delivered + [(x.copy(), y.copy()) for x, y in resumed]) == epoch_digest(reference)


def test_state_dict_after_set_epoch_starts_that_epoch(lmdb_path):
    l = loader(lmdb_path, seed=3)
    it = iter(l)
    next(it)
    next(it)
    del it
    l.set_epoch(10)
    assert l.epoch == 10
    state = l.state_dict()["imagefeed_loader_state"]
    assert (state["epoch"], state["next_batch"]) == (10, 0)
    fresh = loader(lmdb_path, seed=3)
    fresh.load_state_dict(l.state_dict())
    l.set_epoch(10)
    assert epoch_digest(fresh) == epoch_digest(l)


def _next_in_child(step, conn):
    """Runs ``step`` (a call that takes a batch) in a forked child; sends what came of it."""
    try:
        step()
        conn.send("iterated")
    except imagefeed.ConfigError as e:
        conn.send(f"ConfigError: {e}")


def test_a_loader_used_in_a_forked_child_raises_instead_of_hanging(lmdb_path):
    import multiprocessing

    l = loader(lmdb_path)
    next(iter(l))
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_next_in_child, args=(lambda: next(iter(l)), child))
    proc.start()
    assert parent.poll(30), "the child hung"
    message = parent.recv()
    proc.join(30)
    assert message.startswith("ConfigError") and "fork" in message, message


def _two_trees(tmp_path):
    """Two image folders of the same classes and size: in the second, sample 2 (none of the
    fingerprint's eight probes) is another file name, sorted in the same place."""
    import shutil

    trees = [tmp_path / "a", tmp_path / "b"]
    for tree in trees:
        for image in sorted(FIXTURE_TREE.glob("class*/img*.jpg")):
            name = image.name
            if tree.name == "b" and image.parent.name == "class00" and name == "img00002.jpg":
                name = "img00002b.jpg"
            (tree / image.parent.name).mkdir(parents=True, exist_ok=True)
            shutil.copy(image, tree / image.parent.name / name)
    return trees


def test_a_state_does_not_resume_on_a_folder_differing_between_the_probes(tmp_path):
    # A hostile try resumed a checkpoint on another folder of the same size and classes.
    a, b = _two_trees(tmp_path)
    assert imagefeed.Dataset(a).key(2) != imagefeed.Dataset(b).key(2)
    small = T.Compose([T.Resize(8), T.CenterCrop(8)])
    saved = loader(a, batch_size=4, transform=small)
    next(iter(saved))
    state = saved.state_dict()
    with pytest.raises(imagefeed.StateMismatchError) as e:
        loader(b, batch_size=4, transform=small).load_state_dict(state)
    assert e.value.setting == "dataset"
    loader(a, batch_size=4, transform=small).load_state_dict(state)


def test_a_pickled_dataset_refuses_a_folder_changed_between_the_probes(tmp_path):
    import pickle

    a, b = _two_trees(tmp_path)
    data = pickle.dumps(imagefeed.Dataset(a, decode="bytes"))
    a.rename(tmp_path / "old")
    b.rename(a)
    with pytest.raises(imagefeed.DatasetChangedError) as e:
        pickle.loads(data)[0]
    assert "keys, labels or checksums" in str(e.value)


def test_an_iterator_under_way_at_a_fork_raises_in_the_child(lmdb_path):
    # A hostile try: the child of a fork continued the parent's loop, got a batch the parent
    # delivers too, then waited forever for the parent's worker threads.
    import multiprocessing

    l = loader(lmdb_path, workers=2, prefetch=2)
    it = iter(l)
    next(it)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_next_in_child, args=(lambda: next(it), child))
    proc.start()
    assert parent.poll(30), "the child hung"
    message = parent.recv()
    proc.join(30)
    assert message.startswith("ConfigError") and "another process" in message, message
    # The parent's loop goes on.
    assert sum(1 for _ in it) == len(l) - 1


def test_the_decode_mode_is_part_of_the_stream_a_state_resumes(lmdb_path):
    fast = loader(lmdb_path, transform=T.Compose([T.Resize(16), T.CenterCrop(12)]))
    state = fast.state_dict()
    whole = loader(lmdb_path, transform=T.Compose([T.Resize(16), T.CenterCrop(12)]), scaled_decode=False)
    with pytest.raises(imagefeed.StateMismatchError):
        whole.load_state_dict(state)
    # (Images of 32x24 shrunk to 16 are never DCT-scaled: the batches are the same.)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(fast, whole))


def test_wrong_argument_types_and_ranges_are_imagefeed_errors(lmdb_path):
    for bad in [dict(prefetch=-1), dict(prefetch=2**64), dict(prefetch=4097), dict(prefetch=1.5),
                dict(prefetch=True),
                dict(max_pixels=-1), dict(max_pixels=0), dict(label_base=-1), dict(seed=2**64),
                dict(batch_size=2**64), dict(shuffle=None), dict(drop_last="yes"), dict(dtype=None),
                dict(uneven=None), dict(device=None), dict(device="cpu:0"), dict(scaled_decode="no"),
                dict(transform=T.CenterCrop(1 << 16) and T.Compose([T.CenterCrop(1 << 16)])),
                dict(rank=0, world_size=2**40)]:
        with pytest.raises(imagefeed.ConfigError):
            loader(lmdb_path, **bad)
    with pytest.raises(ValueError):
        T.Normalize((0.5, 0.5, 0.5), (float("nan"), 1, 1))
    with pytest.raises(imagefeed.ConfigError):
        loader(lmdb_path).load_state_dict({"imagefeed_loader_state": None})
    with pytest.raises(imagefeed.ConfigError):
        imagefeed.pack(lmdb_path, lmdb_path.parent / "q.lmdb", quality=300, progress=False)
    ds = imagefeed.Dataset(lmdb_path, decode="bytes")
    with pytest.raises(IndexError):
        ds[2**63]
    with pytest.raises(imagefeed.ConfigError):
        imagefeed.Dataset(lmdb_path, max_pixels=-1, decode="bytes")


def test_integer_arguments_name_the_setting_and_take_numpy_ints(lmdb_path, tmp_path):
    # A hostile try: out-of-range ints said "int too big to convert" or "out of range integral
    # type conversion attempted" without the setting; pack(part=(1, 2, 3)) and
    # synthesize(per_class=-1) raised builtins' ValueError/OverflowError; a NumPy batch size
    # was "must be a non-negative int".
    for bad, named in [(dict(batch_size=2**64), "batch_size"), (dict(seed=2**64), "seed"),
                       (dict(workers=-1), "workers"), (dict(prefetch=True), "prefetch"),
                       (dict(label_base=2**32), "label_base")]:
        with pytest.raises(imagefeed.ConfigError, match=named):
            loader(lmdb_path, **bad)
    a = loader(lmdb_path, batch_size=np.int64(5), seed=np.uint32(3), workers=np.int8(1))
    b = loader(lmdb_path, batch_size=5, seed=3, workers=1)
    a.set_epoch(np.int64(2))
    b.set_epoch(2)
    assert [y.tolist() for _, y in a] == [y.tolist() for _, y in b]
    out = tmp_path / "out.lmdb"
    for bad, named in [(dict(part=(1, 2, 3)), "part"), (dict(part=(-1, 2)), "part index"),
                       (dict(quality=-1, resize=8), "quality"), (dict(resize=-1), "resize"),
                       (dict(label_base=-1), "label_base"), (dict(threads=2**64), "threads")]:
        with pytest.raises(imagefeed.ConfigError, match=named):
            imagefeed.pack(lmdb_path, out, progress=False, **bad)
    assert not out.exists()
    for bad, named in [(dict(per_class=-1), "per_class"), (dict(size=(1, 2, 3)), "size"),
                       (dict(classes=10**9), "classes")]:
        with pytest.raises(imagefeed.Error, match=named):
            imagefeed.synthesize(tmp_path / "tree", **bad)
    assert imagefeed.synthesize(tmp_path / "tree", classes=np.int64(2), per_class=2, size=(8, 8)) == 4
    # Bytes paths, as Loader, Dataset and inspect take them.
    summary = imagefeed.pack(os.fsencode(tmp_path / "tree"), os.fsencode(out), progress=False)
    assert summary["samples"] == 4
    assert imagefeed.verify(out, against=os.fsencode(tmp_path / "tree"))["ok"]


def test_the_position_leaves_out_batches_returned_but_not_handed_over(lmdb_path):
    # What the CUDA path relies on: one batch staged ahead on the GPU, one more held when an
    # exception hits. The native loader remembers the positions before its last two batches.
    native = loader(lmdb_path)._native
    native.begin(0)
    for _ in range(3):
        assert native.next_batch() is not None
    position = lambda **kw: json.loads(native.state(0, **kw))["next_batch"]  # noqa: E731
    assert position() == 3 and position(handed=3) == 3
    assert position(handed=2) == 2 and position(handed=1) == 1
    native.stop(1)
    assert position() == 1, "the epoch put aside where the trainer stood"


class StandInFeed:
    """Takes the place of the CUDA feed, with the same interface, so that the loop around it
    (one batch staged ahead, the position, the drain at the end) is tested on a CPU."""

    def __init__(self):
        self.staged = 0  # batches whose "copy" was issued
        self.in_flight = []  # issued and not drained
        self.drains = 0

    def stage(self, images, labels):
        self.staged += 1
        batch = (np.from_dlpack(images), np.from_dlpack(labels))
        # As the real feed lets go of batches whose copy has completed: all but the newest.
        self.in_flight = self.in_flight[-1:] + [batch]
        return batch

    def finish(self, staged):
        return staged

    def drain(self):
        self.drains += 1
        self.in_flight = []


def test_the_gpu_loop_hands_over_every_batch_in_order_and_drains_its_copies(lmdb_path):
    expected = [(x.copy(), y.copy()) for x, y in loader(lmdb_path, batch_size=32)]
    l = loader(lmdb_path, batch_size=32)
    l._cuda = feed = StandInFeed()
    got = [(x.copy(), y.copy()) for x, y in l]
    assert len(got) == len(expected) == len(l)
    for (x, y), (ex, ey) in zip(got, expected):
        assert np.array_equal(x, ex) and np.array_equal(y, ey)
    assert (feed.staged, feed.drains, feed.in_flight) == (len(l), 1, [])


def test_a_gpu_loop_left_early_counts_only_the_batches_handed_over(lmdb_path):
    l = loader(lmdb_path, batch_size=32)
    l._cuda = feed = StandInFeed()
    for i, _ in enumerate(l):
        if i == 2:
            break
    # Three handed over (0, 1, 2) and the fourth staged ahead: it is not trained on, so the
    # position is 3, and its copy was waited for before its buffer could be let go.
    assert feed.staged == 4 and feed.drains == 1 and feed.in_flight == []
    assert l.state_dict()["imagefeed_loader_state"]["next_batch"] == 3
    rest = loader(lmdb_path, batch_size=32)
    rest.load_state_dict(l.state_dict())
    full = [y.copy() for _, y in loader(lmdb_path, batch_size=32)]
    assert [y.tolist() for _, y in rest] == [y.tolist() for y in full[3:]]


CHECKPOINT_SCRIPT = textwrap.dedent(
    """
    import signal, imagefeed
    from imagefeed import transforms as T
    l = imagefeed.Loader({path!r}, batch_size=48, workers=1, prefetch=1, output="numpy",
                         transform=T.imagenet_train(224), rank=0, world_size=1)
    saved = []
    def checkpoint(sig, frame):  # a preemption handler saving a checkpoint
        saved.append(l.state_dict()["imagefeed_loader_state"]["next_batch"])
    signal.signal(signal.SIGALRM, checkpoint)
    signal.setitimer(signal.ITIMER_REAL, 0.06, 0.06)  # fires while the loop waits for batches
    n = sum(1 for _ in l)
    signal.setitimer(signal.ITIMER_REAL, 0)
    print(n, len(saved), saved == sorted(saved))
    """
)


def test_a_signal_handler_may_take_state_dict_while_the_loop_waits(big_tree):
    out = subprocess.run([sys.executable, "-c", CHECKPOINT_SCRIPT.format(path=str(big_tree))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    batches, saved, ordered = out.stdout.split()
    assert batches == "2" and int(saved) > 0 and ordered == "True", out.stdout


@pytest.mark.parametrize("workers", [0, 1])
def test_state_dict_from_another_thread_gets_in_between_batches(big_tree, workers):
    # A checkpoint or watchdog thread's state_dict() waited for the whole epoch (48 s): the
    # iterating thread held the loader's lock while each batch was made and took it back within
    # microseconds. 24 batches of 4 photo-size images; the thread asks after the first.
    import threading

    loader = imagefeed.Loader(big_tree, batch_size=4, workers=workers, prefetch=1, output="numpy",
                              transform=T.imagenet_eval(224, 224), shuffle=False)
    first = threading.Event()
    got = []

    def checkpoint():
        first.wait()
        got.append(loader.state_dict()["imagefeed_loader_state"]["next_batch"])

    thread = threading.Thread(target=checkpoint)
    thread.start()
    batches = 0
    for _ in loader:
        batches += 1
        first.set()
    thread.join()
    assert batches == 24 and got and got[0] <= 6, (batches, got)


def test_finding_the_rank_never_imports_torch(lmdb_path, tmp_path):
    # A stand-in torch on the path: importing it is recorded. A NumPy loader must not import
    # it (the real one costs seconds and hundreds of MB); a process group the script set up
    # (torch.distributed imported and initialised) is still honoured.
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import os\nos.environ['FAKE_TORCH_IMPORTED'] = '1'\n")
    (fake / "distributed.py").write_text(
        "def is_available(): return True\n"
        "def is_initialized(): return True\n"
        "def get_rank(): return 1\n"
        "def get_world_size(): return 2\n"
    )
    script = textwrap.dedent(
        """
        import os, sys
        import imagefeed
        l = imagefeed.Loader(sys.argv[1], output="numpy", batch_size=8, workers=1)
        print(os.environ.get("FAKE_TORCH_IMPORTED", "0"), l.rank, l.world_size)
        import torch.distributed
        l = imagefeed.Loader(sys.argv[1], output="numpy", batch_size=8, workers=1)
        print(l.rank, l.world_size)
        """
    )
    # The stand-in torch comes first; imagefeed is found where this process found it (an
    # installed package, or PYTHONPATH as on the GPU check's machine).
    path = [str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    run = subprocess.run([sys.executable, "-c", script, str(lmdb_path)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    first, second = run.stdout.strip().splitlines()
    assert first == "0 0 1", "torch was imported just to find the rank"
    assert second == "1 2", "an initialised process group gives the rank"


# -- RandomCrop (#33) ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fill, padding_mode",
    [(0, "constant"), ((10, 200, 30), "constant"), (0, "edge"), (0, "reflect"), (0, "symmetric")],
)
def test_random_crop_is_a_window_of_the_padded_image_at_an_even_offset(lmdb_path, fill, padding_mode):
    ds = imagefeed.Dataset(lmdb_path, decode="numpy")
    # Left padding wider than the 32x24 image: the mirrored modes repeat, as numpy.pad does.
    crop = loader(
        lmdb_path,
        transform=T.Compose(
            [T.RandomCrop((20, 28), padding=(35, 1, 5, 2), fill=fill, padding_mode=padding_mode)]
        ),
        dtype="uint8",
        layout="NHWC",
        seed=9,
    ).dataset
    offsets = set()
    for i in range(60):
        image, _ = ds[i]
        window, _ = crop[i]
        assert window.shape == (20, 28, 3)
        # torchvision pads a PIL image with numpy.pad (ImageOps.expand for "constant"), then
        # takes F.crop(padded, top, left, 20, 28), the offsets drawn from 0..=H+3-20 and
        # 0..=W+40-28.
        sides = ((1, 2), (35, 5))
        if padding_mode == "constant":
            padded = np.stack(
                [np.pad(image[..., c], sides, constant_values=np.broadcast_to(fill, 3)[c]) for c in range(3)],
                axis=-1,
            )
        else:
            padded = np.pad(image, sides + ((0, 0),), mode=padding_mode)
        found = [
            (top, left)
            for top in range(padded.shape[0] - 20 + 1)
            for left in range(padded.shape[1] - 28 + 1)
            if np.array_equal(padded[top : top + 20, left : left + 28], window)
        ]
        assert found, f"sample {i} is no window of the padded image"
        offsets.update(found)
    tops = {t for t, _ in offsets}
    lefts = {left for _, left in offsets}
    assert tops == set(range(8)) and min(lefts) < 10 and max(lefts) > 34, (tops, lefts)


def test_random_crop_pads_if_needed_and_refuses_what_it_cannot_do(lmdb_path):
    # 32x24 images and a 40x40 window: bad samples, or padded on both ends with pad_if_needed.
    too_big = loader(lmdb_path, transform=T.Compose([T.RandomCrop(40)]), bad_samples="error")
    with pytest.raises(imagefeed.Error, match="RandomCrop window"):
        next(iter(too_big))
    padded = loader(
        lmdb_path, transform=T.Compose([T.RandomCrop(40, pad_if_needed=True)]), dtype="uint8", layout="NHWC"
    )
    images, _ = next(iter(padded))
    assert images.shape[1:] == (40, 40, 3)
    for bad in (
        dict(fill=256),
        dict(fill=(1, 2)),
        dict(fill={1, 2, 3}),
        dict(fill={1: 0, 2: 0, 3: 0}),
        dict(padding_mode="wrap"),
        dict(padding=-1),
        dict(padding=(1, 2, 3)),
        dict(padding=2.0),
        dict(padding=2**32),
        dict(pad_if_needed="no"),
    ):
        with pytest.raises(ValueError):
            T.RandomCrop(32, **bad)
    for size in (3.0, 2**32, (3, 4, 5), "32", True):
        with pytest.raises(ValueError):
            T.RandomCrop(size)
    # torchvision's other forms of size: NumPy ints, a one-element sequence.
    assert T.RandomCrop(np.int64(32)).size == (32, 32) and T.RandomCrop([24]).size == (24, 24)
    with pytest.raises(ValueError):
        T.Compose([T.CenterCrop(40), T.RandomCrop(32)])
    # The CIFAR preset is torchvision's recipe: RandomCrop(32, padding=4), flip, normalize.
    assert T.cifar_train() == T.Compose(
        [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(0.5), T.Normalize(T.CIFAR10_MEAN, T.CIFAR10_STD)]
    )
    images, _ = next(iter(loader(lmdb_path, transform=T.cifar_train())))
    assert images.shape[1:] == (3, 32, 32)


@pytest.mark.parametrize("padding_mode", ["constant", "reflect"])
def test_resize_then_random_crop_is_a_window_of_the_resized_image(lmdb_path, padding_mode):
    """Compose([Resize(16), RandomCrop(12, padding=2)]): each window is one of PIL's resized
    (as torchvision's Resize on a PIL image) and padded image, within one level on 99% of the
    values (the loader crops, then resamples that region)."""
    from PIL import Image

    ds = imagefeed.Dataset(lmdb_path, decode="numpy")
    crop = loader(
        lmdb_path,
        transform=T.Compose([T.Resize(16), T.RandomCrop(12, padding=2, padding_mode=padding_mode)]),
        dtype="uint8",
        layout="NHWC",
        seed=3,
    ).dataset
    for i in range(12):
        image, _ = ds[i]  # 24 x 32 -> 16 x 21 (torchvision: int(16 * 32 / 24))
        resized = np.asarray(Image.fromarray(image).resize((21, 16), Image.BILINEAR)).astype(int)
        padded = np.pad(resized, ((2, 2), (2, 2), (0, 0)), mode=padding_mode)
        window = crop[i][0].astype(int)
        assert window.shape == (12, 12, 3)
        best = min(
            (np.abs(padded[t : t + 12, x : x + 12] - window) > 1).mean()
            for t in range(padded.shape[0] - 11)
            for x in range(padded.shape[1] - 11)
        )
        assert best <= 0.01, (i, best)
    assert T.Compose([T.Resize(16), T.RandomCrop(12)]).spec()["short"] == 16


def test_bicubic_resizing_is_pils_on_noise(tmp_path):
    """PIL resamples rows first, rounded to 8 bits, then columns; the other order clips the
    cubic's overshoot elsewhere (it was up to 22 levels off on noise). Down and up, on noise,
    within PIL's rounding (at most 2 levels, on a handful of values)."""
    from PIL import Image

    (tmp_path / "c" / "a").mkdir(parents=True)
    noise = np.random.default_rng(0).integers(0, 256, (200, 300, 3), dtype=np.uint8)
    Image.fromarray(noise).save(tmp_path / "c" / "a" / "noise.png")
    for short in (150, 130, 224, 600):
        ds = loader(
            tmp_path / "c", transform=T.Compose([T.Resize(short, interpolation="bicubic")]),
            dtype="uint8", layout="NHWC", scaled_decode=False, shuffle=False,
        ).dataset
        got = ds[0][0].astype(int)
        want = np.asarray(Image.fromarray(noise).resize((short * 3 // 2, short), Image.BICUBIC)).astype(int)
        diff = np.abs(got - want)
        assert diff.max() <= 2 and (diff > 1).mean() < 1e-4, (short, diff.max(), (diff > 1).mean())


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_resize_to_a_fixed_size_is_pils(tmp_path, interpolation):
    """torchvision's Resize((h, w)): every image exactly that size, aspect ratio not kept,
    within PIL's rounding, shrinking and enlarging; the int and one-element forms keep theirs."""
    from PIL import Image

    (tmp_path / "c" / "a").mkdir(parents=True)
    noise = np.random.default_rng(1).integers(0, 256, (200, 300, 3), dtype=np.uint8)
    Image.fromarray(noise).save(tmp_path / "c" / "a" / "noise.png")
    filters = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}
    # Pillow 13 runs the two passes in an order that depends on the shape (columns first when the
    # height loses more than twice the pixels the width does): each kind of shape is here, the
    # boundary too (250 wide: 99 high is columns first, 100 rows first). Pillow 12 and earlier
    # always go rows first, so there the columns-first shapes differ in bicubic by design.
    shapes = [(224, 224), (96, 400), (350, 120), (190, 310), (210, 290), (100, 200), (300, 500), (150, 450)]
    shapes += [(99, 250), (100, 250), (60, 280)]
    pillow = tuple(int(part) for part in Image.__version__.split(".")[:2])
    for h, w in shapes:
        if interpolation == "bicubic" and pillow < (13, 0) and 200 - h > 2 * (300 - w):
            continue
        ds = loader(
            tmp_path / "c", transform=T.Compose([T.Resize((h, w), interpolation=interpolation)]),
            dtype="uint8", layout="NHWC", scaled_decode=False, shuffle=False,
        ).dataset
        got = ds[0][0].astype(int)
        want = np.asarray(Image.fromarray(noise).resize((w, h), filters[interpolation])).astype(int)
        diff = np.abs(got - want)
        assert got.shape == (h, w, 3) and diff.max() <= 2 and (diff > 1).mean() < 1e-4, ((h, w), diff.max())
    assert T.Resize([50]).size == 50 and T.Resize((50, 60)).size == (50, 60)
    with pytest.raises(ValueError, match="int size"):
        T.Compose([T.Resize((50, 60)), T.CenterCrop(40)])
    for bad in ((0, 5), (5, 6, 7), 2**31, "5", ((3, 4),), [[5]]):
        with pytest.raises(ValueError):
            T.Resize(bad)
    # A bare step (not in a Compose) is refused saying how to use it.
    with pytest.raises(imagefeed.ConfigError, match="T.Compose"):
        loader(tmp_path / "c", transform=T.Resize((10, 10)))


# -- RandomErasing (#33) ------------------------------------------------------------------------


def test_erasing_keeps_its_units_when_the_gpu_normalizes(lmdb_path):
    """device="cuda" has the workers write unnormalized uint8 pixels (the GPU normalizes); the
    loader then hands RandomErasing the normalization itself, so value=0 is still the mean
    colour, not black. The description it makes, checked on the CPU."""
    mean, std = T.IMAGENET_MEAN, T.IMAGENET_STD
    erase = dict(T.Compose([T.RandomErasing(p=1.0, value=0)]).spec()["erase"], mean=mean, std=std)
    spec = dict(T.Compose([]).spec(), erase=erase)
    erased = loader(lmdb_path, transform=T.Transform(spec, "as the CUDA feed makes it"), dtype="uint8",
                    layout="NHWC", shuffle=False)
    plain = loader(lmdb_path, transform=T.Compose([]), dtype="uint8", layout="NHWC", shuffle=False)
    fill = np.round(np.array(mean) * 255).astype(np.uint8)
    changed_images = 0
    for (a, _), (b, _) in zip(erased, plain):
        changed = np.any(a != b, axis=-1)
        assert (a[changed] == fill).all()
        changed_images += int(changed.any(axis=(1, 2)).sum())
    assert changed_images > 10


def test_random_erasing_fills_one_rectangle_with_the_value_after_normalization(lmdb_path):
    mean, std = T.CIFAR10_MEAN, T.CIFAR10_STD
    plain = loader(lmdb_path, transform=T.Compose([T.Normalize(mean, std)]), shuffle=False, seed=2).dataset
    erased = loader(
        lmdb_path,
        transform=T.Compose([T.RandomErasing(p=0.5, value=0), T.Normalize(mean, std)]),
        shuffle=False,
        seed=2,
    ).dataset
    hits, areas = 0, []
    for i in range(120):
        before, after = plain[i][0], erased[i][0]
        changed = np.any(before != after, axis=0)
        if not changed.any():
            continue
        hits += 1
        rows, cols = np.nonzero(changed)
        # One rectangle, holding torchvision's value (0 after Normalize) within half a level.
        box = (slice(rows.min(), rows.max() + 1), slice(cols.min(), cols.max() + 1))
        inside = after[:, box[0], box[1]]
        half_level = 0.5 / 255 / np.array(std)[:, None, None] + 1e-6
        assert (np.abs(inside) <= half_level).all()
        assert changed.sum() <= inside.shape[1] * inside.shape[2]
        areas.append(inside.shape[1] * inside.shape[2] / (24 * 32))
    # p = 0.5 over 120 samples, areas from scale (0.02, 0.33).
    assert 40 <= hits <= 80, hits
    assert all(0.0 < a < 0.4 for a in areas)
    # Bit-identical for any worker count.
    one = loader(lmdb_path, workers=1, transform=T.Compose([T.RandomErasing(1.0, value="random")]), seed=4)
    two = loader(lmdb_path, workers=3, transform=T.Compose([T.RandomErasing(1.0, value="random")]), seed=4)
    for (a, _), (b, _) in zip(one, two):
        np.testing.assert_array_equal(a, b)
    for bad in (dict(p=2), dict(value="noise"), dict(value=(1, 2)), dict(scale=(0.5, 0.1))):
        with pytest.raises(ValueError):
            T.RandomErasing(**bad)
