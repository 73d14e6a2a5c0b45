"""Jobs: one run of code or of a model on a node, from submission to its end.

`lifecycle` is what users do (submit, get, list, cancel, delete, events, the public views);
`reports` is what agents report of the jobs they run (progress, outcomes, the cancellation
watch) and the contact sweep; `_changes` is how a job changes (its event log, how it ends);
`gpu_failures` fails the jobs running on a GPU that turned unhealthy (`GPU_FAILED`).
Placing a queued job on a node is the scheduler's (`control_plane.scheduling`), not this
package's. It imports only the floor, the domains below it (access, artifacts, vault,
catalog, fleet) and `scheduling.dispatch`; never `services`, `api` or the background loops.
"""
