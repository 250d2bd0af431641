"""gpucore.graph_nodes: cuBLASLt's workspace memsets moved back beside our kernels in the step graph.

CPU tests check the planner on graphs made up here: which memsets move, how far, and that every
order between two nodes other than the moved memsets survives the edit, while each moved memset
still comes after every node that is not one of our kernels before it and before its GEMM. GPU
tests (pytest -m cuda) edit real captured steps and compare their training with the eager run's
bits (tests/test_step_graph.py runs its graphed-vs-eager tests with the move on, the default).
"""
import random

import numpy as np
import pytest

from gpucore import graph_nodes, runtime, settings
from gpucore.graph_nodes import DEFAULT_EDGE, KERNEL, MEMSET, Node, plan_memset_moves, plan_private_hoist

PROG = 1                                      # a programmatic edge

OURS, CUBLAS, WS_MEMSET, OTHER_MEMSET = (Node(KERNEL, ours=True), Node(KERNEL), Node(MEMSET, in_workspace=True),
                                         Node(MEMSET))
PRIVATE_GEMM, PRIVATE_MEMSET = Node(KERNEL, private=True), Node(MEMSET, private=True)


def _chain(*kinds, types=None):
    """A captured stream: nodes 0..n-1 in order, each depending on the one before."""
    nodes = dict(enumerate(kinds))
    types = types or {}
    edges = [(i - 1, i, types.get(i, DEFAULT_EDGE)) for i in range(1, len(kinds))]
    return nodes, edges


def _apply(edges, moves):
    """The edge set after the moves, as graph_nodes.apply_moves edits the real graph."""
    out = {(a, b) for a, b, _ in edges}
    for mv in moves:
        out.discard((mv.before, mv.memset))
        if mv.anchor is not None:
            out.add((mv.anchor, mv.memset))
        out.update((mv.before, s) for s in mv.after)
    return out


def _reach(nodes, edge_set):
    """{node: every node that must finish before it starts}."""
    preds = {n: {a for a, b in edge_set if b == n} for n in nodes}
    memo = {}

    def up(n):
        if n not in memo:
            memo[n] = set()
            for p in preds[n]:
                memo[n] |= {p} | up(p)
        return memo[n]
    return {n: up(n) for n in nodes}


def test_a_memset_after_our_kernels_moves_back_to_the_gemm_before_them():
    # G1 -> k1 -> k2 -> memset -> G2
    nodes, edges = _chain(CUBLAS, OURS, OURS, WS_MEMSET, CUBLAS)
    (mv,) = plan_memset_moves(nodes, edges)
    assert (mv.memset, mv.before, mv.anchor, mv.after) == (3, 2, 0, (4,))
    assert _apply(edges, [mv]) == {(0, 1), (1, 2), (0, 3), (2, 4), (3, 4)}


def test_memsets_that_stay():
    # after a cuBLAS kernel (nothing of ours to run beside), outside cuBLAS's workspace, after a
    # CuPy kernel (not ours), reached over a programmatic edge
    for nodes, edges in (_chain(OURS, CUBLAS, WS_MEMSET, CUBLAS),
                         _chain(CUBLAS, OURS, OTHER_MEMSET, CUBLAS),
                         _chain(CUBLAS, Node(KERNEL, ours=False), WS_MEMSET, CUBLAS),
                         _chain(CUBLAS, OURS, WS_MEMSET, CUBLAS, types={2: PROG}),
                         _chain(CUBLAS, OURS, WS_MEMSET, CUBLAS, types={1: PROG})):
        assert plan_memset_moves(nodes, edges) == []


def test_a_memset_behind_nothing_but_our_kernels_becomes_a_root():
    nodes, edges = _chain(OURS, OURS, WS_MEMSET, CUBLAS)
    (mv,) = plan_memset_moves(nodes, edges)
    assert (mv.before, mv.anchor) == (1, None)
    assert _apply(edges, [mv]) == {(0, 1), (1, 3), (2, 3)}


