"""The provisioners' view for admins (`GET /api/v1/admin/provisioners`, PV-1a): each
provisioner's profiles, its recent requests and their latest events."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel


class ProfilePublic(BaseModel):
    name: str
    cpus: int
    gpus: int
    ram_mb: int
    labels: dict[str, str]
    sbatch: list[str]
    outstanding: int


class ProvisionEventPublic(BaseModel):
    at: datetime
    kind: str
    data: Any


class ProvisionRequestPublic(BaseModel):
    request_id: str
    profile: str
    state: str
    slurm_job_id: str | None
    node_id: str | None
    age_seconds: float
    created_at: datetime
    attached_at: datetime | None
    ended_at: datetime | None
    reason: str | None
    events: list[ProvisionEventPublic]


class ProvisionerPublic(BaseModel):
    name: str
    type: str
    login: str
    engine_url: str
    max_idle_s: float
    provision_timeout_s: float
    profiles: list[ProfilePublic]
    requests: list[ProvisionRequestPublic]
