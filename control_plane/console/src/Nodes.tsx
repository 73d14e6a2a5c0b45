import { useState } from "react";
import {
  type ApiError,
  api,
  asApiError,
  type Gpu,
  type NodeResources,
  type NodeView,
  type ResourcesView,
  type TelemetryPoint,
} from "./api";
import { FleetFree, NodeFree, NodeHolders } from "./Capacity";
import { Chart } from "./Chart";
import { Confirm } from "./Confirm";
import { ErrorNote } from "./ErrorNote";
import { ago } from "./format";
import { GpuHealth } from "./GpuHealth";
import { Go, Labels } from "./Labels";
import { ListTable } from "./ListTable";
import { usePolled } from "./usePolled";

const REFRESH_MS = 5000;
const CHART_MINUTES = 10;

// Nodes: state, Needs upgrade, duplicate identity, labels, free capacity (and the fleet's),
// each GPU's health (quarantine, re-admission, timeline) and live telemetry, what holds a node's resources, events, and revoking a node's credential.
export function Nodes() {
  const { data: nodes, error, loaded, reload } = usePolled(api.nodes, [], REFRESH_MS);
  const resources = usePolled<ResourcesView | null>(api.resources, null, REFRESH_MS);
  const [selected, setSelected] = useState<string | null>(null);
  const byNode = new Map((resources.data?.nodes ?? []).map((node) => [node.node_id, node]));

  const current = nodes.find((node) => node.node_id === selected) ?? null;

  return (
    <section aria-labelledby="nodes-heading">
      <h1 id="nodes-heading">Nodes</h1>
      <ErrorNote error={error ?? resources.error} />
      <FleetFree view={resources.data} />
      <ListTable
        caption={<>Enrolled nodes (refreshed every {REFRESH_MS / 1000} s)</>}
        columns={[
          "Name",
          "State",
          "Flags",
          "Labels",
          "GPUs",
          "Free (of total)",
          "Last heartbeat",
          "Agent",
          <span className="visually-hidden">Details</span>,
        ]}
        empty="No nodes yet: enroll one from Hardware."
        loaded={loaded}
        rows={nodes}
        row={(node) => (
          <tr key={node.node_id} data-node-id={node.node_id}>
            <td>
              {node.display_name}
              <div className="help">{node.hostname}</div>
            </td>
            <td>
              <span className={"badge " + node.state} data-testid="node-state">
                {node.state}
              </span>
            </td>
            <td>
              {node.needs_upgrade && (
                <span className="badge fail" title={node.needs_upgrade.detail}>
                  Needs upgrade ({node.needs_upgrade.component})
                </span>
              )}
              {node.duplicate_identity && (
                <span className="badge fail" title={node.duplicate_identity.message}>
                  Duplicate identity
                </span>
              )}
            </td>
            <td>
              <Labels labels={node.labels} />
            </td>
            <td>{node.inventory?.gpus?.length ?? 0}</td>
            <td>
              <NodeFree node={byNode.get(node.node_id)} />
            </td>
            <td>{ago(node.last_heartbeat_at)}</td>
            <td>{node.agent_version ?? "—"}</td>
            <td>
              <button
                type="button"
                className="secondary"
                aria-expanded={selected === node.node_id}
                onClick={() => setSelected(selected === node.node_id ? null : node.node_id)}
              >
                {selected === node.node_id ? "Hide" : "Details"}
                <span className="visually-hidden"> for {node.display_name}</span>
              </button>
            </td>
          </tr>
        )}
      />
      {current && (
        <NodeDetails key={current.node_id} node={current} resources={byNode.get(current.node_id)} onChanged={reload} />
      )}
    </section>
  );
}

