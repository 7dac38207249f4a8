"""Fair cycles in an explored state graph: the search behind the progress properties.

A property "never `waiting` forever" (`spec.progress`) is violated exactly when some
reachable cycle of `waiting` states is fair. Under weak fairness a cycle is fair when every
class enabled in all of its states is taken on one of its edges. The search looks at the
strongly connected components of the subgraph of `waiting` states (Tarjan, iterative): a
component with an internal edge holds a fair cycle if and only if every class enabled in all
of its states is the class of one of its internal edges (a smaller cycle inside it is enabled
in no fewer classes and takes no more). The cycle returned is built inside the component:
from its entry (the component's state nearest the initial state) it takes an edge of each
class still owed, until none is, then returns to the entry.

`statemachine/checker/c/search.c` implements the same search for the compiled checker.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

Edge = tuple[int, Hashable | None]
"""(destination state, the edge's fairness class or None)."""


@dataclass(frozen=True)
class FairCycle:
    entry: int
    edges: tuple[tuple[int, int], ...]
    """The cycle from `entry` back to it: (source state, index into its out-edges)."""
    owed: frozenset[Hashable]
    """The classes enabled in every state of the component (each is taken in the cycle)."""


def fair_cycle(out: Sequence[Sequence[Edge]], waiting: Sequence[bool],
               depth: Sequence[int]) -> FairCycle | None:
    """A fair cycle through `waiting` states only, or None."""
    n = len(out)
    enabled = [frozenset(c for _, c in es if c is not None) for es in out]
    index = [-1] * n
    low = [0] * n
    on = [False] * n
    comp = [-1] * n
    stack: list[int] = []
    counter = 0
    comps = 0
    for root in range(n):
        if not waiting[root] or index[root] >= 0:
            continue
        call = [(root, 0)]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on[root] = True
        while call:
            v, k = call[-1]
            if k < len(out[v]):
                call[-1] = (v, k + 1)
                w = out[v][k][0]
                if not waiting[w]:
                    continue
                if index[w] < 0:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on[w] = True
                    call.append((w, 0))
                elif on[w]:
                    low[v] = min(low[v], index[w])
                continue
            call.pop()
            if call:
                u = call[-1][0]
                low[u] = min(low[u], low[v])
            if low[v] != index[v]:
                continue
            members: list[int] = []
            while True:
                w = stack.pop()
                on[w] = False
                comp[w] = comps
                members.append(w)
                if w == v:
                    break
            cid = comps
            comps += 1
            always = frozenset.intersection(*(enabled[m] for m in members))
            internal = [(m, i) for m in members for i, (d, _) in enumerate(out[m])
                        if comp[d] == cid]
            taken = {out[m][i][1] for m, i in internal}
            if internal and always <= taken:
                return _cycle(out, comp, cid, members, enabled, depth, always)
    return None


def _path(out: Sequence[Sequence[Edge]], comp: list[int], cid: int, src: int,
          states: set[int], edges: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """Shortest path inside component `cid` from `src` that ends in one of `states` or ends
    with one of `edges` (taken)."""
    prev: dict[int, tuple[int, int] | None] = {src: None}
    queue = deque([src])
    end: int | None = None
    last: tuple[int, int] | None = None
    while queue:
        v = queue.popleft()
        if v in states and v != src:
            end = v
            break
        last = next(((v, i) for i in range(len(out[v])) if (v, i) in edges), None)
        if last is not None:
            end = v
            break
        for i, (w, _) in enumerate(out[v]):
            if comp[w] == cid and w not in prev:
                prev[w] = (v, i)
                queue.append(w)
    assert end is not None, "the component is strongly connected"
    path: list[tuple[int, int]] = []
    v = end
    while (p := prev[v]) is not None:
        path.append(p)
        v = p[0]
    path.reverse()
    return path + ([last] if last is not None else [])


def _cycle(out: Sequence[Sequence[Edge]], comp: list[int], cid: int, members: list[int],
           enabled: list[frozenset[Hashable]], depth: Sequence[int],
           always: frozenset[Hashable]) -> FairCycle:
    entry = min(members, key=lambda m: (depth[m], m))
    internal = {(m, i) for m in members for i, (d, _) in enumerate(out[m]) if comp[d] == cid}
    edges: list[tuple[int, int]] = []
    cur = entry
    visited = {entry}
    taken: set[Hashable] = set()
    while True:
        owed = frozenset.intersection(*(enabled[v] for v in visited)) - taken
        if not owed and edges and cur == entry:
            break
        if owed:  # take an edge of the class, or visit a state where it is not enabled
            want = min(owed, key=repr)
            states = {m for m in members if want not in enabled[m]}
            goal = {(m, i) for m, i in internal if out[m][i][1] == want}
        elif cur != entry:
            states, goal = {entry}, set()
        else:  # at the entry, nothing owed, no edge yet: any internal edge out, then back
            states, goal = set(), {(entry, i) for e, i in internal if e == entry}
        for v, i in _path(out, comp, cid, cur, states, goal):
            edges.append((v, i))
            taken.add(out[v][i][1])
            cur = out[v][i][0]
            visited.add(cur)
    return FairCycle(entry, tuple(edges), always)
