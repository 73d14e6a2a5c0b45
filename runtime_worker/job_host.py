"""The process a job runs in, leader of its own process group. Reads the job spec from stdin,
runs the entrypoint, writes the outcome to the events pipe as a strict JSON record: a return
value (or an event the job let fail) that is not strict JSON fails the job with
`JOB_RESULT_NOT_JSON`. Started by the job's supervisor (`runtime_worker.supervisor`); never run
by hand."""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

from modelforge_contracts.job_records import (
    RESULT_NOT_JSON,
    RecordNotJson,
    ResultRecord,
    encode,
    job_error,
)
from runtime_worker.job import write_line, write_record
from runtime_worker.runners import run_entrypoint


def _tail(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)[-6:])


def main() -> int:
    spec: dict[str, Any] = json.load(sys.stdin)
    try:
        result = run_entrypoint(spec)
    except RecordNotJson as exc:  # emit() refused an event and the job did not catch it
        write_record(job_error(RESULT_NOT_JSON, f"{exc}\n{_tail(exc)}"[:4000]))
        return 1
    except BaseException as exc:  # the job's own failure, reported, not raised
        message = f"{type(exc).__name__}: {exc}\n{_tail(exc)}"[:4000]
        write_record(job_error("JOB_EXCEPTION", message))
        return 1
    try:
        line = encode(ResultRecord(result))
    except RecordNotJson as exc:
        message = f"the return value is not strict JSON (NaN, Infinity or not serialisable): {exc}"
        write_record(job_error(RESULT_NOT_JSON, message))
        return 1
    write_line(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
