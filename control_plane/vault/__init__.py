"""Secrets (WL-6a): write-only values, encrypted at rest, delivered only where allowed."""
