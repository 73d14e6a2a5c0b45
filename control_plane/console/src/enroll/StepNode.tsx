import { EXPIRY_OPTIONS, type EnrollWizardState } from "./useEnrollWizard";
import { NodeOffer } from "./NodeOffer";
import { StepActions } from "./StepActions";

// Step 1: the node's name, how long its token lives, its accelerator, what it offers (advanced),
// and the fixed API origin.
export function StepNode({ wizard }: { wizard: EnrollWizardState }) {
  return (
    <form
      onSubmit={(event) => {
        event.preventDefault();
        wizard.goTo("image");
      }}
    >
      <label htmlFor="display-name">Display name</label>
      <input
        id="display-name"
        required
        maxLength={120}
        value={wizard.displayName}
        onChange={(event) => wizard.setDisplayName(event.target.value)}
        autoFocus
      />
      <fieldset>
        <legend>Token expiry</legend>
        {EXPIRY_OPTIONS.map((option) => (
          <label key={option.seconds} className="choice">
            <input
              type="radio"
              name="expiry"
              value={option.seconds}
              checked={wizard.expiry === option.seconds}
              onChange={() => wizard.setExpiry(option.seconds)}
            />
            {option.label}
          </label>
        ))}
      </fieldset>
      <fieldset>
        <legend>Accelerator</legend>
        {(["nvidia", "cpu"] as const).map((mode) => (
          <label key={mode} className="choice">
            <input
              type="radio"
              name="accelerator"
              value={mode}
              checked={wizard.accelerator === mode}
              onChange={() => wizard.setAccelerator(mode)}
            />
            {mode === "nvidia" ? "NVIDIA GPUs" : "CPU only"}
          </label>
        ))}
      </fieldset>
      <NodeOffer wizard={wizard} />
      <label htmlFor="api-origin">API origin (locked to this console)</label>
      <input id="api-origin" readOnly value={wizard.origin} aria-describedby="api-origin-help" />
      <p id="api-origin-help" className="help">
        The node agent connects out to exactly this origin; the control plane never dials the node.
      </p>
      {wizard.insecure && (
        <div className="warning" role="alert" aria-label="Plain HTTP">
          <p>
            This console is open over plain <code>http://</code>. The node's one-time token, its
            credential and every call it makes would cross the network <strong>unencrypted</strong>,
            readable and changeable by anyone on it. Serve the control plane over <code>https://</code>
            and open the console there, unless this network is a LAN you trust.
          </p>
          <label className="choice">
            <input
              type="checkbox"
              required
              checked={wizard.trustedLan}
              onChange={(event) => wizard.setTrustedLan(event.target.checked)}
            />
            This is a trusted LAN: let the node use plain http://
          </label>
        </div>
      )}
      <p className="facts">
        <span>Production eligible:</span> <output aria-label="Production eligible">false</output>{" "}
        <span className="help">(release-candidate enrollment: production_eligible=false)</span>
      </p>
      <StepActions next="Next: image" />
    </form>
  );
}
