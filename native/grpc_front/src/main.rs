//! The model server's gRPC front (KServe v2, `inference.GRPCInferenceService`).
//!
//! It does the transport: HTTP/2 (prior knowledge, as gRPC clients speak it without TLS), gRPC's
//! message framing, status and trailers. Every call's message goes unchanged, over a kept-alive
//! HTTP/1.1 connection on loopback, to the model server that started it
//! (`runtime_worker.serving.grpc_front`), which parses it, runs it on its data plane and answers
//! with the response message or the gRPC status to send. So what a call means is decided in one
//! place for both fronts; this process only moves bytes, outside Python's interpreter lock.
//!
//!     modelforge-grpc-front --listen HOST:PORT --backend 127.0.0.1:PORT
//!         --max-message-bytes N --max-calls N --grace-seconds S
//!         [--first-message-seconds S (10)] [--message-seconds S (60)]
//!
//! Its standard input carries the backend's token (one line) and then stays open: at its end
//! (the model server stopping, or gone) the front stops taking calls, lets those running finish
//! for up to the grace period and exits; so do SIGTERM and SIGINT. Once listening it prints
//! `listening PORT` on standard output. A message over `--max-message-bytes` is refused
//! (RESOURCE_EXHAUSTED) from its length prefix, before it is read. A call takes one of
//! `--max-calls` places only once its message has arrived whole, for as long as the model server
//! has it: one past them is refused (RESOURCE_EXHAUSTED) at once, so calls that are slow to send
//! hold no place. The messages being read are bounded per connection (a quarter of
//! `--max-calls`, `reading_per_connection`; a connection's other calls wait their turn); a call
//! whose message has not begun (its 5-byte prefix) within `--first-message-seconds` of its
//! HEADERS, or not arrived whole within `--message-seconds`, is ended with DEADLINE_EXCEEDED.
//! Each connection has a budget of frames that carry nothing (`guard.rs`); h2 bounds
//! resets, header lists and CONTINUATION frames. An `accept()` that fails (EMFILE) is retried
//! after a pause that doubles up to a second, never in a spin. It never logs request data.

mod guard;

use std::collections::HashMap;
use std::future::Future;
use std::io::Write as _;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use h2::server::SendResponse;
use h2::RecvStream;
use http::{HeaderMap, HeaderValue, Request, Response};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::{watch, Semaphore};
use tokio::time::Instant;

use crate::guard::Guarded;

const SERVICE: &str = "/inference.GRPCInferenceService/";
const METHODS: [&str; 6] = [
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelInfer",
];
/// The backend's route for a call of `METHODS[i]`, and the header carrying its token.
const BACKEND_PREFIX: &str = "/_modelforge/grpc/";
const TOKEN_HEADER: &str = "x-modelforge-front";
/// The compressions of messages the model server inflates (named as in grpc-encoding), and
/// the header that tells it a relayed message's.
const COMPRESSIONS: [&str; 2] = ["gzip", "deflate"];
const ENCODING_HEADER: &str = "x-grpc-encoding";
/// The most a backend answer's head may be (status line and headers).
const MAX_HEAD: usize = 16 * 1024;
/// How long a refused call waits for the client to end its side (see `refuse_unread`).
const REFUSED_WAIT: Duration = Duration::from_secs(5);
/// Kept-alive backend connections left idle at most.
const MAX_IDLE: usize = 64;
/// The defaults of `--first-message-seconds` and `--message-seconds`.
const FIRST_MESSAGE: u64 = 10;
const WHOLE_MESSAGE: u64 = 60;
/// Streams a client may reset before the server has taken them, per connection (rapid reset).
const PENDING_RESETS: usize = 20;
/// A call's message is read into this much at first, grown as its bytes come (a length prefix
/// alone reserves no more).
const FIRST_MESSAGE_CAPACITY: usize = 64 * 1024;
/// The share of `--max-calls` one connection may have reading their messages at once.
const READING_SHARE: usize = 4;
/// How often the drain looks whether the calls running have ended.
const DRAIN_POLL: Duration = Duration::from_millis(10);
/// The longest pause between two failed `accept()`s.
const ACCEPT_PAUSE_MAX: Duration = Duration::from_secs(1);

