//! The fast path: gateway requests the control plane's decisions already cover, carried without
//! asking it (as the control plane's own agent fast path answers what it is sure of and hands
//! the rest on).
//!
//! The control plane pushes what it decided and keeps deciding (`control_plane/api/
//! gateway_native.py`):
//! - `routes`: each service with replicas in its rotation (warm, on a live node, not
//!   draining), but an LLM service (each of its calls is counted and limited there): its name,
//!   id, kind, the model's path on its replicas, and the replicas with their nodes. Sent when it changes (checked ten times a second), so a replica that leaves
//!   the rotation stops getting fast-path requests within about 0.1 s.
//! - with a grant (`request`'s reply), `auth`: this `Authorization` value opens this service
//!   for `ttl` seconds (only for a token without a rate limit: a limited token's every request
//!   goes to the control plane's bucket). Past the ttl the next request is asked again, so a
//!   revoked token stops as it does in Python, and the token's last use is recorded.
//!
//! A request takes the fast path only when all of it is covered: `POST /v2/models/{name}/infer`
//! of an `onnx` service or `/services/{name}/{path}` of any, the name plain (no `%`), a
//! remembered `Authorization` for that service, fewer than the service's limit in flight here,
//! a body no larger than the limit by its length, the headers within the gateway's bounds and
//! each one visible ASCII. Anything else is asked (`gateway.rs`): the answer is then the
//! control plane's, exactly. On the fast path the replica is the one with the fewest requests
//! outstanding (ties in turn); a transport failure before the answer tries one other replica
//! while the body can be replayed, else 502, as the control plane does.
//!
//! What happened is reported four times a second (`stats`): each answer's status and seconds,
//! the errors by cause, and the requests in flight per service (the control plane's metrics,
//! its autoscaling's traffic, and its per-service limit count them).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper::header::{self, HeaderMap};
use hyper::{Body, Method, Request};
use serde_json::Value;

use crate::control::{self, Control};
use crate::frames;

/// The most header bytes (names and values) a gateway request may bring (`MAX_HEADER_BYTES`).
const MAX_HEADER_BYTES: usize = 12 * 1024;
/// Remembered `Authorization` values at most; past it, all are forgotten.
const MAX_GRANTS: usize = 10_000;
/// How often what happened is reported.
const STATS_EVERY: Duration = Duration::from_millis(250);
/// The control plane's own headers start so: none crosses to a replica.
const INTERNAL_HEADER: &str = "x-modelforge-";

/// One service as the control plane routes it now.
struct Route {
    id: String,
    /// `onnx` (reached at `/v2/models/{name}/infer`) or `command`.
    onnx: bool,
    /// The model's path on its replicas' servers (`/v2/models/{encoded model name}`).
    model_path: String,
    /// (replica id, node id) of each replica in the rotation.
    replicas: Vec<(String, String)>,
    /// Requests the fast path may carry at once for it.
    limit: u32,
}

/// A remembered `Authorization` value: which service it opens, until when.
struct Grant {
    service: String,
    until: Instant,
}

/// What happened to one service's requests since the last report.
#[derive(Default)]
struct Stats {
    id: String,
    /// (status, seconds) of each answer.
    answers: Vec<(u16, f64)>,
    errors: HashMap<&'static str, u32>,
    in_flight: u32,
    reported_in_flight: u32,
}

#[derive(Default)]
struct State {
    routes: HashMap<String, Route>,
    grants: HashMap<String, Grant>,
    /// Requests outstanding per replica (the fast path's own).
    outstanding: HashMap<String, u32>,
    turn: usize,
    stats: HashMap<String, Stats>,
}

/// The fast path's memory (one per process).
#[derive(Default)]
pub struct Fast {
    state: Mutex<State>,
}

/// A request the fast path takes: where it goes, and how to open it on a replica.
pub struct Plan {
    pub service: String,
    method: String,
    path: String,
    query: String,
    /// The headers that cross, already JSON-encoded as the OPEN frame's `"headers"` value.
    headers_json: String,
    /// Read the body first and send it with the OPEN (its length fits one frame).
    pub whole: bool,
}

/// One attempt's place: the replica, its node and the OPEN frame's payload.
pub struct Choice {
    pub replica: String,
    pub node: String,
    pub open: Vec<u8>,
}

