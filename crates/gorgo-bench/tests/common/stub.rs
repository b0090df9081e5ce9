//! A stand-in `gorgo` binary for the comparison tests: a shell script that "starts"
//! clusters by writing a cluster.json pointing at an in-process SSE server, and logs
//! every `up` and `down` to `calls.log` beside it.
//!
//! Policy names pick what it does: `broken`'s `up` fails; `hang`'s `up` writes to the
//! FIFO `up.fifo` beside it, then never ends; the `down` of `signals-down` writes to
//! the FIFO `down.fifo`, then waits until a line is written to `ack.fifo`. A test
//! reading those FIFOs knows, with no clock involved, that compare has reached that
//! point ([`make_fifos`] creates them).

use std::path::{Path, PathBuf};

use gorgo_workload::{BlockIds, TraceRequest};

/// Write the script to `dir/gorgo` (executable) and return its path.
pub fn fake_gorgo(dir: &Path, url: &str) -> PathBuf {
    let log = dir.join("calls.log");
    let script = format!(
        r#"#!/bin/sh
cmd="$1"; shift
if [ "$1" = "--help" ]; then echo "      --base-port <PORT>"; exit 0; fi
dir=""; port="-"; policy=""
while [ $# -gt 0 ]; do
  case "$1" in
    --run-dir) dir="$2"; shift ;;
    --base-port) port="$2"; shift ;;
    --policy) policy="$2"; shift ;;
    --ready-timeout-s) echo "ready $2" >> "{log}.ready"; shift ;;
  esac
  shift
done
case "$cmd" in
  up)
    echo "up $policy $port" >> "{log}"
    if [ "$policy" = "broken" ]; then echo "engine failed to start" >&2; exit 3; fi
    if [ "$policy" = "hang" ]; then echo up > "{fifos}/up.fifo"; exec sleep 3600; fi
    printf '{{"admin_token":"t","regions":[{{"name":"us","client_url":"{url}","admin_url":"{url}"}},{{"name":"eu","client_url":"{url}/"}}]}}' > "$dir/cluster.json" ;;
  down)
    case "$dir" in
      */signals-down/run) echo down > "{fifos}/down.fifo"; read ack < "{fifos}/ack.fifo" ;;
    esac
    echo "down $dir" >> "{log}" ;;
esac
"#,
        log = log.display(),
        fifos = dir.display(),
    );
    let path = dir.join("gorgo");
    std::fs::write(&path, script).unwrap();
    let mut perm = std::fs::metadata(&path).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&path, perm).unwrap();
    path
}

/// Create the FIFOs the script signals through, in `dir`.
pub fn make_fifos(dir: &Path) {
    for name in ["up.fifo", "down.fifo", "ack.fifo"] {
        let status = std::process::Command::new("mkfifo")
            .arg(dir.join(name))
            .status()
            .unwrap();
        assert!(status.success(), "mkfifo {name}");
    }
}

/// The calls the script logged, one line each (`up <policy> <port>`, `down <run dir>`).
pub fn calls(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("calls.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// `n` small trace requests, 10 ms apart.
pub fn requests(n: usize) -> Vec<TraceRequest> {
    (0..n)
        .map(|i| TraceRequest {
            timestamp_ms: i as u64 * 10,
            input_tokens: 64,
            output_tokens: 3,
            blocks: BlockIds::Int(vec![1, i as u64 + 2]),
            tokens_per_block: 32,
            user: Some(format!("u{}", i % 3)),
            session: None,
            home_region: None,
            request_id: None,
            system_prompt_hash: None,
        })
        .collect()
}