// gRPC status codes (https://grpc.github.io/grpc/core/md_doc_statuscodes.html).
const INVALID_ARGUMENT: u32 = 3;
const DEADLINE_EXCEEDED: u32 = 4;
const RESOURCE_EXHAUSTED: u32 = 8;
const UNIMPLEMENTED: u32 = 12;
const INTERNAL: u32 = 13;
const UNAVAILABLE: u32 = 14;

struct Settings {
    listen: String,
    backend: SocketAddr,
    max_message_bytes: usize,
    max_calls: usize,
    grace: Duration,
    first_message: Duration,
    whole_message: Duration,
}

fn usage(problem: &str) -> ! {
    eprintln!(
        "modelforge-grpc-front: {problem}\nusage: modelforge-grpc-front --listen HOST:PORT \
         --backend 127.0.0.1:PORT --max-message-bytes N --max-calls N --grace-seconds S \
         [--first-message-seconds S] [--message-seconds S]"
    );
    std::process::exit(2)
}

fn settings() -> Settings {
    let mut values: HashMap<String, String> = HashMap::new();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match args.next() {
            Some(value) if flag.starts_with("--") => {
                values.insert(flag[2..].to_owned(), value);
            }
            _ => usage(&format!("{flag} needs a value")),
        }
    }
    let mut take = |name: &str| -> String {
        values
            .remove(name)
            .unwrap_or_else(|| usage(&format!("--{name} is required")))
    };
    let number = |name: &str, text: String| -> usize {
        match text.parse::<usize>() {
            Ok(value) if value > 0 => value,
            _ => usage(&format!("--{name} must be a positive integer")),
        }
    };
    let listen = take("listen");
    let backend = take("backend")
        .parse()
        .unwrap_or_else(|_| usage("--backend must be an IP address and port"));
    let max_message_bytes = number("max-message-bytes", take("max-message-bytes"));
    let max_calls = number("max-calls", take("max-calls"));
    let grace = Duration::from_secs(number("grace-seconds", take("grace-seconds")) as u64);
    let mut seconds = |name: &str, default: u64| match values.remove(name) {
        Some(text) => Duration::from_secs(number(name, text) as u64),
        None => Duration::from_secs(default),
    };
    let first_message = seconds("first-message-seconds", FIRST_MESSAGE);
    let whole_message = seconds("message-seconds", WHOLE_MESSAGE);
    if first_message > whole_message {
        usage("--first-message-seconds must not pass --message-seconds");
    }
    if let Some(flag) = values.keys().next() {
        usage(&format!("unknown flag --{flag}"));
    }
    Settings {
        listen,
        backend,
        max_message_bytes,
        max_calls,
        grace,
        first_message,
        whole_message,
    }
}

/// A gRPC status to end a call with.
struct Status {
    code: u32,
    message: String,
}

impl Status {
    fn new(code: u32, message: impl Into<String>) -> Status {
        Status {
            code,
            message: message.into(),
        }
    }
}

/// Kept-alive HTTP/1.1 connections to the model server.
struct Backend {
    address: SocketAddr,
    token: String,
    idle: Mutex<Vec<BufReader<TcpStream>>>,
}

impl Backend {
    /// Relay one call's message; the response message, or the status the model server set.
    async fn call(
        &self,
        method: &str,
        message: &[u8],
        encoding: Option<&str>,
    ) -> Result<Bytes, Status> {
        // A kept-alive connection the server has closed fails before any answer: then once
        // more on a fresh one (nothing of the call was taken).
        let reused = self.idle.lock().unwrap().pop();
        if let Some(connection) = reused {
            match self.exchange(connection, method, message, encoding).await {
                Err(Failure::Closed) => {}
                Err(Failure::Broken(status)) => return Err(status),
                Ok(answer) => return answer,
            }
        }
        let connection = match TcpStream::connect(self.address).await {
            Ok(stream) => {
                let _ = stream.set_nodelay(true);
                BufReader::with_capacity(64 * 1024, stream)
            }
            Err(_) => {
                return Err(Status::new(
                    UNAVAILABLE,
                    "the model server is not reachable",
                ))
            }
        };
        match self.exchange(connection, method, message, encoding).await {
            Ok(answer) => answer,
            Err(Failure::Broken(status)) => Err(status),
            Err(Failure::Closed) => Err(Status::new(
                UNAVAILABLE,
                "the model server closed the connection",
            )),
        }
    }

