"""The records of a job's stream, one JSON object per line, each with its `kind`:

- from job code to the runtime worker (its events pipe): `event`, `output`, `result`, `error`;
- from the runtime worker to the node agent (the `POST /v1/jobs` answer): `event`, `log`,
  `output`, `tick`, and last `exit`, which carries the outcome.

Every value is strict JSON: `NaN` and `Infinity` are refused when a record is encoded and when
one is decoded (`RecordNotJson`), because the control plane could not store them faithfully.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from modelforge_contracts.text import clean_line, clean_text

RESULT_NOT_JSON = "JOB_RESULT_NOT_JSON"


class RecordError(ValueError):
    """A line is not a record of this stream."""


class RecordNotJson(RecordError):
    """A value cannot travel as strict JSON (NaN, Infinity, or not serialisable at all)."""


@dataclass(frozen=True)
class EventRecord:
    """A JSON event the job recorded (`emit`)."""

    kind: ClassVar[str] = "event"
    data: Any


@dataclass(frozen=True)
class LogRecord:
    """One line of the job's standard output or error, decoded as UTF-8 (bad bytes replaced),
    without its line ending."""

    kind: ClassVar[str] = "log"
    data: str


@dataclass(frozen=True)
class OutputRecord:
    """An artifact the job saved under a name: one of its outputs."""

    kind: ClassVar[str] = "output"
    name: str
    digest: str


@dataclass(frozen=True)
class ResultRecord:
    """The job's return value, written by the job host when the entrypoint returns; strict JSON,
    or the job fails with `JOB_RESULT_NOT_JSON` instead."""

    kind: ClassVar[str] = "result"
    value: Any


@dataclass(frozen=True)
class JobError:
    code: str
    message: str

    def as_json(self) -> dict[str, str]:
        """As reported: code and message cleaned of control and bidi characters (a job's
        traceback may carry ANSI colours), so the report is always one the control plane takes."""
        return {"code": clean_line(self.code), "message": clean_text(self.message)}


@dataclass(frozen=True)
class ErrorRecord:
    """The job's own failure, with a code (`JOB_EXCEPTION`, `JOB_RESULT_NOT_JSON`, ...);
    travels flat: `{"kind": "error", "code", "message"}`."""

    kind: ClassVar[str] = "error"
    error: JobError


@dataclass(frozen=True)
class TickRecord:
    """Nothing happened. The worker sends one at least every tick, so that it notices an agent
    that went away (the write fails) and kills the job's process group."""

    kind: ClassVar[str] = "tick"


@dataclass(frozen=True)
class ExitRecord:
    """The last record: the job's outcome."""

    kind: ClassVar[str] = "exit"
    state: Literal["succeeded", "failed"]
    result: Any = None
    outputs: dict[str, str] = field(default_factory=dict)
    error: JobError | None = None


Record = (
    EventRecord | LogRecord | OutputRecord | ResultRecord | ErrorRecord | TickRecord | ExitRecord
)


def job_error(code: str, message: str) -> ErrorRecord:
    """The job's own failure, as the job host reports it."""
    return ErrorRecord(JobError(code, message))


def failed(code: str, message: str) -> ExitRecord:
    """The `exit` record of a job that failed with `code`."""
    return ExitRecord(state="failed", error=JobError(code, message))


def succeeded(result: Any, outputs: dict[str, str]) -> ExitRecord:
    return ExitRecord(state="succeeded", result=result, outputs=dict(outputs))


def to_json(record: Record) -> dict[str, Any]:
    """The record as the JSON object that travels."""
    if isinstance(record, EventRecord | LogRecord):
        return {"kind": record.kind, "data": record.data}
    if isinstance(record, OutputRecord):
        return {"kind": record.kind, "name": record.name, "digest": record.digest}
    if isinstance(record, ResultRecord):
        return {"kind": record.kind, "value": record.value}
    if isinstance(record, ErrorRecord):
        return {"kind": record.kind, **record.error.as_json()}
    if isinstance(record, TickRecord):
        return {"kind": record.kind}
    body: dict[str, Any] = {"kind": record.kind, "state": record.state}
    if record.state == "succeeded":
        body["result"] = record.result
        body["outputs"] = dict(record.outputs)
    else:
        body["error"] = (record.error or JobError("JOB_FAILED", "")).as_json()
    return body


def dumps_strict(value: Any) -> str:
    """`value` as compact strict JSON; `RecordNotJson` for NaN, Infinity or other types."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise RecordNotJson(str(exc)) from None


def encode(record: Record) -> bytes:
    """One line of the stream; `RecordNotJson` when a value is not strict JSON."""
    return (dumps_strict(to_json(record)) + "\n").encode()


def _refuse_constant(name: str) -> Any:
    raise RecordNotJson(f"{name} is not a JSON value")


def loads_strict(text: str | bytes) -> Any:
    """Parse strict JSON: `RecordNotJson` for NaN/Infinity, `RecordError` for anything else."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except RecordNotJson:
        raise
    except (ValueError, RecursionError) as exc:
        raise RecordError(f"not JSON ({type(exc).__name__})") from None


def _text(data: dict[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str):
        raise RecordError(f"a {data.get('kind')} record needs a string {key!r}")
    return value


def from_json(data: Any) -> Record:
    """The typed record for a decoded JSON object; `RecordError` if it is not one."""
    if not isinstance(data, dict):
        raise RecordError("a record must be a JSON object")
    kind = data.get("kind")
    if kind == "event":
        return EventRecord(data.get("data"))
    if kind == "log":
        return LogRecord(str(data.get("data", "")))
    if kind == "output":
        return OutputRecord(_text(data, "name"), _text(data, "digest"))
    if kind == "result":
        return ResultRecord(data.get("value"))
    if kind == "error":
        return ErrorRecord(JobError(_text(data, "code"), str(data.get("message", ""))))
    if kind == "tick":
        return TickRecord()
    if kind == "exit":
        state = data.get("state")
        if state == "succeeded":
            outputs = data.get("outputs") or {}
            if not isinstance(outputs, dict):
                raise RecordError("an exit record's outputs must be an object")
            return succeeded(data.get("result"), {str(k): str(v) for k, v in outputs.items()})
        error = data.get("error")
        if not isinstance(error, dict):
            error = {}
        return failed(str(error.get("code") or "JOB_FAILED"), str(error.get("message", "")))
    raise RecordError(f"unknown record kind {kind!r}")


def decode(line: str | bytes) -> Record:
    """The record on one line of the stream."""
    return from_json(loads_strict(line))
