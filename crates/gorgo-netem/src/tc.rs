//! `tc netem` scripts for Linux hosts whose kernel has `sch_netem`: the same
//! topology as network namespaces on a bridge. Generated, so the checked-in
//! scripts under `netem/` cannot drift from the topology files.

use std::fmt::Write;

use crate::topology::Topology;

/// Subnet of the emulated network (a /24): regions at .10+i, clients at .100+i.
const SUBNET: &str = "10.77.0";
const REGION_HOST_BASE: usize = 10;
const CLIENT_HOST_BASE: usize = 100;

/// A decimal without float noise or trailing zeros (`45`, `2.5`, `0.3`).
fn fmt_num(v: f64) -> String {
    let s = format!("{v:.4}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

fn fmt_ms(ms: f64) -> String {
    format!("{}ms", fmt_num(ms))
}

/// A bash script (`up`, `down`, `exec <region> <cmd>...`) that builds one
/// namespace per region and one per region's clients, joined by a bridge, with
/// per-destination `netem` qdiscs on each namespace's egress. `source` is the
/// topology file as given, which the header names (it named
/// `configs/topologies/<stem>.toml` whatever file was given).
pub fn tc_script(topology: &Topology, source: &str) -> String {
    let n = topology.regions.len();
    let mut s = String::new();
    let w = &mut s;
    let _ = writeln!(w, "#!/usr/bin/env bash");
    // A newline in the path would end the comment and put the rest in the script.
    let source: String = source
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    let _ = writeln!(
        w,
        "# Generated from {source} by `gorgo netem --topology <file> --tc-script`; do not edit."
    );
    let _ = writeln!(
        w,
        "# Usage: sudo $0 up | down | exec <region|region-client> <command...>"
    );
    let _ = writeln!(
        w,
        "# Needs: iproute2 and the sch_netem + sch_htb kernel modules."
    );
    let _ = writeln!(w, "# Addresses (bridge gorgo-br, {SUBNET}.0/24):");
    for (i, r) in topology.regions.iter().enumerate() {
        let _ = writeln!(
            w,
            "#   {:<16} node {SUBNET}.{}   clients {SUBNET}.{}",
            r.name,
            REGION_HOST_BASE + i,
            CLIENT_HOST_BASE + i
        );
    }
    let _ = writeln!(w, "set -euo pipefail");
    let _ = writeln!(w, "BR=gorgo-br");
    let names: Vec<&str> = topology.regions.iter().map(|r| r.name.as_str()).collect();
    let _ = writeln!(w, "REGIONS=({})", names.join(" "));
    let _ = writeln!(
        w,
        r#"
# netns_add NS IFINDEX IP: a namespace with eth0 on the bridge.
netns_add() {{
  local ns=$1 idx=$2 ip=$3
  ip netns add "$ns"
  ip link add "gg$idx" type veth peer name eth0 netns "$ns"
  ip link set "gg$idx" master "$BR" up
  ip -n "$ns" addr add "$ip/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  tc -n "$ns" qdisc add dev eth0 root handle 1: htb default 1
  tc -n "$ns" class add dev eth0 parent 1: classid 1:1 htb rate 10gbit
}}

# shape NS CLASS DST_IP NETEM_ARGS...: egress from NS to DST_IP through netem.
shape() {{
  local ns=$1 class=$2 dst=$3; shift 3
  tc -n "$ns" class add dev eth0 parent 1: classid "1:$class" htb rate 10gbit
  tc -n "$ns" qdisc add dev eth0 parent "1:$class" handle "$class:" netem limit 100000 "$@"
  tc -n "$ns" filter add dev eth0 protocol ip parent 1: prio 1 u32 match ip dst "$dst/32" flowid "1:$class"
}}

up() {{
  ip link add "$BR" type bridge
  ip link set "$BR" up"#
    );
    let link_args = |delay: f64, jitter: f64, loss: f64, rate: Option<f64>| {
        let mut a = format!("delay {}", fmt_ms(delay));
        if jitter > 0.0 {
            a += &format!(" {}", fmt_ms(jitter));
        }
        if loss > 0.0 {
            a += &format!(" loss {}%", fmt_num(loss * 100.0));
        }
        if let Some(r) = rate {
            a += &format!(" rate {}kbit", (r * 1000.0).round() as u64);
        }
        a
    };
    for (i, r) in topology.regions.iter().enumerate() {
        let _ = writeln!(
            w,
            "  netns_add gorgo-{0} {1} {SUBNET}.{2}\n  netns_add gorgo-{0}-client {3} {SUBNET}.{4}",
            r.name,
            2 * i,
            REGION_HOST_BASE + i,
            2 * i + 1,
            CLIENT_HOST_BASE + i
        );
    }
    for (a, r) in topology.regions.iter().enumerate() {
        for b in 0..n {
            if a == b {
                continue;
            }
            let _ = writeln!(
                w,
                "  shape gorgo-{} {} {SUBNET}.{} {}",
                r.name,
                10 + b,
                REGION_HOST_BASE + b,
                link_args(
                    topology.one_way_ms[a][b],
                    topology.jitter_ms,
                    topology.loss,
                    topology.rate_mbps
                )
            );
        }
        let client = link_args(r.client_delay_ms, r.client_jitter_ms, 0.0, None);
        let _ = writeln!(
            w,
            "  shape gorgo-{0} {1} {SUBNET}.{2} {3}\n  shape gorgo-{0}-client {4} {SUBNET}.{5} {3}",
            r.name,
            10 + n + a,
            CLIENT_HOST_BASE + a,
            client,
            10 + a,
            REGION_HOST_BASE + a,
        );
    }
    let _ = writeln!(
        w,
        r#"}}

down() {{
  for r in "${{REGIONS[@]}}"; do
    ip netns del "gorgo-$r" 2>/dev/null || true
    ip netns del "gorgo-$r-client" 2>/dev/null || true
  done
  ip link del "$BR" 2>/dev/null || true
}}

case "${{1:-}}" in
  up) up ;;
  down) down ;;
  exec) ns=$2; shift 2; exec ip netns exec "gorgo-$ns" "$@" ;;
  *) echo "usage: $0 up | down | exec <region|region-client> <command...>" >&2; exit 2 ;;
esac"#
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checked-in scripts are exactly what the generator makes.
    #[test]
    fn checked_in_scripts_are_current() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
        for name in ["three-region", "five-region", "lan"] {
            let topology =
                Topology::from_file(format!("{root}/configs/topologies/{name}.toml")).unwrap();
            let path = format!("{root}/netem/{name}.sh");
            let expected = tc_script(&topology, &format!("configs/topologies/{name}.toml"));
            if std::env::var_os("GORGO_REGENERATE").is_some() {
                std::fs::write(&path, &expected).unwrap();
            }
            let script = std::fs::read_to_string(&path).unwrap();
            assert_eq!(
                script,
                expected,
                "netem/{name}.sh is stale: regenerate with `GORGO_REGENERATE=1 cargo test -p gorgo-netem checked_in_scripts`"
            );
        }
    }

    #[test]
    fn shapes_every_ordered_pair() {
        let t = Topology::from_toml(
            r#"
            [network]
            jitter_ms = 2
            loss = 0.01
            rate_mbps = 100
            [[regions]]
            name = "a"
            client_delay_ms = 2.5
            [[regions]]
            name = "b"
            client_delay_ms = 3
            [one_way_ms]
            a = { b = 45 }
        "#,
        )
        .unwrap();
        let s = tc_script(&t, "/tmp/x\nrm -rf ~.toml");
        // The header names the file given, and a newline in it stays in the comment.
        assert!(
            s.contains("# Generated from /tmp/x?rm -rf ~.toml by"),
            "{s}"
        );
        assert!(s.contains("shape gorgo-a 11 10.77.0.11 delay 45ms 2ms loss 1% rate 100000kbit"));
        assert!(s.contains("shape gorgo-b 10 10.77.0.10 delay 45ms 2ms loss 1% rate 100000kbit"));
        assert!(s.contains("shape gorgo-a-client 10 10.77.0.10 delay 2.5ms"));
    }
}
