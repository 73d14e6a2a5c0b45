"""ModelForge control plane: the single source of truth for nodes, credentials and work.

It serves the admin API and the agent API over HTTP and never dials a node: agents connect
outward. It must never log, echo or return a secret (admin token, enrollment token, node
credential, signing key).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    RELEASE_VERSION = version("modelforge")
except PackageNotFoundError:  # running from a source tree without an install
    RELEASE_VERSION = "0.0.0+source"
