//! One open tunnel: its reader, its one writer, its keepalive, and a task per stream that
//! relays the stream's request to the replica's local port over HTTP/1.1 keep-alive (hyper's
//! pooled client) and its answer back, both bodies under the protocol's windows.
//!
//! The replica's request is framed here, from the bytes that arrive, never by the client's
//! headers: the OPEN's `content-length` (the length the gateway read the body by) is sent only
//! with a body held to it (`BodyFraming`: a body longer or shorter is reset, never completed),
//! else the body goes chunked, or whole with its own length when its END came with the OPEN. A
//! body that does not end (the stream reset, the tunnel gone) is aborted, so the replica never
//! reads a cut request as a whole one. A replica's answer whose framing contradicts itself
//! (`Content-Length` with `Transfer-Encoding`) is refused: the stream reset and the replica's
//! connection dropped, never reused (`contradicting_framing`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::HttpBody;
use hyper::client::HttpConnector;
use hyper::header::{self, HeaderMap};
use hyper::{Body, Client, Request};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;

use crate::frames::{self, hop_by_hop, Frame};
use crate::tls::Tls;
use crate::ws::{self, Entropy, WsError};

/// The tunnel's connection: TCP, or TLS over it.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

pub const KEEPALIVE: Duration = Duration::from_secs(10);
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The most one WebSocket message from the control plane may hold (the Python agent's limit).
const MAX_MESSAGE: usize = 2 * frames::MAX_PAYLOAD;
const CLOSE_PROTOCOL: u16 = 1002;
const CLOSE_GOING_AWAY: u16 = 1001;

/// What the relay knows and shares across tunnels. The credential lives only in
/// `authorization`, which nothing prints.
pub struct Shared {
    pub connect_host: String,
    pub connect_port: u16,
    pub host_header: String,
    pub path: String,
    pub authorization: String,
    pub local_host: String,
    pub max_streams: usize,
    pub tls: Option<Tls>,
    pub ports: Mutex<HashMap<String, u16>>,
    pub ports_changed: Notify,
    pub in_flight: Mutex<HashMap<String, u32>>,
    pub in_flight_changed: Notify,
    /// The most of one request body a stream held at once (received, not yet passed on).
    pub peak_buffered: AtomicI64,
    pub out: UnboundedSender<String>,
    pub client: Client<HttpConnector, Body>,
    /// Never reuses a connection: a request tried again after a closed one.
    pub fresh: Client<HttpConnector, Body>,
}

impl Shared {
    /// The local port of `replica`: known, or asked of the agent (at most a second's wait).
    async fn port(&self, replica: &str) -> Option<u16> {
        if let Some(port) = self.ports.lock().unwrap().get(replica) {
            return Some(*port);
        }
        let changed = self.ports_changed.notified();
        let _ = self.out.send("{\"want_ports\":true}".to_string());
        let _ = tokio::time::timeout(Duration::from_secs(1), changed).await;
        self.ports.lock().unwrap().get(replica).copied()
    }

    fn count(&self, replica: &str, change: i64) {
        let mut counts = self.in_flight.lock().unwrap();
        let left = *counts.get(replica).unwrap_or(&0) as i64 + change;
        if left > 0 {
            counts.insert(replica.to_string(), left as u32);
        } else {
            counts.remove(replica);
        }
        drop(counts);
        self.in_flight_changed.notify_one();
    }
}

pub fn log(level: &str, message: &str) {
    eprintln!("{} {}", level, message);
}

enum Out {
    Frames(Vec<Vec<u8>>),
    Control(u8, Vec<u8>),
}

type Writer = UnboundedSender<Out>;

fn send(writer: &Writer, frames: Vec<Vec<u8>>) -> bool {
    writer.send(Out::Frames(frames)).is_ok()
}

/// The one writer: frames sent while a message is being written leave together in the next,
/// as one BATCH of at most `MAX_BATCH` bytes (the control plane pays for each message).
async fn write_loop(
    mut io: WriteHalf<Box<dyn Io>>,
    mut queue: UnboundedReceiver<Out>,
    mut entropy: Entropy,
) -> Result<(), WsError> {
    let mut pending: VecDeque<Vec<u8>> = VecDeque::new();
    let mut control: VecDeque<(u8, Vec<u8>)> = VecDeque::new();
    loop {
        if pending.is_empty() && control.is_empty() {
            match queue.recv().await {
                Some(Out::Frames(frames)) => pending.extend(frames),
                Some(Out::Control(opcode, payload)) => control.push_back((opcode, payload)),
                None => return Ok(()),
            }
            // Let the streams made ready in this wake-up add theirs to the message.
            tokio::task::yield_now().await;
        }
        loop {
            match queue.try_recv() {
                Ok(Out::Frames(frames)) => pending.extend(frames),
                Ok(Out::Control(opcode, payload)) => control.push_back((opcode, payload)),
                Err(_) => break,
            }
        }
        while let Some((opcode, payload)) = control.pop_front() {
            io.write_all(&ws::encode_frame(opcode, &payload, &mut entropy)?)
                .await?;
            if opcode == ws::OP_CLOSE {
                return Ok(());
            }
        }
        if pending.is_empty() {
            continue;
        }
        let message = frames::take_batch(&mut pending);
        io.write_all(&ws::encode_frame(ws::OP_BINARY, &message, &mut entropy)?)
            .await?;
    }
}

/// How much DATA this side may still send on a stream (`SendWindow` there).
struct SendWindow {
    available: Mutex<i64>,
    granted: Notify,
    closed: AtomicBool,
}

impl SendWindow {
    fn new() -> SendWindow {
        SendWindow {
            available: Mutex::new(frames::INITIAL_WINDOW),
            granted: Notify::new(),
            closed: AtomicBool::new(false),
        }
    }

    fn grant(&self, increment: i64) -> bool {
        let mut available = self.available.lock().unwrap();
        if !frames::window_fits(*available, increment) {
            return false;
        }
        *available += increment;
        drop(available);
        self.granted.notify_one();
        true
    }

    fn available(&self) -> i64 {
        *self.available.lock().unwrap()
    }

    fn spend(&self, size: usize) {
        *self.available.lock().unwrap() -= size as i64;
    }

    /// Up to `wanted` bytes, at least 1, once there are some; 0 once the stream is over.
    async fn take(&self, wanted: usize) -> usize {
        loop {
            if self.closed.load(Ordering::Acquire) {
                return 0;
            }
            {
                let mut available = self.available.lock().unwrap();
                if *available > 0 {
                    let taken = (wanted as i64).min(*available);
                    *available -= taken;
                    return taken as usize;
                }
            }
            self.granted.notified().await;
        }
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.granted.notify_one();
    }
}

/// A stream as the reader sees it.
struct Entry {
    body: UnboundedSender<Option<Bytes>>,
    /// What the control plane may still send (the reader takes, the body's reader grants).
    remaining: Arc<AtomicI64>,
    /// Received and not yet passed on to the replica.
    buffered: Arc<AtomicI64>,
    window: Arc<SendWindow>,
    task: JoinHandle<()>,
}

type Streams = Arc<Mutex<HashMap<u32, Entry>>>;

fn end_stream(streams: &Streams, id: u32) {
    if let Some(entry) = streams.lock().unwrap().remove(&id) {
        entry.window.close();
        entry.task.abort();
    }
}

/// Run one tunnel until it closes or the agent stops (`stop`): Ok once it was open (however it
/// ended, unless the control plane broke the protocol); Err when it could not be opened.
pub async fn session(
    shared: &Arc<Shared>,
    stop: &mut watch::Receiver<bool>,
    opened: &mut u64,
) -> Result<(), WsError> {
    let address = (shared.connect_host.as_str(), shared.connect_port);
    let socket = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(address)).await {
        Ok(result) => result?,
        Err(_) => return Err(WsError::Io("TimeoutError".into())),
    };
    socket.set_nodelay(true)?;
    let mut socket: Box<dyn Io> = match &shared.tls {
        None => Box::new(socket),
        Some(tls) => {
            let connector = tokio_rustls::TlsConnector::from(tls.config.clone());
            let secured = connector.connect(tls.server_name.clone(), socket);
            match tokio::time::timeout(CONNECT_TIMEOUT, secured).await {
                Ok(Ok(stream)) => Box::new(stream),
                Ok(Err(error)) => return Err(WsError::Io(format!("TLS: {}", error))),
                Err(_) => return Err(WsError::Io("TimeoutError".into())),
            }
        }
    };
    let mut entropy = Entropy::open()?;
    let upgrade = ws::handshake(
        &mut socket,
        &shared.host_header,
        &shared.path,
        &shared.authorization,
        &mut entropy,
    );
    let already = match tokio::time::timeout(CONNECT_TIMEOUT, upgrade).await {
        Ok(result) => result?,
        Err(_) => return Err(WsError::Io("TimeoutError".into())),
    };
    *opened += 1;
    log("info", "tunnel open");
    let _ = shared
        .out
        .send(format!("{{\"connected\":true,\"connections\":{}}}", opened));
    let (read_half, write_half) = tokio::io::split(socket);
    let (writer, queue) = unbounded_channel::<Out>();
    let write_task = tokio::spawn(write_loop(write_half, queue, entropy));
    let streams: Streams = Arc::new(Mutex::new(HashMap::new()));
    let beat_writer = writer.clone();
    let beat = tokio::spawn(async move {
        loop {
            if !send(&beat_writer, vec![frames::keepalive()]) {
                return;
            }
            let _ = beat_writer.send(Out::Control(ws::OP_PING, Vec::new()));
            tokio::time::sleep(KEEPALIVE).await;
        }
    });
    let mut reader = ws::Reader::new(read_half, already, MAX_MESSAGE);
    let mut partial = None;
    let outcome = loop {
        let message = tokio::select! {
            message = tokio::time::timeout(IDLE_TIMEOUT, reader.message(&mut partial)) => message,
            _ = stop.changed() => {
                let mut payload = CLOSE_GOING_AWAY.to_be_bytes().to_vec();
                payload.extend_from_slice(b"the agent is stopping");
                let _ = writer.send(Out::Control(ws::OP_CLOSE, payload));
                break Ok(());
            }
        };
        let message = match message {
            Ok(Ok(message)) => message,
            Ok(Err(error)) => break Err(error),
            Err(_) => {
                break Err(WsError::Io(
                    "no word from the control plane for 30 s".into(),
                ))
            }
        };
        match message.opcode {
            ws::OP_BINARY => match frames::decode_message(&message.payload) {
                Ok(decoded) => {
                    for frame in decoded {
                        dispatch(shared, &writer, &streams, frame);
                    }
                }
                Err(reason) => break Err(WsError::Protocol(reason)),
            },
            ws::OP_TEXT => break Err(WsError::Protocol("a text message on the tunnel".into())),
            ws::OP_PING => {
                let _ = writer.send(Out::Control(ws::OP_PONG, message.payload));
            }
            ws::OP_PONG => {}
            _ => {
                // Close: answered with the same code, then the tunnel is over.
                let code = message
                    .payload
                    .get(..2)
                    .map(|raw| raw.to_vec())
                    .unwrap_or_default();
                let _ = writer.send(Out::Control(ws::OP_CLOSE, code));
                break Ok(());
            }
        }
    };
    if let Err(WsError::Protocol(reason)) = &outcome {
        log(
            "warning",
            &format!(
                "the control plane broke the tunnel's protocol ({}); reconnecting",
                reason
            ),
        );
        let mut payload = CLOSE_PROTOCOL.to_be_bytes().to_vec();
        payload.extend_from_slice(b"protocol error");
        let _ = writer.send(Out::Control(ws::OP_CLOSE, payload));
    }
    beat.abort();
    for (_, entry) in streams.lock().unwrap().drain() {
        entry.window.close();
        entry.task.abort();
    }
    drop(writer);
    let _ = tokio::time::timeout(Duration::from_secs(1), write_task).await;
    let _ = shared.out.send("{\"connected\":false}".to_string());
    match outcome {
        Ok(()) | Err(WsError::Io(_)) => Ok(()),
        Err(error) => Err(error),
    }
}

