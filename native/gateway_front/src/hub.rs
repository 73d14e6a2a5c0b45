//! The agents' tunnels: the server end of the tunnel protocol (`modelforge_contracts/tunnel.py`
//! defines it; `control_plane/gateway/tunnels.py` is the Python end this one mirrors, and
//! `native/tunnel_relay` the agent's end).
//!
//! Each tunnel has one reader (the task running `Hub::serve`), which dispatches the agent's
//! frames to the streams' slots, and one writer task, which takes every frame made ready while
//! it was writing and sends them together: one BATCH per WebSocket message (at most `MAX_BATCH`
//! bytes, a request's OPEN, DATA and END never split), several messages per write. Streams sit
//! in a `HashMap` behind a `std::sync::Mutex` held only between awaits; each stream's slot has
//! its own small lock and a `Notify` its one reader waits on.
//!
//! Bounds, so that one node costs the process a bounded share whatever it sends: the bytes
//! queued for the writer are counted; a stream's DATA and a new stream wait while more than
//! `HIGH_WATER` bytes wait (the client's body waits with them), and past `MAX_QUEUED` (only
//! small frames are queued without waiting) the tunnel is cut off. A write that is not done
//! within `frames::WRITE_TIMEOUT_SECONDS` means the agent does not read: cut off too, never
//! buffered for. The agent's PINGs are answered by one PONG for the latest (RFC 6455 allows
//! it), and more than `frames::PING_BURST` of them at once close the tunnel (1008). The reader
//! takes `frames::FRAMES_PER_SECOND` frames a second (a ping counts as one) and waits past it;
//! a BATCH of more than `frames::MAX_BATCH_FRAMES` frames is refused (1002, with its reason).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::frames;
use crate::ws::{self, WsError};

/// The most one WebSocket message from an agent may hold: a BATCH is at most `MAX_BATCH`
/// bytes; what the agents' own limit is (twice `MAX_PAYLOAD`) with some slack.
const MAX_MESSAGE: usize = 2 * frames::MAX_PAYLOAD + 1024;
const CLOSE_GOING_AWAY: u16 = 1001;
const CLOSE_PROTOCOL: u16 = 1002;
const CLOSE_POLICY: u16 = 1008;
const CLOSE_IDLE: u16 = 4408;
const CLOSE_REPLACED: u16 = 4409;
/// Reset codes `frames` does not name (`ResetCode` there).
const TUNNEL_CLOSED: &str = "TUNNEL_CLOSED";
const CANCELLED: &str = "CANCELLED";
/// The cause of `Failed` when no open tunnel to the node is held (the Python exception's name).
const UNAVAILABLE: &str = "TunnelUnavailable";
/// The writer gathers messages up to about this many bytes into one write.
const WRITE_CHUNK: usize = 256 * 1024;
/// How long a closing tunnel waits for the agent's close, and for its last write.
const CLOSE_GRACE: Duration = Duration::from_secs(1);
/// Bytes queued for the writer past which a stream's DATA and a new stream wait for it.
const HIGH_WATER: usize = 1024 * 1024;
/// Bytes queued past which the agent is taken not to read: the tunnel is cut off.
const MAX_QUEUED: usize = 8 * 1024 * 1024;
/// The writer's error when a write was not done within the write timeout.
const NOT_READING: &str = "not reading";
/// The close reason of a tunnel cut off because its agent does not read.
const DOES_NOT_READ: &str = "the agent does not read its tunnel";

/// A transport failure: no stream could be opened (a short cause, no secrets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failed(pub String);

/// The stream was reset, or ended abnormally (the tunnel closed: `TUNNEL_CLOSED`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reset {
    pub code: String,
    pub message: String,
}

impl Reset {
    fn new(code: &str, message: &str) -> Reset {
        Reset {
            code: code.to_string(),
            message: message.to_string(),
        }
    }
}

// -- the writer ---------------------------------------------------------------------------------

/// A frame's payload, as it came: nothing to copy before the write.
enum Payload {
    Empty,
    Owned(Vec<u8>),
    Shared(Bytes),
    Word([u8; 4]),
}

impl Payload {
    fn as_slice(&self) -> &[u8] {
        match self {
            Payload::Empty => &[],
            Payload::Owned(data) => data,
            Payload::Shared(data) => data,
            Payload::Word(word) => word,
        }
    }
}

/// What the writer is asked to send.
enum Out {
    Frame(u8, u32, Payload),
    /// A stream's OPEN, with its whole body (a DATA unless empty, then END) when given: one
    /// message.
    Open(u32, Vec<u8>, Option<Vec<u8>>),
    /// A WebSocket control frame (close: the writer stops after it).
    Control(u8, Vec<u8>),
    /// The PONG waiting in `Outbox::pong` is to go (one for the latest PING).
    Pong,
    /// The tunnel is over: stop at once.
    Stop,
}

/// A frame waiting for the writer; `joined`: it leaves in the same message as the one before.
struct Pending {
    kind: u8,
    stream: u32,
    payload: Payload,
    joined: bool,
}

/// What a tunnel's senders and its writer share beside the queue.
struct Outbox {
    /// Bytes of frames sent to the writer and not yet written (`queued_size` each).
    queued: AtomicUsize,
    /// A write was done: senders waiting for room look again.
    drained: Notify,
    /// The PONG to send: only the latest PING's is kept.
    pong: Mutex<Option<Vec<u8>>>,
}

impl Outbox {
    fn new() -> Outbox {
        Outbox {
            queued: AtomicUsize::new(0),
            drained: Notify::new(),
            pong: Mutex::new(None),
        }
    }
}

/// What one frame counts in `Outbox::queued`: as it goes in a BATCH.
fn queued_size(payload: usize) -> usize {
    4 + frames::HEAD + payload
}

/// A token bucket: `rate` a second, at most `burst` held.
struct Bucket {
    tokens: f64,
    rate: f64,
    burst: f64,
    at: Instant,
}

impl Bucket {
    fn new(rate: u32, burst: u32) -> Bucket {
        Bucket {
            tokens: burst as f64,
            rate: rate as f64,
            burst: burst as f64,
            at: Instant::now(),
        }
    }

    /// Take `count`; how long until the balance is back to zero (zero when it still is).
    fn spend(&mut self, count: usize) -> Duration {
        let now = Instant::now();
        let refill = now.duration_since(self.at).as_secs_f64() * self.rate;
        self.tokens = (self.tokens + refill).min(self.burst) - count as f64;
        self.at = now;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate)
        }
    }
}

