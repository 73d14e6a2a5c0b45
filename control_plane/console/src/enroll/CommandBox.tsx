import { type ReactNode, useState } from "react";

export function CopyButton({ text, label, onCopied }: { text: string; label: string; onCopied?: () => void }) {
  const [copied, setCopied] = useState(false);
  return (
    <button
      type="button"
      className="secondary"
      onClick={() => {
        void navigator.clipboard?.writeText(text).then(
          () => {
            setCopied(true);
            onCopied?.();
          },
          () => setCopied(false),
        );
      }}
    >
      <span aria-live="polite">{copied ? "Copied" : label}</span>
    </button>
  );
}

// A generated command: labelled, read-only, selectable, with a copy button.
export function CommandBox(props: { id: string; text: string; rows: number; copyLabel: string; children: ReactNode }) {
  return (
    <>
      <label htmlFor={props.id}>{props.children}</label>
      <textarea id={props.id} readOnly rows={props.rows} value={props.text} spellCheck={false} />
      <CopyButton text={props.text} label={props.copyLabel} />
    </>
  );
}