    async fn exchange(
        &self,
        mut connection: BufReader<TcpStream>,
        method: &str,
        message: &[u8],
        encoding: Option<&str>,
    ) -> Result<Result<Bytes, Status>, Failure> {
        let compression = match encoding {
            Some(name) => format!("{ENCODING_HEADER}: {name}\r\n"),
            None => String::new(),
        };
        let head = format!(
            "POST {BACKEND_PREFIX}{method} HTTP/1.1\r\nhost: grpc-front\r\n{TOKEN_HEADER}: {}\r\n\
             {compression}content-type: application/x-protobuf\r\ncontent-length: {}\r\n\r\n",
            self.token,
            message.len()
        );
        // One write for a small call (no second packet to wait for), two for a large one.
        let written = if message.len() <= 64 * 1024 {
            let mut request = Vec::with_capacity(head.len() + message.len());
            request.extend_from_slice(head.as_bytes());
            request.extend_from_slice(message);
            connection.get_mut().write_all(&request).await
        } else {
            match connection.get_mut().write_all(head.as_bytes()).await {
                Ok(()) => connection.get_mut().write_all(message).await,
                Err(error) => Err(error),
            }
        };
        if written.is_err() {
            return Err(Failure::Closed);
        }
        let answer = read_answer(&mut connection).await?;
        if answer.keep_alive {
            let mut idle = self.idle.lock().unwrap();
            if idle.len() < MAX_IDLE {
                idle.push(connection);
            }
        }
        if answer.status == 200 {
            return Ok(Ok(answer.body));
        }
        let text = String::from_utf8_lossy(&answer.body).into_owned();
        Ok(Err(Status::new(answer.grpc_code.unwrap_or(INTERNAL), text)))
    }
}

enum Failure {
    /// The connection ended before the first byte of an answer.
    Closed,
    Broken(Status),
}

struct Answer {
    status: u16,
    grpc_code: Option<u32>,
    keep_alive: bool,
    body: Bytes,
}

async fn read_answer(connection: &mut BufReader<TcpStream>) -> Result<Answer, Failure> {
    let broken = |what: &str| {
        Failure::Broken(Status::new(
            INTERNAL,
            format!("the model server's answer {what}"),
        ))
    };
    let mut head = Vec::with_capacity(256);
    loop {
        let before = head.len();
        match connection.read_until(b'\n', &mut head).await {
            Ok(0) if head.is_empty() => return Err(Failure::Closed),
            Ok(0) => return Err(broken("ended early")),
            Ok(_) => {}
            Err(_) if head.is_empty() => return Err(Failure::Closed),
            Err(_) => return Err(broken("ended early")),
        }
        if head.len() > MAX_HEAD {
            return Err(broken("has too long a head"));
        }
        if head.len() - before <= 2 && before > 0 {
            break; // the empty line ending the head
        }
    }
    let text = std::str::from_utf8(&head).map_err(|_| broken("is not text"))?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse::<u16>().ok())
        .ok_or_else(|| broken("has no status"))?;
    let (mut length, mut grpc_code, mut keep_alive) = (None, None, true);
    for line in lines {
        if let Some((name, value)) = line.split_once(':') {
            let value = value.trim();
            match name.trim().to_ascii_lowercase().as_str() {
                "content-length" => length = value.parse::<usize>().ok(),
                "x-grpc-code" => grpc_code = value.parse::<u32>().ok(),
                "connection" => keep_alive = !value.eq_ignore_ascii_case("close"),
                "transfer-encoding" => return Err(broken("is not of a known length")),
                _ => {}
            }
        }
    }
    let length = length.ok_or_else(|| broken("has no content-length"))?;
    let mut body = vec![0u8; length];
    connection
        .read_exact(&mut body)
        .await
        .map_err(|_| broken("ended early"))?;
    Ok(Answer {
        status,
        grpc_code,
        keep_alive,
        body: Bytes::from(body),
    })
}

struct Front {
    backend: Backend,
    /// The places of calls whose message has arrived whole, held while the model server has
    /// them.
    calls: Arc<Semaphore>,
    max_calls: usize,
    /// The calls reading their messages, on every connection (what the drain waits for).
    reading: AtomicUsize,
    max_message_bytes: usize,
    first_message: Duration,
    whole_message: Duration,
}

