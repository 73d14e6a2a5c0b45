//! The tokens of an OpenAI call's answer, counted at the gateway as the engine reports them
//! (issue 43: usage per key and service, `control_plane/gateway/usage.py` keeps it).
//!
//! The engine's own count is the answer's `usage` (`prompt_tokens`, `completion_tokens`): in a
//! whole JSON answer at its end, in a stream as a last event with no `choices`, which engines
//! send only when asked (`stream_options.include_usage`). `openai.rs` asks for it on every
//! streamed call; when the client did not ask, that event is taken out of what it receives
//! (`strip`), so the client sees the stream it asked for.
//!
//! A stream is passed on event by event (an event ends at a blank line): each complete event
//! goes to the client at once, a partial one waits for its end. An event larger than
//! `MAX_EVENT` is passed on unread (the count is then the engine's last one seen, if any). A
//! whole answer passes as it comes; a copy of at most `MAX_WHOLE` bytes is read at its end.
//!
//! A stream whose replica fails before its end gets one last event in OpenAI's error shape
//! (`broken`) after its last complete event, and then its connection is cut: an OpenAI client
//! raises that error rather than waiting or taking the cut answer for a whole one.

use std::time::Instant;

use bytes::{Bytes, BytesMut};
use serde_json::Value;

/// The largest stream event read for a count; a larger one passes unread.
const MAX_EVENT: usize = 256 * 1024;
/// The largest whole answer read for its count.
const MAX_WHOLE: usize = 1024 * 1024;
/// The event that ends a stream whose replica failed (OpenAI's error shape).
const BROKEN_EVENT: &[u8] = b"data: {\"error\":{\"message\":\"The replica generating this \
answer failed before its end; the answer is incomplete. Retry the request.\",\"type\":\
\"server_error\",\"param\":null,\"code\":\"replica_failed\"}}\n\n";

/// Prompt and completion tokens, as the engine counted them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub prompt: u64,
    pub completion: u64,
}

/// What reads one answer.
pub struct Meter {
    /// Take the engine's usage event out of the stream (the client did not ask for it).
    strip: bool,
    /// None until the answer's head said which kind it is.
    events: Option<bool>,
    pending: BytesMut,
    /// An event too large to read: passed on as it comes until its end.
    passing: bool,
    pub usage: Option<Usage>,
    /// When the call came, and when a stream's first and last events went to the client.
    started: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
}

impl Meter {
    pub fn new(strip: bool) -> Meter {
        Meter {
            strip,
            events: None,
            pending: BytesMut::new(),
            passing: false,
            usage: None,
            started: Instant::now(),
            first: None,
            last: None,
        }
    }

    /// A stream's seconds from the call to its first event (the engine's first token: it
    /// writes none before) and from its first event to its last; None for a whole answer.
    pub fn timing(&self) -> Option<(f64, f64)> {
        let (first, last) = (self.first?, self.last?);
        let to_first = first.duration_since(self.started).as_secs_f64();
        Some((to_first, last.duration_since(first).as_secs_f64()))
    }

    /// The answer's `Content-Type`: server-sent events are read event by event.
    pub fn begin(&mut self, content_type: Option<&[u8]>) {
        let streamed = content_type
            .map(|value| value.to_ascii_lowercase().starts_with(b"text/event-stream"))
            .unwrap_or(false);
        self.events = Some(streamed);
    }

    /// A piece of the answer; what goes to the client now.
    pub fn feed(&mut self, piece: Bytes) -> Bytes {
        match self.events {
            Some(true) => self.feed_events(piece),
            _ => {
                if self.pending.len() + piece.len() <= MAX_WHOLE {
                    self.pending.extend_from_slice(&piece);
                } else {
                    self.pending = BytesMut::new();
                    self.passing = true;
                }
                piece
            }
        }
    }

    /// The answer ended: what is left for the client (a stream's last partial event).
    pub fn finish(&mut self) -> Bytes {
        if self.events == Some(true) {
            return self.pending.split().freeze();
        }
        if !self.passing {
            if let Ok(answer) = serde_json::from_slice::<Value>(&self.pending) {
                self.read_usage(&answer);
            }
        }
        self.pending = BytesMut::new();
        Bytes::new()
    }

