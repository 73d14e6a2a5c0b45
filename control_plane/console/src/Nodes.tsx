import { useEffect, useRef, useState } from "react";
import { type ApiError, api, asApiError, type NodeView } from "./api";
import { Chart, type Series } from "./Chart";
import { ErrorNote } from "./ErrorNote";
import { ago } from "./format";
import { ListTable } from "./ListTable";
import { usePolled } from "./usePolled";

const REFRESH_MS = 5000;
const CHART_MINUTES = 10;

// Nodes: state, Needs upgrade, duplicate identity, labels, GPUs with live telemetry,
// events, and revoking a node's credential.
export function Nodes() {
  const { data: nodes, error, reload } = usePolled(api.nodes, [], REFRESH_MS);
  const [selected, setSelected] = useState<string | null>(null);

  const current = nodes.find((node) => node.node_id === selected) ?? null;

  return (
    <section aria-labelledby="nodes-heading">
      <h1 id="nodes-heading">Nodes</h1>
      <ErrorNote error={error} />
      <ListTable
        caption={<>Enrolled nodes (refreshed every {REFRESH_MS / 1000} s)</>}
        columns={[
          "Name",
          "State",
          "Flags",
          "Labels",
          "GPUs",
          "Last heartbeat",
          "Agent",
          <span className="visually-hidden">Details</span>,
        ]}
        empty="No nodes yet: enroll one from Hardware."
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
              {Object.entries(node.labels).map(([key, value]) => (
                <span key={key} className="chip">
                  {key}={value}
                </span>
              ))}
            </td>
            <td>{node.inventory?.gpus?.length ?? 0}</td>
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
      {current && <NodeDetails key={current.node_id} node={current} onChanged={reload} />}
    </section>
  );
}

function NodeDetails({ node, onChanged }: { node: NodeView; onChanged: () => Promise<void> }) {
  const samples = usePolled(api.nodeTelemetry(node.node_id, CHART_MINUTES), [], REFRESH_MS);
  const history = usePolled(api.nodeEvents(node.node_id, 50), [], REFRESH_MS);
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
      {gpus.length === 0 && <p>No GPUs (CPU-only node).</p>}
      <div className="charts">
        {gpus.map((gpu) => {
          const samples = telemetry.map((p, i) => ({ t: times[i] ?? 0, g: p.gpus.find((g) => g.uuid === gpu.uuid) }));
          const total = gpu.memory_total_mb ?? Math.max(1, ...samples.map((s) => s.g?.memory_total_mb ?? 0));
          const series: Series[] = [
            {
              label: "utilisation",
              className: "line-util",
              unit: "%",
              max: 100,
              points: samples.map((s) => ({ t: s.t, v: s.g?.utilization_percent ?? null })),
            },
            {
              label: "memory",
              className: "line-mem",
              unit: " MB",
              max: total,
              points: samples.map((s) => ({ t: s.t, v: s.g?.memory_used_mb ?? null })),
            },
          ];
          return (
            <Chart
              key={gpu.uuid}
              title={`GPU ${gpu.index} ${gpu.name} (last ${CHART_MINUTES} min)`}
              series={series}
              from={from}
              to={to}
            />
          );
        })}
        <Chart
          title={`Host CPU (last ${CHART_MINUTES} min)`}
          from={from}
          to={to}
          series={[
            {
              label: "cpu",
              className: "line-util",
              unit: "%",
              max: 100,
              points: telemetry.map((p, i) => ({ t: times[i] ?? 0, v: p.cpu_percent })),
            },
          ]}
        />
      </div>
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
      {confirming && <ConfirmRevoke node={node} onConfirm={revoke} onCancel={() => setConfirming(false)} />}
    </section>
  );
}

function ConfirmRevoke({ node, onConfirm, onCancel }: { node: NodeView; onConfirm: () => void; onCancel: () => void }) {
  const dialog = useRef<HTMLDialogElement>(null);
  useEffect(() => {
    if (dialog.current && !dialog.current.open) dialog.current.showModal();
  }, []);
  return (
    <dialog
      ref={dialog}
      aria-labelledby="confirm-title"
      onCancel={(event) => {
        event.preventDefault();
        onCancel();
      }}
    >
      <h2 id="confirm-title">Revoke the credential of {node.display_name}?</h2>
      <p>
        The agent on {node.hostname} is refused from its next request and stops. To bring the node back,
        enroll it again with a new token.
      </p>
      <div className="actions">
        <button type="button" className="secondary" onClick={onCancel} autoFocus>
          Cancel
        </button>
        <button type="button" className="danger" onClick={onConfirm}>
          Revoke credential
        </button>
      </div>
    </dialog>
  );
}
