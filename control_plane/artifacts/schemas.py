"""Request and response bodies of artifact lifetime (AR-3a): the artifact list with who names
each artifact, and the sweep with its report. Kept separate from the ORM tables; responses are
built from the service's dataclasses (`from_attributes`)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, StrictBool

from control_plane.schemas import StrictModel

_DIGEST = "sha256:" + "3f" * 32
_WHEN = "2026-12-01T10:00:00Z"


class ArtifactReference(BaseModel):
    """A setting that names the artifact: a model, a deployed service, a queued or running
    job. `name` is the model's `name@version` or the service's name; `state` the service's or
    job's state."""

    model_config = ConfigDict(from_attributes=True)

    kind: Literal["model", "service", "job"]
    id: str
    name: str | None
    state: str | None


class ArtifactListed(BaseModel):
    model_config = ConfigDict(
        from_attributes=True,
        json_schema_extra={
            "examples": [
                {
                    "digest": _DIGEST,
                    "size_bytes": 104857600,
                    "created_at": _WHEN,
                    "references": [
                        {"kind": "model", "id": "mdl_1", "name": "resnet@1", "state": None}
                    ],
                }
            ]
        },
    )

    digest: str
    size_bytes: int
    created_at: datetime
    references: list[ArtifactReference]


class ArtifactSweepRequest(StrictModel):
    """`POST /api/v1/admin/artifacts/sweep`. `dry_run` must be a JSON boolean: a dry run lists
    what would be deleted, and why each other artifact is kept, and changes nothing."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"dry_run": True}]})

    dry_run: StrictBool = False


class SweptArtifact(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    digest: str
    size_bytes: int
    created_at: datetime


class KeptArtifact(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    digest: str
    size_bytes: int
    reasons: list[str]


class RemovedFile(BaseModel):
    """A file in the store that no row describes (a crashed upload); `path` is relative to
    `<data dir>/artifacts`."""

    model_config = ConfigDict(from_attributes=True)

    path: str
    size_bytes: int
    modified_at: datetime


class ArtifactSweepReport(BaseModel):
    """What the sweep deleted (or, in a dry run, would delete) and why it kept the rest."""

    model_config = ConfigDict(
        from_attributes=True,
        json_schema_extra={
            "examples": [
                {
                    "dry_run": True,
                    "swept_at": _WHEN,
                    "grace_seconds": 86400.0,
                    "deleted": [{"digest": _DIGEST, "size_bytes": 1048576, "created_at": _WHEN}],
                    "kept": [
                        {
                            "digest": "sha256:" + "a0" * 32,
                            "size_bytes": 2048,
                            "reasons": [
                                "named by model resnet@1",
                                "named by service resnet-serve (svc_1)",
                                "named by queued job job_1",
                                "younger than the grace period (23 h 10 min left)",
                            ],
                        }
                    ],
                    "removed_files": [
                        {
                            "path": "tmp/upload-0123456789abcdef",
                            "size_bytes": 512,
                            "modified_at": _WHEN,
                        }
                    ],
                    "bytes_freed": 1049088,
                }
            ]
        },
    )

    dry_run: bool
    swept_at: datetime
    grace_seconds: float
    deleted: list[SweptArtifact]
    kept: list[KeptArtifact]
    removed_files: list[RemovedFile]
    bytes_freed: int


class ArtifactPublic(BaseModel):
    digest: str
    size_bytes: int
    created_at: datetime
