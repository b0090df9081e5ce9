//! The crate graph `docs/design.md` allows, checked against `cargo metadata`.
//!
//! The sans-IO split only holds while nobody adds the wrong dependency: the simulator
//! must run the node's logic through `gorgo-core`, never by linking `gorgo-node`, and
//! `gorgo-core` must never reach an async runtime. This test reads the resolved graph
//! and fails naming the edge that breaks the table in `docs/design.md`.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;

/// Which workspace crates each workspace crate may depend on (normal dependencies),
/// as `docs/design.md` states it. The root package `gorgo` (the CLI) may use any.
const ALLOWED: &[(&str, &[&str])] = &[
    ("gorgo-core", &[]),
    ("gorgo-files", &[]),
    ("gorgo-workload", &["gorgo-core"]),
    ("gorgo-report", &["gorgo-core", "gorgo-files"]),
    ("gorgo-tokenizer", &["gorgo-core", "gorgo-files"]),
    (
        "gorgo-engine",
        &["gorgo-core", "gorgo-tokenizer", "gorgo-files"],
    ),
    ("gorgo-netem", &["gorgo-files"]),
    ("gorgo-cluster", &["gorgo-core", "gorgo-files"]),
    (
        "gorgo-node",
        &[
            "gorgo-core",
            "gorgo-cluster",
            "gorgo-tokenizer",
            "gorgo-files",
        ],
    ),
    (
        "gorgo-bench",
        &[
            "gorgo-core",
            "gorgo-workload",
            "gorgo-report",
            "gorgo-files",
        ],
    ),
    (
        "gorgo-sim",
        &[
            "gorgo-core",
            "gorgo-engine",
            "gorgo-workload",
            "gorgo-report",
        ],
    ),
];

/// Crates that mean IO (an async runtime, sockets, HTTP): none may be reachable from
/// `gorgo-core` through normal dependencies, directly or transitively.
const IO_CRATES: &[&str] = &[
    "tokio",
    "mio",
    "quinn",
    "hyper",
    "axum",
    "reqwest",
    "async-std",
    "smol",
];

/// The resolved graph: package name -> names of its normal (non-dev, non-build)
/// dependencies. Built from `cargo metadata`'s `resolve` section.
type Graph = BTreeMap<String, BTreeSet<String>>;

fn normal_graph(metadata: &Value) -> Graph {
    let mut names = BTreeMap::new();
    for p in metadata["packages"].as_array().expect("packages") {
        names.insert(
            p["id"].as_str().expect("id").to_owned(),
            p["name"].as_str().expect("name").to_owned(),
        );
    }
    let mut graph = Graph::new();
    for node in metadata["resolve"]["nodes"].as_array().expect("resolve") {
        let from = names[node["id"].as_str().expect("id")].clone();
        let deps = graph.entry(from).or_default();
        for d in node["deps"].as_array().expect("deps") {
            let normal = d["dep_kinds"]
                .as_array()
                .expect("dep_kinds")
                .iter()
                .any(|k| k["kind"].is_null());
            if normal {
                deps.insert(names[d["pkg"].as_str().expect("pkg")].clone());
            }
        }
    }
    graph
}

/// Every rule the graph breaks, one line each (empty: the graph is as designed).
fn violations(graph: &Graph) -> Vec<String> {
    let mut out = Vec::new();
    for (krate, allowed) in ALLOWED {
        let Some(deps) = graph.get(*krate) else {
            out.push(format!("{krate}: missing from the workspace"));
            continue;
        };
        for d in deps.iter().filter(|d| d.starts_with("gorgo")) {
            if !allowed.contains(&d.as_str()) {
                out.push(format!(
                    "{krate} depends on {d}; docs/design.md allows only {allowed:?}"
                ));
            }
        }
    }
    // Transitive closure from gorgo-core over normal dependencies.
    let mut seen = BTreeSet::new();
    let mut stack = vec!["gorgo-core".to_owned()];
    while let Some(k) = stack.pop() {
        if !seen.insert(k.clone()) {
            continue;
        }
        if let Some(deps) = graph.get(&k) {
            stack.extend(deps.iter().cloned());
        }
    }
    for io in IO_CRATES {
        if seen.contains(*io) {
            out.push(format!(
                "gorgo-core reaches `{io}` through its dependencies; the core is sans-IO"
            ));
        }
    }
    out
}

fn cargo_metadata() -> Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--locked"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("cargo metadata JSON")
}

#[test]
fn the_workspace_follows_the_documented_crate_graph() {
    let graph = normal_graph(&cargo_metadata());
    let broken = violations(&graph);
    assert!(
        broken.is_empty(),
        "crate graph broken:\n{}",
        broken.join("\n")
    );
}

