"""The process a job runs in, leader of its own process group (WL-4). Reads the job spec from
stdin, runs the entrypoint, writes the outcome to the events pipe. Started by
`runtime_worker.execution`; never run by hand."""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

from runtime_worker.job import _write
from runtime_worker.runners import run_entrypoint


def main() -> int:
    spec: dict[str, Any] = json.load(sys.stdin)
    try:
        result = run_entrypoint(spec)
        json.dumps(result)
    except TypeError as exc:
        _write(
            {
                "kind": "error",
                "code": "JOB_RESULT_NOT_JSON",
                "message": f"the return value is not JSON-serialisable: {exc}",
            }
        )
        return 1
    except BaseException as exc:  # the job's own failure, reported, not raised
        tail = "".join(traceback.format_exception(exc)[-6:])
        _write(
            {
                "kind": "error",
                "code": "JOB_EXCEPTION",
                "message": f"{type(exc).__name__}: {exc}\n{tail}"[:4000],
            }
        )
        return 1
    _write({"kind": "result", "value": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
