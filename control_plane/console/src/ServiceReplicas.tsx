import type { ReplicaView } from "./api";
import { ago } from "./format";
import { ListTable } from "./ListTable";

// A service's replicas, one row each (issue 27): which revision it runs, its state, where, how
// often it restarted and since when it serves. The list comes with the service's view, so it
// refreshes with it.
export function ServiceReplicas({ replicas, desired }: { replicas: readonly ReplicaView[]; desired: number }) {
  const sorted = [...replicas].sort((a, b) => a.ordinal - b.ordinal);
  const healthy = replicas.filter((replica) => replica.state === "healthy").length;
  return (
    <ListTable
      caption={
        <span data-testid="replicas-summary">
          {healthy} of {desired} replica{desired === 1 ? "" : "s"} healthy
        </span>
      }
      columns={["Replica", "Revision", "State", "Node", "GPUs", "Restarts", "Since"]}
      empty="No replica runs: the service is undeployed or scaled to zero."
      rows={sorted}
      row={(replica) => (
        <tr key={replica.id} data-replica-id={replica.id}>
          <td>
            #{replica.ordinal} <code className="detail">{replica.id}</code>
          </td>
          <td>{replica.revision}</td>
          <td>
            <span className={"badge " + replica.state} data-testid="replica-state">
              {replica.state}
            </span>
          </td>
          <td>{replica.node_id ? <code>{replica.node_id}</code> : "not placed"}</td>
          <td>{replica.assigned_gpus.map((gpu) => gpu.index).join(", ") || "—"}</td>
          <td data-testid="replica-restarts">{replica.restarts}</td>
          <td>{since(replica)}</td>
        </tr>
      )}
    />
  );
}

// Since when it is in its state where the control plane says; else since when it is ready.
function since(replica: ReplicaView): string {
  const at = replica.since ?? replica.ready_at;
  if (!at) return "—";
  return replica.since ? ago(at) : `ready ${ago(at)}`;
}
