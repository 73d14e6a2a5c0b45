"""ModelForge runtime worker: executes workloads for its local node agent, and only for it.

It listens on a unix socket shared with the agent (never a network port), reports its version,
protocol and health, and runs each job the agent hands it in a process group of its own,
streaming the job's records back (`modelforge_contracts.job_records`). It must never accept work
from anything but that socket, and nothing a job started may outlive the job.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    WORKER_VERSION = version("modelforge")
except PackageNotFoundError:  # running from a source tree without an install
    WORKER_VERSION = "0.0.0+source"
