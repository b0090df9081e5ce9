//! Cutting, healing and reshaping a running cluster's links: the [`LinkTable`]
//! of every link's gate and parameters, and a small HTTP control API over it
//! for scripts.
//!
//! It exists for chaos runs: a script partitions a region from the others
//! (`POST /partition?a=X&b=Y` for each other region Y), waits, and heals it
//! (`POST /heal?a=X&b=Y`), while the nodes and engines keep running; or makes
//! a link slow (`POST /shape?a=X&b=Y&delay_ms=300`) without restarting the
//! emulator with another topology. The API listens on loopback (the plan's
//! `control_addr`), takes no body and no authentication: whoever can reach
//! the cluster's loopback addresses can already reach its nodes.
//!
//! | route | answer |
//! |---|---|
//! | `POST /partition?a=X&b=Y` | cuts the link between `X` and `Y`, both directions: the link (below) with `"up": false` and `changed` |
//! | `POST /heal?a=X&b=Y` | puts it back up: the link with `"up": true` and `changed` |
//! | `POST /shape?a=X&b=Y&delay_ms=D&rate_mbps=R&loss=L` (any of the last three) | sets them in both directions: the link and `changed` |
//! | `GET /links` | `{"links": [link, ...]}` |
//!
//! A link is `{"a", "b", "up", "a_to_b", "b_to_a"}`, each direction
//! `{"delay_ms", "jitter_ms", "rate_mbps", "loss"}` ([`DirectionStatus`]).
//! `X` and `Y` are region names, or one of them [`CLIENTS`]: the link between
//! a region and its clients (the client TCP relay); both are percent-decoded.
//! A shape applies to what the link admits after it ([`SharedLinkParams`]).
//! Errors are `{"error": "..."}` naming what was wrong (400: a missing or
//! unknown region, a region paired with itself, an unknown or repeated
//! parameter, a value out of range; 404, 405; 413 a body; 414 a URI over
//! [`MAX_URI_BYTES`]).

use std::future::Future;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use tokio::net::TcpListener;

use crate::link::{DuplexLink, LinkParams, SharedLinkParams};
use crate::relay::LinkGate;
use crate::topology::{
    bad_loss, mbps_to_bps, ms, out_of_range, Topology, MAX_DELAY_MS, MAX_RATE_MBPS, MIN_RATE_MBPS,
};
use crate::NetemError;

/// The endpoint name of a region's clients in link names: `a=us-ashburn&b=clients`
/// is the link between us-ashburn's node and its clients. Topologies may not
/// name a region this.
pub const CLIENTS: &str = "clients";

/// Longest request URI the control API reads; its queries are a few short values.
pub const MAX_URI_BYTES: usize = 1024;

/// One direction of a link as the control API shows it: what it applies to
/// what it admits now.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DirectionStatus {
    /// One-way delay, ms.
    pub delay_ms: f64,
    /// Jitter, ms (uniform in +-jitter).
    pub jitter_ms: f64,
    /// Serialisation rate, Mbit/s; `None` (JSON `null`): unlimited.
    pub rate_mbps: Option<f64>,
    /// Fraction of datagrams lost (streams lose none).
    pub loss: f64,
}

impl From<&LinkParams> for DirectionStatus {
    fn from(p: &LinkParams) -> Self {
        // Whole nanoseconds over 1e6: exact for whole and decimal milliseconds
        // (`as_secs_f64() * 1000.0` turns 45 ms into 45.00000000000001).
        let ms = |d: std::time::Duration| d.as_nanos() as f64 / 1e6;
        DirectionStatus {
            delay_ms: ms(p.delay),
            jitter_ms: ms(p.jitter),
            rate_mbps: p.rate_bps.map(|bps| bps as f64 / 1e6),
            loss: p.loss,
        }
    }
}

/// One link of a cluster by its two ends: whether it is up, and what each
/// direction applies.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LinkStatus {
    /// One end: a region.
    pub a: String,
    /// The other end: a region after `a` in topology order, or [`CLIENTS`].
    pub b: String,
    /// Whether it carries traffic.
    pub up: bool,
    /// From `a` to `b` (a region's node to its clients when `b` is [`CLIENTS`]).
    pub a_to_b: DirectionStatus,
    /// From `b` to `a`.
    pub b_to_a: DirectionStatus,
}

