"""`transitions` machines built from the tables of `spec`, and nothing else.

One `Lifecycle` per table and per owner (a scheduler, a worker): one `transitions.Machine`
built from the table's rows with `auto_transitions=False`, so the only moves are the
table's. Subjects (requests, jobs) are not registered as the machine's models: a trigger is
sent to a subject through the event's public `Event.trigger(model, **kwargs)`, which needs no
registration, so the cost of a subject does not grow with the number of live ones, and
nothing is bound onto it. `fire` is the one way to move a subject: a trigger the table does
not allow in the current state, or one whose guards all fail, raises `IllegalTransition`
(plain `transitions` would return False and change nothing, silently).

Guards are methods of the subject (`def other_jobs_remain(self, event) -> bool`), given to
transitions as the row's `conditions` (its `requires`) and `unless`; effects are methods of the
host, run by the row's one `after` callback, in table order, after the state changed. Both
are checked when the machine is built: a table naming something the implementation lacks
fails at once with `SpecMismatch`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from transitions import EventData, Machine

from spec.schema import SAME, MachineSpec, Transition
from statemachine.errors import IllegalTransition, SpecMismatch


class Subject(Protocol):
    state: str

    @property
    def key(self) -> object: ...


@dataclass(frozen=True)
class Fired:
    """A completed transition, as observers see it."""

    machine: str
    key: object
    trigger: str
    source: str
    dest: str
    depth: int
    """0 for a transition fired from outside any other transition's effects."""


@dataclass
class Nesting:
    """Shared by the lifecycles of one owner: how deep in nested effects we are."""

    depth: int = 0
    observers: list[Callable[[Fired], None]] = field(default_factory=list)


class Lifecycle:
    def __init__(self, spec: MachineSpec, subject_cls: type, host: object,
                 nesting: Nesting | None = None) -> None:
        self.spec = spec
        self.host = host
        self.nesting = nesting or Nesting()
        self._check_resolves(subject_cls)
        self.machine = Machine(
            model=None,
            states=list(spec.state_names),
            initial=spec.initial,
            auto_transitions=False,
            send_event=True,
            ignore_invalid_triggers=False,
        )
        self._outgoing: dict[tuple[str, str], tuple[Transition, ...]] = {}
        for t in spec.transitions:
            self.machine.add_transition(
                t.trigger,
                list(t.sources),
                "=" if t.dest == SAME else t.dest,
                conditions=[self._guard(g) for g in t.requires],
                unless=[self._guard(g) for g in t.unless],
                after=[self._effects(t.effects)] if t.effects else [],
            )

    def _check_resolves(self, subject_cls: type) -> None:
        problems = [f"guard {g!r} is not a method of {subject_cls.__name__}"
                    for g in self.spec.guard_names if not callable(getattr(subject_cls, g, None))]
        problems += [f"effect {e!r} is not a method of {type(self.host).__name__}"
                     for e in self.spec.effect_names if not callable(getattr(self.host, e, None))]
        if problems:
            raise SpecMismatch(f"{self.spec.name} table does not resolve: " + "; ".join(problems))

    @staticmethod
    def _guard(name: str) -> Callable[[EventData], bool]:
        """The subject's guard method `name`, as a condition."""

        def holds(event: EventData) -> bool:
            return bool(getattr(event.model, name)(event))

        holds.__name__ = name
        return holds

    def _effects(self, names: tuple[str, ...]) -> Callable[[EventData], None]:
        """One `after` callback running the row's effects, in table order."""
        host = self.host

        def run(event: EventData) -> None:
            for name in names:
                getattr(host, name)(event.model, **event.kwargs)

        run.__name__ = "+".join(names)
        return run

    # -- subjects -------------------------------------------------------------------
    def add(self, subject: Subject, state: str | None = None) -> None:
        """Put `subject` in `state` (the table's initial one)."""
        self.machine.set_state(state or self.spec.initial, model=subject)

    def allowed(self, state: str) -> tuple[str, ...]:
        return self.spec.enabled_triggers(state)

    def outgoing(self, state: str, trigger: str) -> tuple[Transition, ...]:
        """The table's rows for `trigger` from `state` (`spec.outgoing`, memoised)."""
        rows = self._outgoing.get((state, trigger))
        if rows is None:
            rows = self._outgoing[state, trigger] = tuple(self.spec.outgoing(state, trigger))
        return rows

    def fire(self, subject: Subject, trigger: str, **kwargs: Any) -> str:
        """Move `subject` by `trigger`; returns the new state or raises IllegalTransition."""
        source = subject.state
        rows = self.outgoing(source, trigger)
        if not rows:
            raise IllegalTransition(self.spec.name, subject.key, source, trigger,
                                    self.allowed(source))
        self.nesting.depth += 1
        try:
            done = self.machine.events[trigger].trigger(subject, **kwargs)
        finally:
            self.nesting.depth -= 1
        if not done:
            names = sorted({g for r in rows for g in r.guard_names})
            values = ", ".join(f"{g}={self._guard_value(subject, g, kwargs)}" for g in names)
            raise IllegalTransition(self.spec.name, subject.key, source, trigger,
                                    self.allowed(source), f"no guard combination holds ({values})")
        fired = Fired(self.spec.name, subject.key, trigger, source, subject.state,
                      self.nesting.depth)
        for observer in self.nesting.observers:
            observer(fired)
        return subject.state

    def _guard_value(self, subject: Subject, guard: str, kwargs: dict[str, Any]) -> bool:
        event = EventData(self.machine.get_state(subject.state), None, self.machine, subject,
                          args=(), kwargs=kwargs)
        return bool(getattr(subject, guard)(event))
