"""The monitor's event log: one JSON object per line, schema `kvspec-monitor` version 3.

Line 1 is the header; every later line is one scheduler-side hook call of the connector:

    {"schema": "kvspec-monitor", "schema_version": 3, "vllm": "0.33.0", "num_workers": 2,
     "mode": "warn", "stuck_after_steps": 64, "translations": [],
     "records": {"request": ["id", "state", ...], "job": [...], "held": [...]}}
    {"seq": 1, "step": 0, "hook": "on_new_request", "args": {"request": "r0", ...},
     "delta": {"requests": {"r0": ["r0", "IDLE", [], false, ...]}}}

An event's fields:
- `seq`: 1, 2, 3, ... (a gap or a repeat is a malformed log);
- `step`: engine steps seen so far (`build_connector_meta` calls), so the progress check
  can count steps without a wall clock;
- `hook`: a scheduler-side hook of the connector (`spec.hooks`);
- `args`: the hook's arguments in domain terms (`HOOK_ARGS` names the fields of each hook:
  request ids, token counts, block ids per KV cache group, job ids, acks as
  `{job id: reports}`) and its answer where it has one (`result`);
- `delta`: what changed in the projected `spec.AbstractState` after the hook:
  `requests` (id -> record, or null: no longer tracked), `jobs` (id -> record, or null:
  left the job table), `fence` (id -> held job, or null), `quarantine` (timed-out jobs
  awaiting late reports, beyond vLLM: id -> held job, or null), `ref_cnt` (chunk key -> count,
  or null: evicted), `block_fence` (block -> job ids, or null), `signals` (request ->
  `on_request_finished` calls) and `scalars` (the remaining fields of the state, each
  written only when it changed).
- `findings` (optional): what the live monitor reported after this event;
- `error` (optional): the exception the hook raised, `Type: message (file:line)` (the
  event's `result` is then null and its delta what the hook left behind).

A record is an array of its fields in the order the header's `records` names them (for a
`spec.state` `RequestRecord`, `JobRecord` and `HeldJob`: their fields' order in `spec.state`);
frozensets are sorted lists, tuples lists. (Version 1 wrote each record as an object keyed
by field name: the same content, twice the bytes and twice the time to encode. Version 2
wrote `build_connector_meta`'s `scheduled` as request id -> [tokens, new block ids, resumed]
for every scheduled request: version 3 splits it into `scheduled`, `new_block_ids` and
`admitted`, so a request that only decodes costs its token count, a third of the bytes.)
The file is UTF-8: text outside ASCII is written as itself. The writer flushes at the end
of each engine step (`build_connector_meta`) and after an event with findings or an error:
a process that dies loses at most the events of the step it died in.
A log of another schema or version is refused (`SchemaVersionMismatch`); a line that is not
a JSON object, a missing or mistyped field, a seq out of order: `MalformedLog` names the line
and the field (a record's field by its name). A last line cut short (the process died while
writing it) is not an error: `read_log` reports it as `truncated` and checks the lines
before it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any, TypeVar

from spec.hooks import LIFECYCLE_HOOKS, QUERY_HOOKS
from spec.state import HeldJob, JobRecord, RequestRecord
from statemachine.errors import KVSpecError

SCHEMA = "kvspec-monitor"
SCHEMA_VERSION = 3

HOOK_ARGS: dict[str, tuple[str, ...]] = {
    "on_new_request": ("request", "prompt_tokens"),
    "get_num_new_matched_tokens": ("request", "num_computed_tokens", "result"),
    "update_state_after_alloc": ("request", "block_ids", "num_external_tokens"),
    "build_connector_meta": ("scheduled", "new_block_ids", "admitted", "finished", "preempted",
                             "shipped"),
    "update_connector_output": ("acks", "finished_sending", "finished_recving"),
    "request_finished": ("request", "block_ids", "result"),
    "reset_cache": ("result",),
}
"""The argument fields each hook's events carry (schema version 3). `scheduled`: request id
-> tokens scheduled this step, for every request the step schedules (in the scheduler
output's order); `new_block_ids`: request id -> the block ids per KV cache group it was
given this step, only for the requests given some (a request scheduled as new: its whole
table); `admitted`: the requests scheduled as new or resumed from preemption; `shipped`:
the job ids the step's metadata hands the workers, per kind (`store`, `load`, `flush`);
`acks`: job id -> reports (summed over the workers). An implementation with failure reports
(ours) adds `failed` (job id -> failure reports) to `update_connector_output`."""


def block_ids_per_group(blocks: Any) -> list[list[int]]:
    """Block ids per KV cache group in the schema's form (a list per group) from a
    `KVCacheBlocks`, a tuple or list of per-group lists, or one group's flat list; None or
    empty: no groups."""
    if blocks is None:
        return []
    get = getattr(blocks, "get_block_ids", None)
    groups = get() if get is not None else blocks
    if not groups:
        return []
    if isinstance(groups[0], int):
        return [list(map(int, groups))]
    if len(groups) == 1 and not groups[0]:
        return [[]]
    return [list(g) if g else [] for g in groups]


def connector_meta_args(scheduled: Mapping[str, int], new_reqs: Iterable[tuple[str, Any]],
                        cached: Iterable[tuple[str, Any]], resumed: Iterable[str],
                        finished: Iterable[str], preempted: Iterable[str]) -> dict[str, Any]:
    """`build_connector_meta`'s arguments (`HOOK_ARGS`; the caller adds `shipped` once the
    hook returns) from a scheduler output's parts: `new_reqs` (id, whole block table) and
    `cached` (id, new blocks or None) per KV cache group in any form `block_ids_per_group`
    takes, `resumed` the cached requests resumed from preemption. A cached request given no
    block costs only its token count."""
    new_blocks: dict[str, list[list[int]]] = {}
    admitted: list[str] = []
    for rid, table in new_reqs:
        new_blocks[rid] = block_ids_per_group(table)
        admitted.append(rid)
    for rid, blocks in cached:
        if not blocks:
            continue
        if type(blocks) is tuple and len(blocks) == 1 and type(blocks[0]) is list:
            if blocks[0]:       # one KV cache group (the common case), without the checks
                new_blocks[rid] = [list(blocks[0])]
        else:
            ids = block_ids_per_group(blocks)
            if any(ids):
                new_blocks[rid] = ids
    admitted.extend(sorted(resumed))
    return {"scheduled": scheduled, "new_block_ids": new_blocks, "admitted": admitted,
            "finished": sorted(finished), "preempted": sorted(preempted)}


SCALARS = ("job_counter", "stale_threshold", "chunks_being_loaded", "jobs_to_flush",
           "step_open", "reset_since_last_step", "stores_after_signal")
"""The fields of `spec.AbstractState` a delta carries whole, when they change."""


class LogError(KVSpecError):
    """A log the replay cannot read."""


class MalformedLog(LogError):
    """A line that is not what the schema says: names the line (1-based) and the field."""

    def __init__(self, path: str, line: int, field_name: str, reason: str) -> None:
        self.path, self.line, self.field, self.reason = path, line, field_name, reason
        super().__init__(f"{path}:{line}: field {field_name!r}: {reason}")


class SchemaVersionMismatch(LogError):
    def __init__(self, path: str, found: object) -> None:
        self.path, self.found = path, found
        super().__init__(
            f"{path}: the log is of schema {found}, this kvspec reads {SCHEMA!r} version "
            f"{SCHEMA_VERSION} only: replay it with the kvspec release that wrote it")


# ----------------------------------------------------------------------------- records
R = TypeVar("R", RequestRecord, JobRecord, HeldJob)


RECORDS: dict[str, type] = {"request": RequestRecord, "job": JobRecord, "held": HeldJob}
"""The record classes a delta carries, by the name the header's `records` gives them."""


