"""ModelForge runtime worker: executes workloads for its local node agent only, never the network.

(Built by the node agent and jobs issues; this package holds nothing executable yet.)
"""
