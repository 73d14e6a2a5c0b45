import { useEffect, useRef } from "react";
import { CopyButton } from "./enroll/CommandBox";

// Empties the clipboard (best effort: the browser may refuse; clipboard histories are out of reach).
function clearClipboard() {
  void navigator.clipboard?.writeText("").catch(() => undefined);
}

// A secret shown once, just after it was made (a service's access token, a personal key): the
// warning, the value, a copy button, and the button that hides it. A value copied with the
// button is emptied from the clipboard when the reveal goes (hidden, or the screen left).
export function RevealOnce(props: {
  title: string;
  // Its name in the buttons ("Copy token") and, in full, the value's label ("Access token").
  what: string;
  label: string;
  hint: string;
  secret: string;
  testId: string;
  onHide: () => void;
}) {
  const copied = useRef(false);
  useEffect(
    () => () => {
      if (copied.current) clearClipboard();
    },
    [],
  );
  return (
    <section aria-label={props.title} className="token-box">
      <h3>{props.title}</h3>
      <p className="warning">
        Copy it now: you will not see it again. The control plane keeps only its digest and its hint{" "}
        <code>{props.hint}</code>.
      </p>
      <output className="secret" data-testid={props.testId} aria-label={props.label}>
        {props.secret}
      </output>
      <div className="actions start">
        <CopyButton text={props.secret} label={`Copy ${props.what.toLowerCase()}`} onCopied={() => (copied.current = true)} />
        <button type="button" onClick={props.onHide}>
          I have kept it: hide the {props.what.toLowerCase()}
        </button>
      </div>
      <p className="help">Hiding it also empties the clipboard if the button copied it: paste it where it belongs first.</p>
    </section>
  );
}
