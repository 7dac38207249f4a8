"""The abstract model: the lifecycle, executed on immutable values, for exhaustive checking.

A `ModelState` is a hashable value: the connector's requests and jobs (as in
`spec.state.AbstractState`), the manager's chunks, the reset fence, the timeout quarantine,
plus the little the invariants do not speak of but the semantics need (store cursors, a
small core scheduler: which request waits, loads, runs, which GPU blocks are free).

One module per concern:
- `state`: bounds, records, `ModelState`, and `World`, the working copy of one event;
- `interpreter`: `fire`, the only way anything moves, through the tables' rows and guards;
- `effects`: the effects the tables name;
- `hooks`: the connector's hooks (which trigger each decides to fire);
- `core`: the core scheduler stand-in the hooks serve;
- `environment`: events, `apply` (one event), `successors` (the checker's relation);
- `projection`: `abstract` (onto `spec.AbstractState`) and `canonical`;
- `faults`: the faults the mutant catalogue switches on.
"""

from spec.model import effects as _effects  # registers the effects with the interpreter
from spec.model.environment import (
    Call,
    Event,
    FairClass,
    apply,
    events,
    fair_class,
    initial,
    parse_events,
    successors,
)
from spec.model.faults import NO_FAULTS, Fault, Faults
from spec.model.interpreter import MACHINES, SPEC_TABLES, Tables, fire, unresolved
from spec.model.projection import abstract, canonical, renumbering
from spec.model.state import (
    OUTPUT_FAMILY,
    Bounds,
    MCore,
    MJob,
    ModelError,
    ModelState,
    MReq,
    NotEnabled,
    RequestSettings,
    Template,
    World,
    block_key,
    chunk_label,
    key,
)

del _effects
if unresolved():
    raise ImportError("the model does not implement every name of the tables: "
                      + ", ".join(unresolved()))


def coverage_universe() -> set[tuple[str, int]]:
    """Every (machine, row index) of the spec's tables the model may fire."""
    return SPEC_TABLES.coverage_universe()


__all__ = ["MACHINES", "NO_FAULTS", "OUTPUT_FAMILY", "SPEC_TABLES", "Bounds", "Call", "Event",
           "FairClass", "Fault", "Faults", "MCore", "MJob", "MReq", "ModelError", "ModelState",
           "NotEnabled", "RequestSettings", "Tables", "Template", "World", "abstract", "apply",
           "block_key", "canonical", "chunk_label", "coverage_universe", "events", "fair_class",
           "fire", "initial", "key", "parse_events", "renumbering", "successors"]