impl Fast {
    /// The control plane's `routes` (replacing what it said before).
    pub fn set_routes(&self, message: &Value) {
        let mut routes = HashMap::new();
        if let Some(services) = message.get("services").and_then(Value::as_array) {
            for service in services {
                let text = |name: &str| {
                    service
                        .get(name)
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string()
                };
                let replicas = service
                    .get("replicas")
                    .and_then(Value::as_array)
                    .map(|pairs| {
                        pairs
                            .iter()
                            .filter_map(|pair| {
                                let id = pair.get(0)?.as_str()?;
                                let node = pair.get(1)?.as_str()?;
                                Some((id.to_string(), node.to_string()))
                            })
                            .collect::<Vec<_>>()
                    })
                    .unwrap_or_default();
                let limit = service.get("limit").and_then(Value::as_u64).unwrap_or(0) as u32;
                if replicas.is_empty() || limit == 0 {
                    continue;
                }
                routes.insert(
                    text("name"),
                    Route {
                        id: text("id"),
                        onnx: text("kind") == "onnx",
                        model_path: text("model_path"),
                        replicas,
                        limit,
                    },
                );
            }
        }
        self.state.lock().unwrap().routes = routes;
    }

    /// Forget every decision (the control channel was lost: the control plane that comes back
    /// says again what stands).
    pub fn forget(&self) {
        let mut state = self.state.lock().unwrap();
        state.routes.clear();
        state.grants.clear();
    }

    /// A grant's `auth`: `authorization` opens `service` for `ttl` seconds.
    pub fn remember(&self, authorization: &str, auth: &Value) {
        let service = match auth.get("service").and_then(Value::as_str) {
            Some(service) => service.to_string(),
            None => return,
        };
        let ttl = auth.get("ttl").and_then(Value::as_f64).unwrap_or(0.0);
        if !(ttl > 0.0 && ttl <= 60.0) {
            return;
        }
        let mut state = self.state.lock().unwrap();
        if state.grants.len() >= MAX_GRANTS {
            state.grants.clear();
        }
        let until = Instant::now() + Duration::from_secs_f64(ttl);
        state
            .grants
            .insert(authorization.to_string(), Grant { service, until });
    }

    /// The plan for `request` when the fast path covers it all (see the module's docstring),
    /// its place among the service's requests taken; else None (ask the control plane).
    pub fn plan(&self, request: &Request<Body>, config: &crate::Config) -> Option<Plan> {
        let method = request.method();
        let path = request.uri().path();
        let (name, replica_path) = target(method, path)?;
        let headers = request.headers();
        let authorization = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
        let expected = declared_length(headers)?;
        if matches!(expected, Some(length) if length > config.body_bytes) {
            return None; // refused 413 by the control plane, counted there
        }
        // The length checked (`declared_length`), where the client declared one.
        let length = expected.filter(|_| headers.contains_key(header::CONTENT_LENGTH));
        let headers_json = crossing_headers(headers, length)?;
        let mut state = self.state.lock().unwrap();
        let grant = state.grants.get(authorization)?;
        if grant.service != name || grant.until <= Instant::now() {
            return None;
        }
        let route = state.routes.get(name)?;
        let path = match replica_path {
            ReplicaPath::Infer => {
                if !route.onnx {
                    return None;
                }
                let mut path = String::with_capacity(route.model_path.len() + 6);
                path.push_str(&route.model_path);
                path.push_str("/infer");
                path
            }
            ReplicaPath::Rest(rest) => rest.to_string(),
        };
        let limit = route.limit;
        let id = route.id.clone();
        let stats = state.stats.entry(name.to_string()).or_default();
        if stats.in_flight >= limit {
            return None; // the control plane queues it
        }
        stats.in_flight += 1;
        stats.id = id;
        let whole = matches!(expected, Some(length)
            if length <= (frames::MAX_PAYLOAD as u64).min(config.retry_bytes));
        Some(Plan {
            service: name.to_string(),
            method: method.as_str().to_string(),
            path,
            query: request.uri().query().unwrap_or("").to_string(),
            headers_json,
            whole,
        })
    }

