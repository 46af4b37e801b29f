"""The peak memory of a deep stack of identical blocks, from the timelines of two shallower traces.

The additive figures of a step (FLOPs, time, parameter bytes) are linear in the block count and
extrapolate as numbers (estimate.GraphCosts.extrapolate). The peak is not: it is a maximum over
the points of the step, and where it lies can move as blocks are added (a 1-block Llama peaks in
its loss, a 32-block one at the end of forward). Extrapolating the peak's breakdown linearly then
mixes two different points (a 7B Llama, ZeRO-3 on 64 devices: 3.10 GB planned, 6.94 GB traced
whole; a category could come out negative). Here every point of the timeline is extrapolated and
the peak taken over them.

A trace with n+1 blocks is the n-block trace with one block's forward nodes inserted and one
block's backward nodes inserted (its parameters join the placeholders, which are alive throughout
and so add to every point). Before the forward insertion, points count blocks from the first; past
the backward one, from the last. Point j of the (n+1)-block trace then has a counterpart i in the
n-block trace: the same node before the forward insertion, the node one block away after it, and
its live bytes grow by the same amount with every block added:

    live_L(j) = live_{n+1}(j) + (L - n - 1) * (live_{n+1}(j) - live_n(i))

The inner blocks of a deep stack lie between the first's and the last's, affine in the block
index, so the maximum over these points is the L-block peak.
"""

from __future__ import annotations

from fxspeed.ir import FORWARD, GRADIENTS
from fxspeed.planner.memory import Timeline, backward_front, phase_of


ALL = "all"  # extrapolate_peaks' key of the overall peak
FRONT = "backward front"  # and of backward's candidate peaks (memory.backward_front)


def extrapolate_peak(shallow: Timeline, deeper: Timeline, deeper_blocks: int,
                     layers: float) -> dict[str, float] | None:
    """The overall peak of `extrapolate_peaks`."""
    peaks = extrapolate_peaks(shallow, deeper, deeper_blocks, layers)
    return None if peaks is None else peaks[ALL]


def extrapolate_peaks(shallow: Timeline, deeper: Timeline, deeper_blocks: int,
                      layers: float) -> dict[str, dict[str, float]] | None:
    """The peak's live bytes by category with `layers` blocks, from the timelines of the same step
    traced with n (`shallow`) and n + 1 = `deeper_blocks` (`deeper`) blocks; the peak is chosen as memory_timeline
    chooses it (gradients weighted by the deeper trace's grad_scale).

    >>> extrapolate_peaks(timeline(model with 2 blocks), timeline(model with 3 blocks), 3, 32)
    {'all': {'parameters': ..., 'activations': ..., 'gradients': ..., ...}, 'forward': {...}, 'backward': {...}}

    ('all' is the peak; 'forward' and 'backward' the peaks within each phase, as Timeline.phase_peaks;
    FRONT, a list, backward's candidates as Timeline.backward_front gives them.)

    None when `deeper` is not `shallow` with one block's forward and backward nodes inserted (blocks
    whose nodes interleave, passes that rewrite per step): the caller falls back to a linear
    extrapolation of the peak's breakdown."""
    a, b = _body(shallow), _body(deeper)
    A, B = [shallow.keys[i] for i in a], [deeper.keys[i] for i in b]
    # Forward and backward by the last forward node (a cast or a recomputed value in forward's
    # stretch may be counted backward's): a block's forward nodes are those it adds before it
    turn_a, turn_b = _turn(shallow, a), _turn(deeper, b)
    m_f = turn_b - turn_a
    m_b = len(B) - len(A) - m_f
    if m_f <= 0 or m_b < 0:
        return None
    split = _insertions(A, B, m_f, m_b, turn_a)
    if split is None:
        return None
    p, r = split
    q = r + m_f  # where the block's backward nodes were inserted in the deeper trace
    k = layers - deeper_blocks
    best: dict[str, float] = {}
    peaks: dict[str, dict[str, float]] = {}
    points = []
    for j in range(len(B)):
        i = j if j < p else j - m_f if j < q + m_b else j - m_f - m_b
        here, there = deeper.live[b[j]], shallow.live[a[i]]
        live = {c: here.get(c, 0) + k * (here.get(c, 0) - there.get(c, 0)) for c in {*here, *there}}
        weighted = sum(live.values()) - (1.0 - deeper.grad_scale) * live.get(GRADIENTS, 0)
        phase = phase_of(deeper.roles[b[j]])
        if deeper.produced and shallow.produced:
            made = deeper.produced[b[j]] + k * (deeper.produced[b[j]] - shallow.produced[a[i]])
            points.append((phase, made, live, weighted))
        for key in (ALL, phase):
            if weighted > best.get(key, float("-inf")):
                best[key], peaks[key] = weighted, live
    if ALL not in peaks:
        return None
    if points:
        peaks[FRONT] = backward_front(points)  # type: ignore[assignment]
    return peaks


def _insertions(A: list[str], B: list[str], m_f: int, m_b: int, turn: int) -> tuple[int, int] | None:
    """(p, r): B == A[:p] + X + A[p:r] + Y + A[r:] with X (m_f nodes) inserted in forward's stretch
    (p <= `turn`, A's last forward node + 1) and Y (m_b nodes) in backward's (r >= turn), each
    node the same op as the one a block away (X's as the one before it, Y's as the one after it).
    The first and last blocks differ from the inner ones (a residual gradient's add), so p and r
    are searched near the longest common prefix and suffix; a stack of identical blocks is
    periodic there, and the common prefix may run a few nodes into the inserted block (the
    final norm reads like a block's first norm)."""
    pf, ps = _common(A, B), _common(A[::-1], B[::-1])
    n = len(A)
    for p in range(min(pf, turn), max(m_f, pf - m_f) - 1, -1):
        if any(B[j] != A[j - m_f] for j in range(p, p + m_f)):
            continue
        r_max = p + _common(A[p:], B[p + m_f:])  # A[p:r] == B[p+m_f:r+m_f] for every r up to here
        for r in range(min(r_max, n - m_b), max(p, turn, n - ps) - 1, -1):
            q = r + m_f
            if all(B[j] == A[j - m_f] for j in range(q, q + m_b)):
                return p, r
    return None


def _turn(tl: Timeline, body: list[int]) -> int:
    """1 + the position in `body` of the last forward node."""
    return max((k + 1 for k, i in enumerate(body) if tl.roles[i] == FORWARD), default=0)


def _body(tl: Timeline) -> list[int]:
    """Indices of the nodes past the placeholders: those are alive throughout (in every point's
    bytes) and a deeper trace has more of them."""
    return [i for i, key in enumerate(tl.keys) if key != "placeholder"]


def _common(x: list[str], y: list[str]) -> int:
    n = 0
    for u, v in zip(x, y):
        if u != v:
            break
        n += 1
    return n
