"""Checkpoints: exact round trips (bf16 included), atomic replacement, and every kind of damage refused."""
import json
import os

import ml_dtypes
import numpy as np
import pytest

from gpucore import checkpoint, runtime
from gpucore.checkpoint import CheckpointError, load_checkpoint, load_checkpoint_meta, save_checkpoint


def _arrays(rng):
    bf = rng.standard_normal(37).astype(ml_dtypes.bfloat16)
    bf[:3] = [np.nan, np.inf, -0.0]  # special values must survive bit for bit
    return {
        "params": rng.standard_normal((5, 7)).astype(np.float32),
        "params_bf16": bf,
        "m": rng.standard_normal(11).astype(np.float16),
        "v": rng.random(13),                                       # float64
        "tokens": rng.integers(0, 50257, (3, 4)).astype(np.int32),
        "shard": rng.integers(0, 65535, 9).astype(np.uint16),
        "step": np.int64(1234),                                    # 0-d
        "mask": np.array([True, False, True]),
        "empty": np.zeros((0, 3), np.float32),
        "strided": np.arange(40, dtype=np.float32).reshape(8, 5)[::2, 1:4],  # not contiguous
    }


def _meta(rng_state=None):
    return {"config": {"n_layer": 2, "n_embd": 64, "dtype": "bfloat16"}, "step": np.int64(7),
            "loss": np.float32(3.25), "lr_history": [1e-3, 5e-4], "data": {"shard": 0, "batch": 3},
            "rng": rng_state, "note": "ünïcode ok", "nan": float("nan")}


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_round_trip_exact(tmp_path, rng):
    arrays = _arrays(rng)
    gen = np.random.default_rng(42)
    gen.random(5)
    path = tmp_path / "ckpt.bin"
    size = save_checkpoint(path, arrays, _meta(gen.bit_generator.state))
    assert size == os.path.getsize(path)
    loaded, meta = load_checkpoint(path)
    assert list(loaded) == list(arrays)  # order kept
    for k, a in arrays.items():
        assert _same_bits(np.ascontiguousarray(a) if np.ndim(a) else np.asarray(a), loaded[k]), k
        assert loaded[k].flags.writeable and loaded[k].flags.c_contiguous
    assert loaded["params_bf16"].dtype == ml_dtypes.bfloat16
    assert loaded["step"].shape == () and loaded["step"] == 1234
    assert meta["config"] == {"n_layer": 2, "n_embd": 64, "dtype": "bfloat16"}
    assert meta["step"] == 7 and meta["loss"] == 3.25 and meta["note"] == "ünïcode ok"
    assert np.isnan(meta["nan"])
    # the RNG state restores the exact stream
    restored = np.random.default_rng()
    restored.bit_generator.state = meta["rng"]
    assert np.array_equal(restored.random(4), gen.random(4))


def test_chunked_io_round_trip(tmp_path, rng, monkeypatch):
    """Big arrays are written, hashed and read in chunks; tiny chunks exercise the boundaries."""
    monkeypatch.setattr(checkpoint, "_CHUNK", 96)
    arrays = {"a": rng.standard_normal(1001).astype(np.float32), "b": rng.standard_normal(77).astype(ml_dtypes.bfloat16)}
    save_checkpoint(tmp_path / "c.ckpt", arrays, {})
    loaded, _ = load_checkpoint(tmp_path / "c.ckpt")
    assert all(_same_bits(arrays[k], loaded[k]) for k in arrays)


def test_layout_aligned_and_header(tmp_path, rng):
    path = tmp_path / "c.ckpt"
    save_checkpoint(path, _arrays(rng), {"x": 1})
    raw = path.read_bytes()
    assert raw[:8] == checkpoint.MAGIC
    hlen = int.from_bytes(raw[16:24], "little")
    doc = json.loads(raw[64:64 + hlen])
    assert doc["file_size"] == len(raw)
    for e in doc["arrays"]:
        assert e["offset"] % 64 == 0 and len(e["sha256"]) == 64 and e["sha256"] != "0" * 64
    assert load_checkpoint_meta(path) == {"x": 1}


def test_empty_and_overwrite(tmp_path):
    path = tmp_path / "c.ckpt"
    save_checkpoint(path, {}, None)
    assert load_checkpoint(path) == ({}, {})
    save_checkpoint(path, {"a": np.ones(3, np.float32)}, {"v": 2})  # replaces the old file
    arrays, meta = load_checkpoint(path)
    assert meta == {"v": 2} and np.array_equal(arrays["a"], np.ones(3))
    assert sorted(os.listdir(tmp_path)) == ["c.ckpt"]  # no temporary files left behind


def test_creates_parent_dirs(tmp_path):
    path = tmp_path / "a" / "b" / "c.ckpt"
    save_checkpoint(path, {"x": np.zeros(2, np.float32)}, {})
    assert load_checkpoint(path)[0]["x"].shape == (2,)


