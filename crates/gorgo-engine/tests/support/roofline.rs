//! The memory-bandwidth roofline of every built-in engine profile: the inputs the
//! profiles' decode costs and KV capacities are derived from (docs/engine-profiles.md).
//!
//! Shared by `tests/profile_roofline.rs` (which pins each profile to these figures) and
//! `examples/profile_table.rs` (the decode tables in the doc).
//!
//! A decode step reads every weight it needs once and the KV of every context token
//! once, at the GPU's memory bandwidth times an efficiency:
//! `step_overhead_ms + (weight_bytes_read(b) + kv_bytes_per_token * c) / (bandwidth * efficiency)`.
#![allow(dead_code)]

/// Where a profile's KV capacity comes from.
#[derive(Debug, Clone, Copy)]
pub enum Capacity {
    /// `gpu_memory_bytes * mem_fraction - weight_bytes`, over `kv_bytes_per_token`.
    FromMemory {
        /// GPU memory of the engine (all its GPUs), bytes.
        gpu_memory_bytes: f64,
        /// SGLang's `mem_fraction_static`: weights + KV; the rest is the activation reserve.
        mem_fraction: f64,
    },
    /// Reported by the real engine (a metrics scrape); not derived.
    Reported,
}

/// Roofline inputs of one built-in profile.
#[derive(Debug, Clone, Copy)]
pub struct Roofline {
    /// Profile name.
    pub profile: &'static str,
    /// Memory bandwidth of the engine's GPUs together, bytes/s.
    pub bandwidth_bytes_per_s: f64,
    /// Fraction of that bandwidth a serving engine's decode step achieves.
    pub efficiency: f64,
    /// Weights read by every step whatever the batch, bytes (all of a dense model).
    pub dense_weight_bytes: f64,
    /// Routed experts per MoE layer (0 for a dense model).
    pub experts: u32,
    /// Experts each token routes to.
    pub active_experts: u32,
    /// Bytes of one expert over all layers.
    pub expert_bytes: f64,
    /// All weights, bytes (what sits in GPU memory).
    pub weight_bytes: f64,
    /// KV bytes per context token.
    pub kv_bytes_per_token: f64,
    /// Per-step time outside the roofline, ms (fitted; 0 unless the doc says otherwise).
    pub step_overhead_ms: f64,
    /// Batch at which the full-KV step is pinned (the KV spread over this many sequences).
    pub full_kv_batch: usize,
    /// Where the KV capacity comes from.
    pub capacity: Capacity,
}

/// Published figures used below (docs/engine-profiles.md lists the sources).
pub const A100_80GB_BW: f64 = 2.0e12;
/// H200 141 GB, HBM3e.
pub const H200_BW: f64 = 4.8e12;
/// L40S 48 GB, GDDR6.
pub const L40S_BW: f64 = 864e9;
/// gpt-fast: Llama-2-7B bf16 batch-1 decode at 1,397 GB/s on A100-80GB (68.5% of
/// 2,039 GB/s), rounded.
pub const SERVING_DECODE_EFFICIENCY: f64 = 0.70;
/// Mistral-7B: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes.
pub const MISTRAL7B_KV_BYTES: f64 = 131_072.0;
/// Mistral-7B: 7.24 B params in bf16.
pub const MISTRAL7B_WEIGHT_BYTES: f64 = 14.5e9;