/// What [`LinkTable::set`] or [`LinkTable::shape`] did.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LinkChange {
    /// The link after the change.
    #[serde(flatten)]
    pub link: LinkStatus,
    /// False when it already was in that state.
    pub changed: bool,
}

/// A run-time change of a link's shaping, in both directions; `None` leaves a
/// property as it is. It exists so a test can make a link slow, fast or lossy
/// while the cluster runs, as a topology file would at start.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LinkShape {
    /// One-way delay, ms, in `[0, 60000]` (as in topology files).
    pub delay_ms: Option<f64>,
    /// Serialisation rate: `Some(None)` removes the limit, `Some(Some(mbps))`
    /// sets one in `[0.001, 1000000]` Mbit/s.
    pub rate_mbps: Option<Option<f64>>,
    /// Fraction of datagrams lost, in `[0, 1)`. Links between regions only: a
    /// region's link to its clients carries TCP, which loses no bytes.
    pub loss: Option<f64>,
}

impl LinkShape {
    /// Whether it changes nothing.
    pub fn is_empty(&self) -> bool {
        *self == LinkShape::default()
    }

    /// Refuses any value out of its range, naming the parameter.
    fn validate(&self) -> Result<(), NetemError> {
        let checks = [
            self.delay_ms
                .and_then(|d| out_of_range(d, 0.0, MAX_DELAY_MS))
                .map(|r| ("delay_ms", r)),
            self.rate_mbps
                .flatten()
                .and_then(|m| out_of_range(m, MIN_RATE_MBPS, MAX_RATE_MBPS))
                .map(|r| ("rate_mbps", r)),
            self.loss.and_then(bad_loss).map(|r| ("loss", r)),
        ];
        match checks.into_iter().flatten().next() {
            Some((field, reason)) => Err(NetemError::param(field, reason)),
            None => Ok(()),
        }
    }

    /// Applies it to one direction's parameters (validated first).
    fn apply(&self, params: &mut LinkParams) {
        if let Some(delay) = self.delay_ms {
            params.delay = ms(delay);
        }
        if let Some(rate) = self.rate_mbps {
            params.rate_bps = rate.map(mbps_to_bps);
        }
        if let Some(loss) = self.loss {
            params.loss = loss;
        }
    }
}

#[derive(Debug)]
struct NamedLink {
    a: usize,
    /// `None`: the clients of `a`.
    b: Option<usize>,
    /// From `a` to `b` (to the clients when `b` is `None`).
    a_to_b: SharedLinkParams,
    /// From `b` to `a`.
    b_to_a: SharedLinkParams,
    gate: LinkGate,
}

/// Every link of a cluster (each pair of regions, and each region's clients)
/// with its gate and the parameters of both directions; cheap to clone, clones
/// share them. The relays a cluster starts take their links from it
/// ([`peer_link`](Self::peer_link), [`client_link`](Self::client_link)), so a
/// change here reaches them.
#[derive(Clone, Debug)]
pub struct LinkTable {
    regions: Arc<Vec<String>>,
    links: Arc<Vec<NamedLink>>,
}

impl LinkTable {
    /// All links of `topology`, up, with its parameters.
    pub fn new(topology: &Topology) -> Self {
        let n = topology.regions.len();
        let mut links = Vec::new();
        for a in 0..n {
            for b in a + 1..n {
                links.push(NamedLink {
                    a,
                    b: Some(b),
                    a_to_b: topology.link(a, b).into(),
                    b_to_a: topology.link(b, a).into(),
                    gate: LinkGate::default(),
                });
            }
        }
        links.extend((0..n).map(|a| NamedLink {
            a,
            b: None,
            a_to_b: topology.client_link(a).into(),
            b_to_a: topology.client_link(a).into(),
            gate: LinkGate::default(),
        }));
        LinkTable {
            regions: Arc::new(topology.regions.iter().map(|r| r.name.clone()).collect()),
            links: Arc::new(links),
        }
    }

    /// The gate between regions `a` and `b` (by index, either order), or
    /// between `a` and its clients when `b` is `None`.
    ///
    /// # Panics
    /// On an index out of range or `a == b`: the caller builds both from one plan.
    pub fn gate(&self, a: usize, b: Option<usize>) -> &LinkGate {
        &self.entry(a, b).gate
    }

