//! Where to send requests: the client-facing URL of every region of a cluster.
//!
//! A cluster is given either as the run dir (or `cluster.json`) that `gorgo up` writes,
//! or as a list `region=url,...` for clusters started some other way. [`ClusterInfo`]
//! is the one `cluster.json` type: `gorgo up` writes it, `gorgo bench` reads it; and
//! [`parse_region_urls`] is the one reader of `region=url` lists (`gorgo bench
//! --cluster`, `gorgo up --engine-url`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::BenchError;

/// One region of `cluster.json`: where its clients, its admin API and its engine are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegionEndpoint {
    /// Region name, as in the topology and the trace's home regions.
    pub name: String,
    /// The node's client-facing URL (through the emulated client-to-region delay).
    pub client_url: String,
    /// The node's admin URL, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_url: Option<String>,
    /// The region's engine URL, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_url: Option<String>,
    /// The node id, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
}

/// `cluster.json`, as `gorgo up --run-dir D` writes it and `gorgo bench --cluster D`
/// reads it: one type for both sides, so they cannot disagree on the format.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterInfo {
    /// Bearer token of the nodes' admin API, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_token: Option<String>,
    /// Every region with its URLs, in topology order.
    pub regions: Vec<RegionEndpoint>,
}

impl ClusterInfo {
    /// Read `cluster.json`, or `<dir>/cluster.json` when `path` is a directory, with a
    /// cap ([`gorgo_files::MAX_CONFIG_FILE_BYTES`]: `/dev/zero` is refused, not read).
    pub fn from_path(path: &Path) -> Result<Self, BenchError> {
        let file: PathBuf = if path.is_dir() {
            path.join("cluster.json")
        } else {
            path.to_path_buf()
        };
        let text = gorgo_files::read_capped(&file, gorgo_files::MAX_CONFIG_FILE_BYTES).map_err(
            |source| BenchError::Io {
                path: file.clone(),
                source,
            },
        )?;
        let info: ClusterInfo = serde_json::from_str(&text)
            .map_err(|source| BenchError::Json { path: file, source })?;
        if info.regions.is_empty() {
            return Err(BenchError::ClusterSpec(
                "cluster.json lists no regions".into(),
            ));
        }
        Ok(info)
    }

    /// Parse `region=url,region=url,...` (see [`parse_region_urls`]).
    pub fn from_list(list: &str) -> Result<Self, BenchError> {
        let regions = parse_region_urls(list)?
            .into_iter()
            .map(|(name, client_url)| RegionEndpoint {
                name,
                client_url,
                admin_url: None,
                engine_url: None,
                node_id: None,
            })
            .collect();
        Ok(ClusterInfo {
            admin_token: None,
            regions,
        })
    }

    /// Accept what `--cluster` accepts: an existing path (run dir or cluster.json),
    /// else a `region=url,...` list.
    pub fn parse_spec(spec: &str) -> Result<Self, BenchError> {
        let path = Path::new(spec);
        if path.exists() {
            Self::from_path(path)
        } else if spec.contains('=') {
            Self::from_list(spec)
        } else {
            Err(BenchError::ClusterSpec(format!(
                "`{spec}` is neither an existing run dir / cluster.json nor a region=url list"
            )))
        }
    }

    /// Region names in order.
    pub fn region_names(&self) -> Vec<String> {
        self.regions.iter().map(|r| r.name.clone()).collect()
    }
}

/// Parse a `region=url,region=url,...` list into `(region, url)` pairs in order: each
/// region named once, each URL http(s), trailing slashes dropped (paths are appended).
/// Empty items are skipped; an empty list is an error. Errors quote the bad item.
pub fn parse_region_urls(list: &str) -> Result<Vec<(String, String)>, BenchError> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, url) = part.split_once('=').ok_or_else(|| {
            BenchError::ClusterSpec(format!("`{part}` is not of the form region=url"))
        })?;
        let (name, url) = (name.trim(), url.trim().trim_end_matches('/'));
        if name.is_empty() || !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(BenchError::ClusterSpec(format!(
                "`{part}`: need a region name and an http(s) URL"
            )));
        }
        if pairs.iter().any(|(n, _)| n == name) {
            return Err(BenchError::ClusterSpec(format!(
                "region `{name}` listed twice"
            )));
        }
        pairs.push((name.to_owned(), url.to_owned()));
    }
    if pairs.is_empty() {
        return Err(BenchError::ClusterSpec("empty region list".into()));
    }
    Ok(pairs)
}

