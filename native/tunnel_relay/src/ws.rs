//! The WebSocket framing the tunnel needs (RFC 6455). The client role (the agent's relay): the
//! opening handshake with the node credential, binary messages (masked, as a client must send
//! them), ping, pong and close. The server role (the control plane's front, which took the
//! handshake itself): frames sent unmasked, frames read masked (`Reader::server`). No extension
//! is offered or accepted; a text message is handed up for the tunnel to refuse.

use std::fs::File;
use std::io::Read;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
/// The most a handshake answer's head may take.
const MAX_HEAD: usize = 16 * 1024;

pub const OP_CONTINUATION: u8 = 0;
pub const OP_TEXT: u8 = 1;
pub const OP_BINARY: u8 = 2;
pub const OP_CLOSE: u8 = 8;
pub const OP_PING: u8 = 9;
pub const OP_PONG: u8 = 10;

#[derive(Debug)]
pub enum WsError {
    /// The connection failed or closed (the reason, for the logs).
    Io(String),
    /// The server answered the handshake with this HTTP status.
    Refused(u16),
    /// The peer broke the protocol.
    Protocol(String),
}

impl From<std::io::Error> for WsError {
    fn from(error: std::io::Error) -> Self {
        WsError::Io(format!("{:?}", error.kind()))
    }
}

/// Bytes from the kernel's random source, read a block at a time (the masking keys and the
/// handshake's key: RFC 6455 asks for a strong source for both).
pub struct Entropy {
    source: File,
    block: [u8; 4096],
    used: usize,
}

impl Entropy {
    pub fn open() -> std::io::Result<Entropy> {
        Ok(Entropy {
            source: File::open("/dev/urandom")?,
            block: [0; 4096],
            used: 4096,
        })
    }

    pub fn fill(&mut self, out: &mut [u8]) -> std::io::Result<()> {
        for byte in out.iter_mut() {
            if self.used == self.block.len() {
                self.source.read_exact(&mut self.block)?;
                self.used = 0;
            }
            *byte = self.block[self.used];
            self.used += 1;
        }
        Ok(())
    }
}

/// Open the WebSocket on `io`: send the upgrade for `path` with `authorization`, check the
/// answer. Returns the bytes read past the answer's head (the first frames, if any came).
pub async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    io: &mut S,
    host: &str,
    path: &str,
    authorization: &str,
    entropy: &mut Entropy,
) -> Result<Vec<u8>, WsError> {
    let mut nonce = [0u8; 16];
    entropy.fill(&mut nonce)?;
    let key = base64(&nonce);
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: {}\r\nSec-WebSocket-Version: 13\r\nAuthorization: {}\r\n\
         User-Agent: modelforge-tunnel-relay\r\n\r\n",
        path, host, key, authorization
    );
    io.write_all(request.as_bytes()).await?;
    let mut buffer = Vec::with_capacity(1024);
    let end = loop {
        if let Some(at) = find(&buffer, b"\r\n\r\n") {
            break at;
        }
        if buffer.len() > MAX_HEAD {
            return Err(WsError::Protocol(
                "the handshake's answer is too long".into(),
            ));
        }
        let mut chunk = [0u8; 2048];
        let read = io.read(&mut chunk).await?;
        if read == 0 {
            return Err(WsError::Io("closed during the handshake".into()));
        }
        buffer.extend_from_slice(&chunk[..read]);
    };
    let head = String::from_utf8_lossy(&buffer[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or("");
    let status: u16 = parts.next().unwrap_or("").parse().unwrap_or(0);
    if !version.starts_with("HTTP/1.") || status == 0 {
        return Err(WsError::Protocol(
            "the handshake's answer is not HTTP/1.1".into(),
        ));
    }
    if status != 101 {
        return Err(WsError::Refused(status));
    }
    let expected = base64(&sha1(format!("{}{}", key, GUID).as_bytes()));
    let mut accepted = false;
    for line in lines {
        let mut pair = line.splitn(2, ':');
        let name = pair.next().unwrap_or("").trim().to_ascii_lowercase();
        let value = pair.next().unwrap_or("").trim();
        match name.as_str() {
            "sec-websocket-accept" => accepted = value == expected,
            "sec-websocket-extensions" if !value.is_empty() => {
                return Err(WsError::Protocol(
                    "the server chose an extension not offered".into(),
                ))
            }
            _ => {}
        }
    }
    if !accepted {
        return Err(WsError::Protocol(
            "the handshake's Sec-WebSocket-Accept is wrong".into(),
        ));
    }
    Ok(buffer[end + 4..].to_vec())
}

/// One frame as a client sends it: final, masked.
pub fn encode_frame(opcode: u8, payload: &[u8], entropy: &mut Entropy) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(payload.len() + 14);
    out.push(0x80 | opcode);
    let size = payload.len();
    if size < 126 {
        out.push(0x80 | size as u8);
    } else if size <= 0xFFFF {
        out.push(0x80 | 126);
        out.extend_from_slice(&(size as u16).to_be_bytes());
    } else {
        out.push(0x80 | 127);
        out.extend_from_slice(&(size as u64).to_be_bytes());
    }
    let mut mask = [0u8; 4];
    entropy.fill(&mut mask)?;
    out.extend_from_slice(&mask);
    let start = out.len();
    out.extend_from_slice(payload);
    for (index, byte) in out[start..].iter_mut().enumerate() {
        *byte ^= mask[index & 3];
    }
    Ok(out)
}

