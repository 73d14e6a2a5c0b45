import { useState } from "react";
import type { Enrollment } from "./api";
import { EnrollWizard } from "./EnrollWizard";
import { ErrorNote } from "./ErrorNote";
import { ago } from "./format";
import { usePolled } from "./usePolled";

// Hardware: the enrollments this control plane has minted, and the Enroll node wizard.
export function Hardware() {
  const { data: enrollments, error, reload } = usePolled<Enrollment[]>("/api/v1/admin/node-enrollments", []);
  const [wizardOpen, setWizardOpen] = useState(false);

  return (
    <section aria-labelledby="hardware-heading">
      <div className="title-row">
        <h1 id="hardware-heading">Hardware</h1>
        <button type="button" onClick={() => setWizardOpen(true)}>
          Enroll node
        </button>
      </div>
      <ErrorNote error={error} />
      <table className="list">
        <caption>Node enrollments (one-time tokens are never shown here)</caption>
        <thead>
          <tr>
            <th scope="col">Name</th>
            <th scope="col">State</th>
            <th scope="col">Node</th>
            <th scope="col">Created</th>
            <th scope="col">Expires</th>
            <th scope="col">Production eligible</th>
          </tr>
        </thead>
        <tbody>
          {enrollments.length === 0 && (
            <tr>
              <td colSpan={6}>No enrollments yet: use Enroll node.</td>
            </tr>
          )}
          {enrollments.map((row) => (
            <tr key={row.enrollment_id}>
              <td>{row.display_name}</td>
              <td>
                <span className={"badge " + row.state}>{row.state}</span>
              </td>
              <td>
                <code>{row.node_id}</code>
              </td>
              <td>{ago(row.created_at)}</td>
              <td>{new Date(row.expires_at).toLocaleString()}</td>
              <td>{String(row.production_eligible)}</td>
            </tr>
          ))}
        </tbody>
      </table>
      {wizardOpen && (
        <EnrollWizard
          onClose={() => {
            setWizardOpen(false);
            void reload();
          }}
        />
      )}
    </section>
  );
}
