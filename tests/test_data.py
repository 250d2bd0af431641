"""Token shards (llm.c .bin format) and the batch loader: exact batches, resume, shuffle, bad files."""
import ctypes
import json

import numpy as np
import pytest

from gpucore import data, runtime
from gpucore.data import DataError, DataLoader, read_shard, read_shard_header, write_shard


def _tokens(n, start=0):
    """Token ids that encode their own position, so a wrong offset shows in the values."""
    return (np.arange(start, start + n) % 50000).astype(np.uint16)


def _expected(tokens, p, B, T):
    buf = tokens[p:p + B * T + 1].astype(np.int32)
    return buf[:-1].reshape(B, T), buf[1:].reshape(B, T)


# ------------------------------------------------------------------ shards ----

def test_write_read_round_trip(tmp_path):
    toks = np.array([0, 1, 50256, 65535, 7], dtype=np.int64)
    path = tmp_path / "d" / "x_train.bin"  # parent created
    assert write_shard(path, toks) == 5
    raw = path.read_bytes()
    assert len(raw) == 1024 + 2 * 5
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert list(header[:3]) == [20240520, 1, 5] and not header[3:].any()
    assert np.frombuffer(raw[1024:], dtype="<u2").tolist() == toks.tolist()
    got = read_shard(path)
    assert got.dtype == np.uint16 and got.tolist() == toks.tolist()
    assert read_shard_header(path) == 5
    assert write_shard(tmp_path / "e.bin", []) == 0 and read_shard(tmp_path / "e.bin").size == 0


def test_write_shard_rejects_bad_tokens(tmp_path):
    with pytest.raises(ValueError, match=r"\[0, 65535\]"):
        write_shard(tmp_path / "a.bin", [1, 65536])
    with pytest.raises(ValueError, match=r"\[0, 65535\]"):
        write_shard(tmp_path / "a.bin", [-1, 3])
    with pytest.raises(TypeError, match="integer"):
        write_shard(tmp_path / "a.bin", [1.5])
    assert not (tmp_path / "a.bin").exists()


def _shard_bytes(tmp_path, n=100):
    path = tmp_path / "src_train.bin"
    write_shard(path, _tokens(n))
    return bytearray(path.read_bytes())


def _bad(tmp_path, raw, name="bad_train.bin"):
    p = tmp_path / name
    p.write_bytes(bytes(raw))
    return p


@pytest.mark.parametrize("case, match", [
    ("missing", "data file not found"),
    ("empty", "truncated data file"),
    ("short_header", "truncated data file"),
    ("magic", "bad magic number 12345"),
    ("version", "unsupported token file version 2"),
    ("cut_tokens", "header says 100 tokens .* truncated or corrupt"),
    ("extra_bytes", "header says 100 tokens .* truncated or corrupt"),
    ("negative_count", "header says -5 tokens"),
])
def test_read_shard_bad_files(tmp_path, case, match):
    raw = _shard_bytes(tmp_path)
    if case == "missing":
        path = tmp_path / "nope.bin"
    elif case == "empty":
        path = _bad(tmp_path, b"")
    elif case == "short_header":
        path = _bad(tmp_path, raw[:500])
    elif case == "magic":
        raw[0:4] = np.int32(12345).tobytes()
        path = _bad(tmp_path, raw)
    elif case == "version":
        raw[4:8] = np.int32(2).tobytes()
        path = _bad(tmp_path, raw)
    elif case == "cut_tokens":
        path = _bad(tmp_path, raw[:-3])
    elif case == "extra_bytes":
        path = _bad(tmp_path, raw + b"\0\0")
    else:
        raw[8:12] = np.int32(-5).tobytes()
        path = _bad(tmp_path, raw)
    for fn in (read_shard, read_shard_header, lambda p: DataLoader(p, 1, 4)):
        with pytest.raises(DataError, match=match) as ei:
            fn(path)
        assert str(ei.value).startswith(str(path)) and "\n" not in str(ei.value)
    assert issubclass(DataError, ValueError)


def test_read_shard_vocab_check(tmp_path):
    path = tmp_path / "v_train.bin"
    write_shard(path, [5, 50256, 50257, 3, 60000])
    assert read_shard(path).max() == 60000  # no check without vocab_size
    with pytest.raises(DataError, match="token id 60000 >= vocab_size 50257 .*50257 at index 2"):
        read_shard(path, vocab_size=50257)
    read_shard(path, vocab_size=60001)


