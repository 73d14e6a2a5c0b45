//! `modelforge-tunnel-relay`: the node agent's end of the gateway's tunnel (issue 27), outside
//! Python. The agent starts it and talks to it in JSON lines:
//!
//! - stdin, first line: `{"connect_host", "connect_port", "host_header", "path", "credential",
//!   "local_host", "max_streams", "tls"}` (`tls`: null for `http://`, else `{"server_name",
//!   "verify", "ca_cert_path"}`; the credential only ever travels here: never in arguments, the
//!   environment, or a log line); then `{"ports": {replica id: port}}` whenever the
//!   replicas' local ports change. The end of stdin closes the tunnel (1001) and ends the relay.
//! - stdout: `{"connected": true, "connections": n}` / `{"connected": false}` as the tunnel
//!   opens and closes, `{"in_flight": {replica id: n}}` as the requests in flight change (a
//!   draining replica's drain ends at 0), `{"want_ports": true}` for an unknown replica id.
//! - stderr: log lines, `<level> <message>`, with no credential, header or body in them.
//!
//! It keeps one tunnel open, reconnecting with backoff (1 s doubling to 16 s, with jitter) after
//! any loss, as the Python end (`node_agent/tunnel.py`) does; the wire protocol is
//! `modelforge_contracts/tunnel.py`'s.

mod frames;
mod relay;
mod tls;
mod ws;

use std::collections::HashMap;
use std::io::BufRead;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::client::HttpConnector;
use hyper::Client;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::sync::mpsc::unbounded_channel;
use tokio::sync::{watch, Notify};

use relay::{log, Shared};
use ws::{Entropy, WsError};

const BACKOFF_FIRST: f64 = 1.0;
const BACKOFF_MAX: f64 = 16.0;

fn fail(message: &str) -> ! {
    log("error", message);
    std::process::exit(2);
}

fn main() {
    let mut line = String::new();
    if std::io::stdin().lock().read_line(&mut line).unwrap_or(0) == 0 {
        fail("no configuration on stdin");
    }
    let config: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|_| fail("the configuration line is not JSON"));
    let text = |name: &str| -> String {
        match config.get(name).and_then(|value| value.as_str()) {
            Some(value) => value.to_string(),
            None => fail(&format!("the configuration has no {}", name)),
        }
    };
    let number = |name: &str| -> u64 {
        match config.get(name).and_then(|value| value.as_u64()) {
            Some(value) => value,
            None => fail(&format!("the configuration has no {}", name)),
        }
    };
    let (out, mut lines) = unbounded_channel::<String>();
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    let tls = match config.get("tls") {
        None | Some(serde_json::Value::Null) => None,
        Some(settings) => {
            let server_name = settings
                .get("server_name")
                .and_then(|value| value.as_str())
                .unwrap_or("");
            let verify = settings
                .get("verify")
                .and_then(|value| value.as_bool())
                .unwrap_or(true);
            let ca = settings
                .get("ca_cert_path")
                .and_then(|value| value.as_str());
            match tls::configure(server_name, verify, ca) {
                Ok(tls) => Some(tls),
                Err(reason) => fail(&format!("TLS: {}", reason)),
            }
        }
    };
    let shared = Arc::new(Shared {
        connect_host: text("connect_host"),
        connect_port: number("connect_port") as u16,
        host_header: text("host_header"),
        path: text("path"),
        authorization: format!("Bearer {}", text("credential")),
        local_host: text("local_host"),
        max_streams: number("max_streams") as usize,
        tls,
        ports: Mutex::new(HashMap::new()),
        ports_changed: Notify::new(),
        in_flight: Mutex::new(HashMap::new()),
        in_flight_changed: Notify::new(),
        peak_buffered: std::sync::atomic::AtomicI64::new(0),
        out,
        client: Client::builder()
            .pool_idle_timeout(Duration::from_secs(4))
            .pool_max_idle_per_host(64)
            .build(connector.clone()),
        // A connection of its own for a request tried again (`relay::closed_unanswered`).
        fresh: Client::builder().pool_max_idle_per_host(0).build(connector),
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|_| fail("cannot start the runtime"));
    runtime.block_on(async move {
        tokio::spawn(async move {
            let mut stdout = tokio::io::stdout();
            while let Some(mut line) = lines.recv().await {
                line.push('\n');
                if stdout.write_all(line.as_bytes()).await.is_err() || stdout.flush().await.is_err()
                {
                    return;
                }
            }
        });
        let (stop_tx, stop) = watch::channel(false);
        let control = shared.clone();
        tokio::spawn(async move {
            let mut input = tokio::io::BufReader::new(tokio::io::stdin()).lines();
            while let Ok(Some(line)) = input.next_line().await {
                let message: serde_json::Value = match serde_json::from_str(&line) {
                    Ok(message) => message,
                    Err(_) => {
                        log("warning", "a control line that is not JSON; ignored");
                        continue;
                    }
                };
                if let Some(ports) = message.get("ports").and_then(|value| value.as_object()) {
                    let map = ports
                        .iter()
                        .filter_map(|(id, port)| {
                            port.as_u64().map(|port| (id.clone(), port as u16))
                        })
                        .collect();
                    *control.ports.lock().unwrap() = map;
                    control.ports_changed.notify_waiters();
                }
            }
            let _ = stop_tx.send(true);
        });
        let reporter = shared.clone();
        tokio::spawn(async move {
            loop {
                reporter.in_flight_changed.notified().await;
                // Changes within a few milliseconds go as one line.
                tokio::time::sleep(Duration::from_millis(5)).await;
                let counts = reporter.in_flight.lock().unwrap().clone();
                let peak = reporter
                    .peak_buffered
                    .load(std::sync::atomic::Ordering::Acquire);
                let line =
                    serde_json::json!({ "in_flight": counts, "peak_buffered": peak }).to_string();
                if reporter.out.send(line).is_err() {
                    return;
                }
            }
        });
        connect_forever(&shared, stop).await;
    });
}

async fn connect_forever(shared: &Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let mut backoff = BACKOFF_FIRST;
    let mut failing = false;
    let mut opened: u64 = 0;
    let mut jitter = Entropy::open().unwrap_or_else(|_| fail("cannot read /dev/urandom"));
    while !*stop.borrow() {
        match relay::session(shared, &mut stop, &mut opened).await {
            Ok(()) if *stop.borrow() => break,
            Ok(()) => {
                log("info", "the tunnel closed; opening it again");
                failing = false;
                backoff = BACKOFF_FIRST;
            }
            Err(WsError::Refused(status)) => {
                if !failing {
                    log(
                        "warning",
                        &format!("the control plane refused the tunnel (HTTP {})", status),
                    );
                }
                failing = true;
            }
            Err(WsError::Io(kind)) | Err(WsError::Protocol(kind)) => {
                if !failing {
                    log(
                        "warning",
                        &format!("the tunnel is down ({}); retrying", kind),
                    );
                }
                failing = true;
            }
        }
        if *stop.borrow() {
            break;
        }
        let mut random = [0u8; 1];
        let _ = jitter.fill(&mut random);
        let pause = backoff * (0.5 + random[0] as f64 / 510.0);
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs_f64(pause)) => {}
            _ = stop.changed() => break,
        }
        backoff = (backoff * 2.0).min(BACKOFF_MAX);
    }
}