fn dispatch(shared: &Arc<Shared>, writer: &Writer, streams: &Streams, frame: Frame) {
    let id = frame.stream;
    if frame.kind == frames::WINDOW && id == 0 {
        return; // the control plane's keepalive, if it sends one
    }
    if frame.kind == frames::OPEN {
        open(shared, writer, streams, id, &frame.payload);
        return;
    }
    let map = streams.lock().unwrap();
    let entry = match map.get(&id) {
        Some(entry) => entry,
        None => return, // a stream already over: its frames in flight are dropped
    };
    let failure = match frame.kind {
        frames::DATA => {
            let size = frame.payload.len() as i64;
            if entry.remaining.fetch_sub(size, Ordering::AcqRel) < size {
                Some((
                    frames::FLOW_CONTROL,
                    "DATA past the stream's window".to_string(),
                ))
            } else {
                let held = entry.buffered.fetch_add(size, Ordering::AcqRel) + size;
                shared.peak_buffered.fetch_max(held, Ordering::AcqRel);
                let _ = entry.body.send(Some(Bytes::from(frame.payload)));
                None
            }
        }
        frames::END => {
            let _ = entry.body.send(None);
            None
        }
        frames::WINDOW => match frames::parse_window(&frame.payload) {
            Ok(increment) if entry.window.grant(increment) => None,
            Ok(_) => Some((frames::FLOW_CONTROL, "a WINDOW past 2**31 - 1".to_string())),
            Err(reason) => Some((frames::PROTOCOL_ERROR, reason)),
        },
        frames::RESET => {
            drop(map);
            end_stream(streams, id);
            return;
        }
        other => Some((
            frames::PROTOCOL_ERROR,
            format!("frame type {} from the control plane", other),
        )),
    };
    drop(map);
    if let Some((code, message)) = failure {
        end_stream(streams, id);
        send(writer, vec![frames::reset(id, code, &message)]);
    }
}

