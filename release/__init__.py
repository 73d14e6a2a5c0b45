"""ModelForge's release tool, `modelforge-release` (release.cli): builds the three images without
a Docker daemon, writes the offline bundle (images tar, release manifest, SBOMs, SHA256SUMS),
signs it with cosign-compatible keys, verifies it offline, loads it into Docker and starts
Compose from the images it verified (docs/release.md).

It must never import the shipped parts (control plane, node agent, runtime worker; it reads their
files to build images, and imports only `modelforge_contracts`), nor take a secret on its
command line. Every failure it explains is a `release.errors.ReleaseError`.
"""
