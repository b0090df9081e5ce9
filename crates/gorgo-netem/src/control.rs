//! Cutting and healing a running cluster's links: the [`LinkTable`] of every
//! link's gate, and a small HTTP control API over it for scripts.
//!
//! It exists for chaos runs: a script partitions a region from the others
//! (`POST /partition?a=X&b=Y` for each other region Y), waits, and heals it
//! (`POST /heal?a=X&b=Y`), while the nodes and engines keep running. The API
//! listens on loopback (the plan's `control_addr`), takes no body and no
//! authentication: whoever can reach the cluster's loopback addresses can
//! already reach its nodes.
//!
//! | route | answer |
//! |---|---|
//! | `POST /partition?a=X&b=Y` | cuts the link between `X` and `Y`, both directions: `{"a", "b", "up": false, "changed"}` |
//! | `POST /heal?a=X&b=Y` | puts it back up: `{"a", "b", "up": true, "changed"}` |
//! | `GET /links` | `{"links": [{"a", "b", "up"}, ...]}` |
//!
//! `X` and `Y` are region names, or one of them [`CLIENTS`]: the link between
//! a region and its clients (the client TCP relay); both are percent-decoded.
//! Errors are `{"error": "..."}` naming what was wrong (400: a missing or
//! unknown region, a region paired with itself, an unknown or repeated
//! parameter; 404, 405; 413 a body; 414 a URI over [`MAX_URI_BYTES`]).

use std::future::Future;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use tokio::net::TcpListener;

use crate::relay::LinkGate;
use crate::NetemError;

/// The endpoint name of a region's clients in link names: `a=us-ashburn&b=clients`
/// is the link between us-ashburn's node and its clients. Topologies may not
/// name a region this.
pub const CLIENTS: &str = "clients";

/// Longest request URI the control API reads; its queries are two short names.
pub const MAX_URI_BYTES: usize = 1024;

/// One link of a cluster by its two ends, and whether it is up.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LinkStatus {
    /// One end: a region.
    pub a: String,
    /// The other end: a region after `a` in topology order, or [`CLIENTS`].
    pub b: String,
    /// Whether it carries traffic.
    pub up: bool,
}

/// What [`LinkTable::set`] did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LinkChange {
    /// The link after the change.
    #[serde(flatten)]
    pub link: LinkStatus,
    /// False when it already was in that state.
    pub changed: bool,
}

#[derive(Debug)]
struct NamedGate {
    a: usize,
    /// `None`: the clients of `a`.
    b: Option<usize>,
    gate: LinkGate,
}

/// Every link of a cluster (each pair of regions, and each region's clients)
/// with its gate; cheap to clone, clones share the gates.
#[derive(Clone, Debug)]
pub struct LinkTable {
    regions: Arc<Vec<String>>,
    gates: Arc<Vec<NamedGate>>,
}

impl LinkTable {
    /// All links of `regions` up.
    pub fn new(regions: Vec<String>) -> Self {
        let n = regions.len();
        let mut gates = Vec::new();
        for a in 0..n {
            for b in a + 1..n {
                gates.push(NamedGate {
                    a,
                    b: Some(b),
                    gate: LinkGate::default(),
                });
            }
        }
        gates.extend((0..n).map(|a| NamedGate {
            a,
            b: None,
            gate: LinkGate::default(),
        }));
        LinkTable {
            regions: Arc::new(regions),
            gates: Arc::new(gates),
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

    fn entry(&self, a: usize, b: Option<usize>) -> &NamedGate {
        let (lo, hi) = match b {
            Some(b) => (a.min(b), Some(a.max(b))),
            None => (a, None),
        };
        self.gates
            .iter()
            .find(|g| g.a == lo && g.b == hi)
            .unwrap_or_else(|| panic!("no link {a} - {b:?} in a table of {}", self.regions.len()))
    }

    /// Every link and whether it is up: region pairs in topology order, then
    /// each region's clients.
    pub fn links(&self) -> Vec<LinkStatus> {
        self.gates.iter().map(|g| self.status(g)).collect()
    }

    /// Puts the link between `a` and `b` (region names or [`CLIENTS`], either
    /// order) up or cuts it.
    pub fn set(&self, a: &str, b: &str, up: bool) -> Result<LinkChange, NetemError> {
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
        let entry = self.entry(region, other);
        let changed = entry.gate.set_up(up);
        Ok(LinkChange {
            link: self.status(entry),
            changed,
        })
    }

    fn status(&self, g: &NamedGate) -> LinkStatus {
        LinkStatus {
            a: self.regions[g.a].clone(),
            b: g.b
                .map_or_else(|| CLIENTS.to_owned(), |b| self.regions[b].clone()),
            up: g.gate.is_up(),
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

/// The whole API in one function: three routes, every error as JSON.
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
            "this API takes no body: give the link as ?a=X&b=Y",
        );
    }
    let up = match uri.path() {
        "/links" if method == Method::GET => {
            return Json(serde_json::json!({ "links": links.links() })).into_response()
        }
        "/partition" if method == Method::POST => false,
        "/heal" if method == Method::POST => true,
        "/links" => return error(StatusCode::METHOD_NOT_ALLOWED, "use GET /links"),
        "/partition" | "/heal" => {
            return error(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("use POST {}?a=X&b=Y", uri.path()),
            )
        }
        other => {
            return error(
                StatusCode::NOT_FOUND,
                format!("no route `{other}`: POST /partition, POST /heal, GET /links"),
            )
        }
    };
    // Percent-decoded (`us%2Dashburn` is `us-ashburn`), in order, repeats kept.
    let Ok(Query(pairs)) = Query::<Vec<(String, String)>>::try_from_uri(&uri) else {
        return error(StatusCode::BAD_REQUEST, "unreadable query: give a=X&b=Y");
    };
    let (mut a, mut b) = (None, None);
    for (key, value) in pairs {
        let slot = match key.as_str() {
            "a" => &mut a,
            "b" => &mut b,
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!("unknown parameter `{key}`: give a=X&b=Y"),
                )
            }
        };
        // Which one would count is a guess: the last one cut the wrong link.
        if slot.is_some() {
            return error(
                StatusCode::BAD_REQUEST,
                format!("parameter `{key}` given twice: give a=X&b=Y, each once"),
            );
        }
        *slot = Some(value);
    }
    let (Some(a), Some(b)) = (a, b) else {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "give both ends of the link: {}?a=X&b=Y with X, Y among {}",
                uri.path(),
                links.known()
            ),
        );
    };
    match links.set(&a, &b, up) {
        Ok(change) => {
            tracing::info!(a = %change.link.a, b = %change.link.b, up, changed = change.changed, "link set");
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

    fn table() -> LinkTable {
        LinkTable::new(vec!["a".into(), "b".into(), "c".into()])
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
                    up: false
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
}
