//! The control channel: the front's line to the control plane (Python), which makes every
//! decision the front does not (a tunnel's credential, a gateway request's token, rate limit,
//! admission and replica, its metrics).
//!
//! A unix stream socket carrying newline-delimited JSON objects both ways. The front asks
//! (`ask`: the message gets an `"id"`, the reply carries the same one) and tells (`tell`: an
//! event, no reply); the control plane also pushes (`{"op":"close",...}`: close a node's
//! tunnel). Messages the front sends are written as text the caller already built (no JSON
//! tree per message), each one line; one writer task writes whatever is queued in one `write`
//! and flushes once the queue is empty, so a burst of requests costs one system call.
//!
//! The front connects at start, retrying every 100 ms until the control plane listens, and
//! again whenever the connection is lost. The lines waiting for the writer are bounded in bytes
//! (`MAX_QUEUED`): past it an ask fails at once (`Lost`: 503) and an event is dropped, rather
//! than buffering for a control plane that does not read. A loss fails every pending ask (`Lost`: the gateway
//! answers 503) and closes every tunnel (1001): the control plane that comes back knows none of
//! them, and the agents reconnect at once.

use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};

use crate::fast::Fast;
use crate::hub::Hub;
use crate::log;
use crate::meter::Usage;

/// How long to wait before connecting again.
const RETRY: Duration = Duration::from_millis(100);
/// The longest line read from the control plane (a reply carries at most an OPEN payload and
/// an answer's body: far less).
const MAX_LINE: usize = 4 * 1024 * 1024;
/// The most bytes of lines waiting for the writer.
const MAX_QUEUED: usize = 16 * 1024 * 1024;

/// The control channel is down (not connected, or lost while the ask waited).
#[derive(Debug)]
pub struct Lost;

/// One message on its way out: `text` is a JSON object (`{...}`); an ask's `id` is written
/// into it as its first member.
struct Line {
    id: Option<u64>,
    text: String,
}

/// What the connection's tasks and the askers share (never held across an await).
struct State {
    /// The writer's queue while connected (its bytes counted in `Control::queued`); None
    /// while down.
    out: Option<mpsc::UnboundedSender<Line>>,
    next_id: u64,
    /// Each waiting ask, by id.
    pending: HashMap<u64, Pending>,
}

/// A waiting ask: where its reply goes.
struct Pending {
    reply: oneshot::Sender<Value>,
    /// What a reply that finds its asker gone still needs.
    orphan: Orphan,
}

#[derive(Clone, Copy)]
enum Orphan {
    Ignored,
    /// A grant's ticket is ended (`Control::ask_request`).
    EndsTicket,
    /// An accepted tunnel is reported closed (`Control::ask_tunnel`).
    ClosesTunnel,
}

/// The control channel's client (one per process, shared by every request).
pub struct Control {
    state: Mutex<State>,
    /// Bytes of the lines queued and not yet written.
    queued: Arc<AtomicUsize>,
    hub: Arc<Hub>,
    fast: Arc<Fast>,
}

impl Control {
    /// Start connecting to the socket at `path` (and keep connected) on the current runtime.
    pub fn start(path: String, hub: Arc<Hub>, fast: Arc<Fast>) -> Arc<Control> {
        let control = Arc::new(Control {
            state: Mutex::new(State {
                out: None,
                next_id: 1,
                pending: HashMap::new(),
            }),
            queued: Arc::new(AtomicUsize::new(0)),
            hub,
            fast,
        });
        tokio::spawn(control.clone().run(path));
        control
    }

    /// Send `text` (a JSON object without `"id"`) and wait for the reply. `Err(Lost)` at once
    /// while the channel is down, or when it is lost before the reply comes.
    pub async fn ask(&self, text: String) -> Result<Value, Lost> {
        self.ask_with(text, Orphan::Ignored).await
    }

    /// `ask` a gateway `request`: should its asker be gone when the reply comes (its client
    /// hung up while the control plane decided), a grant's ticket is ended (`done`, 499
    /// `client_gone`) here, since no request is left to end it.
    pub async fn ask_request(&self, text: String) -> Result<Value, Lost> {
        self.ask_with(text, Orphan::EndsTicket).await
    }

    /// `ask` about an agent's `tunnel`: should its asker be gone when an acceptance comes (the
    /// agent hung up before its 101), the node's tunnel is reported closed here.
    pub async fn ask_tunnel(&self, text: String) -> Result<Value, Lost> {
        self.ask_with(text, Orphan::ClosesTunnel).await
    }

    async fn ask_with(&self, text: String, orphan: Orphan) -> Result<Value, Lost> {
        let (reply, answer) = oneshot::channel();
        {
            let mut state = self.state.lock().unwrap();
            let out = match &state.out {
                Some(out) => out.clone(),
                None => return Err(Lost),
            };
            if !self.count(&text) {
                return Err(Lost);
            }
            let id = state.next_id;
            state.next_id += 1;
            if out.send(Line { id: Some(id), text }).is_err() {
                return Err(Lost);
            }
            state.pending.insert(id, Pending { reply, orphan });
        }
        answer.await.map_err(|_| Lost)
    }

