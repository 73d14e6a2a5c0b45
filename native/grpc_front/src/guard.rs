//! A budget of frames that carry nothing, per connection, kept below h2.
//!
//! `Guarded` wraps a client's socket and reads the HTTP/2 frame heads as they pass (after the
//! connection preface). A frame that carries a call forward is useful: a HEADERS that opens a
//! new stream (its id above every one seen on the connection), a DATA with data past its
//! padding or ending its stream. Every other one (PING, SETTINGS, WINDOW_UPDATE, PRIORITY,
//! CONTINUATION, a HEADERS on a stream already seen, a DATA of padding only, a type HTTP/2
//! does not know) costs one of `EMPTY_BURST` tokens, given back at `EMPTY_PER_SECOND` and
//! `EMPTY_PER_USEFUL` for each useful frame; a RST_STREAM costs `RESET_COST`, more than the
//! HEADERS it undoes earned, so opening and resetting streams spends the budget too. A
//! connection past its budget is read no more: its reads fail, so h2 drops it (a flood of
//! unknown frames, a CONTINUATION flood, resets in a burst, padding sent for data). h2's own
//! bounds cover the rest (`max_pending_accept_reset_streams`, `max_header_list_size`, ...).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Frames that carry nothing a connection may send at once...
pub const EMPTY_BURST: f64 = 1000.0;
/// ...given back at this rate...
pub const EMPTY_PER_SECOND: f64 = 200.0;
/// ...and this many for each useful frame.
pub const EMPTY_PER_USEFUL: f64 = 2.0;
/// What a RST_STREAM costs: more than a HEADERS earns, so each stream opened and reset
/// spends a token.
pub const RESET_COST: f64 = EMPTY_PER_USEFUL + 1.0;

const PREFACE: usize = 24;
const HEAD: usize = 9;
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const END_STREAM: u8 = 0x1;
const PADDED: u8 = 0x8;

/// A PADDED DATA frame whose pad length (its payload's first byte) is still to be read.
struct PaddedData {
    length: u32,
    flags: u8,
}

/// The frame heads of one direction of an HTTP/2 connection, and the budget they draw on.
pub struct FrameBudget {
    preface_left: usize,
    head: [u8; HEAD],
    head_len: usize,
    payload_left: usize,
    padded: Option<PaddedData>,
    highest_stream: u32,
    tokens: f64,
    refilled: Instant,
}

impl Default for FrameBudget {
    fn default() -> Self {
        FrameBudget {
            preface_left: PREFACE,
            head: [0; HEAD],
            head_len: 0,
            payload_left: 0,
            padded: None,
            highest_stream: 0,
            tokens: EMPTY_BURST,
            refilled: Instant::now(),
        }
    }
}

impl FrameBudget {
    /// Take in bytes read from the client; false once the budget is spent.
    pub fn read(&mut self, mut bytes: &[u8]) -> bool {
        while !bytes.is_empty() {
            if self.preface_left > 0 {
                let take = self.preface_left.min(bytes.len());
                self.preface_left -= take;
                bytes = &bytes[take..];
            } else if self.payload_left > 0 {
                if let Some(data) = self.padded.take() {
                    // The pad length: only what follows it, less the padding, is data.
                    let carried = (data.length - 1).saturating_sub(u32::from(bytes[0]));
                    if !self.judge(carried > 0 || data.flags & END_STREAM != 0, 1.0) {
                        return false;
                    }
                }
                let take = self.payload_left.min(bytes.len());
                self.payload_left -= take;
                bytes = &bytes[take..];
            } else {
                let take = (HEAD - self.head_len).min(bytes.len());
                self.head[self.head_len..self.head_len + take].copy_from_slice(&bytes[..take]);
                self.head_len += take;
                bytes = &bytes[take..];
                if self.head_len == HEAD {
                    self.head_len = 0;
                    let length = u32::from_be_bytes([0, self.head[0], self.head[1], self.head[2]]);
                    self.payload_left = length as usize;
                    let stream = u32::from_be_bytes([
                        self.head[5] & 0x7f,
                        self.head[6],
                        self.head[7],
                        self.head[8],
                    ]);
                    if !self.frame(self.head[3], self.head[4], length, stream) {
                        return false;
                    }
                }
            }
        }
        true
    }

