//! The pass-through to the control plane's own server (Granian, on loopback): every request that
//! is neither the gateway's nor a tunnel goes there as it came, but for the client's address,
//! the scheme it used and the front's key (`proxy`).
//!
//! The server may answer before it has read a request's body, and then close the connection
//! with the body unread: the API refuses a body from its `Content-Length` (413) without reading
//! it. The kernel then resets the connection, and the front's send fails while the answer is
//! already on its way back. hyper's client takes a failed send for the request's failure, so the
//! client would get 502 in place of the server's 413, depending on which it noticed first. The
//! connections here (`Upstream`, `Answering`) report a send the server refused as done and
//! drop what follows, so hyper goes on reading and hands on the answer. A server that refused
//! the send without answering still fails the request: its reset ends the read as well (502).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::client::connect::{Connected, Connection};
use hyper::client::HttpConnector;
use hyper::header::{self, HeaderValue};
use hyper::http::uri::{PathAndQuery, Scheme};
use hyper::service::Service;
use hyper::{Body, Request, Response, StatusCode, Uri};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::{
    error_answer, push_address, Front, FrontBody, CLIENT_HEADER, KEY_HEADER, SCHEME_HEADER,
};

/// hyper's connector to the server, its connections `Answering`.
#[derive(Clone)]
pub struct Upstream(HttpConnector);

impl Upstream {
    pub fn new(connector: HttpConnector) -> Upstream {
        Upstream(connector)
    }
}

type Connecting = Pin<Box<dyn Future<Output = Result<Answering, io::Error>> + Send>>;

impl Service<Uri> for Upstream {
    type Response = Answering;
    type Error = io::Error;
    type Future = Connecting;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), io::Error>> {
        self.0.poll_ready(cx).map_err(io::Error::other)
    }

    fn call(&mut self, target: Uri) -> Connecting {
        let connecting = self.0.call(target);
        Box::pin(async move {
            match connecting.await {
                Ok(stream) => Ok(Answering {
                    stream,
                    send_refused: false,
                }),
                Err(error) => Err(io::Error::other(error)),
            }
        })
    }
}

/// A connection to the server whose refused send does not hide the server's answer (see the
/// module's docs): once the server has reset or closed its end for reading, what is written is
/// dropped and reported as written, while reading goes on as before.
pub struct Answering {
    stream: TcpStream,
    send_refused: bool,
}

/// The errors of a send the server refused by closing (its answer may still be there to read).
fn refused(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
    )
}

impl Answering {
    fn sent<T>(&mut self, result: Poll<io::Result<T>>, done: T) -> Poll<io::Result<T>> {
        match result {
            Poll::Ready(Err(error)) if refused(&error) => {
                self.send_refused = true;
                Poll::Ready(Ok(done))
            }
            other => other,
        }
    }
}

impl AsyncRead for Answering {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Answering {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.send_refused {
            return Poll::Ready(Ok(buf.len()));
        }
        let result = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.sent(result, buf.len())
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let all = bufs.iter().map(|buf| buf.len()).sum();
        if self.send_refused {
            return Poll::Ready(Ok(all));
        }
        let result = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.sent(result, all)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.send_refused {
            return Poll::Ready(Ok(()));
        }
        let result = Pin::new(&mut self.stream).poll_flush(cx);
        self.sent(result, ())
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.send_refused {
            return Poll::Ready(Ok(()));
        }
        let result = Pin::new(&mut self.stream).poll_shutdown(cx);
        self.sent(result, ())
    }
}

impl Connection for Answering {
    fn connected(&self) -> Connected {
        self.stream.connected()
    }
}

