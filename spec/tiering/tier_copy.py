"""The lifecycle of one chunk key in one secondary tier (the filesystem tier TF:86-353 with
its I/O TIO:90-226; the in-memory example tier TEX).

A secondary tier holds copies of CPU-tier chunks: a cascade writes one (CPU -> tier), a
promotion reads one (tier -> CPU). In the filesystem tier a copy is a file named by the key's
hash; a write goes to a temporary name and is renamed into place, so a lookup never sees a
half-written copy, even after the process is killed mid-write (TIO:97-138).
"""

from __future__ import annotations

from spec.schema import (
    BEYOND_VLLM,
    SAME,
    Effect,
    Guard,
    MachineSpec,
    Path,
    State,
    StateGroup,
    Transition,
)

ABSENT = "ABSENT"
WRITING = "WRITING"
STORED = "STORED"
READING = "READING"

STATES = (
    State(ABSENT, "the tier holds no copy of the key", "fs: no file at "
          "file_mapper.get_file_name(key)"),
    State(WRITING, "a cascade writes the copy; lookups do not see it yet",
          "fs: a store task of the pool writes <name>_<suffix>.tmp"),
    State(STORED, "a complete copy: lookups hit it", "fs: the file exists (renamed into place)"),
    State(READING, "a complete copy that a promotion reads", "fs: a load task of the pool "
          "reads the file"),
)

VISIBLE = StateGroup("visible", "a lookup of the tier hits it (TF:215-220)", (STORED, READING))
GROUPS = (VISIBLE,)

GUARDS = (
    Guard("tier_full", "the tier holds its capacity of copies (beyond vLLM: a full disk; "
          "vLLM's filesystem tier never deletes a copy)"),
)

EFFECTS = (
    Effect("write_temporary", "write the CPU slot's bytes to a temporary name (TIO:102-123)"),
    Effect("rename_into_place", "atomically publish the copy (TIO:124-132)"),
    Effect("remove_temporary", "delete the temporary file (TIO:133-138)"),
    Effect("read_into_slot", "copy the file into the CPU slot (TIO:141-171)"),
    Effect("drop_copy", "delete the short file (TIO:158-168)"),
)

_META = "build_connector_meta"
_LOOKUP = "get_num_new_matched_tokens"

TRANSITIONS = (
    Transition("write_started", (ABSENT,), WRITING, _META, "TF:222-236",
               unless=("tier_full",), effects=("write_temporary",),
               note="submit_store of a cascade; the copy takes one unit of the capacity"),
    Transition("write_refused", (ABSENT,), SAME, _META, BEYOND_VLLM,
               requires=("tier_full",), path=Path.FAILURE,
               note="the tier is full (ENOSPC): the cascade job will report a failure"),
    Transition("write_started", (WRITING, STORED, READING), SAME, _META, "TIO:98-100, "
               "TIO:124-132", note="a copy exists or is being written: content-addressed, the "
               "first rename wins and the store is done"),
    Transition("write_landed", (WRITING,), STORED, "tier I/O", "TIO:124-125, TP:162-194",
               effects=("rename_into_place",)),
    Transition("write_failed", (WRITING,), ABSENT, "tier I/O", "TIO:133-138",
               effects=("remove_temporary",), path=Path.FAILURE,
               note="an I/O error: the temporary file is removed, nothing is published"),
    Transition("crashed", (WRITING,), ABSENT, "kill -9", "TIO:102-125",
               effects=("remove_temporary",), path=Path.FAILURE,
               note="the process died mid-write: the temporary file is never published, and "
               "a new process ignores it"),
    Transition("read_started", (STORED,), READING, _META, "TF:238-276",
               effects=("read_into_slot",), note="submit_load of a promotion (a second "
               "lookup of the key finds it promoting in the CPU tier and defers, so one "
               "promotion reads a copy at a time)"),
    Transition("read_ended", (READING,), STORED, "tier I/O", "TF:249-276, TP:162-194",
               note="the promotion's I/O finished (or failed with the file left in place, "
               "TIO:148-150)"),
    Transition("short_read", (READING,), ABSENT, "tier I/O", "TIO:155-168",
               effects=("drop_copy",), path=Path.FAILURE,
               note="the file is shorter than a block: it is removed, the promotion fails"),
)

TIER_COPY_MACHINE = MachineSpec(
    name="tier_copy",
    title="A chunk key in a secondary tier",
    subject="(tier, chunk key)",
    states=STATES,
    transitions=TRANSITIONS,
    initial=ABSENT,
    finals=(),
    guards=GUARDS,
    effects=EFFECTS,
    groups=GROUPS,
    ignored=(
        ("a temporary file left by a killed process",
         "never looked up (its name is not a key's name); removed when the tier opens"),
    ),
)
