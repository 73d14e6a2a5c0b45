import { useState } from "react";
import { api } from "./api";
import { ErrorNote } from "./ErrorNote";
import { ListTable } from "./ListTable";
import { usePolled } from "./usePolled";

const EMPTY = { action: "", actor: "", target: "" };

// Audit: every admin action (who, what, on what, the outcome), newest first, filterable.
export function Audit() {
  const [draft, setDraft] = useState(EMPTY);
  const [filters, setFilters] = useState(EMPTY);
  const entries = usePolled(api.audit(filters), [], 10_000);
  const filtered = Object.values(filters).some(Boolean);
  return (
    <section aria-labelledby="audit-heading">
      <h1 id="audit-heading">Audit</h1>
      <form
        className="filters"
        onSubmit={(event) => {
          event.preventDefault();
          setFilters({ action: draft.action.trim(), actor: draft.actor.trim(), target: draft.target.trim() });
        }}
      >
        {(["action", "actor", "target"] as const).map((field) => (
          <div key={field}>
            <label htmlFor={"audit-" + field}>{field.charAt(0).toUpperCase() + field.slice(1)}</label>
            <input
              id={"audit-" + field}
              value={draft[field]}
              placeholder={field === "action" ? "job.cancel" : field === "actor" ? "admin-token" : ""}
              onChange={(event) => setDraft({ ...draft, [field]: event.target.value })}
            />
          </div>
        ))}
        <button type="submit" className="secondary">
          Filter
        </button>
      </form>
      <ErrorNote error={entries.error} />
      <ListTable
        caption="Admin actions, newest first (the last 200 that match)"
        columns={["When", "Actor", "Action", "Target", "Outcome", "Detail"]}
        loaded={entries.loaded}
        empty={filtered ? "No entry matches these filters." : "No admin actions yet."}
        rows={entries.data}
        row={(entry) => (
          <tr key={entry.id} data-action={entry.action}>
            <td>
              <time dateTime={entry.at}>{new Date(entry.at).toLocaleString()}</time>
            </td>
            <td>{entry.actor}</td>
            <td>
              <code>{entry.action}</code>
            </td>
            <td>
              <code>{entry.target}</code>
            </td>
            <td>
              <span className={"badge " + (entry.outcome === "ok" ? "pass" : "fail")}>{entry.outcome}</span>
            </td>
            <td>
              <code className="detail">{Object.keys(entry.detail).length ? JSON.stringify(entry.detail) : ""}</code>
            </td>
          </tr>
        )}
      />
    </section>
  );
}