fn open(shared: &Arc<Shared>, writer: &Writer, streams: &Streams, id: u32, payload: &[u8]) {
    let mut map = streams.lock().unwrap();
    if map.contains_key(&id) {
        send(
            writer,
            vec![frames::reset(
                id,
                frames::PROTOCOL_ERROR,
                "an OPEN for a stream that is open",
            )],
        );
        return;
    }
    if map.len() >= shared.max_streams {
        let message = format!("{} streams open", shared.max_streams);
        send(
            writer,
            vec![frames::reset(id, frames::TOO_MANY_STREAMS, &message)],
        );
        return;
    }
    let request = match frames::parse_open(payload) {
        Ok(request) => request,
        Err(reason) => {
            send(
                writer,
                vec![frames::reset(id, frames::PROTOCOL_ERROR, &reason)],
            );
            return;
        }
    };
    let (body, body_queue) = unbounded_channel();
    let remaining = Arc::new(AtomicI64::new(frames::INITIAL_WINDOW));
    let buffered = Arc::new(AtomicI64::new(0));
    let window = Arc::new(SendWindow::new());
    let stream = Stream {
        shared: shared.clone(),
        writer: writer.clone(),
        streams: streams.clone(),
        id,
        remaining: remaining.clone(),
        buffered: buffered.clone(),
        window: window.clone(),
    };
    // Inserted under the lock the task's own removal takes, so it cannot end unseen first.
    let task = tokio::spawn(stream.run(request, body_queue));
    map.insert(
        id,
        Entry {
            body,
            remaining,
            buffered,
            window,
            task,
        },
    );
}

