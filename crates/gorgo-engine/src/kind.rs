//! Which real engine the emulator passes for.
//!
//! A node reads an engine's `/metrics` by the names of the kind its config states,
//! and clients meet that engine's API defaults and error bodies: an emulator that
//! mixed SGLang's metric names with vLLM's API would stand in for neither. Each
//! [`EmulatedKind`] is one engine throughout (docs/engine-profiles.md, "The emulator").

use crate::EngineError;

/// The engine whose `/metrics` names, API defaults and error bodies the emulator
/// takes on. SGLang by default: its metric names and `/get_server_info` are what
/// `gorgo up` and every node config beside an emulator (`kind = "sglang"`) read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EmulatedKind {
    /// SGLang: `sglang:` metrics, `/get_server_info`, flat error bodies
    /// (`{"object":"error","message",...}`), `stream_options` ignored without
    /// `stream`, `max_tokens` of `/v1/completions` an integer (16 when absent).
    #[default]
    Sglang,
    /// vLLM: `vllm:` metrics (V1 engine names), no `/get_server_info`, errors under
    /// `"error"`, `stream_options` refused without `stream` and read as asking for
    /// usage when it leaves `include_usage` out.
    Vllm,
}

impl EmulatedKind {
    /// Every kind, in the order the CLI lists them.
    pub const ALL: [EmulatedKind; 2] = [EmulatedKind::Sglang, EmulatedKind::Vllm];

    /// The name a node config and `gorgo engine --kind` use for it.
    pub fn name(self) -> &'static str {
        match self {
            EmulatedKind::Sglang => "sglang",
            EmulatedKind::Vllm => "vllm",
        }
    }
}

impl std::fmt::Display for EmulatedKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for EmulatedKind {
    type Err = EngineError;

    /// The config's spelling (`sglang`, `vllm`); anything else, `openai` included (an
    /// engine without metrics has nothing to emulate), is refused naming the choices.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EmulatedKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| EngineError::UnknownKind { name: s.to_owned() })
    }
}

impl From<EmulatedKind> for gorgo_core::EngineKind {
    /// The kind a node fronting this emulator states in its config.
    fn from(kind: EmulatedKind) -> Self {
        match kind {
            EmulatedKind::Sglang => gorgo_core::EngineKind::Sglang,
            EmulatedKind::Vllm => gorgo_core::EngineKind::Vllm,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_others_are_refused_naming_the_choices() {
        for kind in EmulatedKind::ALL {
            assert_eq!(kind.name().parse::<EmulatedKind>().unwrap(), kind);
            assert_eq!(
                gorgo_core::EngineKind::from(kind).to_string(),
                kind.name(),
                "a node names it as the emulator does"
            );
        }
        for bad in ["openai", "SGLang", "", "vllm "] {
            let e = bad.parse::<EmulatedKind>().unwrap_err().to_string();
            assert!(e.contains("sglang") && e.contains("vllm"), "{bad:?}: {e}");
        }
        assert_eq!(EmulatedKind::default(), EmulatedKind::Sglang);
    }
}
