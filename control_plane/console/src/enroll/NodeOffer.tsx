import { OFFER_FIELDS, type EnrollWizardState } from "./useEnrollWizard";

// Step 1's advanced settings: what the node offers and its idle exit, written into the `.env` as
// the agent's MODELFORGE_AGENT_* variables. Each left empty is left to the agent (detected, or
// its default) and gets no line.
export function NodeOffer({ wizard }: { wizard: EnrollWizardState }) {
  return (
    <details className="advanced">
      <summary>Advanced: what the node offers</summary>
      <p className="help" id="node-offer-help">
        Leave a field empty to let the node agent detect it (or use its default). Each value is written into the{" "}
        <code>.env</code> as its <code>MODELFORGE_AGENT_*</code> variable.
      </p>
      <div className="row">
        {OFFER_FIELDS.map((field) => (
          <div key={field.name}>
            <label htmlFor={`offer-${field.name}`}>{field.label}</label>
            <input
              id={`offer-${field.name}`}
              type="number"
              inputMode="numeric"
              step={1}
              min={field.min}
              max={field.max}
              placeholder={field.placeholder}
              value={wizard.offer[field.name]}
              onChange={(event) => wizard.setOfferField(field.name, event.target.value)}
              aria-describedby="node-offer-help"
            />
          </div>
        ))}
      </div>
    </details>
  );
}