    /// The link from region `from` to region `to` (indices) as a relay in front
    /// of `to` carries it: `from -> to` towards its target, `to -> from` back.
    ///
    /// # Panics
    /// As [`gate`](Self::gate).
    pub fn peer_link(&self, from: usize, to: usize) -> DuplexLink {
        let entry = self.entry(from, Some(to));
        let (forward, back) = if entry.a == from {
            (&entry.a_to_b, &entry.b_to_a)
        } else {
            (&entry.b_to_a, &entry.a_to_b)
        };
        DuplexLink {
            to_target: forward.clone(),
            to_source: back.clone(),
            gate: entry.gate.clone(),
        }
    }

    /// The link between region `region`'s clients and its node as the client
    /// relay carries it: clients -> node towards its target, node -> clients back.
    ///
    /// # Panics
    /// On an index out of range.
    pub fn client_link(&self, region: usize) -> DuplexLink {
        let entry = self.entry(region, None);
        DuplexLink {
            to_target: entry.b_to_a.clone(),
            to_source: entry.a_to_b.clone(),
            gate: entry.gate.clone(),
        }
    }

    fn entry(&self, a: usize, b: Option<usize>) -> &NamedLink {
        let (lo, hi) = match b {
            Some(b) => (a.min(b), Some(a.max(b))),
            None => (a, None),
        };
        self.links
            .iter()
            .find(|g| g.a == lo && g.b == hi)
            .unwrap_or_else(|| panic!("no link {a} - {b:?} in a table of {}", self.regions.len()))
    }

    /// Every link, whether it is up and what it applies: region pairs in
    /// topology order, then each region's clients.
    pub fn links(&self) -> Vec<LinkStatus> {
        self.links.iter().map(|g| self.status(g)).collect()
    }

    /// Puts the link between `a` and `b` (region names or [`CLIENTS`], either
    /// order) up or cuts it.
    pub fn set(&self, a: &str, b: &str, up: bool) -> Result<LinkChange, NetemError> {
        let entry = self.resolve(a, b)?;
        let changed = entry.gate.set_up(up);
        Ok(LinkChange {
            link: self.status(entry),
            changed,
        })
    }

    /// Changes the link between `a` and `b` (as in [`set`](Self::set)) in
    /// both directions, for what it admits from now on. Every value is checked
    /// before any is applied.
    pub fn shape(&self, a: &str, b: &str, shape: &LinkShape) -> Result<LinkChange, NetemError> {
        let entry = self.resolve(a, b)?;
        shape.validate()?;
        if shape.loss.is_some() && entry.b.is_none() {
            return Err(NetemError::param(
                "loss",
                format!(
                    "the link `{}` - `{CLIENTS}` carries TCP, which loses no bytes: loss applies between regions",
                    self.regions[entry.a]
                ),
            ));
        }
        // Both, whatever the first returns.
        let changed = [&entry.a_to_b, &entry.b_to_a]
            .map(|params| params.update(|p| shape.apply(p)))
            .contains(&true);
        Ok(LinkChange {
            link: self.status(entry),
            changed,
        })
    }

    /// The link between two ends by name (region names or [`CLIENTS`], either order).
    fn resolve(&self, a: &str, b: &str) -> Result<&NamedLink, NetemError> {
        let end = |name: &str| -> Result<Option<usize>, NetemError> {
            if name == CLIENTS {
                return Ok(None);
            }
            self.regions
                .iter()
                .position(|r| r == name)
                .map(Some)
                .ok_or_else(|| NetemError::UnknownRegion(name.to_owned()))
        };
        let (ia, ib) = (end(a)?, end(b)?);
        let (region, other) = match (ia, ib) {
            (Some(x), Some(y)) if x == y => {
                return Err(NetemError::Link(format!(
                    "`{a}` - `{b}`: a region has no link to itself"
                )))
            }
            (None, None) => {
                return Err(NetemError::Link(format!(
                    "`{a}` - `{b}`: name a region and its `{CLIENTS}`"
                )))
            }
            (Some(x), y) => (x, y),
            (None, Some(y)) => (y, None),
        };
        Ok(self.entry(region, other))
    }

    fn status(&self, g: &NamedLink) -> LinkStatus {
        LinkStatus {
            a: self.regions[g.a].clone(),
            b: g.b
                .map_or_else(|| CLIENTS.to_owned(), |b| self.regions[b].clone()),
            up: g.gate.is_up(),
            a_to_b: (&g.a_to_b.get()).into(),
            b_to_a: (&g.b_to_a.get()).into(),
        }
    }