def test_directory_is_not_a_shard(tmp_path):
    with pytest.raises(DataError, match="is a directory"):
        read_shard(tmp_path)


# ------------------------------------------------------------ file selection ----

def test_file_selection(tmp_path):
    d = tmp_path / "ts"
    write_shard(d / "ts_train_000001.bin", _tokens(50))
    write_shard(d / "ts_train_000000.bin", _tokens(50))
    write_shard(d / "ts_val.bin", _tokens(40))
    names = lambda dl: [p.name for p in dl.files]  # noqa: E731
    assert names(DataLoader(d, 1, 4, split="train")) == ["ts_train_000000.bin", "ts_train_000001.bin"]
    assert names(DataLoader(d, 1, 4, split="val")) == ["ts_val.bin"]
    assert len(DataLoader(d, 1, 4).files) == 3
    assert names(DataLoader(str(d / "ts_{split}*.bin"), 1, 4, split="val")) == ["ts_val.bin"]
    assert names(DataLoader(str(d / "*.bin"), 1, 4, split="train"))[0] == "ts_train_000000.bin"
    assert names(DataLoader(d / "ts_val.bin", 1, 4, split="train")) == ["ts_val.bin"]  # a file is used as is
    with pytest.raises(DataError, match="no data files match .* for split 'test'"):
        DataLoader(d, 1, 4, split="test")
    with pytest.raises(DataError, match="no data files match"):
        DataLoader(str(tmp_path / "nothing_*.bin"), 1, 4)
    with pytest.raises(DataError, match="data file not found"):
        DataLoader(tmp_path / "missing.bin", 1, 4)


# ------------------------------------------------------------------ loader ----

def test_batches_follow_llmc(tmp_path):
    B, T = 2, 5
    toks = _tokens(47)                       # (47 - 1) // 10 = 4 batches, 6 tokens left over
    write_shard(tmp_path / "a_train.bin", toks)
    dl = DataLoader(tmp_path / "a_train.bin", B, T)
    assert dl.num_tokens == 47 and dl.num_batches == 4
    for epoch in range(2):
        for k in range(4):
            x, y = dl.next_batch()
            assert isinstance(x, np.ndarray) and x.dtype == np.int32 and y.dtype == np.int32
            assert x.shape == y.shape == (B, T) and x.flags.c_contiguous and y.flags.c_contiguous
            ex, ey = _expected(toks, k * B * T, B, T)
            assert np.array_equal(x, ex) and np.array_equal(y, ey)
            assert np.array_equal(x.reshape(-1)[1:], y.reshape(-1)[:-1])  # targets = inputs shifted
        assert dl.epoch == epoch + 1


def test_last_batch_uses_the_final_token(tmp_path):
    B, T = 1, 4
    toks = _tokens(9)                        # positions 0, 4; batch at 4 reads tokens[4:9]
    write_shard(tmp_path / "a.bin", toks)
    dl = DataLoader(tmp_path / "a.bin", B, T)
    dl.next_batch()
    x, y = dl.next_batch()
    assert x.tolist() == [[4, 5, 6, 7]] and y.tolist() == [[5, 6, 7, 8]]
    assert dl.next_batch()[0].tolist() == [[0, 1, 2, 3]]  # wrapped


