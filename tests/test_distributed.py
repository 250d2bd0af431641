"""Data-parallel training (gpucore.distributed) on CPU ranks: the same bucketing and ZeRO-1 code as on GPUs.

End to end, as users start it: `gpucore train --nproc N` (TCP between the ranks) and
`mpirun -np N gpucore train` (MPI), tiny model, NumPy backend, fp32. N ranks with B rows
each must train like one rank accumulating N micro-batches of B rows (same global batch):
losses within 1e-6 relative (the gradient sums run in another order), with and without
ZeRO-1. Also: a checkpoint of 2 ZeRO ranks resumes on 1 and on 2 ZeRO ranks; FP8 ranks
share their scales, so their checkpoint resumes bitwise; a killed or stopped rank ends the
job with one line naming it. Unit tests: shard layout, the TCP communicator, the launcher
environments, the data position across a change of rank count.
GPU (-m cuda): --nproc 1 through NCCL matches the plain run bitwise (bf16 and FP8), and its
ZeRO-1 checkpoint resumes bitwise.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gpucore import data as datamod
from gpucore.distributed.comm import DistributedError
from gpucore.distributed.hostcomm import SocketComm
from gpucore.distributed.launch import ProcessInfo, detect, free_port
from gpucore.distributed.parallel import plan_for
from gpucore.distributed.reducer import GradientReducer, parameter_slices
from gpucore.distributed.zero import ShardedAdamW, ShardLayout
from gpucore.model import GPT2, GPT2Config

REPO = Path(__file__).resolve().parents[1]
HAVE_MPI = shutil.which("mpiexec") is not None and subprocess.run(
    [sys.executable, "-c", "import mpi4py"], capture_output=True).returncode == 0


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCORE_RANK", "GPUCORE_WORLD", "PMI_",
                                                                      "OMPI_", "SLURM_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _train_argv(shards, out, steps=3, device="cpu", model="tiny", B=1, T=32, total=192, *extra):
    return ["-m", "gpucore.cli", "train", "--model", model, "--device", device, "-B", str(B), "-T", str(T),
            "--total-batch-size", str(total), "--steps", str(steps), "--lr", "1e-3", "--val-every", "0",
            "--sample-every", "0", "--data", str(shards), "--out-dir", str(out), *map(str, extra)]


def _job(argv, launcher=None, nproc=0, timeout=600, env=None):
    """Run one training job to the end (env: extra variables); (returncode, stdout, stderr)."""
    if launcher == "mpi":
        cmd = ["mpiexec", "-n", str(nproc), sys.executable, *argv]
    else:
        cmd = [sys.executable, *argv] + (["--nproc", str(nproc)] if nproc else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**_env(), **(env or {})}, cwd=REPO)
    return p.returncode, p.stdout, p.stderr


def _metrics(out):
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    return np.array([r["loss"] for r in steps]), np.array([r["grad_norm"] for r in steps])


@pytest.fixture(scope="module")
def one_rank(shards, tmp_path_factory):
    """The reference: one process accumulating 6 micro-batches of 1 x 32 tokens, 5 steps."""
    out = tmp_path_factory.mktemp("one_rank")
    code, so, se = _job(_train_argv(shards, out, 5))
    assert code == 0, so + se
    assert "grad accum 6" in so
    return out


@pytest.fixture(scope="module")
def zero_two_ranks(shards, tmp_path_factory):
    """`--nproc 2 --zero 1`, 3 steps of the reference's global batch: (out dir, stdout)."""
    out = tmp_path_factory.mktemp("zero_two_ranks")
    code, so, se = _job(_train_argv(shards, out, 3, "cpu", "tiny", 1, 32, 192, "--zero", 1), nproc=2)
    assert code == 0, so + se
    return out, so


# every launcher, rank count and ZeRO setting appears at least once (each job costs seconds in CI)
LAUNCHES = [("nproc", 2, 1), ("nproc", 3, 0), ("mpi", 2, 0), ("mpi", 3, 1)]


