//! One gateway request (`/v2...`, `/services/...`), carried to a replica through its node's
//! tunnel as `control_plane/api/gateway_forward.py` carries it, the control plane deciding:
//!
//! - The front asks `request`; the control plane answers it itself (a token refused, a rate
//!   limit, no replica, the server's metadata...), says `pass` (not the gateway's: the request
//!   goes to the control plane's server like any other), or grants it: a ticket, the node, the
//!   OPEN frame's payload, and whether the body is small enough to read first (`whole`: it then
//!   goes with the OPEN in one message).
//! - The body is read a piece at a time, each within `body_timeout` (408), counted against
//!   `body_bytes` (413), and kept up to `retry_bytes` so a second attempt can replay it.
//! - A transport failure before the response began (no tunnel, the stream reset) asks the
//!   control plane for another replica (`retry`) while the body can be replayed; past that, 502.
//! - The response goes to the client as it comes (`relay`), each piece handed to hyper before
//!   the next is taken from the tunnel, so a slow client slows the replica and never fills
//!   memory; an answer that arrived whole goes in one piece. A stream that breaks mid-body
//!   ends the client's response short (the connection dropped); a client that goes resets the
//!   stream so the replica stops.
//! - Each ticket's end is reported (`done`) exactly once, whatever path the request took: by
//!   `Done`'s `Drop`, so even a request whose future hyper dropped (its client gone) reports.
//!
//! Framing and headers (`control_plane/api/gateway_headers.py`, the same rules):
//! - A request whose body's framing is ambiguous (`Content-Length` with `Transfer-Encoding`, a
//!   coding other than `chunked`, differing or malformed lengths) is 400 before anything of it
//!   is carried (`framing_refusal`). The length a replica gets is the one hyper read the body
//!   by; the agent's relay holds the body to it.
//! - The client's `X-Forwarded-For/-Host/-Proto`, `Forwarded` and `X-Real-IP` are dropped; the
//!   front sets `X-Forwarded-For` (the client's address), `-Proto` and `-Host` itself
//!   (`set_forwarding`), before the fast path or the control plane sees the request.
//! - No header of one hop, of the replica's framing (`Content-Length`: hyper frames the answer
//!   by its real body), `Set-Cookie`, `Set-Cookie2`, `Clear-Site-Data` or `x-modelforge-...`
//!   crosses from a replica to a client (`reaches_client`). An answer to HEAD, and a 304, has
//!   no body for a length to frame: the replica's one `Content-Length`, digits only, crosses
//!   (`passed_length`), as it does through the control plane.
//!
//! Nothing of a request (its headers, a token, its body) is logged.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use hyper::body::HttpBody;
use hyper::header::{self, HeaderName, HeaderValue};
use hyper::{Body, HeaderMap, Method, Request, Response, StatusCode};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::control::{self, Control, Lost};
use crate::fast::{Fast, Plan};
use crate::frames;
use crate::hub::{Failed, Stream};
use crate::meter::Meter;
use crate::{Broken, Front, FrontBody};

/// The prefix of the control plane's own headers: none crosses to a client.
const INTERNAL_HEADER: &str = "x-modelforge-";
/// The reset code of a stream the front gives up on.
const CANCELLED: &str = "CANCELLED";
/// The 400 of a request whose framing is ambiguous (`gateway_headers.AMBIGUOUS_FRAMING`).
pub const AMBIGUOUS_FRAMING: &str = "the request declares its body's framing ambiguously \
(Content-Length with Transfer-Encoding, a Transfer-Encoding other than chunked, or differing \
Content-Length values); send one Content-Length, or Transfer-Encoding: chunked alone";
/// A client's word on who it is or came through: never passed on (the front says it).
const CLIENT_FORWARDING: [&str; 5] = [
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "forwarded",
    "x-real-ip",
];
/// What a replica's answer never carries to a client, besides those of one hop.
const DROPPED_RESPONSE_HEADERS: [&str; 4] = [
    "content-length",
    "set-cookie",
    "set-cookie2",
    "clear-site-data",
];

