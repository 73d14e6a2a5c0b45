import { useEffect, useRef } from "react";
import { StepImage } from "./enroll/StepImage";
import { StepNode } from "./enroll/StepNode";
import { StepReadiness } from "./enroll/StepReadiness";
import { StepToken } from "./enroll/StepToken";
import { type Step, useEnrollWizard } from "./enroll/useEnrollWizard";

// Hardware → Enroll node: a modal dialog of four steps. The state, the one-time token included,
// lives in useEnrollWizard and goes when the dialog closes.

const STEPS: { id: Step; label: string }[] = [
  { id: "node", label: "1. Node" },
  { id: "image", label: "2. Image" },
  { id: "start", label: "3. Token and start" },
  { id: "readiness", label: "4. Readiness" },
];

export function EnrollWizard({ onClose }: { onClose: () => void }) {
  const dialog = useRef<HTMLDialogElement>(null);
  const wizard = useEnrollWizard();

  useEffect(() => {
    const element = dialog.current;
    if (element && !element.open) element.showModal();
  }, []);

  return (
    <dialog
      ref={dialog}
      className="wizard"
      aria-labelledby="wizard-title"
      onCancel={(event) => {
        event.preventDefault();
        onClose();
      }}
    >
      <div className="wizard-head">
        <h2 id="wizard-title">Enroll node</h2>
        <button type="button" className="secondary" onClick={onClose}>
          Close
        </button>
      </div>
      <ol className="steps" aria-label="Steps">
        {STEPS.map((item) => (
          <li key={item.id} aria-current={item.id === wizard.step ? "step" : undefined}>
            {item.label}
          </li>
        ))}
      </ol>
      {wizard.step === "node" && <StepNode wizard={wizard} />}
      {wizard.step === "image" && <StepImage wizard={wizard} />}
      {wizard.step === "start" && <StepToken wizard={wizard} />}
      {wizard.step === "readiness" && <StepReadiness wizard={wizard} />}
    </dialog>
  );
}
