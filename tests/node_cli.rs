//! `gorgo node` from the built binary: the example configs validate, and a typo or a
//! missing field is an error that names it (and the node does not start).

use std::process::Command;

const GORGO: &str = env!("CARGO_BIN_EXE_gorgo");

fn node(config: &std::path::Path, check: bool) -> std::process::Output {
    let mut cmd = Command::new(GORGO);
    cmd.args(["node", "--config"])
        .arg(config)
        .env("RUST_BACKTRACE", "0");
    if check {
        cmd.arg("--check");
    }
    cmd.output().expect("running gorgo node")
}

#[test]
fn example_configs_validate() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/nodes");
    for name in ["us-ashburn", "eu-frankfurt", "ap-seoul"] {
        let out = node(&dir.join(format!("{name}.toml")), true);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn typo_and_missing_field_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let example = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/nodes/us-ashburn.toml"),
    )
    .unwrap();

    let typo = dir.path().join("typo.toml");
    std::fs::write(&typo, example.replace("max_hops = 1", "max_hop = 1")).unwrap();
    let out = node(&typo, false);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("max_hop"), "{err}");

    let missing = dir.path().join("missing.toml");
    std::fs::write(&missing, example.replace("kind = \"sglang\"", "")).unwrap();
    let out = node(&missing, false);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("missing field `kind`"), "{err}");

    let range = dir.path().join("range.toml");
    std::fs::write(
        &range,
        example.replace("max_body_bytes = 8388608", "max_body_bytes = 0"),
    )
    .unwrap();
    let out = node(&range, false);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("limits.max_body_bytes"), "{err}");
}
