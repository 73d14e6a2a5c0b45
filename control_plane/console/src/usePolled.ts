import { useCallback, useEffect, useRef, useState } from "react";
import { type ApiError, api, asApiError } from "./api";

// GET `path` now and every `intervalMs` (if given) while the component is shown; the latest
// answer, or the refusal that replaced it.
export function usePolled<T>(path: string, initial: T, intervalMs?: number) {
  const [data, setData] = useState<T>(initial);
  const [error, setError] = useState<ApiError | null>(null);
  const initialRef = useRef(initial);

  const reload = useCallback(async () => {
    const asked = path;
    try {
      const answer = await api.get<T>(asked);
      if (current.current === asked) {
        setData(answer);
        setError(null);
      }
    } catch (caught) {
      if (current.current === asked) setError(asApiError(caught));
    }
  }, [path]);

  // A new path starts from nothing: never show one node's data under another's name, and drop
  // answers that arrive for a path no longer shown.
  const current = useRef(path);
  useEffect(() => {
    current.current = path;
    setData(initialRef.current);
    setError(null);
  }, [path]);

  useEffect(() => {
    void reload();
    if (!intervalMs) return;
    const timer = window.setInterval(() => void reload(), intervalMs);
    return () => window.clearInterval(timer);
  }, [reload, intervalMs]);

  return { data, error, reload };
}