struct Stream {
    shared: Arc<Shared>,
    writer: Writer,
    streams: Streams,
    id: u32,
    remaining: Arc<AtomicI64>,
    buffered: Arc<AtomicI64>,
    window: Arc<SendWindow>,
}

/// Counts the request in flight, and forgets the stream, however its task ends (aborted too).
struct InFlight {
    shared: Arc<Shared>,
    streams: Streams,
    replica: String,
    id: u32,
    pump: Option<JoinHandle<()>>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(pump) = self.pump.take() {
            pump.abort();
        }
        self.streams.lock().unwrap().remove(&self.id);
        self.shared.count(&self.replica, -1);
    }
}

impl Stream {
    /// Reset the stream; its task returns at once, and its `InFlight` forgets it.
    fn reset(&self, code: &str, message: &str) {
        send(&self.writer, vec![frames::reset(self.id, code, message)]);
    }

    async fn run(
        self,
        request: frames::OpenRequest,
        mut body_queue: UnboundedReceiver<Option<Bytes>>,
    ) {
        self.shared.count(&request.replica_id, 1);
        let mut guard = InFlight {
            shared: self.shared.clone(),
            streams: self.streams.clone(),
            replica: request.replica_id.clone(),
            id: self.id,
            pump: None,
        };
        let port = match self.shared.port(&request.replica_id).await {
            Some(port) => port,
            None => {
                let message = format!("this node runs no replica {}", request.replica_id);
                return self.reset(frames::NO_SUCH_REPLICA, &message);
            }
        };
        // The body's pieces already here: all of it when its END came with the OPEN.
        let mut pieces: Vec<Bytes> = Vec::new();
        let mut ended = false;
        while let Ok(piece) = body_queue.try_recv() {
            match piece {
                Some(piece) => pieces.push(piece),
                None => {
                    ended = true;
                    break;
                }
            }
        }
        let taken: usize = pieces.iter().map(|piece| piece.len()).sum();
        self.buffered.fetch_sub(taken as i64, Ordering::AcqRel);
        let declared = match declared_length(&request.headers) {
            Ok(declared) => declared,
            Err(reason) => return self.reset(frames::PROTOCOL_ERROR, reason),
        };
        if ended && declared.is_some_and(|length| length != taken as u64) {
            return self.reset(frames::PROTOCOL_ERROR, LENGTH_MISMATCH);
        }
        // A whole body is kept, so a kept-alive connection the replica closed as the request
        // went (no answer begun) can be tried once more on a connection of its own.
        let mut whole: Option<Bytes> = None;
        let body = if ended {
            let bytes = match pieces.len() {
                0 => Bytes::new(),
                1 => pieces.pop().unwrap(),
                _ => Bytes::from(pieces.concat()),
            };
            whole = Some(bytes.clone());
            Body::from(bytes)
        } else {
            let (sender, body) = Body::channel();
            guard.pump = Some(tokio::spawn(pump(
                pieces,
                body_queue,
                BodyFraming::new(sender, declared),
                Pumped {
                    writer: self.writer.clone(),
                    streams: self.streams.clone(),
                    id: self.id,
                    remaining: self.remaining.clone(),
                    buffered: self.buffered.clone(),
                },
            )));
            body
        };
        let outbound = match to_replica(&self.shared, &request, port, declared, ended, body) {
            Ok(outbound) => outbound,
            Err(reason) => return self.reset(frames::PROTOCOL_ERROR, reason),
        };
        let mut sent = self.shared.client.request(outbound).await;
        if let (Err(error), Some(bytes)) = (&sent, whole) {
            if closed_unanswered(error) {
                // Built again only here: a request sent once pays for no copy.
                if let Ok(again) = to_replica(
                    &self.shared,
                    &request,
                    port,
                    declared,
                    ended,
                    Body::from(bytes),
                ) {
                    sent = self.shared.fresh.request(again).await;
                }
            }
        }
        let response = match sent {
            Ok(response) => response,
            Err(error) => {
                let message = format!(
                    "the replica's port {} did not answer ({})",
                    port,
                    describe(&error)
                );
                return self.reset(frames::UPSTREAM_UNREACHABLE, &message);
            }
        };
        let (parts, mut answer) = response.into_parts();
        if contradicting_framing(&parts.headers) {
            // `answer` dropped unread: hyper closes that connection rather than reuse it.
            return self.reset(
                frames::UPSTREAM_FAILED,
                "the replica's answer declares both Content-Length and Transfer-Encoding",
            );
        }
        let head = frames::encode(
            frames::RESPONSE,
            self.id,
            &frames::response_head(parts.status.as_u16(), &parts.headers),
        );
        let declared = answer.size_hint().exact();
        let fits = |size: u64| {
            size as usize <= frames::MAX_PAYLOAD && (size as i64) <= self.window.available()
        };
        if declared.map(fits).unwrap_or(false) {
            // Small and declared: read whole, then RESPONSE, DATA and END as one message.
            let data = match hyper::body::to_bytes(answer).await {
                Ok(data) => data,
                Err(error) => {
                    let message = format!("the replica broke off ({})", describe(&error));
                    return self.reset(frames::UPSTREAM_FAILED, &message);
                }
            };
            let mut out = vec![head];
            if !data.is_empty() {
                self.window.spend(data.len());
                out.push(frames::encode(frames::DATA, self.id, &data));
            }
            out.push(frames::encode(frames::END, self.id, b""));
            send(&self.writer, out);
        } else {
            send(&self.writer, vec![head]);
            while let Some(piece) = answer.data().await {
                let piece = match piece {
                    Ok(piece) => piece,
                    Err(error) => {
                        let message = format!("the replica broke off ({})", describe(&error));
                        return self.reset(frames::UPSTREAM_FAILED, &message);
                    }
                };
                let mut at = 0;
                while at < piece.len() {
                    let taken = self
                        .window
                        .take((piece.len() - at).min(frames::MAX_PAYLOAD))
                        .await;
                    if taken == 0 {
                        return; // reset: the stream is over
                    }
                    send(
                        &self.writer,
                        vec![frames::encode(
                            frames::DATA,
                            self.id,
                            &piece[at..at + taken],
                        )],
                    );
                    at += taken;
                }
            }
            send(
                &self.writer,
                vec![frames::encode(frames::END, self.id, b"")],
            );
        }
        drop(guard);
    }
}

