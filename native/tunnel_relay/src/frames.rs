//! The tunnel's frames (`modelforge_contracts/tunnel.py` is the protocol's definition; this is
//! the same wire format): `type u8 | stream u32 | payload`, or a BATCH of them on stream 0, each
//! as `length u32 | frame`.

use std::collections::VecDeque;

pub const OPEN: u8 = 1;
pub const DATA: u8 = 2;
pub const END: u8 = 3;
pub const RESPONSE: u8 = 4;
pub const RESET: u8 = 5;
pub const WINDOW: u8 = 6;
pub const BATCH: u8 = 7;

pub const INITIAL_WINDOW: i64 = 256 * 1024;
pub const MAX_PAYLOAD: usize = 64 * 1024;
pub const MAX_OPEN: usize = 16 * 1024;
pub const MAX_BATCH: usize = MAX_OPEN + MAX_PAYLOAD + 64;
/// A frame's header: its kind (1 byte) and stream (4).
pub const HEAD: usize = 5;
/// The most frames one BATCH holds; a longer one is refused and the tunnel closed (the
/// limits below are `modelforge_contracts/tunnel.py`'s, the same numbers).
pub const MAX_BATCH_FRAMES: usize = 256;
/// The frames a tunnel's reader takes per second on average (a WebSocket ping counts as one),
/// and at most at once: past them the reader waits, so one node's floods cost a bounded share.
/// (These last are the control plane's ends' to enforce; the agent's end reads none of them.)
#[allow(dead_code)]
pub const FRAMES_PER_SECOND: u32 = 20_000;
#[allow(dead_code)]
pub const FRAME_BURST: u32 = 2_000;
/// The WebSocket pings a tunnel may send per second on average, and at most at once (an agent
/// pings every 10 s): past them the tunnel is closed (1008).
#[allow(dead_code)]
pub const PINGS_PER_SECOND: u32 = 1;
#[allow(dead_code)]
pub const PING_BURST: u32 = 16;
/// A write toward the peer that makes no progress this long: the peer does not read, and the
/// tunnel is cut off rather than buffered for.
#[allow(dead_code)]
pub const WRITE_TIMEOUT_SECONDS: u64 = 10;
const MAX_WINDOW: i64 = (1 << 31) - 1;

/// Reset codes (`ResetCode` there).
pub const TOO_MANY_STREAMS: &str = "TOO_MANY_STREAMS";
pub const NO_SUCH_REPLICA: &str = "NO_SUCH_REPLICA";
pub const UPSTREAM_UNREACHABLE: &str = "UPSTREAM_UNREACHABLE";
pub const UPSTREAM_FAILED: &str = "UPSTREAM_FAILED";
pub const FLOW_CONTROL: &str = "FLOW_CONTROL";
pub const PROTOCOL_ERROR: &str = "PROTOCOL_ERROR";

pub struct Frame {
    pub kind: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
}

pub fn encode(kind: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEAD + payload.len());
    out.push(kind);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

pub fn window(stream: u32, increment: u32) -> Vec<u8> {
    encode(WINDOW, stream, &increment.to_be_bytes())
}

pub fn keepalive() -> Vec<u8> {
    window(0, 0)
}

pub fn reset(stream: u32, code: &str, message: &str) -> Vec<u8> {
    let message: String = message.chars().take(500).collect();
    let payload = serde_json::json!({"code": code, "message": message}).to_string();
    encode(RESET, stream, payload.as_bytes())
}

/// The next WebSocket message from the front of `pending` (not empty): as many frames as fit
/// one BATCH of at most `MAX_BATCH` bytes (at least one), or the frame itself when only one
/// goes (`FrameWriter` there).
pub fn take_batch(pending: &mut VecDeque<Vec<u8>>) -> Vec<u8> {
    let (mut taken, mut size) = (0, HEAD);
    for frame in pending.iter() {
        size += 4 + frame.len();
        if taken > 0 && (size > MAX_BATCH || taken == MAX_BATCH_FRAMES) {
            break;
        }
        taken += 1;
    }
    if taken == 1 {
        return pending.pop_front().unwrap_or_default();
    }
    let mut out = Vec::with_capacity(size);
    out.push(BATCH);
    out.extend_from_slice(&0u32.to_be_bytes());
    for frame in pending.drain(..taken) {
        out.extend_from_slice(&(frame.len() as u32).to_be_bytes());
        out.extend_from_slice(&frame);
    }
    out
}

