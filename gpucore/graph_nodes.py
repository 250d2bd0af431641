"""The captured step graph's nodes: cuBLASLt's workspace memsets moved off the step's critical path.

Why: the graphed step's kernel timeline (tools/notes/profile.md, twenty-second session) left the GPU
idle 0.6-0.8 ms a d12 step, ~0.5 ms of it in 111-121 gaps of 3-10 us. Each gap holds a 4-byte
memset that cuBLASLt issues before its GEMM (its nvjet kernels keep a counter at the start of the
workspace we give it). Stream capture records the launches as one chain,

    ... -> G1 (GEMM) -> k1 -> k2 (ours) -> memset -> G2 (GEMM) -> ...

so the memset waits for k2 to finish and G2 for the memset: ~1.5 us to launch the memset, 0.8 us
of memset, 2-3 us to launch G2, where one kernel after another takes < 1 us. The memset only needs
what came before it in cuBLASLt's own use of the workspace: the GEMMs before it. So after the
capture, each such memset is made to depend on the nearest node before our kernels (G1 above)
instead of k2, and G2 gets k2 as a dependency of its own:

    G1 -> k1 -> k2 -> G2          (G1 -> memset -> G2 beside it)

The memset then runs beside k1 and k2, and G2 starts right after k2. Every kernel keeps its
arguments and every byte of memory the same order of writers: the step's results are bit for bit
the same (GPU-tested).

Which memsets move (plan_memset_moves, pure Python, tested on the CPU): a memset node whose bytes
lie inside a cuBLAS(Lt) workspace (cublas.workspace_ranges()), with exactly one dependency, a
kernel node of ours (a function our runtime loaded: runtime.kernel_handles()) over a default edge;
it moves back over our kernels while each has exactly one dependency over a default edge, and no
further than the first node that is not one of our kernels (a cuBLAS kernel, a CuPy kernel,
another memset). Our kernels never touch cuBLAS's workspace, so nothing they do can race the
moved memset, and it still runs after every cuBLAS kernel before it.

The graph is edited through the driver API (libcuda's cuGraph*_v2 entry points, CUDA 12.3+, through
ctypes as gpucore/cublas.py calls cuBLASLt), then instantiated and launched as an exec of our own
(CuPy's Graph keeps its handle to the graph but had instantiated it before the edit). Where the
entry points are missing (an older driver) nothing moves and the step graph runs as captured.
settings.graph_move_memsets (default on) switches it; measured: tools/notes/step_graph.md.

Private workspaces (thirty-first session). A memset that follows another GEMM cannot move: that
GEMM used the same workspace. But most GEMMs' algorithms need only the 4-byte counter (d12 and d48:
16 of 18 plans; tools/probes/lt_workspace.py). So during the capture each such GEMM gets a 256-byte
workspace of its own (cublas.PrivateWorkspaces): its memset then zeroes bytes that no other node
of the graph touches. hoist_private_memsets cuts those memsets out of the chain (each predecessor
takes over the memset's dependents) and puts them, and then one memset of the whole slot arena,
before the graph's roots: every counter is zero when the replay starts, and a GEMM follows the
one before it with nothing in between. The GEMMs on private workspaces (recorded at capture:
capture_tail) touch no shared workspace, so the memsets that remain (the split-K GEMMs' big
workspaces) can move back over them as over our kernels. settings.graph_private_workspaces
switches the hoist.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

KERNEL, MEMSET = "kernel", "memset"
DEFAULT_EDGE = 0                          # CU_GRAPH_DEPENDENCY_TYPE_DEFAULT (1: programmatic)


@dataclass(frozen=True)
class Node:
    """What the planner needs of a graph node: its kind ("kernel", "memset", "other"), whether it is
    a kernel of ours, and for a memset whether its bytes lie in a cuBLAS workspace. private: a
    cuBLAS kernel that ran on a private workspace (it touches no shared one), or a memset of a
    private workspace (no other node touches its bytes)."""
    kind: str
    ours: bool = False
    in_workspace: bool = False
    private: bool = False


@dataclass(frozen=True)
class Move:
    """One memset moved: drop edge (before -> memset), add (anchor -> memset) unless anchor is None
    (the memset becomes a root), add (before -> each of after)."""
    memset: object
    before: object            # the kernel of ours it depended on
    anchor: object            # the first node before our kernels, or None
    after: tuple              # the memset's dependents (the GEMM)


def plan_memset_moves(nodes: dict, edges: list) -> list[Move]:
    """The memsets to move and where: `nodes` {id: Node}, `edges` [(from, to, edge type)]."""
    preds, succs = {n: [] for n in nodes}, {n: [] for n in nodes}
    for a, b, kind in edges:
        preds[b].append((a, kind))
        succs[a].append(b)
    linked = {(a, b) for a, b, _ in edges}

    def ours(n):              # a kernel that cannot touch a shared cuBLAS workspace
        return nodes[n].kind == KERNEL and (nodes[n].ours or nodes[n].private)

    moves = []
    for m, node in nodes.items():
        if node.kind != MEMSET or not node.in_workspace or len(preds[m]) != 1:
            continue
        before, kind = preds[m][0]
        if kind != DEFAULT_EDGE or not ours(before):
            continue
        cur = before                              # back over our kernels, one default edge at a time
        while len(preds[cur]) == 1 and preds[cur][0][1] == DEFAULT_EDGE and ours(preds[cur][0][0]):
            cur = preds[cur][0][0]
        p = preds[cur]
        if not p:                                 # our kernels back to the graph's start
            anchor = None
        elif len(p) == 1 and p[0][1] == DEFAULT_EDGE:
            anchor = p[0][0]                      # the first node that is not one of our kernels
        elif cur != before:
            anchor = cur                          # a join or a programmatic edge: wait for the kernel there
        else:
            continue                              # nothing to move over
        moves.append(Move(m, before, anchor, tuple(s for s in succs[m] if (before, s) not in linked)))
    return moves


@dataclass(frozen=True)
class Hoist:
    """The private memsets removed, the edges that replace them, and the roots that the one memset
    of the whole arena goes before (the graph's roots once the memsets are gone)."""
    removed: tuple
    added: tuple              # (from, to) default edges
    roots: tuple


def plan_private_hoist(nodes: dict, edges: list) -> Hoist:
    """Which memsets to remove (module docstring: private workspaces) and the edges that keep every
    other order: each predecessor of a removed memset gets its dependents (unless already linked)."""
    removed = {m for m, node in nodes.items() if node.kind == MEMSET and node.private}
    preds, succs = {n: [] for n in nodes}, {n: [] for n in nodes}
    for a, b, kind in edges:
        preds[b].append((a, kind))
        succs[a].append(b)
    linked = {(a, b) for a, b, _ in edges}
    added = []

    def sources(m):           # the nearest nodes before m that stay (memsets can sit in a row)
        out = []
        for p, _ in preds[m]:
            out += sources(p) if p in removed else [p]
        return out

    for m in sorted(removed, key=str):
        for s in succs[m]:
            if s in removed:
                continue
            for p in sources(m):
                if (p, s) not in linked:
                    linked.add((p, s))
                    added.append((p, s))
    kept_preds = {n: [p for p, _ in preds[n] if p not in removed] for n in nodes if n not in removed}
    for a, b in added:
        kept_preds[b].append(a)
    roots = tuple(n for n, ps in kept_preds.items() if not ps)
    return Hoist(tuple(sorted(removed, key=str)), tuple(added), roots)


# ------------------------------------------------------------------ the driver API (ctypes)

class _EdgeData(ctypes.Structure):                # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelParams(ctypes.Structure):            # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = ([("func", ctypes.c_void_p)] +
                [(f, ctypes.c_uint) for f in ("gx", "gy", "gz", "bx", "by", "bz", "shared")] +
                [("params", ctypes.c_void_p), ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p),
                 ("ctx", ctypes.c_void_p)])


