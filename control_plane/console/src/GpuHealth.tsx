import { type ReactNode, useEffect, useId, useState } from "react";
import { type ApiError, api, asApiError, type GpuHealthView } from "./api";
import { Confirm } from "./Confirm";
import { ErrorNote } from "./ErrorNote";
import { ago } from "./format";
import { Go } from "./Labels";
import { ListTable } from "./ListTable";
import { usePolled } from "./usePolled";

const REFRESH_MS = 5000;
const TIMELINE_LIMIT = 50;
const EVIDENCE_SHOWN = 3;

// The health of each GPU of a node (docs/nodes.md): its state as the scheduler reads it, why,
// since when and the active check that runs on it; an operator quarantines a GPU (with a reason)
// and re-admits it here, and reads its timeline. Every answer the control plane gives to those
// two actions is shown as it came: the GPU back in the schedule, a check started, or the refusal's
// code, message and next step.
export function GpuHealth({ nodeId }: { nodeId: string }) {
  const gpus = usePolled(api.nodeGpus(nodeId), [], REFRESH_MS);
  const [timeline, setTimeline] = useState<string | null>(null);
  const [quarantining, setQuarantining] = useState<GpuHealthView | null>(null);
  const [outcome, setOutcome] = useState<{ gpu: GpuHealthView; note: ReactNode; error: ApiError | null } | null>(null);
  const [busy, setBusy] = useState(false);
  // Bumped by each action, so the open timeline shows its entry at once, not at the next poll.
  const [changes, setChanges] = useState(0);

  async function readmit(gpu: GpuHealthView) {
    setBusy(true);
    try {
      const answer = await api.readmitGpu(nodeId, gpu.uuid);
      const note = answer.check ? (
        <>
          Active check started (<Go to={`/jobs/${answer.check.job_id}`}>job {answer.check.job_id}</Go>): the GPU stays out
          of the schedule until it passes.
        </>
      ) : (
        <>Re-admitted: the GPU is {answer.state} and back in the schedule.</>
      );
      setOutcome({ gpu, note, error: null });
    } catch (caught) {
      setOutcome({ gpu, note: "Re-admission refused.", error: asApiError(caught) });
    } finally {
      setBusy(false);
      setTimeline(gpu.uuid);
      setChanges((count) => count + 1);
      await gpus.reload();
    }
  }

  async function quarantined(gpu: GpuHealthView, answer: GpuHealthView) {
    setQuarantining(null);
    setOutcome({ gpu, note: `Quarantined: no new work is placed on it; work running on it goes on.`, error: null });
    setTimeline(answer.uuid);
    setChanges((count) => count + 1);
    await gpus.reload();
  }

  const open = gpus.data.find((gpu) => gpu.uuid === timeline) ?? null;
  return (
    <>
      <ErrorNote error={gpus.error} />
      <ListTable
        caption={<>GPU health: the scheduler places work only on healthy and degraded GPUs (refreshed every {REFRESH_MS / 1000} s)</>}
        columns={["GPU", "State", "Reason", "Since", "Active check", <span className="visually-hidden">Actions</span>]}
        loaded={gpus.loaded}
        rows={gpus.data}
        row={(gpu) => (
          <tr key={gpu.uuid} data-gpu-uuid={gpu.uuid} data-gpu-index={gpu.index}>
            <td>
              GPU {gpu.index}
              {gpu.name ? ` ${gpu.name}` : ""}
              <div className="help">
                <code>{gpu.uuid}</code>
              </div>
            </td>
            <td>
              <GpuBadge gpu={gpu} />
            </td>
            <td data-testid="gpu-reason">
              <GpuReason gpu={gpu} />
            </td>
            <td>{gpu.since ? <time dateTime={gpu.since} title={new Date(gpu.since).toLocaleString()}>{ago(gpu.since)}</time> : "—"}</td>
            <td data-testid="gpu-check">
              {gpu.check ? <Go to={`/jobs/${gpu.check.job_id}`}>{gpu.check.state}</Go> : "—"}
            </td>
            <td>
              <div className="actions start">
                <button type="button" className="secondary" onClick={() => setQuarantining(gpu)}>
                  {gpu.quarantine ? "Change reason" : "Quarantine"}
                  <span className="visually-hidden">{gpu.quarantine ? " of" : ""} GPU {gpu.index}</span>
                </button>
                {(gpu.state === "quarantined" || gpu.state === "unhealthy") && (
                  <button type="button" disabled={busy} onClick={() => void readmit(gpu)}>
                    Re-admit<span className="visually-hidden"> GPU {gpu.index}</span>
                  </button>
                )}
                <button
                  type="button"
                  className="secondary"
                  aria-expanded={timeline === gpu.uuid}
                  onClick={() => setTimeline(timeline === gpu.uuid ? null : gpu.uuid)}
                >
                  Timeline<span className="visually-hidden"> of GPU {gpu.index}</span>
                </button>
              </div>
            </td>
          </tr>
        )}
      />
      {outcome && (
        <div data-testid="gpu-outcome">
          {outcome.error ? (
            <>
              <p>
                GPU {outcome.gpu.index}: {outcome.note}
              </p>
              <ErrorNote error={outcome.error} />
            </>
          ) : (
            <p role="status">
              GPU {outcome.gpu.index}: {outcome.note}
            </p>
          )}
        </div>
      )}
      {open && <GpuTimeline key={open.uuid} nodeId={nodeId} gpu={open} changes={changes} />}
      {quarantining && (
        <QuarantineDialog
          nodeId={nodeId}
          gpu={quarantining}
          onDone={(answer) => void quarantined(quarantining, answer)}
          onCancel={() => setQuarantining(null)}
        />
      )}
    </>
  );
}