function NodeDetails({
  node,
  resources,
  onChanged,
}: {
  node: NodeView;
  resources: NodeResources | undefined;
  onChanged: () => Promise<void>;
}) {
  const samples = usePolled(api.nodeTelemetry(node.node_id, CHART_MINUTES), [], REFRESH_MS);
  const history = usePolled(api.nodeEvents(node.node_id, 50), [], REFRESH_MS);
  const queued = usePolled(api.nodeQueuedWork(node.node_id), [], REFRESH_MS);
  const telemetry = samples.data;
  const events = history.data;
  const [failure, setFailure] = useState<ApiError | null>(null);
  const error = failure ?? samples.error ?? history.error;
  const [confirming, setConfirming] = useState(false);
  const [revoked, setRevoked] = useState<string | null>(null);

  async function revoke() {
    setConfirming(false);
    try {
      const result = await api.revokeNodeCredential(node.node_id);
      setRevoked(`${result.revoked} credential(s) revoked. The agent stops at its next request (exit code 4).`);
      await Promise.all([onChanged(), history.reload()]);
    } catch (caught) {
      setFailure(asApiError(caught));
    }
  }

  const gpus = node.inventory?.gpus ?? [];
  const times = telemetry.map((p) => Date.parse(p.at));
  // The x axis spans the samples there are (at least a minute, at most CHART_MINUTES), so a
  // node that just arrived does not draw a sliver at the right edge.
  const to = Math.max(Date.now(), ...times);
  const from = Math.max(to - CHART_MINUTES * 60_000, Math.min(times[0] ?? to, to - 60_000));

  return (
    <section className="details" aria-labelledby="details-heading">
      <h2 id="details-heading">
        {node.display_name} <code>{node.node_id}</code>
      </h2>
      <p>
        Health: {node.health?.status ?? "unknown"}
        {node.health?.message ? ` — ${node.health.message}` : ""} · protocol {node.protocol_version ?? "—"} ·
        inventory {ago(node.inventory_at)} · telemetry {ago(node.telemetry_at)}
      </p>
      <p data-testid="runtime-worker">
        Runtime worker: {node.inventory?.runtime_worker?.version ?? "not reported"}
        {node.inventory?.runtime_worker?.protocol_version != null
          ? ` (protocol ${node.inventory.runtime_worker.protocol_version})`
          : ""}
        {node.inventory?.slurm?.job_id ? ` · Slurm job ${node.inventory.slurm.job_id}` : ""}
      </p>
      {node.needs_upgrade && (
        <p className="warning">
          Needs upgrade: {node.needs_upgrade.code} ({node.needs_upgrade.component}) — {node.needs_upgrade.detail}
        </p>
      )}
      {node.duplicate_identity && (
        <p className="warning">
          {node.duplicate_identity.message} Next step: {node.duplicate_identity.next_step}
        </p>
      )}
      <h3>GPUs</h3>
      {gpus.length === 0 ? <p>No GPUs (CPU-only node).</p> : <GpuHealth nodeId={node.node_id} />}
      <div className="charts">
        {gpus.map((gpu) => (
          <GpuCharts key={gpu.uuid} gpu={gpu} telemetry={telemetry} times={times} from={from} to={to} />
        ))}
        <Chart
          title={`Host CPU (last ${CHART_MINUTES} min)`}
          unit="%"
          max={100}
          from={from}
          to={to}
          series={[
            {
              label: "cpu",
              className: "line-util",
              points: telemetry.map((p, i) => ({ t: times[i] ?? 0, v: p.cpu_percent })),
            },
          ]}
        />
      </div>
      <h3>Held here</h3>
      <NodeHolders node={resources} />
      <h3>Queued work it could run</h3>
      <ErrorNote error={queued.error} />
      <ListTable
        caption="Queued jobs and pending services whose labels and size this node fits, oldest first"
        columns={["Kind", "Name", "Labels", "Queued"]}
        loaded={queued.loaded}
        empty="Nothing queued that this node could run."
        rows={queued.data}
        row={(work) => (
          <tr key={work.kind + work.id}>
            <td>{work.kind}</td>
            <td>
              <Go to={`/${work.kind}s/${work.id}`}>{work.name}</Go>
            </td>
            <td>
              <Labels labels={work.labels} />
            </td>
            <td>{ago(work.created_at)}</td>
          </tr>
        )}
      />
      <h3>Events</h3>
      <ul className="events">
        {events.map((event) => (
          <li key={event.id}>
            <time dateTime={event.at}>{new Date(event.at).toLocaleTimeString()}</time> <strong>{event.kind}</strong>
            {event.to_state ? ` → ${event.to_state}` : ""}: {event.reason}
          </li>
        ))}
      </ul>
      <h3>Credential</h3>
      <p className="credential-expiry">
        {node.credential_expires_at ? (
          <>
            Expires <time dateTime={node.credential_expires_at}>{new Date(node.credential_expires_at).toLocaleString()}</time>
            ; after that the agent stops and the node must be enrolled again.
          </>
        ) : (
          "No expiry recorded for this node's credential."
        )}
      </p>
      <ErrorNote error={error} />
      {revoked && <p role="status">{revoked}</p>}
      <button type="button" className="danger" onClick={() => setConfirming(true)}>
        Revoke credential
      </button>
      {confirming && (
        <Confirm
          title={`Revoke the credential of ${node.display_name}?`}
          action="Revoke credential"
          onConfirm={revoke}
          onCancel={() => setConfirming(false)}
        >
          <p>
            The agent on {node.hostname} is refused from its next request and stops. To bring the node back, enroll it
            again with a new token.
          </p>
        </Confirm>
      )}
    </section>
  );
}