/// The head of one frame as a server sends it (final, unmasked) for a payload of `size` bytes,
/// appended to `out`; the payload follows it.
#[allow(dead_code)] // the server role: the gateway front's
pub fn server_head(opcode: u8, size: usize, out: &mut Vec<u8>) {
    out.push(0x80 | opcode);
    if size < 126 {
        out.push(size as u8);
    } else if size <= 0xFFFF {
        out.push(126);
        out.extend_from_slice(&(size as u16).to_be_bytes());
    } else {
        out.push(127);
        out.extend_from_slice(&(size as u64).to_be_bytes());
    }
}

/// One frame as a server sends it: final, unmasked.
#[allow(dead_code)] // the server role: the gateway front's
pub fn encode_server_frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 10);
    server_head(opcode, payload.len(), &mut out);
    out.extend_from_slice(payload);
    out
}

/// `data` XORed with the masking `key` (RFC 6455 section 5.3), a word at a time.
fn unmask(data: &mut [u8], key: [u8; 4]) {
    let word = u64::from_ne_bytes([
        key[0], key[1], key[2], key[3], key[0], key[1], key[2], key[3],
    ]);
    let mut words = data.chunks_exact_mut(8);
    for chunk in &mut words {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(chunk);
        chunk.copy_from_slice(&(u64::from_ne_bytes(raw) ^ word).to_ne_bytes());
    }
    // The rest starts at a multiple of 8: the key's phase is 0 again.
    for (index, byte) in words.into_remainder().iter_mut().enumerate() {
        *byte ^= key[index & 3];
    }
}

/// One whole message (or control frame) from the peer.
pub struct Message {
    pub opcode: u8,
    pub payload: Vec<u8>,
}

/// Reads the peer's frames into messages, at most `max_message` bytes each: a server's
/// (unmasked: `new`) or a client's (masked, as RFC 6455 requires: `server`).
pub struct Reader<R> {
    io: R,
    buffer: Vec<u8>,
    /// Where the unread part of `buffer` starts (what was read is dropped at the next read).
    start: usize,
    /// Where each read lands (one allocation for the connection's life).
    scratch: Vec<u8>,
    max_message: usize,
    /// The peer is a client: its frames must be masked (else they must not be).
    masked: bool,
}

impl<R: AsyncRead + Unpin> Reader<R> {
    /// The client role: reads a server's frames (unmasked).
    pub fn new(io: R, already: Vec<u8>, max_message: usize) -> Reader<R> {
        Reader {
            io,
            buffer: already,
            start: 0,
            scratch: vec![0u8; 64 * 1024],
            max_message,
            masked: false,
        }
    }

    /// The server role: reads a client's frames (masked; an unmasked one is a protocol error).
    #[allow(dead_code)] // the server role: the gateway front's
    pub fn server(io: R, already: Vec<u8>, max_message: usize) -> Reader<R> {
        Reader {
            masked: true,
            ..Reader::new(io, already, max_message)
        }
    }

