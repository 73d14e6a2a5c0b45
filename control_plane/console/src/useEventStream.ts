import { useEffect, useState } from "react";
import { type ApiError, asApiError } from "./api";

interface Sequenced {
  seq: number;
}

// Follow a list of events from the first on: `fetch(after, signal)` answers the events after
// `after`, oldest first (a long poll may hold the answer until there are some). With an empty
// answer the next ask waits `pauseMs`; a refusal is shown and retried after 3 s. Keeps the
// latest `keep` events. `key` names what is followed: a new key starts again from nothing.
export function useEventStream<T extends Sequenced>(
  key: string,
  fetch: (after: number, signal: AbortSignal) => Promise<T[]>,
  pauseMs: number,
  keep = 2000,
) {
  const [events, setEvents] = useState<T[]>([]);
  const [error, setError] = useState<ApiError | null>(null);
  useEffect(() => {
    const stop = new AbortController();
    const pause = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
    let after = 0;
    setEvents([]);
    setError(null);
    void (async () => {
      while (!stop.signal.aborted) {
        try {
          const batch = await fetch(after, stop.signal);
          if (stop.signal.aborted) return;
          setError(null);
          const last = batch.at(-1);
          if (last) {
            after = last.seq;
            setEvents((seen) => [...seen, ...batch].slice(-keep));
          } else if (pauseMs > 0) {
            await pause(pauseMs);
          }
        } catch (caught) {
          if (stop.signal.aborted) return;
          setError(asApiError(caught));
          await pause(3000);
        }
      }
    })();
    return () => stop.abort();
    // `fetch` is a new function at every render; `key` says when it asks for something else.
  }, [key, pauseMs, keep]);
  return { events, error };
}