    /// Judge a frame from its head; a PADDED DATA with a payload waits for its pad length.
    fn frame(&mut self, kind: u8, flags: u8, length: u32, stream: u32) -> bool {
        match kind {
            DATA if flags & PADDED != 0 && length > 0 => {
                self.padded = Some(PaddedData { length, flags });
                true
            }
            DATA => self.judge(length > 0 || flags & END_STREAM != 0, 1.0),
            HEADERS => {
                let opens = stream > self.highest_stream;
                self.highest_stream = self.highest_stream.max(stream);
                self.judge(opens, 1.0)
            }
            RST_STREAM => self.judge(false, RESET_COST),
            _ => self.judge(false, 1.0),
        }
    }

    /// Refill the budget for the time passed and a useful frame, or charge `cost`; false
    /// once it is spent.
    fn judge(&mut self, useful: bool, cost: f64) -> bool {
        let now = Instant::now();
        let elapsed = now.duration_since(self.refilled).as_secs_f64();
        self.refilled = now;
        let gained = elapsed * EMPTY_PER_SECOND + if useful { EMPTY_PER_USEFUL } else { 0.0 };
        self.tokens = (self.tokens + gained).min(EMPTY_BURST);
        if !useful {
            self.tokens -= cost;
        }
        self.tokens >= 0.0
    }
}

/// A client's socket whose reads draw on a `FrameBudget`.
pub struct Guarded<T> {
    inner: T,
    budget: FrameBudget,
    spent: bool,
}