    /// At least `wanted` unread bytes in `buffer`, from `start`.
    async fn fill(&mut self, wanted: usize) -> Result<(), WsError> {
        while self.buffer.len() - self.start < wanted {
            if self.start > 0 {
                // Only the start of a frame is left: moved to the front before reading on.
                self.buffer.drain(..self.start);
                self.start = 0;
            }
            let read = self.io.read(&mut self.scratch).await?;
            if read == 0 {
                return Err(WsError::Io("closed".into()));
            }
            self.buffer.extend_from_slice(&self.scratch[..read]);
        }
        Ok(())
    }

    /// The next frame: (final, opcode, payload).
    async fn frame(&mut self) -> Result<(bool, u8, Vec<u8>), WsError> {
        self.fill(2).await?;
        let (first, second) = (self.buffer[self.start], self.buffer[self.start + 1]);
        if first & 0x70 != 0 {
            return Err(WsError::Protocol("a frame with reserved bits set".into()));
        }
        if second & 0x80 != 0 && !self.masked {
            return Err(WsError::Protocol("a masked frame from the server".into()));
        }
        if second & 0x80 == 0 && self.masked {
            return Err(WsError::Protocol(
                "an unmasked frame from the client".into(),
            ));
        }
        let (fin, opcode) = (first & 0x80 != 0, first & 0x0F);
        let (size, at) = match second & 0x7F {
            126 => {
                self.fill(4).await?;
                let at = self.start + 2;
                (
                    u16::from_be_bytes([self.buffer[at], self.buffer[at + 1]]) as usize,
                    4,
                )
            }
            127 => {
                self.fill(10).await?;
                let mut raw = [0u8; 8];
                raw.copy_from_slice(&self.buffer[self.start + 2..self.start + 10]);
                let size = u64::from_be_bytes(raw);
                if size > self.max_message as u64 {
                    return Err(WsError::Protocol("a message over the size limit".into()));
                }
                (size as usize, 10)
            }
            small => (small as usize, 2),
        };
        if size > self.max_message {
            return Err(WsError::Protocol("a message over the size limit".into()));
        }
        if opcode >= 8 && (!fin || size > 125) {
            return Err(WsError::Protocol(
                "a fragmented or long control frame".into(),
            ));
        }
        let at = if self.masked { at + 4 } else { at };
        self.fill(at + size).await?;
        let begin = self.start + at;
        let mut payload = self.buffer[begin..begin + size].to_vec();
        if self.masked {
            let mut key = [0u8; 4];
            key.copy_from_slice(&self.buffer[begin - 4..begin]);
            unmask(&mut payload, key);
        }
        self.start = begin + size;
        if self.start == self.buffer.len() {
            self.buffer.clear();
            self.start = 0;
        }
        Ok((fin, opcode, payload))
    }