class _MemsetParams(ctypes.Structure):            # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("element_size", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


_CU_KERNEL, _CU_MEMSET = 0, 2                     # CUgraphNodeType
_NEEDED = ("cuGraphGetNodes", "cuGraphNodeGetType", "cuGraphGetEdges_v2", "cuGraphKernelNodeGetParams_v2",
           "cuGraphMemsetNodeGetParams", "cuGraphAddDependencies_v2", "cuGraphRemoveDependencies_v2",
           "cuGraphAddMemsetNode", "cuCtxGetCurrent", "cuStreamGetCaptureInfo_v3")
_DRIVER = []


def driver():
    """libcuda with the graph entry points we call, or None (no such library or an older driver)."""
    if not _DRIVER:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            ok = all(hasattr(lib, name) for name in _NEEDED)
        except OSError:
            lib, ok = None, False
        _DRIVER.append(lib if ok else None)
    return _DRIVER[0]


def _check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUresult {rc}")


def capture_tail(stream: int) -> tuple:
    """The nodes a capturing stream's next node will depend on: right after a library call, the
    last node(s) that call added. () when the stream is not capturing or the driver lacks it."""
    cu = driver()
    if cu is None:
        return ()
    status, n = ctypes.c_int(), ctypes.c_size_t(0)
    deps, data = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_void_p()
    rc = cu.cuStreamGetCaptureInfo_v3(ctypes.c_void_p(stream), ctypes.byref(status), None, None,
                                      ctypes.byref(deps), ctypes.byref(data), ctypes.byref(n))
    if rc != 0 or status.value != 1:              # CU_STREAM_CAPTURE_STATUS_ACTIVE
        return ()
    return tuple(deps[i] for i in range(n.value))