impl<T> Guarded<T> {
    pub fn new(inner: T) -> Self {
        Guarded {
            inner,
            budget: FrameBudget::default(),
            spent: false,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Guarded<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.spent {
            return Poll::Ready(Err(spent()));
        }
        let before = buf.filled().len();
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(context, buf) {
            Poll::Ready(Ok(())) => {
                if !this.budget.read(&buf.filled()[before..]) {
                    this.spent = true;
                    return Poll::Ready(Err(spent()));
                }
                Poll::Ready(Ok(()))
            }
            other => other,
        }
    }
}

fn spent() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        "the client sent too many frames that carry nothing",
    )
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Guarded<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(context, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(context)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(context)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(context, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        frame_on(kind, flags, 1, payload)
    }

    fn frame_on(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let length = (payload.len() as u32).to_be_bytes();
        let mut out = vec![length[1], length[2], length[3], kind, flags];
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// Whether `bytes`, after the preface and read `split` bytes at a time, pass the budget.
    fn passes(bytes: &[u8], split: usize) -> bool {
        let mut budget = FrameBudget::default();
        assert!(budget.read(&preface()));
        bytes.chunks(split).all(|chunk| budget.read(chunk))
    }

    fn preface() -> Vec<u8> {
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec()
    }

    #[test]
    fn useful_frames_pass_however_many() {
        let mut budget = FrameBudget::default();
        assert!(budget.read(&preface()));
        for stream in (1..10_000).step_by(2) {
            assert!(budget.read(&frame_on(HEADERS, 0x4, stream, b"abc")));
            assert!(budget.read(&frame_on(DATA, 0, stream, b"payload")));
            assert!(budget.read(&frame(0x8, 0, &[0, 0, 0, 1]))); // a WINDOW_UPDATE each
                                                                 // Data behind padding is data.
            assert!(budget.read(&frame_on(DATA, PADDED, stream, &[2, b'x', 0, 0])));
            assert!(budget.read(&frame(0x8, 0, &[0, 0, 0, 1])));
        }
    }

    #[test]
    fn data_frames_of_padding_only_spend_the_budget_split_anywhere() {
        let mut flood = Vec::new();
        for _ in 0..(EMPTY_BURST as usize + 200) {
            flood.extend(frame(DATA, PADDED, &[10; 11])); // a pad length, ten bytes of padding
        }
        for split in [1, 3, 20, 1 << 20] {
            assert!(!passes(&flood, split), "split {split}");
        }
        // Padding that ends the stream ends a call: useful, as an empty DATA ending it is.
        let mut ending = Vec::new();
        for stream in (1..10_000).step_by(2) {
            ending.extend(frame_on(HEADERS, 0x4, stream, b"abc"));
            ending.extend(frame_on(DATA, PADDED | END_STREAM, stream, &[3, 0, 0, 0]));
            ending.extend(frame(0x8, 0, &[0, 0, 0, 1]));
        }
        assert!(passes(&ending, 5));
    }

    #[test]
    fn headers_earn_only_when_they_open_a_stream() {
        // Trailers, or HEADERS sent again on one stream, each beside a PING: no call goes
        // forward, so the budget runs out.
        let mut flood = Vec::new();
        for _ in 0..(EMPTY_BURST as usize + 200) {
            flood.extend(frame_on(HEADERS, 0x4 | END_STREAM, 1, b"abc"));
            flood.extend(frame(0x6, 0, &[0; 8]));
        }
        assert!(!passes(&flood, 1 << 20));
        // Streams whose ids go down are not new either.
        let mut down = Vec::new();
        for stream in (1..=(2 * EMPTY_BURST as u32 + 401)).rev().step_by(2) {
            down.extend(frame_on(HEADERS, 0x4, stream, b"abc"));
            down.extend(frame(0x6, 0, &[0; 8]));
        }
        assert!(!passes(&down, 1 << 20));
    }

    #[test]
    fn opening_and_resetting_streams_spends_the_budget() {
        let mut flood = Vec::new();
        for stream in (1..(4 * EMPTY_BURST as u32)).step_by(2) {
            flood.extend(frame_on(HEADERS, 0x4, stream, b"abc"));
            flood.extend(frame_on(RST_STREAM, 0, stream, &[0, 0, 0, 8]));
        }
        assert!(!passes(&flood, 1 << 20));
    }

    #[test]
    fn a_flood_of_frames_that_carry_nothing_spends_the_budget_split_anywhere() {
        let mut budget = FrameBudget::default();
        let mut bytes = preface();
        for _ in 0..(EMPTY_BURST as usize + 200) {
            bytes.extend(frame(0xfa, 0, b"")); // a type HTTP/2 does not know
        }
        // Read a few bytes at a time: heads split between reads are still read whole.
        let passed = bytes
            .chunks(7)
            .take_while(|chunk| budget.read(chunk))
            .count();
        assert!(passed * 7 < bytes.len());
        assert!(passed * 7 > (EMPTY_BURST as usize - 10) * HEAD);
    }

    #[tokio::test]
    async fn a_guarded_socket_fails_its_reads_past_the_budget() {
        let (client, server) = tokio::io::duplex(1 << 20);
        let mut guarded = Guarded::new(server);
        let mut client = client;
        let mut flood = preface();
        for _ in 0..(EMPTY_BURST as usize * 2) {
            flood.extend(frame(0x9, 0, b"")); // empty CONTINUATIONs
        }
        client.write_all(&flood).await.unwrap();
        let mut sink = vec![0u8; 1 << 20];
        let mut failed = None;
        for _ in 0..100 {
            match guarded.read(&mut sink).await {
                Ok(0) => break,
                Ok(_) => {}
                Err(error) => {
                    failed = Some(error.kind());
                    break;
                }
            }
        }
        assert_eq!(failed, Some(io::ErrorKind::InvalidData));
        assert!(guarded.read(&mut sink).await.is_err()); // and stays failed
    }
}