    /// The replica for the next attempt of `plan` (fewest outstanding, none of `tried`), its
    /// count taken; None when none is left (or its OPEN would not fit).
    pub fn choose(&self, plan: &Plan, tried: &[String]) -> Option<Choice> {
        let mut state = self.state.lock().unwrap();
        let state = &mut *state;
        let route = state.routes.get(&plan.service)?;
        let candidates: Vec<&(String, String)> = route
            .replicas
            .iter()
            .filter(|(id, _)| !tried.contains(id))
            .collect();
        let count = |id: &String| state.outstanding.get(id).copied().unwrap_or(0);
        let fewest = candidates.iter().map(|(id, _)| count(id)).min()?;
        let tied: Vec<&&(String, String)> = candidates
            .iter()
            .filter(|(id, _)| count(id) == fewest)
            .collect();
        state.turn = state.turn.wrapping_add(1);
        let (replica, node) = tied[state.turn % tied.len()];
        let open = open_payload(plan, replica);
        if open.len() > frames::MAX_OPEN {
            return None;
        }
        *state.outstanding.entry(replica.clone()).or_insert(0) += 1;
        Some(Choice {
            replica: replica.clone(),
            node: node.clone(),
            open,
        })
    }

    /// An attempt on `replica` is over (its count given back).
    pub fn released(&self, replica: &str) {
        let mut state = self.state.lock().unwrap();
        if let Some(count) = state.outstanding.get_mut(replica) {
            *count -= 1;
            if *count == 0 {
                state.outstanding.remove(replica);
            }
        }
    }

    /// Count `cause` for `service` (`transport`, `retried`, `unreachable`...).
    pub fn error(&self, service: &str, cause: &'static str) {
        let mut state = self.state.lock().unwrap();
        *state
            .stats
            .entry(service.to_string())
            .or_default()
            .errors
            .entry(cause)
            .or_insert(0) += 1;
    }

    /// The request is over: its status and seconds, and `error` when it ended in one.
    pub fn ended(&self, service: &str, status: u16, seconds: f64, error: &'static str) {
        let mut state = self.state.lock().unwrap();
        let stats = state.stats.entry(service.to_string()).or_default();
        stats.in_flight = stats.in_flight.saturating_sub(1);
        stats.answers.push((status, seconds));
        if !error.is_empty() {
            *stats.errors.entry(error).or_insert(0) += 1;
        }
    }

    /// The `stats` event for what happened since the last one; None when nothing did.
    fn report(&self) -> Option<String> {
        let mut state = self.state.lock().unwrap();
        let mut out = String::new();
        for (name, stats) in state.stats.iter_mut() {
            if stats.answers.is_empty()
                && stats.errors.is_empty()
                && stats.in_flight == stats.reported_in_flight
            {
                continue;
            }
            out.push_str(if out.is_empty() { "{" } else { "," });
            control::push_str(&mut out, name);
            out.push_str(":{\"id\":");
            control::push_str(&mut out, &stats.id);
            out.push_str(&format!(",\"in_flight\":{},\"answers\":[", stats.in_flight));
            for (index, (status, seconds)) in stats.answers.drain(..).enumerate() {
                if index > 0 {
                    out.push(',');
                }
                out.push_str(&format!("[{},{:.6}]", status, seconds));
            }
            out.push_str("],\"errors\":{");
            for (index, (cause, count)) in stats.errors.drain().enumerate() {
                if index > 0 {
                    out.push(',');
                }
                out.push_str(&format!("\"{}\":{}", cause, count));
            }
            out.push_str("}}");
            stats.reported_in_flight = stats.in_flight;
        }
        if out.is_empty() {
            return None;
        }
        out.push('}');
        Some(format!("{{\"op\":\"stats\",\"services\":{}}}", out))
    }

    /// Report what happened four times a second, for the process's life.
    pub async fn report_forever(self: Arc<Self>, control: Arc<Control>) {
        let mut every = tokio::time::interval(STATS_EVERY);
        loop {
            every.tick().await;
            if let Some(line) = self.report() {
                control.tell(line);
            }
        }
    }
}

/// Where a fast-path request goes on the replica.
enum ReplicaPath<'a> {
    /// `{model_path}/infer`.
    Infer,
    /// `/{path...}` of `/services/{name}/{path...}`, as received.
    Rest(&'a str),
}

/// The service's name and the path on its replica, for the shapes the fast path takes.
fn target<'a>(method: &Method, path: &'a str) -> Option<(&'a str, ReplicaPath<'a>)> {
    if let Some(rest) = path.strip_prefix("/services/") {
        let slash = rest.find('/')?;
        let name = &rest[..slash];
        if name.is_empty() || name.contains('%') {
            return None;
        }
        return Some((name, ReplicaPath::Rest(&rest[slash..])));
    }
    let name = path.strip_prefix("/v2/models/")?.strip_suffix("/infer")?;
    if *method != Method::POST || name.is_empty() || name.contains('/') || name.contains('%') {
        return None;
    }
    Some((name, ReplicaPath::Infer))
}

