"""The spec where vLLM runs: a monitored connector, its event log, and the log's replay.

- `log`: the event log's schema (JSON lines, versioned), its writer and its reader;
- `checker`: `SpecMonitor`, which checks events one at a time (moves against the tables,
  invariants, progress) and keeps the trace; the same for a live engine and a replay;
- `live`: the projection of a running vLLM connector after each hook (no vLLM import);
- `connector`: `MonitoredOffloadingConnector`, the subclass of vLLM's `OffloadingConnector`
  an engine loads through `kv_connector_module_path` (imports vLLM);
- `replay`: `kvspec replay LOG`.
"""

from __future__ import annotations

__all__ = ["checker", "connector", "live", "log", "replay"]
