import { type ReactNode, useEffect, useId, useRef } from "react";

// A modal confirmation: Escape and Cancel change nothing; focus starts on Cancel, so Enter
// alone never does the dangerous thing.
export function Confirm(props: {
  title: string;
  children: ReactNode;
  action: string;
  onConfirm: () => void;
  onCancel: () => void;
  danger?: boolean;
}) {
  const dialog = useRef<HTMLDialogElement>(null);
  const titleId = useId();
  useEffect(() => {
    if (dialog.current && !dialog.current.open) dialog.current.showModal();
  }, []);
  return (
    <dialog
      ref={dialog}
      aria-labelledby={titleId}
      onCancel={(event) => {
        event.preventDefault();
        props.onCancel();
      }}
    >
      <h2 id={titleId}>{props.title}</h2>
      {props.children}
      <div className="actions">
        <button type="button" className="secondary" onClick={props.onCancel} autoFocus>
          Cancel
        </button>
        <button type="button" className={props.danger === false ? undefined : "danger"} onClick={props.onConfirm}>
          {props.action}
        </button>
      </div>
    </dialog>
  );
}
