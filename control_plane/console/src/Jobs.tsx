import { useState } from "react";
import { ApiError, api, asApiError, type JobEvent, type JobState, type JobView, type Reason } from "./api";
import { Confirm } from "./Confirm";
import { ErrorNote } from "./ErrorNote";
import { ago } from "./format";
import { Go, Labels, when } from "./Labels";
import { ListTable } from "./ListTable";
import { navigate } from "./route";
import { useEventStream } from "./useEventStream";
import { usePolled } from "./usePolled";

const LIST_REFRESH_MS = 3000;
const JOB_REFRESH_MS = 2000;
const LOG_LINES = 500;
const STATES: readonly ("" | JobState)[] = ["", "queued", "running", "succeeded", "failed", "cancelled"];
const EXAMPLE = JSON.stringify(
  {
    entrypoint: {
      kind: "python",
      module: "hello",
      function: "main",
      source: { "hello.py": "def main(name):\n    print('hello', name)\n    return {'greeting': 'hello ' + name}\n" },
    },
    params: { name: "world" },
    labels: {},
    resources: { cpus: 1, gpus: 0 },
  },
  null,
  2,
);

function parseLabels(text: string): string[] {
  return text
    .split(/[,\s]+/)
    .map((item) => item.trim())
    .filter(Boolean);
}

export function WaitingReason({ reason }: { reason: Reason }) {
  return (
    <div className="waiting" data-testid="waiting-reason">
      <strong>{reason.code}</strong>: {reason.message}
      <div className="next-step">Next step: {reason.next_step}</div>
    </div>
  );
}

// Jobs: newest first, filtered by state and labels, refreshed every few seconds; submit one.
export function Jobs() {
  const [state, setState] = useState<"" | JobState>("");
  const [labelText, setLabelText] = useState("");
  const [labels, setLabels] = useState<string[]>([]);
  const jobs = usePolled(api.jobs(state, labels), [], LIST_REFRESH_MS);
  const badLabel = labels.find((label) => !/^[^=]+=/.test(label));

  return (
    <section aria-labelledby="jobs-heading">
      <h1 id="jobs-heading">Jobs</h1>
      <form
        className="filters"
        onSubmit={(event) => {
          event.preventDefault();
          setLabels(parseLabels(labelText));
        }}
      >
        <div>
          <label htmlFor="job-state">State</label>
          <select id="job-state" value={state} onChange={(event) => setState(event.target.value as "" | JobState)}>
            {STATES.map((value) => (
              <option key={value} value={value}>
                {value || "any"}
              </option>
            ))}
          </select>
        </div>
        <div className="grow">
          <label htmlFor="job-labels">Labels</label>
          <input
            id="job-labels"
            value={labelText}
            placeholder="key=value, key=value"
            aria-describedby="job-labels-help"
            onChange={(event) => setLabelText(event.target.value)}
          />
          <div className="help" id="job-labels-help">
            Only jobs carrying every label listed; press Enter to apply.
          </div>
        </div>
        <button type="submit" className="secondary">
          Filter
        </button>
      </form>
      {badLabel && <p className="warning">“{badLabel}” is not key=value: the control plane refuses it.</p>}
      <ErrorNote error={jobs.error} />
      <ListTable
        caption={<>Jobs, newest first (refreshed every {LIST_REFRESH_MS / 1000} s)</>}
        columns={["Job", "State", "Labels", "Node", "GPUs", "Submitted", "Why waiting / outcome"]}
        loaded={jobs.loaded}
        empty={state || labels.length ? "No job matches these filters." : "No jobs yet: submit one below or with POST /api/v1/jobs."}
        rows={jobs.data}
        row={(job) => (
          <tr key={job.job_id} data-job-id={job.job_id}>
            <td>
              <Go to={`/jobs/${job.job_id}`}>
                <code>{job.job_id}</code>
              </Go>
            </td>
            <td>
              <span className={"badge " + job.state} data-testid="job-state">
                {job.state}
              </span>
            </td>
            <td>
              <Labels labels={job.labels} />
            </td>
            <td>{job.node_id ? <code>{job.node_id}</code> : "—"}</td>
            <td>{job.assigned_gpus.map((gpu) => gpu.index).join(", ") || "—"}</td>
            <td>{ago(job.created_at)}</td>
            <td>
              {job.waiting_reason
                ? `${job.waiting_reason.code}: ${job.waiting_reason.message}`
                : job.error
                  ? job.error.code
                  : job.state === "succeeded"
                    ? "result ready"
                    : ""}
            </td>
          </tr>
        )}
      />
      <SubmitJob />
    </section>
  );
}

