import { useState } from "react";
import { api } from "./api";
import { EnrollWizard } from "./EnrollWizard";
import { ErrorNote } from "./ErrorNote";
import { ago } from "./format";
import { ListTable } from "./ListTable";
import { usePolled } from "./usePolled";

// Hardware: the enrollments this control plane has minted, and the Enroll node wizard.
export function Hardware() {
  const { data: enrollments, error, loaded, reload } = usePolled(api.enrollments, []);
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
      <ListTable
        caption="Node enrollments (one-time tokens are never shown here)"
        columns={["Name", "State", "Node", "Created", "Expires", "Production eligible"]}
        empty="No enrollments yet: use Enroll node."
        loaded={loaded}
        rows={enrollments}
        row={(row) => (
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
        )}
      />
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
