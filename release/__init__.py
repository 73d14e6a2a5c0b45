"""ModelForge release tooling: images, offline bundle, checksums and cosign-compatible signatures.

(Built by the release issue; this package holds nothing executable yet.)
"""