/// Carry one gateway request (see the module's docstring).
pub async fn handle(
    front: &Arc<Front>,
    request: Request<Body>,
    peer: SocketAddr,
) -> Response<FrontBody> {
    carry(front, request, peer, None).await
}

/// Carry one gateway request; `call` (an OpenAI call's facts, `openai.rs`, and whether the
/// engine's usage event is taken out of its stream) goes with the ask, and such a call is
/// always asked, never taken by the fast path; its answer's tokens are counted (`meter.rs`).
pub async fn carry(
    front: &Arc<Front>,
    mut request: Request<Body>,
    peer: SocketAddr,
    call: Option<(String, bool)>,
) -> Response<FrontBody> {
    if framing_refusal(request.headers()) {
        return crate::error_answer(front, StatusCode::BAD_REQUEST, AMBIGUOUS_FRAMING, true);
    }
    set_forwarding(request.headers_mut(), peer, front.config.scheme());
    let head = request.method() == Method::HEAD;
    if call.is_none() {
        if let Some(plan) = front.fast.plan(&request, &front.config) {
            return fast_path(front, plan, request).await;
        }
    }
    let ask = request_ask(
        &request,
        peer,
        call.as_ref().map(|(facts, _)| facts.as_str()),
    );
    let mut reply = match front.control.ask_request(ask).await {
        Ok(reply) => reply,
        Err(Lost) => return crate::restarting(front),
    };
    if reply.get("pass").and_then(Value::as_bool) == Some(true) {
        return crate::upstream::proxy(front, request, peer).await;
    }
    if reply.get("open").is_none() {
        return crate::control_answer(reply);
    }
    if let Some(auth) = reply.get("auth") {
        if let Some(authorization) = request.headers().get(header::AUTHORIZATION) {
            if let Ok(authorization) = authorization.to_str() {
                front.fast.remember(authorization, auth);
            }
        }
    }
    let mut done = Done {
        control: front.control.clone(),
        ticket: reply
            .get_mut("ticket")
            .map(Value::take)
            .unwrap_or(Value::Null),
        status: 499,
        error: "client_gone",
        fast: None,
        meter: call.map(|(_, strip)| Meter::new(strip)),
    };
    let mut body = RequestBody::new(request.into_body(), &front.config);
    loop {
        let cause = match attempt(front, &mut reply, &mut body, &mut done, head).await {
            Attempt::Answered(response) => return response,
            Attempt::Started(stream, response) => return start_relay(stream, response, body, done),
            Attempt::Failed(cause) => cause,
        };
        if !body.replayable {
            // Counted by the control plane as its own path counts it: a transport failure,
            // then no replica reached.
            done.set(502, "transport");
            let message = format!(
                "no replica could be reached ({}); retry in a few seconds",
                cause
            );
            return crate::error_answer(front, StatusCode::BAD_GATEWAY, &message, false);
        }
        let mut ask = String::with_capacity(64 + cause.len());
        ask.push_str("{\"op\":\"retry\",\"ticket\":");
        ask.push_str(&done.ticket.to_string());
        ask.push_str(",\"cause\":");
        control::push_str(&mut ask, &cause);
        ask.push('}');
        reply = match front.control.ask(ask).await {
            Ok(reply) => reply,
            Err(Lost) => {
                done.set(503, "");
                return crate::restarting(front);
            }
        };
        if reply.get("open").is_none() {
            let response = crate::control_answer(reply);
            done.set(response.status().as_u16(), "");
            return response;
        }
    }
}

