//! The per-request record every driver (live bench, simulator) produces.

use serde::{Deserialize, Serialize};

/// One request's outcome, as measured where the client is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Routing policy the request ran under.
    pub policy: String,
    /// The trace's (or the driver's) request id.
    pub request_id: String,
    /// The client's home region: the node it sent the request to.
    pub region: String,
    /// The region whose engine served it (`None` when it failed before any did).
    pub served_by: Option<String>,
    /// Forwards between nodes (0: served in the home region).
    pub hops: u32,
    /// Time to first token, ms.
    pub ttft_ms: f64,
    /// End-to-end latency, ms.
    pub e2e_ms: f64,
    /// Mean inter-token latency, ms, when the driver measured it; otherwise derived
    /// by [`RequestRecord::itl`].
    pub itl_ms: Option<f64>,
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Generated tokens.
    pub output_tokens: u64,
    /// Prompt tokens the engine reported cached, when it reports them.
    pub cached_tokens: Option<u64>,
    /// The TTFT the cost model predicted for the chosen candidate when the client's node
    /// decided, ms (`gorgo_core::cost::estimated_ttft_ms`); `None` for policies that do
    /// not estimate costs, or when the driver did not get one.
    #[serde(default)]
    pub predicted_ttft_ms: Option<f64>,
    /// The longest prefix of the prompt any engine of the cluster held when the client's
    /// node decided: what a perfect placement could have used. Only the simulator knows
    /// it (`None` live); `scripts/floor_gap.py` splits cache misses with it.
    #[serde(default)]
    pub cached_anywhere_tokens: Option<u64>,
    /// Send time, ms from the start of the run.
    pub start_ms: f64,
    /// When a successful (2xx) response head arrived, ms after `start_ms` (the
    /// scheduled send: subtract `slip_ms` of `requests.csv` for the time after the
    /// actual send): the stream began. `None` when the request failed before one did (connect error, error
    /// status, timeout), or when the driver does not measure it (the simulator). A
    /// failed request that has it was cut mid-stream.
    #[serde(default)]
    pub first_byte_ms: Option<f64>,
    /// Times the client sent the request again because nothing answered it (refused
    /// or reset connections: a node restarting behind its address). 0 where the
    /// driver does not retry (the simulator).
    #[serde(default)]
    pub retries: u32,
    /// True when the request completed.
    pub ok: bool,
    /// Why it failed.
    pub error: Option<String>,
}

impl RequestRecord {
    /// Inter-token latency: the measured one, or `(E2E - TTFT) / (output_tokens - 1)`
    /// (docs/design.md); `None` with fewer than two output tokens.
    pub fn itl(&self) -> Option<f64> {
        if let Some(itl) = self.itl_ms {
            return itl.is_finite().then_some(itl);
        }
        (self.output_tokens >= 2 && self.e2e_ms.is_finite() && self.ttft_ms.is_finite())
            .then(|| (self.e2e_ms - self.ttft_ms).max(0.0) / (self.output_tokens - 1) as f64)
    }

    /// True when the request left its home region.
    pub fn forwarded(&self) -> bool {
        self.hops > 0
    }
}

/// `requests.csv`'s bytes: the header, then one row per record. The header is there
/// even without records (a simulation that kept no rows, `--max-rows`), so a reader
/// finds the columns rather than an empty file.
pub(crate) fn csv(records: &[RequestRecord]) -> Result<Vec<u8>, csv::Error> {
    let mut out = csv::Writer::from_writer(Vec::new());
    for r in records {
        out.serialize(CsvRow::from(r))?;
    }
    if records.is_empty() {
        // serde writes the header with the first row: write one for a blank record and
        // keep its header line, so the columns stay those of `CsvRow`.
        let blank = RequestRecord {
            policy: String::new(),
            request_id: String::new(),
            region: String::new(),
            served_by: None,
            hops: 0,
            ttft_ms: 0.0,
            e2e_ms: 0.0,
            itl_ms: None,
            input_tokens: 0,
            output_tokens: 0,
            cached_tokens: None,
            predicted_ttft_ms: None,
            cached_anywhere_tokens: None,
            start_ms: 0.0,
            first_byte_ms: None,
            retries: 0,
            ok: false,
            error: None,
        };
        out.serialize(CsvRow::from(&blank))?;
        let bytes = out.into_inner().map_err(|e| e.into_error())?;
        let header = bytes.iter().position(|&b| b == b'\n').map_or(0, |i| i + 1);
        return Ok(bytes[..header].to_vec());
    }
    Ok(out.into_inner().map_err(|e| e.into_error())?)
}

/// A `requests.csv` row: the record with ITL filled in where it can be derived.
#[derive(Serialize)]
pub(crate) struct CsvRow<'a> {
    policy: &'a str,
    request_id: &'a str,
    region: &'a str,
    served_by: Option<&'a str>,
    hops: u32,
    ttft_ms: f64,
    e2e_ms: f64,
    itl_ms: Option<f64>,
    input_tokens: u64,
    output_tokens: u64,
    cached_tokens: Option<u64>,
    predicted_ttft_ms: Option<f64>,
    start_ms: f64,
    ok: bool,
    error: Option<&'a str>,
    first_byte_ms: Option<f64>,
    retries: u32,
    // Last, so the columns before it keep their places for older readers.
    cached_anywhere_tokens: Option<u64>,
}

impl<'a> From<&'a RequestRecord> for CsvRow<'a> {
    fn from(r: &'a RequestRecord) -> Self {
        CsvRow {
            policy: &r.policy,
            request_id: &r.request_id,
            region: &r.region,
            served_by: r.served_by.as_deref(),
            hops: r.hops,
            ttft_ms: r.ttft_ms,
            e2e_ms: r.e2e_ms,
            itl_ms: r.itl(),
            input_tokens: r.input_tokens,
            output_tokens: r.output_tokens,
            cached_tokens: r.cached_tokens,
            predicted_ttft_ms: r.predicted_ttft_ms,
            start_ms: r.start_ms,
            ok: r.ok,
            error: r.error.as_deref(),
            first_byte_ms: r.first_byte_ms,
            retries: r.retries,
            cached_anywhere_tokens: r.cached_anywhere_tokens,
        }
    }
}
