"""The scheduler's value types (SC-1, SC-5): what a job asks for (`Request`), what a node has
left (`Capacity`, GPUs as the exact set of free ones), what decides where a job may run
(`Shape`) and label matching.

The bottom of the scheduling domain: any domain may import it (a service's placement reads the
same shapes and capacities), and it imports nothing but the standard library. No queries here.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    inventory's GPUs no running job holds. `gpus` are those work may be handed: healthy ones
    first, then degraded ones (picked last), each by index. `blocked` are the free GPUs out of
    the schedule (unhealthy, quarantined: issue 28): never handed out, except the one a job is
    pinned to (the GPU's active check)."""

    cpus: float
    gpus: tuple[dict[str, Any], ...]
    memory_mb: int
    blocked: tuple[dict[str, Any], ...] = ()

    @classmethod
    def of_inventory(
        cls, inventory: dict[str, Any], health: Mapping[str, str] | None = None
    ) -> Capacity:
        """`health`: the node's GPUs that are not healthy, by UUID (`fleet.gpu_health.
        out_of_schedule`). A state other than `degraded` keeps the GPU out of the schedule: a
        state this module does not know is never placed on."""
        gpus = _inventory_gpus(inventory)
        if health:
            usable = [gpu for gpu in gpus if health.get(gpu["uuid"], _HEALTHY) in _PLACED_ON]
            usable.sort(key=lambda gpu: (health.get(gpu["uuid"]) == _DEGRADED, gpu["index"]))
            blocked = tuple(gpu for gpu in gpus if gpu not in usable)
            gpus = tuple(usable)
        else:
            blocked = ()
        return cls(
            float(inventory.get("cpu_count", 0)), gpus, int(inventory.get("memory_mb", 0)), blocked
        )

    def counting_blocked(self) -> Capacity:
        """This capacity were its GPUs out of the schedule back in it: the node's size, for
        'is it big enough at all' (health changes by the second; the batch judges it)."""
        if not self.blocked:
            return self
        gpus = tuple(sorted(self.gpus + self.blocked, key=lambda gpu: gpu["index"]))
        return Capacity(self.cpus, gpus, self.memory_mb)

    def fits(self, request: Request, pinned: str | None = None) -> bool:
        """Whether `request` fits; `pinned` (a GPU's UUID): a job pinned to that GPU, which
        fits when the GPU is free, in the schedule or not, whatever its GPU count."""
        if pinned is None:
            return (
                request.cpus <= self.cpus + 1e-9
                and request.gpus <= len(self.gpus)
                and request.memory_mb <= self.memory_mb
            )
        return (
            request.cpus <= self.cpus + 1e-9
            and request.memory_mb <= self.memory_mb
            and any(gpu["uuid"] == pinned for gpu in self.gpus + self.blocked)
        )

    def pick_gpus(self, request: Request, pinned: str | None = None) -> list[dict[str, Any]]:
        """The GPUs a job with `request` is handed: the first free ones (healthy before
        degraded, by index); for a job pinned to a GPU, exactly that one."""
        if pinned is not None:
            return [dict(gpu) for gpu in self.gpus + self.blocked if gpu["uuid"] == pinned]
        return [dict(gpu) for gpu in self.gpus[: request.gpus]]

    def minus(self, request: Request, held_gpus: list[Any] | None) -> Capacity:
        held = {gpu.get("uuid") for gpu in held_gpus or []}
        gpus = tuple(gpu for gpu in self.gpus if gpu["uuid"] not in held)
        blocked = self.blocked
        if blocked:
            blocked = tuple(gpu for gpu in blocked if gpu["uuid"] not in held)
        if held_gpus is None:
            # A job running from before GPUs were assigned: it holds as many as it asked for,
            # which ones unknown; count them off the end so the total stays right.
            gpus = gpus[: max(0, len(gpus) - request.gpus)]
        return Capacity(self.cpus - request.cpus, gpus, self.memory_mb - request.memory_mb, blocked)


_HEALTHY, _DEGRADED = "healthy", "degraded"
#: The GPU states work is placed on; every other one is out of the schedule.
_PLACED_ON = frozenset({_HEALTHY, _DEGRADED})


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
    #: `(node id, GPU UUID)` of a job pinned to one GPU (`Job.pinned`: a GPU's active check):
    #: it runs on that node only, handed exactly that GPU, even one out of the schedule.
    pinned: tuple[str, str] | None = None

    @classmethod
    def of(
        cls,
        labels: dict[str, Any],
        worker_policy: str,
        resources: dict[str, Any],
        required: dict[str, Any] | None = None,
        pinned: dict[str, Any] | None = None,
    ) -> Shape:
        return cls(
            _label_items(labels),
            worker_policy == "prefer",
            Request.of(resources),
            _label_items(required or {}),
            (str(pinned["node_id"]), str(pinned["uuid"])) if pinned else None,
        )

    @property
    def pinned_gpu(self) -> str | None:
        """The UUID of the GPU it is pinned to, if any."""
        return self.pinned[1] if self.pinned else None

    def label_text(self) -> str:
        return ", ".join(f"{key}={value}" for key, value in self.labels)

    def admits(self, carried: dict[str, Any], node_id: str | None = None) -> bool:
        """Whether node `node_id`, carrying `carried`, may run it at all: its secrets' labels,
        and for a pinned job, its node (a node not named, such as one yet to be provisioned,
        never may)."""
        if self.pinned is not None and self.pinned[0] != node_id:
            return False
        return labels_match(self.required, carried)

    def fits(self, capacity: Capacity) -> bool:
        """Whether its job fits `capacity` (a pinned job: its GPU is free there)."""
        return capacity.fits(self.request, self.pinned[1] if self.pinned else None)


def _label_items(labels: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in labels.items()))
