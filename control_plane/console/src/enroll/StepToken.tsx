import { ErrorNote } from "../ErrorNote";
import { clock } from "../format";
import { CommandBox, CopyButton } from "./CommandBox";
import { StepActions } from "./StepActions";
import { EXPIRY_OPTIONS, type EnrollWizardState, type Hidden } from "./useEnrollWizard";

const HIDDEN_REASON: Record<Hidden, string> = {
  readiness: "The token was hidden when you checked readiness. It was shown once and cannot be shown again.",
  revoked: "The unused token was revoked: it can no longer enroll a node.",
  expired: "The token expired: it can no longer enroll a node. Start the wizard again for a new one.",
};

// Step 3: create the enrollment, reveal its one-time token once, and give the node's start
// command; from here the unused token can be revoked and the node's readiness checked.
export function StepToken({ wizard }: { wizard: EnrollWizardState }) {
  const { image, enrollment, setup } = wizard;
  if (!image) return null;
  return (
    <div className="start">
      <p>
        Image <code>{image.image}</code>, checked against {image.checked_against}.
      </p>
      {!enrollment && (
        <>
          <p>
            Create the one-time enrollment token for <strong>{wizard.displayName}</strong> (expires{" "}
            {EXPIRY_OPTIONS.find((o) => o.seconds === wizard.expiry)?.label} after creation).
          </p>
          <ErrorNote error={wizard.error} />
          <StepActions
            onBack={() => wizard.goTo("image")}
            next="Create enrollment token"
            onNext={wizard.createEnrollment}
            busy={wizard.busy}
          />
        </>
      )}
      {enrollment && (
        <>
          <section aria-labelledby="token-heading" className="token-box">
            <h3 id="token-heading">One-time enrollment token</h3>
            {wizard.token ? (
              <>
                <p className="warning">
                  Shown once, only while this wizard is open. Enter it at the start command's hidden prompt on
                  the node.
                </p>
                <output className="secret" data-testid="enrollment-token" aria-label="Enrollment token">
                  {wizard.token}
                </output>
                <CopyButton text={wizard.token} label="Copy token" onCopied={wizard.tokenCopied} />
              </>
            ) : (
              <p data-testid="token-hidden">{wizard.hidden ? HIDDEN_REASON[wizard.hidden] : "Hidden."}</p>
            )}
            {enrollment.state === "pending" && (
              <p role="timer" aria-live="off" data-testid="countdown">
                Token expires in {clock(wizard.remaining)}
              </p>
            )}
            <p>
              Node ID <code data-testid="node-id">{enrollment.node_id}</code> · enrollment{" "}
              <span className={"badge " + enrollment.state}>{enrollment.state}</span>
            </p>
          </section>
          {setup && (enrollment.state === "pending" || enrollment.state === "claimed") && (
            <>
              <label htmlFor="env-file">
                Generated <code>.env</code> (non-secret settings; the start command writes it as{" "}
                <code>modelforge-node.env</code>)
              </label>
              <textarea id="env-file" readOnly rows={8} value={setup.env_file} spellCheck={false} />
              <CommandBox id="start-command" text={setup.start_command} rows={12} copyLabel="Copy start command">
                Start command (paste into Bash in the release's <code>compose/</code> folder)
              </CommandBox>
            </>
          )}
          <ErrorNote error={wizard.error} />
          <div className="actions">
            {!setup && enrollment.state === "pending" && (
              <button type="button" className="secondary" onClick={wizard.regenerateSetup} disabled={wizard.busy}>
                Generate the start command again
              </button>
            )}
            {enrollment.state === "pending" && (
              <button type="button" className="danger" onClick={wizard.revoke} disabled={wizard.busy}>
                Revoke unused token
              </button>
            )}
            <button type="button" onClick={wizard.checkReadiness} disabled={wizard.busy}>
              Check node readiness
            </button>
          </div>
        </>
      )}
    </div>
  );
}
