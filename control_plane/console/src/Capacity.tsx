import type { Amounts, NodeResources, ResourcesView } from "./api";
import { Go } from "./Labels";
import { ListTable } from "./ListTable";

// Free capacity as the scheduler counts it (GET /api/v1/admin/resources): the Nodes screen's
// Free column, the fleet's totals above it, and what holds a node's resources in its details.

function cpus(count: number): string {
  return String(Math.round(count * 100) / 100);
}

function memory(mb: number): string {
  return mb >= 1024 ? `${(mb / 1024).toFixed(1)} GiB` : `${mb} MB`;
}

function freeOf(free: Amounts, total: Amounts): string[] {
  return [
    `${cpus(free.cpus)} of ${cpus(total.cpus)} CPUs`,
    `${memory(free.memory_mb)} of ${memory(total.memory_mb)}`,
    `${free.gpus} of ${total.gpus} GPUs`,
  ];
}

// One node's free CPUs, memory and GPUs, each of its total.
export function NodeFree({ node }: { node: NodeResources | undefined }) {
  if (!node) return <span className="help">—</span>;
  if (!node.capacity) return <span className="help">no inventory yet</span>;
  return (
    <span data-testid="node-free" title={node.schedulable ? "" : "Not schedulable now: the scheduler places nothing here"}>
      {freeOf(node.capacity.free, node.capacity.total).map((line) => (
        <div key={line}>{line}</div>
      ))}
      <div className="help">
        {node.slots.in_use} job{node.slots.in_use === 1 ? "" : "s"} running
      </div>
    </span>
  );
}

// The fleet: free on the nodes the scheduler places work on now, nodes by state, queued work.
export function FleetFree({ view }: { view: ResourcesView | null }) {
  if (!view) return null;
  const { fleet } = view;
  const { free, total } = fleet.schedulable;
  const states = fleet.nodes_by_state;
  return (
    <p data-testid="fleet-free">
      <strong>Free on schedulable nodes:</strong> {freeOf(free, total).join(" · ")}.{" "}
      <span className="help">
        {states.online} online, {states.stale} stale, {states.offline} offline
        {fleet.needs_upgrade ? `, ${fleet.needs_upgrade} need an upgrade` : ""} · {fleet.slots_in_use} job
        {fleet.slots_in_use === 1 ? "" : "s"} running · {fleet.queued_jobs} queued · {fleet.pending_services} service
        {fleet.pending_services === 1 ? "" : "s"} pending
      </span>
    </p>
  );
}

// What holds a node's resources: each running job and deployed service, and its GPUs.
export function NodeHolders({ node }: { node: NodeResources | undefined }) {
  if (!node) return null;
  const gpus = new Map(node.gpus.map((gpu) => [gpu.index, gpu]));
  return (
    <ListTable
      caption={
        node.capacity
          ? `Held: ${cpus(node.capacity.held.cpus)} CPUs, ${memory(node.capacity.held.memory_mb)}, ${node.capacity.held.gpus} GPUs`
          : "Held"
      }
      columns={["Kind", "Name", "CPUs", "Memory", "GPUs"]}
      empty="Nothing runs here: all of it is free."
      rows={node.holders}
      row={(holder) => (
        <tr key={holder.kind + holder.id}>
          <td>{holder.kind}</td>
          <td>
            <Go to={`/${holder.kind}s/${holder.id}`}>{holder.name}</Go>
          </td>
          <td>{cpus(holder.cpus)}</td>
          <td>{memory(holder.memory_mb)}</td>
          <td>
            {holder.gpus.length === 0
              ? "—"
              : holder.gpus.map((index) => `GPU ${index}${gpus.get(index)?.model ? ` (${gpus.get(index)?.model})` : ""}`).join(", ")}
          </td>
        </tr>
      )}
    />
  );
}
