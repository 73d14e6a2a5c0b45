"""The scheduler's request and response bodies: an agent's work claim and the job assigned to
it, and the queued work a node could run."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from control_plane.fleet.schemas import AssignedGpu
from control_plane.schemas import StrictModel


class QueuedWork(BaseModel):
    """A queued job or pending service a node could run (the console's node details)."""

    kind: Literal["job", "service"]
    id: str
    name: str
    created_at: datetime
    labels: dict[str, Any]


class WorkClaim(StrictModel):
    hold_seconds: Annotated[float, Field(ge=0, le=60)] = 25.0


class JobAssignment(BaseModel):
    job_id: str
    entrypoint: dict[str, Any]
    params: dict[str, Any]
    inputs: dict[str, str]
    resources: dict[str, Any]
    #: Exactly the GPUs the job may see; empty for `gpus: 0`.
    assigned_gpus: list[AssignedGpu]
    timeout_seconds: float
    silence_timeout_seconds: float
    progress_interval_seconds: float
    #: The job's secrets by name (WL-6a): for its process's environment only.
    secrets: dict[str, str] = Field(default_factory=dict)
