import { ErrorNote } from "../ErrorNote";
import { ListTable } from "../ListTable";
import { CommandBox } from "./CommandBox";
import { StepActions } from "./StepActions";
import type { EnrollWizardState } from "./useEnrollWizard";

// Step 4: whether the node this enrollment made is ready, check by check, and (once it is
// claimed) the command that recreates its container without the token.
export function StepReadiness({ wizard }: { wizard: EnrollWizardState }) {
  const { enrollment, readiness, setup } = wizard;
  if (!enrollment) return null;
  return (
    <div className="readiness">
      <p>
        Readiness of node <code>{enrollment.node_id}</code> (this enrollment) ·{" "}
        <span className={"badge " + enrollment.state}>{enrollment.state}</span>
      </p>
      {readiness && (
        <>
          <p className={readiness.ready ? "ok" : "warning"} data-testid="readiness-verdict">
            {readiness.ready ? "Ready: every check passes." : "Not ready yet."}
          </p>
          <ListTable
            caption="Readiness checks"
            columns={["Check", "Status", "Detail", "Next step"]}
            rows={readiness.checks}
            row={(check) => (
              <tr key={check.name} data-check={check.name}>
                <td>{check.name}</td>
                <td>
                  <span className={"badge " + check.status}>{check.status}</span>
                </td>
                <td>{check.detail}</td>
                <td>{check.next_step}</td>
              </tr>
            )}
          />
        </>
      )}
      <ErrorNote error={wizard.error} />
      {enrollment.state === "claimed" && setup && (
        <CommandBox id="recreate-command" text={setup.recreate_command} rows={10} copyLabel="Copy recreation command">
          Container recreation command (removes the one-time token from the running container's environment;
          identity and credential are kept)
        </CommandBox>
      )}
      <StepActions
        onBack={() => wizard.goTo("start")}
        next="Check node readiness"
        onNext={wizard.checkReadiness}
        busy={wizard.busy}
      />
    </div>
  );
}