/// Cap on one admin response read by [`fetch_tuning`] and [`fetch_states`], bytes: a
/// larger one is skipped once this much of it has been read.
const MAX_ADMIN_RESPONSE: usize = 16 << 20;

/// Every node's `GET /admin/tuning` view, with the node's region name. Nodes that do
/// not answer are skipped: tuning records are a bonus to the report, not a condition.
async fn fetch_tuning_views(info: &ClusterInfo) -> Vec<(String, serde_json::Value)> {
    fetch_admin_views(info, "/admin/tuning")
        .await
        .into_iter()
        .filter_map(|(region, view)| view.map(|v| (region, v)))
        .collect()
}

/// Every node's `GET /admin/state` (docs/node.md), by region, in cluster order: `None`
/// for a region without an admin URL or whose node did not answer. `gorgo bench
/// --policy` reads `allow_policy_header` and `policy` from it.
pub async fn fetch_states(info: &ClusterInfo) -> Vec<(String, Option<serde_json::Value>)> {
    fetch_admin_views(info, "/admin/state").await
}

/// Every node's JSON answer to `GET <admin>/<route>` with the cluster's admin token,
/// by region: `None` where there is no admin URL, no answer, or no JSON.
async fn fetch_admin_views(
    info: &ClusterInfo,
    route: &str,
) -> Vec<(String, Option<serde_json::Value>)> {
    let Ok(client) = crate::client::build_client(
        std::time::Duration::from_secs(5),
        std::time::Duration::from_secs(10),
    ) else {
        return info
            .regions
            .iter()
            .map(|r| (r.name.clone(), None))
            .collect();
    };
    let mut views = Vec::new();
    for region in &info.regions {
        let Some(admin) = &region.admin_url else {
            views.push((region.name.clone(), None));
            continue;
        };
        let url = format!("{}{route}", admin.trim_end_matches('/'));
        let mut req = client.get(&url);
        if let Some(token) = &info.admin_token {
            req = req.bearer_auth(token);
        }
        // Read up to one byte past the cap, never the whole of an oversized body: a
        // view that does not fit is skipped, not buffered and then thrown away.
        let body = match req.send().await {
            Ok(resp) if resp.status().is_success() => {
                crate::client::read_bounded(resp, MAX_ADMIN_RESPONSE + 1)
                    .await
                    .ok()
                    .filter(|b| b.complete)
                    .map(|b| b.bytes)
            }
            _ => None,
        };
        let view = body.and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
        if view.is_none() {
            tracing::debug!(%url, "no admin view");
        }
        views.push((region.name.clone(), view));
    }
    views
}

/// The entries of array `key` of every view, each tagged with `policy` and `node`, one
/// per epoch (several nodes may report the same decision; the first copy wins), in
/// epoch order.
fn merge_by_epoch(
    views: Vec<(String, serde_json::Value)>,
    key: &str,
    policy: &str,
) -> Vec<serde_json::Value> {
    let mut by_epoch = std::collections::BTreeMap::new();
    for (node, view) in views {
        let entries = view[key].as_array().cloned().unwrap_or_default();
        for mut entry in entries {
            let Some(epoch) = entry["epoch"].as_u64() else {
                continue;
            };
            if let Some(obj) = entry.as_object_mut() {
                obj.insert("policy".into(), policy.into());
                obj.insert("node".into(), node.clone().into());
            }
            by_epoch.entry(epoch).or_insert(entry);
        }
    }
    by_epoch.into_values().collect()
}

/// The tuning decisions (`GET /admin/tuning`, its `history`: docs/design.md's `tuning.jsonl`
/// records) of every node of the cluster, each tagged with `policy` and `node`, one per
/// epoch, in epoch order.
pub async fn fetch_tuning(info: &ClusterInfo, policy: &str) -> Vec<serde_json::Value> {
    merge_by_epoch(fetch_tuning_views(info).await, "history", policy)
}

/// The same decisions in the format of the paper's ES trace
/// (`paper_es_tune_trace_apr5.jsonl`: `score` = -p95 TTFT s, `best_params`, `sigma`,
/// `rechenberg`, ...; the `es_trace` of `GET /admin/tuning`), for `es_trace.jsonl`.
pub async fn fetch_es_trace(info: &ClusterInfo, policy: &str) -> Vec<serde_json::Value> {
    merge_by_epoch(fetch_tuning_views(info).await, "es_trace", policy)
}

