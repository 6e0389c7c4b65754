"""Which region paths give up their CUDA graphs under ``max_graph_memory``: the largest first.

Why. ``apply_manifest(..., max_graph_memory="2GiB")`` caps what the region graphs hold on the
device (surgery.runtime.graphs.arena keeps the count). Admitting paths in the order they are
first captured would leave the cap's room to whichever paths the model happens to call first,
and demote the last ones called, however small they are. Issue 20 asks that past the cap the
largest paths give way first, so that the bytes the cap allows buy as many graphs as they can.

What decides. Bytes: the runtime knows exactly what each path's graphs hold. What a graph saves
per path is not timed (a replay saves about the host cost of one compiled call, 80-140 us on an
H200, and every path pays it once per call), so time saved does not enter the order; bytes do.
A path's size here is what demoting it would free: the bytes of the buffers (output sets and
static inputs) that its graphs alone use. A set another path writes too, a static input another
path reads, or an output another path's graph reads in place stays when it goes, so it does not
count. The capture pool's temporaries do not count either: the pool is one for every graph and
does not shrink when one graph goes, and the next capture reuses its free blocks.

How. When a capture (a path's graph, or one more set of its ring) would take the graphs past the
cap, ``make_room`` looks at the paths that hold more than the newcomer would (its need plus what
it already holds alone), largest first, and takes as many as free the room. If they do, each is
demoted: its graphs are dropped, it runs its compiled code without a graph from then on, and its
record says so, with the bytes and the path it made room for. If they do not, none is touched
and the newcomer gives way (the caller notes it). Among paths of equal size the one already
captured keeps its graph: a tie frees nothing a demotion would not cost again. The order is
deterministic: sizes, then registration order (the order the paths were installed), never the
hash order of a set.

An example. Under a 10 MiB cap, paths A, B and C whose graphs need 6, 5 and 5 MiB alone, called
in that order: A is captured; B does not fit beside it, A holds more than B needs, so A is
demoted and B captured; C fits beside B. Called C, B, A: C and B are captured and A, larger than
either, gives way. Either way A runs without a graph and B and C replay.

What it does not promise. A demoted path's outputs that a caller still holds stay alive until
released (they are the caller's now), and an output another path's graph reads in place stays
until that graph is captured again reading a copy (it notices the address change on its next
call). The cap then holds to within those, as it holds to within the last capture's pool growth
(its size is known only after it).
"""

from __future__ import annotations

from typing import Any

from surgery.runtime.graphs.arena import BufferArena, fmt_bytes


def _storages_of(member: Any, held: set[int]) -> dict[int, int]:
    """{storage address: bytes} of the buffers a member's graphs use: output sets written,
    static inputs copied into, and other paths' outputs read in place. The addresses of sets
    someone outside surgery still holds go into ``held``."""
    out: dict[int, int] = {}
    for cap in list(member.graphs.values()):
        for o in cap.sets:
            out.update((s.data_ptr(), s.nbytes()) for s in o.storages)
            if o.held():
                held.update(s.data_ptr() for s in o.storages)
        for i in cap.copied:
            st = cap.inputs[i].untyped_storage()
            out[st.data_ptr()] = st.nbytes()
        for owner, _ in cap.adopted_from:
            out.update((s.data_ptr(), s.nbytes()) for s in owner.storages)
    return out


def alone_bytes(arena: BufferArena) -> dict[Any, int]:
    """What each captured member's graphs hold that no other member uses and nobody outside
    surgery holds now: what demoting it would free (the capture pool aside). A set a caller
    still holds (a KV cache's k and v) is freed only when the caller lets go; demoted, it is
    the caller's tensor, as it would be in eager."""
    members = [m for m in arena.members() if m.graphs]
    held: set[int] = set()
    used = {m: _storages_of(m, held) for m in members}
    users: dict[int, int] = {}
    for storages in used.values():
        for ptr in storages:
            users[ptr] = users.get(ptr, 0) + 1
    return {m: sum(n for ptr, n in storages.items() if users[ptr] == 1 and ptr not in held)
            for m, storages in used.items()}


def make_room(arena: BufferArena, me: Any, need: int) -> bool:
    """Can ``me`` take ``need`` more bytes under the cap? Demotes larger paths if that makes
    room (see the module docstring); False, touching nothing, if it cannot."""
    if arena.admits(need):
        return True
    assert arena.limit is not None  # admits() is True without a cap
    over = arena.used() + need - arena.limit
    sizes = alone_bytes(arena)
    mine = need + sizes.pop(me, 0)
    ranked = sorted(((n, m) for m, n in sizes.items() if n > mine and not m.disabled),
                    key=lambda nm: (-nm[0], -nm[1].arena_order))
    chosen: list[tuple[int, Any]] = []
    freed = 0
    for n, m in ranked:
        if freed >= over:
            break
        chosen.append((n, m))
        freed += n
    if freed < over:
        return False
    label = getattr(me, "label", "") or "another path"
    for n, m in chosen:
        why = (f"demoted by max_graph_memory = {fmt_bytes(arena.limit)}: its graphs held "
               f"{fmt_bytes(n)} alone, more than {label} needed ({fmt_bytes(mine)}), and the "
               "largest paths give way first; runs compiled without a graph")
        m.demote(why)
        arena.demoted.append((getattr(m, "label", ""), n))
    return arena.admits(need)

