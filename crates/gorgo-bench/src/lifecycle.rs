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
        // 0600: `gorgo up` prints the cluster's admin token, which opens every node's
        // admin API to whoever reads it.
        // `mode` applies to a file it creates; one a run before left keeps its own,
        // so it is set again.
        let log = {
            use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&log_path)
                .and_then(|f| {
                    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
                    Ok(f)
                })
        }
        .map_err(|source| BenchError::Io {
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
        // `gorgo up`'s own wait for readiness (60 s unless told) within ours, so that a
        // slow start fails with its message, not ours, and is not cut at 60 s when the
        // caller allowed more.
        let ready_s = opts.timeout.as_secs().saturating_sub(5).max(1);
        if !opts.extra_args.iter().any(|a| a == "--ready-timeout-s") {
            cmd.arg("--ready-timeout-s").arg(ready_s.to_string());
        }
        cmd.args(&opts.extra_args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .kill_on_drop(true);
        // What the run dir's pids file held before: a `gorgo up` that refuses to
        // start (a cluster already runs from there) leaves it as it was, and that
        // cluster, not ours, is left alone.
        let pids_file = opts.run_dir.join("pids.json");
        let read_pids =
            || gorgo_files::read_capped_bytes(&pids_file, gorgo_files::MAX_CONFIG_FILE_BYTES).ok();
        let pids_before = read_pids();
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
            if pids_before.is_some() && read_pids() == pids_before {
                // Nothing of ours started: another cluster runs from this run dir
                // (a second compare with the same --out), and `gorgo down` here
                // would stop it mid-replay.
                guard.stopped = true;
            }
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
    use std::os::unix::process::CommandExt;
    let log_path = run_dir.join("down.log");
    // Its own process group: a Ctrl-C at the terminal while it waits for the nodes to
    // drain reaches the caller (which handles it), not `gorgo down`, which would die
    // halfway and leave the engines and relays running.
    let output = std::process::Command::new(exe)
        .arg("down")
        .arg("--run-dir")
        .arg(run_dir)
        .stdin(Stdio::null())
        .process_group(0)
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

/// Lines of a log's end an error shows when the log holds no `Error:` line.
const TAIL_LINES: usize = 8;

/// Lines from a log's last `Error:` line an error shows at most (the error and its
/// causes).
const ERROR_LINES: usize = 16;

/// The end of a log, for error messages: from its last `Error:` line (the error
/// `gorgo` exits with, and its causes) when it has one, else its last lines; never
/// backtrace frames, which with `RUST_BACKTRACE` set fill the end of the log and
/// would hide the error.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines = without_backtraces(&text);
    let mut tail = match lines.iter().rposition(|l| l.starts_with("Error:")) {
        Some(i) => &lines[i..lines.len().min(i + ERROR_LINES)],
        None => &lines[lines.len().saturating_sub(TAIL_LINES)..],
    };
    while let [rest @ .., last] = tail {
        if !last.trim().is_empty() {
            break;
        }
        tail = rest;
    }
    let tail = tail.join("\n");
    if tail.is_empty() {
        format!("(empty log {})", path.display())
    } else {
        format!("{tail}\n(log: {})", path.display())
    }
}

/// The lines of `text` outside backtraces: a `stack backtrace:` header (a panic's, or
/// `Stack backtrace:` after the binary's error), the frames under it and the note
/// that ends a panic's are left out.
fn without_backtraces(text: &str) -> Vec<&str> {
    let mut lines = Vec::new();
    let mut in_trace = false;
    for line in text.lines() {
        let t = line.trim_start();
        if t.eq_ignore_ascii_case("stack backtrace:") {
            in_trace = true;
            continue;
        }
        if in_trace {
            if is_frame(t) {
                continue;
            }
            in_trace = false;
            if t.starts_with("note: Some details are omitted") {
                continue;
            }
        }
        lines.push(line);
    }
    lines
}

/// A backtrace frame line, indentation removed: `12: symbol` or `at file:line:col`.
fn is_frame(line: &str) -> bool {
    line.starts_with("at ")
        || line
            .split_once(": ")
            .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The log of a `gorgo up` that failed with `RUST_BACKTRACE` set, as the binary's
    /// `main` prints it: its error and cause, then a backtrace longer than the tail.
    const FAILED_UP: &str = "\
2025-01-01T00:00:00Z  INFO gorgo::cmd::up: starting netem
Error: 127.0.0.10:47810 (us-ashburn's engine) is taken: pick another --base-port / --ip-base

Caused by:
    Address already in use (os error 98)

Stack backtrace:
   0: anyhow::error::<impl anyhow::Error>::msg
             at /cargo/anyhow-1.0.98/src/backtrace.rs:27:14
   1: gorgo::cmd::up::run_up
             at ./src/cmd/up.rs:640:9
   2: gorgo::main
             at ./src/main.rs:58:11
   3: std::rt::lang_start::{{closure}}
             at /rustc/59807616e1fa2540724bfbac14d7976d7e4a3860/library/std/src/rt.rs:171:5
   4: main
   5: __libc_start_main
";

    fn tail_of(text: &str) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("up.log");
        std::fs::write(&path, text).unwrap();
        log_tail(&path)
    }

    #[test]
    fn the_tail_shows_the_error_not_the_backtrace() {
        let tail = tail_of(FAILED_UP);
        assert!(
            tail.starts_with("Error: 127.0.0.10:47810 (us-ashburn's engine) is taken"),
            "{tail}"
        );
        assert!(tail.contains("\n    Address already in use"), "{tail}");
        assert!(
            !tail.contains("rt.rs") && !tail.contains("backtrace"),
            "{tail}"
        );
        assert!(!tail.contains("INFO"), "{tail}");
    }

    #[test]
    fn without_an_error_line_the_tail_is_the_last_lines_less_frames() {
        let panicked = "\
line 1
thread 'main' panicked at src/cmd/up.rs:12:5:
no engine
stack backtrace:
   0: rust_begin_unwind
             at /rustc/x/library/std/src/panicking.rs:652:5
   1: gorgo::main
note: Some details are omitted, run with `RUST_BACKTRACE=full` for a verbose backtrace.
";
        let tail = tail_of(panicked);
        assert!(tail.starts_with("line 1\nthread 'main' panicked"), "{tail}");
        assert!(tail.contains("no engine\n(log: "), "{tail}");
        let many: String = (0..20).map(|i| format!("line {i}\n")).collect();
        let tail = tail_of(&many);
        assert!(
            tail.starts_with("line 12\n") && tail.contains("line 19\n"),
            "{tail}"
        );
        assert!(tail_of("").starts_with("(empty log "));
    }
}
