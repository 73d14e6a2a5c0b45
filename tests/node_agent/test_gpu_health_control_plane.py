"""The whole way of a GPU fault: a real agent on the substitute NVML's two GPUs, a real control
plane process. XID 79 on GPU 1 shows at the control plane within 2 s (GPU 0 stays healthy); a
reset after the GPU was lost makes the agent report it healthy again, and the control plane
keeps it unhealthy (sticky) with the agent's report beside it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.e2e.node import live_stack, wait_until
from tests.nvml_substitute import CONTROL_ENV, EXPECTED_GPUS, FaultInjector

GPU0, GPU1 = (gpu["uuid"] for gpu in EXPECTED_GPUS)
FAST = {
    "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_LIVENESS_SWEEP_INTERVAL_SECONDS": "0.2",
}


def test_xid_79_reaches_the_control_plane_and_stays_unhealthy_after_a_reset(
    fake_nvml_dir: Path, tmp_path: Path
) -> None:
    control = tmp_path / "nvml-control"
    control.touch()
    faults = FaultInjector(control)
    extra = {CONTROL_ENV: str(control), "MODELFORGE_AGENT_GPU_HEALTH_POLL_SECONDS": "0.2"}
    with live_stack(tmp_path, FAST, mode="nvidia", nvml_dir=fake_nvml_dir, extra_env=extra) as (
        server,
        node,
    ):
        node_id = node.start_agent().node_id()

        def gpus() -> dict[str, dict[str, Any]]:
            return {g["uuid"]: g for g in server.get(f"/api/v1/admin/nodes/{node_id}/gpus")}

        # XIDs reach only event sets registered before them: wait for the watch.
        wait_until(lambda: "GPU health watch: watching 2 GPU(s)" in node.log(), 30, "the watch")
        wait_until(lambda: len(gpus()) == 2, 30, "the inventory's GPUs")
        injected = time.monotonic()
        faults.xid(1, 79)
        wait_until(lambda: gpus()[GPU1]["state"] == "unhealthy", 10, "GPU 1 unhealthy", 0.05)
        took = time.monotonic() - injected
        assert took < 2.0, f"GPU 1 unhealthy at the control plane {took:.2f} s after the XID"
        view = gpus()
        assert view[GPU0]["state"] == "healthy"
        assert view[GPU1]["reported"] == "unhealthy"
        assert view[GPU1]["reason"] == "XID 79 (GPU has fallen off the bus)"
        assert [(e["kind"], e.get("xid")) for e in view[GPU1]["evidence"]] == [("xid", 79)]

        faults.lose(1)
        wait_until(
            lambda: "lost" in {e["kind"] for e in gpus()[GPU1]["evidence"]}, 15, "GPU 1 lost"
        )
        faults.reset(1)  # the lost GPU answers again: the agent sees it was reset
        wait_until(lambda: gpus()[GPU1]["reported"] == "healthy", 15, "GPU 1 reported clean")
        view = gpus()
        assert view[GPU1]["state"] == "unhealthy"
        assert view[GPU1]["rules_state"] == "unhealthy"
        assert view[GPU0]["state"] == "healthy"