#[test]
fn the_checker_catches_a_forbidden_edge_and_a_runtime_in_the_core() {
    let mut graph = normal_graph(&cargo_metadata());
    graph
        .get_mut("gorgo-sim")
        .unwrap()
        .insert("gorgo-node".into());
    graph.get_mut("gorgo-core").unwrap().insert("bytes".into());
    graph
        .entry("bytes".into())
        .or_default()
        .insert("tokio".into());
    let broken = violations(&graph);
    assert!(
        broken
            .iter()
            .any(|l| l.starts_with("gorgo-sim depends on gorgo-node")),
        "{broken:?}"
    );
    assert!(broken.iter().any(|l| l.contains("`tokio`")), "{broken:?}");
}

#[test]
fn the_design_doc_lists_every_crate() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/design.md"))
        .expect("docs/design.md");
    for (krate, _) in ALLOWED {
        assert!(
            doc.contains(&format!("`{krate}`")),
            "{krate} not in docs/design.md"
        );
    }
}

/// The modules of one crate's `src` that each top-level module names through
/// `crate::` (in code, not comments; tests excluded): module -> modules it imports.
/// The crate root (`lib.rs`, `main.rs`) declares every module and is left out.
type ModuleGraph = BTreeMap<String, BTreeSet<String>>;

/// The `crate::` module names in `code`: `crate::a::X` and the lowercase items of
/// `crate::{a, b::Y, Z}` (uppercase ones are the root's own items).
fn crate_paths(code: &str) -> BTreeSet<String> {
    let ident = |s: &str| -> String {
        s.trim()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = BTreeSet::new();
    for line in code.lines() {
        if line.trim_start().starts_with("//") {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            let before = rest[..at].chars().next_back();
            rest = &rest[at + "crate::".len()..];
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                continue;
            }
            let items: Vec<String> = match rest.strip_prefix('{') {
                Some(group) => group
                    .split('}')
                    .next()
                    .unwrap_or("")
                    .split(',')
                    .map(ident)
                    .collect(),
                None => vec![ident(rest)],
            };
            out.extend(
                items
                    .into_iter()
                    .filter(|i| i.starts_with(|c: char| c.is_ascii_lowercase()))
                    .filter(|i| !matches!(i.as_str(), "self" | "super" | "crate")),
            );
        }
    }
    out
}

/// The module graph of the crate whose sources are under `src`.
fn module_graph(src: &std::path::Path) -> ModuleGraph {
    fn walk(dir: &std::path::Path, files: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read src dir") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                walk(&path, files);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let mut files = Vec::new();
    walk(src, &mut files);
    let mut graph = ModuleGraph::new();
    for file in files {
        let rel = file.strip_prefix(src).expect("under src");
        let first = rel.components().next().expect("a file");
        let module = first
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_owned();
        if module == "lib" || module == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("read source");
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        let uses = graph.entry(module.clone()).or_default();
        uses.extend(crate_paths(code).into_iter().filter(|m| *m != module));
    }
    graph
}

/// Pairs of modules that import each other.
fn mutual_imports(graph: &ModuleGraph) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (a, uses) in graph {
        for b in uses.iter().filter(|b| a < *b) {
            if graph.get(b).is_some_and(|back| back.contains(a)) {
                out.push((a.clone(), b.clone()));
            }
        }
    }
    out
}

/// docs/design.md: "Data flows one way through a request path: no two modules import
/// each other". Checked in every library crate.
#[test]
fn no_two_modules_of_a_crate_import_each_other() {
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crates");
    let mut broken = Vec::new();
    for entry in std::fs::read_dir(&crates).expect("crates/") {
        let src = entry.expect("dir entry").path().join("src");
        if !src.is_dir() {
            continue;
        }
        for (a, b) in mutual_imports(&module_graph(&src)) {
            broken.push(format!("{}: {a} <-> {b}", src.display()));
        }
    }
    assert!(
        broken.is_empty(),
        "modules importing each other:\n{}",
        broken.join("\n")
    );
}

#[test]
fn the_module_checker_reads_grouped_paths_and_finds_a_pair() {
    let paths = crate_paths(
        "use crate::{telemetry, NodeState};\nuse crate::cost::queue_ms;\n// crate::ignored\nlet x = gorgo_crate::no;",
    );
    assert_eq!(paths.into_iter().collect::<Vec<_>>(), ["cost", "telemetry"]);
    let mut graph = ModuleGraph::new();
    graph
        .entry("local".into())
        .or_default()
        .insert("kv_events".into());
    graph
        .entry("kv_events".into())
        .or_default()
        .insert("local".into());
    graph
        .entry("serve".into())
        .or_default()
        .insert("local".into());
    assert_eq!(
        mutual_imports(&graph),
        [("kv_events".to_owned(), "local".to_owned())]
    );
}