@pytest.mark.parametrize("launcher,nproc,zero", LAUNCHES, ids=[f"{a}{n}-zero{z}" for a, n, z in LAUNCHES])
def test_ranks_train_like_one_rank_with_accumulation(shards, one_rank, zero_two_ranks, tmp_path, launcher, nproc,
                                                     zero):
    if launcher == "mpi" and not HAVE_MPI:
        pytest.skip("mpi4py / mpiexec not installed (pip install 'gpucore[mpi]')")
    if (launcher, nproc, zero) == ("nproc", 2, 1):
        tmp_path, so = zero_two_ranks
    else:
        code, so, se = _job(_train_argv(shards, tmp_path, 3, "cpu", "tiny", 1, 32, 192, "--zero", zero),
                            "mpi" if launcher == "mpi" else None, nproc)
        assert code == 0, so + se
    assert f"data parallel: {nproc} ranks" in so and f"grad accum {6 // nproc}" in so
    assert ("ZeRO-1" in so) == bool(zero)
    assert so.count("step     1/3") == 1, "only rank 0 prints"
    loss, norm = _metrics(tmp_path)
    ref_loss, ref_norm = _metrics(one_rank)
    assert len(loss) == 3
    # the same global batch: only the order of the gradient sums differs (fp32)
    np.testing.assert_allclose(loss, ref_loss[:3], rtol=1e-6, atol=0)
    np.testing.assert_allclose(norm, ref_norm[:3], rtol=1e-5, atol=0)
    assert loss[-1] < loss[0] - 0.01          # it trains


def test_two_ranks_are_deterministic_and_launcher_independent(shards, zero_two_ranks, tmp_path):
    """Same seed, same N: bitwise-identical losses from another run, through another launcher
    (MPI instead of TCP; a sum of two terms does not depend on the order)."""
    launcher = "mpi" if HAVE_MPI else None
    code, so, se = _job(_train_argv(shards, tmp_path, 3, "cpu", "tiny", 1, 32, 192, "--zero", 1), launcher, 2)
    assert code == 0, so + se
    first, again = _metrics(zero_two_ranks[0])[0], _metrics(tmp_path)[0]
    assert np.array_equal(first, again), (first, again)


@pytest.mark.parametrize("zero", [1, 0])
def test_reducing_after_the_backward_gives_the_same_losses(shards, zero_two_ranks, tmp_path, zero):
    """By default (settings.dp_overlap off) the gradients are reduced after the backward (ZeRO-1:
    bucket by bucket; plain: one all-reduce of the whole flat buffer); dp_overlap=1 reduces each
    layer's bucket beside the backward. The sums of two ranks are the same either way, so the
    losses are bitwise equal."""
    code, so, se = _job(_train_argv(shards, tmp_path / "overlapped", 3, "cpu", "tiny", 1, 32, 192, "--zero", zero),
                        nproc=2, env={"GPUCORE_SETTINGS": "dp_overlap=1"})
    assert code == 0, so + se
    after = zero_two_ranks[0] if zero else tmp_path / "after"     # the default: dp_overlap off
    if not zero:
        code, so, se = _job(_train_argv(shards, after, 3, "cpu", "tiny", 1, 32, 192), nproc=2)
        assert code == 0, so + se
    first, after = _metrics(tmp_path / "overlapped")[0], _metrics(after)[0]
    assert len(after) == 3 and np.array_equal(first, after), (first, after)


