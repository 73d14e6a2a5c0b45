"""ModelForge runtime worker: executes workloads for its local node agent, and only for it.

It listens on a unix socket shared with the agent (never a network port) and reports its
version, protocol and health. It must never accept work from anything but that socket. Workload
execution arrives with the jobs issue; until then the worker reports itself and does nothing else.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    WORKER_VERSION = version("modelforge")
except PackageNotFoundError:  # running from a source tree without an install
    WORKER_VERSION = "0.0.0+source"

#: The protocol this worker speaks with its agent, judged by the control plane (CO-1).
PROTOCOL_VERSION = 1