// The state in words (never colour alone), and, when they differ, the rules' own state beneath
// an operator's quarantine.
function GpuBadge({ gpu }: { gpu: GpuHealthView }) {
  return (
    <>
      <span className={"badge gpu-" + gpu.state} data-testid="gpu-state">
        {gpu.state}
      </span>
      {gpu.state === "quarantined" && gpu.rules_state !== "healthy" && <div className="help">rules: {gpu.rules_state}</div>}
    </>
  );
}

function GpuReason({ gpu }: { gpu: GpuHealthView }) {
  // The evidence that says more than the reason (the first often is the reason itself).
  const evidence = (gpu.evidence ?? []).filter((item) => item.detail !== gpu.reason);
  return (
    <>
      {gpu.quarantine && (
        <div>
          Quarantined by an operator: {gpu.quarantine.reason}{" "}
          <span className="help">({ago(gpu.quarantine.at)})</span>
        </div>
      )}
      {gpu.reason && gpu.reason !== gpu.quarantine?.reason && <div>{gpu.reason}</div>}
      {evidence.slice(0, EVIDENCE_SHOWN).map((item, index) => (
        <div className="help" key={index}>
          {item.kind}
          {item.xid != null ? ` ${item.xid}` : ""}: {item.detail}
        </div>
      ))}
      {evidence.length > EVIDENCE_SHOWN && <div className="help">and {evidence.length - EVIDENCE_SHOWN} more</div>}
      {gpu.reported && gpu.reported !== gpu.rules_state && <div className="help">The agent now reports it {gpu.reported}.</div>}
      {!gpu.quarantine && !gpu.reason && evidence.length === 0 && "—"}
    </>
  );
}

// The GPU's timeline, newest first: state changes, quarantines, re-admissions and checks.
function GpuTimeline({ nodeId, gpu, changes }: { nodeId: string; gpu: GpuHealthView; changes: number }) {
  const events = usePolled(api.gpuEvents(nodeId, gpu.uuid, TIMELINE_LIMIT), [], REFRESH_MS);
  const { reload } = events;
  useEffect(() => {
    if (changes > 0) void reload();
  }, [changes, reload]);
  const headingId = useId();
  return (
    <section aria-labelledby={headingId} data-testid="gpu-timeline">
      <h4 id={headingId}>
        Timeline of GPU {gpu.index} <code>{gpu.uuid}</code>
      </h4>
      <ErrorNote error={events.error} />
      {events.loaded && events.data.length === 0 && <p>No events: nothing has happened to this GPU yet.</p>}
      <ul className="events">
        {events.data.map((event, index) => (
          <li key={event.id ?? `${event.at}-${index}`}>
            <time dateTime={event.at}>{new Date(event.at).toLocaleString()}</time> <strong>{event.kind}</strong>
            {event.to_state ? ` ${event.from_state ?? "—"} → ${event.to_state}` : ""}: {event.reason}
            {event.actor ? <span className="help"> (by {event.actor})</span> : null}
          </li>
        ))}
      </ul>
    </section>
  );
}

// Quarantine asks why: the reason is kept with the GPU and shown to every operator after.
function QuarantineDialog(props: {
  nodeId: string;
  gpu: GpuHealthView;
  onDone: (answer: GpuHealthView) => void;
  onCancel: () => void;
}) {
  const [reason, setReason] = useState(props.gpu.quarantine?.reason ?? "");
  const [failure, setFailure] = useState<ApiError | null>(null);
  const inputId = useId();
  const errorId = useId();

  async function confirm() {
    try {
      props.onDone(await api.quarantineGpu(props.nodeId, props.gpu.uuid, reason.trim()));
    } catch (caught) {
      setFailure(asApiError(caught));
    }
  }

  return (
    <Confirm
      title={props.gpu.quarantine ? `Change the quarantine reason of GPU ${props.gpu.index}?` : `Quarantine GPU ${props.gpu.index}?`}
      action={props.gpu.quarantine ? "Change reason" : "Quarantine"}
      onConfirm={() => void confirm()}
      onCancel={props.onCancel}
    >
      <p>
        The scheduler places no new work on GPU {props.gpu.index} (<code>{props.gpu.uuid}</code>) until it is re-admitted.
        Work running on it now goes on until it ends.
      </p>
      <label htmlFor={inputId}>Reason</label>
      <input
        id={inputId}
        value={reason}
        maxLength={500}
        required
        aria-describedby={failure ? errorId : undefined}
        onChange={(event) => setReason(event.target.value)}
      />
      <div className="help">Shown with the GPU and kept in its timeline and the audit log (up to 500 characters).</div>
      <ErrorNote error={failure} id={errorId} />
    </Confirm>
  );
}