    /// The names a link end may take, for error messages.
    fn known(&self) -> String {
        let mut names: Vec<&str> = self.regions.iter().map(String::as_str).collect();
        names.push(CLIENTS);
        names.join(", ")
    }
}

/// Serves the control API on `listener` until `shutdown` resolves.
pub async fn serve_control(
    listener: TcpListener,
    links: LinkTable,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = axum::Router::new().fallback(handle).with_state(links);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(serde_json::json!({ "error": message.into() }))).into_response()
}

/// What a POST route does to the link its query names.
enum Action {
    /// Up (`true`, heal) or cut (`false`, partition).
    Gate(bool),
    /// Change its delay, rate or loss.
    Shape,
}

impl Action {
    /// The parameters the route takes, the link's ends first.
    fn params(&self) -> &'static [&'static str] {
        match self {
            Action::Gate(_) => &["a", "b"],
            Action::Shape => &["a", "b", "delay_ms", "rate_mbps", "loss"],
        }
    }

    /// How to call it, for error messages.
    fn usage(&self) -> &'static str {
        match self {
            Action::Gate(_) => "a=X&b=Y",
            Action::Shape => "a=X&b=Y with any of delay_ms=D, rate_mbps=R (or `unlimited`), loss=L",
        }
    }
}

/// A number parameter of `/shape`; the error names it.
fn number(field: &str, value: &str) -> Result<f64, NetemError> {
    value
        .parse()
        .map_err(|_| NetemError::param(field, format!("`{value}` is not a number")))
}

/// The change a `/shape` query asks for (values not yet range-checked).
fn link_shape(
    delay_ms: Option<&str>,
    rate_mbps: Option<&str>,
    loss: Option<&str>,
) -> Result<LinkShape, NetemError> {
    Ok(LinkShape {
        delay_ms: delay_ms.map(|v| number("delay_ms", v)).transpose()?,
        rate_mbps: rate_mbps
            .map(|v| match v {
                "unlimited" => Ok(None),
                v => number("rate_mbps", v).map(Some),
            })
            .transpose()?,
        loss: loss.map(|v| number("loss", v)).transpose()?,
    })
}