/// The body's declared length: Some(Some(n)), Some(None) when chunked (unknown), and None
/// when the fast path does not take it (both, or a length that is not a number).
fn declared_length(headers: &HeaderMap) -> Option<Option<u64>> {
    let chunked = headers.contains_key(header::TRANSFER_ENCODING);
    match headers.get(header::CONTENT_LENGTH) {
        Some(value) if !chunked => Some(Some(value.to_str().ok()?.parse().ok()?)),
        Some(_) => None,
        None if chunked => Some(None),
        None => Some(Some(0)),
    }
}

/// The headers a replica gets (`gateway_forward.crossing`), as the OPEN frame's JSON value:
/// the client's `Content-Length` (each, if it sent several) never crosses as sent, the one
/// `length` checked goes last instead, as `gateway.py` appends it. None when a value is not
/// visible ASCII or all pass the gateway's bound (the control plane answers those).
fn crossing_headers(headers: &HeaderMap, length: Option<u64>) -> Option<String> {
    let mut total = 0;
    let mut out = String::with_capacity(32 * headers.len());
    out.push('[');
    for (name, value) in headers {
        total += name.as_str().len() + value.len();
        let name = name.as_str();
        if frames::hop_by_hop(name)
            || name == "authorization"
            || name == "cookie"
            || name == "content-length"
            || name.starts_with(INTERNAL_HEADER)
        {
            continue;
        }
        let value = value.to_str().ok()?;
        if out.len() > 1 {
            out.push(',');
        }
        out.push('[');
        control::push_str(&mut out, name);
        out.push(',');
        control::push_str(&mut out, value);
        out.push(']');
    }
    if total > MAX_HEADER_BYTES {
        return None;
    }
    if let Some(length) = length {
        if out.len() > 1 {
            out.push(',');
        }
        out.push_str("[\"content-length\",\"");
        out.push_str(&length.to_string());
        out.push_str("\"]");
    }
    out.push(']');
    Some(out)
}

