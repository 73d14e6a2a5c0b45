"""The scheduler's value types (SC-1, SC-5): what a job asks for (`Request`), what a node has
left (`Capacity`, GPUs as the exact set of free ones), what decides where a job may run
(`Shape`) and label matching.

The bottom of the scheduling domain: any domain may import it (a service's placement reads the
same shapes and capacities), and it imports nothing but the standard library. No queries here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


class Request(NamedTuple):
    cpus: float
    gpus: int
    memory_mb: int

    @classmethod
    def of(cls, resources: dict[str, Any]) -> Request:
        return cls(
            float(resources.get("cpus", 0)),
            int(resources.get("gpus", 0)),
            int(resources.get("memory_mb", 0)),
        )


@dataclass(frozen=True)
class Capacity:
    """What a node has left: cpus and memory by arithmetic, GPUs as the exact set of its
    inventory's GPUs no running job holds, in index order."""

    cpus: float
    gpus: tuple[dict[str, Any], ...]
    memory_mb: int

    @classmethod
    def of_inventory(cls, inventory: dict[str, Any]) -> Capacity:
        return cls(
            float(inventory.get("cpu_count", 0)),
            _inventory_gpus(inventory),
            int(inventory.get("memory_mb", 0)),
        )

    def fits(self, request: Request) -> bool:
        return (
            request.cpus <= self.cpus + 1e-9
            and request.gpus <= len(self.gpus)
            and request.memory_mb <= self.memory_mb
        )

    def pick_gpus(self, request: Request) -> list[dict[str, Any]]:
        """The GPUs a job with `request` is handed: the free ones with the lowest indexes."""
        return [dict(gpu) for gpu in self.gpus[: request.gpus]]

    def minus(self, request: Request, held_gpus: list[Any] | None) -> Capacity:
        held = {gpu.get("uuid") for gpu in held_gpus or []}
        gpus = tuple(gpu for gpu in self.gpus if gpu["uuid"] not in held)
        if held_gpus is None:
            # A job running from before GPUs were assigned: it holds as many as it asked for,
            # which ones unknown; count them off the end so the total stays right.
            gpus = gpus[: max(0, len(gpus) - request.gpus)]
        return Capacity(self.cpus - request.cpus, gpus, self.memory_mb - request.memory_mb)


def labels_match(
    wanted: dict[str, str] | tuple[tuple[str, str], ...], carried: dict[str, Any]
) -> bool:
    items = wanted.items() if isinstance(wanted, dict) else wanted
    return all(carried.get(key) == value for key, value in items)


def _inventory_gpus(inventory: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    gpus = [
        {"index": int(gpu["index"]), "uuid": str(gpu["uuid"])}
        for gpu in inventory.get("gpus") or []
        if isinstance(gpu, dict) and "index" in gpu and gpu.get("uuid")
    ]
    return tuple(sorted(gpus, key=lambda gpu: gpu["index"]))


@dataclass(frozen=True)
class Shape:
    """What decides where a job may run; jobs of one shape are interchangeable to the matcher."""

    labels: tuple[tuple[str, str], ...]
    prefer: bool
    request: Request
    #: Labels a node must carry whatever the policy: those of the job's secrets (WL-6a).
    required: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(
        cls,
        labels: dict[str, Any],
        worker_policy: str,
        resources: dict[str, Any],
        required: dict[str, Any] | None = None,
    ) -> Shape:
        return cls(
            _label_items(labels),
            worker_policy == "prefer",
            Request.of(resources),
            _label_items(required or {}),
        )

    def label_text(self) -> str:
        return ", ".join(f"{key}={value}" for key, value in self.labels)

    def admits(self, carried: dict[str, Any]) -> bool:
        """Whether a node carrying `carried` may run it at all (its secrets' labels)."""
        return labels_match(self.required, carried)


def _label_items(labels: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in labels.items()))
