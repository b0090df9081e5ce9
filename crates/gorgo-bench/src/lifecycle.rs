//! Starting and stopping one local cluster per policy by running the `gorgo` binary
//! itself (`gorgo up --detach` / `gorgo down`), with teardown guaranteed by a guard.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crate::cluster::ClusterInfo;
use crate::BenchError;

/// How to bring one cluster up.
#[derive(Debug, Clone)]
pub struct UpOptions {
    /// The `gorgo` binary (normally `std::env::current_exe()`).
    pub exe: PathBuf,
    /// Topology file.
    pub topology: PathBuf,
    /// Routing policy every node runs.
    pub policy: String,
    /// Engine profile of the emulators, when not the default.
    pub engine_profile: Option<String>,
    /// Run dir: logs, pids and `cluster.json`.
    pub run_dir: PathBuf,
    /// First port of the cluster's port block, when the binary supports `--base-port`
    /// (clusters that run side by side need disjoint ports).
    pub base_port: Option<u16>,
    /// Any further arguments for `gorgo up`.
    pub extra_args: Vec<String>,
    /// Give up on `gorgo up` after this long.
    pub timeout: Duration,
}

/// A cluster started by [`RunningCluster::up`]; stopped by [`RunningCluster::down`] or,
/// whatever happens (error, panic, Ctrl-C unwinding), when dropped.
#[derive(Debug)]
pub struct RunningCluster {
    exe: PathBuf,
    run_dir: PathBuf,
    /// What `gorgo up` wrote to `cluster.json`.
    pub info: ClusterInfo,
    stopped: bool,
}

/// Whether `gorgo <subcommand> --help` lists `flag`: lets compare use options of
/// `gorgo up` only when the binary has them.
pub async fn supports_flag(exe: &Path, subcommand: &str, flag: &str) -> bool {
    let out = tokio::process::Command::new(exe)
        .args([subcommand, "--help"])
        .stdin(Stdio::null())
        .output()
        .await;
    match out {
        Ok(o) => String::from_utf8_lossy(&o.stdout).contains(flag),
        Err(_) => false,
    }
}

impl RunningCluster {
    /// Run `gorgo up --detach` and read the `cluster.json` it writes. On failure the
    /// partial cluster is torn down before returning the error.
    pub async fn up(opts: &UpOptions) -> Result<Self, BenchError> {
        std::fs::create_dir_all(&opts.run_dir).map_err(|source| BenchError::Io {
            path: opts.run_dir.clone(),
            source,
        })?;
        let log_path = opts.run_dir.join("up.log");
        let log = std::fs::File::create(&log_path).map_err(|source| BenchError::Io {
            path: log_path.clone(),
            source,
        })?;
        let log_err = log.try_clone().map_err(|source| BenchError::Io {
            path: log_path.clone(),
            source,
        })?;
        let mut cmd = tokio::process::Command::new(&opts.exe);
        cmd.arg("up")
            .arg("--topology")
            .arg(&opts.topology)
            .arg("--policy")
            .arg(&opts.policy)
            .arg("--run-dir")
            .arg(&opts.run_dir)
            .arg("--detach");
        if let Some(p) = &opts.engine_profile {
            cmd.arg("--engine-profile").arg(p);
        }
        if let Some(port) = opts.base_port {
            cmd.arg("--base-port").arg(port.to_string());
        }
        cmd.args(&opts.extra_args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .kill_on_drop(true);
        // From here on, whatever happens, the guard tears the cluster down.
        let mut guard = RunningCluster {
            exe: opts.exe.clone(),
            run_dir: opts.run_dir.clone(),
            info: ClusterInfo {
                admin_token: None,
                regions: Vec::new(),
            },
            stopped: false,
        };
        let status = match tokio::time::timeout(opts.timeout, cmd.status()).await {
            Ok(Ok(status)) => status,
            Ok(Err(e)) => {
                return Err(BenchError::Cluster {
                    action: "up",
                    reason: format!("could not run {}: {e}", opts.exe.display()),
                })
            }
            Err(_) => {
                return Err(BenchError::Cluster {
                    action: "up",
                    reason: format!(
                        "not ready after {:?}; log: {}",
                        opts.timeout,
                        log_path.display()
                    ),
                })
            }
        };
        if !status.success() {
            return Err(BenchError::Cluster {
                action: "up",
                reason: format!("{status}: {}", log_tail(&log_path)),
            });
        }
        guard.info = ClusterInfo::from_path(&opts.run_dir)?;
        Ok(guard)
    }

    /// The run dir of this cluster.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// Stop the cluster now and report whether `gorgo down` succeeded.
    pub fn down(mut self) -> Result<(), BenchError> {
        self.stopped = true;
        stop(&self.exe, &self.run_dir)
    }
}

impl Drop for RunningCluster {
    fn drop(&mut self) {
        if !self.stopped {
            self.stopped = true;
            if let Err(e) = stop(&self.exe, &self.run_dir) {
                tracing::warn!("{e}");
            }
        }
    }
}

/// `gorgo down --run-dir <dir>`, blocking: runs from `Drop` too.
fn stop(exe: &Path, run_dir: &Path) -> Result<(), BenchError> {
    let log_path = run_dir.join("down.log");
    let output = std::process::Command::new(exe)
        .arg("down")
        .arg("--run-dir")
        .arg(run_dir)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| BenchError::Cluster {
            action: "down",
            reason: format!("could not run {}: {e}", exe.display()),
        })?;
    let mut log = output.stdout.clone();
    log.extend_from_slice(&output.stderr);
    let _ = std::fs::write(&log_path, &log);
    if output.status.success() {
        Ok(())
    } else {
        Err(BenchError::Cluster {
            action: "down",
            reason: format!("{} ({})", output.status, run_dir.display()),
        })
    }
}

/// The last lines of a log, for error messages.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(8)..].join("\n");
    if tail.is_empty() {
        format!("(empty log {})", path.display())
    } else {
        format!("{tail}\n(log: {})", path.display())
    }
}
