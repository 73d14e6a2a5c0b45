"""ModelForge node agent: outbound-only. It runs the NVIDIA preflight, enrolls once with a
single-use token, then reports heartbeats, inventory and telemetry to the control plane and
claims work for its runtime worker, all through one client (`node_agent.client`).

It must never open an inbound port, write its credential or enrollment token to a log or a
process argument, or send an empty inventory or fabricated telemetry.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    AGENT_VERSION = version("modelforge")
except PackageNotFoundError:  # running from a source tree without an install
    AGENT_VERSION = "0.0.0+source"