def read_graph(graph: int, our_handles: set, workspaces: list, private_kernels=frozenset(),
               private_ranges=()) -> tuple[dict, list]:
    """(nodes, edges) of a cudaGraph_t for the planners. our_handles: CUfunction handles of our
    kernels; workspaces: (pointer, bytes) ranges of cuBLAS's shared workspaces; private_kernels:
    node handles of cuBLAS kernels on private workspaces; private_ranges: the private arena."""
    cu = driver()
    g = ctypes.c_void_p(graph)
    n = ctypes.c_size_t(0)
    _check(cu.cuGraphGetNodes(g, None, ctypes.byref(n)), "cuGraphGetNodes")
    handles = (ctypes.c_void_p * n.value)()
    _check(cu.cuGraphGetNodes(g, handles, ctypes.byref(n)), "cuGraphGetNodes")
    nodes = {}
    for h in handles:
        t = ctypes.c_int()
        _check(cu.cuGraphNodeGetType(ctypes.c_void_p(h), ctypes.byref(t)), "cuGraphNodeGetType")
        if t.value == _CU_KERNEL:
            kp = _KernelParams()
            rc = cu.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(h), ctypes.byref(kp))
            nodes[h] = Node(KERNEL, ours=rc == 0 and bool(kp.func) and int(kp.func) in our_handles,
                            private=h in private_kernels)
        elif t.value == _CU_MEMSET:
            mp = _MemsetParams()
            _check(cu.cuGraphMemsetNodeGetParams(ctypes.c_void_p(h), ctypes.byref(mp)), "cuGraphMemsetNodeGetParams")
            rows = max(1, mp.height)                    # a 2D memset: rows of `width` elements, `pitch` apart
            end = mp.dst + mp.pitch * (rows - 1) + mp.element_size * mp.width
            nodes[h] = Node(MEMSET, in_workspace=any(p <= mp.dst and end <= p + size for p, size in workspaces),
                            private=mp.value == 0 and any(p <= mp.dst and end <= p + size
                                                          for p, size in private_ranges))
        else:
            nodes[h] = Node("other")
    ne = ctypes.c_size_t(0)
    _check(cu.cuGraphGetEdges_v2(g, None, None, None, ctypes.byref(ne)), "cuGraphGetEdges_v2")
    frm, to = (ctypes.c_void_p * ne.value)(), (ctypes.c_void_p * ne.value)()
    data = (_EdgeData * ne.value)()
    _check(cu.cuGraphGetEdges_v2(g, frm, to, data, ctypes.byref(ne)), "cuGraphGetEdges_v2")
    edges = [(frm[i], to[i], data[i].type) for i in range(ne.value)]
    return nodes, edges


