"""What the agent says of its services while the runtime worker is lost (node_agent.services).

The services die with their worker (their supervisors are told by the kernel), so while it does
not answer each service the control plane wants here is reported `failed`, without a port, with
one `RUNTIME_WORKER_LOST` error event per loss, and its last known restarts, exit and output.
When a new worker answers, the agent starts them again there; each counts that as a restart, on
top of the restarts it had under the worker before (a worker counts only its own).

It holds no secret: only what the sync reports anyway.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

WORKER_LOST = "RUNTIME_WORKER_LOST"


class ServicesDown:
    def __init__(self, worker_socket: Path) -> None:
        self._socket = worker_socket
        #: The services the control plane wants on this node: id -> generation.
        self._wanted: dict[str, Any] = {}
        #: Id -> the last status reported from the worker (restarts counted in full).
        self._last: dict[str, dict[str, Any]] = {}
        #: Id -> the restarts counted under earlier workers.
        self._base: dict[str, int] = {}
        #: The worker process whose statuses are counted now.
        self._instance: str | None = None
        #: Id -> when this loss was first reported for it, and whether its event was delivered.
        self._down: dict[str, dict[str, Any]] = {}

    def want(self, desired: list[Any]) -> None:
        """The control plane's answer: these services, at these generations, are this node's."""
        self._wanted = {
            spec["service_id"]: spec.get("generation")
            for spec in desired
            if isinstance(spec, dict) and isinstance(spec.get("service_id"), str)
        }
        for table in (self._last, self._base, self._down):
            for service_id in [key for key in table if key not in self._wanted]:
                del table[service_id]

    def worker_answers(self, instance: Any) -> None:
        """The worker answered (as process `instance`): a loss is over, and a new process
        restarted every service the one before it ran."""
        self._down.clear()
        if instance == self._instance:
            return
        if self._instance is not None:
            for service_id, last in self._last.items():
                self._base[service_id] = int(last.get("restarts") or 0) + 1
        self._instance = instance

    def counted(self, service_id: str, entry: dict[str, Any]) -> dict[str, Any]:
        """A status the worker reported, its restarts counting those under earlier workers."""
        entry["restarts"] = self._base.get(service_id, 0) + int(entry.get("restarts") or 0)
        self._last[service_id] = dict(entry, events=[])
        return entry

    def entries(self) -> dict[str, dict[str, Any]]:
        """While the worker is lost: each wanted service down, with its event once per loss."""
        entries = {}
        for service_id, generation in self._wanted.items():
            down = self._down.setdefault(
                service_id, {"at": datetime.now(UTC).isoformat(), "reported": False}
            )
            last = self._last.get(service_id, {})
            events = []
            if not down["reported"]:
                message = (
                    f"the runtime worker at {self._socket} stopped answering: the service is "
                    "down with it, and starts again when a worker answers"
                )
                events.append(
                    {
                        "at": down["at"],
                        "kind": "error",
                        "data": {"code": WORKER_LOST, "message": message},
                    }
                )
            entries[service_id] = {
                "service_id": service_id,
                "generation": generation,
                "state": "failed",
                "port": None,
                "restarts": int(last.get("restarts") or 0),
                "last_exit": last.get("last_exit"),
                "log_tail": list(last.get("log_tail") or []),
                "events": events,
            }
        return entries

    def delivered(self, service_ids: list[str]) -> None:
        """The control plane took the loss events of these services."""
        for service_id in service_ids:
            if service_id in self._down:
                self._down[service_id]["reported"] = True
