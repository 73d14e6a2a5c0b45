//! `modelforge-gateway-front`: the control plane's native front. It listens on the control
//! plane's public port and
//!
//! - holds the agents' tunnels (an upgrade at `tunnel_path`, accepted or refused by the control
//!   plane over the control channel; `hub.rs` serves each),
//! - carries the gateway's requests (`/v2...`, `/services/...`) to replicas through those
//!   tunnels, the control plane deciding each (`gateway.rs`),
//! - and passes every other request to the control plane's own server (Granian) on a loopback
//!   port, streamed both ways, with the client's address in `x-modelforge-client`, the scheme
//!   the client used in `x-modelforge-scheme` and the front's key in `x-modelforge-front-key`
//!   (the control plane trusts the address and the scheme only with the key).
//!
//! With `tls_cert` and `tls_key` (the files' paths) it terminates TLS itself (`tls.rs`) for all
//! three; Granian behind it stays plain HTTP on loopback.
//!
//! The control plane (Python) starts it and writes one JSON line to its stdin: the
//! configuration (`Config`). The end of stdin ends the front. The control channel is
//! `control.rs`. Logs go to stderr as `<level> <message>`, never with a header, token or body.

#[allow(dead_code)] // shared with the relay, which uses other parts of it
#[path = "../../tunnel_relay/src/frames.rs"]
mod frames;
#[allow(dead_code)] // shared with the relay, which uses other parts of it
#[path = "../../tunnel_relay/src/ws.rs"]
mod ws;

mod control;
mod fast;
mod gateway;
mod hub;
mod meter;
mod openai;
mod tls;
mod upstream;

use std::convert::Infallible;
use std::io::BufRead;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{HttpBody, SizeHint};
use hyper::client::HttpConnector;
use hyper::header::{self, HeaderName, HeaderValue};
use hyper::http::uri::Authority;
use hyper::server::conn::Http;
use hyper::service::service_fn;
use hyper::{Body, Client, HeaderMap, Request, Response, StatusCode};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use control::Control;
use fast::Fast;
use hub::Hub;

/// The header that carries the client's address to the control plane's server.
pub const CLIENT_HEADER: HeaderName = HeaderName::from_static("x-modelforge-client");
/// The header that proves `CLIENT_HEADER` came from the front.
pub const KEY_HEADER: HeaderName = HeaderName::from_static("x-modelforge-front-key");
/// The header that tells the control plane's server the client's scheme (`http`, `https`).
pub const SCHEME_HEADER: HeaderName = HeaderName::from_static("x-modelforge-scheme");
/// RFC 6455's GUID, from which the handshake's Sec-WebSocket-Accept is made.
const WEBSOCKET_GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
/// The pause after a failed `accept()`, doubled at each next failure up to the longest.
const ACCEPT_PAUSE_MIN: Duration = Duration::from_millis(10);
const ACCEPT_PAUSE_MAX: Duration = Duration::from_secs(1);

/// The pause between failed `accept()`s (EMFILE: no descriptor left), as the gRPC front
/// keeps it: `ACCEPT_PAUSE_MIN` after the first, doubling up to `ACCEPT_PAUSE_MAX`, none
/// again once one succeeds; never a spin, and one log line each way.
#[derive(Default)]
struct AcceptPause {
    pause: Duration,
}

impl AcceptPause {
    /// After a failure: the pause to take, and whether it begins a run of failures.
    fn failed(&mut self) -> (Duration, bool) {
        let first = self.pause.is_zero();
        self.pause = (self.pause * 2).clamp(ACCEPT_PAUSE_MIN, ACCEPT_PAUSE_MAX);
        (self.pause, first)
    }

    /// After a success: whether it ends a run of failures.
    fn succeeded(&mut self) -> bool {
        let recovered = !self.pause.is_zero();
        self.pause = Duration::ZERO;
        recovered
    }
}

