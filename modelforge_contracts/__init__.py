"""The contracts between ModelForge's separately shipped parts: the floor of the house.

The control plane, the node agent, the runtime worker and the release tool may all import this
package; it imports none of them (a test enforces the direction). What lives here is what two or
more parts must agree on byte for byte:

- `protocol`: the agent protocol version and the range a control plane accepts.
- `digests`: what a content digest looks like (artifacts, image configs and layers).
- `errors`: the error body every HTTP refusal carries, and its one builder.
- `release_manifest`: the release manifest and the image facts compared against it.
- `json_trees`: how deep a parsed JSON document nests, and whether its numbers are finite.
- `job_records`: the records a job's stream carries between runtime worker and node agent.
- `files`: the owner-only atomic file writer for secrets and state.
- `settings_errors`: one readable line per invalid setting, naming the variable to fix.
- `text`: which characters text shown to people may not hold, and how a node cleans them.
- `ipc`: HTTP over unix sockets between the processes of one node.
- `gpu_health`: per-GPU health states, evidence kinds, report limits and the XID catalogue.
"""