def record_fields() -> dict[str, list[str]]:
    """The header's `records`: each record class's fields, in the order a record lists them."""
    return {name: [f.name for f in fields(cls)] for name, cls in RECORDS.items()}


_ENCODERS: dict[type, Any] = {}


def _encoder(cls: type) -> Any:
    """`record_json` of one record class, compiled once: a single list display over the
    fields (the hot path of the live monitor's log writes one per changed record)."""
    enc = _ENCODERS.get(cls)
    if enc is None:
        parts = []
        for f in fields(cls):
            text = str(f.type)
            value = f"r.{f.name}"
            if text.startswith("frozenset"):
                value = f"sorted(r.{f.name})"
            elif text.startswith("tuple"):
                value = f"list(r.{f.name})"
            parts.append(value)
        namespace: dict[str, Any] = {}
        exec(f"def encode(r):\n    return [{', '.join(parts)}]\n", namespace)
        enc = _ENCODERS[cls] = namespace["encode"]
    return enc


def record_json(rec: RequestRecord | JobRecord | HeldJob) -> list[Any]:
    """A record as a JSON array of its fields in their order (frozensets as sorted lists,
    tuples as lists in their order)."""
    out: list[Any] = _encoder(type(rec))(rec)
    return out


_FIELD_TYPES: dict[type, dict[str, type]] = {}