@pytest.mark.parametrize("launcher,zero", [("nproc", 0), ("mpi", 1)])
def test_fp8_ranks_share_their_scales_so_a_checkpoint_resumes_bitwise(shards, tmp_path, launcher, zero):
    """--dtype fp8 on 2 CPU ranks: each step's amaxes are max-reduced over the ranks before the scale
    update, so every rank holds rank 0's scales and the checkpoint (rank 0's) is every rank's state:
    a run resumed at step 2 repeats steps 3-4 bit for bit. (Ranks that kept their own scales would
    resume rank 1 with rank 0's and part.) The ranks also train like one rank accumulating 2
    micro-batches, to FP8 rounding."""
    if launcher == "mpi" and not HAVE_MPI:
        pytest.skip("mpi4py / mpiexec not installed (pip install 'gpucore[mpi]')")
    launch = "mpi" if launcher == "mpi" else None
    argv = lambda out, steps, *extra: _train_argv(shards, out, steps, "cpu", "tiny", 1, 32, 64, "--dtype", "fp8",
                                                  "--zero", zero, *extra)
    code, so, se = _job(argv(tmp_path / "full", 4, "--ckpt-every", 2, "--keep-last", 0), launch, 2)
    assert code == 0, so + se
    assert "data parallel: 2 ranks" in so
    (tmp_path / "resumed").mkdir()
    shutil.copy(tmp_path / "full" / "metrics.jsonl", tmp_path / "resumed" / "metrics.jsonl")
    code, so, se = _job(argv(tmp_path / "resumed", 4, "--resume", tmp_path / "full" / "ckpt_000002.ckpt"), launch, 2)
    assert code == 0, so + se
    full, resumed = _metrics(tmp_path / "full"), _metrics(tmp_path / "resumed")
    assert len(full[0]) == 4 and np.array_equal(full[0], resumed[0][-4:]), (full[0], resumed[0])
    assert np.array_equal(full[1], resumed[1][-4:])
    code, so, se = _job(argv(tmp_path / "one", 4))
    assert code == 0, so + se
    one = _metrics(tmp_path / "one")
    np.testing.assert_allclose(full[0], one[0], rtol=2e-3, atol=0)
    assert not np.array_equal(full[0], one[0])        # FP8: another rounding, not the same bits
    assert full[0][-1] < full[0][0] - 0.05            # it trains


def test_zero_checkpoint_resumes_on_zero_ranks(shards, one_rank, zero_two_ranks, tmp_path):
    """`--nproc 2 --zero 1 --resume`: each rank takes its shard of the saved whole m and v
    (ShardedAdamW.load_state), so steps 4-5 are the one-rank run's. Step 5's loss follows step 4's
    update, which reads m and v: a shard taken from the wrong place would part from it."""
    shutil.copy(zero_two_ranks[0] / "metrics.jsonl", tmp_path / "metrics.jsonl")
    ckpt = zero_two_ranks[0] / "ckpt_000003.ckpt"
    code, so, se = _job(_train_argv(shards, tmp_path, 5, "cpu", "tiny", 1, 32, 192, "--zero", 1, "--resume", ckpt),
                        nproc=2)
    assert code == 0, so + se
    assert "ZeRO-1" in so
    loss, _ = _metrics(tmp_path)
    ref_loss, _ = _metrics(one_rank)
    assert len(loss) == 5
    np.testing.assert_allclose(loss[-2:], ref_loss[3:5], rtol=1e-6, atol=0)


def test_zero_checkpoint_of_two_ranks_resumes_on_one(shards, one_rank, zero_two_ranks, tmp_path):
    from gpucore.checkpoint import load_checkpoint
    shutil.copy(zero_two_ranks[0] / "metrics.jsonl", tmp_path / "metrics.jsonl")
    ckpt = shutil.copy(zero_two_ranks[0] / "ckpt_000003.ckpt", tmp_path / "ckpt_000003.ckpt")
    arrays, meta = load_checkpoint(ckpt)
    ref, _ = load_checkpoint(one_rank / "ckpt_000005.ckpt")
    assert meta["data"]["num_processes"] == 2 and meta["optimizer"]["step"] == 3
    for name in ("params", "m", "v"):        # the whole state, gathered from both shards
        assert arrays[name].shape == ref[name].shape and np.isfinite(arrays[name]).all()
        assert np.count_nonzero(arrays[name]) > 0.9 * arrays[name].size - 50304 * 64
    # continue on one rank to step 5: the same as the one-rank run's steps 4 and 5
    code, so, se = _job(_train_argv(shards, tmp_path, 5, "cpu", "tiny", 1, 32, 192, "--resume", ckpt))
    assert code == 0, so + se
    assert "data position: saved with 2 processes" in so
    loss, _ = _metrics(tmp_path)
    ref_loss, _ = _metrics(one_rank)
    np.testing.assert_allclose(loss[-2:], ref_loss[3:5], rtol=1e-6, atol=0)