/// What `main` reads from stdin (see the module's docstring).
pub struct Config {
    pub listen: String,
    pub upstream: Authority,
    pub control: String,
    pub front_key: HeaderValue,
    pub tunnel_path: String,
    pub max_streams: usize,
    pub idle_timeout: Duration,
    /// The most a gateway request's body may hold (413 past it).
    pub body_bytes: u64,
    /// The most of a body kept to send again on a retry.
    pub retry_bytes: u64,
    /// The longest wait for each piece of a gateway request's body (408 past it).
    pub body_timeout: Duration,
    /// Added to every gateway answer and every answer the front makes itself.
    pub security_headers: Vec<(HeaderName, HeaderValue)>,
    /// The 413's message.
    pub too_large: String,
    /// The 408's message.
    pub body_timeout_message: String,
    /// The paths of the certificate (chain) and the private key, both PEM: TLS on `listen`.
    pub tls: Option<(String, String)>,
}

impl Config {
    /// The scheme clients reach the front with.
    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }
}

#[cfg(test)]
impl Config {
    pub fn for_tests() -> Config {
        Config {
            listen: "127.0.0.1:0".into(),
            upstream: Authority::from_static("127.0.0.1:1"),
            control: String::new(),
            front_key: HeaderValue::from_static("key"),
            tunnel_path: "/api/v1/agent/tunnel".into(),
            max_streams: 256,
            idle_timeout: Duration::from_secs(30),
            body_bytes: 1024 * 1024,
            retry_bytes: 8 * 1024 * 1024,
            body_timeout: Duration::from_secs(30),
            security_headers: Vec::new(),
            too_large: String::new(),
            body_timeout_message: String::new(),
            tls: None,
        }
    }
}

/// Everything a request may need, shared by all of them.
pub struct Front {
    pub config: Config,
    pub hub: Arc<Hub>,
    pub control: Arc<Control>,
    /// The control plane's decisions the fast path carries requests by (`fast.rs`).
    pub fast: Arc<Fast>,
    /// The pooled client to the control plane's server.
    pub client: Client<upstream::Upstream, Body>,
}

pub fn log(level: &str, message: &str) {
    eprintln!("{} {}", level, message);
}

fn fail(message: &str) -> ! {
    log("error", message);
    std::process::exit(2);
}

/// A response body the front sends: hyper's own (a whole answer, or the control plane's
/// server's body passed on), or a tunnel stream's body, fed by the task relaying it
/// (`gateway.rs`). The tunnel's variant lets that task see the client go (the receiver
/// dropped: `Sender::closed`) even while no piece is moving, and ends the response short
/// (`Err`: hyper drops the connection) when the stream breaks.
pub enum FrontBody {
    Hyper(Body),
    Tunnel(mpsc::Receiver<Result<Bytes, Broken>>),
}

/// The stream broke after the response began: the client's connection is dropped, so it
/// cannot take a cut body for a whole one.
#[derive(Debug)]
pub struct Broken;

impl std::fmt::Display for Broken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the replica's answer broke off")
    }
}

impl std::error::Error for Broken {}

impl From<Bytes> for FrontBody {
    fn from(bytes: Bytes) -> FrontBody {
        FrontBody::Hyper(Body::from(bytes))
    }
}