/// Carry a request the fast path took (`fast.rs`): a replica chosen here, one other tried
/// after a transport failure while the body can be replayed, else 502, as the control plane
/// does; what happened is counted for its next report.
async fn fast_path(front: &Arc<Front>, plan: Plan, request: Request<Body>) -> Response<FrontBody> {
    let head = request.method() == Method::HEAD;
    let mut done = Done {
        control: front.control.clone(),
        ticket: Value::Null,
        status: 499,
        error: "client_gone",
        meter: None,
        fast: Some(FastDone {
            fast: front.fast.clone(),
            service: plan.service.clone(),
            replica: None,
            started: Instant::now(),
        }),
    };
    let mut body = RequestBody::new(request.into_body(), &front.config);
    let mut tried: Vec<String> = Vec::new();
    let mut cause = String::new();
    while tried.len() < 2 {
        let choice = match front.fast.choose(&plan, &tried) {
            Some(choice) => choice,
            None => break,
        };
        tried.push(choice.replica.clone());
        done.attempting(choice.replica);
        let mut grant = serde_json::json!({
            "node": choice.node,
            "open": String::from_utf8(choice.open).unwrap_or_default(),
            "whole": plan.whole,
        });
        match attempt(front, &mut grant, &mut body, &mut done, head).await {
            Attempt::Answered(response) => return response,
            Attempt::Started(stream, response) => return start_relay(stream, response, body, done),
            Attempt::Failed(failed) => cause = failed,
        }
        front.fast.error(&plan.service, "transport");
        if !body.replayable {
            break;
        }
        if tried.len() == 1 {
            front.fast.error(&plan.service, "retried");
        }
    }
    front.fast.error(&plan.service, "unreachable");
    done.set(502, "");
    let message = format!(
        "no replica of service '{}' could be reached ({}); retry in a few seconds",
        plan.service,
        if cause.is_empty() {
            "transport"
        } else {
            &cause
        }
    );
    crate::error_answer(front, StatusCode::BAD_GATEWAY, &message, false)
}

/// Whether the request's body framing is ambiguous: `Content-Length` with `Transfer-Encoding`,
/// a coding other than `chunked` alone, or lengths that differ or are not numbers. (hyper
/// refuses most of these itself; it passes a `Content-Length` sent before `Transfer-Encoding`.)
pub fn framing_refusal(headers: &HeaderMap) -> bool {
    let mut lengths: Vec<&[u8]> = Vec::new();
    for value in headers.get_all(header::CONTENT_LENGTH) {
        lengths.push(trim(value.as_bytes())); // a list ("5, 5") is not a number either
    }
    let mut codings = 0;
    for value in headers.get_all(header::TRANSFER_ENCODING) {
        for coding in value.as_bytes().split(|&byte| byte == b',').map(trim) {
            codings += 1;
            if !coding.eq_ignore_ascii_case(b"chunked") {
                return true;
            }
        }
    }
    if codings > 0 && (codings > 1 || !lengths.is_empty()) {
        return true;
    }
    let number = |length: &&[u8]| !length.is_empty() && length.iter().all(u8::is_ascii_digit);
    !lengths.iter().all(number) || lengths.windows(2).any(|pair| pair[0] != pair[1])
}

fn trim(bytes: &[u8]) -> &[u8] {
    let start = bytes.iter().position(|byte| !byte.is_ascii_whitespace());
    let end = bytes.iter().rposition(|byte| !byte.is_ascii_whitespace());
    match (start, end) {
        (Some(start), Some(end)) => &bytes[start..=end],
        _ => &[],
    }
}

/// The client's forwarding headers dropped, the front's own set: the client's address, the
/// scheme the client used (`https` when the front terminates TLS) and the request's `Host`.
fn set_forwarding(headers: &mut HeaderMap, peer: SocketAddr, scheme: &'static str) {
    for name in CLIENT_FORWARDING {
        headers.remove(name);
    }
    if let Ok(address) = HeaderValue::from_str(&peer.ip().to_string()) {
        headers.insert(HeaderName::from_static("x-forwarded-for"), address);
    }
    headers.insert(
        HeaderName::from_static("x-forwarded-proto"),
        HeaderValue::from_static(scheme),
    );
    if let Some(host) = headers.get(header::HOST).cloned() {
        headers.insert(HeaderName::from_static("x-forwarded-host"), host);
    }
}

/// Whether a replica's response header named `name` (lower case) reaches the client.
fn reaches_client(name: &str) -> bool {
    !frames::hop_by_hop(name)
        && !name.starts_with(INTERNAL_HEADER)
        && !DROPPED_RESPONSE_HEADERS.contains(&name)
}

