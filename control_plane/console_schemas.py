"""Request and response bodies of the console's own endpoints: sign-in, GPU telemetry history
and the Enroll node wizard's generated node setup."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, SecretStr, StringConstraints

from control_plane.schemas import StrictModel, Text


class SignInRequest(StrictModel):
    # SecretStr: a validation error or a repr() never shows it.
    admin_token: Annotated[SecretStr, StringConstraints(min_length=1, max_length=512)]


class ConsoleSessionInfo(BaseModel):
    """Held by the console in memory only; the session itself is the HttpOnly cookie."""

    csrf_token: str
    expires_at: datetime


class GpuPoint(BaseModel):
    index: int
    uuid: str
    utilization_percent: float | None
    memory_used_mb: float | None
    memory_total_mb: float | None
    #: Where the GPU reports them (NVML may not, for a given board).
    temperature_c: float | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None


class TelemetryPoint(BaseModel):
    at: datetime
    cpu_percent: float | None
    gpus: list[GpuPoint]


class NodeImageRequest(StrictModel):
    image_source: Literal["bundle", "registry"] = "bundle"
    #: Bundle mode: the pasted `images.modelforge-node-agent` entry of the release manifest.
    manifest_entry: Annotated[Text, StringConstraints(max_length=65536)] | None = None
    #: Registry mode: an image reference pinned by digest, `name@sha256:<64 hex>`.
    registry_image: Annotated[str, StringConstraints(max_length=400)] | None = None


class NodeImage(BaseModel):
    image: str
    #: What the pasted entry was checked against: the configured release manifest, or only
    #: what this control plane knows of its own release.
    checked_against: str


class NodeSetupRequest(NodeImageRequest):
    #: The console's own origin; the node agent is pointed at exactly this.
    api_origin: Annotated[str, StringConstraints(min_length=1, max_length=300)]
    accelerator_mode: Literal["nvidia", "cpu"] = "nvidia"


class NodeSetup(NodeImage):
    enrollment_id: str
    node_id: str
    env_file: str
    start_command: str
    recreate_command: str
