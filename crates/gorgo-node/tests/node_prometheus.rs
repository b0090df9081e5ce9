//! The node's metrics as Prometheus itself reads them: a real `prometheus` server
//! (Debian's package) scrapes a three-node cluster while clients send requests, some
//! of them forwarded, and PromQL answers about routing (requests by policy and serving
//! region, forwards, a TTFT quantile) agree with what the clients saw; and
//! `promtool check metrics` finds nothing to lint in any node's `/metrics`.
//!
//! Without the binaries the tests say so and pass, unless `GORGO_REQUIRE_PROMETHEUS=1`
//! (set in CI by scripts/test.sh), where a missing binary fails them.
mod common;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const IDS: [&str; 3] = ["a", "b", "c"];
/// How long Prometheus may take to start and to scrape what was sent (a debug build
/// on two busy cores; it scrapes every second).
const PROMETHEUS_DEADLINE: Duration = Duration::from_secs(90);

/// The binary `name` on `PATH`, or `None` after saying the test is skipped; with
/// `GORGO_REQUIRE_PROMETHEUS=1` a missing binary fails the test instead.
fn required_tool(name: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        let required = std::env::var("GORGO_REQUIRE_PROMETHEUS").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "`{name}` not found on PATH and GORGO_REQUIRE_PROMETHEUS=1 \
             (install Debian's `prometheus` package)"
        );
        // Straight to stderr, past the test harness' capture: a skip must show.
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: `{name}` not found on PATH (apt-get install prometheus); \
             set GORGO_REQUIRE_PROMETHEUS=1 to fail instead"
        );
    }
    found
}

/// A child process killed (and reaped) however the test ends.
struct KillOnDrop {
    child: Child,
    log: PathBuf,
}

impl KillOnDrop {
    /// The last lines of the child's output, for a failure message.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Three nodes on an in-process mesh, each beside its own stub engine; clients may
/// pick the policy (`x-gorgo-policy`), which is how the traffic forces forwards.
async fn cluster() -> MeshCluster {
    // Far apart: the default policy serves an idle node's own requests locally.
    let rtts = [("a", "b", 150.0), ("a", "c", 200.0), ("b", "c", 250.0)];
    mesh_cluster(&IDS, &rtts, |_| {
        "[routing]\nallow_policy_header = true\n".to_owned()
    })
    .await
}

/// What the clients sent and saw.
#[derive(Debug, Default)]
struct Sent {
    /// Requests answered 200, by (policy, serving region).
    by_policy_and_region: BTreeMap<(String, String), u64>,
    /// Requests that took a forward hop, by the peer that served them.
    forwarded_to: BTreeMap<String, u64>,
    /// The slowest request, send to last byte: no node saw a TTFT above it.
    slowest: Duration,
    /// Requests answered 200 as an event stream: those the TTFT histogram counts.
    streamed: u64,
}

impl Sent {
    fn total(&self) -> u64 {
        self.by_policy_and_region.values().sum()
    }
    fn forwards(&self) -> u64 {
        self.forwarded_to.values().sum()
    }
}

/// Requests to every node under its default policy (`gorgo`, served where they
/// arrive), then round-robin requests to `a`, which spreads them over all three
/// nodes: forwards to `b` and `c`. Streaming and whole responses alternate.
async fn send_traffic(c: &MeshCluster) -> Sent {
    let http = client();
    let mut sent = Sent::default();
    let mut jobs: Vec<(usize, Option<&str>)> = Vec::new();
    for i in 0..IDS.len() {
        jobs.extend([(i, None), (i, None)]);
    }
    jobs.extend(std::iter::repeat_n((0, Some("round-robin")), 6));
    for (n, (node, policy)) in jobs.into_iter().enumerate() {
        let mut req = http
            .post(format!("{}/v1/chat/completions", c.nodes[node].base))
            .json(&chat_body(
                &prompt(&format!("request {n}"), 2000),
                n % 2 == 0,
            ));
        if let Some(p) = policy {
            req = req.header("x-gorgo-policy", p);
        }
        let started = Instant::now();
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 200);
        sent.streamed += u64::from(n % 2 == 0);
        let header = |name: &str| resp.headers()[name].to_str().unwrap().to_owned();
        let (served_by, hops) = (header("x-gorgo-served-by"), header("x-gorgo-hops"));
        let body = resp.bytes().await.unwrap();
        assert!(!body.is_empty());
        sent.slowest = sent.slowest.max(started.elapsed());
        *sent
            .by_policy_and_region
            .entry((policy.unwrap_or("gorgo").to_owned(), served_by.clone()))
            .or_default() += 1;
        if hops != "0" {
            *sent.forwarded_to.entry(served_by).or_default() += 1;
        }
    }
    sent
}