/// Write `lines` as JSON lines to `path` (nothing when there are none).
pub fn write_jsonl(path: &Path, lines: &[serde_json::Value]) -> std::io::Result<()> {
    if lines.is_empty() {
        return Ok(());
    }
    let mut text = String::new();
    for l in lines {
        text += &l.to_string();
        text.push('\n');
    }
    gorgo_files::write_atomic(path, text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuning_views_merge_by_epoch_first_copy_wins() {
        let a = serde_json::json!({"es_trace": [{"epoch": 4, "score": -1.0}, {"epoch": 2, "score": -2.0}]});
        let b = serde_json::json!({"es_trace": [{"epoch": 2, "score": -9.0}, {"nope": 1}]});
        let lines = merge_by_epoch(vec![("a".into(), a), ("b".into(), b)], "es_trace", "gorgo");
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["epoch"], 2);
        assert_eq!(lines[0]["node"], "a");
        assert_eq!(lines[1]["policy"], "gorgo");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("es_trace.jsonl");
        write_jsonl(&path, &lines).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 2);
        write_jsonl(&dir.path().join("none.jsonl"), &[]).unwrap();
        assert!(!dir.path().join("none.jsonl").exists());
    }

    #[test]
    fn parses_list() {
        let c = ClusterInfo::parse_spec("a=http://127.0.0.1:1, b=http://127.0.0.1:2/").unwrap();
        assert_eq!(c.region_names(), vec!["a", "b"]);
        assert_eq!(c.regions[1].client_url, "http://127.0.0.1:2");
        assert_eq!(
            parse_region_urls("x = https://e.example/v ,").unwrap(),
            vec![("x".to_owned(), "https://e.example/v".to_owned())]
        );
    }

    #[test]
    fn cluster_json_round_trips() {
        let info = ClusterInfo {
            admin_token: Some("t".into()),
            regions: vec![RegionEndpoint {
                name: "us".into(),
                client_url: "http://127.0.0.1:9".into(),
                admin_url: Some("http://127.0.0.1:10".into()),
                engine_url: None,
                node_id: Some("us".into()),
            }],
        };
        let text = serde_json::to_string(&info).unwrap();
        assert!(!text.contains("engine_url"), "{text}");
        assert_eq!(serde_json::from_str::<ClusterInfo>(&text).unwrap(), info);
    }

    #[test]
    fn rejects_bad_lists() {
        assert!(ClusterInfo::from_list("a").is_err());
        assert!(ClusterInfo::from_list("a=ftp://x").is_err());
        assert!(ClusterInfo::from_list("a=http://x,a=http://y").is_err());
        assert!(ClusterInfo::from_list(",").is_err());
        assert!(ClusterInfo::parse_spec("/no/such/dir").is_err());
    }

    #[test]
    fn reads_run_dir() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("cluster.json"),
            r#"{"admin_token":"t","regions":[{"name":"us","client_url":"http://127.0.0.1:9",
                "admin_url":"http://127.0.0.1:10","engine_url":"http://127.0.0.1:11","node_id":"n1"}]}"#,
        )
        .unwrap();
        let c = ClusterInfo::parse_spec(dir.path().to_str().unwrap()).unwrap();
        assert_eq!(c.admin_token.as_deref(), Some("t"));
        assert_eq!(c.regions[0].node_id.as_deref(), Some("n1"));
        std::fs::write(dir.path().join("cluster.json"), "{").unwrap();
        assert!(matches!(
            ClusterInfo::from_path(dir.path()),
            Err(BenchError::Json { .. })
        ));
    }

    /// `--cluster` names a file read with a cap: one byte over it, or `/dev/zero`
    /// (which says it is empty), is refused naming the file and the cap.
    #[test]
    fn a_cluster_file_over_the_cap_is_refused() {
        let cap = gorgo_files::MAX_CONFIG_FILE_BYTES;
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("cluster.json");
        std::fs::File::create(&big)
            .unwrap()
            .set_len(cap + 1)
            .unwrap();
        let zero = Path::new("/dev/zero");
        for path in [dir.path(), zero].into_iter().filter(|p| p.exists()) {
            let e = ClusterInfo::parse_spec(path.to_str().unwrap()).unwrap_err();
            assert!(matches!(e, BenchError::Io { .. }), "{e:?}");
            let e = e.to_string();
            assert!(e.contains(&format!("larger than {cap} bytes")), "{e}");
        }
    }
}