def _kinds(cls: type) -> dict[str, type]:
    """Each field's Python type as the codec reads it (int, str, bool, frozenset, tuple)."""
    if cls not in _FIELD_TYPES:
        kinds: dict[str, type] = {}
        for f in fields(cls):
            text = str(f.type)
            kinds[f.name] = (frozenset if text.startswith("frozenset") else
                             tuple if text.startswith("tuple") else
                             bool if text == "bool" else
                             int if text.startswith("int") else str)
        _FIELD_TYPES[cls] = kinds
    return _FIELD_TYPES[cls]


def record_from_json(cls: type[R], data: object, where: str) -> R:
    """A record from its JSON array; `ValueError` naming the field where it does not fit."""
    kinds = _kinds(cls)
    if not isinstance(data, list) or len(data) != len(kinds):
        got = f"{len(data)} values" if isinstance(data, list) else type(data).__name__
        raise ValueError(f"{where}: a record must be an array of the {len(kinds)} fields of "
                         f"{cls.__name__} ({', '.join(kinds)}), not {got}")
    kw: dict[str, Any] = {}
    for name, value in zip(kinds, data, strict=True):
        kind = kinds[name]
        if kind in (frozenset, tuple):
            if not isinstance(value, list) or not all(isinstance(x, int) for x in value):
                raise ValueError(f"{where}.{name}: a list of integers expected")
            kw[name] = kind(value)
        elif name == "store_cursor" and value is None:
            kw[name] = None
        elif (kind is bool and not isinstance(value, bool)) or (kind is int and (
                not isinstance(value, int) or isinstance(value, bool))) \
                or (kind is str and not isinstance(value, str)):
            raise ValueError(f"{where}.{name}: {kind.__name__} expected, got {value!r}")
        else:
            kw[name] = value
    try:
        return cls(**kw)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None


