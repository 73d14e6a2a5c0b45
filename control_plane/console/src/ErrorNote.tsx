import type { ApiError } from "./api";

// Every refusal shows its code, what went wrong and the next step (never a stack trace).
export function ErrorNote({ error, id }: { error: ApiError | null; id?: string }) {
  if (!error) return null;
  return (
    <div className="error" role="alert" id={id}>
      <strong>{error.code}</strong>: {error.message}
      <div className="next-step">Next step: {error.nextStep}</div>
    </div>
  );
}
