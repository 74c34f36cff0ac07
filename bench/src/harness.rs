//! Timing harness: repeated samples, medians, and one table of rows side by side.
//!
//! These machines are noisy, so every figure is a median over many samples and every
//! comparison is made within one run (flowhost and its baseline measured interleaved).

use std::time::{Duration, Instant};

/// A set of per-operation timings.
#[derive(Debug, Clone)]
pub struct Samples(pub Vec<Duration>);

impl Samples {
    /// The median sample.
    pub fn median(&self) -> Duration {
        let mut v = self.0.clone();
        v.sort_unstable();
        if v.is_empty() {
            return Duration::ZERO;
        }
        v[v.len() / 2]
    }

    /// The p-th percentile (0..=100) sample.
    pub fn percentile(&self, p: usize) -> Duration {
        let mut v = self.0.clone();
        v.sort_unstable();
        if v.is_empty() {
            return Duration::ZERO;
        }
        v[((v.len() - 1) * p.min(100)) / 100]
    }
}

/// Times `batch` calls of `f` per sample, `samples` times, and returns per-call durations.
pub fn per_call(samples: usize, batch: usize, mut f: impl FnMut()) -> Samples {
    let batch = batch.max(1);
    let mut out = Vec::with_capacity(samples);
    for _ in 0..samples {
        let start = Instant::now();
        for _ in 0..batch {
            f();
        }
        out.push(start.elapsed() / batch as u32);
    }
    Samples(out)
}

/// Measures two variants interleaved (A, B, A, B, ...) so drift affects both equally.
pub fn interleaved(
    samples: usize,
    batch: usize,
    mut a: impl FnMut(),
    mut b: impl FnMut(),
) -> (Samples, Samples) {
    let (mut sa, mut sb) = (Vec::with_capacity(samples), Vec::with_capacity(samples));
    for _ in 0..samples {
        sa.extend(per_call(1, batch, &mut a).0);
        sb.extend(per_call(1, batch, &mut b).0);
    }
    (Samples(sa), Samples(sb))
}

/// One line of the results table.
#[derive(Debug, Clone)]
pub struct Row {
    /// What was measured.
    pub name: String,
    /// flowhost's figure, already formatted (e.g. "41.2 µs" or "3.1 M/s").
    pub flowhost: String,
    /// The baseline or peer and its figure, if the benchmark has one.
    pub baseline: Option<(String, String)>,
    /// The comparison (ratio or difference), formatted.
    pub comparison: String,
    /// The goal from the issue.
    pub goal: String,
    /// Whether the goal is met.
    pub met: bool,
}

/// Formats a duration with a sensible unit.
pub fn fmt_duration(d: Duration) -> String {
    let ns = d.as_nanos() as f64;
    if ns < 1_000.0 {
        format!("{ns:.0} ns")
    } else if ns < 1_000_000.0 {
        format!("{:.1} µs", ns / 1_000.0)
    } else if ns < 1_000_000_000.0 {
        format!("{:.2} ms", ns / 1_000_000.0)
    } else {
        format!("{:.2} s", ns / 1_000_000_000.0)
    }
}

/// Formats a rate per second.
pub fn fmt_rate(per_second: f64) -> String {
    if per_second >= 1_000_000.0 {
        format!("{:.2} M/s", per_second / 1_000_000.0)
    } else if per_second >= 1_000.0 {
        format!("{:.1} k/s", per_second / 1_000.0)
    } else {
        format!("{per_second:.0}/s")
    }
}

/// Prints the rows as one Markdown table (so it can be pasted into BENCHMARKS.md).
pub fn print_table(rows: &[Row]) {
    println!("| benchmark | flowhost | baseline / peer | comparison | goal | met |");
    println!("|---|---|---|---|---|---|");
    for r in rows {
        let baseline = r
            .baseline
            .as_ref()
            .map(|(name, fig)| format!("{fig} ({name})"))
            .unwrap_or_else(|| "—".to_string());
        println!(
            "| {} | {} | {} | {} | {} | {} |",
            r.name,
            r.flowhost,
            baseline,
            r.comparison,
            r.goal,
            if r.met { "yes" } else { "NO" }
        );
    }
}