def test_the_walk_stops_at_a_fork_or_a_programmatic_edge():
    # k1 waits for two nodes (a side stream joins): the memset waits for k1 itself
    nodes = {0: CUBLAS, 1: CUBLAS, 2: OURS, 3: OURS, 4: WS_MEMSET, 5: CUBLAS}
    edges = [(0, 2, 0), (1, 2, 0), (2, 3, 0), (3, 4, 0), (4, 5, 0)]
    (mv,) = plan_memset_moves(nodes, edges)
    assert (mv.before, mv.anchor) == (3, 2)
    # k1 started early behind a programmatic edge: the same
    nodes, edges = _chain(CUBLAS, OURS, OURS, WS_MEMSET, CUBLAS, types={1: PROG})
    (mv,) = plan_memset_moves(nodes, edges)
    assert (mv.before, mv.anchor) == (2, 1)


def test_a_gemm_that_already_waits_for_our_kernel_gets_no_second_edge():
    nodes = {0: CUBLAS, 1: OURS, 2: WS_MEMSET, 3: CUBLAS}
    edges = [(0, 1, 0), (1, 2, 0), (2, 3, 0), (1, 3, 0)]
    (mv,) = plan_memset_moves(nodes, edges)
    assert mv.after == ()


def test_random_chains_keep_every_order_but_the_moved_memsets():
    """Captured-stream chains of random kinds: after the moves, every node other than a moved memset
    waits for exactly what it waited for before; a moved memset still waits for every node before it
    that is not one of our kernels, and its GEMM still waits for it."""
    rng = random.Random(0)
    kinds = [OURS, OURS, OURS, CUBLAS, WS_MEMSET, OTHER_MEMSET, Node(KERNEL)]
    for trial in range(300):
        seq = [rng.choice(kinds) for _ in range(rng.randint(2, 14))]
        types = {i: PROG for i in range(1, len(seq)) if rng.random() < 0.1}
        nodes, edges = _chain(*seq, types=types)
        moves = plan_memset_moves(nodes, edges)
        moved = {mv.memset for mv in moves}
        before, after = _reach(nodes, {(a, b) for a, b, _ in edges}), _reach(nodes, _apply(edges, moves))
        for n in nodes:
            if n in moved:
                keep = {p for p in before[n] if not (nodes[p].kind == KERNEL and nodes[p].ours)}
                assert keep <= after[n], (trial, n)
                assert after[n] < before[n]                      # it moved: it waits for less
            else:
                assert after[n] - moved == before[n] - moved, (trial, n)
        for mv in moves:
            assert all(mv.memset in after[s] for s in range(mv.memset + 1, len(seq)))


def test_a_memset_moves_back_over_gemms_on_private_workspaces_but_not_over_a_shared_one():
    # G1 (shared) -> P1 -> k -> P2 -> memset -> G2: P1 and P2 ran on workspaces of their own
    nodes, edges = _chain(CUBLAS, PRIVATE_GEMM, OURS, PRIVATE_GEMM, WS_MEMSET, CUBLAS)
    (mv,) = plan_memset_moves(nodes, edges)
    assert (mv.memset, mv.before, mv.anchor, mv.after) == (4, 3, 0, (5,))
    nodes, edges = _chain(PRIVATE_GEMM, CUBLAS, WS_MEMSET, CUBLAS)          # a shared GEMM right before: stays
    assert plan_memset_moves(nodes, edges) == []


def test_private_memsets_leave_and_their_gemms_follow_what_came_before():
    # G0 -> m1 -> G1 -> k -> m2 -> G2, m1 and m2 zeroing private workspaces
    nodes, edges = _chain(CUBLAS, PRIVATE_MEMSET, PRIVATE_GEMM, OURS, PRIVATE_MEMSET, PRIVATE_GEMM)
    plan = plan_private_hoist(nodes, edges)
    assert plan.removed == (1, 4) and set(plan.added) == {(0, 2), (3, 5)} and plan.roots == (0,)
    # a private memset first in the graph: its GEMM becomes the root; two in a row are bridged together
    nodes, edges = _chain(PRIVATE_MEMSET, PRIVATE_GEMM, PRIVATE_MEMSET, PRIVATE_MEMSET, OURS)
    plan = plan_private_hoist(nodes, edges)
    assert plan.removed == (0, 2, 3) and plan.added == ((1, 4),) and plan.roots == (1,)
    # nothing private: nothing to do
    nodes, edges = _chain(CUBLAS, WS_MEMSET, CUBLAS)
    assert plan_private_hoist(nodes, edges).removed == ()