    /// The replica failed before the answer's end: for a stream, the event that says so (the
    /// partial event held back is dropped). None for a whole answer, or while an oversized
    /// event is passing (the client is inside it: only the cut connection can tell).
    pub fn broken(&mut self) -> Option<Bytes> {
        if self.events != Some(true) || self.passing {
            return None;
        }
        self.pending.clear();
        Some(Bytes::from_static(BROKEN_EVENT))
    }

    fn feed_events(&mut self, piece: Bytes) -> Bytes {
        if self.passing {
            // Pass the oversized event on until its blank line, then read again.
            return match find_end(&piece) {
                None => piece,
                Some(end) => {
                    self.passing = false;
                    let rest = piece.slice(end..);
                    let mut out = BytesMut::from(&piece[..end]);
                    out.extend_from_slice(&self.feed_events(rest));
                    out.freeze()
                }
            };
        }
        self.pending.extend_from_slice(&piece);
        let mut out = BytesMut::new();
        while let Some(end) = find_end(&self.pending) {
            let event = self.pending.split_to(end);
            if self.keep(&event) {
                out.extend_from_slice(&event);
            }
        }
        if self.pending.len() > MAX_EVENT {
            self.passing = true;
            out.extend_from_slice(&self.pending.split());
        }
        if !out.is_empty() {
            let now = Instant::now();
            self.first.get_or_insert(now);
            self.last = Some(now);
        }
        out.freeze()
    }

    /// Read one event; whether it goes to the client.
    fn keep(&mut self, event: &[u8]) -> bool {
        let text = match std::str::from_utf8(event) {
            Ok(text) => text,
            Err(_) => return true,
        };
        let mut data = String::new();
        for line in text.lines() {
            if let Some(value) = line.strip_prefix("data:") {
                data.push_str(value.strip_prefix(' ').unwrap_or(value));
            }
        }
        if !data.contains("\"usage\"") {
            return true;
        }
        let parsed: Value = match serde_json::from_str(&data) {
            Ok(parsed) => parsed,
            Err(_) => return true,
        };
        let before = self.usage;
        self.read_usage(&parsed);
        let usage_only = parsed
            .get("choices")
            .and_then(Value::as_array)
            .map(Vec::is_empty)
            .unwrap_or(false);
        !(self.strip && usage_only && self.usage != before)
    }

    fn read_usage(&mut self, answer: &Value) {
        let usage = match answer.get("usage") {
            Some(usage) if usage.is_object() => usage,
            _ => return,
        };
        let count = |name: &str| usage.get(name).and_then(Value::as_u64);
        // An embeddings answer counts its input alone (no `completion_tokens`).
        if let Some(prompt) = count("prompt_tokens") {
            let completion = count("completion_tokens").unwrap_or(0);
            self.usage = Some(Usage { prompt, completion });
        }
    }
}