type Sample = TelemetryPoint["gpus"][number];

// One GPU's charts: utilisation, memory, and temperature and power where the GPU reports them.
function GpuCharts({ gpu, telemetry, times, from, to }: { gpu: Gpu; telemetry: TelemetryPoint[]; times: number[]; from: number; to: number }) {
  const samples = telemetry.map((p, i) => ({ t: times[i] ?? 0, g: p.gpus.find((g) => g.uuid === gpu.uuid) }));
  const points = (pick: (g: Sample) => number | null | undefined) =>
    samples.map((s) => ({ t: s.t, v: s.g ? (pick(s.g) ?? null) : null }));
  const reported = (pick: (g: Sample) => number | null | undefined) => samples.some((s) => s.g && pick(s.g) != null);
  const totalMb = gpu.memory_total_mb ?? Math.max(1, ...samples.map((s) => s.g?.memory_total_mb ?? 0));
  const name = `GPU ${gpu.index} ${gpu.name}`;
  const window = `(last ${CHART_MINUTES} min)`;
  const limit = Math.max(0, ...samples.map((s) => s.g?.power_limit_w ?? 0), ...samples.map((s) => (s.g?.power_draw_w ?? 0) * 1.2));
  return (
    <>
      <Chart
        title={`${name} utilisation ${window}`}
        unit="%"
        max={100}
        from={from}
        to={to}
        series={[{ label: "utilisation", className: "line-util", points: points((g) => g.utilization_percent) }]}
      />
      <Chart
        title={`${name} memory ${window}`}
        unit=" GiB"
        max={totalMb / 1024}
        from={from}
        to={to}
        series={[
          {
            label: "memory",
            className: "line-mem",
            points: points((g) => (g.memory_used_mb == null ? null : g.memory_used_mb / 1024)),
          },
        ]}
      />
      {reported((g) => g.temperature_c) && (
        <Chart
          title={`${name} temperature ${window}`}
          unit=" °C"
          max={100}
          from={from}
          to={to}
          series={[{ label: "temperature", className: "line-temp", points: points((g) => g.temperature_c) }]}
        />
      )}
      {reported((g) => g.power_draw_w) && (
        <Chart
          title={`${name} power ${window}`}
          unit=" W"
          max={limit || 1}
          from={from}
          to={to}
          series={[{ label: "power", className: "line-power", points: points((g) => g.power_draw_w) }]}
        />
      )}
    </>
  );
}
