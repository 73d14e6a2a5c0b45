//! The OpenAI API at the control plane's address (issue 43; `control_plane/gateway/openai.py`
//! decides, docs/llm.md): `POST /v1/chat/completions`, `/v1/completions` and `/v1/embeddings`.
//!
//! The call's `model` is in its body, so the body is read whole first: at most `MAX_BODY`
//! bytes (413 past it, or when the declared length says so before any read), each piece within
//! the gateway's `body_timeout` (408). It must be one JSON object (serde_json: no NaN, no raw
//! control character in a string, nesting within its recursion limit) naming its `model` as a
//! string of 1 to `MAX_MODEL` bytes (400 otherwise). Nothing of a refused call reaches a
//! replica. The call then goes as a gateway request for `/services/{model}{path}` (the model
//! percent-encoded as one segment), its body whole, with its facts in the ask (`"openai"`: the
//! model, the `max_tokens` it asks for) and never on the fast path: the control plane checks
//! every call against its service's limits. The answer streams back as any gateway answer does
//! (server-sent events event by event; a client that goes resets the stream, so the engine stops
//! generating).
//!
//! Answers the front makes itself are reshaped to OpenAI's error shape
//! (`{"error": {"message", "type", "param", "code"}}`, same status); the control plane shapes
//! its own; the engine's pass as it gave them.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use hyper::body::HttpBody;
use hyper::header::{self, HeaderValue};
use hyper::http::uri::PathAndQuery;
use hyper::{Body, Method, Request, Response, StatusCode, Uri};
use serde_json::Value;

use crate::{control, gateway, Front, FrontBody, OwnAnswer};

/// The calls carried as the OpenAI API (`GET /v1/models` is the control plane's own route).
pub const ENDPOINTS: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"];
/// The most an OpenAI call's body may hold: read whole before it goes anywhere.
pub const MAX_BODY: u64 = 4 * 1024 * 1024;
/// The longest `model` a call may name.
const MAX_MODEL: usize = 256;

/// Whether `method path` is one of the calls this module carries.
pub fn is_call(method: &Method, path: &str) -> bool {
    method == Method::POST && ENDPOINTS.contains(&path)
}

/// Carry one OpenAI call (see the module's docstring).
pub async fn handle(
    front: &Arc<Front>,
    request: Request<Body>,
    peer: SocketAddr,
) -> Response<FrontBody> {
    if gateway::framing_refusal(request.headers()) {
        return refuse(
            front,
            StatusCode::BAD_REQUEST,
            gateway::AMBIGUOUS_FRAMING,
            "invalid_request",
            true,
        );
    }
    let limit = MAX_BODY.min(front.config.body_bytes);
    let (mut parts, body) = request.into_parts();
    let bytes = match read_whole(body, limit, front.config.body_timeout).await {
        Ok(bytes) => bytes,
        Err(ReadError::TooLarge) => {
            let message = format!(
                "the request body is larger than {} bytes; send a shorter prompt",
                limit
            );
            return refuse(
                front,
                StatusCode::PAYLOAD_TOO_LARGE,
                &message,
                "request_too_large",
                true,
            );
        }
        Err(ReadError::Timeout) => {
            let message = front.config.body_timeout_message.clone();
            return refuse(
                front,
                StatusCode::REQUEST_TIMEOUT,
                &message,
                "request_timeout",
                true,
            );
        }
        Err(ReadError::Gone) => {
            let message = "the request body broke off before its end";
            return refuse(
                front,
                StatusCode::BAD_REQUEST,
                message,
                "invalid_request",
                true,
            );
        }
    };
    let mut call = match read_call(&bytes) {
        Ok(call) => call,
        Err(message) => {
            return refuse(
                front,
                StatusCode::BAD_REQUEST,
                &message,
                "invalid_request",
                false,
            )
        }
    };
    let mut target = String::with_capacity(16 + call.model.len() * 3 + parts.uri.path().len());
    target.push_str("/services/");
    push_segment(&mut target, &call.model);
    target.push_str(parts.uri.path());
    if let Some(query) = parts.uri.query() {
        target.push('?');
        target.push_str(query);
    }
    parts.uri = match PathAndQuery::try_from(target).map(Uri::from) {
        Ok(uri) => uri,
        Err(_) => {
            let message = "the request's query is not valid";
            return refuse(
                front,
                StatusCode::BAD_REQUEST,
                message,
                "invalid_request",
                false,
            );
        }
    };
    let bytes = call.body.take().unwrap_or(bytes);
    parts.headers.remove(header::TRANSFER_ENCODING);
    parts
        .headers
        .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    let request = Request::from_parts(parts, Body::from(bytes));
    let facts = (call.facts(), call.strip_usage);
    let response = gateway::carry(front, request, peer, Some(facts)).await;
    reshape(response)
}