/// The `request` ask: the method, the path as received (still percent-encoded), the raw
/// query, every header and the client's address.
fn request_ask(request: &Request<Body>, peer: SocketAddr, call: Option<&str>) -> String {
    let uri = request.uri();
    let mut ask = String::with_capacity(256 + 64 * request.headers().len());
    ask.push_str("{\"op\":\"request\",\"method\":");
    control::push_str(&mut ask, request.method().as_str());
    ask.push_str(",\"path\":");
    control::push_str(&mut ask, uri.path());
    ask.push_str(",\"query\":");
    control::push_str(&mut ask, uri.query().unwrap_or(""));
    ask.push_str(",\"headers\":");
    crate::push_headers(&mut ask, request.headers());
    ask.push_str(",\"client\":\"");
    crate::push_address(&mut ask, peer);
    ask.push('"');
    if let Some(call) = call {
        ask.push_str(",\"openai\":");
        ask.push_str(call);
    }
    ask.push('}');
    ask
}

/// Reports the ticket's end when dropped: exactly once, whichever way the request ended.
/// Until told otherwise, the client went away (the request's future dropped by hyper).
struct Done {
    control: Arc<Control>,
    ticket: Value,
    status: u16,
    error: &'static str,
    /// A fast-path request's: counted for the report, not told as a ticket.
    fast: Option<FastDone>,
    /// An OpenAI call's: its answer's tokens, told with the ticket's end.
    meter: Option<Meter>,
}

/// What a fast-path request gives back when it ends.
struct FastDone {
    fast: Arc<Fast>,
    service: String,
    /// The replica of the attempt under way (its outstanding count taken).
    replica: Option<String>,
    started: Instant,
}

impl Done {
    /// A fast-path attempt on `replica` begins: the previous one's count is given back.
    fn attempting(&mut self, replica: String) {
        if let Some(fast) = &mut self.fast {
            if let Some(previous) = fast.replica.replace(replica) {
                fast.fast.released(&previous);
            }
        }
    }

    fn set(&mut self, status: u16, error: &'static str) {
        self.status = status;
        self.error = error;
    }
}

impl Drop for Done {
    fn drop(&mut self) {
        match self.fast.take() {
            Some(fast) => {
                if let Some(replica) = &fast.replica {
                    fast.fast.released(replica);
                }
                let seconds = fast.started.elapsed().as_secs_f64();
                fast.fast
                    .ended(&fast.service, self.status, seconds, self.error);
            }
            None => {
                let usage = self.meter.as_ref().and_then(|meter| meter.usage);
                let timing = self.meter.as_ref().and_then(Meter::timing);
                self.control.tell(control::done_line(
                    &self.ticket,
                    self.status,
                    self.error,
                    usage,
                    timing,
                ))
            }
        }
    }
}

/// Why a read of the client's body failed.
enum BodyError {
    /// Past `body_bytes`: 413.
    TooLarge,
    /// No piece for `body_timeout`: 408.
    Timeout,
    /// The client's connection failed.
    Gone,
}

/// The client's body, read once, kept up to `retry_bytes` so that another attempt can send it
/// again (`gateway_forward.RequestBody`).
struct RequestBody {
    body: Body,
    /// What was read so far, while it is all kept.
    kept: Vec<Bytes>,
    size: u64,
    /// The whole body was read.
    done: bool,
    /// Everything read is in `kept`.
    replayable: bool,
    limit: u64,
    retry_bytes: u64,
    timeout: Duration,
}

impl RequestBody {
    fn new(body: Body, config: &crate::Config) -> RequestBody {
        RequestBody {
            // A body declared empty (a GET) is done before any read.
            done: body.is_end_stream(),
            body,
            kept: Vec::new(),
            size: 0,
            replayable: true,
            limit: config.body_bytes,
            retry_bytes: config.retry_bytes,
            timeout: config.body_timeout,
        }
    }