/// The reset's message for a body longer or shorter than its declared length.
const LENGTH_MISMATCH: &str = "the request's body is not the length it declared";

/// The OPEN's `content-length`: None when it has none; an error for one that is not a single
/// number (the gateway checked it: a relay never guesses).
fn declared_length(headers: &[(String, String)]) -> Result<Option<u64>, &'static str> {
    let mut declared = None;
    for (name, value) in headers {
        if name.eq_ignore_ascii_case("content-length") {
            let text = value.trim();
            let length = match text.parse::<u64>() {
                Ok(length) if text.bytes().all(|byte| byte.is_ascii_digit()) => length,
                _ => return Err("an OPEN whose content-length is not a number"),
            };
            if declared.is_some_and(|earlier| earlier != length) {
                return Err("an OPEN with two content-lengths");
            }
            declared = Some(length);
        }
    }
    Ok(declared)
}

/// Whether a replica's answer frames its body two ways (`Content-Length` beside
/// `Transfer-Encoding`): which one a reader believes decides where the next answer starts.
/// (hyper refuses differing or malformed lengths itself.)
fn contradicting_framing(headers: &HeaderMap) -> bool {
    headers.contains_key(header::TRANSFER_ENCODING) && headers.contains_key(header::CONTENT_LENGTH)
}

