import { type FormEvent, useEffect, useRef, useState } from "react";
import { type ChatMessage, type ServiceUsage, api, streamChat } from "./api";
import { ErrorNote } from "./ErrorNote";
import { ListTable } from "./ListTable";
import { usePolled } from "./usePolled";

const USAGE_REFRESH_MS = 5000;
const MAX_TOKENS = 256;

// The runners whose services are LLMs, called with the OpenAI API at /v1.
export const LLM_RUNNERS = ["llama.cpp"];

// A chat with the model through the OpenAI API at this origin, exactly as a client calls it:
// the operator's API key goes only into each call's Authorization header (the page keeps it in
// memory while it is open, never in storage), the answer streams in as it is generated, and an
// error comes back as the gateway or the engine worded it.
export function ChatPlayground({ model }: { model: string }) {
  const [key, setKey] = useState("");
  const [draft, setDraft] = useState("");
  const [messages, setMessages] = useState<ChatMessage[]>([]);
  const [answer, setAnswer] = useState<string | null>(null);
  const [failure, setFailure] = useState<{ code: string; message: string } | null>(null);
  const [figures, setFigures] = useState<string | null>(null);
  const stop = useRef<AbortController | null>(null);
  useEffect(() => () => stop.current?.abort(), []);

  async function send(event: FormEvent) {
    event.preventDefault();
    const content = draft.trim();
    if (!content || !key.trim() || answer !== null) return;
    const asked: ChatMessage[] = [...messages, { role: "user", content }];
    setMessages(asked);
    setDraft("");
    setFailure(null);
    setFigures(null);
    setAnswer("");
    const controller = new AbortController();
    stop.current = controller;
    const started = performance.now();
    let first: number | null = null;
    let text = "";
    await streamChat(
      key.trim(),
      model,
      asked,
      MAX_TOKENS,
      (told) => {
        if (told.kind === "text") {
          first ??= performance.now();
          text += told.text;
          setAnswer(text);
        } else if (told.kind === "error") {
          setFailure({ code: told.code, message: told.message });
        } else {
          const parts = [first !== null ? `first token after ${Math.round(first - started)} ms` : null];
          if (told.usage) parts.push(`${told.usage.prompt_tokens} prompt + ${told.usage.completion_tokens} completion tokens`);
          setFigures(parts.filter(Boolean).join(" · "));
        }
      },
      controller.signal,
    );
    if (text) {
      setMessages([...asked, { role: "assistant", content: text }]);
    } else {
      // Nothing came back: the question goes back to the box, not into the conversation.
      setMessages(messages);
      setDraft(content);
    }
    setAnswer(null);
    stop.current = null;
  }

  return (
    <section aria-labelledby="playground-heading">
      <h2 id="playground-heading">Chat playground</h2>
      <p className="help">
        Calls <code>/v1/chat/completions</code> at this address with model <code>{model}</code>, streaming, as any
        OpenAI client does. Paste one of its API keys (mint one under Access tokens); it is sent only with these calls
        and forgotten when you leave the page.
      </p>
      <form onSubmit={(event) => void send(event)}>
        <label htmlFor="playground-key">API key</label>
        <input
          id="playground-key"
          type="password"
          autoComplete="off"
          spellCheck={false}
          value={key}
          onChange={(event) => setKey(event.target.value)}
          placeholder="mfs_…"
        />
        <ol className="chat" data-testid="playground-chat" aria-live="polite">
          {messages.map((message, index) => (
            <li key={index} className={message.role} data-role={message.role}>
              <strong>{message.role === "user" ? "You" : model}:</strong> {message.content}
            </li>
          ))}
          {answer !== null && (
            <li className="assistant" data-role="streaming">
              <strong>{model}:</strong> {answer || "…"}
            </li>
          )}
        </ol>
        <label htmlFor="playground-message">Message</label>
        <textarea
          id="playground-message"
          rows={2}
          value={draft}
          onChange={(event) => setDraft(event.target.value)}
          placeholder="Ask something…"
        />
        <div className="actions start">
          <button type="submit" disabled={answer !== null || !key.trim() || !draft.trim()}>
            Send
          </button>
          {answer !== null && (
            <button type="button" className="secondary" onClick={() => stop.current?.abort()}>
              Stop
            </button>
          )}
          {messages.length > 0 && answer === null && (
            <button type="button" className="secondary" onClick={() => setMessages([])}>
              Clear
            </button>
          )}
        </div>
      </form>
      {figures && (
        <p className="help" data-testid="playground-figures">
          {figures}
        </p>
      )}
      {failure && (
        <p className="error" role="alert" data-testid="playground-error">
          <code>{failure.code}</code> {failure.message}
        </p>
      )}
    </section>
  );
}

// The service's tokens of the last day, per API key (its name and hint, never the key).
export function ServiceUsagePanel({ serviceId }: { serviceId: string }) {
  const polled = usePolled(api.serviceUsage(serviceId), null as ServiceUsage | null, USAGE_REFRESH_MS);
  const usage = polled.data;
  return (
    <section aria-labelledby="usage-heading">
      <h2 id="usage-heading">Usage (last 24 hours)</h2>
      <ErrorNote error={polled.error} />
      {usage && (
        <>
          <p data-testid="usage-total">
            {usage.requests} requests · {usage.prompt_tokens} prompt tokens · {usage.completion_tokens} completion tokens
          </p>
          <ListTable
            caption="Tokens per API key"
            columns={["Key", "Requests", "Prompt tokens", "Completion tokens"]}
            loaded={polled.loaded}
            empty="No calls in the last day."
            rows={usage.tokens}
            row={(row) => (
              <tr key={row.token_id} data-usage-token={row.token_id}>
                <td>
                  {row.name} <code>{row.hint}…</code>
                </td>
                <td>{row.requests}</td>
                <td>{row.prompt_tokens}</td>
                <td>{row.completion_tokens}</td>
              </tr>
            )}
          />
        </>
      )}
    </section>
  );
}