def test_bad_arguments_write_nothing(tmp_path):
    path = tmp_path / "c.ckpt"
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(path, {"a": np.zeros(2)}, {"obj": object()})
    with pytest.raises(TypeError, match="cannot be stored"):
        save_checkpoint(path, {"a": np.array(["x"])}, {})
    with pytest.raises(TypeError, match="cannot be stored"):
        save_checkpoint(path, {"a": np.zeros(2, np.complex64)}, {})
    with pytest.raises(TypeError, match="names must be str"):
        save_checkpoint(path, {1: np.zeros(2)}, {})
    with pytest.raises(TypeError, match="arrays: expected a dict"):
        save_checkpoint(path, [np.zeros(2)], {})
    with pytest.raises(TypeError, match="meta: expected a dict"):
        save_checkpoint(path, {}, [1])
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("where", ["array", "fsync"])
def test_failure_midway_keeps_old_file(tmp_path, rng, monkeypatch, where):
    path = tmp_path / "c.ckpt"
    old = {"w": rng.standard_normal(1000).astype(np.float32)}
    save_checkpoint(path, old, {"step": 1})
    before = path.read_bytes()

    new = {"w": rng.standard_normal(1000).astype(np.float32), "m": np.zeros(1000, np.float32),
           "v": np.zeros(1000, np.float32)}
    if where == "array":  # e.g. a GPU error in .get() after part of the file was written
        real, calls = checkpoint._to_host, []

        def failing(name, a):
            calls.append(name)
            if len(calls) == 2:
                raise RuntimeError("simulated failure while writing")
            return real(name, a)
        monkeypatch.setattr(checkpoint, "_to_host", failing)
    else:  # e.g. the disk filled up before the data reached it
        def failing_fsync(fd):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(checkpoint.os, "fsync", failing_fsync)
    with pytest.raises((RuntimeError, OSError)):
        save_checkpoint(path, new, {"step": 2})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["c.ckpt"]  # the temporary file was removed
    arrays, meta = load_checkpoint(path)
    assert meta == {"step": 1} and np.array_equal(arrays["w"], old["w"])


# -------------------------------------------------------------- damage ----

@pytest.fixture
def good(tmp_path, rng):
    path = tmp_path / "good.ckpt"
    save_checkpoint(path, {"a": rng.standard_normal(100).astype(np.float32),
                           "b": rng.standard_normal(50).astype(ml_dtypes.bfloat16)}, {"step": 3})
    return path


def _damaged(tmp_path, good, fn):
    raw = bytearray(good.read_bytes())
    out = tmp_path / "bad.ckpt"
    out.write_bytes(bytes(fn(raw)))
    return out


def _header(raw):
    hlen = int.from_bytes(raw[16:24], "little")
    return json.loads(bytes(raw[64:64 + hlen]))


def _flip(raw, i):
    raw[i] ^= 0xFF
    return raw


