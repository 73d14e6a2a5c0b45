// A step's buttons: Back, where the step has one, and the step's main action, which submits the
// step's form unless it is given an onNext.
export function StepActions(props: { next: string; onNext?: () => void; onBack?: () => void; busy?: boolean }) {
  return (
    <div className="actions">
      {props.onBack && (
        <button type="button" className="secondary" onClick={props.onBack}>
          Back
        </button>
      )}
      <button type={props.onNext ? "button" : "submit"} onClick={props.onNext} disabled={props.busy}>
        {props.next}
      </button>
    </div>
  );
}