# ----------------------------------------------------------------------------- delta
@dataclass
class Delta:
    """What one hook changed in the projected state (see the module docstring)."""

    requests: dict[str, RequestRecord | None] = field(default_factory=dict)
    jobs: dict[int, JobRecord | None] = field(default_factory=dict)
    fence: dict[int, HeldJob | None] = field(default_factory=dict)
    quarantine: dict[int, HeldJob | None] = field(default_factory=dict)
    ref_cnt: dict[int, int | None] = field(default_factory=dict)
    block_fence: dict[int, frozenset[int] | None] = field(default_factory=dict)
    signals: dict[str, int] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return any((self.requests, self.jobs, self.fence, self.quarantine, self.ref_cnt,
                    self.block_fence, self.signals, self.scalars))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.requests:
            enc = _encoder(RequestRecord)
            out["requests"] = {k: None if v is None else enc(v)
                               for k, v in self.requests.items()}
        if self.jobs:
            enc = _encoder(JobRecord)
            out["jobs"] = {str(k): None if v is None else enc(v)
                           for k, v in self.jobs.items()}
        if self.fence:
            enc = _encoder(HeldJob)
            out["fence"] = {str(k): None if v is None else enc(v)
                            for k, v in self.fence.items()}
        if self.quarantine:
            enc = _encoder(HeldJob)
            out["quarantine"] = {str(k): None if v is None else enc(v)
                                 for k, v in self.quarantine.items()}
        if self.ref_cnt:
            out["ref_cnt"] = {str(k): v for k, v in self.ref_cnt.items()}
        if self.block_fence:
            out["block_fence"] = {str(k): None if v is None else sorted(v)
                                  for k, v in self.block_fence.items()}
        if self.signals:
            out["signals"] = dict(self.signals)
        if self.scalars:
            out["scalars"] = {k: sorted(v) if isinstance(v, frozenset) else v
                              for k, v in self.scalars.items()}
        return out

    @classmethod
    def from_json(cls, data: object) -> Delta:
        """The delta of an event's `delta` object; `ValueError` naming the field (relative
        to `delta`) where it does not fit the schema."""
        if not isinstance(data, dict):
            raise ValueError("delta: an object expected")
        unknown = sorted(set(data) - {"requests", "jobs", "fence", "quarantine", "ref_cnt",
                                      "block_fence", "signals", "scalars"})
        if unknown:
            raise ValueError(f"delta.{unknown[0]}: no such part of a delta")
        d = cls()
        for rid, rec in _obj(data, "requests").items():
            d.requests[rid] = None if rec is None else record_from_json(
                RequestRecord, rec, f"delta.requests.{rid}")
        for jid, rec in _obj(data, "jobs").items():
            d.jobs[_int_key(jid, "jobs")] = None if rec is None else record_from_json(
                JobRecord, rec, f"delta.jobs.{jid}")
        for jid, rec in _obj(data, "fence").items():
            d.fence[_int_key(jid, "fence")] = None if rec is None else record_from_json(
                HeldJob, rec, f"delta.fence.{jid}")
        for jid, rec in _obj(data, "quarantine").items():
            d.quarantine[_int_key(jid, "quarantine")] = None if rec is None else \
                record_from_json(HeldJob, rec, f"delta.quarantine.{jid}")
        for key, n in _obj(data, "ref_cnt").items():
            if n is not None and (not isinstance(n, int) or isinstance(n, bool)):
                raise ValueError(f"delta.ref_cnt.{key}: an integer or null expected")
            d.ref_cnt[_int_key(key, "ref_cnt")] = n
        for block, ids in _obj(data, "block_fence").items():
            if ids is not None and (not isinstance(ids, list)
                                    or not all(isinstance(x, int) for x in ids)):
                raise ValueError(f"delta.block_fence.{block}: a list of job ids expected")
            d.block_fence[_int_key(block, "block_fence")] = (
                None if ids is None else frozenset(ids))
        for rid, n in _obj(data, "signals").items():
            if not isinstance(n, int):
                raise ValueError(f"delta.signals.{rid}: an integer expected")
            d.signals[rid] = n
        for name, value in _obj(data, "scalars").items():
            if name not in SCALARS:
                raise ValueError(f"delta.scalars.{name}: no such field of the state")
            d.scalars[name] = _scalar(name, value)
        return d


def _obj(data: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ValueError(f"delta.{name}: an object expected")
    return value


def _int_key(text: str, part: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"delta.{part}.{text}: an integer key expected") from None


def _scalar(name: str, value: Any) -> Any:
    if name in ("chunks_being_loaded", "jobs_to_flush"):
        if not isinstance(value, list) or not all(isinstance(x, int) for x in value):
            raise ValueError(f"delta.scalars.{name}: a list of integers expected")
        return frozenset(value)
    if name == "stores_after_signal":
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise ValueError(f"delta.scalars.{name}: a list of request ids expected")
        return frozenset(value)
    if name in ("step_open", "reset_since_last_step"):
        if not isinstance(value, bool):
            raise ValueError(f"delta.scalars.{name}: true or false expected")
        return value
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"delta.scalars.{name}: an integer expected")
    return value


# ----------------------------------------------------------------------------- events
@dataclass
class Header:
    vllm: str
    num_workers: int
    mode: str = "log"
    stuck_after_steps: int | None = None
    translations: tuple[str, ...] = ()
    """The release translations the monitor applied (`statemachine.monitor.translations`)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "vllm": self.vllm,
                "num_workers": self.num_workers, "mode": self.mode,
                "stuck_after_steps": self.stuck_after_steps,
                "translations": list(self.translations), "records": record_fields(),
                **self.extra}


@dataclass
class Event:
    seq: int
    step: int
    hook: str
    args: dict[str, Any]
    delta: Delta
    findings: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    """The exception the hook raised (`Type: message (file:line)`), if it raised."""
    line: int = 0
    """The line of the log it was read from (0: not read from a log)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seq": self.seq, "step": self.step, "hook": self.hook,
                               "args": self.args, "delta": self.delta.to_json()}
        if self.findings:
            out["findings"] = self.findings
        if self.error is not None:
            out["error"] = self.error
        return out


