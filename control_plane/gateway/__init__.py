"""The gateway (issue 27): one address for every model service. It owns how a request reaches a
replica: the agents' tunnels this process holds (`tunnels.py`: `TunnelHub`, one per process, on
`AppContext`), and the routing, the token checks and the gateway's metrics beside it.

It stands above `services` and `fleet` and below the transport: it never imports `api/` or
FastAPI, and never dials a node (every byte to a replica goes through the tunnel its agent
opened). It never queries the database per request.
"""