impl HttpBody for FrontBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_data(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        match self.get_mut() {
            FrontBody::Hyper(body) => Pin::new(body)
                .poll_data(cx)
                .map(|piece| piece.map(|piece| piece.map_err(Into::into))),
            FrontBody::Tunnel(pieces) => pieces
                .poll_recv(cx)
                .map(|piece| piece.map(|piece| piece.map_err(Into::into))),
        }
    }

    fn poll_trailers(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<HeaderMap>, Self::Error>> {
        match self.get_mut() {
            FrontBody::Hyper(body) => Pin::new(body).poll_trailers(cx).map_err(Into::into),
            FrontBody::Tunnel(_) => Poll::Ready(Ok(None)),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            FrontBody::Hyper(body) => body.is_end_stream(),
            FrontBody::Tunnel(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            FrontBody::Hyper(body) => body.size_hint(),
            FrontBody::Tunnel(_) => SizeHint::default(),
        }
    }
}

/// An answer the front makes itself: `{"error": message}`, with the security headers (and
/// `connection: close` when `close`: the request's body was not read to its end).
pub fn error_answer(
    front: &Front,
    status: StatusCode,
    message: &str,
    close: bool,
) -> Response<FrontBody> {
    let mut text = String::with_capacity(message.len() + 16);
    text.push_str("{\"error\":");
    control::push_str(&mut text, message);
    text.push('}');
    let size = text.len();
    let mut response = Response::new(FrontBody::from(Bytes::from(text)));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(size));
    if close {
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    add_security_headers(front, headers);
    response
        .extensions_mut()
        .insert(OwnAnswer(message.to_string()));
    response
}

/// Marks an answer the front made itself (`error_answer`), with its message, so a caller
/// that answers in another error shape (`openai.rs`) can reshape it. Never sent.
#[derive(Clone, Debug)]
pub struct OwnAnswer(pub String);

pub fn add_security_headers(front: &Front, headers: &mut HeaderMap) {
    for (name, value) in &front.config.security_headers {
        headers.append(name.clone(), value.clone());
    }
}

/// The control plane's own answer (`{"status", "headers": [[k, v], ...], "body": text}`),
/// sent exactly as given.
pub fn control_answer(mut reply: Value) -> Response<FrontBody> {
    let status = reply
        .get("status")
        .and_then(Value::as_u64)
        .and_then(|status| StatusCode::from_u16(status as u16).ok())
        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = match reply.get_mut("body").map(Value::take) {
        Some(Value::String(text)) => Bytes::from(text),
        _ => Bytes::new(),
    };
    let mut response = Response::new(FrontBody::from(body));
    *response.status_mut() = status;
    if let Some(pairs) = reply.get("headers").and_then(Value::as_array) {
        let headers = response.headers_mut();
        for pair in pairs {
            if let Some([name, value]) = pair.as_array().map(Vec::as_slice) {
                if let (Some(name), Some(value)) = (name.as_str(), value.as_str()) {
                    if let (Ok(name), Some(value)) =
                        (HeaderName::from_bytes(name.as_bytes()), latin1_value(value))
                    {
                        headers.append(name, value);
                    }
                }
            }
        }
    }
    response
}

/// A header value given as Latin-1 text (each character one byte), as the Python end and the
/// tunnel's frames carry them. None for one that is not a valid value.
pub fn latin1_value(text: &str) -> Option<HeaderValue> {
    if text.is_ascii() {
        return HeaderValue::from_str(text).ok();
    }
    let mut bytes = Vec::with_capacity(text.len());
    for character in text.chars() {
        let code = character as u32;
        if code > 0xFF {
            return None;
        }
        bytes.push(code as u8);
    }
    HeaderValue::from_maybe_shared(Bytes::from(bytes)).ok()
}

/// The 503 while the control channel is down.
pub fn restarting(front: &Front) -> Response<FrontBody> {
    error_answer(
        front,
        StatusCode::SERVICE_UNAVAILABLE,
        "the control plane is restarting; retry in a few seconds",
        false,
    )
}

/// Route one request (see the module's docstring).
async fn route(front: Arc<Front>, request: Request<Body>, peer: SocketAddr) -> Response<FrontBody> {
    let path = request.uri().path();
    if path.starts_with("/v2") || path.starts_with("/services/") {
        return gateway::handle(&front, request, peer).await;
    }
    if openai::is_call(request.method(), path) {
        return openai::handle(&front, request, peer).await;
    }
    if path == front.config.tunnel_path
        && request.method() == hyper::Method::GET
        && is_websocket(request.headers())
    {
        return tunnel(&front, request, peer).await;
    }
    upstream::proxy(&front, request, peer).await
}

fn is_websocket(headers: &HeaderMap) -> bool {
    match headers.get(header::UPGRADE) {
        Some(value) => value.as_bytes().eq_ignore_ascii_case(b"websocket"),
        None => false,
    }
}

/// The request's headers as the control plane reads them: `[[name, value], ...]`, names in
/// lower case (as hyper keeps them), values Latin-1 text.
pub fn push_headers(out: &mut String, headers: &HeaderMap) {
    out.push('[');
    for (index, (name, value)) in headers.iter().enumerate() {
        if index > 0 {
            out.push(',');
        }
        out.push('[');
        control::push_str(out, name.as_str());
        out.push(',');
        control::push_latin1(out, value.as_bytes());
        out.push(']');
    }
    out.push(']');
}

/// Append the client's address, `ip:port` (`[ip]:port` for IPv6).
pub fn push_address(out: &mut String, peer: SocketAddr) {
    use std::fmt::Write;
    let _ = write!(out, "{}", peer);
}

/// An agent's tunnel: the control plane accepts (for a node) or refuses it; accepted, the
/// 101 goes back and the hub serves the upgraded connection until it ends.
async fn tunnel(
    front: &Arc<Front>,
    mut request: Request<Body>,
    peer: SocketAddr,
) -> Response<FrontBody> {
    let key = match request.headers().get("sec-websocket-key") {
        Some(key) => key.as_bytes().to_vec(),
        None => {
            return error_answer(
                front,
                StatusCode::BAD_REQUEST,
                "a WebSocket upgrade needs Sec-WebSocket-Key",
                false,
            )
        }
    };
    let mut ask = String::with_capacity(512);
    ask.push_str("{\"op\":\"tunnel\",\"headers\":");
    push_headers(&mut ask, request.headers());
    ask.push_str(",\"client\":\"");
    push_address(&mut ask, peer);
    ask.push_str("\"}");
    let mut reply = match front.control.ask_tunnel(ask).await {
        Ok(reply) => reply,
        Err(control::Lost) => return restarting(front),
    };
    let node = match reply.get_mut("node").map(Value::take) {
        Some(Value::String(node)) => node,
        _ => return control_answer(reply),
    };
    let mut material = key;
    material.extend_from_slice(WEBSOCKET_GUID.as_bytes());
    let accept = ws::base64(&ws::sha1(&material));
    let upgrade = hyper::upgrade::on(&mut request);
    let front = front.clone();
    tokio::spawn(async move {
        let why = match upgrade.await {
            Ok(upgraded) => front.hub.serve(node.clone(), upgraded).await,
            Err(_) => "the upgrade failed".to_string(),
        };
        if !front.hub.connected(&node) {
            front.control.tell(control::tunnel_closed_line(&node, &why));
        }
    });
    let mut response = Response::new(FrontBody::from(Bytes::new()));
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let headers = response.headers_mut();
    headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    if let Ok(accept) = HeaderValue::from_str(&accept) {
        headers.insert(header::SEC_WEBSOCKET_ACCEPT, accept);
    }
    response
}

fn config_from(line: &str) -> Config {
    let config: Value =
        serde_json::from_str(line).unwrap_or_else(|_| fail("the configuration line is not JSON"));
    let text = |name: &str| -> String {
        match config.get(name).and_then(Value::as_str) {
            Some(value) => value.to_string(),
            None => fail(&format!("the configuration has no {}", name)),
        }
    };
    let number = |name: &str| -> f64 {
        match config.get(name).and_then(Value::as_f64) {
            Some(value) if value >= 0.0 => value,
            _ => fail(&format!("the configuration has no {}", name)),
        }
    };
    let optional = |name: &str| -> Option<String> {
        match config.get(name) {
            None | Some(Value::Null) => None,
            Some(Value::String(value)) => Some(value.clone()),
            Some(_) => fail(&format!("the configuration's {} is not a path", name)),
        }
    };
    let tls = match (optional("tls_cert"), optional("tls_key")) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        _ => fail("MODELFORGE_TLS_CERT and MODELFORGE_TLS_KEY must be set together"),
    };
    let mut security_headers = Vec::new();
    for pair in config
        .get("security_headers")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
    {
        let parsed = match pair.as_array().map(Vec::as_slice) {
            Some([name, value]) => match (name.as_str(), value.as_str()) {
                (Some(name), Some(value)) => HeaderName::from_bytes(name.as_bytes())
                    .ok()
                    .zip(HeaderValue::from_str(value).ok()),
                _ => None,
            },
            _ => None,
        };
        match parsed {
            Some(pair) => security_headers.push(pair),
            None => fail("a security header that is not a valid [name, value]"),
        }
    }
    Config {
        listen: text("listen"),
        upstream: text("upstream")
            .parse()
            .unwrap_or_else(|_| fail("the upstream is not host:port")),
        control: text("control"),
        front_key: HeaderValue::from_str(&text("front_key"))
            .unwrap_or_else(|_| fail("the front key is not a header value")),
        tunnel_path: text("tunnel_path"),
        max_streams: number("max_streams") as usize,
        idle_timeout: Duration::from_secs_f64(number("idle_timeout")),
        body_bytes: number("body_bytes") as u64,
        retry_bytes: number("retry_bytes") as u64,
        body_timeout: Duration::from_secs_f64(number("body_timeout")),
        security_headers,
        too_large: text("too_large"),
        body_timeout_message: text("body_timeout_message"),
        tls,
    }
}