fn push_frame(out: &mut Vec<u8>, kind: u8, stream: u32, payload: &[u8]) {
    out.push(kind);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// The next WebSocket message from the front of `pending` (not empty), appended to `out`: as
/// many frames as one BATCH of at most `MAX_BATCH` bytes and `MAX_BATCH_FRAMES` frames holds
/// (at least one group), or the frame itself when only one goes (`frames::take_batch`, groups
/// kept whole). Returns what the frames taken counted in `Outbox::queued`.
fn append_message(pending: &mut VecDeque<Pending>, out: &mut Vec<u8>) -> usize {
    let (mut taken, mut size) = (0, frames::HEAD);
    while taken < pending.len() {
        let mut end = taken + 1;
        let mut group = queued_size(pending[taken].payload.as_slice().len());
        while end < pending.len() && pending[end].joined {
            group += queued_size(pending[end].payload.as_slice().len());
            end += 1;
        }
        if taken > 0 && (size + group > frames::MAX_BATCH || end > frames::MAX_BATCH_FRAMES) {
            break;
        }
        size += group;
        taken = end;
    }
    if taken == 1 {
        if let Some(item) = pending.pop_front() {
            let payload = item.payload.as_slice();
            ws::server_head(ws::OP_BINARY, frames::HEAD + payload.len(), out);
            push_frame(out, item.kind, item.stream, payload);
        }
        return size - frames::HEAD;
    }
    ws::server_head(ws::OP_BINARY, size, out);
    push_frame(out, frames::BATCH, 0, &[]);
    for item in pending.drain(..taken) {
        let payload = item.payload.as_slice();
        out.extend_from_slice(&((frames::HEAD + payload.len()) as u32).to_be_bytes());
        push_frame(out, item.kind, item.stream, payload);
    }
    size - frames::HEAD
}

/// Takes one request for the writer; false for `Stop`.
fn accept(
    item: Out,
    pending: &mut VecDeque<Pending>,
    control: &mut VecDeque<(u8, Vec<u8>)>,
    outbox: &Outbox,
) -> bool {
    match item {
        Out::Frame(kind, stream, payload) => pending.push_back(Pending {
            kind,
            stream,
            payload,
            joined: false,
        }),
        Out::Open(stream, open, body) => {
            pending.push_back(Pending {
                kind: frames::OPEN,
                stream,
                payload: Payload::Owned(open),
                joined: false,
            });
            if let Some(body) = body {
                if !body.is_empty() {
                    pending.push_back(Pending {
                        kind: frames::DATA,
                        stream,
                        payload: Payload::Owned(body),
                        joined: true,
                    });
                }
                pending.push_back(Pending {
                    kind: frames::END,
                    stream,
                    payload: Payload::Empty,
                    joined: true,
                });
            }
        }
        Out::Control(opcode, payload) => control.push_back((opcode, payload)),
        Out::Pong => {
            if let Some(payload) = outbox.pong.lock().unwrap().take() {
                match control.back_mut() {
                    // One PONG for the latest PING, however many came meanwhile.
                    Some((ws::OP_PONG, waiting)) => *waiting = payload,
                    _ => control.push_back((ws::OP_PONG, payload)),
                }
            }
        }
        Out::Stop => return false,
    }
    true
}

/// The tunnel's one writer: frames sent while a write is under way leave together in the
/// next, as BATCH messages (`FrameWriter` there), written in one go. A write not done within
/// `write_timeout` fails with `NOT_READING`.
async fn write_loop<W: AsyncWrite + Unpin>(
    io: W,
    queue: UnboundedReceiver<Out>,
    outbox: Arc<Outbox>,
    write_timeout: Duration,
) -> Result<(), WsError> {
    let written = write_messages(io, queue, &outbox, write_timeout).await;
    // Senders waiting for room see the tunnel end.
    outbox.drained.notify_waiters();
    written
}

async fn write_messages<W: AsyncWrite + Unpin>(
    mut io: W,
    mut queue: UnboundedReceiver<Out>,
    outbox: &Outbox,
    write_timeout: Duration,
) -> Result<(), WsError> {
    let mut pending: VecDeque<Pending> = VecDeque::new();
    let mut control: VecDeque<(u8, Vec<u8>)> = VecDeque::new();
    // One buffer for the tunnel's life: each write's messages are built in it.
    let mut out: Vec<u8> = Vec::with_capacity(frames::MAX_BATCH + 16);
    loop {
        if pending.is_empty() && control.is_empty() {
            match queue.recv().await {
                Some(item) => {
                    if !accept(item, &mut pending, &mut control, outbox) {
                        return Ok(());
                    }
                }
                None => return Ok(()),
            }
            // Let the streams made ready in this wake-up add theirs to the message.
            tokio::task::yield_now().await;
        }
        while let Ok(item) = queue.try_recv() {
            if !accept(item, &mut pending, &mut control, outbox) {
                return Ok(());
            }
        }
        out.clear();
        let mut closing = false;
        while let Some((opcode, payload)) = control.pop_front() {
            ws::server_head(opcode, payload.len(), &mut out);
            out.extend_from_slice(&payload);
            if opcode == ws::OP_CLOSE {
                closing = true;
                break;
            }
        }
        let mut freed = 0;
        while !closing && !pending.is_empty() && out.len() < WRITE_CHUNK {
            freed += append_message(&mut pending, &mut out);
        }
        let write = async {
            io.write_all(&out).await?;
            io.flush().await?;
            Ok::<(), WsError>(())
        };
        match tokio::time::timeout(write_timeout, write).await {
            Ok(written) => written?,
            Err(_) => return Err(WsError::Io(NOT_READING.to_string())),
        }
        outbox.queued.fetch_sub(freed, Ordering::AcqRel);
        outbox.drained.notify_waiters();
        if closing {
            let _ = io.shutdown().await;
            return Ok(());
        }
    }
}

fn close_payload(code: u16, reason: &str) -> Vec<u8> {
    let mut payload = code.to_be_bytes().to_vec();
    let mut end = reason.len().min(123);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    payload.extend_from_slice(&reason.as_bytes()[..end]);
    payload
}

fn reset_payload(code: &str, message: &str) -> Payload {
    let message: String = message.chars().take(500).collect();
    let body = serde_json::json!({"code": code, "message": message});
    Payload::Owned(body.to_string().into_bytes())
}

// -- the streams' state -------------------------------------------------------------------------

type Head = (u16, Vec<(String, String)>);

/// One stream as both its reader (`Stream`) and the tunnel's reader see it.
struct Slot {
    inner: Mutex<Inner>,
    /// Something changed for the stream's one reader (its answer, its window, its end).
    wake: Notify,
}

struct Inner {
    head: Option<Head>,
    head_seen: bool,
    chunks: VecDeque<Bytes>,
    /// The agent's END has come: the whole answer is in `chunks` (and the send window closed).
    all_here: bool,
    whole_taken: bool,
    reset: Option<Reset>,
    /// The send window (`SendWindow` there).
    available: i64,
    /// The receive window (`ReceiveWindow` there): what the agent may still send, and what
    /// was consumed since the last grant.
    remaining: i64,
    consumed: i64,
}

impl Slot {
    fn new(spent: usize) -> Slot {
        Slot {
            inner: Mutex::new(Inner {
                head: None,
                head_seen: false,
                chunks: VecDeque::new(),
                all_here: false,
                whole_taken: false,
                reset: None,
                available: frames::INITIAL_WINDOW - spent as i64,
                remaining: frames::INITIAL_WINDOW,
                consumed: 0,
            }),
            wake: Notify::new(),
        }
    }
}

// -- the tunnels --------------------------------------------------------------------------------

struct Closing {
    code: u16,
    reason: String,
    why: String,
}

struct State {
    streams: HashMap<u32, Arc<Slot>>,
    next_id: u32,
    /// No stream may open any more (its streams were failed).
    closed: bool,
    /// Asked to close (`Hub::close`, a replacement): the first ask wins.
    close: Option<Closing>,
}

impl State {
    /// Every stream failed with `TUNNEL_CLOSED`; no new one opens.
    fn close_streams(&mut self, message: &str) {
        self.closed = true;
        for (_, slot) in self.streams.drain() {
            let mut inner = slot.inner.lock().unwrap();
            if inner.reset.is_none() {
                inner.reset = Some(Reset::new(TUNNEL_CLOSED, message));
            }
            drop(inner);
            slot.wake.notify_one();
        }
    }

    /// A new stream id: counting up from 1 as the Python end does, never 0 nor one in use.
    fn allocate(&mut self) -> u32 {
        loop {
            let id = self.next_id;
            self.next_id = self.next_id.wrapping_add(1);
            if id != 0 && !self.streams.contains_key(&id) {
                return id;
            }
        }
    }
}

struct Tunnel {
    node: String,
    writer: UnboundedSender<Out>,
    outbox: Arc<Outbox>,
    state: Mutex<State>,
    /// `state.close` was set: the tunnel's reader is to close it.
    stop: Notify,
}

impl Tunnel {
    /// Send a frame without waiting for room (a small one: END, WINDOW, RESET); past
    /// `MAX_QUEUED` bytes queued the agent does not read, and the tunnel is cut off.
    fn send(&self, kind: u8, stream: u32, payload: Payload) -> bool {
        let size = queued_size(payload.as_slice().len());
        let queued = self.outbox.queued.fetch_add(size, Ordering::AcqRel) + size;
        if queued > MAX_QUEUED {
            self.request_close(
                CLOSE_POLICY,
                DOES_NOT_READ,
                &format!("cut off: it does not read ({} bytes wait for it)", queued),
            );
            return false;
        }
        self.writer.send(Out::Frame(kind, stream, payload)).is_ok()
    }

    /// Count `size` bytes into the writer's queue once no more than `HIGH_WATER` wait (the
    /// writer drains it); false once the tunnel is closed.
    async fn reserve(&self, size: usize) -> bool {
        let outbox = &self.outbox;
        loop {
            // Made before the look, so that a drain between the two still wakes it.
            let drained = outbox.drained.notified();
            if self.state.lock().unwrap().closed {
                return false;
            }
            let queued = outbox.queued.load(Ordering::Acquire);
            if queued <= HIGH_WATER {
                let counted = outbox.queued.compare_exchange(
                    queued,
                    queued + size,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                if counted.is_ok() {
                    return true;
                }
                continue;
            }
            drained.await;
        }
    }

    /// Give back bytes `reserve` counted that will not be sent.
    fn unreserve(&self, size: usize) {
        self.outbox.queued.fetch_sub(size, Ordering::AcqRel);
        self.outbox.drained.notify_waiters();
    }

    /// Answer a PING: the one PONG waiting carries the latest PING's payload.
    fn pong(&self, payload: Vec<u8>) {
        let first = self.outbox.pong.lock().unwrap().replace(payload).is_none();
        if first {
            let _ = self.writer.send(Out::Pong);
        }
    }

    fn request_close(&self, code: u16, reason: &str, why: &str) {
        let mut state = self.state.lock().unwrap();
        if state.close.is_some() {
            return;
        }
        state.close = Some(Closing {
            code,
            reason: reason.to_string(),
            why: why.to_string(),
        });
        state.close_streams(reason);
        drop(state);
        self.outbox.drained.notify_waiters();
        self.stop.notify_one();
    }

    fn closed_reset(&self) -> Reset {
        Reset::new(
            TUNNEL_CLOSED,
            &format!("the tunnel of node {} closed", self.node),
        )
    }

    /// The frames of one message from the agent, each to its stream (`Tunnel.read` there);
    /// Err for a malformed message (the tunnel is then closed), checked whole before any frame
    /// is dispatched.
    fn dispatch(&self, message: Vec<u8>, spans: &mut Vec<frames::Span>) -> Result<(), String> {
        frames::split(&message, spans)?;
        if spans.iter().all(|span| span.stream == 0) {
            return Ok(()); // keepalives: the idle clock was refreshed
        }
        let message = Bytes::from(message);
        let mut resets: Vec<(u32, &'static str, String)> = Vec::new();
        let mut state = self.state.lock().unwrap();
        for span in spans.iter() {
            if span.stream == 0 {
                continue; // the keepalive
            }
            let slot = match state.streams.get(&span.stream) {
                Some(slot) => slot,
                None => continue, // one this side reset or finished: its frames in flight go
            };
            let payload = &message[span.start..span.end];
            let mut inner = slot.inner.lock().unwrap();
            let mut over = false;
            let failure = match span.kind {
                frames::RESPONSE if inner.head_seen => {
                    Some((frames::PROTOCOL_ERROR, "a second RESPONSE".to_string()))
                }
                frames::RESPONSE => match parse_head(payload) {
                    Ok(head) => {
                        inner.head = Some(head);
                        inner.head_seen = true;
                        None
                    }
                    Err(reason) => Some((frames::PROTOCOL_ERROR, reason)),
                },
                frames::DATA if !inner.head_seen => {
                    Some((frames::PROTOCOL_ERROR, "DATA before RESPONSE".to_string()))
                }
                frames::DATA => {
                    let size = payload.len() as i64;
                    if size > inner.remaining {
                        Some((
                            frames::FLOW_CONTROL,
                            "DATA past the stream's window".to_string(),
                        ))
                    } else {
                        inner.remaining -= size;
                        inner.chunks.push_back(message.slice(span.start..span.end));
                        None
                    }
                }
                frames::END if !inner.head_seen => {
                    Some((frames::PROTOCOL_ERROR, "END before RESPONSE".to_string()))
                }
                frames::END => {
                    inner.all_here = true;
                    over = true;
                    None
                }
                frames::WINDOW => match frames::parse_window(payload) {
                    Ok(increment) if frames::window_fits(inner.available, increment) => {
                        inner.available += increment;
                        None
                    }
                    Ok(_) => Some((
                        frames::PROTOCOL_ERROR,
                        "a WINDOW past 2**31 - 1".to_string(),
                    )),
                    Err(reason) => Some((frames::PROTOCOL_ERROR, reason)),
                },
                frames::RESET => {
                    if inner.reset.is_none() {
                        inner.reset = Some(parse_reset(payload));
                    }
                    over = true;
                    None
                }
                _ => Some((frames::PROTOCOL_ERROR, "OPEN from an agent".to_string())),
            };
            if let Some((code, reason)) = failure {
                if inner.reset.is_none() {
                    inner.reset = Some(Reset::new(code, &reason));
                }
                resets.push((span.stream, code, reason));
                over = true;
            }
            drop(inner);
            slot.wake.notify_one();
            if over {
                state.streams.remove(&span.stream);
            }
        }
        drop(state);
        for (stream, code, reason) in resets {
            self.send(frames::RESET, stream, reset_payload(code, &reason));
        }
        Ok(())
    }
}

/// A RESPONSE frame's payload (`ResponseHead.from_payload` there).
fn parse_head(payload: &[u8]) -> Result<Head, String> {
    let body: Value = serde_json::from_slice(payload)
        .map_err(|_| "a RESPONSE frame's payload is not JSON".to_string())?;
    let mut body = match body {
        Value::Object(body) => body,
        _ => return Err("a RESPONSE frame's payload is a JSON object".into()),
    };
    let status = match body.get("status").and_then(Value::as_u64) {
        Some(status) if (100..=599).contains(&status) => status as u16,
        _ => return Err("a RESPONSE frame's status is an HTTP status".into()),
    };
    let bad = || "headers are a list of [name, value] pairs of strings".to_string();
    let pairs = match body.remove("headers") {
        Some(Value::Array(pairs)) => pairs,
        _ => return Err(bad()),
    };
    let mut headers = Vec::with_capacity(pairs.len());
    for pair in pairs {
        let mut pair = match pair {
            Value::Array(pair) if pair.len() == 2 => pair,
            _ => return Err(bad()),
        };
        match (pair.pop(), pair.pop()) {
            (Some(Value::String(value)), Some(Value::String(name))) => headers.push((name, value)),
            _ => return Err(bad()),
        }
    }
    Ok((status, headers))
}

/// A RESET frame's payload (`Reset.from_payload` there).
fn parse_reset(payload: &[u8]) -> Reset {
    let text = |value: Option<&Value>, default: &str| match value {
        None => default.to_string(),
        Some(Value::String(text)) => text.clone(),
        Some(other) => other.to_string(),
    };
    match serde_json::from_slice::<Value>(payload) {
        Ok(Value::Object(body)) => Reset {
            code: text(body.get("code"), frames::PROTOCOL_ERROR),
            message: text(body.get("message"), ""),
        },
        _ => Reset::new(
            frames::PROTOCOL_ERROR,
            "a RESET frame without a readable reason",
        ),
    }
}

// -- the hub ------------------------------------------------------------------------------------

/// The tunnels this process holds, by node id.
pub struct Hub {
    tunnels: Mutex<HashMap<String, Arc<Tunnel>>>,
    max_streams: usize,
    idle_timeout: Duration,
    write_timeout: Duration,
}

/// How a tunnel's reader stopped.
enum End {
    /// The agent's close (its code, echoed).
    AgentClosed(Vec<u8>),
    Asked,
    Idle,
    Protocol(String),
    /// More PINGs than `frames::PING_BURST` at once.
    Pings,
    Io(String),
    WriteFailed(String),
}

impl Hub {
    pub fn new(max_streams: usize, idle_timeout: Duration) -> Arc<Hub> {
        Arc::new(Hub {
            tunnels: Mutex::new(HashMap::new()),
            max_streams,
            idle_timeout,
            write_timeout: Duration::from_secs(frames::WRITE_TIMEOUT_SECONDS),
        })
    }

    /// Serve one accepted tunnel for `node` until it ends (the 101 was sent by the caller); a
    /// tunnel the node had is replaced (closed with 4409). Returns why it ended ("replaced"
    /// when a newer one replaced it); every stream of it has then failed with `TUNNEL_CLOSED`.
    pub async fn serve<S>(self: &Arc<Self>, node: String, io: S) -> String
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (read_half, write_half) = tokio::io::split(io);
        // Unbounded as a channel, bounded in bytes by `Outbox::queued` (`Tunnel::send`,
        // `reserve`) and in PONGs by `Outbox::pong`.
        let (writer, queue) = unbounded_channel();
        let outbox = Arc::new(Outbox::new());
        let tunnel = Arc::new(Tunnel {
            node: node.clone(),
            writer,
            outbox: outbox.clone(),
            state: Mutex::new(State {
                streams: HashMap::new(),
                next_id: 1,
                closed: false,
                close: None,
            }),
            stop: Notify::new(),
        });
        let mut write_task =
            tokio::spawn(write_loop(write_half, queue, outbox, self.write_timeout));
        let previous = self
            .tunnels
            .lock()
            .unwrap()
            .insert(node.clone(), tunnel.clone());
        if let Some(previous) = previous {
            previous.request_close(
                CLOSE_REPLACED,
                "replaced by a newer tunnel of the same node",
                "replaced",
            );
        }
        let mut reader = ws::Reader::server(read_half, Vec::new(), MAX_MESSAGE);
        let mut partial = None;
        let mut spans = Vec::new();
        let idle = self.idle_timeout;
        let mut heard = Instant::now();
        let mut frames_taken = Bucket::new(frames::FRAMES_PER_SECOND, frames::FRAME_BURST);
        let mut pings = Bucket::new(frames::PINGS_PER_SECOND, frames::PING_BURST);
        let silence = tokio::time::sleep_until(heard + idle);
        tokio::pin!(silence);
        let stopped = tunnel.stop.notified();
        tokio::pin!(stopped);
        let mut writer_done = false;
        let end = loop {
            tokio::select! {
                biased;
                _ = &mut stopped => break End::Asked,
                written = &mut write_task => {
                    writer_done = true;
                    break End::WriteFailed(match written {
                        Ok(Ok(())) => "the writer stopped".to_string(),
                        Ok(Err(WsError::Io(kind))) => kind,
                        Ok(Err(_)) => "a write failed".to_string(),
                        Err(_) => "the writer failed".to_string(),
                    });
                }
                message = reader.message(&mut partial) => match message {
                    Ok(message) => {
                        match message.opcode {
                            ws::OP_BINARY => {
                                heard = Instant::now();
                                if let Err(reason) = tunnel.dispatch(message.payload, &mut spans) {
                                    break End::Protocol(reason);
                                }
                            }
                            // Not a frame: what the Python end makes of it (an empty message).
                            ws::OP_TEXT => {
                                break End::Protocol("a frame shorter than its header".to_string())
                            }
                            ws::OP_PING => {
                                if !pings.spend(1).is_zero() {
                                    break End::Pings;
                                }
                                spans.clear();
                                tunnel.pong(message.payload);
                            }
                            ws::OP_PONG => spans.clear(),
                            _ => {
                                let code = message.payload.get(..2).unwrap_or_default().to_vec();
                                break End::AgentClosed(code);
                            }
                        }
                        // Past its frames a second, the reader waits (the agent's sends with it).
                        let wait = frames_taken.spend(spans.len().max(1));
                        if !wait.is_zero() {
                            tokio::time::sleep(wait).await;
                        }
                    }
                    Err(WsError::Protocol(reason)) => break End::Protocol(reason),
                    Err(WsError::Io(reason)) => break End::Io(reason),
                    Err(WsError::Refused(status)) => break End::Io(format!("status {}", status)),
                },
                _ = &mut silence => {
                    let due = heard + idle;
                    if Instant::now() >= due {
                        break End::Idle;
                    }
                    silence.as_mut().reset(due);
                }
            }
        };
        // Every stream fails now, and the node is no longer connected through this tunnel.
        let asked = {
            let mut state = tunnel.state.lock().unwrap();
            let asked = state
                .close
                .as_ref()
                .map(|closing| (closing.code, closing.reason.clone(), closing.why.clone()));
            state.close_streams(&format!("the tunnel of node {} closed", node));
            asked
        };
        tunnel.outbox.drained.notify_waiters();
        {
            let mut tunnels = self.tunnels.lock().unwrap();
            if matches!(tunnels.get(&node), Some(held) if Arc::ptr_eq(held, &tunnel)) {
                tunnels.remove(&node);
            }
        }
        let (why, close, wait_for_close) = match end {
            End::AgentClosed(code) => ("the agent closed it".to_string(), Some(code), false),
            End::Asked => {
                let (code, reason, why) =
                    asked.unwrap_or((CLOSE_GOING_AWAY, String::new(), "closed".to_string()));
                (why, Some(close_payload(code, &reason)), true)
            }
            End::Idle => (
                format!("silent for {} s", idle.as_secs_f64()),
                Some(close_payload(CLOSE_IDLE, "the tunnel was silent")),
                true,
            ),
            End::Protocol(reason) => (
                format!("a protocol error ({})", reason),
                Some(close_payload(CLOSE_PROTOCOL, &reason)),
                false,
            ),
            End::Pings => (
                format!("cut off: more than {} PINGs at once", frames::PING_BURST),
                Some(close_payload(CLOSE_POLICY, "too many pings")),
                false,
            ),
            End::Io(reason) if reason == "closed" => {
                ("the agent closed it".to_string(), None, false)
            }
            End::Io(reason) => (format!("its connection failed ({})", reason), None, false),
            End::WriteFailed(reason) if reason == NOT_READING => (
                format!(
                    "cut off: it does not read (a write waited {} s)",
                    self.write_timeout.as_secs_f64()
                ),
                None,
                false,
            ),
            End::WriteFailed(reason) => {
                (format!("its connection failed ({})", reason), None, false)
            }
        };
        if why.starts_with("cut off") || why.starts_with("a protocol error") {
            crate::log(
                "warning",
                &format!("node {}'s tunnel closed: {}", node, why),
            );
        }
        if !writer_done {
            let last = match close {
                Some(payload) => Out::Control(ws::OP_CLOSE, payload),
                None => Out::Stop,
            };
            let _ = tunnel.writer.send(last);
            if wait_for_close {
                // The agent's close in answer (what else it sends is dropped), or a moment.
                let answered = async {
                    while let Ok(message) = reader.message(&mut partial).await {
                        if message.opcode == ws::OP_CLOSE {
                            break;
                        }
                    }
                };
                let _ = tokio::time::timeout(CLOSE_GRACE, answered).await;
            }
            if tokio::time::timeout(CLOSE_GRACE, &mut write_task)
                .await
                .is_err()
            {
                write_task.abort();
            }
        }
        why
    }

    /// Close the node's tunnel (if held) with a WebSocket close code and reason.
    pub fn close(&self, node: &str, code: u16, reason: &str) {
        let tunnel = self.tunnels.lock().unwrap().get(node).cloned();
        if let Some(tunnel) = tunnel {
            tunnel.request_close(code, reason, reason);
        }
    }

    /// Close every tunnel (e.g. 1001 going away, when the control channel is lost).
    pub fn close_all(&self, code: u16, reason: &str) {
        let tunnels: Vec<Arc<Tunnel>> = self.tunnels.lock().unwrap().values().cloned().collect();
        for tunnel in tunnels {
            tunnel.request_close(code, reason, reason);
        }
    }

    pub fn connected(&self, node: &str) -> bool {
        let tunnel = self.tunnels.lock().unwrap().get(node).cloned();
        matches!(tunnel, Some(tunnel) if !tunnel.state.lock().unwrap().closed)
    }

    /// Open a stream to `node`'s agent with this OPEN payload (`OpenRequest.to_payload()`);
    /// with `whole_body` (at most `MAX_PAYLOAD` bytes) the OPEN, its DATA (none when empty)
    /// and END go in one message. `Failed` when no open tunnel to the node is held, or it has
    /// `max_streams` streams ("TOO_MANY_STREAMS").
    pub async fn open(
        &self,
        node: &str,
        open_payload: Vec<u8>,
        whole_body: Option<Vec<u8>>,
    ) -> Result<Stream, Failed> {
        if open_payload.len() > frames::MAX_OPEN {
            return Err(Failed("OPEN_TOO_LARGE".to_string()));
        }
        let spent = whole_body.as_ref().map_or(0, Vec::len);
        if spent > frames::MAX_PAYLOAD {
            return Err(Failed("BODY_TOO_LARGE".to_string()));
        }
        let tunnel = self.tunnels.lock().unwrap().get(node).cloned();
        let tunnel = match tunnel {
            Some(tunnel) => tunnel,
            None => return Err(Failed(UNAVAILABLE.to_string())),
        };
        // What the writer will free for these frames (`append_message`).
        let size = queued_size(open_payload.len())
            + match &whole_body {
                Some(body) if body.is_empty() => queued_size(0),
                Some(body) => queued_size(body.len()) + queued_size(0),
                None => 0,
            };
        if !tunnel.reserve(size).await {
            return Err(Failed(UNAVAILABLE.to_string()));
        }
        let slot = Arc::new(Slot::new(spent));
        let id = {
            let mut state = tunnel.state.lock().unwrap();
            let refused = if state.closed {
                Some(UNAVAILABLE)
            } else if state.streams.len() >= self.max_streams {
                Some(frames::TOO_MANY_STREAMS)
            } else {
                None
            };
            if let Some(refused) = refused {
                drop(state);
                tunnel.unreserve(size);
                return Err(Failed(refused.to_string()));
            }
            let id = state.allocate();
            state.streams.insert(id, slot.clone());
            id
        };
        let sent_end = whole_body.is_some();
        if tunnel
            .writer
            .send(Out::Open(id, open_payload, whole_body))
            .is_err()
        {
            tunnel.state.lock().unwrap().streams.remove(&id);
            return Err(Failed(UNAVAILABLE.to_string()));
        }
        Ok(Stream {
            tunnel,
            slot,
            id,
            sent_end,
        })
    }
}

/// One request through a tunnel (`Stream` there).
pub struct Stream {
    tunnel: Arc<Tunnel>,
    slot: Arc<Slot>,
    id: u32,
    sent_end: bool,
}

impl Stream {
    /// Up to `wanted` bytes of the send window, at least 1, once there are some; 0 once the
    /// answer has ended (the agent reads no more of the request).
    async fn take(&self, wanted: usize) -> Result<usize, Reset> {
        loop {
            {
                let mut inner = self.slot.inner.lock().unwrap();
                if let Some(reset) = &inner.reset {
                    return Err(reset.clone());
                }
                if inner.all_here {
                    return Ok(0);
                }
                if inner.available > 0 {
                    let taken = (wanted as i64).min(inner.available);
                    inner.available -= taken;
                    return Ok(taken as usize);
                }
            }
            self.slot.wake.notified().await;
        }
    }

    /// A piece of the request body, as DATA frames of at most `MAX_PAYLOAD` bytes, each sent
    /// once the agent's window allows it. Err once the stream is reset or the tunnel closed;
    /// Ok without sending (the rest) once the answer has ended.
    pub async fn send(&mut self, mut data: Bytes) -> Result<(), Reset> {
        while !data.is_empty() {
            let taken = self.take(data.len().min(frames::MAX_PAYLOAD)).await?;
            if taken == 0 {
                return Ok(());
            }
            let piece = data.split_to(taken);
            // Room in the writer's queue first: the body waits while the agent reads slowly.
            if !self.tunnel.reserve(queued_size(piece.len())).await {
                return Err(self.tunnel.closed_reset());
            }
            let frame = Out::Frame(frames::DATA, self.id, Payload::Shared(piece));
            if self.tunnel.writer.send(frame).is_err() {
                return Err(self.tunnel.closed_reset());
            }
        }
        Ok(())
    }

    /// The request body is complete (END). Idempotent.
    pub async fn end(&mut self) -> Result<(), Reset> {
        {
            let inner = self.slot.inner.lock().unwrap();
            if let Some(reset) = &inner.reset {
                return Err(reset.clone());
            }
            if self.sent_end || inner.all_here {
                return Ok(()); // an answer already over reads no more of the request
            }
        }
        self.sent_end = true;
        if !self.tunnel.send(frames::END, self.id, Payload::Empty) {
            return Err(self.tunnel.closed_reset());
        }
        Ok(())
    }

    /// The replica's status and headers (its RESPONSE frame), once they came.
    pub async fn response(&mut self) -> Result<(u16, Vec<(String, String)>), Reset> {
        loop {
            {
                let mut inner = self.slot.inner.lock().unwrap();
                if let Some(head) = inner.head.take() {
                    return Ok(head);
                }
                if let Some(reset) = &inner.reset {
                    return Err(reset.clone());
                }
                if inner.head_seen {
                    return Err(Reset::new(
                        frames::PROTOCOL_ERROR,
                        "the response was taken already",
                    ));
                }
            }
            self.slot.wake.notified().await;
        }
    }

    /// The next piece of the answer's body; None at its END. What is consumed is granted
    /// back to the agent as the Python `ReceiveWindow` does: all of it once half the initial
    /// window was consumed.
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, Reset> {
        loop {
            {
                let mut inner = self.slot.inner.lock().unwrap();
                if let Some(chunk) = inner.chunks.pop_front() {
                    inner.consumed += chunk.len() as i64;
                    let mut grant = 0;
                    if inner.consumed >= frames::INITIAL_WINDOW / 2 {
                        grant = inner.consumed;
                        inner.consumed = 0;
                        inner.remaining += grant;
                    }
                    let over = inner.all_here || inner.reset.is_some();
                    drop(inner);
                    if grant > 0 && !over {
                        let word = (grant as u32).to_be_bytes();
                        self.tunnel
                            .send(frames::WINDOW, self.id, Payload::Word(word));
                    }
                    return Ok(Some(chunk));
                }
                if let Some(reset) = &inner.reset {
                    return Err(reset.clone());
                }
                if inner.all_here {
                    return Ok(None);
                }
            }
            self.slot.wake.notified().await;
        }
    }

    /// The whole answer's body when its END has come (taken at once); else None, and nothing
    /// is taken (read it with `chunk`).
    pub fn whole_body(&mut self) -> Option<Bytes> {
        let mut inner = self.slot.inner.lock().unwrap();
        if inner.reset.is_some() || !inner.all_here || inner.whole_taken {
            return None;
        }
        inner.whole_taken = true;
        match inner.chunks.len() {
            0 => Some(Bytes::new()),
            1 => inner.chunks.pop_front(),
            _ => {
                let size = inner.chunks.iter().map(Bytes::len).sum();
                let mut whole = Vec::with_capacity(size);
                for chunk in inner.chunks.drain(..) {
                    whole.extend_from_slice(&chunk);
                }
                Some(Bytes::from(whole))
            }
        }
    }

    /// End the stream both ways, and send RESET(code, message) unless it ended already.
    pub fn reset(&mut self, code: &str, message: &str) {
        let ended = {
            let mut inner = self.slot.inner.lock().unwrap();
            let ended = inner.reset.is_some() || inner.all_here;
            if inner.reset.is_none() {
                inner.reset = Some(Reset::new(code, message));
            }
            ended
        };
        if ended {
            return;
        }
        {
            let mut state = self.tunnel.state.lock().unwrap();
            if matches!(state.streams.get(&self.id), Some(slot) if Arc::ptr_eq(slot, &self.slot)) {
                state.streams.remove(&self.id);
            }
        }
        self.tunnel
            .send(frames::RESET, self.id, reset_payload(code, message));
    }
}

impl Drop for Stream {
    /// Not ended: the agent is told (RESET CANCELLED), and the stream's place is freed.
    fn drop(&mut self) {
        self.reset(CANCELLED, "the request went away");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{DuplexStream, ReadHalf, WriteHalf};

    /// An agent's end of a tunnel, speaking the client role (masked frames).
    struct Agent {
        reader: ws::Reader<ReadHalf<DuplexStream>>,
        writer: WriteHalf<DuplexStream>,
        entropy: ws::Entropy,
        partial: Option<(u8, Vec<u8>)>,
    }

    impl Agent {
        async fn send_raw(&mut self, opcode: u8, payload: &[u8]) {
            let frame = ws::encode_frame(opcode, payload, &mut self.entropy).unwrap();
            self.writer.write_all(&frame).await.unwrap();
        }

        /// `frames` as one message (a BATCH when more than one).
        async fn send(&mut self, frames_out: Vec<Vec<u8>>) {
            let mut pending = VecDeque::from(frames_out);
            let message = frames::take_batch(&mut pending);
            assert!(pending.is_empty());
            self.send_raw(ws::OP_BINARY, &message).await;
        }

        async fn message(&mut self) -> ws::Message {
            let next = self.reader.message(&mut self.partial);
            tokio::time::timeout(Duration::from_secs(5), next)
                .await
                .expect("a message in time")
                .expect("a message")
        }

        async fn frames(&mut self) -> Vec<frames::Frame> {
            let message = self.message().await;
            assert_eq!(message.opcode, ws::OP_BINARY);
            frames::decode_message(&message.payload).unwrap()
        }
    }

    async fn start(
        max_streams: usize,
        idle: Duration,
    ) -> (Arc<Hub>, Agent, tokio::task::JoinHandle<String>) {
        start_with(Hub::new(max_streams, idle), 1 << 20).await
    }

    /// A tunnel to `hub` over a pipe of `buffer` bytes each way.
    async fn start_with(
        hub: Arc<Hub>,
        buffer: usize,
    ) -> (Arc<Hub>, Agent, tokio::task::JoinHandle<String>) {
        let (server, client) = tokio::io::duplex(buffer);
        let serving = {
            let hub = hub.clone();
            tokio::spawn(async move { hub.serve("n1".to_string(), server).await })
        };
        while !hub.connected("n1") {
            tokio::task::yield_now().await;
        }
        let (read_half, write_half) = tokio::io::split(client);
        let agent = Agent {
            reader: ws::Reader::new(read_half, Vec::new(), 1 << 20),
            writer: write_half,
            entropy: ws::Entropy::open().unwrap(),
            partial: None,
        };
        (hub, agent, serving)
    }

    fn head(stream: u32) -> Vec<u8> {
        frames::encode(
            frames::RESPONSE,
            stream,
            br#"{"status": 200, "headers": [["content-type", "text/plain"]]}"#,
        )
    }

    const OPEN: &[u8] =
        br#"{"replica_id":"r1","method":"POST","path":"/v2/x","query":"","headers":[]}"#;

    #[tokio::test]
    async fn small_request_and_answer_each_go_in_one_message() {
        let (hub, mut agent, _serving) = start(8, Duration::from_secs(30)).await;
        let mut stream = hub
            .open("n1", OPEN.to_vec(), Some(b"hello".to_vec()))
            .await
            .unwrap();
        let message = agent.message().await;
        assert_eq!(message.payload[0], frames::BATCH);
        let got = frames::decode_message(&message.payload).unwrap();
        let kinds: Vec<(u8, u32)> = got.iter().map(|f| (f.kind, f.stream)).collect();
        assert_eq!(
            kinds,
            vec![(frames::OPEN, 1), (frames::DATA, 1), (frames::END, 1)]
        );
        assert_eq!(got[0].payload, OPEN);
        assert_eq!(got[1].payload, b"hello");
        agent
            .send(vec![
                head(1),
                frames::encode(frames::DATA, 1, b"the answer"),
                frames::encode(frames::END, 1, b""),
            ])
            .await;
        let (status, headers) = stream.response().await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(
            headers,
            vec![("content-type".to_string(), "text/plain".to_string())]
        );
        assert_eq!(
            stream.whole_body().unwrap(),
            Bytes::from_static(b"the answer")
        );
        assert_eq!(stream.whole_body(), None);
        assert_eq!(stream.chunk().await.unwrap(), None);
        drop(stream); // ended: no RESET goes
                      // A body-less request: OPEN and END only; the next stream is 2.
        let _second = hub
            .open("n1", OPEN.to_vec(), Some(Vec::new()))
            .await
            .unwrap();
        let got = agent.frames().await;
        let kinds: Vec<(u8, u32)> = got.iter().map(|f| (f.kind, f.stream)).collect();
        assert_eq!(kinds, vec![(frames::OPEN, 2), (frames::END, 2)]);
    }

    #[tokio::test]
    async fn a_large_body_waits_for_window_credit_and_the_answer_grants_some() {
        let (hub, mut agent, _serving) = start(8, Duration::from_secs(30)).await;
        let mut stream = hub.open("n1", OPEN.to_vec(), None).await.unwrap();
        let got = agent.frames().await;
        assert_eq!((got[0].kind, got[0].stream), (frames::OPEN, 1));
        let body: Vec<u8> = (0..300 * 1024).map(|index| (index % 251) as u8).collect();
        let expected = body.clone();
        let sending = tokio::spawn(async move {
            stream.send(Bytes::from(body)).await.unwrap();
            stream.end().await.unwrap();
            stream
        });
        let mut received = Vec::new();
        while received.len() < frames::INITIAL_WINDOW as usize {
            for frame in agent.frames().await {
                assert_eq!((frame.kind, frame.stream), (frames::DATA, 1));
                assert!(frame.payload.len() <= frames::MAX_PAYLOAD);
                received.extend_from_slice(&frame.payload);
            }
        }
        assert_eq!(received.len(), frames::INITIAL_WINDOW as usize);
        // No more without credit.
        let more = agent.reader.message(&mut agent.partial);
        assert!(tokio::time::timeout(Duration::from_millis(200), more)
            .await
            .is_err());
        assert!(!sending.is_finished());
        agent.send(vec![frames::window(1, 64 * 1024)]).await;
        let mut ended = false;
        while !ended {
            for frame in agent.frames().await {
                match frame.kind {
                    frames::DATA => received.extend_from_slice(&frame.payload),
                    frames::END => ended = true,
                    other => panic!("frame type {}", other),
                }
            }
        }
        assert_eq!(received, expected);
        let mut stream = sending.await.unwrap();
        // The answer: consuming half the initial window grants it back.
        agent.send(vec![head(1)]).await;
        let piece = vec![7u8; frames::MAX_PAYLOAD];
        for _ in 0..3 {
            agent
                .send(vec![frames::encode(frames::DATA, 1, &piece)])
                .await;
        }
        assert_eq!(stream.response().await.unwrap().0, 200);
        assert!(stream.whole_body().is_none());
        for _ in 0..2 {
            assert_eq!(
                stream.chunk().await.unwrap().unwrap().len(),
                frames::MAX_PAYLOAD
            );
        }
        let got = agent.frames().await;
        assert_eq!((got[0].kind, got[0].stream), (frames::WINDOW, 1));
        assert_eq!(
            frames::parse_window(&got[0].payload).unwrap(),
            frames::INITIAL_WINDOW / 2
        );
        agent.send(vec![frames::encode(frames::END, 1, b"")]).await;
        assert_eq!(
            stream.chunk().await.unwrap().unwrap().len(),
            frames::MAX_PAYLOAD
        );
        assert_eq!(stream.chunk().await.unwrap(), None);
    }

    #[tokio::test]
    async fn the_tunnel_closing_fails_its_streams() {
        let (hub, mut agent, serving) = start(8, Duration::from_secs(30)).await;
        let mut stream = hub.open("n1", OPEN.to_vec(), None).await.unwrap();
        agent.frames().await;
        // The agent's close is echoed.
        agent.send_raw(ws::OP_CLOSE, &1000u16.to_be_bytes()).await;
        let echoed = agent.message().await;
        assert_eq!(
            (echoed.opcode, &echoed.payload[..]),
            (ws::OP_CLOSE, &1000u16.to_be_bytes()[..])
        );
        let reset = stream.response().await.unwrap_err();
        assert_eq!(reset.code, TUNNEL_CLOSED);
        assert_eq!(
            stream
                .send(Bytes::from_static(b"x"))
                .await
                .unwrap_err()
                .code,
            TUNNEL_CLOSED
        );
        assert_eq!(serving.await.unwrap(), "the agent closed it");
        assert!(!hub.connected("n1"));
        assert_eq!(
            hub.open("n1", OPEN.to_vec(), None).await.err(),
            Some(Failed(UNAVAILABLE.to_string()))
        );

        // The connection simply dropped: the same.
        let (hub, agent, serving) = start(8, Duration::from_secs(30)).await;
        let mut stream = hub.open("n1", OPEN.to_vec(), None).await.unwrap();
        drop(agent);
        assert_eq!(stream.chunk().await.unwrap_err().code, TUNNEL_CLOSED);
        assert_eq!(serving.await.unwrap(), "the agent closed it");
        assert!(!hub.connected("n1"));
    }

    #[tokio::test]
    async fn max_streams_refuses_one_more_and_a_dropped_stream_frees_its_place() {
        let (hub, mut agent, _serving) = start(2, Duration::from_secs(30)).await;
        let first = hub.open("n1", OPEN.to_vec(), None).await.unwrap();
        let _second = hub.open("n1", OPEN.to_vec(), None).await.unwrap();
        assert_eq!(
            hub.open("n1", OPEN.to_vec(), None).await.err(),
            Some(Failed("TOO_MANY_STREAMS".to_string()))
        );
        let mut opened = 0;
        while opened < 2 {
            opened += agent.frames().await.len();
        }
        drop(first);
        let got = agent.frames().await;
        assert_eq!((got[0].kind, got[0].stream), (frames::RESET, 1));
        let body: Value = serde_json::from_slice(&got[0].payload).unwrap();
        assert_eq!(body["code"], CANCELLED);
        let _third = hub.open("n1", OPEN.to_vec(), None).await.unwrap();
        assert_eq!(agent.frames().await[0].stream, 3);
    }

    #[tokio::test]
    async fn an_unmasked_frame_closes_the_tunnel() {
        let (hub, mut agent, serving) = start(8, Duration::from_secs(30)).await;
        let mut stream = hub.open("n1", OPEN.to_vec(), None).await.unwrap();
        agent.frames().await;
        let frame = ws::encode_server_frame(ws::OP_BINARY, &frames::keepalive());
        agent.writer.write_all(&frame).await.unwrap();
        let close = agent.message().await;
        assert_eq!(close.opcode, ws::OP_CLOSE);
        assert_eq!(close.payload[..2], CLOSE_PROTOCOL.to_be_bytes());
        assert!(serving.await.unwrap().starts_with("a protocol error"));
        assert_eq!(stream.response().await.unwrap_err().code, TUNNEL_CLOSED);
        assert!(!hub.connected("n1"));
    }

    #[tokio::test]
    async fn stream_errors_reset_the_stream_only() {
        let (hub, mut agent, _serving) = start(8, Duration::from_secs(30)).await;
        let mut stream = hub.open("n1", OPEN.to_vec(), None).await.unwrap();
        agent.frames().await;
        // DATA before RESPONSE: the stream is reset with PROTOCOL_ERROR, the tunnel stays.
        agent
            .send(vec![frames::encode(frames::DATA, 1, b"x")])
            .await;
        assert_eq!(
            stream.response().await.unwrap_err().code,
            frames::PROTOCOL_ERROR
        );
        let got = agent.frames().await;
        assert_eq!((got[0].kind, got[0].stream), (frames::RESET, 1));
        // The agent's RESET ends a stream with its code; frames for unknown streams go.
        let mut stream = hub.open("n1", OPEN.to_vec(), None).await.unwrap();
        agent.frames().await;
        agent
            .send(vec![
                frames::encode(frames::END, 99, b""),
                frames::keepalive(),
                frames::reset(2, "NO_SUCH_REPLICA", "no such replica"),
            ])
            .await;
        let reset = stream.response().await.unwrap_err();
        assert_eq!(reset, Reset::new("NO_SUCH_REPLICA", "no such replica"));
        drop(stream); // reset already: nothing sent
        assert!(hub.connected("n1"));
        // A text message is a protocol error.
        agent.send_raw(ws::OP_TEXT, b"hello").await;
        assert_eq!(agent.message().await.opcode, ws::OP_CLOSE);
    }

    #[tokio::test]
    async fn ping_pong_replacement_and_idle() {
        let (hub, mut agent, serving) = start(8, Duration::from_secs(30)).await;
        agent.send_raw(ws::OP_PING, b"p").await;
        let pong = agent.message().await;
        assert_eq!((pong.opcode, &pong.payload[..]), (ws::OP_PONG, &b"p"[..]));
        // A second tunnel for the node replaces the first (closed with 4409).
        let (server, _client) = tokio::io::duplex(1 << 16);
        let second = {
            let hub = hub.clone();
            tokio::spawn(async move { hub.serve("n1".to_string(), server).await })
        };
        let close = agent.message().await;
        assert_eq!(close.opcode, ws::OP_CLOSE);
        assert_eq!(close.payload[..2], CLOSE_REPLACED.to_be_bytes());
        agent.send_raw(ws::OP_CLOSE, &close.payload[..2]).await;
        assert_eq!(serving.await.unwrap(), "replaced");
        assert!(hub.connected("n1"));
        hub.close("n1", 4401, "the node credential was revoked");
        assert!(!hub.connected("n1"));
        assert_eq!(second.await.unwrap(), "the node credential was revoked");

        let (hub, mut agent, serving) = start(8, Duration::from_millis(300)).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        agent.send(vec![frames::keepalive()]).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(hub.connected("n1"));
        let close = agent.message().await;
        assert_eq!(close.payload[..2], CLOSE_IDLE.to_be_bytes());
        assert_eq!(serving.await.unwrap(), "silent for 0.3 s");
    }

    fn queued(hub: &Hub) -> usize {
        let tunnel = hub.tunnels.lock().unwrap().get("n1").cloned().unwrap();
        tunnel.outbox.queued.load(Ordering::Acquire)
    }

    #[test]
    fn the_bucket_gives_its_burst_then_its_rate() {
        let mut bucket = Bucket::new(1000, 10);
        assert!(bucket.spend(10).is_zero());
        let wait = bucket.spend(5);
        assert!(wait > Duration::from_millis(4) && wait <= Duration::from_millis(5));
    }

    #[tokio::test]
    async fn an_agent_that_does_not_read_is_cut_off_and_its_queue_stays_bounded() {
        let hub = Arc::new(Hub {
            tunnels: Mutex::new(HashMap::new()),
            max_streams: 64,
            idle_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_millis(500),
        });
        // A pipe of 4 KiB the agent never reads: the writer's first write waits.
        let (hub, _agent, serving) = start_with(hub, 4096).await;
        let body: Vec<u8> = vec![7; 200 * 1024];
        let mut senders = Vec::new();
        for _ in 0..12 {
            let mut stream = hub.open("n1", OPEN.to_vec(), None).await.unwrap();
            let body = Bytes::from(body.clone());
            senders.push(tokio::spawn(async move { stream.send(body).await }));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        // 2.4 MB to send: no more than the high-water mark and one frame waits; the rest of
        // the bodies wait with their senders.
        let waiting = queued(&hub);
        assert!(waiting > HIGH_WATER / 2, "{} bytes queued", waiting);
        assert!(
            waiting <= HIGH_WATER + queued_size(frames::MAX_PAYLOAD),
            "{} bytes queued",
            waiting
        );
        // The bodies that found room went whole (each within its window); the rest wait.
        let waiting: Vec<_> = senders
            .into_iter()
            .filter(|sender| !sender.is_finished())
            .collect();
        assert!(waiting.len() >= 12 - HIGH_WATER / body.len() - 1);
        // The write never finishes: the tunnel is cut off, every waiting sender told.
        let why = tokio::time::timeout(Duration::from_secs(5), serving)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(why, "cut off: it does not read (a write waited 0.5 s)");
        assert!(!hub.connected("n1"));
        for sender in waiting {
            let failed = tokio::time::timeout(Duration::from_secs(5), sender)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(failed.unwrap_err().code, TUNNEL_CLOSED);
        }
    }

    #[tokio::test]
    async fn pings_get_one_pong_for_the_latest_and_a_flood_closes_the_tunnel() {
        let (_hub, mut agent, serving) = start(8, Duration::from_secs(30)).await;
        let mut burst = Vec::new();
        for index in 0..frames::PING_BURST {
            let payload = format!("ping {}", index);
            let frame = ws::encode_frame(ws::OP_PING, payload.as_bytes(), &mut agent.entropy);
            burst.extend_from_slice(&frame.unwrap());
        }
        agent.writer.write_all(&burst).await.unwrap();
        // Every PING read before the writer ran is answered by one PONG, the latest's.
        let mut pongs = Vec::new();
        let last = format!("ping {}", frames::PING_BURST - 1).into_bytes();
        while pongs.last() != Some(&last) {
            let pong = agent.message().await;
            assert_eq!(pong.opcode, ws::OP_PONG);
            pongs.push(pong.payload);
        }
        assert!(
            pongs.len() < frames::PING_BURST as usize,
            "{} pongs",
            pongs.len()
        );
        // One more at once: the tunnel is closed (1008).
        agent.send_raw(ws::OP_PING, b"one more").await;
        let close = agent.message().await;
        assert_eq!(close.opcode, ws::OP_CLOSE);
        assert_eq!(close.payload[..2], CLOSE_POLICY.to_be_bytes());
        assert_eq!(&close.payload[2..], b"too many pings");
        let why = serving.await.unwrap();
        assert_eq!(
            why,
            format!("cut off: more than {} PINGs at once", frames::PING_BURST)
        );
    }

    /// `count` keepalives in one BATCH message.
    fn keepalives(count: usize) -> Vec<u8> {
        let mut message = frames::encode(frames::BATCH, 0, b"");
        for _ in 0..count {
            let frame = frames::keepalive();
            message.extend_from_slice(&(frame.len() as u32).to_be_bytes());
            message.extend_from_slice(&frame);
        }
        message
    }

    #[tokio::test]
    async fn a_batch_of_too_many_frames_closes_the_tunnel_with_its_reason() {
        let (hub, mut agent, serving) = start(8, Duration::from_secs(30)).await;
        agent
            .send_raw(ws::OP_BINARY, &keepalives(frames::MAX_BATCH_FRAMES))
            .await;
        assert!(hub.connected("n1"));
        agent
            .send_raw(ws::OP_BINARY, &keepalives(frames::MAX_BATCH_FRAMES + 1))
            .await;
        let close = agent.message().await;
        assert_eq!(close.opcode, ws::OP_CLOSE);
        assert_eq!(close.payload[..2], CLOSE_PROTOCOL.to_be_bytes());
        let reason = format!("a BATCH of more than {} frames", frames::MAX_BATCH_FRAMES);
        assert_eq!(&close.payload[2..], reason.as_bytes());
        assert_eq!(
            serving.await.unwrap(),
            format!("a protocol error ({})", reason)
        );
    }

    #[tokio::test]
    async fn the_reader_takes_frames_at_its_rate() {
        let (hub, mut agent, _serving) = start(8, Duration::from_secs(30)).await;
        let mut stream = hub.open("n1", OPEN.to_vec(), None).await.unwrap();
        agent.frames().await;
        // Twice the burst, then a RESET: it is read once the rate allowed the rest.
        let began = Instant::now();
        let messages = 2 * frames::FRAME_BURST as usize / frames::MAX_BATCH_FRAMES;
        let mut flood = Vec::new();
        for _ in 0..messages {
            let message = keepalives(frames::MAX_BATCH_FRAMES);
            flood.extend_from_slice(
                &ws::encode_frame(ws::OP_BINARY, &message, &mut agent.entropy).unwrap(),
            );
        }
        agent.writer.write_all(&flood).await.unwrap();
        agent
            .send(vec![frames::reset(1, "CANCELLED", "gone")])
            .await;
        assert_eq!(stream.response().await.unwrap_err().code, "CANCELLED");
        let over = (messages * frames::MAX_BATCH_FRAMES) as f64 - frames::FRAME_BURST as f64;
        let least = Duration::from_secs_f64(over / frames::FRAMES_PER_SECOND as f64 * 0.9);
        assert!(
            began.elapsed() >= least,
            "{:?} < {:?}",
            began.elapsed(),
            least
        );
        assert!(hub.connected("n1"));
    }
}