/// The whole API in one function: four routes, every error as JSON.
async fn handle(
    State(links): State<LinkTable>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let uri_len = uri.path_and_query().map_or(0, |p| p.as_str().len());
    if uri_len > MAX_URI_BYTES {
        return error(
            StatusCode::URI_TOO_LONG,
            format!("request URI of {uri_len} bytes; at most {MAX_URI_BYTES}"),
        );
    }
    let has_body = headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get(header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() != b"0");
    if has_body {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "this API takes no body: give the link and its values in the query (?a=X&b=Y...)",
        );
    }
    let action = match uri.path() {
        "/links" if method == Method::GET => {
            return Json(serde_json::json!({ "links": links.links() })).into_response()
        }
        "/partition" if method == Method::POST => Action::Gate(false),
        "/heal" if method == Method::POST => Action::Gate(true),
        "/shape" if method == Method::POST => Action::Shape,
        "/links" => return error(StatusCode::METHOD_NOT_ALLOWED, "use GET /links"),
        "/partition" | "/heal" | "/shape" => {
            return error(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("use POST {}?a=X&b=Y", uri.path()),
            )
        }
        other => {
            return error(
                StatusCode::NOT_FOUND,
                format!("no route `{other}`: POST /partition, POST /heal, POST /shape, GET /links"),
            )
        }
    };
    let (names, usage) = (action.params(), action.usage());
    // Percent-decoded (`us%2Dashburn` is `us-ashburn`), in order, repeats kept.
    let Ok(Query(pairs)) = Query::<Vec<(String, String)>>::try_from_uri(&uri) else {
        return error(
            StatusCode::BAD_REQUEST,
            format!("unreadable query: give {usage}"),
        );
    };
    let mut values: Vec<Option<String>> = vec![None; names.len()];
    for (key, value) in pairs {
        let Some(slot) = names.iter().position(|n| *n == key) else {
            return error(
                StatusCode::BAD_REQUEST,
                format!("unknown parameter `{key}`: give {usage}"),
            );
        };
        // Which one would count is a guess: the last one cut the wrong link.
        if values[slot].is_some() {
            return error(
                StatusCode::BAD_REQUEST,
                format!("parameter `{key}` given twice: give {usage}, each once"),
            );
        }
        values[slot] = Some(value);
    }
    let [Some(a), Some(b)] = [&values[0], &values[1]] else {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "give both ends of the link: {}?{usage}, X and Y among {}",
                uri.path(),
                links.known()
            ),
        );
    };
    let result = match action {
        Action::Gate(up) => links.set(a, b, up),
        Action::Shape => {
            let value = |i: usize| values.get(i).and_then(|v| v.as_deref());
            match link_shape(value(2), value(3), value(4)) {
                Ok(shape) if shape.is_empty() => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        format!("nothing to change: give {usage}"),
                    )
                }
                Ok(shape) => links.shape(a, b, &shape),
                Err(e) => Err(e),
            }
        }
    };
    match result {
        Ok(change) => {
            tracing::info!(link = ?change.link, changed = change.changed, "link changed");
            Json(change).into_response()
        }
        Err(e @ NetemError::UnknownRegion(_)) => error(
            StatusCode::BAD_REQUEST,
            format!("{e} (known: {})", links.known()),
        ),
        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three regions, a -> b 10 ms and b -> a 12 ms, 100 Mbit/s, 1% loss;
    /// clients 2, 3, 4 ms.
    fn table() -> LinkTable {
        let topology = Topology::from_toml(
            r#"
            [network]
            loss = 0.01
            rate_mbps = 100
            [[regions]]
            name = "a"
            client_delay_ms = 2
            [[regions]]
            name = "b"
            client_delay_ms = 3
            [[regions]]
            name = "c"
            client_delay_ms = 4
            [one_way_ms]
            a = { b = 10, c = 20 }
            b = { a = 12, c = 30 }
        "#,
        )
        .unwrap();
        LinkTable::new(&topology)
    }

    fn delay(ms: f64) -> DirectionStatus {
        DirectionStatus {
            delay_ms: ms,
            jitter_ms: 0.0,
            rate_mbps: Some(100.0),
            loss: 0.01,
        }
    }

    #[test]
    fn set_cuts_one_link_both_ways_and_names_bad_ends() {
        let t = table();
        assert_eq!(t.links().len(), 3 + 3);
        assert!(t.links().iter().all(|l| l.up));
        let change = t.set("c", "a", false).unwrap();
        assert_eq!(
            change,
            LinkChange {
                link: LinkStatus {
                    a: "a".into(),
                    b: "c".into(),
                    up: false,
                    a_to_b: delay(20.0),
                    b_to_a: delay(20.0),
                },
                changed: true
            }
        );
        assert!(!t.gate(0, Some(2)).is_up() && !t.gate(2, Some(0)).is_up());
        assert!(t.gate(0, Some(1)).is_up() && t.gate(0, None).is_up());
        assert!(!t.set("a", "c", false).unwrap().changed, "already down");
        assert!(t.set("a", "c", true).unwrap().changed);
        assert!(t.gate(0, Some(2)).is_up());

        let clients = t.set(CLIENTS, "b", false).unwrap().link;
        assert_eq!((clients.a.as_str(), clients.b.as_str()), ("b", CLIENTS));
        assert!(!t.gate(1, None).is_up());

        let e = t.set("a", "mars", false).unwrap_err().to_string();
        assert!(e.contains("mars"), "{e}");
        assert!(t.set("a", "a", false).is_err());
        assert!(t.set(CLIENTS, CLIENTS, false).is_err());
    }

    /// A shape changes both directions of one link, and only what it names;
    /// the relays' links from the table (`peer_link`, `client_link`) see it in
    /// the right direction.
    #[test]
    fn shape_changes_both_directions_of_one_link() {
        let t = table();
        // Relays in front of b (for a's datagrams) and in front of a (for b's).
        let (at_b, at_a) = (t.peer_link(0, 1), t.peer_link(1, 0));
        let ms = |d: std::time::Duration| d.as_millis();
        assert_eq!(
            (
                ms(at_b.to_target.get().delay),
                ms(at_b.to_source.get().delay)
            ),
            (10, 12)
        );
        assert_eq!(
            (
                ms(at_a.to_target.get().delay),
                ms(at_a.to_source.get().delay)
            ),
            (12, 10)
        );

        let slow = LinkShape {
            delay_ms: Some(150.0),
            ..LinkShape::default()
        };
        let change = t.shape("b", "a", &slow).unwrap();
        assert!(change.changed);
        assert_eq!((change.link.a.as_str(), change.link.b.as_str()), ("a", "b"));
        assert_eq!(
            (change.link.a_to_b.clone(), change.link.b_to_a.clone()),
            (delay(150.0), delay(150.0))
        );
        for link in [&at_b, &at_a] {
            for dir in [&link.to_target, &link.to_source] {
                assert_eq!(ms(dir.get().delay), 150);
                assert_eq!(dir.get().rate_bps, Some(100_000_000), "rate left as it was");
            }
        }
        assert!(!t.shape("a", "b", &slow).unwrap().changed, "already so");
        let others = t.links();
        assert_eq!(others[1].a_to_b, delay(20.0), "a - c untouched");

        let free = LinkShape {
            rate_mbps: Some(None),
            loss: Some(0.0),
            ..LinkShape::default()
        };
        let link = t.shape("a", "b", &free).unwrap().link;
        assert_eq!((link.a_to_b.rate_mbps, link.a_to_b.loss), (None, 0.0));
        assert_eq!(link.b_to_a.delay_ms, 150.0, "delay left as it was");

        // A region's clients: clients -> node towards the client relay's target.
        let clients = t.client_link(2);
        let change = t
            .shape(
                CLIENTS,
                "c",
                &LinkShape {
                    delay_ms: Some(40.5),
                    ..LinkShape::default()
                },
            )
            .unwrap();
        assert_eq!(
            (change.link.a_to_b.delay_ms, change.link.b_to_a.delay_ms),
            (40.5, 40.5)
        );
        assert_eq!(
            clients.to_target.get().delay,
            std::time::Duration::from_micros(40_500)
        );
        assert_eq!(
            clients.to_source.get().delay,
            std::time::Duration::from_micros(40_500)
        );
    }

    /// Values out of range are refused naming the parameter, before anything
    /// changes; so are unknown regions and loss on a client (TCP) link.
    #[test]
    fn shape_refuses_bad_values_naming_them() {
        let t = table();
        let before = t.links();
        let bad = [
            (
                LinkShape {
                    delay_ms: Some(-1.0),
                    ..LinkShape::default()
                },
                "delay_ms",
                "got -1",
            ),
            (
                LinkShape {
                    delay_ms: Some(f64::NAN),
                    ..LinkShape::default()
                },
                "delay_ms",
                "got NaN",
            ),
            (
                LinkShape {
                    delay_ms: Some(f64::INFINITY),
                    ..LinkShape::default()
                },
                "delay_ms",
                "got inf",
            ),
            (
                LinkShape {
                    delay_ms: Some(60_001.0),
                    ..LinkShape::default()
                },
                "delay_ms",
                "[0, 60000]",
            ),
            (
                LinkShape {
                    rate_mbps: Some(Some(0.0)),
                    ..LinkShape::default()
                },
                "rate_mbps",
                "got 0",
            ),
            (
                LinkShape {
                    rate_mbps: Some(Some(2e6)),
                    ..LinkShape::default()
                },
                "rate_mbps",
                "1000000",
            ),
            (
                LinkShape {
                    loss: Some(1.0),
                    ..LinkShape::default()
                },
                "loss",
                "[0, 1)",
            ),
            (
                LinkShape {
                    loss: Some(-0.1),
                    ..LinkShape::default()
                },
                "loss",
                "got -0.1",
            ),
            // Nothing applied when a later value is bad.
            (
                LinkShape {
                    delay_ms: Some(5.0),
                    loss: Some(f64::NAN),
                    ..LinkShape::default()
                },
                "loss",
                "got NaN",
            ),
        ];
        for (shape, field, detail) in bad {
            let e = t.shape("a", "b", &shape).unwrap_err();
            assert!(matches!(e, NetemError::Param { .. }), "{e:?}");
            let e = e.to_string();
            assert!(
                e.contains(&format!("`{field}`")) && e.contains(detail),
                "{e}"
            );
        }
        let e = t
            .shape(
                "a",
                "mars",
                &LinkShape {
                    delay_ms: Some(5.0),
                    ..LinkShape::default()
                },
            )
            .unwrap_err();
        assert!(e.to_string().contains("`mars`"), "{e}");
        let e = t
            .shape(
                "a",
                CLIENTS,
                &LinkShape {
                    loss: Some(0.1),
                    ..LinkShape::default()
                },
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("`loss`") && e.contains("TCP"), "{e}");
        assert_eq!(t.links(), before, "nothing changed");
    }
}
