"""The fleet: enrollment, node credentials, heartbeats and liveness, readiness, protocol
compatibility, what agents report, and the Enroll node wizard's setup and start script."""