/// One frame of a message: its kind, its stream, and where its payload lies in the message.
pub struct Span {
    pub kind: u8,
    pub stream: u32,
    pub start: usize,
    pub end: usize,
}

/// One frame's head, checked as the Python codec checks it: (kind, stream).
fn check(frame: &[u8]) -> Result<(u8, u32), String> {
    if frame.len() < HEAD {
        return Err("a frame shorter than its header".into());
    }
    let kind = frame[0];
    let stream = u32::from_be_bytes([frame[1], frame[2], frame[3], frame[4]]);
    if !(OPEN..=WINDOW).contains(&kind) {
        return Err(format!("unknown frame type {}", kind));
    }
    let limit = if kind == OPEN || kind == RESPONSE {
        MAX_OPEN
    } else {
        MAX_PAYLOAD
    };
    if frame.len() - HEAD > limit {
        return Err(format!("a frame of type {} over {} bytes", kind, limit));
    }
    if stream == 0 && kind != WINDOW {
        return Err("only the keepalive (WINDOW) and BATCH use stream 0".into());
    }
    Ok((kind, stream))
}

/// The frames of one WebSocket message, in order, into `spans` (no payload copied); an error
/// for anything malformed (the tunnel is then closed, as the Python end does), found before
/// any frame is taken.
pub fn split(message: &[u8], spans: &mut Vec<Span>) -> Result<(), String> {
    spans.clear();
    if message.first() != Some(&BATCH) {
        let (kind, stream) = check(message)?;
        spans.push(Span {
            kind,
            stream,
            start: HEAD,
            end: message.len(),
        });
        return Ok(());
    }
    if message.len() > MAX_BATCH + HEAD {
        return Err(format!("a BATCH over {} bytes", MAX_BATCH));
    }
    if message.len() < HEAD || message[1..HEAD] != [0, 0, 0, 0] {
        return Err("a BATCH is on stream 0".into());
    }
    let mut at = HEAD;
    while at < message.len() {
        if at + 4 > message.len() {
            return Err("a BATCH cut inside a frame's length".into());
        }
        let length = u32::from_be_bytes([
            message[at],
            message[at + 1],
            message[at + 2],
            message[at + 3],
        ]) as usize;
        at += 4;
        if length > message.len() - at {
            return Err("a BATCH cut inside a frame".into());
        }
        if spans.len() == MAX_BATCH_FRAMES {
            return Err(format!("a BATCH of more than {} frames", MAX_BATCH_FRAMES));
        }
        let inner = &message[at..at + length];
        if inner.first() == Some(&BATCH) {
            return Err("a BATCH inside a BATCH".into());
        }
        let (kind, stream) = check(inner)?;
        spans.push(Span {
            kind,
            stream,
            start: at + HEAD,
            end: at + length,
        });
        at += length;
    }
    Ok(())
}

/// The frames of one WebSocket message, each with its payload copied (`split`).
pub fn decode_message(message: &[u8]) -> Result<Vec<Frame>, String> {
    let mut spans = Vec::new();
    split(message, &mut spans)?;
    Ok(spans
        .iter()
        .map(|span| Frame {
            kind: span.kind,
            stream: span.stream,
            payload: message[span.start..span.end].to_vec(),
        })
        .collect())
}

pub fn parse_window(payload: &[u8]) -> Result<i64, String> {
    if payload.len() != 4 {
        return Err("a WINDOW frame's payload is 4 bytes".into());
    }
    Ok(u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]) as i64)
}

pub fn window_fits(available: i64, increment: i64) -> bool {
    available + increment <= MAX_WINDOW
}

/// An OPEN frame's request.
pub struct OpenRequest {
    pub replica_id: String,
    pub method: String,
    pub path: String,
    pub query: String,
    pub headers: Vec<(String, String)>,
}