function SubmitJob() {
  const [open, setOpen] = useState(false);
  const [text, setText] = useState(EXAMPLE);
  const [error, setError] = useState<ApiError | null>(null);
  const [busy, setBusy] = useState(false);

  async function submit() {
    let body: unknown;
    try {
      body = JSON.parse(text);
    } catch (caught) {
      setError(new ApiError(0, "JOB_NOT_JSON", `The job is not valid JSON: ${String(caught)}`, "Correct the JSON, then submit again."));
      return;
    }
    setBusy(true);
    try {
      const job = await api.submitJob(body);
      navigate(null, `/jobs/${job.job_id}`);
    } catch (caught) {
      setError(asApiError(caught));
    } finally {
      setBusy(false);
    }
  }

  if (!open)
    return (
      <button type="button" onClick={() => setOpen(true)}>
        Submit a job
      </button>
    );
  return (
    <section className="details" aria-labelledby="submit-heading">
      <h2 id="submit-heading">Submit a job</h2>
      <label htmlFor="job-spec">Job (JSON, as POST /api/v1/jobs takes it)</label>
      <textarea id="job-spec" rows={14} value={text} spellCheck={false} onChange={(event) => setText(event.target.value)} />
      <ErrorNote error={error} />
      <div className="actions">
        <button type="button" className="secondary" onClick={() => setOpen(false)}>
          Close
        </button>
        <button type="button" disabled={busy} onClick={() => void submit()}>
          {busy ? "Submitting…" : "Submit"}
        </button>
      </div>
    </section>
  );
}

function describe(event: JobEvent): string {
  if (event.kind === "state" && event.data && typeof event.data === "object") {
    const data = event.data as Record<string, unknown>;
    return Object.entries(data)
      .map(([key, value]) => `${key}=${typeof value === "string" ? value : JSON.stringify(value)}`)
      .join(" ");
  }
  return typeof event.data === "string" ? event.data : JSON.stringify(event.data);
}