def test_one_rank_error_is_one_line_naming_the_rank(shards, tmp_path):
    code, so, se = _job(_train_argv(shards, tmp_path, 3, "cpu", "tiny", 1, 32, 96), nproc=2, timeout=120)
    assert code == 1
    assert "Error: rank 0: --total-batch-size 96 is not a multiple of B*T x 2 ranks = 1*32*2 = 64" in se
    assert "Traceback" not in se


def test_divergence_stops_every_rank_at_the_same_step(shards, tmp_path):
    """lr 1e20: the agreed loss of step 2 is NaN on both ranks, so both stop there with one line each
    and the job exits 1; rank 0 had saved step 1 and nothing after it."""
    code, so, se = _job(_train_argv(shards, tmp_path, 4, "cpu", "tiny", 1, 32, 64, "--lr", "1e20",
                                    "--warmup", 0, "--ckpt-every", 1), nproc=2, timeout=300)
    assert code == 1, so + se
    assert "Traceback" not in se
    # each rank prints its own line; the launcher may end one before it prints, never both
    assert re.search(r"Error: rank [01]: step 2: loss nan, gradient norm nan: training stopped", se), se
    assert "the last checkpoint is step 1" in se and "step 3" not in se, se
    assert sorted(p.name for p in tmp_path.glob("ckpt_*")) == ["ckpt_000001.ckpt"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r and "event" not in r] == [1]
    assert rows[-1]["event"] == "non-finite" and rows[-1]["step"] == 2