impl Front {
    fn new(backend: Backend, settings: &Settings) -> Front {
        Front {
            backend,
            calls: Arc::new(Semaphore::new(settings.max_calls)),
            max_calls: settings.max_calls,
            reading: AtomicUsize::new(0),
            max_message_bytes: settings.max_message_bytes,
            first_message: settings.first_message,
            whole_message: settings.whole_message,
        }
    }

    /// The calls one connection may have reading their messages at once: well below
    /// `max_calls`, so no one client's slow senders fill the front.
    fn reading_per_connection(&self) -> usize {
        self.max_calls.div_ceil(READING_SHARE)
    }

    /// Whether no call is reading its message or held by the model server.
    fn idle(&self) -> bool {
        self.reading.load(Ordering::Relaxed) == 0
            && self.calls.available_permits() == self.max_calls
    }
}

/// A call counted in `Front::reading` while it lives.
struct Reading<'a>(&'a AtomicUsize);

impl<'a> Reading<'a> {
    fn new(count: &'a AtomicUsize) -> Reading<'a> {
        count.fetch_add(1, Ordering::Relaxed);
        Reading(count)
    }
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// When a call's message must have begun (`first`) and arrived whole (`whole`).
struct Deadlines {
    first: Instant,
    whole: Instant,
    first_seconds: u64,
    whole_seconds: u64,
}

/// Read a unary call's one message: its length checked from its prefix before it is read.
/// A compressed one (its prefix's flag) is taken only with an `encoding` the model server
/// inflates (`COMPRESSIONS`): true then.
/// DEADLINE_EXCEEDED once past `deadlines` (a call that stalls gives its place back).
async fn read_message(
    body: &mut RecvStream,
    max: usize,
    encoding: Option<&str>,
    deadlines: &Deadlines,
) -> Result<(Vec<u8>, bool), Status> {
    let mut compressed = false;
    let mut prefix = BytesMut::with_capacity(5);
    let mut message: Option<Vec<u8>> = None;
    let mut expected = 0usize;
    loop {
        let begun = message.is_some();
        let deadline = if begun {
            deadlines.whole
        } else {
            deadlines.first
        };
        let next = match tokio::time::timeout_at(deadline, body.data()).await {
            Ok(next) => next,
            Err(_) if begun => {
                let seconds = deadlines.whole_seconds;
                let text = format!("the call's message did not arrive whole within {seconds} s");
                return Err(Status::new(DEADLINE_EXCEEDED, text));
            }
            Err(_) => {
                let seconds = deadlines.first_seconds;
                let text = format!("the call sent no message within {seconds} s");
                return Err(Status::new(DEADLINE_EXCEEDED, text));
            }
        };
        let Some(chunk) = next else { break };
        let mut chunk = chunk.map_err(|_| Status::new(UNAVAILABLE, "the call was cut off"))?;
        let _ = body.flow_control().release_capacity(chunk.len());
        while !chunk.is_empty() {
            match message.as_mut() {
                None => {
                    let take = (5 - prefix.len()).min(chunk.len());
                    prefix.extend_from_slice(&chunk.split_to(take));
                    if prefix.len() == 5 {
                        if prefix[0] != 0 {
                            match encoding {
                                Some(name) if COMPRESSIONS.contains(&name) => compressed = true,
                                _ => {
                                    return Err(Status::new(
                                        UNIMPLEMENTED,
                                        "a compressed message needs grpc-encoding gzip or \
                                         deflate; send one of those, or no compression",
                                    ))
                                }
                            }
                        }
                        expected = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]])
                            as usize;
                        if expected > max {
                            return Err(Status::new(
                                RESOURCE_EXHAUSTED,
                                format!("Received message larger than max ({expected} vs. {max})"),
                            ));
                        }
                        message = Some(Vec::with_capacity(expected.min(FIRST_MESSAGE_CAPACITY)));
                    }
                }
                Some(buffer) => {
                    if buffer.len() + chunk.len() > expected {
                        return Err(Status::new(
                            UNIMPLEMENTED,
                            "a unary call carries one message; this one sent more",
                        ));
                    }
                    buffer.extend_from_slice(&chunk);
                    chunk.clear();
                }
            }
        }
    }
    match message {
        Some(buffer) if buffer.len() == expected => Ok((buffer, compressed)),
        _ => Err(Status::new(
            INVALID_ARGUMENT,
            "the call ended before its message did",
        )),
    }
}