    /// The next piece from the client (never empty); None once the body is complete.
    /// Cancel-safe: a piece is taken from hyper only when this returns it.
    async fn next(&mut self) -> Result<Option<Bytes>, BodyError> {
        while !self.done {
            let piece = match tokio::time::timeout(self.timeout, self.body.data()).await {
                Err(_) => return Err(BodyError::Timeout),
                Ok(None) => {
                    self.done = true;
                    return Ok(None);
                }
                Ok(Some(Err(_))) => return Err(BodyError::Gone),
                Ok(Some(Ok(piece))) => piece,
            };
            // hyper knows when a declared length is all read: no further read to learn it.
            self.done = self.body.is_end_stream();
            if piece.is_empty() {
                continue;
            }
            self.size += piece.len() as u64;
            if self.size > self.limit {
                return Err(BodyError::TooLarge);
            }
            if self.replayable {
                if self.size <= self.retry_bytes {
                    self.kept.push(piece.clone());
                } else {
                    self.forget();
                }
            }
            return Ok(Some(piece));
        }
        Ok(None)
    }

    /// Keep nothing more: the body will not be sent again.
    fn forget(&mut self) {
        self.replayable = false;
        self.kept = Vec::new();
    }

    /// The whole body, read before the stream opens (the grant said it is small enough), to go
    /// with the OPEN. None when more came than fits one DATA frame: it is then streamed, from
    /// what was kept.
    async fn whole(&mut self) -> Result<Option<Vec<u8>>, BodyError> {
        let cap = (frames::MAX_PAYLOAD as u64).min(self.retry_bytes);
        while !self.done && self.size <= cap {
            self.next().await?;
        }
        if !self.replayable {
            // More than declared, past what is kept (as the Python end has it).
            return Err(BodyError::TooLarge);
        }
        if !self.done || self.size > frames::MAX_PAYLOAD as u64 {
            return Ok(None);
        }
        let mut whole = Vec::with_capacity(self.size as usize);
        for piece in &self.kept {
            whole.extend_from_slice(piece);
        }
        Ok(Some(whole))
    }
}

/// One attempt's end.
enum Attempt {
    /// The request is over: this goes to the client (a 408/413, a client gone...).
    Answered(Response<FrontBody>),
    /// The response began: its head, its body still in the stream.
    Started(Stream, Response<FrontBody>),
    /// A transport failure before the response began (its cause): another may be tried.
    Failed(String),
}

/// Open the granted stream, send the body, wait for the response to begin (`head_request`:
/// the request's method is HEAD).
async fn attempt(
    front: &Front,
    grant: &mut Value,
    body: &mut RequestBody,
    done: &mut Done,
    head_request: bool,
) -> Attempt {
    let open = match grant.get_mut("open").map(Value::take) {
        Some(Value::String(open)) => open.into_bytes(),
        _ => return Attempt::Failed("a grant without its OPEN".into()),
    };
    let node = grant.get("node").and_then(Value::as_str).unwrap_or("");
    let mut whole = None;
    if grant.get("whole").and_then(Value::as_bool) == Some(true) {
        match body.whole().await {
            Ok(bytes) => whole = bytes,
            Err(error) => return Attempt::Answered(refuse(front, error, done)),
        }
    }
    let whole_sent = whole.is_some();
    let mut stream = match front.hub.open(node, open, whole).await {
        Ok(stream) => stream,
        Err(Failed(cause)) => return Attempt::Failed(cause),
    };
    let head = if whole_sent {
        stream.response().await
    } else {
        // What an earlier attempt read goes again first, then the rest as it comes, while
        // the response is awaited (a replica may answer before the body's end).
        for index in 0..body.kept.len() {
            if let Err(reset) = stream.send(body.kept[index].clone()).await {
                return Attempt::Failed(reset.code);
            }
        }
        loop {
            if body.done {
                if let Err(reset) = stream.end().await {
                    return Attempt::Failed(reset.code);
                }
                break stream.response().await;
            }
            tokio::select! {
                biased;
                head = stream.response() => break head,
                piece = body.next() => match piece {
                    Ok(Some(piece)) => {
                        if let Err(reset) = stream.send(piece).await {
                            return Attempt::Failed(reset.code);
                        }
                    }
                    Ok(None) => {}
                    Err(error) => {
                        stream.reset(CANCELLED, reset_reason(&error));
                        return Attempt::Answered(refuse(front, error, done));
                    }
                },
            }
        }
    };
    let (status, pairs) = match head {
        Ok(head) => head,
        Err(reset) => return Attempt::Failed(reset.code),
    };
    let mut response = Response::new(FrontBody::from(Bytes::new()));
    *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    let length = passed_length(head_request, response.status(), &pairs);
    response_headers(front, response.headers_mut(), pairs);
    if let Some(length) = length {
        response
            .headers_mut()
            .insert(header::CONTENT_LENGTH, length);
    }
    done.set(response.status().as_u16(), "");
    Attempt::Started(stream, response)
}

