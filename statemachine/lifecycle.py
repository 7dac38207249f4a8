"""`transitions` machines built from the tables of `spec`, and nothing else.

One `Lifecycle` per table and per owner (a scheduler): a single shared `transitions.Machine`
to which subjects (requests, jobs) are added and from which they are removed, because a
Machine per request costs far more than adding a model. `auto_transitions=False`, so the only
moves are the table's. `fire` is the one way to move a subject: a trigger the table does not
allow in the current state, or one whose guards all fail, raises `IllegalTransition` (plain
`transitions` would return False and change nothing, silently).

Cost (the scheduler fires several transitions per job, thousands per engine step): subjects
get no trigger methods of their own (`Machine.add_model` would bind one per trigger and per
state to every subject, which cost more than the rest of a job's life); the machine keeps its
models in an identity set, so adding and removing one is O(1) however many are live; `fire`
hands the event straight to the transitions of the trigger for the current state, and these
run their conditions, the state change and their after callbacks without the hooks a table's
machine never has (see `_TableTransition`).

Guards are methods of the subject (`def other_jobs_remain(self, event) -> bool`); effects are
methods of the host (`def create_load_job(self, subject, **kwargs) -> None`), run after the
state changed, in table order. Both are resolved when the machine is built: a table naming
something the implementation lacks fails at once with `SpecMismatch`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from transitions import EventData, Machine
from transitions import Transition as MachineTransition

from spec.schema import SAME, MachineSpec, Transition, guard_name, guard_negated
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


class _TableTransition(MachineTransition):
    """A `transitions.Transition` run as the tables need it: conditions (the guards) in order,
    then the state change, then the after callbacks (the effects) in order, as
    `Transition.execute` runs them, without its debug logging and without the prepare,
    before, state enter/exit and machine-wide callbacks, which a `Lifecycle` machine never has
    (`Lifecycle.__init__` checks)."""

    def execute(self, event_data: EventData) -> bool:
        for cond in self.conditions:
            if not cond.check(event_data):
                return False
        model: Any = event_data.model
        event_data.machine.set_state(self.dest, model)  # type: ignore[arg-type]  # never None
        event_data.update(model.state)
        for effect in self.after:
            effect(event_data)  # type: ignore[operator]  # callables (Lifecycle._effect)
        return True


class _TableMachine(Machine):
    transition_cls = _TableTransition


class _Models:
    """`Machine.models` as an insertion-ordered identity set (transitions keeps a list, which
    makes adding and removing a model O(models))."""

    __slots__ = ("_by_id",)

    def __init__(self) -> None:
        self._by_id: dict[int, object] = {}

    def append(self, model: object) -> None:
        self._by_id[id(model)] = model

    def remove(self, model: object) -> None:
        if self._by_id.get(id(model)) is not model:
            raise ValueError(f"{model!r} is not a model of this machine")
        del self._by_id[id(model)]

    def __contains__(self, model: object) -> bool:
        return self._by_id.get(id(model)) is model

    def __iter__(self) -> Iterator[object]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def __getitem__(self, index: int) -> object:
        return list(self._by_id.values())[index]


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
        self.machine = _TableMachine(
            model=None,
            states=list(spec.state_names),
            initial=spec.initial,
            auto_transitions=False,
            send_event=True,
            ignore_invalid_triggers=False,
        )
        self.machine.models = _Models()  # type: ignore[assignment]
        self._outgoing: dict[tuple[str, str], tuple[Transition, ...]] = {}
        for t in spec.transitions:
            self.machine.add_transition(
                t.trigger,
                list(t.sources),
                "=" if t.dest == SAME else t.dest,
                conditions=[g for g in t.guards if not guard_negated(g)],
                unless=[guard_name(g) for g in t.guards if guard_negated(g)],
                after=[self._effect(e) for e in t.effects],
            )
        self._check_lean(self.machine)

    @staticmethod
    def _check_lean(machine: Machine) -> None:
        """What `_TableTransition` leaves out must be absent."""
        hooks = [machine.prepare_event, machine.before_state_change,
                 machine.after_state_change, machine.finalize_event, machine.on_exception,
                 machine.on_final]
        hooks += [cb for st in machine.states.values() for cb in (st.on_enter, st.on_exit)]
        hooks += [cb for ev in machine.events.values() for ts in ev.transitions.values()
                  for t in ts for cb in (t.prepare, t.before)]
        assert not any(hooks), "a Lifecycle machine has no callbacks but the effects"
        assert all(t.dest is not None for ev in machine.events.values()
                   for ts in ev.transitions.values() for t in ts), "no internal transitions"

    def _check_resolves(self, subject_cls: type) -> None:
        problems = [f"guard {g!r} is not a method of {subject_cls.__name__}"
                    for g in self.spec.guard_names if not callable(getattr(subject_cls, g, None))]
        problems += [f"effect {e!r} is not a method of {type(self.host).__name__}"
                     for e in self.spec.effect_names if not callable(getattr(self.host, e, None))]
        problems += [f"{subject_cls.__name__}.{t} would shadow the trigger {t!r}"
                     for t in self.spec.triggers if hasattr(subject_cls, t)]
        if problems:
            raise SpecMismatch(f"{self.spec.name} table does not resolve: " + "; ".join(problems))

    def _effect(self, name: str) -> Callable[[EventData], None]:
        method = getattr(self.host, name)

        def run(event: EventData) -> None:
            method(event.model, **event.kwargs)

        run.__name__ = name
        return run

    # -- subjects -------------------------------------------------------------------
    def add(self, subject: Subject, state: str | None = None) -> None:
        """Make `subject` a model of the machine, in `state` (the table's initial one)."""
        models = self.machine.models
        if subject not in models:
            self.machine.set_state(state or self.spec.initial, model=subject)
            models.append(subject)

    def remove(self, subject: Subject) -> None:
        self.machine.remove_model(subject)

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
        machine = self.machine
        event = machine.events[trigger]
        event_data = EventData(machine.states[source], event, machine, subject, args=(),
                               kwargs=kwargs)
        done = False
        self.nesting.depth += 1
        try:
            for transition in event.transitions[source]:  # the rows, in table order
                event_data.transition = transition
                if transition.execute(event_data):
                    event_data.result = done = True
                    break
        finally:
            self.nesting.depth -= 1
        if not done:
            guards = sorted({g for r in rows for g in r.guards})
            names = sorted({guard_name(g) for g in guards})
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