/// Pass a request to the control plane's server, as it came but for the client's address and
/// the front's key; an upgrade it accepts (101) is joined through.
pub async fn proxy(
    front: &Front,
    mut request: Request<Body>,
    peer: SocketAddr,
) -> Response<FrontBody> {
    let headers = request.headers_mut();
    // `insert` replaces whatever the client sent under these names.
    let mut address = String::with_capacity(48);
    push_address(&mut address, peer);
    if let Ok(client) = HeaderValue::from_maybe_shared(Bytes::from(address)) {
        headers.insert(CLIENT_HEADER, client);
    }
    headers.insert(
        SCHEME_HEADER,
        HeaderValue::from_static(front.config.scheme()),
    );
    headers.insert(KEY_HEADER, front.config.front_key.clone());
    let client_upgrade = if headers.contains_key(header::UPGRADE) {
        Some(hyper::upgrade::on(&mut request))
    } else {
        None
    };
    let mut parts = std::mem::take(request.uri_mut()).into_parts();
    parts.scheme = Some(Scheme::HTTP);
    parts.authority = Some(front.config.upstream.clone());
    if parts.path_and_query.is_none() {
        parts.path_and_query = Some(PathAndQuery::from_static("/"));
    }
    match Uri::from_parts(parts) {
        Ok(uri) => *request.uri_mut() = uri,
        Err(_) => return error_answer(front, StatusCode::BAD_REQUEST, "a malformed target", true),
    }
    let mut response = match front.client.request(request).await {
        Ok(response) => response,
        Err(_) => {
            return error_answer(
                front,
                StatusCode::BAD_GATEWAY,
                "the control plane's API is not reachable yet; retry in a few seconds",
                false,
            )
        }
    };
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client_upgrade) = client_upgrade {
            let upstream_upgrade = hyper::upgrade::on(&mut response);
            tokio::spawn(async move {
                if let (Ok(mut client), Ok(mut upstream)) =
                    (client_upgrade.await, upstream_upgrade.await)
                {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                }
            });
        }
    }
    response.map(FrontBody::Hyper)
}
#[cfg(test)]
mod tests {
    use super::*;
    use hyper::Client;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A server that answers 413 from the request's head and closes with the body unread (the
    /// kernel resets the connection), as the API does with a body over its limit.
    async fn refusing_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match socket.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let answer: &[u8] = b"HTTP/1.1 413 Payload Too Large\r\n\
                        content-length: 8\r\nconnection: close\r\n\r\ntoo long";
                    let _ = socket.write_all(answer).await;
                    drop(socket); // body unread: a reset, not a FIN
                });
            }
        });
        address
    }

    /// A 64 MiB request body, sent as fast as it is taken.
    fn big_body() -> Body {
        let (mut sender, body) = Body::channel();
        tokio::spawn(async move {
            let chunk = Bytes::from(vec![b'0'; 64 * 1024]);
            for _ in 0..(64 * 16) {
                if sender.send_data(chunk.clone()).await.is_err() {
                    return;
                }
            }
        });
        body
    }

    async fn send_big(client: &Client<Upstream, Body>, address: SocketAddr) -> StatusCode {
        let request = Request::post(format!("http://{}/api/v1/jobs", address))
            .header(header::CONTENT_LENGTH, 64 * 1024 * 64 * 16)
            .body(big_body())
            .unwrap();
        let response = tokio::time::timeout(Duration::from_secs(10), client.request(request))
            .await
            .expect("an answer within 10 s")
            .expect("the server's answer, not the broken send");
        response.status()
    }

    #[tokio::test]
    async fn an_answer_given_before_the_body_is_read_reaches_the_client() {
        let address = refusing_server().await;
        let client = Client::builder().build(Upstream::new(HttpConnector::new()));
        for _ in 0..20 {
            assert_eq!(
                send_big(&client, address).await,
                StatusCode::PAYLOAD_TOO_LARGE
            );
        }
    }

    #[tokio::test]
    async fn a_server_that_resets_without_answering_fails_the_request() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = socket.read(&mut buf).await;
            drop(socket); // reset: nothing answered
        });
        let client = Client::builder().build(Upstream::new(HttpConnector::new()));
        let request = Request::post(format!("http://{}/x", address))
            .header(header::CONTENT_LENGTH, 64 * 1024 * 64 * 16)
            .body(big_body())
            .unwrap();
        let outcome = tokio::time::timeout(Duration::from_secs(10), client.request(request))
            .await
            .expect("an outcome within 10 s");
        assert!(outcome.is_err(), "a reset without an answer is a failure");
    }
}