    /// Send an event (a JSON object); dropped while the channel is down (the control plane
    /// that comes back starts afresh).
    pub fn tell(&self, text: String) {
        let state = self.state.lock().unwrap();
        if let Some(out) = &state.out {
            if self.count(&text) {
                let _ = out.send(Line { id: None, text });
            }
        }
    }

    /// Count a line into the writer's queue; false (not counted) past `MAX_QUEUED`.
    fn count(&self, text: &str) -> bool {
        let size = text.len() + 32;
        if self.queued.fetch_add(size, Ordering::AcqRel) + size > MAX_QUEUED {
            self.queued.fetch_sub(size, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// Connect, serve the connection until it is lost, and again, for the process's life.
    async fn run(self: Arc<Self>, path: String) {
        let mut reported = false;
        loop {
            let stream = match UnixStream::connect(&path).await {
                Ok(stream) => stream,
                Err(error) => {
                    if !reported {
                        log(
                            "info",
                            &format!(
                                "waiting for the control channel ({:?}); retrying every 100 ms",
                                error.kind()
                            ),
                        );
                        reported = true;
                    }
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
            };
            reported = false;
            log("info", "the control channel is connected");
            let (read, write) = stream.into_split();
            let (out, queue) = mpsc::unbounded_channel();
            self.queued.store(0, Ordering::Release);
            self.state.lock().unwrap().out = Some(out);
            let mut writer = tokio::spawn(write_loop(write, queue, self.queued.clone()));
            tokio::select! {
                why = self.read_loop(read) => log("warning", &format!("the control channel was lost ({})", why)),
                _ = &mut writer => log("warning", "the control channel was lost (a write failed)"),
            }
            writer.abort();
            let pending = {
                let mut state = self.state.lock().unwrap();
                state.out = None;
                std::mem::take(&mut state.pending)
            };
            // Dropping the reply slots fails every waiting ask with `Lost`.
            drop(pending);
            self.hub.close_all(1001, "the control plane restarted");
            self.fast.forget();
            tokio::time::sleep(RETRY).await;
        }
    }

    /// Read the control plane's lines until the connection ends; returns why (for the log).
    async fn read_loop(&self, read: OwnedReadHalf) -> String {
        let mut reader = BufReader::with_capacity(64 * 1024, read);
        let mut line = Vec::with_capacity(4096);
        loop {
            line.clear();
            match (&mut reader)
                .take(MAX_LINE as u64)
                .read_until(b'\n', &mut line)
                .await
            {
                Ok(0) => return "closed".into(),
                Ok(_) if line.last() != Some(&b'\n') => {
                    return if line.len() >= MAX_LINE {
                        "a line too long".into()
                    } else {
                        "closed inside a line".into()
                    };
                }
                Ok(_) => {}
                Err(error) => return format!("{:?}", error.kind()),
            }
            match serde_json::from_slice::<Value>(&line) {
                Ok(message) => self.dispatch(message),
                Err(_) => log("warning", "a control line that is not JSON; ignored"),
            }
        }
    }

    /// One message from the control plane: a reply to its ask, or a push.
    fn dispatch(&self, message: Value) {
        if let Some(id) = message.get("id").and_then(Value::as_u64) {
            let pending = self.state.lock().unwrap().pending.remove(&id);
            if let Some(pending) = pending {
                if let Err(message) = pending.reply.send(message) {
                    self.orphaned(pending.orphan, message);
                }
            }
            return;
        }
        match message.get("op").and_then(Value::as_str) {
            Some("routes") => self.fast.set_routes(&message),
            Some("close") => {
                let node = message.get("node").and_then(Value::as_str).unwrap_or("");
                let code = message.get("code").and_then(Value::as_u64).unwrap_or(1000) as u16;
                let reason = message.get("reason").and_then(Value::as_str).unwrap_or("");
                self.hub.close(node, code, reason);
            }
            _ => log("warning", "an unknown control message; ignored"),
        }
    }

    /// A reply whose asker went away first (its client hung up while the control plane
    /// decided): what the control plane counts on must still be told, exactly once.
    fn orphaned(&self, orphan: Orphan, reply: Value) {
        match orphan {
            Orphan::Ignored => {}
            Orphan::EndsTicket => {
                if let (Some(_), Some(ticket)) = (reply.get("open"), reply.get("ticket")) {
                    self.tell(done_line(ticket, 499, "client_gone", None, None));
                }
            }
            Orphan::ClosesTunnel => {
                if let Some(node) = reply.get("node").and_then(Value::as_str) {
                    if !self.hub.connected(node) {
                        self.tell(tunnel_closed_line(
                            node,
                            "the agent went away before its 101",
                        ));
                    }
                }
            }
        }
    }
}

/// The `done` event for `ticket` (the control plane's own value, echoed).
pub fn done_line(
    ticket: &Value,
    status: u16,
    error: &str,
    usage: Option<Usage>,
    timing: Option<(f64, f64)>,
) -> String {
    let mut line = format!(
        r#"{{"op":"done","ticket":{},"status":{},"error":"{}""#,
        ticket, status, error
    );
    if let Some(usage) = usage {
        line.push_str(&format!(
            r#","usage":[{},{}]"#,
            usage.prompt, usage.completion
        ));
    }
    if let Some((to_first, between)) = timing {
        line.push_str(&format!(r#","timing":[{:.6},{:.6}]"#, to_first, between));
    }
    line.push('}');
    line
}

/// The `tunnel_closed` event for `node`.
pub fn tunnel_closed_line(node: &str, why: &str) -> String {
    let mut event = String::with_capacity(64 + node.len() + why.len());
    event.push_str("{\"op\":\"tunnel_closed\",\"node\":");
    push_str(&mut event, node);
    event.push_str(",\"why\":");
    push_str(&mut event, why);
    event.push('}');
    event
}

/// Write each queued line, as many as are waiting in one go, flushing when none is left.
async fn write_loop(
    write: OwnedWriteHalf,
    mut queue: mpsc::UnboundedReceiver<Line>,
    queued: Arc<AtomicUsize>,
) {
    let mut writer = BufWriter::with_capacity(64 * 1024, write);
    while let Some(mut line) = queue.recv().await {
        loop {
            if write_line(&mut writer, &line).await.is_err() {
                return;
            }
            queued.fetch_sub(line.text.len() + 32, Ordering::AcqRel);
            line = match queue.try_recv() {
                Ok(next) => next,
                Err(_) => break,
            };
        }
        if writer.flush().await.is_err() {
            return;
        }
    }
}

async fn write_line(writer: &mut BufWriter<OwnedWriteHalf>, line: &Line) -> std::io::Result<()> {
    match line.id {
        Some(id) => {
            // `{"id":N,` then the message's members (its text without the opening brace).
            let mut head = [0u8; 32];
            let mut cursor = std::io::Cursor::new(&mut head[..]);
            write!(cursor, "{{\"id\":{}", id)?;
            let size = cursor.position() as usize;
            writer.write_all(&head[..size]).await?;
            let rest = &line.text[1..];
            if !rest.starts_with('}') {
                writer.write_all(b",").await?;
            }
            writer.write_all(rest.as_bytes()).await?;
        }
        None => writer.write_all(line.text.as_bytes()).await?,
    }
    writer.write_all(b"\n").await
}

/// Append `text` to `out` as a JSON string (quoted, escaped).
pub fn push_str(out: &mut String, text: &str) {
    out.push('"');
    let mut start = 0;
    for (at, byte) in text.bytes().enumerate() {
        if byte >= 0x20 && byte != b'"' && byte != b'\\' {
            continue;
        }
        out.push_str(&text[start..at]);
        push_escape(out, byte);
        start = at + 1;
    }
    out.push_str(&text[start..]);
    out.push('"');
}

/// Append the bytes of a header value to `out` as a JSON string, each byte one character
/// (Latin-1, as the Python end reads header bytes).
pub fn push_latin1(out: &mut String, bytes: &[u8]) {
    match std::str::from_utf8(bytes) {
        Ok(text) if text.is_ascii() => push_str(out, text),
        _ => {
            out.push('"');
            for &byte in bytes {
                if byte >= 0x20 && byte != b'"' && byte != b'\\' {
                    out.push(byte as char);
                } else {
                    push_escape(out, byte);
                }
            }
            out.push('"');
        }
    }
}

fn push_escape(out: &mut String, byte: u8) {
    match byte {
        b'"' => out.push_str("\\\""),
        b'\\' => out.push_str("\\\\"),
        b'\n' => out.push_str("\\n"),
        b'\r' => out.push_str("\\r"),
        b'\t' => out.push_str("\\t"),
        _ => {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.push_str("\\u00");
            out.push(HEX[(byte >> 4) as usize] as char);
            out.push(HEX[(byte & 15) as usize] as char);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lines_waiting_are_bounded_in_bytes() {
        let control = Control {
            state: Mutex::new(State {
                out: None,
                next_id: 1,
                pending: HashMap::new(),
            }),
            queued: Arc::new(AtomicUsize::new(0)),
            hub: Hub::new(1, Duration::from_secs(1)),
            fast: Arc::new(Fast::default()),
        };
        let line = "x".repeat(1024 * 1024 - 32);
        for _ in 0..MAX_QUEUED / (1024 * 1024) {
            assert!(control.count(&line));
        }
        assert!(!control.count(&line));
        assert!(!control.count("{}"));
        control.queued.fetch_sub(line.len() + 32, Ordering::AcqRel);
        assert!(control.count(&line));
    }

    #[test]
    fn json_strings_round_trip() {
        let mut out = String::new();
        push_str(&mut out, "a\"b\\c\nd\u{1}é");
        let back: String = serde_json::from_str(&out).unwrap();
        assert_eq!(back, "a\"b\\c\nd\u{1}é");
        out.clear();
        push_latin1(&mut out, &[b'x', 0xE9, b'"']);
        let back: String = serde_json::from_str(&out).unwrap();
        assert_eq!(back, "xé\"");
    }
}