/// The four built-in profiles' rooflines.
pub const ROOFLINES: [Roofline; 4] = [
    Roofline {
        profile: "paper-a100-mistral7b",
        bandwidth_bytes_per_s: A100_80GB_BW,
        efficiency: SERVING_DECODE_EFFICIENCY,
        dense_weight_bytes: MISTRAL7B_WEIGHT_BYTES,
        experts: 0,
        active_experts: 0,
        expert_bytes: 0.0,
        weight_bytes: MISTRAL7B_WEIGHT_BYTES,
        kv_bytes_per_token: MISTRAL7B_KV_BYTES,
        step_overhead_ms: 0.0,
        full_kv_batch: 64,
        capacity: Capacity::FromMemory {
            gpu_memory_bytes: 80e9,
            mem_fraction: 0.88,
        },
    },
    Roofline {
        profile: "h200-mistral7b",
        bandwidth_bytes_per_s: H200_BW,
        efficiency: SERVING_DECODE_EFFICIENCY,
        dense_weight_bytes: MISTRAL7B_WEIGHT_BYTES,
        experts: 0,
        active_experts: 0,
        expert_bytes: 0.0,
        weight_bytes: MISTRAL7B_WEIGHT_BYTES,
        kv_bytes_per_token: MISTRAL7B_KV_BYTES,
        step_overhead_ms: 0.0,
        full_kv_batch: 64,
        capacity: Capacity::FromMemory {
            gpu_memory_bytes: 141e9,
            mem_fraction: 0.88,
        },
    },
    Roofline {
        profile: "h200-dense-1.5b",
        bandwidth_bytes_per_s: H200_BW,
        efficiency: SERVING_DECODE_EFFICIENCY,
        // 1.777 B params (the calibration file's shape) in bf16.
        dense_weight_bytes: 3.554e9,
        experts: 0,
        active_experts: 0,
        expert_bytes: 0.0,
        weight_bytes: 3.554e9,
        // 28 layers x 2 KV heads x 128 x 2 x 2 bytes.
        kv_bytes_per_token: 28_672.0,
        step_overhead_ms: 0.0,
        full_kv_batch: 256,
        capacity: Capacity::FromMemory {
            gpu_memory_bytes: 141e9,
            mem_fraction: 0.88,
        },
    },
    Roofline {
        profile: "paper-l40s-qwen35b-a3b",
        // Tensor parallel over two L40S: each reads half the weights and KV.
        bandwidth_bytes_per_s: 2.0 * L40S_BW,
        efficiency: SERVING_DECODE_EFFICIENCY,
        // ASSUMED shape (docs/engine-profiles.md): FP8, 35 GB in all, 1.5 GB dense
        // (attention, shared expert, embeddings), 256 routed experts, 8 per token.
        dense_weight_bytes: 1.5e9,
        experts: 256,
        active_experts: 8,
        expert_bytes: (35e9 - 1.5e9) / 256.0,
        weight_bytes: 35e9,
        // ASSUMED: 10 full-attention layers x 2 KV heads x 256 x 2 x 2 bytes.
        kv_bytes_per_token: 20_480.0,
        // Fitted to the Apr 5 run's ITL p50 (docs/engine-profiles.md).
        step_overhead_ms: 4.5,
        full_kv_batch: 32,
        capacity: Capacity::Reported,
    },
];

impl Roofline {
    /// The roofline of a built-in profile by name.
    pub fn of(profile: &str) -> Option<&'static Roofline> {
        ROOFLINES.iter().find(|r| r.profile == profile)
    }

    /// Weights a decode step over `batch` sequences reads: the dense part plus every
    /// expert at least one token routes to (expected union, uniform routing).
    pub fn weight_bytes_read(&self, batch: usize) -> f64 {
        if self.experts == 0 {
            return self.dense_weight_bytes;
        }
        let miss = 1.0 - self.active_experts as f64 / self.experts as f64;
        let touched = self.experts as f64 * (1.0 - miss.powi(batch.max(1) as i32));
        self.dense_weight_bytes + self.expert_bytes * touched
    }

    /// Roofline decode step over `batch` sequences with `context_tokens` in all, ms.
    pub fn decode_step_ms(&self, batch: usize, context_tokens: u64) -> f64 {
        let bytes = self.weight_bytes_read(batch) + self.kv_bytes_per_token * context_tokens as f64;
        self.step_overhead_ms + 1e3 * bytes / (self.bandwidth_bytes_per_s * self.efficiency)
    }

    /// KV capacity derived from memory, tokens (`None` when the profile's is reported).
    pub fn kv_capacity_tokens(&self) -> Option<f64> {
        match self.capacity {
            Capacity::FromMemory {
                gpu_memory_bytes,
                mem_fraction,
            } => Some(
                (gpu_memory_bytes * mem_fraction - self.weight_bytes) / self.kv_bytes_per_token,
            ),
            Capacity::Reported => None,
        }
    }
}