_ENCODE = json.JSONEncoder(separators=(",", ":"), check_circular=False,
                           ensure_ascii=False).encode
"""`json.dumps(obj, separators=(",", ":"), ensure_ascii=False)`, its encoder built once (an
event holds no cycle to look for). The file is UTF-8, so text outside ASCII is written as
itself (a third cheaper than escaping every string); the JSON read back is the same."""
_ENCODE_ASCII = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode


FLUSH_AFTER = "build_connector_meta"
"""The hook that ends an engine step: the writer flushes after it (and after any event with
findings or an error), not after every event (a flush is a system call per line)."""


class LogWriter:
    """Appends events to a JSON-lines file, flushed at the end of each engine step and after
    an event with findings or an error (a process that dies loses at most its last step's
    events; a line cut short is read back as `truncated`)."""

    def __init__(self, path: str | Path, header: Header) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._out: IO[str] = self.path.open("w", encoding="utf-8")
        self._write(header.to_json())
        self._out.flush()

    def _write(self, obj: dict[str, Any]) -> None:
        line = _ENCODE(obj) + "\n"
        try:
            self._out.write(line)
        except UnicodeEncodeError:  # a lone surrogate in a string: escaped, as JSON allows
            self._out.write(_ENCODE_ASCII(obj) + "\n")

    def write(self, event: Event) -> None:
        self._write(event.to_json())
        if event.hook == FLUSH_AFTER or event.findings or event.error is not None:
            self._out.flush()

    def flush(self) -> None:
        self._out.flush()

    def close(self) -> None:
        self._out.close()


@dataclass
class Log:
    path: str
    header: Header
    events: list[Event]
    truncated: int | None = None
    """The line number of a last line cut short (it is not checked), or None."""


def _header(path: str, line: int, data: Any) -> Header:
    if not isinstance(data, dict) or "schema" not in data:
        raise MalformedLog(path, line, "schema", "the first line must be the log's header "
                           f"(an object with \"schema\": {SCHEMA!r})")
    found = (data.get("schema"), data.get("schema_version"))
    if found != (SCHEMA, SCHEMA_VERSION):
        raise SchemaVersionMismatch(path, f"{found[0]!r} version {found[1]!r}")
    workers = data.get("num_workers")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise MalformedLog(path, line, "num_workers", f"a positive integer expected, got "
                           f"{workers!r}")
    stuck = data.get("stuck_after_steps")
    if stuck is not None and (not isinstance(stuck, int) or stuck < 1):
        raise MalformedLog(path, line, "stuck_after_steps", "a positive integer or null "
                           f"expected, got {stuck!r}")
    from statemachine.monitor.translations import TRANSLATIONS

    names = data.get("translations", [])
    if not isinstance(names, list) or any(n not in TRANSLATIONS for n in names):
        raise MalformedLog(path, line, "translations", f"a list of translation names "
                           f"({', '.join(TRANSLATIONS)}) expected, got {names!r}")
    records = data.get("records")
    if records != record_fields():
        raise MalformedLog(path, line, "records", "each record's fields in this kvspec's "
                           f"order expected ({record_fields()}), got {records!r}")
    known = {"schema", "schema_version", "vllm", "num_workers", "mode", "stuck_after_steps",
             "translations", "records"}
    return Header(vllm=str(data.get("vllm", "?")), num_workers=workers,
                  mode=str(data.get("mode", "log")), stuck_after_steps=stuck,
                  translations=tuple(names),
                  extra={k: v for k, v in data.items() if k not in known})


