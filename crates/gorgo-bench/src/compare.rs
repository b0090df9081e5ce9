//! Run every policy on the same workload, each on its own cluster: all clusters up
//! first, then every replay at once (as the paper ran them), or one policy after the
//! other with `sequential`. Clusters are always torn down, on error and on cancel too.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gorgo_workload::TraceRequest;
use tokio_util::sync::CancellationToken;

use crate::lifecycle::{supports_flag, RunningCluster, UpOptions};
use crate::replay::{replay, ReplayConfig, ReplayOutput};
use crate::workload::{body_builder, replay_items};
use crate::BenchError;

/// What a comparison runs.
#[derive(Debug, Clone)]
pub struct CompareSpec {
    /// The `gorgo` binary that provides `up` and `down`.
    pub exe: PathBuf,
    /// Topology of every cluster.
    pub topology: PathBuf,
    /// Policies, one cluster each.
    pub policies: Vec<String>,
    /// Output dir; cluster `k`'s run dir is `<out>/<policy>/run`.
    pub out: PathBuf,
    /// One policy after the other instead of all at once.
    pub sequential: bool,
    /// Engine profile of the emulators, when not the default.
    pub engine_profile: Option<String>,
    /// Further arguments of every `gorgo up` (e.g. `--replicas 4`).
    pub up_args: Vec<String>,
    /// First port of the first cluster; cluster `k` starts at `base_port + k * port_stride`.
    pub base_port: u16,
    /// Ports between the blocks of two clusters.
    pub port_stride: u16,
    /// Ports one cluster takes from its base port on a region's address, as `gorgo up`
    /// lays them out with `up_args` (7 for one engine a region, more with
    /// `--replicas`: the binary's `cmd::up::cluster_port_span`, the one place that
    /// knows the layout): clusters' blocks closer than this overlap.
    pub cluster_ports: u32,
    /// Give up on one `gorgo up` after this long.
    pub up_timeout: Duration,
    /// How the workload is offered (the same for every policy).
    pub replay: ReplayConfig,
    /// `model` of the request bodies.
    pub model: String,
    /// Ask engines for exactly `max_tokens` output tokens.
    pub ignore_eos: bool,
    /// Progress bars, one per policy; nothing is drawn when `None`.
    pub progress: Option<indicatif::MultiProgress>,
}

impl CompareSpec {
    /// Refuse a spec that cannot run, before anything starts: no policy, a policy
    /// listed twice or not a name, clusters' port blocks that overlap or run past the
    /// last port.
    pub fn validate(&self) -> Result<(), BenchError> {
        if self.policies.is_empty() {
            return Err(BenchError::InvalidConfig {
                field: "policies",
                reason: "no policy given".into(),
            });
        }
        for (i, p) in self.policies.iter().enumerate() {
            if self.policies[..i].contains(p) {
                return Err(BenchError::InvalidConfig {
                    field: "policies",
                    reason: format!(
                        "`{p}` listed twice (each policy gets one cluster and run dir)"
                    ),
                });
            }
            if p.is_empty() || p.contains(['/', '\\']) || p == "." || p == ".." {
                return Err(BenchError::InvalidConfig {
                    field: "policies",
                    reason: format!("`{p}` is not a policy name"),
                });
            }
        }
        // Each cluster's block of ports on a region's address runs from its base over
        // `cluster_ports` ports: blocks closer than that overlap, and the last block
        // must end at 65,535 at most.
        let last_base = u64::from(self.base_port)
            + u64::from(self.port_stride) * (self.policies.len().saturating_sub(1) as u64);
        let overlap = self.policies.len() > 1 && u32::from(self.port_stride) < self.cluster_ports;
        let blocks = format!(
            "clusters' port blocks ({} ports each from --base-port {}, --port-stride {} \
             apart, {} clusters)",
            self.cluster_ports,
            self.base_port,
            self.port_stride,
            self.policies.len()
        );
        if overlap {
            return Err(BenchError::InvalidConfig {
                field: "port_stride",
                reason: format!("{blocks} overlap"),
            });
        }
        // Blocks that do not overlap but end past the last port: the base is too high.
        if last_base + u64::from(self.cluster_ports) > 65_536 {
            return Err(BenchError::InvalidConfig {
                field: "base_port",
                reason: format!("{blocks} run past 65535"),
            });
        }
        Ok(())
    }
}