def test_random_graphs_keep_every_order_once_the_private_memsets_are_hoisted():
    """Random chains with a side branch: after the hoist (the removed memsets' edges bridged, one zeroing
    node before the new roots), every remaining node waits for exactly the remaining nodes it waited
    for before, and every node that waited for a private memset waits for the zeroing node."""
    rng = random.Random(1)
    kinds = [OURS, CUBLAS, PRIVATE_GEMM, PRIVATE_MEMSET, PRIVATE_MEMSET, WS_MEMSET]
    for trial in range(300):
        n = rng.randint(2, 14)
        nodes, edges = _chain(*(rng.choice(kinds) for _ in range(n)))
        if n > 3 and rng.random() < 0.5:                 # a fork and a join beside the chain
            a = rng.randrange(n - 2)
            nodes[n] = rng.choice(kinds)
            edges += [(a, n, DEFAULT_EDGE), (n, rng.randrange(a + 1, n), DEFAULT_EDGE)]
        plan = plan_private_hoist(nodes, edges)
        removed = set(plan.removed)
        assert removed == {k for k, v in nodes.items() if v == PRIVATE_MEMSET}
        zero = "zero"
        after_edges = {(a, b) for a, b, _ in edges if a not in removed and b not in removed}
        after_edges |= set(plan.added) | {(zero, r) for r in plan.roots}
        before = _reach(nodes, {(a, b) for a, b, _ in edges})
        after = _reach({**{k: v for k, v in nodes.items() if k not in removed}, zero: None}, after_edges)
        for k in nodes:
            if k in removed:
                continue
            assert after[k] - {zero} == before[k] - removed, (trial, k)
            if before[k] & removed:
                assert zero in after[k], (trial, k)


def test_nothing_moves_without_the_driver_entry_points(monkeypatch):
    monkeypatch.setattr(graph_nodes, "driver", lambda: None)
    assert graph_nodes.move_memsets(0, set(), []) == 0


# ------------------------------------------------------------------ GPU ----

@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [None, "adaptive"])
def test_gpu_the_moved_graph_trains_bitwise_as_the_captured_one(fp8):
    """GPT-2-sized layers (C = 768, so cuBLASLt takes the kernels that keep a workspace counter):
    the step graph with its memsets moved, without, and eager give the same bits."""
    from gpucore.model import GPT2, GPT2Config
    from gpucore.optim import AdamW
    from gpucore.step_graph import StepGraph
    from gpucore.train import train_step
    if fp8:
        from gpucore.ops.fp8 import fp8_supported
        ok, why = fp8_supported()
        if not ok:
            pytest.fail(why)
    cp = runtime.cupy
    cfg = GPT2Config(num_layers=2, num_heads=12, channels=768, max_seq_len=256)
    r = np.random.default_rng(3)
    batches = [(cp.asarray(r.integers(0, cfg.vocab_size, (8, 256), dtype=np.int32)),
                cp.asarray(r.integers(0, cfg.vocab_size, (8, 256), dtype=np.int32))) for _ in range(4)]

    def train(graphed, move, private=True):
        with settings.using(graph_move_memsets=move, graph_private_workspaces=private):
            m = GPT2(cfg, xp=cp, dtype="bfloat16", seed=5, fp8=fp8)
            opt = AdamW(m, weight_decay=0.1, max_grad_norm=1.0)
            feed = iter(batches)
            g = StepGraph(m, strict=True) if graphed else None
            losses = [float(train_step(m, opt, lambda: next(feed), 1, 1e-3, graph=g)[0]) for _ in batches]
            return losses, m.params.flat().get().tobytes(), g

    eager = train(False, True)
    moved = train(True, True)
    shared = train(True, True, private=False)
    hoisted = train(True, False)
    kept = train(True, False, private=False)
    for run in (moved, shared, hoisted, kept):
        assert run[:2] == eager[:2]
    assert kept[2].moved_memsets == kept[2].hoisted_memsets == shared[2].hoisted_memsets == 0
    assert hoisted[2].moved_memsets == 0 and hoisted[2].hoisted_memsets == moved[2].hoisted_memsets
    if runtime.device_arch().startswith("90"):      # Hopper: cuBLASLt's nvjet kernels and their memsets
        assert shared[2].moved_memsets >= 1, shared[2].moved_memsets
        # most of cuBLASLt's algorithms here need only the 4-byte counter: their memsets are hoisted
        assert moved[2].hoisted_memsets >= 4, moved[2].hoisted_memsets