/// The replica's `Content-Length` where it crosses: an answer to HEAD (`head`) or a 304 frames
/// no body by it, so its one value, digits only, goes to the client; None otherwise (several,
/// or not a number: dropped, as every other answer's is).
fn passed_length(
    head: bool,
    status: StatusCode,
    pairs: &[(String, String)],
) -> Option<HeaderValue> {
    if !head && status != StatusCode::NOT_MODIFIED {
        return None;
    }
    let mut lengths = pairs
        .iter()
        .filter(|(name, _)| name.eq_ignore_ascii_case("content-length"));
    let (_, value) = lengths.next()?;
    if lengths.next().is_some() || value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    value.parse::<u64>().ok()?;
    HeaderValue::from_str(value).ok()
}

/// The response's headers: the replica's that reach a client (`reaches_client`), then the
/// security headers.
fn response_headers(front: &Front, headers: &mut HeaderMap, pairs: Vec<(String, String)>) {
    headers.reserve(pairs.len() + front.config.security_headers.len());
    for (name, value) in pairs {
        let name = match HeaderName::from_bytes(name.as_bytes()) {
            Ok(name) => name,
            Err(_) => continue,
        };
        if !reaches_client(name.as_str()) {
            continue;
        }
        let value = if value.is_ascii() {
            // The text's own buffer becomes the value's: no copy.
            HeaderValue::from_maybe_shared(Bytes::from(value)).ok()
        } else {
            crate::latin1_value(&value)
        };
        if let Some(value) = value {
            headers.append(name, value);
        }
    }
    crate::add_security_headers(front, headers);
}

/// The answer to a client whose body failed (408, 413), or to none (it has gone); the ticket
/// ends with it.
fn refuse(front: &Front, error: BodyError, done: &mut Done) -> Response<FrontBody> {
    match error {
        BodyError::TooLarge => {
            done.set(413, "too_large");
            crate::error_answer(
                front,
                StatusCode::PAYLOAD_TOO_LARGE,
                &front.config.too_large,
                true,
            )
        }
        BodyError::Timeout => {
            done.set(408, "client_timeout");
            crate::error_answer(
                front,
                StatusCode::REQUEST_TIMEOUT,
                &front.config.body_timeout_message,
                true,
            )
        }
        BodyError::Gone => {
            done.set(499, "client_gone");
            // Nobody reads it: hyper drops the connection.
            let mut response = Response::new(FrontBody::from(Bytes::new()));
            *response.status_mut() = StatusCode::BAD_REQUEST;
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            response
        }
    }
}

fn reset_reason(error: &BodyError) -> &'static str {
    match error {
        BodyError::TooLarge => "the body is larger than the gateway accepts",
        BodyError::Timeout => "the client stopped sending its body",
        BodyError::Gone => "the client went away",
    }
}