/// What the control plane is told of a call, and what goes to the engine.
#[derive(Debug, PartialEq)]
pub struct Call {
    pub model: String,
    pub max_tokens: Option<u64>,
    /// A streamed call that did not ask for the engine's usage event: it is asked for (the
    /// gateway counts every call's tokens, `meter.rs`) and taken out of the client's stream.
    pub strip_usage: bool,
    /// The body the engine gets, when it is not the client's (usage asked for).
    pub body: Option<Bytes>,
}

impl Call {
    /// The ask's `"openai"` object.
    fn facts(&self) -> String {
        let mut out = String::with_capacity(48 + self.model.len());
        out.push_str("{\"model\":");
        control::push_str(&mut out, &self.model);
        if let Some(limit) = self.max_tokens {
            out.push_str(",\"max_tokens\":");
            out.push_str(&limit.to_string());
        }
        out.push('}');
        out
    }
}

/// The call a body makes, or why it is refused (400).
pub fn read_call(bytes: &[u8]) -> Result<Call, String> {
    let body: Value = serde_json::from_slice(bytes).map_err(|error| {
        format!(
            "the request body is not valid JSON ({}): send one JSON object",
            error
        )
    })?;
    let object = body
        .as_object()
        .ok_or_else(|| "the request body must be a JSON object".to_string())?;
    let model = match object.get("model") {
        Some(Value::String(model)) if !model.is_empty() && model.len() <= MAX_MODEL => model,
        Some(Value::String(_)) => {
            return Err(format!(
                "model must name a model in 1 to {} bytes; list them with GET /v1/models",
                MAX_MODEL
            ))
        }
        Some(_) => return Err("model must be a string; list models with GET /v1/models".into()),
        None => return Err("the call names no model; list models with GET /v1/models".into()),
    };
    // `max_completion_tokens` is the chat API's newer name for it.
    let max_tokens = ["max_tokens", "max_completion_tokens"]
        .iter()
        .filter_map(|name| object.get(*name).and_then(Value::as_u64))
        .max();
    let model = model.clone();
    let streamed = object.get("stream").and_then(Value::as_bool) == Some(true);
    let asked = object
        .get("stream_options")
        .and_then(|options| options.get("include_usage"))
        .and_then(Value::as_bool)
        == Some(true);
    let mut call = Call {
        model,
        max_tokens,
        strip_usage: streamed && !asked,
        body: None,
    };
    if call.strip_usage {
        let mut body = body;
        if let Some(object) = body.as_object_mut() {
            let options = object
                .entry("stream_options")
                .or_insert_with(|| Value::Object(Default::default()));
            if !options.is_object() {
                *options = Value::Object(Default::default());
            }
            options["include_usage"] = Value::Bool(true);
        }
        call.body = serde_json::to_vec(&body).ok().map(Bytes::from);
    }
    Ok(call)
}

enum ReadError {
    TooLarge,
    Timeout,
    Gone,
}

async fn read_whole(
    mut body: Body,
    limit: u64,
    timeout: std::time::Duration,
) -> Result<Bytes, ReadError> {
    if body.size_hint().lower() > limit {
        return Err(ReadError::TooLarge);
    }
    let mut whole = BytesMut::new();
    while !body.is_end_stream() {
        let piece = match tokio::time::timeout(timeout, body.data()).await {
            Err(_) => return Err(ReadError::Timeout),
            Ok(None) => break,
            Ok(Some(Err(_))) => return Err(ReadError::Gone),
            Ok(Some(Ok(piece))) => piece,
        };
        if (whole.len() + piece.len()) as u64 > limit {
            return Err(ReadError::TooLarge);
        }
        whole.extend_from_slice(&piece);
    }
    Ok(whole.freeze())
}

/// Append `text` as one path segment: every byte but the unreserved ones percent-encoded.
fn push_segment(out: &mut String, text: &str) {
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{:02X}", byte));
        }
    }
}

/// OpenAI's error `type` for a status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        429 => "rate_limit_error",
        500..=599 => "server_error",
        _ => "invalid_request_error",
    }
}