/// A running `prometheus` scraping the nodes' admin ports every second.
struct Prometheus {
    process: KillOnDrop,
    base: String,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(binary: &Path, nodes: &[TestNode]) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let mut targets = String::new();
        for (id, node) in IDS.iter().zip(nodes) {
            targets.push_str(&format!(
                "      - targets: [\"{}\"]\n        labels: {{node: \"{id}\"}}\n",
                node.handle.admin_addr
            ));
        }
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
                 scrape_configs:\n  - job_name: gorgo\n    static_configs:\n{targets}"
            ),
        )
        .unwrap();
        // Prometheus cannot report a port it picked itself: take a free one and
        // hand it over (a clash shows as Prometheus exiting, with its log).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = dir.path().join("prometheus.log");
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("starting prometheus");
        Prometheus {
            process: KillOnDrop { child, log },
            base: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        }
    }

    /// Fail with Prometheus' log if it exited or `deadline` passed.
    fn check_alive(&mut self, deadline: Instant, waiting_for: &str) {
        if let Ok(Some(status)) = self.process.child.try_wait() {
            panic!(
                "prometheus exited ({status}) while waiting for {waiting_for}:\n{}",
                self.process.log_tail()
            );
        }
        assert!(
            Instant::now() < deadline,
            "prometheus: no {waiting_for} within {PROMETHEUS_DEADLINE:?}:\n{}",
            self.process.log_tail()
        );
    }

    async fn wait_ready(&mut self, deadline: Instant) {
        let url = format!("{}/-/ready", self.base);
        loop {
            let ready = client().get(&url).send().await;
            if ready.is_ok_and(|r| r.status() == 200) {
                return;
            }
            self.check_alive(deadline, "readiness");
            // Prometheus starts on its own clock; poll its readiness, bounded above.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// An instant PromQL query: each series' labels and value.
    async fn query(&self, promql: &str) -> Vec<(BTreeMap<String, String>, f64)> {
        let v: serde_json::Value = client()
            .get(format!("{}/api/v1/query", self.base))
            .query(&[("query", promql)])
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v["status"], "success", "{promql}: {v}");
        v["data"]["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|series| {
                let labels = series["metric"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
                    .collect();
                let value = series["value"][1].as_str().unwrap().parse().unwrap();
                (labels, value)
            })
            .collect()
    }

    /// A query whose answer is one number.
    async fn scalar(&self, promql: &str) -> f64 {
        let result = self.query(promql).await;
        assert_eq!(result.len(), 1, "{promql}: {result:?}");
        result[0].1
    }
}

/// The answer of a `sum by (<labels>)` query as a map from label values.
fn by_labels(
    result: Vec<(BTreeMap<String, String>, f64)>,
    labels: &[&str],
) -> BTreeMap<Vec<String>, u64> {
    result
        .into_iter()
        .map(|(l, v)| {
            let key = labels.iter().map(|k| l[*k].clone()).collect();
            (key, v as u64)
        })
        .collect()
}