fn main() {
    let mut line = String::new();
    let stdin = std::io::stdin();
    if stdin.lock().read_line(&mut line).unwrap_or(0) == 0 {
        fail("no configuration on stdin");
    }
    let config = config_from(&line);
    // `--check`: the configuration read and the TLS files loaded, then exit (the control plane
    // runs it before it starts, so a file that cannot serve is a start-up error).
    if std::env::args().nth(1).as_deref() == Some("--check") {
        if let Some((cert, key)) = &config.tls {
            if let Err(message) = tls::acceptor(cert, key) {
                fail(&message);
            }
        }
        std::process::exit(0);
    }
    // The end of stdin (the control plane gone) ends the front.
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut stdin.lock(), &mut std::io::sink());
        std::process::exit(0);
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|_| fail("cannot start the runtime"));
    runtime.block_on(serve(config));
}

async fn serve(config: Config) {
    // Before the port is taken: a certificate or key that cannot serve ends the start here.
    let acceptor = config
        .tls
        .as_ref()
        .map(|(cert, key)| tls::acceptor(cert, key).unwrap_or_else(|message| fail(&message)));
    let listener = TcpListener::bind(&config.listen)
        .await
        .unwrap_or_else(|error| fail(&format!("cannot listen on {}: {}", config.listen, error)));
    let hub = Hub::new(config.max_streams, config.idle_timeout);
    let fast = Arc::new(Fast::default());
    let control = Control::start(config.control.clone(), hub.clone(), fast.clone());
    tokio::spawn(fast.clone().report_forever(control.clone()));
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    let client = Client::builder()
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(256)
        .build(upstream::Upstream::new(connector));
    let front = Arc::new(Front {
        config,
        hub,
        control,
        fast,
        client,
    });
    let mut http = Http::new();
    // As Granian (its default): a client that takes longer to send a request's head is dropped.
    http.http1_only(true)
        .http1_keep_alive(true)
        .http1_header_read_timeout(Duration::from_secs(30));
    let http = Arc::new(http);
    log(
        "info",
        &format!(
            "listening on {} ({})",
            front.config.listen,
            front.config.scheme()
        ),
    );
    let mut pause = AcceptPause::default();
    loop {
        let (socket, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of descriptors, most likely: wait, longer each time, rather than spin.
                let (wait, first) = pause.failed();
                if first {
                    log("warning", &format!("accept failed ({}); pausing", error));
                }
                tokio::time::sleep(wait).await;
                continue;
            }
        };
        if pause.succeeded() {
            log("info", "accepting connections again");
        }
        let _ = socket.set_nodelay(true);
        let front = front.clone();
        let http = http.clone();
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let front = front.clone();
                async move { Ok::<_, Infallible>(route(front, request, peer).await) }
            });
            match acceptor {
                None => {
                    let _ = http.serve_connection(socket, service).with_upgrades().await;
                }
                Some(acceptor) => {
                    // A failed or stalled handshake (a scanner, plain HTTP on this port) ends
                    // that connection only.
                    let accepted =
                        tokio::time::timeout(tls::HANDSHAKE_TIMEOUT, acceptor.accept(socket)).await;
                    if let Ok(Ok(stream)) = accepted {
                        let _ = http.serve_connection(stream, service).with_upgrades().await;
                    }
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_accepts_pause_longer_each_time_and_log_once_each_way() {
        let mut pause = AcceptPause::default();
        assert!(!pause.succeeded());
        let waits: Vec<(Duration, bool)> = (0..10).map(|_| pause.failed()).collect();
        let millis: Vec<u128> = waits.iter().map(|(wait, _)| wait.as_millis()).collect();
        assert_eq!(millis, [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
        // The first failure of a run is logged; the rest are not.
        let logged: Vec<bool> = waits.iter().map(|(_, first)| *first).collect();
        assert_eq!(
            logged,
            [true, false, false, false, false, false, false, false, false, false]
        );
        // The recovery is logged once, and the next failure begins again at the shortest.
        assert!(pause.succeeded());
        assert!(!pause.succeeded());
        assert_eq!(pause.failed(), (ACCEPT_PAUSE_MIN, true));
    }
}