/// OpenAI's error body.
pub fn error_body(status: StatusCode, message: &str, code: &str) -> String {
    let mut text = String::with_capacity(message.len() + 96);
    text.push_str("{\"error\":{\"message\":");
    control::push_str(&mut text, message);
    text.push_str(",\"type\":\"");
    text.push_str(error_type(status));
    text.push_str("\",\"param\":null,\"code\":");
    control::push_str(&mut text, code);
    text.push_str("}}");
    text
}

fn refuse(
    front: &Front,
    status: StatusCode,
    message: &str,
    code: &str,
    close: bool,
) -> Response<FrontBody> {
    let mut response = crate::error_answer(front, status, message, close);
    shape(&mut response, status, message, code);
    response
}

/// A response the front made itself (`OwnAnswer`) in OpenAI's shape; any other as it is.
fn reshape(mut response: Response<FrontBody>) -> Response<FrontBody> {
    if let Some(OwnAnswer(message)) = response.extensions_mut().remove::<OwnAnswer>() {
        let status = response.status();
        let code = match status.as_u16() {
            400 => "invalid_request",
            408 => "request_timeout",
            413 => "request_too_large",
            502 => "replica_unreachable",
            503 => "unavailable",
            _ => "gateway_error",
        };
        shape(&mut response, status, &message, code);
    }
    response
}

fn shape(response: &mut Response<FrontBody>, status: StatusCode, message: &str, code: &str) {
    let text = error_body(status, message, code);
    response
        .headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(text.len()));
    *response.body_mut() = FrontBody::from(Bytes::from(text));
    response.extensions_mut().remove::<OwnAnswer>();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_names_its_model_and_its_limit() {
        let call =
            read_call(br#"{"model":"smol","messages":[],"max_tokens":16,"stream":true}"#).unwrap();
        assert_eq!(call.model, "smol");
        assert_eq!(call.max_tokens, Some(16));
        // Streamed without asking for usage: asked for, to be taken out again.
        assert!(call.strip_usage);
        let sent: Value = serde_json::from_slice(call.body.as_ref().unwrap()).unwrap();
        assert_eq!(sent["stream_options"]["include_usage"], true);
        assert_eq!(sent["max_tokens"], 16);
        let asked =
            read_call(br#"{"model":"smol","stream":true,"stream_options":{"include_usage":true}}"#)
                .unwrap();
        assert!(!asked.strip_usage && asked.body.is_none());
        let newer = read_call(br#"{"model":"smol","max_completion_tokens":99}"#).unwrap();
        assert_eq!(newer.max_tokens, Some(99));
        assert_eq!(newer.facts(), r#"{"model":"smol","max_tokens":99}"#);
    }

    #[test]
    fn bodies_that_are_not_a_call_are_refused() {
        for body in [
            &b"not json"[..],
            b"[1, 2]",
            b"{\"messages\": []}",
            b"{\"model\": 7}",
            b"{\"model\": \"\"}",
            b"{\"model\": \"m\", \"temperature\": NaN}",
            b"{\"model\": \"a\x01b\"}",
        ] {
            assert!(
                read_call(body).is_err(),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
        let deep = format!("{}{}", "[".repeat(1000), "]".repeat(1000));
        let nested = format!("{{\"model\":\"m\",\"x\":{}}}", deep);
        assert!(read_call(nested.as_bytes())
            .unwrap_err()
            .contains("recursion limit"));
        let long = format!("{{\"model\":\"{}\"}}", "m".repeat(MAX_MODEL + 1));
        assert!(read_call(long.as_bytes()).is_err());
    }

    #[test]
    fn the_model_is_one_path_segment() {
        let mut out = String::new();
        push_segment(&mut out, "org/model name?%");
        assert_eq!(out, "org%2Fmodel%20name%3F%25");
    }

    #[test]
    fn errors_take_openais_shape() {
        let body = error_body(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too \"big\"",
            "request_too_large",
        );
        let parsed: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(parsed["error"]["message"], "too \"big\"");
        assert_eq!(parsed["error"]["type"], "invalid_request_error");
        assert_eq!(parsed["error"]["code"], "request_too_large");
        assert!(parsed["error"]["param"].is_null());
        let server = error_body(StatusCode::BAD_GATEWAY, "gone", "replica_unreachable");
        assert!(server.contains("\"server_error\""));
    }

    #[test]
    fn only_the_three_posts_are_calls() {
        assert!(is_call(&Method::POST, "/v1/chat/completions"));
        assert!(is_call(&Method::POST, "/v1/embeddings"));
        assert!(!is_call(&Method::GET, "/v1/chat/completions"));
        assert!(!is_call(&Method::GET, "/v1/models"));
        assert!(!is_call(&Method::POST, "/v1/chat/completions/"));
    }
}
