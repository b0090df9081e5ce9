//! `gorgo trace stats|convert|generate`: inspect, convert and generate workload traces.

use std::fs::File;
use std::io::{BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

use gorgo_files::AtomicFile;
use gorgo_workload::generate::zipf_weights;
use gorgo_workload::{
    open_trace, slice_window, spread_ties, GeneratorConfig, JsonlWriter, StatsAccumulator,
    TraceFormat, TraceReader,
};

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct TraceArgs {
    #[command(subcommand)]
    command: TraceCommand,
}

#[derive(clap::Subcommand, Debug)]
enum TraceCommand {
    /// Print a trace's request count, span, rate, length percentiles, block reuse and
    /// per-user figures.
    Stats(StatsArgs),
    /// Convert a trace (Mooncake, ART-Chat, Azure, generator JSONL) to the generator's
    /// JSONL, optionally cutting a time window.
    Convert(ConvertArgs),
    /// Generate a session-based synthetic trace (defaults: ART-Chat-2.5M's window shape).
    Generate(GenerateArgs),
}

#[derive(clap::Args, Debug)]
struct StatsArgs {
    /// Trace file.
    file: PathBuf,
    /// Print JSON (the keys of docs/design.md's Interfaces) instead of a table.
    #[arg(long)]
    json: bool,
    /// Input format: mooncake, art, azure, gorgo (default: detect).
    #[arg(long)]
    format: Option<TraceFormat>,
}

#[derive(clap::Args, Debug)]
struct ConvertArgs {
    /// Input trace file.
    input: PathBuf,
    /// Output JSONL file (`-` for stdout); written whole or not at all, so it may be
    /// the input itself.
    #[arg(long)]
    out: PathBuf,
    /// Input format: mooncake, art, azure, gorgo (default: detect).
    #[arg(long)]
    format: Option<TraceFormat>,
    /// Keep requests from this many seconds after the trace's origin (rebased to 0).
    #[arg(long, default_value_t = 0.0)]
    window_start: f64,
    /// Keep this many seconds from the window start (default: to the end).
    #[arg(long)]
    duration: Option<f64>,
    /// Spread the requests that share a timestamp uniformly over the interval to the next
    /// timestamp, keeping their order (for traces recorded on a coarse clock, such as the
    /// Mooncake conversation trace's 3-second grid). Applied before the window.
    #[arg(long)]
    spread_ties: bool,
    /// Seed of the spread's draws (with `--spread-ties`).
    #[arg(long, default_value_t = 0, requires = "spread_ties")]
    seed: u64,
}

#[derive(clap::Args, Debug)]
struct GenerateArgs {
    /// Output JSONL file (`-` for stdout).
    #[arg(long)]
    out: PathBuf,
    /// Generator parameters from a TOML file (fields of `GeneratorConfig`); flags override.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Seed of the random stream.
    #[arg(long)]
    seed: Option<u64>,
    /// Window length in seconds.
    #[arg(long)]
    duration_s: Option<f64>,
    /// Distinct users.
    #[arg(long)]
    users: Option<u32>,
    /// Home regions, comma-separated.
    #[arg(long, value_delimiter = ',')]
    regions: Option<Vec<String>>,
    /// Relative user share per region, comma-separated (default: skewed 1, 1/2, 1/3...).
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
    region_weights: Option<Vec<f64>>,
    /// UTC offset in hours per region, comma-separated (default: 0 for custom regions).
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
    region_utc_offsets: Option<Vec<f64>>,
    /// Time of day (UTC hours) at the window start.
    #[arg(long)]
    start_hour_utc: Option<f64>,
    /// Diurnal swing of each region's rate, 0..1.
    #[arg(long)]
    diurnal_amplitude: Option<f64>,
    /// Mean requests per user per 30 minutes.
    #[arg(long)]
    requests_per_user: Option<f64>,
    /// Output tokens per request (`max_tokens`).
    #[arg(long)]
    output_tokens: Option<u32>,
    /// Also print the generated trace's statistics.
    #[arg(long)]
    stats: bool,
}

/// Run `gorgo trace ...`.
pub fn run(args: TraceArgs) -> anyhow::Result<()> {
    match args.command {
        TraceCommand::Stats(a) => stats(a),
        TraceCommand::Convert(a) => convert(a),
        TraceCommand::Generate(a) => generate(a),
    }
}

fn open(path: &Path, format: Option<TraceFormat>) -> anyhow::Result<TraceReader<BufReader<File>>> {
    let reader = match format {
        Some(f) => TraceReader::new(
            BufReader::new(File::open(path).with_context(|| format!("open {}", path.display()))?),
            f,
        ),
        None => open_trace(path).with_context(|| format!("open {}", path.display()))?,
    };
    Ok(reader)
}

/// Where a converted or generated trace goes: stdout, or a file written whole or not
/// at all ([`AtomicFile`]: the input of `convert F --out F` is read to its end before
/// it is replaced, never truncated under the reader).
enum Output {
    Stdout(BufWriter<std::io::StdoutLock<'static>>),
    File(AtomicFile, PathBuf),
}

impl Output {
    fn create(path: &Path) -> anyhow::Result<Self> {
        if path.as_os_str() == "-" {
            return Ok(Output::Stdout(BufWriter::new(std::io::stdout().lock())));
        }
        let file =
            AtomicFile::create(path).with_context(|| format!("create {}", path.display()))?;
        Ok(Output::File(file, path.to_path_buf()))
    }

    /// Flush, and put a file output in place.
    fn commit(self) -> anyhow::Result<()> {
        match self {
            Output::Stdout(mut out) => out.flush().context("writing to stdout"),
            Output::File(file, path) => file
                .commit()
                .with_context(|| format!("writing {}", path.display())),
        }
    }
}

impl Write for Output {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Output::Stdout(out) => out.write(buf),
            Output::File(file, _) => file.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Output::Stdout(out) => out.flush(),
            Output::File(file, _) => file.flush(),
        }
    }
}