def test_multiple_shards_in_order_and_wrap(tmp_path):
    B, T = 2, 3
    shards = [_tokens(20, 0), _tokens(13, 1000), _tokens(31, 2000)]
    for i, s in enumerate(shards):
        write_shard(tmp_path / f"x_train_{i:03d}.bin", s)
    dl = DataLoader(tmp_path, B, T, split="train")
    per = [(len(s) - 1) // (B * T) for s in shards]
    assert dl.shard_batches == per == [3, 2, 5] and dl.num_batches == 10 and dl.num_tokens == 64
    for _ in range(2):
        for s, nb in zip(shards, per):
            for k in range(nb):
                x, y = dl.next_batch()
                ex, ey = _expected(s, k * B * T, B, T)
                assert np.array_equal(x, ex) and np.array_equal(y, ey)


def test_returned_batches_are_independent(tmp_path):
    write_shard(tmp_path / "a.bin", _tokens(100))
    dl = DataLoader(tmp_path / "a.bin", 2, 4)
    x0, _ = dl.next_batch()
    keep = x0.copy()
    x0[:] = -1                               # the caller may scribble on its batch
    dl.reset()
    assert np.array_equal(dl.next_batch()[0], keep)


def test_too_few_tokens_for_a_batch(tmp_path):
    write_shard(tmp_path / "a_val.bin", _tokens(40))
    DataLoader(tmp_path / "a_val.bin", 3, 13)  # 40 = 3*13 + 1: exactly one batch
    with pytest.raises(DataError, match=r"40 tokens is fewer than one batch needs \(B\*T \+ 1 = 41"):
        DataLoader(tmp_path / "a_val.bin", 4, 10)
    with pytest.raises(DataError, match=r"2\*B\*T \+ 1 = 41"):
        DataLoader(tmp_path / "a_val.bin", 2, 10, num_processes=2)


def test_vocab_checked_when_shard_loads(tmp_path):
    write_shard(tmp_path / "x_train_0.bin", _tokens(30))
    bad = _tokens(30)
    bad[17] = 50257
    write_shard(tmp_path / "x_train_1.bin", bad)
    dl = DataLoader(tmp_path, 1, 4, split="train", vocab_size=50257)  # headers fine: construction works
    for _ in range((30 - 1) // 4):
        dl.next_batch()                                                   # shard 0 is clean
    with pytest.raises(DataError, match="x_train_1.bin: token id 50257 >= vocab_size 50257"):
        dl.next_batch()


def test_bad_arguments(tmp_path):
    write_shard(tmp_path / "a.bin", _tokens(100))
    for kw, match in [({"B": 0}, "B: expected a positive int"), ({"T": -1}, "T: expected"),
                      ({"B": 2.5}, "B: expected"), ({"process_rank": 2, "num_processes": 2}, "process_rank"),
                      ({"vocab_size": 0}, "vocab_size")]:
        args = {"B": 2, "T": 4} | kw
        with pytest.raises(ValueError, match=match):
            DataLoader(tmp_path / "a.bin", **args)


def _run(dl, n):
    return [tuple(a.copy() for a in dl.next_batch()) for _ in range(n)]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("after", [0, 1, 4, 9, 17])
def test_resume_is_exact(tmp_path, shuffle, after):
    for i, n in enumerate([41, 25, 60]):
        write_shard(tmp_path / f"x_train_{i}.bin", _tokens(n, 100 * i))
    mk = lambda: DataLoader(tmp_path, 2, 4, split="train", shuffle=shuffle, seed=3)  # noqa: E731
    ref = mk()
    _run(ref, after)
    state = json.loads(json.dumps(ref.state_dict()))  # it goes through a checkpoint's JSON
    cont = _run(ref, 15)                               # crosses shard and epoch boundaries
    resumed = mk()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    for (x, y), (rx, ry) in zip(cont, _run(resumed, 15)):
        assert np.array_equal(x, rx) and np.array_equal(y, ry)


def test_state_dict_fields_and_reset(tmp_path):
    write_shard(tmp_path / "a_train.bin", _tokens(41))
    dl = DataLoader(tmp_path / "a_train.bin", 2, 4)
    s0 = dl.state_dict()
    assert (s0["epoch"], s0["shard"], s0["batch"], s0["position"]) == (0, 0, 0, 0)
    first = _run(dl, 3)
    s = dl.state_dict()
    assert (s["epoch"], s["shard"], s["batch"], s["position"], s["file"]) == (0, 0, 3, 24, "a_train.bin")
    dl.reset()
    assert dl.state_dict() == s0
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(first, _run(dl, 3)))


def test_load_state_dict_mismatch(tmp_path):
    write_shard(tmp_path / "a_train.bin", _tokens(100))
    write_shard(tmp_path / "b_train.bin", _tokens(100))
    state = DataLoader(tmp_path / "a_train.bin", 2, 4).state_dict()
    with pytest.raises(DataError, match="saved with B=2, this loader has B=3"):
        DataLoader(tmp_path / "a_train.bin", 3, 4).load_state_dict(state)
    with pytest.raises(DataError, match="saved with shuffle=False"):
        DataLoader(tmp_path / "a_train.bin", 2, 4, shuffle=True).load_state_dict(state)
    with pytest.raises(DataError, match="saved over files"):
        DataLoader(tmp_path / "b_train.bin", 2, 4).load_state_dict(state)
    with pytest.raises(DataError, match="missing 'batch'"):
        DataLoader(tmp_path / "a_train.bin", 2, 4).load_state_dict({k: v for k, v in state.items() if k != "batch"})
    with pytest.raises(DataError, match="out of range"):
        DataLoader(tmp_path / "a_train.bin", 2, 4).load_state_dict(state | {"batch": 12})


def test_shuffle_is_a_permutation_per_epoch(tmp_path):
    B, T = 1, 4
    for i in range(3):
        write_shard(tmp_path / f"x_train_{i}.bin", _tokens(41, 1000 * i))  # 10 batches each
    dl = DataLoader(tmp_path, B, T, split="train", shuffle=True, seed=0)
    plain = DataLoader(tmp_path, B, T, split="train")
    everything = sorted(int(x[0, 0]) for x, _ in _run(plain, 30))
    epochs = [[int(x[0, 0]) for x, _ in _run(dl, 30)] for _ in range(2)]
    assert sorted(epochs[0]) == everything and sorted(epochs[1]) == everything  # every batch once
    assert epochs[0] != epochs[1]                                               # new order each epoch
    assert epochs[0] != sorted(epochs[0])
    same = DataLoader(tmp_path, B, T, split="train", shuffle=True, seed=0)
    other = DataLoader(tmp_path, B, T, split="train", shuffle=True, seed=1)
    assert [int(x[0, 0]) for x, _ in _run(same, 30)] == epochs[0]               # seeded
    assert [int(x[0, 0]) for x, _ in _run(other, 30)] != epochs[0]
    for x, y in _run(dl, 30):                                                   # still aligned windows
        assert np.array_equal(x.reshape(-1)[1:], y.reshape(-1)[:-1]) and int(x[0, 0]) % 4 == 0


def test_processes_split_each_step(tmp_path):
    B, T, W = 2, 3, 3
    toks = _tokens(100)
    write_shard(tmp_path / "a.bin", toks)
    loaders = [DataLoader(tmp_path / "a.bin", B, T, process_rank=r, num_processes=W) for r in range(W)]
    assert loaders[0].num_batches == (100 - 1) // (W * B * T) == 5
    for k in range(5):
        for r, dl in enumerate(loaders):
            x, y = dl.next_batch()
            ex, ey = _expected(toks, k * W * B * T + r * B * T, B, T)
            assert np.array_equal(x, ex) and np.array_equal(y, ey)


def test_repr(tmp_path):
    write_shard(tmp_path / "a_val.bin", _tokens(100))
    r = repr(DataLoader(tmp_path / "a_val.bin", 2, 4))
    assert "100 tokens" in r and "12 batches/epoch" in r


# ---------------------------------------------- GPU bookkeeping, on the CPU ----

class _FakeCupy:
    """Just enough of CuPy for the loader's prefetch path, with synchronous copies.

    It cannot show races, but it runs the slot/cursor/state bookkeeping of the GPU
    path on any machine; the real streams and events are covered by the cuda tests.
    """

    class _Dev:
        def __init__(self, shape, dtype):
            self.arr = np.full(shape, -7, dtype=dtype)
            self.shape, self.dtype = self.arr.shape, self.arr.dtype
            self.data = self

        def copy_from_host_async(self, ptr, nbytes, stream):
            assert isinstance(stream, _FakeCupy.cuda.Stream) and nbytes == self.arr.nbytes
            ctypes.memmove(self.arr.ctypes.data, ptr, nbytes)

        def get(self):
            return self.arr.copy()

    class cuda:  # noqa: N801 - mirrors cupy.cuda
        class Stream:
            def __init__(self, non_blocking=False):
                assert non_blocking

            def wait_event(self, event):
                assert event.recorded

            def synchronize(self):
                pass

        class Event:
            def __init__(self, disable_timing=False):
                self.recorded = False

            def record(self, stream):
                self.recorded = True

            def synchronize(self):
                assert self.recorded

        @staticmethod
        def alloc_pinned_memory(nbytes):
            return bytearray(nbytes)

        @staticmethod
        def get_current_stream():
            return _FakeCupy.cuda.Stream(non_blocking=True)

    @staticmethod
    def empty(shape, dtype):
        return _FakeCupy._Dev(shape, dtype)


@pytest.mark.parametrize("shuffle", [False, True])
def test_prefetch_path_bookkeeping(tmp_path, shuffle):
    for i, n in enumerate([41, 25, 60]):
        write_shard(tmp_path / f"x_train_{i}.bin", _tokens(n, 100 * i))
    kw = dict(split="train", shuffle=shuffle, seed=2)
    cpu = DataLoader(tmp_path, 2, 4, **kw)
    gpu = DataLoader(tmp_path, 2, 4, xp=_FakeCupy, **kw)
    slots = set()
    for step in range(25):
        assert gpu.state_dict() == cpu.state_dict(), step   # the prefetched batch is not "consumed"
        x, y = gpu.next_batch()
        slots.add(id(x))
        ex, ey = cpu.next_batch()
        assert np.array_equal(x.get(), ex) and np.array_equal(y.get(), ey), step
        if step == 10:
            state = gpu.state_dict()
            expected = _run(cpu, 6)
            resumed = DataLoader(tmp_path, 2, 4, xp=_FakeCupy, **kw)
            resumed.load_state_dict(state)
            assert [r.get().tolist() for r, _ in (resumed.next_batch() for _ in range(6))] == \
                [e.tolist() for e, _ in expected]
            gpu.load_state_dict(state)                      # drops its prefetched batch
            for _ in range(6):                              # back in step with cpu
                gpu.next_batch()
    assert len(slots) == 2                                  # two device slots alternate
    gpu.reset()
    cpu.reset()
    assert gpu.state_dict() == cpu.state_dict()
    assert np.array_equal(gpu.next_batch()[0].get(), cpu.next_batch()[0])


# --------------------------------------------------------------------- GPU ----

@pytest.mark.cuda
@pytest.mark.parametrize("shuffle", [False, True])
def test_gpu_loader_matches_cpu(tmp_path, shuffle):
    """The prefetching GPU loader returns exactly the CPU loader's batches, also when the caller
    computes on its own stream between calls and when resuming from a state taken mid-prefetch."""
    cp = runtime.cupy
    B, T = 4, 64
    for i, n in enumerate([3000, 1100, 2500]):
        write_shard(tmp_path / f"x_train_{i}.bin", np.random.default_rng(i).integers(0, 50257, n))
    kw = dict(split="train", shuffle=shuffle, seed=5, vocab_size=50257)
    cpu = DataLoader(tmp_path, B, T, **kw)
    gpu = DataLoader(tmp_path, B, T, xp=cp, **kw)
    compute = cp.cuda.Stream(non_blocking=True)
    acc = cp.zeros((B, T), dtype=cp.int64)
    with compute:
        for step in range(2 * cpu.num_batches + 3):       # two epochs and a bit, over every shard
            assert gpu.state_dict() == cpu.state_dict()
            x, y = gpu.next_batch()
            assert isinstance(x, cp.ndarray) and x.dtype == cp.int32 and x.shape == (B, T)
            acc += x.astype(cp.int64) * (step + 1)        # queue work that reads the batch
            acc -= y.astype(cp.int64)
            ex, ey = cpu.next_batch()
            assert np.array_equal(x.get(), ex) and np.array_equal(y.get(), ey), step
        state = gpu.state_dict()
        expected = _run(cpu, 5)
        again = DataLoader(tmp_path, B, T, xp=cp, **kw)
        again.load_state_dict(state)
        for (ex, ey) in expected:
            x, y = again.next_batch()
            assert np.array_equal(x.get(), ex) and np.array_equal(y.get(), ey)
        gpu.reset()
        cpu.reset()
        assert np.array_equal(gpu.next_batch()[0].get(), cpu.next_batch()[0])
    compute.synchronize()


@pytest.mark.cuda
def test_gpu_batch_not_overwritten_while_in_use(tmp_path):
    """Work queued on a batch before the next next_batch() call sees it intact, even when the GPU
    only gets to that work after the loader has started copying the following batches."""
    cp = runtime.cupy
    B, T = 8, 128
    write_shard(tmp_path / "a.bin", np.random.default_rng(0).integers(0, 50257, 20 * B * T + 1))
    cpu = DataLoader(tmp_path / "a.bin", B, T)
    gpu = DataLoader(tmp_path / "a.bin", B, T, xp=cp)
    busy = cp.ones((4096, 4096), dtype=cp.float32)
    snaps = []
    for _ in range(12):
        x, y = gpu.next_batch()
        for _ in range(3):
            busy = (busy @ busy) * (1.0 / 4096)         # milliseconds of GPU work ...
        snaps.append((x.copy(), y.copy()))              # ... so these reads run late, after the
    cp.cuda.get_current_stream().synchronize()          # next calls have queued their copies
    for k, (sx, sy) in enumerate(snaps):
        ex, ey = cpu.next_batch()
        assert np.array_equal(sx.get(), ex) and np.array_equal(sy.get(), ey), k
    assert float(busy[0, 0]) == 1.0
