"""Provisioning (PV-1): node agents started on Slurm clusters over SSH when work waits for a
profile's labels and resources."""