def _event(path: str, line: int, data: Any, expect_seq: int) -> Event:
    if not isinstance(data, dict):
        raise MalformedLog(path, line, "(line)", "an event must be a JSON object")
    for name, kind in (("seq", int), ("step", int), ("hook", str), ("args", dict),
                       ("delta", dict)):
        if name not in data:
            raise MalformedLog(path, line, name, "missing")
        if not isinstance(data[name], kind) or (kind is int and isinstance(data[name], bool)):
            raise MalformedLog(path, line, name, f"{kind.__name__} expected, got "
                               f"{type(data[name]).__name__}")
    if data["seq"] != expect_seq:
        raise MalformedLog(path, line, "seq", f"{expect_seq} expected (events are numbered "
                           f"1, 2, ... without gaps), got {data['seq']}")
    hook = data["hook"]
    if hook not in HOOK_ARGS and hook not in LIFECYCLE_HOOKS and hook not in QUERY_HOOKS:
        raise MalformedLog(path, line, "hook", f"{hook!r} is not a scheduler-side hook")
    missing = [a for a in HOOK_ARGS.get(hook, ()) if a not in data["args"]]
    if missing:
        raise MalformedLog(path, line, f"args.{missing[0]}", f"missing (hook {hook})")
    try:
        delta = Delta.from_json(data["delta"])
    except ValueError as exc:
        text = str(exc)
        name, _, reason = text.partition(": ")
        raise MalformedLog(path, line, name, reason) from None
    findings = data.get("findings", [])
    if not isinstance(findings, list):
        raise MalformedLog(path, line, "findings", "a list expected")
    error = data.get("error")
    if error is not None and not isinstance(error, str):
        raise MalformedLog(path, line, "error", "a string expected")
    return Event(seq=data["seq"], step=data["step"], hook=hook, args=data["args"],
                 delta=delta, findings=findings, error=error, line=line)


class LogFollower:
    """Reads a log, also while its writer appends to it: `poll()` returns the events of the
    complete lines written since the last call (the header is read first, once it is
    there; a line still being written waits for its newline, so a character the writer's
    buffer split is decoded whole); `finish()`, once the writer is done, the event of a
    last line with no newline, or none if that line was cut short (`truncated`). The
    validation of the module docstring; `read_log` is a `poll()` and a `finish()`."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._file: IO[bytes] = Path(path).open("rb")  # noqa: SIM115 (held open)
        self._partial = b""
        self._line = 0
        self.header: Header | None = None
        self.events = 0
        self.truncated: int | None = None
        """The line number of a last line cut short (`finish`), or None."""

    def poll(self) -> list[Event]:
        chunk = self._file.read()
        if not chunk:
            return []
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        out: list[Event] = []
        for raw in lines:
            self._read(raw, out)
        return out

    def finish(self) -> list[Event]:
        """What `poll` left: the last line, which has no newline. A line that is not JSON
        there is reported as `truncated` (the writer died in the middle of it), not
        refused, once the header was read."""
        out = self.poll()
        raw, self._partial = self._partial, b""
        self._read(raw, out, last=True)
        return out

    def _read(self, raw: bytes, out: list[Event], last: bool = False) -> None:
        self._line += 1
        if not raw.strip():
            return
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if last and self.header is not None:
                self.truncated = self._line  # the writer died in the middle of it
                return
            why = (f"not UTF-8: {exc.reason}" if isinstance(exc, UnicodeDecodeError) else
                   f"not JSON: {exc.msg} at column {exc.colno}")
            raise MalformedLog(self.path, self._line, "(line)", why) from None
        if self.header is None:
            self.header = _header(self.path, self._line, data)
        else:
            self.events += 1
            out.append(_event(self.path, self._line, data, self.events))

    def close(self) -> None:
        self._file.close()


def read_log(path: str | Path) -> Log:
    """The whole log, validated (see the module docstring for what is refused)."""
    follower = LogFollower(path)
    try:
        events = follower.poll()
        events += follower.finish()
    finally:
        follower.close()
    if follower.header is None:
        raise MalformedLog(follower.path, 1, "schema", "empty log: no header line")
    return Log(path=follower.path, header=follower.header, events=events,
               truncated=follower.truncated)


__all__ = ["HOOK_ARGS", "RECORDS", "SCALARS", "SCHEMA", "SCHEMA_VERSION", "Delta", "Event",
           "Header", "Log", "LogError", "LogFollower", "LogWriter", "MalformedLog",
           "SchemaVersionMismatch",
           "read_log", "record_fields", "record_from_json", "record_json"]