fn stats(a: StatsArgs) -> anyhow::Result<()> {
    let mut acc = StatsAccumulator::new();
    for r in open(&a.file, a.format)? {
        acc.push(&r.with_context(|| a.file.display().to_string())?);
    }
    let s = acc.finish();
    // Statistics of nothing are zeros that read as a result, as `sim` and `bench`
    // refuse to report on no request.
    if s.requests == 0 {
        bail!("{} holds no request", a.file.display());
    }
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        out!("{}", s.render());
    }
    Ok(())
}

fn seconds_to_ms(field: &str, s: f64) -> anyhow::Result<u64> {
    if !(s.is_finite() && s >= 0.0) {
        bail!("--{field} must be a non-negative number of seconds, got {s}");
    }
    Ok((s * 1000.0).round() as u64)
}

fn convert(a: ConvertArgs) -> anyhow::Result<()> {
    let start = seconds_to_ms("window-start", a.window_start)?;
    let duration = a
        .duration
        .map(|d| seconds_to_ms("duration", d))
        .transpose()?;
    let reader = open(&a.input, a.format)?;
    let mut out = JsonlWriter::new(Output::create(&a.out)?);
    let mut n = 0u64;
    if a.spread_ties {
        let mut all = reader
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| a.input.display().to_string())?;
        let moved = spread_ties(&mut all, a.seed);
        eprintln!(
            "spread {moved} of {} requests sharing a timestamp",
            all.len()
        );
        for r in slice_window(all.into_iter().map(Ok), start, duration) {
            // The spread can move the last stamps past what a trace may hold.
            out.write(&r?).with_context(|| {
                format!("--out {} (times after --spread-ties)", a.out.display())
            })?;
            n += 1;
        }
    } else {
        for r in slice_window(reader, start, duration) {
            out.write(&r.with_context(|| a.input.display().to_string())?)
                .with_context(|| format!("--out {}", a.out.display()))?;
            n += 1;
        }
    }
    out.finish()?.commit()?;
    eprintln!("wrote {n} requests to {}", a.out.display());
    Ok(())
}

/// The `trace generate` flag that sets generator field `field`, where one does.
fn generator_flag(field: &str) -> Option<&'static str> {
    Some(match field {
        "duration_s" => "duration-s",
        "users" => "users",
        "regions" => "regions",
        "region_weights" => "region-weights",
        "region_utc_offsets_h" => "region-utc-offsets",
        "start_hour_utc" => "start-hour-utc",
        "diurnal_amplitude" => "diurnal-amplitude",
        "requests_per_user" => "requests-per-user",
        _ => return None,
    })
}

fn generate(a: GenerateArgs) -> anyhow::Result<()> {
    let mut cfg = match &a.config {
        Some(p) => {
            let text = gorgo_files::read_capped(p, gorgo_files::MAX_CONFIG_FILE_BYTES)
                .with_context(|| format!("--config {}", p.display()))?;
            GeneratorConfig::from_toml_str(&text)
                .with_context(|| format!("parse {}", p.display()))?
        }
        None => GeneratorConfig::default(),
    };
    if let Some(v) = a.seed {
        cfg.seed = v;
    }
    if let Some(v) = a.duration_s {
        cfg.duration_s = v;
    }
    if let Some(v) = a.users {
        cfg.users = v;
    }
    if let Some(regions) = a.regions {
        if regions != cfg.regions {
            // Custom regions: skewed sizes, no diurnal phase difference unless given.
            cfg.region_weights = zipf_weights(regions.len());
            cfg.region_utc_offsets_h = vec![0.0; regions.len()];
            cfg.regions = regions;
        }
    }
    if let Some(v) = a.region_weights {
        cfg.region_weights = v;
    }
    if let Some(v) = a.region_utc_offsets {
        cfg.region_utc_offsets_h = v;
    }
    if let Some(v) = a.start_hour_utc {
        cfg.start_hour_utc = v;
    }
    if let Some(v) = a.diurnal_amplitude {
        cfg.diurnal_amplitude = v;
    }
    if let Some(v) = a.requests_per_user {
        cfg.requests_per_user = v;
    }
    if let Some(v) = a.output_tokens {
        cfg.output_tokens = v;
    }
    // Checked before anything is drawn (the trace is held whole in memory: at most
    // `MAX_GENERATED_REQUESTS`), naming the flag that sets the field where one does.
    let requests = gorgo_workload::generate(&cfg).map_err(|e| {
        if let gorgo_workload::WorkloadError::InvalidConfig { field, reason } = &e {
            if let Some(flag) = generator_flag(field) {
                return anyhow::anyhow!("--{flag}: {reason}");
            }
        }
        anyhow::Error::from(e)
    })?;
    let mut out = Output::create(&a.out)?;
    let n = gorgo_workload::write_jsonl(&mut out, &requests)
        .with_context(|| format!("--out {}", a.out.display()))?;
    out.commit()?;
    eprintln!("wrote {n} requests to {}", a.out.display());
    if a.stats {
        out!(
            "{}",
            gorgo_workload::TraceStats::from_requests(&requests).render()
        );
    }
    Ok(())
}
