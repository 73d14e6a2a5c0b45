"""Scheduling: which node runs which queued job, and the agents' claims for work.

`scheduler` is the per-process scheduler (waiting claims, batches); `queue` the queued jobs by
shape; `placement` the matcher and one batch's transaction; `waiting` and `fleet_view` why a job
waits; `resources` the resources view (what each node has, holds and could take); `claims` a
claim's rules from arrival to answer; `completions` the agents' outcomes, committed in groups;
`dispatch` the wake-ups across replicas; `shapes` the value types; `gpu_health` an agent's GPU
health report applied (recorded by the fleet, the jobs and services on a failed GPU stopped).

`shapes` and `dispatch` import only the floor, and any domain may import them. The rest may
import the floor and the domains below (access, artifacts, vault, catalog, fleet, jobs,
services); never `provisioning`, `api`, the background loops or the app's composition.
"""
