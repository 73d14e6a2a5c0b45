import { useCallback, useEffect, useRef, useState } from "react";
import { type ApiError, asApiError, read, type Resource } from "./api";

// Read `resource` (from api.ts) now and every `intervalMs` (if given) while the component is
// shown; the latest answer, or the refusal that replaced it, and whether an answer (or a
// refusal) came at all yet (`loaded`), so a screen can tell "loading" from "empty".
export function usePolled<T>(resource: Resource<T>, initial: T, intervalMs?: number) {
  const [data, setData] = useState<T>(initial);
  const [error, setError] = useState<ApiError | null>(null);
  const [loaded, setLoaded] = useState(false);
  const initialRef = useRef(initial);

  const reload = useCallback(async () => {
    const asked = resource;
    try {
      const answer = await read(asked);
      if (current.current === asked) {
        setData(answer);
        setError(null);
        setLoaded(true);
      }
    } catch (caught) {
      if (current.current === asked) {
        setError(asApiError(caught));
        setLoaded(true);
      }
    }
  }, [resource]);

  // A new resource starts from nothing: never show one node's data under another's name, and
  // drop answers that arrive for a resource no longer shown.
  const current = useRef<Resource<T>>(resource);
  useEffect(() => {
    current.current = resource;
    setData(initialRef.current);
    setError(null);
    setLoaded(false);
  }, [resource]);

  useEffect(() => {
    void reload();
    if (!intervalMs) return;
    const timer = window.setInterval(() => void reload(), intervalMs);
    return () => window.clearInterval(timer);
  }, [reload, intervalMs]);

  return { data, error, loaded, reload };
}