/// One policy's measured replay.
#[derive(Debug, Clone)]
pub struct PolicyRun {
    /// The policy.
    pub policy: String,
    /// Region names of its cluster, in topology order.
    pub regions: Vec<String>,
    /// Everything the replay measured.
    pub output: ReplayOutput,
    /// The cluster's tuning decisions (docs/design.md's `tuning.jsonl` records tagged with
    /// `policy` and `node`); empty when nothing was tuned.
    pub tuning: Vec<serde_json::Value>,
}

/// A policy whose cluster or replay failed after another policy had finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyFailure {
    /// The policy.
    pub policy: String,
    /// What failed, as the error says it.
    pub error: String,
}

/// What a comparison produced. An interrupt is not an error: the policies that
/// finished are kept, and what the interrupt cut short is said. Nor is a failure once
/// some policy has finished: its run is kept, and the failure said
/// ([`Comparison::failed`]); the caller reports what finished, then the failure.
#[derive(Debug, Clone)]
pub struct Comparison {
    /// The policies that ran, in order: complete, or stopped during their replay
    /// (`output.cancelled`, what they measured until then kept).
    pub runs: Vec<PolicyRun>,
    /// The policies an interrupt kept from running (their cluster never came up, or
    /// was still coming up) or a failure stopped (they come after it, in sequence),
    /// in order.
    pub not_run: Vec<String>,
    /// The policies whose cluster or replay failed, in order; empty unless one did.
    pub failed: Vec<PolicyFailure>,
}

impl Comparison {
    /// An interrupt cut the comparison short (a replay stopped, or a policy never
    /// ran for it, not for a failure): its report covers what finished, and must say
    /// so.
    pub fn interrupted(&self) -> bool {
        (!self.not_run.is_empty() && self.failed.is_empty())
            || self.runs.iter().any(|r| r.output.cancelled)
    }
}

/// Run the comparison. Stops (tearing everything down) when `cancel` fires, returning
/// the policies that finished, the one whose replay it stopped, and those it kept from
/// running ([`Comparison::interrupted`]). A failure (a cluster that does not come up or
/// go down, a replay that fails) stops the sequence: it is an error when no policy has
/// finished yet (or the spec is bad), else it is returned in [`Comparison::failed`]
/// beside the runs that finished, which an error would have lost.
pub async fn compare(
    spec: &CompareSpec,
    requests: Arc<Vec<TraceRequest>>,
    cancel: CancellationToken,
) -> Result<Comparison, BenchError> {
    spec.validate()?;
    let mut sequential = spec.sequential;
    let has_base_port = supports_flag(&spec.exe, "up", "--base-port").await;
    if !sequential && !has_base_port && spec.policies.len() > 1 {
        tracing::warn!(
            "`gorgo up` has no --base-port: clusters cannot run side by side, running sequentially"
        );
        sequential = true;
    }
    let up_options = |k: usize, policy: &str| UpOptions {
        exe: spec.exe.clone(),
        topology: spec.topology.clone(),
        policy: policy.to_owned(),
        engine_profile: spec.engine_profile.clone(),
        run_dir: spec.out.join(policy).join("run"),
        base_port: has_base_port.then(|| spec.base_port + (k as u16) * spec.port_stride),
        extra_args: spec.up_args.clone(),
        timeout: spec.up_timeout,
    };
    let mut runs = Vec::new();
    if sequential {
        for (k, policy) in spec.policies.iter().enumerate() {
            // An interrupt after a replay returned (while its tuning was read or its
            // cluster went down) lets that run stand and runs no more.
            let started = match start(&up_options(k, policy), &cancel).await {
                Ok(started) => started,
                Err(e) => {
                    let rest = spec.policies[k + 1..].to_vec();
                    return keep_finished(runs, rest, vec![(policy.clone(), e)]);
                }
            };
            let Some(cluster) = started else {
                return Ok(Comparison {
                    runs,
                    not_run: spec.policies[k..].to_vec(),
                    failed: Vec::new(),
                });
            };
            let run = run_policy(spec, policy, &cluster, requests.clone(), &cancel).await;
            let down = cluster.down();
            // A cluster that did not go down may hold the ports the next one needs: its
            // run stands (it finished), and the sequence stops.
            // A failed run whose cluster also failed to go down: both are said.
            let failures = outcomes(&mut runs, [(policy, run, down)]);
            if !failures.is_empty() {
                let rest = spec.policies[k + 1..].to_vec();
                return keep_finished(runs, rest, failures);
            }
        }
    } else {
        let mut clusters = Vec::new();
        for (k, policy) in spec.policies.iter().enumerate() {
            // A failure or an interrupt here drops the clusters already up, which tears
            // them down; no replay has run.
            match start(&up_options(k, policy), &cancel).await? {
                Some(cluster) => clusters.push(cluster),
                None => {
                    return Ok(Comparison {
                        runs,
                        not_run: spec.policies.clone(),
                        failed: Vec::new(),
                    })
                }
            }
        }
        let replays = spec
            .policies
            .iter()
            .zip(&clusters)
            .map(|(policy, cluster)| run_policy(spec, policy, cluster, requests.clone(), &cancel));
        let results = futures::future::join_all(replays).await;
        let downs = clusters.into_iter().map(RunningCluster::down);
        let ended = spec.policies.iter().zip(results).zip(downs);
        let failures = outcomes(&mut runs, ended.map(|((p, run), down)| (p, run, down)));
        if !failures.is_empty() {
            return keep_finished(runs, Vec::new(), failures);
        }
    }
    Ok(Comparison {
        runs,
        not_run: Vec::new(),
        failed: Vec::new(),
    })
}