/// A streamed request body's sending end, held to its declared length: a piece past it, an
/// END short of it, or any end but a clean one (the stream reset, the task aborted) aborts the
/// body, so hyper never completes the request (no last chunk, no missing bytes made up).
struct BodyFraming {
    sender: Option<hyper::body::Sender>,
    declared: Option<u64>,
    sent: u64,
}

impl BodyFraming {
    fn new(sender: hyper::body::Sender, declared: Option<u64>) -> BodyFraming {
        BodyFraming {
            sender: Some(sender),
            declared,
            sent: 0,
        }
    }

    /// Send `piece`; Err(true) when it passes the declared length (aborted), Err(false) when
    /// hyper no longer takes the body.
    async fn send(&mut self, piece: Bytes) -> Result<(), bool> {
        self.sent += piece.len() as u64;
        if self.declared.is_some_and(|length| self.sent > length) {
            self.abort();
            return Err(true);
        }
        match self.sender.as_mut() {
            Some(sender) => sender.send_data(piece).await.map_err(|_| false),
            None => Err(false),
        }
    }

    /// The END came: the body is complete when it holds its declared length (false: aborted).
    fn end(mut self) -> bool {
        if self.declared.is_some_and(|length| self.sent != length) {
            self.abort();
            return false;
        }
        drop(self.sender.take()); // dropping the sender ends the body
        true
    }

