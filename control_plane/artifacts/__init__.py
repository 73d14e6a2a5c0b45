"""Artifacts: the content-addressed store, who names each artifact, and the sweep with its trash."""
