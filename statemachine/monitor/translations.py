"""Translations: where a vLLM release's hooks fire the spec's rows differently.

The tables are written against vLLM 0.33.0. An older release can take the same path of rows
in fewer hook calls; a translation names the extra triggers a hook of that release may
fire, so the monitor checks the release against the same tables instead of flagging every
such move. A log's header lists the translations its monitor applied (`translations`), and
`kvspec replay` applies the same ones. CONFORMANCE.md lists them with the releases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Translation:
    name: str
    meaning: str
    triggers: dict[str, tuple[str, ...]]
    """hook -> the extra triggers (rows) a call of it may fire."""


TRANSLATIONS: dict[str, Translation] = {t.name: t for t in (
    Translation(
        "FINISH-AT-ONCE",
        "releases before the finish lifecycle (no `finished_signaled`, vLLM < 0.27): "
        "`request_finished` signals the manager and drops a request with no job at once, and "
        "the last report of a finished request's job drops it; 0.33 finalizes both in the next "
        "`build_connector_meta`",
        {"request_finished": ("finalize",), "update_connector_output": ("finalize",)}),
    Translation(
        "ARRIVE-AT-LOOKUP",
        "releases without `on_new_request` (vLLM < 0.23): the connector creates a request's "
        "state at its first `get_num_new_matched_tokens` (S@0.22.0:525-528), so that call "
        "fires the `add` row before the lookup's own",
        {"get_num_new_matched_tokens": ("add",)}),
)}


def extra_triggers(names: tuple[str, ...], hook: str) -> tuple[str, ...]:
    """The extra triggers a call of `hook` may fire under the translations `names`."""
    out: list[str] = []
    for name in names:
        out.extend(TRANSLATIONS[name].triggers.get(hook, ()))
    return tuple(out)


def translations_of(sched: Any) -> tuple[str, ...]:
    """The translations a live vLLM connector scheduler needs, read from its classes."""
    import importlib

    module = importlib.import_module(type(sched).__module__)
    state = getattr(module, "RequestOffloadState", None)
    fields = getattr(state, "__dataclass_fields__", {})
    names = []
    if state is not None and "finished_signaled" not in fields:
        names.append("FINISH-AT-ONCE")
    if not hasattr(type(sched), "on_new_request"):
        names.append("ARRIVE-AT-LOOKUP")
    return tuple(names)


__all__ = ["TRANSLATIONS", "Translation", "extra_triggers", "translations_of"]