    fn abort(&mut self) {
        if let Some(sender) = self.sender.take() {
            sender.abort();
        }
    }
}

impl Drop for BodyFraming {
    fn drop(&mut self) {
        self.abort();
    }
}

/// What a stream's body pump reports through.
struct Pumped {
    writer: Writer,
    streams: Streams,
    id: u32,
    remaining: Arc<AtomicI64>,
    buffered: Arc<AtomicI64>,
}

impl Pumped {
    /// The body broke its declared length: the stream is reset and forgotten.
    fn mismatch(&self) {
        send(
            &self.writer,
            vec![frames::reset(
                self.id,
                frames::PROTOCOL_ERROR,
                LENGTH_MISMATCH,
            )],
        );
        end_stream(&self.streams, self.id);
    }
}

/// A streamed request body: each piece to the replica as it comes, the window granted back as
/// the pieces are taken (half the initial window at a time, as the Python end does).
async fn pump(
    first: Vec<Bytes>,
    mut queue: UnboundedReceiver<Option<Bytes>>,
    mut body: BodyFraming,
    pumped: Pumped,
) {
    let mut consumed: i64 = 0;
    let mut ready: VecDeque<Bytes> = first.into();
    loop {
        let piece = match ready.pop_front() {
            Some(piece) => piece,
            None => match queue.recv().await {
                Some(Some(piece)) => {
                    pumped
                        .buffered
                        .fetch_sub(piece.len() as i64, Ordering::AcqRel);
                    piece
                }
                Some(None) => {
                    if !body.end() {
                        pumped.mismatch();
                    }
                    return;
                }
                None => return, // reset: `body` dropped aborts it, the replica sees it cut
            },
        };
        let size = piece.len() as i64;
        match body.send(piece).await {
            Ok(()) => {}
            Err(true) => return pumped.mismatch(),
            Err(false) => return,
        }
        consumed += size;
        if consumed >= frames::INITIAL_WINDOW / 2 {
            pumped.remaining.fetch_add(consumed, Ordering::AcqRel);
            send(
                &pumped.writer,
                vec![frames::window(pumped.id, consumed as u32)],
            );
            consumed = 0;
        }
    }
}

/// The request to the replica's local port: the tunnel's method, path, query and headers (but
/// those of one hop and the length: the framing is this end's), framed by `declared` and
/// `ended`; the reason for a request that cannot be sent.
fn to_replica(
    shared: &Shared,
    request: &frames::OpenRequest,
    port: u16,
    declared: Option<u64>,
    ended: bool,
    body: Body,
) -> Result<Request<Body>, &'static str> {
    let query = if request.query.is_empty() {
        String::new()
    } else {
        format!("?{}", request.query)
    };
    let uri = format!(
        "http://{}:{}{}{}",
        shared.local_host, port, request.path, query
    );
    let mut builder = Request::builder()
        .method(request.method.as_bytes())
        .uri(uri);
    for (name, value) in &request.headers {
        let lowered = name.to_ascii_lowercase();
        if hop_by_hop(&lowered) || lowered == "content-length" {
            continue; // the framing is this end's: below
        }
        if value.chars().any(|c| c as u32 > 0xFF) {
            return Err("a header value that is not Latin-1");
        }
        let raw: Vec<u8> = value.chars().map(|c| c as u8).collect();
        builder = builder.header(name.as_str(), raw);
    }
    builder = match (declared, ended) {
        (Some(length), _) => builder.header(header::CONTENT_LENGTH, length),
        // Streamed, its length unknown: chunked (hyper would send a GET's as empty).
        (None, false) => builder.header(header::TRANSFER_ENCODING, "chunked"),
        (None, true) => builder, // whole: hyper gives it its length
    };
    builder
        .body(body)
        .map_err(|_| "a request that is not valid HTTP")
}