def test_missing_and_directory(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "nope.ckpt")
    with pytest.raises(CheckpointError, match="is a directory"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        load_checkpoint_meta(tmp_path / "nope.ckpt")


@pytest.mark.parametrize("cut", [0, 5, 40, 100, -1, -300])
def test_truncated(tmp_path, good, cut):
    size = good.stat().st_size
    n = cut if cut >= 0 else size + cut
    bad = _damaged(tmp_path, good, lambda r: r[:n])
    with pytest.raises(CheckpointError, match="truncated") as ei:
        load_checkpoint(bad)
    assert str(ei.value).startswith(str(bad))
    assert "\n" not in str(ei.value)


def test_trailing_garbage(tmp_path, good):
    bad = _damaged(tmp_path, good, lambda r: r + b"extra")
    with pytest.raises(CheckpointError, match="corrupt checkpoint.*header says"):
        load_checkpoint(bad)


def test_bad_magic_and_version(tmp_path, good):
    bad = _damaged(tmp_path, good, lambda r: b"NOTCKPT!" + r[8:])
    with pytest.raises(CheckpointError, match="not a gpucore checkpoint"):
        load_checkpoint(bad)
    bad = _damaged(tmp_path, good, lambda r: r[:8] + (99).to_bytes(4, "little") + r[12:])
    with pytest.raises(CheckpointError, match="unsupported checkpoint version 99"):
        load_checkpoint(bad)
    other = tmp_path / "text.ckpt"
    other.write_text("hello")  # smaller than the prefix, not ours
    with pytest.raises(CheckpointError, match="not a gpucore checkpoint"):
        load_checkpoint(other)


def test_data_file_is_not_a_checkpoint(tmp_path):
    from gpucore.data import write_shard
    write_shard(tmp_path / "x_train.bin", np.arange(100))
    with pytest.raises(CheckpointError, match="not a gpucore checkpoint"):
        load_checkpoint(tmp_path / "x_train.bin")


def test_corrupt_header(tmp_path, good):
    bad = _damaged(tmp_path, good, lambda r: _flip(r, 70))
    with pytest.raises(CheckpointError, match="header checksum mismatch"):
        load_checkpoint(bad)
    with pytest.raises(CheckpointError, match="header checksum mismatch"):
        load_checkpoint_meta(bad)


@pytest.mark.parametrize("which", ["a", "b"])
def test_corrupt_data(tmp_path, good, which):
    raw = bytearray(good.read_bytes())
    e = next(e for e in _header(raw)["arrays"] if e["name"] == which)
    bad = _damaged(tmp_path, good, lambda r: _flip(r, e["offset"] + e["nbytes"] // 2))
    with pytest.raises(CheckpointError, match=f"checksum mismatch in array '{which}'"):
        load_checkpoint(bad)
    arrays, _ = load_checkpoint(bad, verify=False)  # skipping the hash is possible on purpose
    assert arrays[which].shape == tuple(e["shape"])
    assert load_checkpoint_meta(bad) == {"step": 3}  # the header itself is fine


def test_checkpoint_error_is_value_error():
    assert issubclass(CheckpointError, ValueError)


@pytest.mark.cuda
def test_cupy_arrays_round_trip(tmp_path, rng):
    cp = runtime.cupy
    host = {"w": rng.standard_normal((64, 33)).astype(np.float32),
            "w_bf16": rng.standard_normal(1000).astype(ml_dtypes.bfloat16)}
    dev = {k: cp.asarray(v) for k, v in host.items()}
    dev["strided"] = cp.asarray(host["w"])[:, ::2]
    save_checkpoint(tmp_path / "g.ckpt", dev, {"on": "gpu"})
    loaded, meta = load_checkpoint(tmp_path / "g.ckpt")
    assert meta == {"on": "gpu"}
    assert _same_bits(loaded["w"], host["w"])
    assert _same_bits(loaded["w_bf16"], host["w_bf16"])
    assert _same_bits(loaded["strided"], np.ascontiguousarray(host["w"][:, ::2]))


# ------------------------------------------------------ training checkpoints ----

def test_killed_save_leaves_a_temp_file_that_cleanup_removes(tmp_path):
    """SIGKILL mid-save (no except clause runs) leaves .<name>.<random>.tmp; only the cleanup removes it,
    and only once it is older than min_age_s."""
    import subprocess
    import sys
    code = ("import os, signal, numpy as np\n"
            "from gpucore import checkpoint\n"
            "real, calls = checkpoint._to_host, []\n"
            "def dying(name, a):\n"
            "    calls.append(name)\n"
            "    if len(calls) == 2:\n"
            "        os.kill(os.getpid(), signal.SIGKILL)\n"
            "    return real(name, a)\n"
            "checkpoint._to_host = dying\n"
            f"checkpoint.save_checkpoint({str(tmp_path / 'ckpt_000007.ckpt')!r}, "
            "{'a': np.ones(1000, np.float32), 'b': np.ones(1000, np.float32)}, {})\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == -9, res.stderr
    (tmp,) = os.listdir(tmp_path)
    assert tmp.startswith(".ckpt_000007.ckpt.") and tmp.endswith(".tmp")
    assert checkpoint.remove_stale_temp_files(tmp_path, checkpoint.CHECKPOINT_GLOB) == []   # may be live
    other = tmp_path / ".unrelated.txt.x.tmp"
    other.write_text("not ours")
    removed = checkpoint.remove_stale_temp_files(tmp_path, checkpoint.CHECKPOINT_GLOB, min_age_s=0)
    assert removed == [tmp_path / tmp] and os.listdir(tmp_path) == [other.name]


def _fake_ckpts(d, steps):
    for s in steps:
        checkpoint.checkpoint_path(d, s).write_bytes(b"x")


def test_checkpoints_sort_by_step_not_name(tmp_path):
    _fake_ckpts(tmp_path, [999_999, 1_000_000, 5])
    (tmp_path / "ckpt_notes.ckpt").write_text("not a step")
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [5, 999_999, 1_000_000]
    assert checkpoint.find_checkpoint(tmp_path).name == "ckpt_1000000.ckpt"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no checkpoints"):
        checkpoint.find_checkpoint(empty)


def test_prune_keeps_the_newest_and_later_runs_checkpoints(tmp_path):
    _fake_ckpts(tmp_path, [1, 2, 3, 4, 5])
    # a run resumed at step 1 has just saved step 3: 4 and 5 are an earlier run's, not its to delete
    removed = checkpoint.prune_checkpoints(tmp_path, keep_last=1, newest_step=3)
    assert [p.name for p in removed] == ["ckpt_000001.ckpt", "ckpt_000002.ckpt"]
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [3, 4, 5]
    assert checkpoint.prune_checkpoints(tmp_path, keep_last=0, newest_step=5) == []
    assert checkpoint.prune_checkpoints(tmp_path, keep_last=5, newest_step=5) == []
