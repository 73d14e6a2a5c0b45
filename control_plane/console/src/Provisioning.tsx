import { api } from "./api";
import { ErrorNote } from "./ErrorNote";
import { Labels, when } from "./Labels";
import { ListTable } from "./ListTable";
import { usePolled } from "./usePolled";

const REFRESH_MS = 5000;

function age(seconds: number): string {
  if (seconds < 60) return `${Math.round(seconds)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min`;
  return `${Math.floor(seconds / 3600)} h ${Math.floor((seconds % 3600) / 60)} min`;
}

// Workers / provisioning: the Slurm profiles, their outstanding requests with age and state,
// the nodes they brought and when those nodes' credentials expire.
export function Provisioning() {
  const provisioners = usePolled(api.provisioners, [], REFRESH_MS);
  const nodes = usePolled(api.nodes, [], REFRESH_MS);
  const nodeById = new Map(nodes.data.map((node) => [node.node_id, node]));
  return (
    <section aria-labelledby="provisioning-heading">
      <h1 id="provisioning-heading">Provisioning</h1>
      <ErrorNote error={provisioners.error ?? nodes.error} />
      {!provisioners.loaded && <p className="loading-row">Loading…</p>}
      {provisioners.loaded && !provisioners.error && provisioners.data.length === 0 && (
        <p data-testid="no-provisioners">
          No provisioners are configured. To start node agents on a Slurm cluster when work waits, write a
          provisioners.json and point MODELFORGE_PROVISIONERS_FILE at it (see docs/provisioning.md).
        </p>
      )}
      {provisioners.data.map((provisioner) => (
        <section key={provisioner.name} className="details" aria-label={`Provisioner ${provisioner.name}`}>
          <h2>
            {provisioner.name} <span className="help">({provisioner.type} via {provisioner.login})</span>
          </h2>
          <p className="help">
            A request that does not attach within {provisioner.provision_timeout_s || "∞"} s is cancelled; a provisioned
            node idle for {provisioner.max_idle_s || "∞"} s is released.
          </p>
          <ListTable
            caption="Profiles"
            columns={["Profile", "CPUs", "GPUs", "Memory", "Labels", "Outstanding"]}
            rows={provisioner.profiles}
            empty="No profiles."
            row={(profile) => (
              <tr key={profile.name}>
                <td>{profile.name}</td>
                <td>{profile.cpus}</td>
                <td>{profile.gpus}</td>
                <td>{profile.ram_mb} MB</td>
                <td>
                  <Labels labels={profile.labels} />
                </td>
                <td>{profile.outstanding}</td>
              </tr>
            )}
          />
          <ListTable
            caption="Requests (outstanding first)"
            columns={["Request", "Profile", "State", "Slurm job", "Age", "Node it brought", "Credential expires", "Reason"]}
            rows={provisioner.requests}
            empty="No requests yet: one is made when work waits that only this provisioner's profiles can run."
            row={(request) => {
              const node = request.node_id ? nodeById.get(request.node_id) : undefined;
              return (
                <tr key={request.request_id} data-request-id={request.request_id} data-state={request.state}>
                  <td>
                    <code>{request.request_id}</code>
                  </td>
                  <td>{request.profile}</td>
                  <td>
                    <span className={"badge " + request.state}>{request.state}</span>
                  </td>
                  <td>{request.slurm_job_id ?? "—"}</td>
                  <td>{age(request.age_seconds)}</td>
                  <td data-testid="request-node">{node ? `${node.display_name} (${node.state})` : request.node_id ?? "—"}</td>
                  <td data-testid="request-expires">{node ? when(node.credential_expires_at ?? null) : "—"}</td>
                  <td>{request.reason ?? ""}</td>
                </tr>
              );
            }}
          />
        </section>
      ))}
    </section>
  );
}