def apply_moves(graph: int, moves: list[Move]) -> None:
    """Edit the graph's edges as each Move says (default edges)."""
    cu = driver()
    g = ctypes.c_void_p(graph)

    def edge(fn, a, b, what):
        _check(fn(g, ctypes.byref(ctypes.c_void_p(a)), ctypes.byref(ctypes.c_void_p(b)), None, ctypes.c_size_t(1)), what)

    for mv in moves:
        edge(cu.cuGraphRemoveDependencies_v2, mv.before, mv.memset, "cuGraphRemoveDependencies_v2")
        if mv.anchor is not None:
            edge(cu.cuGraphAddDependencies_v2, mv.anchor, mv.memset, "cuGraphAddDependencies_v2")
        for s in mv.after:
            edge(cu.cuGraphAddDependencies_v2, mv.before, s, "cuGraphAddDependencies_v2")


def move_memsets(graph: int, our_handles: set, workspaces: list, private_kernels=frozenset()) -> int:
    """Move the memsets of a captured graph (module docstring); returns how many moved."""
    if driver() is None:
        return 0
    moves = plan_memset_moves(*read_graph(graph, our_handles, workspaces, private_kernels))
    apply_moves(graph, moves)
    return len(moves)


def hoist_private_memsets(graph: int, arena: list) -> int:
    """Take the memsets of the private workspaces `arena` [(pointer, bytes)] off a captured graph's
    chain (module docstring); returns how many.

    Graphs with programmatic edges (cuBLASLt's split-K GEMMs) refuse cuGraphDestroyNode and
    cuGraphClone (CUDA_ERROR_NOT_SUPPORTED), so the memsets stay in the graph, cut loose: each
    loses its edges (its predecessors take over its dependents) and goes before one memset of the
    whole arena, which goes before the graph's roots. They run first, side by side, then the arena
    is zeroed once, then the step."""
    cu = driver()
    if cu is None or not arena:
        return 0
    nodes, edges = read_graph(graph, set(), [], private_ranges=arena)
    plan = plan_private_hoist(nodes, edges)
    if not plan.removed:
        return 0
    g = ctypes.c_void_p(graph)

    def edge(fn, a, b, what):
        _check(fn(g, ctypes.byref(ctypes.c_void_p(a)), ctypes.byref(ctypes.c_void_p(b)), None, ctypes.c_size_t(1)), what)

    for a, b in plan.added:
        edge(cu.cuGraphAddDependencies_v2, a, b, "cuGraphAddDependencies_v2")
    removed = set(plan.removed)
    for a, b, _ in edges:
        if a in removed or b in removed:
            edge(cu.cuGraphRemoveDependencies_v2, a, b, "cuGraphRemoveDependencies_v2")
    ctx = ctypes.c_void_p()
    _check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    for ptr, size in arena:                       # one memset per arena chunk: after the cut memsets,
        params = _MemsetParams(dst=ptr, pitch=size, value=0, element_size=4, width=size // 4, height=1)
        node = ctypes.c_void_p()                  # before every root
        _check(cu.cuGraphAddMemsetNode(ctypes.byref(node), g, None, ctypes.c_size_t(0), ctypes.byref(params), ctx),
               "cuGraphAddMemsetNode")
        for m in plan.removed:
            edge(cu.cuGraphAddDependencies_v2, m, node.value, "cuGraphAddDependencies_v2")
        for r in plan.roots:
            edge(cu.cuGraphAddDependencies_v2, node.value, r, "cuGraphAddDependencies_v2")
    return len(plan.removed)
