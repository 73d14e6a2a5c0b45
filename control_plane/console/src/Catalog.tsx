import { useState } from "react";
import { type ApiError, api, asApiError, type SweepReport } from "./api";
import { Confirm } from "./Confirm";
import { ErrorNote } from "./ErrorNote";
import { ago } from "./format";
import { bytes, Go } from "./Labels";
import { ListTable } from "./ListTable";
import { usePolled } from "./usePolled";

// Models: immutable name@version entries that jobs and services name.
export function Models() {
  const models = usePolled(api.models, [], 10_000);
  return (
    <section aria-labelledby="models-heading">
      <h1 id="models-heading">Models</h1>
      <ErrorNote error={models.error} />
      <ListTable
        caption="Models, newest first (register one with POST /api/v1/models)"
        columns={["Model", "Runner", "Weights", "Parameters", "Registered"]}
        loaded={models.loaded}
        empty="No models yet: register one with POST /api/v1/models."
        rows={models.data}
        row={(model) => (
          <tr key={model.model_id}>
            <td>
              <strong>{model.ref}</strong>
            </td>
            <td>{model.runner}</td>
            <td>
              <code className="digest">{model.weights}</code>
            </td>
            <td>
              <code>{Object.keys(model.params).length ? JSON.stringify(model.params) : "—"}</code>
            </td>
            <td>{ago(model.created_at)}</td>
          </tr>
        )}
      />
    </section>
  );
}

// Artifacts: content-addressed blobs, their size and who names them; the sweep, dry run first.
export function Artifacts() {
  const artifacts = usePolled(api.artifacts, [], 10_000);
  const [report, setReport] = useState<SweepReport | null>(null);
  const [confirming, setConfirming] = useState(false);
  const [busy, setBusy] = useState(false);
  const [failure, setFailure] = useState<ApiError | null>(null);
  const total = artifacts.data.reduce((sum, artifact) => sum + artifact.size_bytes, 0);

  async function sweep(dryRun: boolean) {
    setConfirming(false);
    setBusy(true);
    setFailure(null);
    try {
      setReport(await api.sweep(dryRun));
      await artifacts.reload();
    } catch (caught) {
      setFailure(asApiError(caught));
    } finally {
      setBusy(false);
    }
  }

  return (
    <section aria-labelledby="artifacts-heading">
      <div className="title-row">
        <h1 id="artifacts-heading">Artifacts</h1>
        <div className="actions">
          <button type="button" className="secondary" disabled={busy} onClick={() => void sweep(true)}>
            Sweep dry run
          </button>
          <button type="button" className="danger" disabled={busy} onClick={() => setConfirming(true)}>
            Sweep now
          </button>
        </div>
      </div>
      <ErrorNote error={failure} />
      {busy && <p role="status">Sweeping…</p>}
      {report && <SweepResult report={report} />}
      <ErrorNote error={artifacts.error} />
      <ListTable
        caption={
          <>
            Stored artifacts, newest first: {artifacts.data.length} ({bytes(total)})
          </>
        }
        columns={["Digest", "Size", "Stored", "Referenced by"]}
        loaded={artifacts.loaded}
        empty="No artifacts stored."
        rows={artifacts.data}
        row={(artifact) => (
          <tr key={artifact.digest} data-digest={artifact.digest}>
            <td>
              <code className="digest">{artifact.digest}</code>
            </td>
            <td>{bytes(artifact.size_bytes)}</td>
            <td>{ago(artifact.created_at)}</td>
            <td>
              {artifact.references.length === 0 && <span className="help">nothing (a sweep may delete it after the grace period)</span>}
              {artifact.references.map((ref) => (
                <span key={ref.kind + ref.id} className="chip">
                  {ref.kind === "model" ? (
                    `model ${ref.name}`
                  ) : (
                    <Go to={`/${ref.kind}s/${ref.id}`}>
                      {ref.kind} {ref.name}
                    </Go>
                  )}
                  {ref.state ? ` (${ref.state})` : ""}
                </span>
              ))}
            </td>
          </tr>
        )}
      />
      {confirming && (
        <Confirm
          title="Delete every unreferenced artifact now?"
          action="Sweep now"
          onConfirm={() => void sweep(false)}
          onCancel={() => setConfirming(false)}
        >
          <p>
            Artifacts that no model, deployed service or queued or running job names, and that are older than the grace
            period, are deleted from disk. Run a dry run first to see the list.
          </p>
        </Confirm>
      )}
    </section>
  );
}

function SweepResult({ report }: { report: SweepReport }) {
  return (
    <section className="details" aria-labelledby="sweep-heading" data-testid="sweep-report">
      <h2 id="sweep-heading">
        {report.dry_run ? "Sweep dry run" : "Sweep"} at {new Date(report.swept_at).toLocaleTimeString()}:{" "}
        {report.dry_run ? "would delete" : "deleted"} {report.deleted.length} artifact(s), {bytes(report.bytes_freed)}
      </h2>
      <p className="help">
        Grace period {report.grace_seconds} s: newer artifacts are kept whatever names them.
        {report.dry_run ? " Nothing was changed." : ""}
      </p>
      <ListTable
        caption={report.dry_run ? "Would delete" : "Deleted"}
        columns={["Digest", "Size", "Stored"]}
        empty="Nothing."
        rows={report.deleted}
        row={(item) => (
          <tr key={item.digest}>
            <td>
              <code className="digest">{item.digest}</code>
            </td>
            <td>{bytes(item.size_bytes)}</td>
            <td>{ago(item.created_at)}</td>
          </tr>
        )}
      />
      <ListTable
        caption="Kept, and why"
        columns={["Digest", "Size", "Why kept"]}
        empty="Nothing kept."
        rows={report.kept}
        row={(item) => (
          <tr key={item.digest}>
            <td>
              <code className="digest">{item.digest}</code>
            </td>
            <td>{bytes(item.size_bytes)}</td>
            <td>{item.reasons.join("; ")}</td>
          </tr>
        )}
      />
      {report.removed_files.length > 0 && (
        <p>
          Files without a record {report.dry_run ? "that would be removed" : "removed"}:{" "}
          {report.removed_files.map((file) => file.path).join(", ")}
        </p>
      )}
    </section>
  );
}