def _rank_pid(parent_pid, rank, deadline):
    """The pid of the worker with GPUCORE_RANK=rank among parent_pid's children (Linux /proc)."""
    while time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                env = (d / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == parent_pid and f"GPUCORE_RANK={rank}".encode() in env:
                return int(d.name)
        time.sleep(0.1)
    raise AssertionError(f"no worker of rank {rank} under pid {parent_pid}")


def _wait_for_steps(out, proc, deadline):
    path = Path(out) / "metrics.jsonl"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the job ended early: {proc.communicate()}")
        if path.exists() and '"loss"' in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError("no step finished in time")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the worker processes through /proc")
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_dead_or_hung_rank_ends_the_job_naming_it(shards, tmp_path, how):
    """SIGKILL: the launcher sees rank 1 die and stops rank 0. SIGSTOP (a hang): rank 0 gives up
    waiting after --dist-timeout, says so, and the launcher stops the stopped rank."""
    argv = _train_argv(shards, tmp_path, 100000, "cpu", "tiny", 1, 32, 64, "--no-checkpoint",
                       "--dist-timeout", 8)
    proc = subprocess.Popen([sys.executable, *argv, "--nproc", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        _wait_for_steps(tmp_path, proc, deadline)
        victim = _rank_pid(proc.pid, 1, deadline)
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        _, err = proc.communicate(timeout=90)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    if how == "kill":
        # rank 0 may notice first (its connection to rank 1 closed) and exit before the launcher
        # stops it: the launcher still names the rank that died
        assert "gpucore: rank 1 was killed by SIGKILL" in err, err
        assert took < 30
    else:
        # rank 0 notices first, after --dist-timeout, in one of three ways: its socket's receive
        # times out, its send times out (the stopped rank's socket buffer is full mid all-reduce),
        # or its watchdog sees no step finish
        assert ("rank 0: no data from rank 1 for 8 s (it hangs or died)" in err
                or "rank 0: rank 1 took no data for 8 s (it hangs or died)" in err
                or "rank 0: no progress for" in err), err
        assert "gpucore: rank 0 exited with status 1; stopping ranks [1]" in err
        assert took < 60


# ------------------------------------------------------------------ units ----

def _slices(sizes, decays=None):
    decays = decays or [True] * len(sizes)
    offs = np.cumsum([0] + sizes[:-1])
    return [(f"t{i}", None, int(o), s, d) for i, (o, s, d) in enumerate(zip(offs, sizes, decays))]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_shard_layout_covers_every_element_once(world):
    sizes = [64, 5, 1, 192, 3 * 64, 0, 11]
    slices = _slices(sizes, [True, False, True, True, False, False, True])
    n = sum(sizes)
    layouts = [ShardLayout(slices, world, r) for r in range(world)]
    owned = np.concatenate([lay.index()[:lay.sharded_size] for lay in layouts])
    tails = layouts[0].tail_index
    assert all(np.array_equal(lay.tail_index, tails) for lay in layouts)   # tails are replicated
    assert np.array_equal(np.sort(np.concatenate([owned, tails])), np.arange(n))
    assert len(tails) == sum(s % world for s in sizes)
    for lay in layouts:                 # each piece is the block reduce-scatter gives this rank
        for (_, _, off, s, _), p, pa in zip(slices, lay.piece, lay.piece_at):
            assert np.array_equal(lay.index()[pa:pa + p], np.arange(off + lay.rank * p, off + (lay.rank + 1) * p))
        assert np.array_equal(lay.index()[lay.sharded_size:], tails)
    if world == 1:
        assert np.array_equal(layouts[0].index(), np.arange(n))   # one rank: the flat buffer itself
    full = np.random.default_rng(world).standard_normal(n).astype(np.float32)
    for lay in layouts:                 # take() copies exactly the indexed elements, cast into out's dtype
        assert np.array_equal(lay.take(full), full[lay.index()])
        into = lay.take(full, out=np.zeros(lay.size, np.float64))
        assert into.dtype == np.float64 and np.array_equal(into, full[lay.index()])
        moved = lay.take(full, out=np.zeros(lay.size, np.float32), convert=lambda a: a * 2)   # each range converted
        assert np.array_equal(moved, 2 * full[lay.index()])
    decayed = np.zeros(n, bool)
    for _, _, off, s, d in slices:
        decayed[off:off + s] = d
    for lay in layouts:                 # the decay spans mark exactly the decayed elements
        mask = np.zeros(lay.size, bool)
        for a, b in lay.decay_spans:
            mask[a:b] = True
        assert np.array_equal(mask, decayed[lay.index()])


def _with_ranks(world, fn, timeout=20):
    """Run fn(comm) on `world` SocketComm ranks (threads); their results by rank."""
    port = free_port()
    results, errors = [None] * world, []

    def body(r):
        try:
            comm = SocketComm(r, world, "127.0.0.1", port, timeout)
            results[r] = fn(comm)
            comm.close()
        except Exception as e:       # noqa: BLE001 - reported below
            errors.append((r, e))
    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return results, errors


@pytest.mark.parametrize("world", [1, 2, 3])
def test_socket_comm_collectives(world):
    data = [np.arange(6 * world, dtype=np.float32) * (r + 1) + 0.25 for r in range(world)]

    def fn(comm):
        x = data[comm.rank]
        total = comm.all_reduce(x.copy())
        part = comm.reduce_scatter(x, np.empty(6, np.float32))
        gathered = comm.all_gather(x[:4], np.empty(4 * world, np.float32))
        peak = comm.all_reduce_max(np.array([comm.rank, -comm.rank, 2.5], np.float32))
        return (total, part, gathered, comm.broadcast_object({"id": comm.rank}), comm.all_reduce_host([comm.rank]),
                peak)
    results, errors = _with_ranks(world, fn)
    assert not errors, errors
    expect = sum(d.astype(np.float64) for d in data).astype(np.float32)
    for r, (total, part, gathered, obj, host, peak) in enumerate(results):
        np.testing.assert_array_equal(peak, [world - 1, 0, 2.5])
        np.testing.assert_array_equal(total, expect)
        np.testing.assert_array_equal(part, expect[6 * r:6 * r + 6])
        np.testing.assert_array_equal(gathered, np.concatenate([d[:4] for d in data]))
        assert obj == {"id": 0} and host[0] == sum(range(world))


def test_socket_comm_names_a_peer_that_died():
    def fn(comm):
        if comm.rank == 1:
            comm.close()                 # rank 1 goes away without taking part
            return None
        with pytest.raises(DistributedError, match="rank 0: rank 1 closed its connection"):
            comm.all_reduce(np.zeros(3, np.float32))
        return "ok"
    results, errors = _with_ranks(2, fn)
    assert not errors and results[0] == "ok"


@pytest.mark.parametrize("way", ["recv", "send"])
def test_socket_comm_names_a_peer_that_hangs(way):
    """A rank that stops taking part (SIGSTOP, a hang) is noticed after the timeout on either side of
    the wire: rank 0 waits for its data, or rank 0's send stalls once the peer's socket buffer is full."""
    rank0_done = threading.Event()
    big = np.zeros(64 << 20, np.uint8)   # far more than the kernel's socket buffers hold

    def fn(comm):
        if comm.rank == 1:
            if way == "send":            # sends its part, then hangs before reading the result
                comm._recv_from = lambda conn, peer: rank0_done.wait(30)
                comm.broadcast_object(big)
            rank0_done.wait(30)          # hangs: takes no further part until rank 0 gave up
            return None
        try:
            if way == "recv":
                with pytest.raises(DistributedError, match=r"rank 0: no data from rank 1 for 3 s \(it hangs"):
                    comm.all_reduce(np.zeros(3, np.float32))
            else:
                with pytest.raises(DistributedError, match=r"rank 0: rank 1 took no data for 3 s \(it hangs"):
                    comm.broadcast_object(big)
        finally:
            rank0_done.set()
        return "ok"
    # 3 s, not less: the timeout also bounds connecting and rank 1's whole sendall of `big`,
    # which a loaded CI machine must finish in time
    results, errors = _with_ranks(2, fn, timeout=3)
    assert not errors and results[0] == "ok", errors


def test_socket_comm_size_rules():
    comm = SocketComm(0, 1, "127.0.0.1", 0, 5)
    with pytest.raises(ValueError, match="reduce_scatter: send has 5 elements, expected 1 x 4"):
        comm.reduce_scatter(np.zeros(5, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="all_gather: recv has 3 elements"):
        comm.all_gather(np.zeros(2, np.float32), np.zeros(3, np.float32))


def test_launcher_environments():
    assert detect({}) == ProcessInfo()
    assert not detect({}).distributed
    info = detect({"GPUCORE_RANK": "2", "GPUCORE_WORLD_SIZE": "4", "GPUCORE_LOCAL_RANK": "1",
                   "GPUCORE_MASTER_ADDR": "10.0.0.5", "GPUCORE_MASTER_PORT": "4000"})
    assert (info.rank, info.world_size, info.local_rank, info.launcher, info.master_addr, info.master_port) == \
        (2, 4, 1, "gpucore", "10.0.0.5", 4000)
    slurm = detect({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3", "SLURM_NNODES": "1",
                    "SLURM_JOB_ID": "12345"})
    assert (slurm.rank, slurm.world_size, slurm.local_rank, slurm.launcher, slurm.master_port) == \
        (3, 8, 3, "slurm", 20000 + 12345 % 20000)
    with pytest.raises(DistributedError, match="set GPUCORE_MASTER_ADDR"):
        detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_NNODES": "2"})
    with pytest.raises(DistributedError, match="rank 4 is not in"):
        detect({"GPUCORE_RANK": "4", "GPUCORE_WORLD_SIZE": "4"})
    with pytest.raises(DistributedError, match="GPUCORE_RANK='x': expected an integer"):
        detect({"GPUCORE_RANK": "x", "GPUCORE_WORLD_SIZE": "4"})


def test_data_position_moves_to_another_rank_count(shards):
    three = datamod.DataLoader(shards, 2, 16, split="train", process_rank=0, num_processes=3)
    for _ in range(5):
        three.next_batch()
    state = three.state_dict()          # 5 steps of 3 x 2 x 16 tokens: position 480
    one = datamod.DataLoader(shards, 2, 16, split="train")
    with pytest.raises(datamod.DataError, match="num_processes=3"):
        one.load_state_dict(state)
    note = one.load_state_dict(state, remap_processes=True)
    assert "saved with 3 processes" in note
    assert one.state_dict()["batch"] == 15      # 480 / (2 * 16)
    two = datamod.DataLoader(shards, 2, 16, split="train", process_rank=1, num_processes=2)
    two.load_state_dict(state, remap_processes=True)
    assert two.state_dict()["batch"] == 8       # ceil(480 / 64): the next batch boundary
    x, _ = two.next_batch()
    tokens = datamod.read_shard(sorted(Path(shards).glob("*train*.bin"))[0])
    assert np.array_equal(x.reshape(-1), tokens[8 * 64 + 32:8 * 64 + 64])


@pytest.mark.parametrize("dtype,world", [("bfloat16", 2), ("bfloat16", 3), ("float32", 2)])
def test_zero_optimizer_holds_only_its_shards(dtype, world):
    """ShardedAdamW and its reducer hold the planned shards (master, m, v, the shard's gradients and
    its low-precision copy) and nothing else of the shard's size: an int64 index of the shard, 8
    bytes an element, once cost more than ZeRO-1 saved (d48 on 2 H200s: the pool peak of --zero 1
    equalled the plain run's)."""
    from types import SimpleNamespace
    model = GPT2(GPT2Config.from_preset("tiny"), xp=np, dtype=dtype, seed=3)
    comm = SimpleNamespace(rank=world - 1, world_size=world)
    layout = ShardLayout(parameter_slices(model), world, comm.rank)
    opt = ShardedAdamW(model, GradientReducer(comm, model, layout), comm)
    item = np.dtype(model.dtype).itemsize
    held = {f"{type(o).__name__}.{k}": v.nbytes for o in (opt, opt.reducer, layout)
            for k, v in vars(o).items() if isinstance(v, np.ndarray)}
    planned = layout.size * (3 * 4 + item + (item if dtype == "bfloat16" else 0))   # master m v, grads, lowp
    small = 2 * 8 * len(layout.tail_index)
    assert 0 <= sum(held.values()) - planned <= small, held
    assert layout.size < model.num_parameters // world + len(parameter_slices(model))
    flat = model.params.flat()
    assert np.array_equal(opt.master, flat[layout.index()].astype(np.float32))   # the rank's own weights


def test_zero_memory_plan_is_per_rank():
    plan = {"params": 200, "grads": 200, "master": 400, "m": 400, "v": 400, "activations": 1000}
    assert plan_for(plan, 4, 0) is plan
    z = plan_for(plan, 4, 1)
    assert (z["master"], z["m"], z["v"], z["grad shard"], z["param shard"]) == (100, 100, 100, 50, 50)
    fp32 = plan_for({"params": 400, "grads": 400, "master": 0, "m": 400, "v": 400}, 3, 1)
    assert fp32["master"] == 134 and "param shard" not in fp32


# -------------------------------------------------------------------- GPU ----

DP_GPU = [(0, 0, "bf16"), (1, 0, "bf16"), (0, 1, "bf16"), (1, 1, "bf16"), (0, 0, "fp8"), (1, 1, "fp8")]


@pytest.mark.cuda
@pytest.mark.parametrize("zero,overlap,dtype", DP_GPU, ids=[f"zero{z}-overlap{o}-{d}" for z, o, d in DP_GPU])
def test_nccl_one_rank_matches_the_plain_run(shards, tmp_path, zero, overlap, dtype):
    """--nproc 1 runs every data-parallel stage through NCCL (the all-reduce after a CUDA-graphed
    backward, or bucketed beside an eager one with dp_overlap; ZeRO-1's reduce-scatter / sharded AdamW
    / all-gather; FP8's amax max-reduce) with one rank: the losses are the plain (graphed) run's."""
    from gpucore.ops.fp8 import fp8_supported
    if dtype == "fp8" and not fp8_supported()[0]:
        pytest.skip(fp8_supported()[1])
    argv = ("small", 4, 128, 512 * 2, "--dtype", dtype)
    code, so, se = _job(_train_argv(shards, tmp_path / "plain", 6, "cuda", *argv))
    assert code == 0, so + se
    code, so2, se = _job(_train_argv(shards, tmp_path / "nccl", 6, "cuda", *argv, "--zero", zero), nproc=1,
                         env={"GPUCORE_SETTINGS": f"dp_overlap={overlap}"})
    assert code == 0, so2 + se
    assert "data parallel: 1 ranks (gpucore --nproc; nccl)" in so2
    assert "CUDA graph on" in so and ("CUDA graph off (dp_overlap" if overlap else "CUDA graph on") in so2, so2
    plain, plain_norm = _metrics(tmp_path / "plain")
    nccl, nccl_norm = _metrics(tmp_path / "nccl")
    assert np.array_equal(plain, nccl), (plain, nccl)
    assert np.array_equal(plain_norm, nccl_norm), (plain_norm, nccl_norm)
    # the checkpoints too: under ZeRO the optimizer state is gathered slice by slice (zero.py _full_host)
    from gpucore.checkpoint import load_checkpoint
    (a, _), (b, _) = (load_checkpoint(sorted((tmp_path / run).glob("ckpt_*.ckpt"))[-1]) for run in ("plain", "nccl"))
    assert {"params", "m", "v"} <= set(a) and set(a) == set(b), (sorted(a), sorted(b))
    for name in a:
        assert np.array_equal(a[name].view(np.uint8), b[name].view(np.uint8)), name


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_nccl_zero_run_resumes_bitwise(shards, tmp_path, dtype):
    """A ZeRO-1 run on one NCCL rank, resumed from its step-3 checkpoint: the device shards of m, v
    (and bf16's fp32 master weights) are taken range by range from the host arrays
    (ShardedAdamW.load_state), and steps 4-6 repeat bit for bit."""
    from gpucore.ops.fp8 import fp8_supported
    if dtype == "fp8" and not fp8_supported()[0]:
        pytest.skip(fp8_supported()[1])
    argv = lambda out, *extra: _train_argv(shards, out, 6, "cuda", "small", 4, 128, 512 * 2, "--dtype", dtype,
                                           "--zero", 1, *extra)
    code, so, se = _job(argv(tmp_path / "full", "--ckpt-every", 3, "--keep-last", 0), nproc=1)
    assert code == 0, so + se
    (tmp_path / "resumed").mkdir()
    shutil.copy(tmp_path / "full" / "metrics.jsonl", tmp_path / "resumed" / "metrics.jsonl")
    code, so, se = _job(argv(tmp_path / "resumed", "--resume", tmp_path / "full" / "ckpt_000003.ckpt"), nproc=1)
    assert code == 0, so + se
    assert "ZeRO-1" in so
    (full, full_norm), (resumed, resumed_norm) = _metrics(tmp_path / "full"), _metrics(tmp_path / "resumed")
    assert len(full) == 6 and np.array_equal(full, resumed[-6:]), (full, resumed)
    assert np.array_equal(full_norm, resumed_norm[-6:])


def test_ctrl_c_stops_every_rank_after_the_same_step_and_saves_once(shards, tmp_path):
    """Ctrl-C reaches every process of the terminal's group: the ranks agree to stop after one step,
    gather the ZeRO shards, rank 0 saves and prints the resume command, the job exits 130."""
    argv = _train_argv(shards, tmp_path, 100000, "cpu", "tiny", 1, 32, 64, "--zero", 1)
    proc = subprocess.Popen([sys.executable, *argv, "--nproc", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=REPO, start_new_session=True)
    try:
        _wait_for_steps(tmp_path, proc, time.monotonic() + 120)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out + err
    (ckpt,) = tmp_path.glob("ckpt_*.ckpt")
    step = int(ckpt.stem.split("_")[1])
    assert f"interrupted after step {step} of 100000: saved checkpoint" in err
    assert err.count("resume with: ") == 1 and "--nproc 2 --zero 1" in err
    loss, _ = _metrics(tmp_path)
    assert len(loss) == step
