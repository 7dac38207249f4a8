"""The vocabulary of the tables: states, transitions, machines.

A table is plain, immutable data. Nothing here executes a transition; the implementation
(`statemachine`) builds `transitions` machines from these objects, the diagrams are drawn
from them, and the abstract model's action set is derived from them.

Conventions:
- A row names its guards in two fields: ``requires`` (each must hold) and ``unless`` (none may
  hold). Two transitions that leave the same state on the same trigger must be told apart by
  a guard that one requires and the other lists under ``unless`` (checked by the
  well-formedness tests).
- ``dest == SAME`` means the transition stays in its source state (a reflexive transition;
  ``transitions`` spells it ``"="``). It lets one row list several sources.
- ``vllm_ref`` cites vLLM 0.33.0 (``S:1247-1252``: a file abbreviated in `spec.vllm` and its
  lines), or is ``BEYOND_VLLM`` for behaviour vLLM 0.33.0 lacks.
- ``path`` classifies the edge for people: the happy path, reset handling, failure and
  timeout handling, abort/finish, or a counted ignore.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

SAME = "="
BEYOND_VLLM = "beyond vLLM"


class Path(StrEnum):
    """Which kind of path an edge belongs to; the diagrams style each kind apart."""

    HAPPY = "happy"
    PREEMPT = "preempt"
    FINISH = "finish"
    RESET = "reset"
    FAILURE = "failure"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class State:
    name: str
    meaning: str
    vllm_predicate: str
    beyond_vllm: bool = False


@dataclass(frozen=True)
class Transition:
    trigger: str
    sources: tuple[str, ...]
    dest: str
    hook: str
    vllm_ref: str
    requires: tuple[str, ...] = ()
    """Guards that must hold."""
    unless: tuple[str, ...] = ()
    """Guards that must not hold."""
    effects: tuple[str, ...] = ()
    path: Path = Path.HAPPY
    note: str = ""

    @property
    def beyond_vllm(self) -> bool:
        return self.vllm_ref == BEYOND_VLLM

    @property
    def guard_names(self) -> tuple[str, ...]:
        """Every guard the row evaluates, required ones first."""
        return (*self.requires, *self.unless)

    @property
    def guard_text(self) -> str:
        """``g & !h``: the guards as people read them (empty without guards)."""
        return " & ".join((*self.requires, *(f"!{g}" for g in self.unless)))

    def dest_from(self, source: str) -> str:
        return source if self.dest == SAME else self.dest


@dataclass(frozen=True)
class StateGroup:
    """A set of states that code tests membership of, named once, with its meaning.

    `state in GROUP` and iteration (in the machine's state order) work as on a tuple."""

    name: str
    meaning: str
    states: tuple[str, ...]

    def __contains__(self, state: object) -> bool:
        return state in self.states

    def __iter__(self) -> Iterator[str]:
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)


@dataclass(frozen=True)
class Guard:
    name: str
    meaning: str


@dataclass(frozen=True)
class Effect:
    name: str
    meaning: str


@dataclass(frozen=True)
class MachineSpec:
    """One lifecycle: its states, transitions, guards and effects, all as data."""

    name: str
    title: str
    subject: str
    states: tuple[State, ...]
    transitions: tuple[Transition, ...]
    initial: str
    finals: tuple[str, ...]
    guards: tuple[Guard, ...]
    effects: tuple[Effect, ...]
    ignored: tuple[tuple[str, str], ...] = field(default=())
    """Inputs that are not transitions but documented, counted ignores: (input, rule)."""
    groups: tuple[StateGroup, ...] = field(default=())
    """The state groups of this machine that other layers test membership of."""

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states)

    def row_id(self, index: int) -> str:
        """The name of transition `index` (0-based) in the tables and everywhere else: the
        machine's initial and the 1-based row number (`r48` is the request machine's 48th)."""
        return f"{self.name[0]}{index + 1}"

    @property
    def triggers(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for t in self.transitions:
            seen.setdefault(t.trigger, None)
        return tuple(seen)

    @property
    def guard_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.guards)

    @property
    def effect_names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.effects)

    def state(self, name: str) -> State:
        for s in self.states:
            if s.name == name:
                return s
        raise KeyError(f"{self.name}: no state {name!r}")

    def edges(self) -> list[tuple[str, str, Transition]]:
        """Every (source, destination, transition) triple, reflexive rows expanded."""
        return [(src, t.dest_from(src), t) for t in self.transitions for src in t.sources]

    def outgoing(self, state: str, trigger: str) -> list[Transition]:
        return [t for t in self.transitions if t.trigger == trigger and state in t.sources]

    def enabled_triggers(self, state: str) -> tuple[str, ...]:
        return tuple(trig for trig in self.triggers if self.outgoing(state, trig))
