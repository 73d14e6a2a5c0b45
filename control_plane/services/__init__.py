"""Model services (WL-5a): long-running model servers, deployed until undeployed.

`lifecycle` is what users do (deploy, get, list, restart, undeploy, events, the public views);
`replicas` is a service's running copies (each placed, synced and summarised on its own);
`placement` gives pending replicas a node and says why a service waits; `sync` is the agents'
services sync; `_changes` is a service's event log; `gpu_failures` puts the services on a GPU
that turned unhealthy back to `pending`; `access_tokens` mints, lists, revokes and verifies
the gateway's access tokens. Its functions take a session and keyword
arguments and raise `ModelForgeError`. It imports only the floor, the domains below it (access,
artifacts, vault, catalog, fleet) and scheduling's low modules; what the scheduler knows is
passed in. It never imports `jobs`, FastAPI, `api` or the background loops, and never makes a
network call inside a transaction.
"""