// One job: state, placement, why it waits, result or error, its events and the tail of its log
// (followed while it runs); cancel and delete, each confirmed.
export function JobPage({ jobId }: { jobId: string }) {
  const polled = usePolled(api.job(jobId), null as JobView | null, JOB_REFRESH_MS);
  const { events, error: eventsError } = useEventStream(
    jobId,
    (after, signal) => api.jobEvents(jobId, after, 15, signal),
    0,
  );
  const [asking, setAsking] = useState<"cancel" | "delete" | null>(null);
  const [failure, setFailure] = useState<ApiError | null>(null);
  const [notice, setNotice] = useState<string | null>(null);
  const job = polled.data;
  const logLines = events.filter((event) => event.kind === "log").map((event) => String(event.data));
  const others = events.filter((event) => event.kind !== "log");
  const active = job?.state === "queued" || job?.state === "running";

  async function act(what: "cancel" | "delete") {
    setAsking(null);
    setFailure(null);
    try {
      if (what === "cancel") {
        await api.cancelJob(jobId);
        setNotice("Cancel requested: a running job is stopped by its node within seconds.");
        await polled.reload();
      } else {
        await api.deleteJob(jobId);
        navigate(null, "/jobs");
      }
    } catch (caught) {
      setFailure(asApiError(caught));
    }
  }

  return (
    <section aria-labelledby="job-heading">
      <p>
        <Go to="/jobs">← Jobs</Go>
      </p>
      <h1 id="job-heading">
        Job <code>{jobId}</code>
      </h1>
      <ErrorNote error={polled.error} />
      {!polled.loaded && <p className="loading-row">Loading…</p>}
      {job && (
        <>
          <dl className="facts">
            <dt>State</dt>
            <dd>
              <span className={"badge " + job.state} data-testid="job-state">
                {job.state}
              </span>
              {job.cancel_requested && active ? " (cancel requested)" : ""}
            </dd>
            <dt>Node</dt>
            <dd>{job.node_id ? <code>{job.node_id}</code> : "not placed"}</dd>
            <dt>GPUs</dt>
            <dd data-testid="assigned-gpus">
              {job.assigned_gpus.length ? job.assigned_gpus.map((gpu) => `GPU ${gpu.index} (${gpu.uuid})`).join(", ") : "none"}
            </dd>
            <dt>Labels</dt>
            <dd>
              <Labels labels={job.labels} />
            </dd>
            <dt>Submitted · started · finished</dt>
            <dd>
              {when(job.created_at)} · {when(job.started_at)} · {when(job.finished_at)}
            </dd>
            {job.model && (
              <>
                <dt>Model</dt>
                <dd>{job.model}</dd>
              </>
            )}
            {job.secrets.length > 0 && (
              <>
                <dt>Secrets (names)</dt>
                <dd>{job.secrets.join(", ")}</dd>
              </>
            )}
          </dl>
          {job.waiting_reason && <WaitingReason reason={job.waiting_reason} />}
          {job.error && (
            <div className="error" data-testid="job-error">
              <strong>{job.error.code}</strong>: {job.error.message}
              {job.error.next_step && <div className="next-step">Next step: {job.error.next_step}</div>}
            </div>
          )}
          {job.state === "succeeded" && (
            <>
              <h2>Result</h2>
              <pre className="result" data-testid="job-result">
                {JSON.stringify(job.result, null, 2)}
              </pre>
            </>
          )}
          {notice && <p role="status">{notice}</p>}
          <ErrorNote error={failure} />
          <div className="actions start">
            {active && (
              <button type="button" className="danger" onClick={() => setAsking("cancel")} disabled={job.cancel_requested}>
                Cancel job
              </button>
            )}
            {!active && (
              <button type="button" className="danger" onClick={() => setAsking("delete")}>
                Delete job
              </button>
            )}
          </div>
        </>
      )}
      <h2>Log</h2>
      <ErrorNote error={polled.error ? null : eventsError} />
      <pre className="log" data-testid="job-log" aria-live="polite">
        {logLines.length ? logLines.slice(-LOG_LINES).join("\n") : active ? "(no output yet)" : "(no output)"}
      </pre>
      <h2>Events</h2>
      <ul className="events">
        {others.length === 0 && <li>{polled.loaded ? "No events yet." : "Loading…"}</li>}
        {others.map((event) => (
          <li key={event.seq}>
            <time dateTime={event.at}>{new Date(event.at).toLocaleTimeString()}</time> <strong>{event.kind}</strong>{" "}
            {describe(event)}
          </li>
        ))}
      </ul>
      {asking && (
        <Confirm
          title={asking === "cancel" ? `Cancel job ${jobId}?` : `Delete job ${jobId}?`}
          action={asking === "cancel" ? "Cancel job" : "Delete job"}
          onConfirm={() => void act(asking)}
          onCancel={() => setAsking(null)}
        >
          <p>
            {asking === "cancel"
              ? "A queued job never starts; a running one is stopped (its process group gets SIGTERM, then SIGKILL)."
              : "Its record, events and log are removed. Artifacts it produced stay until the sweep finds them unreferenced."}
          </p>
        </Confirm>
      )}
    </section>
  );
}