pub fn parse_open(payload: &[u8]) -> Result<OpenRequest, String> {
    let body: serde_json::Value =
        serde_json::from_slice(payload).map_err(|_| "an OPEN frame's payload is not JSON")?;
    let field = |name: &str| {
        body.get(name)
            .and_then(|value| value.as_str())
            .map(str::to_owned)
    };
    let (replica_id, method, path, query) = match (
        field("replica_id"),
        field("method"),
        field("path"),
        field("query"),
    ) {
        (Some(a), Some(b), Some(c), Some(d)) => (a, b, c, d),
        _ => return Err("an OPEN frame needs replica_id, method, path and query".into()),
    };
    if !path.starts_with('/') {
        return Err("an OPEN frame's path starts with /".into());
    }
    let mut headers = Vec::new();
    let bad = || "headers are a list of [name, value] pairs of strings".to_string();
    for pair in body
        .get("headers")
        .and_then(|value| value.as_array())
        .ok_or_else(bad)?
    {
        match pair.as_array().map(|items| items.as_slice()) {
            Some([name, value]) => match (name.as_str(), value.as_str()) {
                (Some(name), Some(value)) => headers.push((name.to_owned(), value.to_owned())),
                _ => return Err(bad()),
            },
            _ => return Err(bad()),
        }
    }
    Ok(OpenRequest {
        replica_id,
        method,
        path,
        query,
        headers,
    })
}

/// A RESPONSE frame's payload: the status and the headers (each value as Latin-1 text, as the
/// Python end decodes header bytes).
pub fn response_head(status: u16, headers: &http::HeaderMap) -> Vec<u8> {
    let pairs: Vec<serde_json::Value> = headers
        .iter()
        .filter(|(name, _)| !hop_by_hop(name.as_str()))
        .map(|(name, value)| {
            let text: String = value.as_bytes().iter().map(|&byte| byte as char).collect();
            serde_json::json!([name.as_str(), text])
        })
        .collect();
    serde_json::json!({"status": status, "headers": pairs})
        .to_string()
        .into_bytes()
}

/// Headers of one hop, never relayed (`HOP_BY_HOP` there).
pub fn hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_round_trip() {
        let mut pending = VecDeque::from(vec![encode(DATA, 3, b"abc"), encode(END, 3, b"")]);
        let decoded = decode_message(&take_batch(&mut pending)).unwrap();
        assert!(pending.is_empty());
        assert_eq!(decoded.len(), 2);
        assert_eq!(
            (decoded[0].kind, decoded[0].stream, &decoded[0].payload[..]),
            (DATA, 3, &b"abc"[..])
        );
        assert_eq!(decoded[1].kind, END);
    }

    #[test]
    fn refuses_what_the_python_end_refuses() {
        assert!(decode_message(&encode(DATA, 0, b"x")).is_err());
        assert!(decode_message(&[9, 0, 0, 0, 1]).is_err());
        assert!(decode_message(&[1, 0]).is_err());
        let inner = take_batch(&mut VecDeque::from(vec![
            encode(END, 1, b""),
            encode(END, 2, b""),
        ]));
        let nested = take_batch(&mut VecDeque::from(vec![inner, encode(END, 3, b"")]));
        assert!(decode_message(&nested).is_err());
        // A batch holds no more than MAX_BATCH bytes: the rest waits for the next message.
        let full = encode(DATA, 1, &[0; MAX_PAYLOAD]);
        let mut pending = VecDeque::from(vec![full.clone(), full.clone(), encode(END, 1, b"")]);
        assert_eq!(take_batch(&mut pending), full);
        assert_eq!(pending.len(), 2);
        // Nor more than MAX_BATCH_FRAMES frames: one more is refused whole.
        let tiny = || encode(END, 1, b"");
        let mut pending: VecDeque<Vec<u8>> = (0..MAX_BATCH_FRAMES + 1).map(|_| tiny()).collect();
        let most = take_batch(&mut pending);
        assert_eq!(decode_message(&most).unwrap().len(), MAX_BATCH_FRAMES);
        assert_eq!(pending.len(), 1);
        let mut over = most.clone();
        over.extend_from_slice(&(HEAD as u32).to_be_bytes());
        over.extend_from_slice(&tiny());
        let refused = decode_message(&over).err().unwrap();
        assert_eq!(
            refused,
            format!("a BATCH of more than {} frames", MAX_BATCH_FRAMES)
        );
        assert!(parse_open(
            br#"{"replica_id":"r","method":"GET","path":"x","query":"","headers":[]}"#
        )
        .is_err());
        let open = parse_open(
            br#"{"replica_id":"r","method":"GET","path":"/x","query":"a=1","headers":[["a","b"]]}"#,
        )
        .unwrap();
        assert_eq!(open.headers, vec![("a".to_string(), "b".to_string())]);
    }
}
