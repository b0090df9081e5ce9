//! `gorgo node` from the built binary: the example configs validate, and a typo or a
//! missing field is an error that names it (and the node does not start). Also the
//! engine emulator a node is tested against: `gorgo engine --tokenizer` counts as the
//! engine of its `--kind` counts.

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

/// `text` written as `dir/name` and given to `gorgo node` (`check`: with `--check`):
/// its stderr, once it has failed, as a config that is wrong must.
fn refused(dir: &std::path::Path, name: &str, text: &str, check: bool) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    let out = node(&path, check);
    assert!(!out.status.success(), "{name} was taken");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

const EXAMPLES: [&str; 3] = ["us-ashburn", "eu-frankfurt", "ap-seoul"];

/// The example configs copied to `dir/configs/nodes`, with the certificates they name
/// (`../../certs/`) written by `gorgo certs`.
fn examples_with_certs(dir: &std::path::Path) -> std::path::PathBuf {
    let nodes = dir.join("configs/nodes");
    std::fs::create_dir_all(&nodes).unwrap();
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/nodes");
    for name in EXAMPLES {
        let file = format!("{name}.toml");
        std::fs::copy(src.join(&file), nodes.join(&file)).unwrap();
    }
    let out = Command::new(GORGO)
        .args(["certs", "--nodes", &EXAMPLES.join(",")])
        .arg("--out")
        .arg(dir.join("certs"))
        .output()
        .expect("running gorgo certs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    nodes
}

#[test]
fn example_configs_validate() {
    let dir = tempfile::tempdir().unwrap();
    let nodes = examples_with_certs(dir.path());
    for name in EXAMPLES {
        let out = node(&nodes.join(format!("{name}.toml")), true);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `--check` reads the files a start reads: a config whose schema is right but whose
/// certificate names another node, or whose learned-weights file is missing, fails the
/// check, naming what is wrong, instead of failing the start it vouched for.
#[test]
fn the_check_reads_the_files_a_start_reads() {
    let dir = tempfile::tempdir().unwrap();
    let nodes = examples_with_certs(dir.path());
    let example = std::fs::read_to_string(nodes.join("us-ashburn.toml")).unwrap();

    let err = refused(
        &nodes,
        "stolen.toml",
        &example.replace("certs/us-ashburn.", "certs/ap-seoul."),
        true,
    );
    assert!(
        err.contains("invalid `tls.cert`") && err.contains("us-ashburn"),
        "{err}"
    );

    // A file that cannot be read names its field, once ("tls: tls: reading ...").
    let err = refused(
        &nodes,
        "no-certs.toml",
        &example.replace("certs/ca.pem", "certs/nope.pem"),
        true,
    );
    assert!(
        err.contains("invalid `tls.ca`") && err.contains("nope.pem") && !err.contains("tls: tls:"),
        "{err}"
    );

    // Another node's key beside this node's certificate: the check passed it, and
    // the start then failed naming no field ("keys may not be consistent").
    let crossed = example.replace("certs/us-ashburn.key", "certs/eu-frankfurt.key");
    assert_ne!(crossed, example);
    for check in [true, false] {
        let err = refused(&nodes, "crossed.toml", &crossed, check);
        assert!(
            err.contains("invalid `tls.key`")
                && err.contains("eu-frankfurt.key")
                && err.contains("`tls.cert`"),
            "check: {check}: {err}"
        );
    }

    let err = refused(
        &nodes,
        "weights.toml",
        &example.replace(
            "[tuning]",
            "[tuning]\nweights_file = \"missing-weights.json\"",
        ),
        true,
    );
    assert!(
        err.contains("tuning.weights_file") && err.contains("missing-weights.json"),
        "{err}"
    );
}

#[test]
fn typo_and_missing_field_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let example = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/nodes/us-ashburn.toml"),
    )
    .unwrap();

    let err = refused(
        dir.path(),
        "typo.toml",
        &example.replace("max_hops = 1", "max_hop = 1"),
        false,
    );
    assert!(err.contains("max_hop"), "{err}");

    let err = refused(
        dir.path(),
        "missing.toml",
        &example.replace("kind = \"sglang\"", ""),
        false,
    );
    assert!(err.contains("missing field `kind`"), "{err}");

    let err = refused(
        dir.path(),
        "range.toml",
        &example.replace("max_body_bytes = 8388608", "max_body_bytes = 0"),
        false,
    );
    assert!(err.contains("limits.max_body_bytes"), "{err}");
}

/// `gorgo engine --tokenizer` counts a chat prompt as the engine of its `--kind` builds
/// it, as a node of that kind counts it: two text parts joined with "\n" by vLLM
/// (66 tokens with the fixture tokenizer), with " " by SGLang (65), as transformers'
/// `apply_chat_template` counts them given each engine's messages
/// (`crates/gorgo-node/tests/node_tokens.rs` says how). Before, every kind joined them
/// as vLLM does.
#[test]
fn an_emulator_counts_chat_prompts_as_its_kind_builds_them() {
    use std::io::{BufRead, Read, Write};
    let body = r#"{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "Which"}, {"type": "text", "text": "words?"}]}]}"#;
    for (kind, tokens) in [("vllm", 66), ("sglang", 65)] {
        let mut engine = Command::new(GORGO)
            .args([
                "engine",
                "--listen",
                "127.0.0.1:0",
                "--model",
                "m",
                "--kind",
                kind,
            ])
            .arg("--tokenizer")
            .arg(gorgo_tokenizer::FIXTURE_TOKENIZER)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("running gorgo engine");
        // It logs its address once it listens.
        let log = std::io::BufReader::new(engine.stdout.take().unwrap());
        let addr = log
            .lines()
            .map_while(Result::ok)
            .find_map(|line| {
                let at = line.find("listening")?;
                let from = at + line[at..].find("127.0.0.1:")?;
                let port: String = line[from + 10..]
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect();
                Some(format!("127.0.0.1:{port}"))
            })
            .expect("the emulator's address in its log");
        let mut conn = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            conn,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).unwrap();
        engine.kill().unwrap();
        engine.wait().unwrap();
        let json = answer.split("\r\n\r\n").nth(1).expect("a body");
        let v: serde_json::Value = serde_json::from_str(json).expect(&answer);
        assert_eq!(v["usage"]["prompt_tokens"], tokens, "{kind}: {answer}");
    }
}