fn grpc_headers(map: &mut HeaderMap, status: &Status) {
    map.insert("grpc-status", HeaderValue::from(status.code));
    if !status.message.is_empty() {
        // grpc-message is percent-encoded: printable ASCII but '%' as is.
        let mut encoded = String::with_capacity(status.message.len());
        for byte in status.message.bytes() {
            if (0x20..0x7f).contains(&byte) && byte != b'%' {
                encoded.push(byte as char);
            } else {
                encoded.push_str(&format!("%{byte:02X}"));
            }
        }
        if let Ok(value) = HeaderValue::from_str(&encoded) {
            map.insert("grpc-message", value);
        }
    }
}

fn head() -> Response<()> {
    let mut response = Response::new(());
    response
        .headers_mut()
        .insert("content-type", HeaderValue::from_static("application/grpc"));
    response
}

/// End a call with `status` and no message (gRPC's trailers-only answer).
fn refuse(mut respond: SendResponse<Bytes>, status: Status) {
    let mut response = head();
    grpc_headers(response.headers_mut(), &status);
    let _ = respond.send_response(response, true);
}

/// Resolves when the client resets its call's stream.
struct ResetBy<'a>(&'a mut SendResponse<Bytes>);

impl Future for ResetBy<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<()> {
        self.0.poll_reset(context).map(|_| ())
    }
}

/// End a call whose message was not read (in full) with `status`, then wait for the client to
/// end its side, reading nothing more than the window it was given (`REFUSED_WAIT` at most):
/// ending the stream at once would reset it (CANCEL), which clients report instead of the status.
async fn refuse_unread(respond: SendResponse<Bytes>, mut body: RecvStream, status: Status) {
    refuse(respond, status);
    let drain = async move { while let Some(Ok(_)) = body.data().await {} };
    let _ = tokio::time::timeout(REFUSED_WAIT, drain).await;
}

/// One call: its message read (one of its connection's `reading` places held meanwhile, taken
/// in turn within `--first-message-seconds`), then one of the front's places taken for as long
/// as the model server has it (none free: RESOURCE_EXHAUSTED at once).
async fn serve_call(
    front: Arc<Front>,
    reading: Arc<Semaphore>,
    request: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    let (parts, mut body) = request.into_parts();
    let method = match parts.uri.path().strip_prefix(SERVICE) {
        Some(method) if METHODS.contains(&method) => method.to_owned(),
        _ => {
            let path = parts.uri.path().chars().take(120).collect::<String>();
            let status = Status::new(UNIMPLEMENTED, format!("no method {path}"));
            return refuse_unread(respond, body, status).await;
        }
    };
    let encoding = parts
        .headers
        .get("grpc-encoding")
        .and_then(|value| value.to_str().ok());
    let started = Instant::now();
    let deadlines = Deadlines {
        first: started + front.first_message,
        whole: started + front.whole_message,
        first_seconds: front.first_message.as_secs(),
        whole_seconds: front.whole_message.as_secs(),
    };
    let counted = Reading::new(&front.reading);
    let turn = match tokio::time::timeout_at(deadlines.first, reading.acquire()).await {
        Ok(Ok(turn)) => turn,
        _ => {
            let text = format!(
                "the call's message was not read within {} s: its connection's other calls \
                 held every place for reading ({})",
                deadlines.first_seconds,
                front.reading_per_connection()
            );
            refuse(respond, Status::new(DEADLINE_EXCEEDED, text));
            return;
        }
    };
    let read = read_message(&mut body, front.max_message_bytes, encoding, &deadlines).await;
    drop(turn);
    let (message, compressed) = match read {
        Ok(read) => read,
        Err(status) if status.code == DEADLINE_EXCEEDED => {
            // A stalled call: its status, and its stream closed at once (no wait for a
            // client that sends nothing).
            refuse(respond, status);
            return;
        }
        Err(status) => {
            drop(counted); // the call is over: what the client still sends is not waited for
            return refuse_unread(respond, body, status).await;
        }
    };
    drop(body);
    // Its message whole, the call takes a place while the model server has it.
    let permit = match front.calls.clone().try_acquire_owned() {
        Ok(permit) => permit,
        Err(_) => {
            let message = format!(
                "the server is running as many calls as it may ({})",
                front.max_calls
            );
            refuse(respond, Status::new(RESOURCE_EXHAUSTED, message));
            return;
        }
    };
    drop(counted);
    let encoding = if compressed { encoding } else { None };
    // A client gone before the answer (cancelled, or past its deadline: it resets the stream)
    // ends the relayed request too: its connection closes, so the model server drops it (from
    // its queue, or unanswered) as it does any HTTP request whose client went away.
    let answer = tokio::select! {
        answer = front.backend.call(&method, &message, encoding) => answer,
        _ = ResetBy(&mut respond) => return,
    };
    drop(message);
    match answer {
        Ok(reply) => {
            let mut framed = BytesMut::with_capacity(5 + reply.len());
            framed.extend_from_slice(&[0]);
            framed.extend_from_slice(&(reply.len() as u32).to_be_bytes());
            framed.extend_from_slice(&reply);
            drop(reply);
            let mut stream = match respond.send_response(head(), false) {
                Ok(stream) => stream,
                Err(_) => return,
            };
            if stream.send_data(framed.freeze(), false).is_ok() {
                let mut trailers = HeaderMap::new();
                grpc_headers(&mut trailers, &Status::new(0, ""));
                let _ = stream.send_trailers(trailers);
            }
        }
        Err(status) => refuse(respond, status),
    }
    drop(permit);
}