    /// The next message; control frames come as they arrive, between a message's pieces.
    pub async fn message(
        &mut self,
        partial: &mut Option<(u8, Vec<u8>)>,
    ) -> Result<Message, WsError> {
        loop {
            let (fin, opcode, payload) = self.frame().await?;
            if opcode >= 8 {
                return Ok(Message { opcode, payload });
            }
            match (opcode, partial.take()) {
                (OP_CONTINUATION, None) => {
                    return Err(WsError::Protocol("a continuation of no message".into()))
                }
                (OP_CONTINUATION, Some((kind, mut so_far))) => {
                    if so_far.len() + payload.len() > self.max_message {
                        return Err(WsError::Protocol("a message over the size limit".into()));
                    }
                    so_far.extend_from_slice(&payload);
                    if fin {
                        return Ok(Message {
                            opcode: kind,
                            payload: so_far,
                        });
                    }
                    *partial = Some((kind, so_far));
                }
                (_, Some(_)) => {
                    return Err(WsError::Protocol("a new message inside another".into()))
                }
                (OP_TEXT, None) | (OP_BINARY, None) => {
                    if fin {
                        return Ok(Message { opcode, payload });
                    }
                    *partial = Some((opcode, payload));
                }
                _ => return Err(WsError::Protocol(format!("an unknown opcode {}", opcode))),
            }
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

#[allow(clippy::manual_div_ceil)] // usize::div_ceil is newer than Debian 12's rustc 1.63
pub fn base64(data: &[u8]) -> String {
    let mut out = String::with_capacity((data.len() + 2) / 3 * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        for index in 0..4 {
            if index <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * index) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// SHA-1 (FIPS 180-4), for the handshake's Sec-WebSocket-Accept only (RFC 6455 names it).
pub fn sha1(data: &[u8]) -> [u8; 20] {
    let mut h: [u32; 5] = [0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476, 0xC3D2E1F0];
    let mut message = data.to_vec();
    message.push(0x80);
    while message.len() % 64 != 56 {
        message.push(0);
    }
    message.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in message.chunks(64) {
        let mut w = [0u32; 80];
        for (index, word) in block.chunks(4).enumerate() {
            w[index] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for index in 16..80 {
            w[index] = (w[index - 3] ^ w[index - 8] ^ w[index - 14] ^ w[index - 16]).rotate_left(1);
        }
        let (mut a, mut b, mut c, mut d, mut e) = (h[0], h[1], h[2], h[3], h[4]);
        for (index, word) in w.iter().enumerate() {
            let (f, k) = match index {
                0..=19 => ((b & c) | (!b & d), 0x5A827999),
                20..=39 => (b ^ c ^ d, 0x6ED9EBA1),
                40..=59 => ((b & c) | (b & d) | (c & d), 0x8F1BBCDC),
                _ => (b ^ c ^ d, 0xCA62C1D6),
            };
            let next = a
                .rotate_left(5)
                .wrapping_add(f)
                .wrapping_add(e)
                .wrapping_add(k)
                .wrapping_add(*word);
            e = d;
            d = c;
            c = b.rotate_left(30);
            b = a;
            a = next;
        }
        h[0] = h[0].wrapping_add(a);
        h[1] = h[1].wrapping_add(b);
        h[2] = h[2].wrapping_add(c);
        h[3] = h[3].wrapping_add(d);
        h[4] = h[4].wrapping_add(e);
    }
    let mut out = [0u8; 20];
    for (index, word) in h.iter().enumerate() {
        out[index * 4..index * 4 + 4].copy_from_slice(&word.to_be_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc_6455_accept_example() {
        // RFC 6455 section 1.3's example key and accept value.
        let accept = base64(&sha1(
            format!("dGhlIHNhbXBsZSBub25jZQ=={}", GUID).as_bytes(),
        ));
        assert_eq!(accept, "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
    }

    #[test]
    fn unmask_matches_the_bytewise_xor() {
        let key = [0x12, 0x34, 0x56, 0x78];
        for size in [0, 1, 7, 8, 9, 13, 64, 100] {
            let data: Vec<u8> = (0..size).map(|index| index as u8).collect();
            let mut fast = data.clone();
            unmask(&mut fast, key);
            let slow: Vec<u8> = data
                .iter()
                .enumerate()
                .map(|(index, byte)| byte ^ key[index & 3])
                .collect();
            assert_eq!(fast, slow);
        }
    }

    #[tokio::test]
    async fn server_role_reads_masked_frames_and_refuses_unmasked_ones() {
        let mut entropy = Entropy::open().unwrap();
        let mut wire = Vec::new();
        wire.extend(encode_frame(OP_BINARY, &[7u8; 300], &mut entropy).unwrap());
        wire.extend(encode_frame(OP_PING, b"hi", &mut entropy).unwrap());
        wire.extend(encode_server_frame(OP_BINARY, b"x"));
        let mut reader = Reader::server(&wire[..], Vec::new(), 1024);
        let mut partial = None;
        let first = reader.message(&mut partial).await.unwrap();
        assert_eq!((first.opcode, first.payload), (OP_BINARY, vec![7u8; 300]));
        let ping = reader.message(&mut partial).await.unwrap();
        assert_eq!((ping.opcode, &ping.payload[..]), (OP_PING, &b"hi"[..]));
        assert!(matches!(
            reader.message(&mut partial).await,
            Err(WsError::Protocol(_))
        ));
        // The client role reads what the server role writes, and refuses masked frames.
        let mut wire = encode_server_frame(OP_BINARY, &[1u8; 70000]);
        wire.extend(encode_frame(OP_BINARY, b"y", &mut entropy).unwrap());
        let mut reader = Reader::new(&wire[..], Vec::new(), 100_000);
        let big = reader.message(&mut partial).await.unwrap();
        assert_eq!(big.payload, vec![1u8; 70000]);
        assert!(matches!(
            reader.message(&mut partial).await,
            Err(WsError::Protocol(_))
        ));
    }

    #[test]
    fn sha1_of_abc_and_base64_padding() {
        let digest = sha1(b"abc");
        assert_eq!(digest[..4], [0xA9, 0x99, 0x3E, 0x36]);
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
    }
}