/// Keep each policy's finished run in `runs`; return the failures: a policy's run
/// under its name, its cluster's teardown as "<policy> (teardown)" (a run that finished
/// stands though its cluster failed to go down).
fn outcomes<'a>(
    runs: &mut Vec<PolicyRun>,
    ended: impl IntoIterator<
        Item = (
            &'a String,
            Result<PolicyRun, BenchError>,
            Result<(), BenchError>,
        ),
    >,
) -> Vec<(String, BenchError)> {
    let mut failures = Vec::new();
    for (policy, run, down) in ended {
        match run {
            Ok(run) => runs.push(run),
            Err(e) => failures.push((policy.clone(), e)),
        }
        if let Err(e) = down {
            failures.push((format!("{policy} (teardown)"), e));
        }
    }
    failures
}

/// The comparison after `failures` (at least one): the first failure's error when no
/// policy finished (the others logged), else the runs that did with the failures said.
fn keep_finished(
    runs: Vec<PolicyRun>,
    not_run: Vec<String>,
    failures: Vec<(String, BenchError)>,
) -> Result<Comparison, BenchError> {
    if runs.is_empty() {
        let mut failures = failures.into_iter();
        let (_, first) = failures.next().expect("called with a failure");
        for (policy, e) in failures {
            tracing::error!(%policy, error = %e, "also failed");
        }
        return Err(first);
    }
    for (policy, e) in &failures {
        tracing::error!(%policy, error = %e, "policy failed; keeping the policies that finished");
    }
    Ok(Comparison {
        runs,
        not_run,
        failed: failures
            .into_iter()
            .map(|(policy, e)| PolicyFailure {
                policy,
                error: e.to_string(),
            })
            .collect(),
    })
}

/// Bring one cluster up; `None` when `cancel` fires first (or had fired: no cluster is
/// started after an interrupt), the partial cluster then torn down.
async fn start(
    opts: &UpOptions,
    cancel: &CancellationToken,
) -> Result<Option<RunningCluster>, BenchError> {
    tokio::select! {
        biased;
        _ = cancel.cancelled() => Ok(None),
        r = async {
            tracing::info!(policy = %opts.policy, run_dir = %opts.run_dir.display(), "starting cluster");
            RunningCluster::up(opts).await
        } => r.map(Some),
    }
}

async fn run_policy(
    spec: &CompareSpec,
    policy: &str,
    cluster: &RunningCluster,
    requests: Arc<Vec<TraceRequest>>,
    cancel: &CancellationToken,
) -> Result<PolicyRun, BenchError> {
    let regions = cluster.info.region_names();
    let items = replay_items(&requests, &regions);
    let bodies = body_builder(requests, spec.model.clone(), spec.ignore_eos);
    let mut config = spec.replay.clone();
    config.progress = spec.progress.as_ref().map(|mp| {
        let pb = mp.add(indicatif::ProgressBar::new(items.len() as u64));
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{prefix:>24} {elapsed_precise} [{wide_bar}] {pos}/{len} {msg}",
        ) {
            pb.set_style(style);
        }
        pb.set_prefix(policy.to_owned());
        pb
    });
    let output = replay(&cluster.info, items, bodies, &config, cancel.cancelled()).await?;
    let tuning = crate::cluster::fetch_tuning(&cluster.info, policy).await;
    Ok(PolicyRun {
        policy: policy.to_owned(),
        regions,
        output,
        tuning,
    })
}