async fn serve_connection<T>(front: Arc<Front>, socket: T, mut stopping: watch::Receiver<bool>)
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let reading = Arc::new(Semaphore::new(front.reading_per_connection()));
    let handshake = h2::server::Builder::new()
        .initial_window_size(1 << 20)
        .initial_connection_window_size(1 << 24)
        .max_concurrent_streams(front.max_calls.min(u32::MAX as usize) as u32)
        .max_header_list_size(64 * 1024)
        .max_pending_accept_reset_streams(PENDING_RESETS)
        .handshake::<_, Bytes>(Guarded::new(socket))
        .await;
    let mut connection = match handshake {
        Ok(connection) => connection,
        Err(_) => return,
    };
    let mut draining = *stopping.borrow();
    if draining {
        connection.graceful_shutdown();
    }
    loop {
        tokio::select! {
            next = connection.accept() => match next {
                Some(Ok((request, respond))) => {
                    tokio::spawn(serve_call(front.clone(), reading.clone(), request, respond));
                }
                _ => return,
            },
            changed = stopping.changed(), if !draining => {
                draining = true;
                if changed.is_ok() {
                    connection.graceful_shutdown();
                }
            }
        }
    }
}

/// Listen on `listen`; `0.0.0.0` (every interface) takes IPv6 too where the host has it, on
/// one dual-stack socket, as gRPC's own servers do.
async fn bind(listen: &str) -> std::io::Result<TcpListener> {
    if let Some(port) = listen.strip_prefix("0.0.0.0:") {
        if let Ok(listener) = TcpListener::bind(format!("[::]:{port}")).await {
            return Ok(listener);
        }
    }
    TcpListener::bind(listen).await
}

async fn run(settings: Settings, token: String) -> std::io::Result<()> {
    let listener = bind(&settings.listen).await?;
    let port = listener.local_addr()?.port();
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening {port}")?;
        out.flush()?;
    }
    let backend = Backend {
        address: settings.backend,
        token,
        idle: Mutex::new(Vec::new()),
    };
    let front = Arc::new(Front::new(backend, &settings));
    let (stop, stopping) = watch::channel(false);
    // The end of standard input is the model server's word to stop (or its death). SIGTERM
    // and SIGINT, sent to the server's whole process group when it is stopped, start the same
    // drain instead of ending the calls running at once.
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut parent = tokio::io::stdin();
    let ended = async move {
        let mut sink = [0u8; 64];
        while matches!(parent.read(&mut sink).await, Ok(n) if n > 0) {}
    };
    tokio::pin!(ended);
    // After a failed accept (EMFILE: no descriptor left), a pause before the next, doubling.
    let mut pause = Duration::ZERO;
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((socket, _)) => {
                    if !pause.is_zero() {
                        pause = Duration::ZERO;
                        eprintln!("modelforge-grpc-front: accepting connections again");
                    }
                    let _ = socket.set_nodelay(true);
                    tokio::spawn(serve_connection(front.clone(), socket, stopping.clone()));
                }
                Err(error) => {
                    if pause.is_zero() {
                        eprintln!("modelforge-grpc-front: accept failed ({error}); pausing");
                    }
                    pause = (pause * 2).clamp(Duration::from_millis(10), ACCEPT_PAUSE_MAX);
                    let stop = tokio::select! {
                        _ = tokio::time::sleep(pause) => false,
                        _ = &mut ended => true,
                        _ = terminate.recv() => true,
                        _ = interrupt.recv() => true,
                    };
                    if stop {
                        break;
                    }
                }
            },
            _ = &mut ended => break,
            _ = terminate.recv() => break,
            _ = interrupt.recv() => break,
        }
    }
    drop(listener);
    let _ = stop.send(true);
    // Let the calls running finish (those still reading their messages too), for up to the
    // grace period.
    let drained = async {
        while !front.idle() {
            tokio::time::sleep(DRAIN_POLL).await;
        }
    };
    let _ = tokio::time::timeout(settings.grace, drained).await;
    Ok(())
}