#[tokio::test]
async fn prometheus_answers_routing_queries_about_a_three_node_cluster() {
    let Some(binary) = required_tool("prometheus") else {
        return;
    };
    let c = cluster().await;
    let mut prometheus = Prometheus::start(&binary, &c.nodes);
    let deadline = Instant::now() + PROMETHEUS_DEADLINE;
    prometheus.wait_ready(deadline).await;
    let sent = send_traffic(&c).await;
    assert!(
        sent.forwards() > 0,
        "the traffic forwarded nothing: {sent:?}"
    );

    // Requests by policy and serving region: wait (bounded) until every node's last
    // scrape holds all of them; the counters no longer move after that.
    let expected: BTreeMap<Vec<String>, u64> = sent
        .by_policy_and_region
        .iter()
        .map(|((p, r), n)| (vec![p.clone(), r.clone()], *n))
        .collect();
    let requests = r#"sum by (policy, served_by) (gorgo_requests_total{outcome="ok"})"#;
    loop {
        let got = by_labels(prometheus.query(requests).await, &["policy", "served_by"]);
        if got == expected {
            break;
        }
        prometheus.check_alive(
            deadline,
            &format!("{expected:?} from `{requests}` (now {got:?})"),
        );
        // Scrapes happen every second on Prometheus' clock: poll, bounded above.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        prometheus.scalar("sum(gorgo_requests_total)").await as u64,
        sent.total(),
        "no request failed or was counted twice"
    );
    let per_region = by_labels(
        prometheus
            .query(r#"sum by (served_by) (gorgo_requests_total{outcome="ok"})"#)
            .await,
        &["served_by"],
    );
    assert_eq!(per_region.values().sum::<u64>(), sent.total());
    assert_eq!(
        per_region.len(),
        IDS.len(),
        "every region served: {per_region:?}"
    );

    // Forwards: sent by the origins to the peers that served them, received there.
    let forwards = by_labels(
        prometheus
            .query(r#"sum by (peer) (gorgo_forwards_total{result="ok"})"#)
            .await,
        &["peer"],
    );
    let expected_forwards: BTreeMap<Vec<String>, u64> = sent
        .forwarded_to
        .iter()
        .map(|(peer, n)| (vec![peer.clone()], *n))
        .collect();
    assert_eq!(forwards, expected_forwards);
    assert_eq!(
        prometheus
            .scalar("sum(gorgo_forwards_received_total)")
            .await as u64,
        sent.forwards()
    );

    // TTFT: one observation per streamed request (a whole JSON body's first byte
    // comes with its last), and the p95 lies at or below the bucket bound that holds
    // the slowest request as the client timed it.
    assert_eq!(
        prometheus.scalar("sum(gorgo_ttft_seconds_count)").await as u64,
        sent.streamed
    );
    let p95 = prometheus
        .scalar("histogram_quantile(0.95, sum by (le) (gorgo_ttft_seconds_bucket))")
        .await;
    let slowest = sent.slowest.as_secs_f64();
    let bound = prometheus
        .query("sum by (le) (gorgo_ttft_seconds_bucket)")
        .await
        .into_iter()
        .map(|(l, _)| l["le"].parse::<f64>().unwrap())
        .filter(|le| *le >= slowest)
        .fold(f64::INFINITY, f64::min);
    assert!(
        p95 > 0.0 && p95 <= bound,
        "p95 TTFT {p95} s, slowest request {slowest} s (bucket bound {bound})"
    );
}

#[tokio::test]
async fn promtool_finds_nothing_to_lint_in_node_metrics() {
    let Some(promtool) = required_tool("promtool") else {
        return;
    };
    let c = cluster().await;
    // Traffic first, so that the labelled families have series to check too.
    let sent = send_traffic(&c).await;
    assert!(sent.forwards() > 0);
    for node in &c.nodes {
        // No `Accept`: the Prometheus text format, what promtool reads.
        let text = metrics_text(node).await;
        assert!(text.contains("gorgo_requests_total{"), "{text}");
        let mut check = Command::new(&promtool)
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting promtool");
        check
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let out = check.wait_with_output().unwrap();
        let report = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && report.trim().is_empty(),
            "promtool check metrics ({}): {report}\n{text}",
            out.status
        );
    }
}