/// Send the response: whole when it has all arrived (one piece, its length known), else
/// relayed as it comes by a task of its own.
fn start_relay(
    mut stream: Stream,
    response: Response<FrontBody>,
    mut body: RequestBody,
    mut done: Done,
) -> Response<FrontBody> {
    if let Some(meter) = done.meter.as_mut() {
        let kind = response.headers().get(header::CONTENT_TYPE);
        meter.begin(kind.map(HeaderValue::as_bytes));
    }
    if let Some(mut whole) = stream.whole_body() {
        if let Some(meter) = done.meter.as_mut() {
            let mut read = BytesMut::from(&meter.feed(whole)[..]);
            read.extend_from_slice(&meter.finish());
            whole = read.freeze();
        }
        // Answered: the rest of the request (if any) is not wanted; the ticket ends here.
        drop(stream);
        drop(done);
        // A length passed (HEAD, 304) frames no body: none goes.
        if response.headers().contains_key(header::CONTENT_LENGTH) {
            return response;
        }
        return response.map(|_| FrontBody::from(whole));
    }
    body.forget();
    let (pieces, receiver) = mpsc::channel(1);
    tokio::spawn(relay(stream, body, pieces, done));
    response.map(|_| FrontBody::Tunnel(receiver))
}

/// Relay the response's body to the client (through `FrontBody::Tunnel`), and the rest of
/// the request's body to the replica while it is still coming (a replica may stream its
/// answer while it reads). `Stream`'s calls each take it whole, so both directions share
/// one loop: a piece of either is moved as it comes.
async fn relay(
    mut stream: Stream,
    mut body: RequestBody,
    pieces: mpsc::Sender<Result<Bytes, Broken>>,
    mut done: Done,
) {
    let status = done.status;
    // A body complete already has had its END (with the OPEN, or before the response).
    let mut pumping = !body.done;
    loop {
        if pumping && body.done {
            pumping = false;
            let _ = stream.end().await;
        }
        tokio::select! {
            biased;
            piece = stream.chunk() => match piece {
                Ok(Some(mut piece)) => {
                    if let Some(meter) = done.meter.as_mut() {
                        piece = meter.feed(piece);
                        if piece.is_empty() {
                            continue; // a partial event, or one taken out
                        }
                    }
                    if pieces.send(Ok(piece)).await.is_err() {
                        break;
                    }
                }
                Ok(None) => {
                    if let Some(rest) = done.meter.as_mut().map(Meter::finish) {
                        if !rest.is_empty() && pieces.send(Ok(rest)).await.is_err() {
                            done.set(499, "client_gone");
                            return;
                        }
                    }
                    // Dropping `pieces` ends the client's body.
                    done.set(status, "");
                    return;
                }
                Err(_) => {
                    // An OpenAI stream is told why in its own shape, then cut like any other.
                    if let Some(last) = done.meter.as_mut().and_then(Meter::broken) {
                        let _ = pieces.send(Ok(last)).await;
                    }
                    let _ = pieces.send(Err(Broken)).await;
                    done.set(status, "response_broken");
                    return;
                }
            },
            _ = pieces.closed() => break,
            piece = body.next(), if pumping => match piece {
                Ok(Some(piece)) => {
                    if stream.send(piece).await.is_err() {
                        // Reset: `chunk` tells how the answer ends.
                        pumping = false;
                    }
                }
                Ok(None) => {}
                Err(BodyError::Gone) => break,
                Err(error) => {
                    // The request cannot be completed: nor can its answer.
                    stream.reset(CANCELLED, reset_reason(&error));
                    let _ = pieces.send(Err(Broken)).await;
                    let kind = match error {
                        BodyError::TooLarge => "too_large",
                        _ => "client_timeout",
                    };
                    done.set(status, kind);
                    return;
                }
            },
        }
    }
    // The client went away: the replica stops, the stream's slot is freed.
    stream.reset(CANCELLED, "the client went away");
    done.set(499, "client_gone");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn an_ambiguous_framing_is_refused_and_a_plain_one_passes() {
        for ambiguous in [
            &[("content-length", "5"), ("transfer-encoding", "chunked")][..],
            &[("transfer-encoding", "chunked"), ("content-length", "5")],
            &[("transfer-encoding", "gzip")],
            &[("transfer-encoding", "gzip, chunked")],
            &[
                ("transfer-encoding", "chunked"),
                ("transfer-encoding", "chunked"),
            ],
            &[("content-length", "5"), ("content-length", "7")],
            &[("content-length", "5, 7")],
            &[("content-length", "5, 5")],
            &[("content-length", "5x")],
            &[("content-length", "")],
            &[("content-length", "-1")],
        ] {
            assert!(framing_refusal(&headers(ambiguous)), "{:?}", ambiguous);
        }
        for plain in [
            &[][..],
            &[("content-length", "5")],
            &[("content-length", " 5 ")],
            &[("content-length", "5"), ("content-length", "5")],
            &[("transfer-encoding", "Chunked")],
        ] {
            assert!(!framing_refusal(&headers(plain)), "{:?}", plain);
        }
    }

    #[test]
    fn the_forwarding_headers_are_the_fronts_own() {
        let mut map = headers(&[
            ("host", "cp.example:8000"),
            ("x-forwarded-for", "6.6.6.6"),
            ("x-forwarded-for", "7.7.7.7"),
            ("x-forwarded-host", "evil.example"),
            ("x-forwarded-proto", "https"),
            ("forwarded", "for=6.6.6.6"),
            ("x-real-ip", "6.6.6.6"),
            ("x-other", "kept"),
        ]);
        set_forwarding(&mut map, "[2001:db8::1]:4242".parse().unwrap(), "http");
        let all = |name: &str| -> Vec<&str> {
            map.get_all(name)
                .iter()
                .map(|value| value.to_str().unwrap())
                .collect()
        };
        assert_eq!(all("x-forwarded-for"), ["2001:db8::1"]);
        assert_eq!(all("x-forwarded-proto"), ["http"]);
        assert_eq!(all("x-forwarded-host"), ["cp.example:8000"]);
        assert!(all("forwarded").is_empty() && all("x-real-ip").is_empty());
        assert_eq!(all("x-other"), ["kept"]);
        let mut bare = HeaderMap::new();
        set_forwarding(&mut bare, "10.0.0.2:1".parse().unwrap(), "https");
        assert!(bare.get("x-forwarded-host").is_none());
        assert_eq!(bare["x-forwarded-for"], "10.0.0.2");
        assert_eq!(bare["x-forwarded-proto"], "https");
    }

    #[test]
    fn a_replicas_framing_cookies_and_hop_headers_never_reach_the_client() {
        for dropped in [
            "content-length",
            "transfer-encoding",
            "set-cookie",
            "set-cookie2",
            "clear-site-data",
            "connection",
            "keep-alive",
            "proxy-authenticate",
            "trailer",
            "upgrade",
            "x-modelforge-peer-failure",
        ] {
            assert!(!reaches_client(dropped), "{}", dropped);
        }
        for kept in ["content-type", "x-replica", "cache-control", "etag"] {
            assert!(reaches_client(kept), "{}", kept);
        }
    }

    #[test]
    fn a_replicas_length_crosses_only_where_it_frames_no_body() {
        let pairs = |lengths: &[&str]| -> Vec<(String, String)> {
            let mut pairs = vec![("content-type".to_string(), "text/plain".to_string())];
            for length in lengths {
                pairs.push(("Content-Length".into(), length.to_string()));
            }
            pairs
        };
        let (ok, not_modified) = (StatusCode::OK, StatusCode::NOT_MODIFIED);
        assert_eq!(passed_length(true, ok, &pairs(&["1234"])).unwrap(), "1234");
        assert_eq!(
            passed_length(false, not_modified, &pairs(&["0"])).unwrap(),
            "0"
        );
        assert_eq!(passed_length(true, ok, &pairs(&[])), None);
        // Any other answer's is the replica's framing: hyper frames by the real body.
        assert_eq!(passed_length(false, ok, &pairs(&["1234"])), None);
        assert_eq!(
            passed_length(false, StatusCode::NO_CONTENT, &pairs(&["0"])),
            None
        );
        // Never one that is not a single number.
        for bad in [
            &["12", "12"][..],
            &["12", "13"],
            &["12, 12"],
            &[" 12"],
            &["+12"],
            &["-1"],
            &["0x10"],
            &[""],
            &["99999999999999999999999"],
        ] {
            assert_eq!(passed_length(true, ok, &pairs(bad)), None, "{bad:?}");
        }
    }
}