/// A kept-alive connection the server closed before any answer: it took the request for the
/// next on a connection it was closing (llama.cpp's server does, between calls). Tried once more
/// on a fresh connection, as the gateway tries another replica after a failure before any
/// answer.
fn closed_unanswered(error: &hyper::Error) -> bool {
    error.is_incomplete_message() || error.is_canceled()
}

fn describe(error: &hyper::Error) -> &'static str {
    if error.is_connect() {
        "ConnectionRefusedError"
    } else if error.is_incomplete_message() {
        "IncompleteReadError"
    } else if error.is_timeout() {
        "TimeoutError"
    } else if error.is_canceled() {
        "CancelledError"
    } else {
        "ConnectionError"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect()
    }

    #[test]
    fn the_declared_length_is_one_number_or_none() {
        assert_eq!(declared_length(&pairs(&[("a", "b")])), Ok(None));
        assert_eq!(
            declared_length(&pairs(&[("Content-Length", " 12 ")])),
            Ok(Some(12))
        );
        assert_eq!(
            declared_length(&pairs(&[("content-length", "5"), ("content-length", "5")])),
            Ok(Some(5))
        );
        for bad in [
            &[("content-length", "5"), ("content-length", "6")][..],
            &[("content-length", "+5")],
            &[("content-length", "5, 6")],
            &[("content-length", "")],
        ] {
            assert!(declared_length(&pairs(bad)).is_err(), "{:?}", bad);
        }
    }

    #[test]
    fn an_answer_framed_two_ways_is_refused() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
        assert!(!contradicting_framing(&headers));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        assert!(contradicting_framing(&headers));
        headers.remove(header::CONTENT_LENGTH);
        assert!(!contradicting_framing(&headers));
    }

    async fn received(body: Body) -> Result<Vec<u8>, hyper::Error> {
        hyper::body::to_bytes(body)
            .await
            .map(|bytes| bytes.to_vec())
    }

    #[tokio::test]
    async fn a_body_held_to_its_length_completes_only_when_it_matches() {
        // Exactly the length: complete.
        let (sender, body) = Body::channel();
        let mut framing = BodyFraming::new(sender, Some(5));
        let reader = tokio::spawn(received(body));
        framing.send(Bytes::from_static(b"hel")).await.unwrap();
        framing.send(Bytes::from_static(b"lo")).await.unwrap();
        assert!(framing.end());
        assert_eq!(reader.await.unwrap().unwrap(), b"hello");
        // Longer: the piece that passes it is not sent, the body aborted.
        let (sender, body) = Body::channel();
        let mut framing = BodyFraming::new(sender, Some(5));
        let reader = tokio::spawn(received(body));
        let smuggled = Bytes::from_static(b"helloGET /smuggled HTTP/1.1\r\n\r\n");
        assert_eq!(framing.send(smuggled).await, Err(true));
        assert!(reader.await.unwrap().is_err());
        // Shorter at its END: aborted.
        let (sender, body) = Body::channel();
        let mut framing = BodyFraming::new(sender, Some(5));
        let reader = tokio::spawn(received(body));
        framing.send(Bytes::from_static(b"hel")).await.unwrap();
        assert!(!framing.end());
        assert!(reader.await.unwrap().is_err());
    }

    #[tokio::test]
    async fn a_body_that_never_ends_is_aborted_not_completed() {
        // Chunked (no length): dropped without its END, as a reset stream's pump is.
        let (sender, body) = Body::channel();
        let mut framing = BodyFraming::new(sender, None);
        let reader = tokio::spawn(received(body));
        framing.send(Bytes::from_static(b"part")).await.unwrap();
        drop(framing);
        assert!(reader.await.unwrap().is_err());
        // Its END: complete, whatever its length.
        let (sender, body) = Body::channel();
        let mut framing = BodyFraming::new(sender, None);
        let reader = tokio::spawn(received(body));
        framing.send(Bytes::from_static(b"part")).await.unwrap();
        assert!(framing.end());
        assert_eq!(reader.await.unwrap().unwrap(), b"part");
    }
}