/// Where the first event in `bytes` ends (after its blank line), if it is complete.
fn find_end(bytes: &[u8]) -> Option<usize> {
    let lf = bytes
        .windows(2)
        .position(|pair| pair == b"\n\n")
        .map(|at| at + 2);
    let crlf = bytes
        .windows(4)
        .position(|quad| quad == b"\r\n\r\n")
        .map(|at| at + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DELTA: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n";
    const USAGE: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3,\"total_tokens\":10}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    fn stream(strip: bool, pieces: &[&[u8]]) -> (Vec<u8>, Option<Usage>) {
        let mut meter = Meter::new(strip);
        meter.begin(Some(b"text/event-stream; charset=utf-8"));
        let mut out = Vec::new();
        for piece in pieces {
            out.extend_from_slice(&meter.feed(Bytes::copy_from_slice(piece)));
        }
        out.extend_from_slice(&meter.finish());
        (out, meter.usage)
    }

    #[test]
    fn a_broken_stream_ends_with_an_error_event_after_its_last_whole_one() {
        let mut meter = Meter::new(false);
        meter.begin(Some(b"text/event-stream"));
        let sent = meter.feed(Bytes::from(format!("{}data: {{\"choi", DELTA)));
        assert_eq!(&sent[..], DELTA.as_bytes());
        let last = meter.broken().expect("a stream's error event");
        let text = std::str::from_utf8(&last).unwrap();
        let data = text
            .strip_prefix("data: ")
            .unwrap()
            .strip_suffix("\n\n")
            .unwrap();
        let error: Value = serde_json::from_str(data).unwrap();
        assert_eq!(error["error"]["code"], "replica_failed");
        assert_eq!(error["error"]["type"], "server_error");
        assert!(meter.finish().is_empty()); // the partial event is gone
        let (to_first, between) = meter.timing().expect("a stream's timing");
        assert!(to_first >= 0.0 && between >= 0.0);

        let mut whole = Meter::new(false);
        whole.begin(Some(b"application/json"));
        whole.feed(Bytes::from_static(b"{\"choices\""));
        assert!(whole.broken().is_none()); // a cut JSON answer is told by the cut alone
        assert!(whole.timing().is_none());
    }

    #[test]
    fn a_stream_is_counted_and_its_usage_taken_out_when_not_asked() {
        let whole = format!("{}{}{}{}", DELTA, DELTA, USAGE, DONE);
        let (out, usage) = stream(true, &[whole.as_bytes()]);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("{}{}{}", DELTA, DELTA, DONE)
        );
        assert_eq!(
            usage,
            Some(Usage {
                prompt: 7,
                completion: 3
            })
        );
        let (kept, usage) = stream(false, &[whole.as_bytes()]);
        assert_eq!(kept, whole.as_bytes());
        assert_eq!(
            usage,
            Some(Usage {
                prompt: 7,
                completion: 3
            })
        );
    }

    #[test]
    fn events_split_anywhere_pass_whole_and_in_order() {
        let whole = format!("{}{}{}", DELTA, USAGE, DONE);
        let bytes = whole.as_bytes();
        for cut in 1..bytes.len() {
            let (out, usage) = stream(true, &[&bytes[..cut], &bytes[cut..]]);
            assert_eq!(
                String::from_utf8(out).unwrap(),
                format!("{}{}", DELTA, DONE)
            );
            assert_eq!(
                usage,
                Some(Usage {
                    prompt: 7,
                    completion: 3
                })
            );
        }
    }

    #[test]
    fn each_complete_event_goes_at_once() {
        let mut meter = Meter::new(true);
        meter.begin(Some(b"text/event-stream"));
        assert_eq!(&meter.feed(Bytes::from(DELTA))[..], DELTA.as_bytes());
        assert!(meter.feed(Bytes::from_static(b"data: {\"cho")).is_empty());
    }

    #[test]
    fn an_oversized_event_passes_unread() {
        let big = format!("data: {}\n\n", "x".repeat(MAX_EVENT + 10));
        let whole = format!("{}{}{}", big, USAGE, DONE);
        let pieces: Vec<&[u8]> = whole.as_bytes().chunks(4096).collect();
        let (out, usage) = stream(true, &pieces);
        assert_eq!(String::from_utf8(out).unwrap(), format!("{}{}", big, DONE));
        assert_eq!(
            usage,
            Some(Usage {
                prompt: 7,
                completion: 3
            })
        );
    }

    #[test]
    fn a_whole_answer_is_counted_at_its_end() {
        let answer = br#"{"choices":[{"message":{"content":"Hi"}}],"usage":{"prompt_tokens":5,"completion_tokens":2}}"#;
        let mut meter = Meter::new(false);
        meter.begin(Some(b"application/json"));
        let mut out = Vec::new();
        for piece in answer.chunks(7) {
            out.extend_from_slice(&meter.feed(Bytes::copy_from_slice(piece)));
        }
        out.extend_from_slice(&meter.finish());
        assert_eq!(out, answer.to_vec());
        assert_eq!(
            meter.usage,
            Some(Usage {
                prompt: 5,
                completion: 2
            })
        );
    }

    #[test]
    fn an_answer_without_usage_counts_nothing() {
        let (out, usage) = stream(true, &[DELTA.as_bytes(), DONE.as_bytes()]);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("{}{}", DELTA, DONE)
        );
        assert_eq!(usage, None);
    }

    #[test]
    fn an_embeddings_answer_counts_its_input() {
        let mut meter = Meter::new(false);
        meter.begin(Some(b"application/json"));
        let body = r#"{"data":[{"embedding":[0.1]}],"usage":{"prompt_tokens":5,"total_tokens":5}}"#;
        meter.feed(Bytes::from(body));
        meter.finish();
        let counted = Usage {
            prompt: 5,
            completion: 0,
        };
        assert_eq!(meter.usage, Some(counted));
    }
}