fn main() {
    let settings = settings();
    let mut token = String::new();
    if std::io::stdin().read_line(&mut token).is_err() || token.trim().is_empty() {
        usage("standard input must start with the backend's token");
    }
    let token = token.trim().to_owned();
    if !token.bytes().all(|byte| byte.is_ascii_alphanumeric()) {
        usage("the backend's token must be letters and digits");
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    if let Err(error) = runtime.block_on(run(settings, token)) {
        eprintln!("modelforge-grpc-front: {error}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::Notify;

    const LIVE: &str = "/inference.GRPCInferenceService/ServerLive";
    /// ServerLiveResponse{live: true}.
    const LIVE_ANSWER: &[u8] = b"\x08\x01";

    /// A stand-in for the model server: every call answered live, once `release` allows
    /// (at once when `held` is false); the number of calls it has taken.
    async fn backend(held: bool) -> (SocketAddr, Arc<Notify>, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let release = Arc::new(Notify::new());
        let taken = Arc::new(AtomicUsize::new(0));
        let (gate, count) = (release.clone(), taken.clone());
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let (gate, count) = (gate.clone(), count.clone());
                tokio::spawn(async move {
                    let mut socket = BufReader::new(socket);
                    loop {
                        let mut length = 0;
                        let mut line = String::new();
                        loop {
                            line.clear();
                            if socket.read_line(&mut line).await.unwrap_or(0) == 0 {
                                return;
                            }
                            if let Some(value) =
                                line.to_ascii_lowercase().strip_prefix("content-length:")
                            {
                                length = value.trim().parse().unwrap();
                            }
                            if line == "\r\n" {
                                break;
                            }
                        }
                        let mut body = vec![0u8; length];
                        socket.read_exact(&mut body).await.unwrap();
                        count.fetch_add(1, Ordering::SeqCst);
                        if held {
                            gate.notified().await;
                        }
                        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n\x08\x01";
                        if socket.get_mut().write_all(answer).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (address, release, taken)
    }

    fn front(backend: SocketAddr, max_calls: usize) -> Arc<Front> {
        let settings = Settings {
            listen: String::new(),
            backend,
            max_message_bytes: 1 << 20,
            max_calls,
            grace: Duration::from_secs(1),
            first_message: Duration::from_secs(10),
            whole_message: Duration::from_secs(20),
        };
        let backend = Backend {
            address: backend,
            token: "token".into(),
            idle: Mutex::new(Vec::new()),
        };
        Arc::new(Front::new(backend, &settings))
    }

    /// A client connection to `front`, over an in-memory pipe.
    async fn connect(front: &Arc<Front>) -> h2::client::SendRequest<Bytes> {
        let (client, server) = tokio::io::duplex(1 << 20);
        let (_stop, stopping) = watch::channel(false);
        let front = front.clone();
        tokio::spawn(async move {
            let _stop = _stop;
            serve_connection(front, server, stopping).await
        });
        let (sender, connection) = h2::client::handshake(client).await.unwrap();
        tokio::spawn(connection);
        sender
    }

    /// Open a call; its stream to send the message on, and its answer to come.
    async fn open(
        sender: h2::client::SendRequest<Bytes>,
    ) -> (h2::SendStream<Bytes>, h2::client::ResponseFuture) {
        let mut sender = sender.ready().await.unwrap();
        let request = Request::post(format!("http://front{LIVE}"))
            .header("content-type", "application/grpc")
            .body(())
            .unwrap();
        let (answer, stream) = sender.send_request(request, false).unwrap();
        (stream, answer)
    }

    /// The call's gRPC status (its trailers', or its trailers-only answer's) and message.
    async fn status(answer: h2::client::ResponseFuture) -> (u32, Vec<u8>) {
        let response = answer.await.unwrap();
        let code = |headers: &HeaderMap| {
            headers
                .get("grpc-status")
                .and_then(|value| value.to_str().ok()?.parse::<u32>().ok())
        };
        if let Some(code) = code(response.headers()) {
            return (code, Vec::new());
        }
        let mut body = response.into_body();
        let mut message = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.unwrap();
            let _ = body.flow_control().release_capacity(chunk.len());
            message.extend_from_slice(&chunk);
        }
        let trailers = body.trailers().await.unwrap().unwrap();
        (code(&trailers).unwrap(), message)
    }

    /// A whole call: an empty message.
    async fn call(sender: h2::client::SendRequest<Bytes>) -> (u32, Vec<u8>) {
        let (mut stream, answer) = open(sender).await;
        stream.send_data(Bytes::from_static(&[0; 5]), true).unwrap();
        status(answer).await
    }

    fn answered() -> (u32, Vec<u8>) {
        let mut framed = vec![0, 0, 0, 0, 2];
        framed.extend_from_slice(LIVE_ANSWER);
        (0, framed)
    }

    #[tokio::test]
    async fn calls_that_send_nothing_hold_no_place_of_the_fronts() {
        let (address, _, _) = backend(false).await;
        let front = front(address, 2);
        // One client opens as many calls as the front runs at once, and sends nothing...
        let stalled = connect(&front).await;
        let mut held = Vec::new();
        for _ in 0..2 {
            held.push(open(stalled.clone()).await);
        }
        // ...and one sends a prefix, then a trickle.
        let trickling = connect(&front).await;
        let (mut stream, _trickle) = open(trickling).await;
        stream
            .send_data(Bytes::from_static(&[0, 0, 0, 0, 100, 1]), false)
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Another client is served all the same, on connections of its own.
        for _ in 0..3 {
            let other = connect(&front).await;
            let answer = tokio::time::timeout(Duration::from_secs(5), call(other)).await;
            assert_eq!(answer.unwrap(), answered());
        }
        assert_eq!(front.calls.available_permits(), 2);
        assert!(!front.idle()); // the drain would wait for those reading
    }

    #[tokio::test]
    async fn calls_past_the_limit_running_at_once_are_refused_at_once() {
        let (address, release, taken) = backend(true).await;
        let front = front(address, 2);
        let first = connect(&front).await;
        let running = [
            tokio::spawn(call(first.clone())),
            tokio::spawn(call(first.clone())),
        ];
        while taken.load(Ordering::SeqCst) < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let other = connect(&front).await;
        let refused = tokio::time::timeout(Duration::from_secs(2), call(other)).await;
        assert_eq!(refused.unwrap().0, RESOURCE_EXHAUSTED);
        assert_eq!(taken.load(Ordering::SeqCst), 2);
        release.notify_waiters();
        for call in running {
            assert_eq!(call.await.unwrap(), answered());
        }
        assert!(front.idle());
    }

    #[tokio::test]
    async fn a_connections_calls_wait_their_turn_to_be_read() {
        let (address, _, _) = backend(false).await;
        let front = front(address, 4); // one call read at a time per connection
        assert_eq!(front.reading_per_connection(), 1);
        let sender = connect(&front).await;
        let (mut slow, slow_answer) = open(sender.clone()).await;
        slow.send_data(Bytes::from_static(&[0, 0, 0, 0, 2]), false)
            .unwrap();
        let (mut quick, quick_answer) = open(sender.clone()).await;
        quick.send_data(Bytes::from_static(&[0; 5]), true).unwrap();
        let quick_answer = tokio::spawn(status(quick_answer));
        // The second waits while the first is read...
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!quick_answer.is_finished());
        // ...and is read once the first's message is whole.
        slow.send_data(Bytes::from_static(LIVE_ANSWER), true)
            .unwrap();
        assert_eq!(status(slow_answer).await, answered());
        let answer = tokio::time::timeout(Duration::from_secs(5), quick_answer).await;
        assert_eq!(answer.unwrap().unwrap(), answered());
    }
}