/// The OPEN frame's payload (`OpenRequest.to_payload`) for `replica`.
fn open_payload(plan: &Plan, replica: &str) -> Vec<u8> {
    let mut out = String::with_capacity(96 + plan.path.len() + plan.headers_json.len());
    out.push_str("{\"replica_id\":");
    control::push_str(&mut out, replica);
    out.push_str(",\"method\":");
    control::push_str(&mut out, &plan.method);
    out.push_str(",\"path\":");
    control::push_str(&mut out, &plan.path);
    out.push_str(",\"query\":");
    control::push_str(&mut out, &plan.query);
    out.push_str(",\"headers\":");
    out.push_str(&plan.headers_json);
    out.push('}');
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> crate::Config {
        crate::Config::for_tests()
    }

    fn fast_with_route() -> Fast {
        let fast = Fast::default();
        fast.set_routes(&serde_json::json!({"services": [{
            "name": "mlp", "id": "svc_1", "kind": "onnx", "model_path": "/v2/models/m%20x",
            "replicas": [["rep_a", "node_a"], ["rep_b", "node_b"]], "limit": 2,
        }]}));
        fast.remember(
            "Bearer mfs_good",
            &serde_json::json!({"service": "mlp", "ttl": 5.0}),
        );
        fast
    }

    fn infer(authorization: &str) -> Request<Body> {
        Request::post("/v2/models/mlp/infer?x=1")
            .header("authorization", authorization)
            .header("content-length", "3")
            .header("cookie", "c=1")
            .header("x-modelforge-client", "1.2.3.4:5")
            .header("content-type", "application/octet-stream")
            .body(Body::from("abc"))
            .unwrap()
    }

    #[test]
    fn a_remembered_token_takes_the_fast_path_with_its_open_frame() {
        let fast = fast_with_route();
        let plan = fast.plan(&infer("Bearer mfs_good"), &config()).unwrap();
        assert!(plan.whole);
        let choice = fast.choose(&plan, &[]).unwrap();
        let open: Value = serde_json::from_slice(&choice.open).unwrap();
        assert_eq!(open["path"], "/v2/models/m%20x/infer");
        assert_eq!(open["query"], "x=1");
        assert_eq!(open["method"], "POST");
        assert_eq!(open["replica_id"].as_str().unwrap(), choice.replica);
        // The token, cookies and the control plane's own headers never cross.
        assert_eq!(
            open["headers"],
            serde_json::json!([
                ["content-type", "application/octet-stream"],
                ["content-length", "3"]
            ])
        );
    }

    fn crossing(headers: &[(&'static str, &'static str)], length: Option<u64>) -> Value {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.append(*name, header::HeaderValue::from_static(value));
        }
        serde_json::from_str(&crossing_headers(&map, length).unwrap()).unwrap()
    }

    #[test]
    fn the_client_s_lengths_never_cross_as_sent_the_one_checked_does() {
        let expected = serde_json::json!([["accept", "*/*"], ["content-length", "5"]]);
        for sent in [
            &[("content-length", "5"), ("content-length", "5")][..],
            &[("content-length", "5")],
            &[("content-length", "05")],
        ] {
            let mut headers = vec![("accept", "*/*")];
            headers.extend_from_slice(sent);
            assert_eq!(crossing(&headers, Some(5)), expected, "{sent:?}");
        }
        // No length declared (nothing, or chunked: the transfer coding never crosses either).
        let chunked = [("transfer-encoding", "chunked"), ("accept", "*/*")];
        assert_eq!(
            crossing(&chunked, None),
            serde_json::json!([["accept", "*/*"]])
        );
        // A request with duplicate equal lengths still takes the fast path, with one.
        let fast = fast_with_route();
        let twice = Request::post("/v2/models/mlp/infer")
            .header("authorization", "Bearer mfs_good")
            .header("content-length", "3")
            .header("content-length", "3")
            .body(Body::from("abc"))
            .unwrap();
        let plan = fast.plan(&twice, &config()).unwrap();
        let open: Value = serde_json::from_slice(&fast.choose(&plan, &[]).unwrap().open).unwrap();
        assert_eq!(
            open["headers"],
            serde_json::json!([["content-length", "3"]])
        );
    }

    #[test]
    fn anything_not_remembered_is_asked() {
        let fast = fast_with_route();
        assert!(fast.plan(&infer("Bearer mfs_other"), &config()).is_none());
        let metadata = Request::get("/v2/models/mlp")
            .header("authorization", "Bearer mfs_good")
            .body(Body::empty())
            .unwrap();
        assert!(fast.plan(&metadata, &config()).is_none());
        let escaped = Request::post("/v2/models/ml%70/infer")
            .header("authorization", "Bearer mfs_good")
            .body(Body::empty())
            .unwrap();
        assert!(fast.plan(&escaped, &config()).is_none());
        fast.forget();
        assert!(fast.plan(&infer("Bearer mfs_good"), &config()).is_none());
    }

    #[test]
    fn the_limit_sends_the_next_to_the_control_plane() {
        let fast = fast_with_route();
        let first = fast.plan(&infer("Bearer mfs_good"), &config()).unwrap();
        let _second = fast.plan(&infer("Bearer mfs_good"), &config()).unwrap();
        assert!(fast.plan(&infer("Bearer mfs_good"), &config()).is_none());
        fast.ended(&first.service, 200, 0.001, "");
        assert!(fast.plan(&infer("Bearer mfs_good"), &config()).is_some());
    }

    #[test]
    fn the_replica_with_fewest_outstanding_is_chosen_and_a_retry_takes_another() {
        let fast = fast_with_route();
        let plan = fast.plan(&infer("Bearer mfs_good"), &config()).unwrap();
        let first = fast.choose(&plan, &[]).unwrap();
        let second = fast.choose(&plan, &[]).unwrap();
        assert_ne!(first.replica, second.replica);
        let retried = fast
            .choose(&plan, std::slice::from_ref(&first.replica))
            .unwrap();
        assert_eq!(retried.replica, second.replica);
        assert!(fast
            .choose(&plan, &[first.replica.clone(), second.replica.clone()])
            .is_none());
        fast.released(&first.replica);
        fast.released(&second.replica);
        fast.released(&retried.replica);
        assert!(fast.state.lock().unwrap().outstanding.is_empty());
    }

    #[test]
    fn the_report_says_what_happened_once() {
        let fast = fast_with_route();
        let plan = fast.plan(&infer("Bearer mfs_good"), &config()).unwrap();
        fast.error(&plan.service, "transport");
        fast.ended(&plan.service, 200, 0.5, "");
        let report: Value = serde_json::from_str(&fast.report().unwrap()).unwrap();
        let mlp = &report["services"]["mlp"];
        assert_eq!(mlp["id"], "svc_1");
        assert_eq!(mlp["in_flight"], 0);
        assert_eq!(mlp["answers"], serde_json::json!([[200, 0.5]]));
        assert_eq!(mlp["errors"]["transport"], 1);
        assert!(fast.report().is_none());
    }
}
