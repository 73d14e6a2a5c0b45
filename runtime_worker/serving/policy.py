"""The serving options of a deployed `onnx` service, checked: `batching` (Triton's dynamic
batcher's fields) and `instances`. The runtime worker checks a service's with these before it
starts the server, and the server parses its `--batching` flag with them, so both refuse alike.
Plain Python: no numpy, no onnxruntime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The most a field may be: far beyond sensible, small enough to never overflow anything.
MAX_BATCH_SIZE = 1 << 20
MAX_QUEUE_DELAY_MICROSECONDS = 60_000_000  # a minute
MAX_QUEUE_SIZE = 1 << 20
MAX_INSTANCES = 64


class InvalidServing(ValueError):
    """A serving option the server cannot take; the message names the field and the range."""


@dataclass(frozen=True)
class BatchingPolicy:
    """Triton's dynamic batcher per model (runtime_worker.serving.batcher); 0 is off."""

    max_batch_size: int = 0
    preferred_batch_size: tuple[int, ...] = ()
    max_queue_delay_microseconds: int = 0
    max_queue_size: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "max_batch_size": self.max_batch_size,
            "preferred_batch_size": list(self.preferred_batch_size),
            "max_queue_delay_microseconds": self.max_queue_delay_microseconds,
            "max_queue_size": self.max_queue_size,
        }


def _count(section: dict[str, Any], key: str, low: int, high: int) -> int:
    value = section.get(key, 0)
    if type(value) is not int or not low <= value <= high:
        raise InvalidServing(f"batching.{key} must be a whole number from {low} to {high}")
    return value


def batching_policy(value: Any) -> BatchingPolicy:
    """`batching` as a service gives it (an object, or null for off)."""
    if value is None:
        return BatchingPolicy()
    if not isinstance(value, dict):
        raise InvalidServing("batching must be an object (max_batch_size, ...) or null")
    known = set(BatchingPolicy.__dataclass_fields__)
    if unknown := sorted(str(key)[:40] for key in value if key not in known):
        raise InvalidServing(f"batching has unknown fields {unknown}; it takes {sorted(known)}")
    most = _count(value, "max_batch_size", 0, MAX_BATCH_SIZE)
    preferred = value.get("preferred_batch_size") or []
    if not isinstance(preferred, list) or not all(
        type(size) is int and 1 <= size <= most for size in preferred
    ):
        raise InvalidServing(
            "batching.preferred_batch_size must be a list of batch sizes from 1 to max_batch_size"
        )
    if preferred and most == 0:
        raise InvalidServing("batching.preferred_batch_size needs max_batch_size")
    return BatchingPolicy(
        max_batch_size=most,
        preferred_batch_size=tuple(sorted(set(preferred))),
        max_queue_delay_microseconds=_count(
            value, "max_queue_delay_microseconds", 0, MAX_QUEUE_DELAY_MICROSECONDS
        ),
        max_queue_size=_count(value, "max_queue_size", 0, MAX_QUEUE_SIZE),
    )


def instance_count(value: Any) -> int | None:
    """`instances` as a service gives it (null: one per GPU it holds, one on the CPU)."""
    if value is None:
        return None
    if type(value) is not int or not 1 <= value <= MAX_INSTANCES:
        raise InvalidServing(f"instances must be a whole number from 1 to {MAX_INSTANCES}")
    return value
