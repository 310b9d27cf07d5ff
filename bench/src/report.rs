//! Summaries of a run: statistics per transport, pairwise ratios, and the outputs
//! (JSON, CSV, Markdown, PNG plots).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use serde_json::Value;

use crate::client::Measure;
use crate::record::Record;
use crate::stats::{percentile, Line, Stats};

/// One attempt as the run loop saw it.
#[derive(Clone, Debug)]
pub struct Attempt {
    pub id: i64,
    pub transport: String,
    pub result: Result<Measure, String>,
}

/// The pairs of one configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub model: String,
    pub profile: String,
    pub target_prompt_tokens: usize,
    pub max_tokens: u32,
    pub transports: Vec<String>,
    /// Index 0 is the warm-up.
    pub pairs: Vec<Vec<Attempt>>,
}

/// A concurrency run of one transport.
#[derive(Clone, Debug)]
pub struct Concurrency {
    pub model: String,
    pub profile: String,
    pub transport: String,
    pub clients: usize,
    pub target_prompt_tokens: usize,
    pub max_tokens: u32,
    pub wall_s: f64,
    pub attempts: Vec<Attempt>,
}

type Metric = (&'static str, fn(&Measure) -> Option<f64>);

const METRICS: &[Metric] = &[
    ("prompt_tokens", |m| Some(m.prompt_tokens as f64)),
    ("completion_tokens", |m| Some(m.completion_tokens as f64)),
    ("ttft_ms", |m| Some(m.ttft_ms)),
    ("tpot_ms", |m| m.tpot_ms),
    ("itl_p90_ms", |m| {
        let mut s = m.itl_ms.clone();
        s.sort_by(f64::total_cmp);
        (!s.is_empty()).then(|| percentile(&s, 0.9))
    }),
    ("e2e_ms", |m| Some(m.e2e_ms)),
    ("decode_tps", |m| m.decode_tps),
    ("prefill_ms", |m| m.prefill_ms),
    ("handoff_ms", |m| m.handoff_ms),
    ("handoff_mb", |m| m.handoff_bytes.map(|b| b as f64 / 1e6)),
    // The answer's longest pause, and the one after its first token (the handoff's).
    ("itl_max_ms", |m| m.itl_ms.iter().copied().reduce(f64::max)),
    ("gap_1_2_ms", |m| m.itl_ms.first().copied()),
    ("switch_ms", |m| m.switch_ms),
    ("import_ms", |m| m.import_ms),
    ("prefill_tokens", |m| m.prefill_tokens.map(|n| n as f64)),
    ("phone_tokens", |m| m.phone_tokens.map(|n| n as f64)),
    ("laptop_cpu_ms", |m| m.laptop_cpu_ms),
];

const RATIO_METRICS: &[Metric] = &[
    ("ttft_ms", |m| Some(m.ttft_ms)),
    ("decode_tps", |m| m.decode_tps),
    ("e2e_ms", |m| Some(m.e2e_ms)),
];

/// The EdgeSplit transports' answers in a pair must be identical (the stock server's are
/// compared and recorded, but it is not our invariant). Returns, per attempt, whether its
/// answer equals the pair's reference (its first EdgeSplit attempt).
pub fn fidelity(pair: &[Attempt]) -> Vec<Option<bool>> {
    let reference = pair
        .iter()
        .find(|a| a.transport != "stock")
        .and_then(|a| a.result.as_ref().ok())
        .map(|m| m.text.clone());
    pair.iter()
        .map(|a| match (&a.result, &reference) {
            (Ok(m), Some(r)) => Some(&m.text == r),
            _ => None,
        })
        .collect()
}

/// A retained pair counts when every request succeeded and the EdgeSplit answers agree.
pub fn pair_counts(pair: &[Attempt]) -> bool {
    pair.iter().all(|a| a.result.is_ok())
        && fidelity(pair)
            .iter()
            .zip(pair)
            .all(|(same, a)| a.transport == "stock" || *same == Some(true))
}

impl Config {
    fn retained(&self) -> impl Iterator<Item = &Vec<Attempt>> {
        self.pairs.iter().skip(1).filter(|p| pair_counts(p))
    }

    pub fn failed(&self, transport: &str) -> usize {
        self.pairs
            .iter()
            .skip(1)
            .flatten()
            .filter(|a| a.transport == transport && a.result.is_err())
            .count()
    }

    pub fn mismatched_pairs(&self) -> usize {
        self.pairs
            .iter()
            .skip(1)
            .filter(|p| p.iter().all(|a| a.result.is_ok()) && !pair_counts(p))
            .count()
    }

    fn line(&self, subject: String, metric: &str, xs: &[(f64, Vec<i64>)]) -> Option<Line> {
        let values: Vec<f64> = xs.iter().map(|x| x.0).collect();
        Some(Line {
            model: self.model.clone(),
            profile: self.profile.clone(),
            target_prompt_tokens: self.target_prompt_tokens,
            max_tokens: self.max_tokens,
            subject,
            metric: metric.to_string(),
            stats: Stats::of(&values)?,
            attempt_ids: xs.iter().flat_map(|x| x.1.iter().copied()).collect(),
        })
    }

    /// Statistics per transport and metric, and pairwise ratios.
    pub fn summarise(&self) -> Vec<Line> {
        let mut out = Vec::new();
        for t in &self.transports {
            for (metric, f) in METRICS {
                let xs: Vec<(f64, Vec<i64>)> = self
                    .retained()
                    .flatten()
                    .filter(|a| &a.transport == t)
                    .filter_map(|a| Some((f(a.result.as_ref().ok()?)?, vec![a.id])))
                    .collect();
                out.extend(self.line(t.clone(), metric, &xs));
            }
        }
        for (a, b) in self.ratio_pairs() {
            for (metric, f) in RATIO_METRICS {
                let xs: Vec<(f64, Vec<i64>)> = self
                    .retained()
                    .filter_map(|p| {
                        let x = p.iter().find(|x| x.transport == a)?;
                        let y = p.iter().find(|y| y.transport == b)?;
                        let (vx, vy) = (f(x.result.as_ref().ok()?)?, f(y.result.as_ref().ok()?)?);
                        (vy > 0.0).then(|| (vx / vy, vec![x.id, y.id]))
                    })
                    .collect();
                out.extend(self.line(format!("ratio {a}/{b}"), metric, &xs));
            }
        }
        out
    }

    /// Each disaggregated transport against `local`, and every EdgeSplit transport
    /// against the stock server.
    fn ratio_pairs(&self) -> Vec<(String, String)> {
        let has = |t: &str| self.transports.iter().any(|x| x == t);
        let mut r = Vec::new();
        for t in &self.transports {
            if has("local") && t != "local" && t != "stock" {
                r.push((t.clone(), "local".to_string()));
            }
        }
        if has("stock") {
            for t in self.transports.iter().filter(|t| *t != "stock") {
                r.push((t.clone(), "stock".to_string()));
            }
        }
        r
    }
}

impl Concurrency {
    pub fn summarise(&self) -> Vec<Line> {
        let ok: Vec<(&Measure, i64)> = self
            .attempts
            .iter()
            .filter_map(|a| Some((a.result.as_ref().ok()?, a.id)))
            .collect();
        let ids: Vec<i64> = self.attempts.iter().map(|a| a.id).collect();
        let subject = format!("{} x{}", self.transport, self.clients);
        let mut out = Vec::new();
        let mut push = |metric: &str, values: Vec<f64>, ids: Vec<i64>| {
            if let Some(stats) = Stats::of(&values) {
                out.push(Line {
                    model: self.model.clone(),
                    profile: self.profile.clone(),
                    target_prompt_tokens: self.target_prompt_tokens,
                    max_tokens: self.max_tokens,
                    subject: subject.clone(),
                    metric: metric.to_string(),
                    stats,
                    attempt_ids: ids,
                });
            }
        };
        let tokens: u64 = ok.iter().map(|(m, _)| m.completion_tokens).sum();
        push(
            "requests_per_s",
            vec![ok.len() as f64 / self.wall_s],
            ids.clone(),
        );
        push(
            "output_tokens_per_s",
            vec![tokens as f64 / self.wall_s],
            ids.clone(),
        );
        push("failed", vec![(self.attempts.len() - ok.len()) as f64], ids);
        let okids: Vec<i64> = ok.iter().map(|x| x.1).collect();
        push(
            "ttft_ms",
            ok.iter().map(|(m, _)| m.ttft_ms).collect(),
            okids.clone(),
        );
        push(
            "tpot_ms",
            ok.iter().filter_map(|(m, _)| m.tpot_ms).collect(),
            okids.clone(),
        );
        push("e2e_ms", ok.iter().map(|(m, _)| m.e2e_ms).collect(), okids);
        out
    }
}

fn find<'a>(lines: &'a [Line], subject: &str, metric: &str) -> Option<&'a Stats> {
    lines
        .iter()
        .find(|l| l.subject == subject && l.metric == metric)
        .map(|l| &l.stats)
}

fn f(x: Option<f64>, digits: usize) -> String {
    x.map_or_else(|| "-".to_string(), |x| format!("{x:.digits$}"))
}

/// The Markdown summary.
pub fn markdown(
    header: &str,
    configs: &[(Config, Vec<Line>)],
    concurrency: &[(Concurrency, Vec<Line>)],
    profiles: &BTreeMap<String, String>,
) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "{header}");
    let mut groups: Vec<(String, String)> = configs
        .iter()
        .map(|(c, _)| (c.model.clone(), c.profile.clone()))
        .collect();
    groups.dedup();
    for (model, profile) in groups {
        let _ = writeln!(
            md,
            "\n### {model}, link `{profile}` ({})\n",
            profiles.get(&profile).map_or("", String::as_str)
        );
        let _ = writeln!(
            md,
            "| prompt tok | out tok | transport | n | TTFT ms median (p90) | TPOT ms | ITL p90 ms | longest gap ms | gap 1-2 ms | decode tok/s | e2e ms | handoff MB | handoff ms | tokens before switch | phone tokens | laptop CPU ms | failed |"
        );
        let _ = writeln!(
            md,
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        let mut ratios = String::new();
        for (c, lines) in configs
            .iter()
            .filter(|(c, _)| c.model == model && c.profile == profile)
        {
            for t in &c.transports {
                let g = |m: &str| find(lines, t, m);
                let _ = writeln!(
                    md,
                    "| {} | {} | {t} | {} | {} ({}) | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    f(g("prompt_tokens").map(|s| s.median), 0),
                    f(g("completion_tokens").map(|s| s.median), 0),
                    g("ttft_ms").map_or(0, |s| s.n),
                    f(g("ttft_ms").map(|s| s.median), 1),
                    f(g("ttft_ms").map(|s| s.p90), 1),
                    f(g("tpot_ms").map(|s| s.median), 2),
                    f(g("itl_p90_ms").map(|s| s.median), 2),
                    f(g("itl_max_ms").map(|s| s.median), 1),
                    f(g("gap_1_2_ms").map(|s| s.median), 1),
                    f(g("decode_tps").map(|s| s.median), 1),
                    f(g("e2e_ms").map(|s| s.median), 1),
                    f(g("handoff_mb").map(|s| s.median), 2),
                    f(g("handoff_ms").map(|s| s.median), 1),
                    f(g("prefill_tokens").map(|s| s.median), 0),
                    f(g("phone_tokens").map(|s| s.median), 0),
                    f(g("laptop_cpu_ms").map(|s| s.median), 0),
                    c.failed(t),
                );
            }
            for (a, b) in c.ratio_pairs() {
                let s = format!("ratio {a}/{b}");
                let g = |m: &str| find(lines, &s, m);
                // "median (min-max)" of one pairwise ratio.
                let cell = |m: &str| {
                    let st = g(m);
                    format!(
                        "{} ({}-{})",
                        f(st.map(|s| s.median), 3),
                        f(st.map(|s| s.min), 2),
                        f(st.map(|s| s.max), 2)
                    )
                };
                let _ = writeln!(
                    ratios,
                    "| {} | {a} / {b} | {} | {} | {} | {} |",
                    c.target_prompt_tokens,
                    g("ttft_ms").map_or(0, |s| s.n),
                    cell("ttft_ms"),
                    cell("decode_tps"),
                    cell("e2e_ms"),
                );
            }
            let bad = c.mismatched_pairs();
            if bad > 0 {
                let _ = writeln!(
                    ratios,
                    "| {} | **{bad} pairs with differing answers (not counted)** | | | | |",
                    c.target_prompt_tokens
                );
            }
        }
        if !ratios.is_empty() {
            let _ = writeln!(
                md,
                "\nPairwise ratios (median, min-max over retained pairs; TTFT and e2e: lower is better for the first, decode tok/s: higher):\n"
            );
            let _ = writeln!(
                md,
                "| target prompt tok | ratio | pairs | TTFT | decode tok/s | e2e |\n|---|---|---|---|---|---|"
            );
            md.push_str(&ratios);
        }
    }
    let stock: Vec<Option<bool>> = configs
        .iter()
        .flat_map(|(c, _)| c.pairs.iter().skip(1))
        .flat_map(|p| p.iter().zip(fidelity(p)))
        .filter(|(a, _)| a.transport == "stock")
        .map(|(_, same)| same)
        .collect();
    if !stock.is_empty() {
        let _ = writeln!(
            md,
            "
Stock llama-server answers identical to EdgeSplit's (temperature 0): {} of {}.",
            stock.iter().filter(|s| **s == Some(true)).count(),
            stock.len()
        );
    }
    if !concurrency.is_empty() {
        let _ = writeln!(
            md,
            "\n### Concurrency\n\n| model | link | transport | clients | requests | failed | req/s | output tok/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms |\n|---|---|---|---|---|---|---|---|---|---|"
        );
        for (c, lines) in concurrency {
            let s = format!("{} x{}", c.transport, c.clients);
            let g = |m: &str| find(lines, &s, m);
            let pct = |m: &str| {
                let mut v: Vec<f64> = c
                    .attempts
                    .iter()
                    .filter_map(|a| {
                        let r = a.result.as_ref().ok()?;
                        if m == "ttft" {
                            Some(r.ttft_ms)
                        } else {
                            r.tpot_ms
                        }
                    })
                    .collect();
                v.sort_by(f64::total_cmp);
                if v.is_empty() {
                    return "-".to_string();
                }
                format!(
                    "{:.1} / {:.1} / {:.1}",
                    percentile(&v, 0.5),
                    percentile(&v, 0.9),
                    percentile(&v, 0.99)
                )
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                c.model,
                c.profile,
                c.transport,
                c.clients,
                c.attempts.len(),
                f(g("failed").map(|s| s.mean), 0),
                f(g("requests_per_s").map(|s| s.mean), 2),
                f(g("output_tokens_per_s").map(|s| s.mean), 1),
                pct("ttft"),
                pct("tpot"),
            );
        }
    }
    md
}

/// Writes every attempt row and every summary row as JSON, the attempts as CSV.
pub fn write_tables(rec: &Record, out: &Path) -> anyhow::Result<()> {
    let attempts = rec.rows("attempts")?;
    let summaries = rec.rows("summaries")?;
    std::fs::write(
        out.join("samples.json"),
        serde_json::to_string_pretty(&attempts)?,
    )?;
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&summaries)?,
    )?;
    for (name, rows) in [("samples.csv", &attempts), ("summary.csv", &summaries)] {
        let mut w = csv::Writer::from_path(out.join(name))?;
        if let Some(first) = rows.first() {
            w.write_record(first.keys())?;
        }
        for r in rows {
            w.write_record(r.values().map(|v| match v {
                Value::Null => String::new(),
                Value::String(s) => s.clone(),
                other => other.to_string(),
            }))?;
        }
        w.flush()?;
    }
    Ok(())
}

/// Registers a TrueType font for the plots' text (Debian's fonts-dejavu-core).
fn font() -> anyhow::Result<()> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let path = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
        let bytes = std::fs::read(path).map_err(|e| {
            format!("{path}: {e} (install fonts-dejavu-core; scripts/setup.sh does)")
        })?;
        plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into()))
            .map_err(|_| format!("{path}: not a usable font"))
    })
    .clone()
    .map_err(|e| anyhow::anyhow!(e))
}

/// A line plot with a logarithmic x axis; `series` are (name, points).
pub fn plot(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> anyhow::Result<()> {
    font()?;
    let pts = series.iter().flat_map(|s| s.1.iter());
    let (mut x0, mut x1, mut y1) = (f64::MAX, f64::MIN, 0.0f64);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1) = (1.0, 10.0);
    }
    let (x0, x1) = ((x0 * 0.8).max(1.0), x1 * 1.25);
    let y1 = if y1 > 0.0 { y1 * 1.15 } else { 1.0 };
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d((x0..x1).log_scale(), 0.0..y1)
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    for (i, (name, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| anyhow::anyhow!("{e:?}"))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    root.present().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(())
}

/// The run's plots: TTFT, decode tok/s and handoff size against prompt length, one line
/// per (model, link profile, transport).
pub fn plots(configs: &[(Config, Vec<Line>)], out: &Path) -> anyhow::Result<Vec<String>> {
    // (model, profile, transport, metric) -> points.
    type Key<'a> = (String, String, String, &'a str);
    let mut by: BTreeMap<Key, Vec<(f64, f64)>> = BTreeMap::new();
    for (c, lines) in configs {
        for t in &c.transports {
            let x = find(lines, t, "prompt_tokens").map(|s| s.median);
            for metric in [
                "ttft_ms",
                "e2e_ms",
                "decode_tps",
                "handoff_mb",
                "phone_tokens",
                "laptop_cpu_ms",
            ] {
                if let (Some(x), Some(y)) = (x, find(lines, t, metric).map(|s| s.median)) {
                    by.entry((c.model.clone(), c.profile.clone(), t.clone(), metric))
                        .or_default()
                        .push((x, y));
                }
            }
        }
    }
    let models: std::collections::BTreeSet<&String> = by.keys().map(|k| &k.0).collect();
    let several_models = models.len() > 1;
    let series = |metric: &str, with_profile: bool| -> Vec<(String, Vec<(f64, f64)>)> {
        let mut s: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for ((model, profile, t, m), pts) in &by {
            if *m != metric {
                continue;
            }
            let mut name = t.clone();
            if with_profile {
                name = format!("{t} @ {profile}");
            }
            if several_models {
                name = format!("{model}: {name}");
            }
            let e = s.entry(name).or_default();
            if e.is_empty() {
                e.extend(pts);
            }
        }
        s.into_iter()
            .map(|(k, mut v)| {
                v.sort_by(|a, b| a.0.total_cmp(&b.0));
                (k, v)
            })
            .collect()
    };
    let mut files = Vec::new();
    for (file, title, y, metric, with_profile) in [
        (
            "ttft_vs_prompt.png",
            "Time to first token vs prompt length",
            "TTFT, median ms",
            "ttft_ms",
            true,
        ),
        (
            "decode_tps.png",
            "Decode speed vs prompt length",
            "decode tokens/s (server), median",
            "decode_tps",
            true,
        ),
        (
            "handoff_bytes.png",
            "Handoff size vs prompt length",
            "handoff MB, median",
            "handoff_mb",
            false,
        ),
        (
            "e2e_vs_prompt.png",
            "Whole answer vs prompt length",
            "e2e, median ms",
            "e2e_ms",
            true,
        ),
        (
            "phone_tokens.png",
            "Answer tokens the phone wrote vs prompt length",
            "decode-node tokens, median",
            "phone_tokens",
            true,
        ),
        (
            "laptop_cpu.png",
            "The laptop's CPU time per request vs prompt length",
            "prefill-node CPU ms, median",
            "laptop_cpu_ms",
            true,
        ),
    ] {
        plot(
            &out.join(file),
            title,
            "prompt tokens (log scale)",
            y,
            &series(metric, with_profile),
        )?;
        files.push(file.to_string());
    }
    plot(
        &out.join("token_gaps.png"),
        "Gaps between tokens through one answer (longest prompt, last pair)",
        "time since the request, ms (log scale)",
        "gap before the token, ms",
        &gap_series(configs),
    )?;
    files.push("token_gaps.png".to_string());
    Ok(files)
}

/// For each (model, link) at its longest prompt, one answer per transport (the last
/// retained pair's): each token's gap to the one before, at the time it came. A handoff
/// that stalls the answer shows as one tall point after the first token.
fn gap_series(configs: &[(Config, Vec<Line>)]) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut longest: BTreeMap<(String, String), &Config> = BTreeMap::new();
    for (c, _) in configs {
        let e = longest
            .entry((c.model.clone(), c.profile.clone()))
            .or_insert(c);
        if c.target_prompt_tokens > e.target_prompt_tokens {
            *e = c;
        }
    }
    let several_models = longest
        .keys()
        .map(|k| &k.0)
        .collect::<std::collections::BTreeSet<_>>()
        .len()
        > 1;
    let mut series = Vec::new();
    for ((model, profile), c) in longest {
        let Some(pair) = c.pairs.iter().skip(1).next_back() else {
            continue;
        };
        for a in pair {
            let Ok(m) = &a.result else { continue };
            let mut at = m.ttft_ms;
            let points = m
                .itl_ms
                .iter()
                .map(|gap| {
                    at += gap;
                    (at, *gap)
                })
                .collect();
            let mut name = format!("{} @ {profile}", a.transport);
            if several_models {
                name = format!("{model}: {name}");
            }
            series.push((name, points));
        }
    }
    series
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attempt(id: i64, t: &str, text: &str, ttft: f64) -> Attempt {
        Attempt {
            id,
            transport: t.into(),
            result: Ok(Measure {
                ttft_ms: ttft,
                e2e_ms: ttft * 2.0,
                decode_tps: Some(100.0),
                text: text.into(),
                ..Measure::default()
            }),
        }
    }

    #[test]
    fn pairs_with_differing_answers_or_failures_do_not_count() {
        let good = vec![attempt(1, "local", "a", 10.0), attempt(2, "v2", "a", 12.0)];
        let differ = vec![attempt(3, "local", "a", 10.0), attempt(4, "v2", "b", 12.0)];
        let mut failed = good.clone();
        failed[1].result = Err("HTTP 503".into());
        let stock_differs = vec![
            attempt(5, "local", "a", 10.0),
            attempt(6, "stock", "z", 5.0),
        ];
        assert!(pair_counts(&good));
        assert!(!pair_counts(&differ));
        assert!(!pair_counts(&failed));
        assert!(pair_counts(&stock_differs));
        assert_eq!(fidelity(&stock_differs), vec![Some(true), Some(false)]);

        let c = Config {
            model: "m".into(),
            profile: "loopback".into(),
            target_prompt_tokens: 16,
            max_tokens: 8,
            transports: vec!["local".into(), "v2".into()],
            pairs: vec![good.clone(), good, differ, failed],
        };
        assert_eq!(c.failed("v2"), 1);
        assert_eq!(c.mismatched_pairs(), 1);
        let lines = c.summarise();
        let ttft = find(&lines, "v2", "ttft_ms").unwrap();
        assert_eq!(ttft.n, 1, "warm-up, mismatched and failed pairs excluded");
        let r = lines
            .iter()
            .find(|l| l.subject == "ratio v2/local" && l.metric == "ttft_ms")
            .unwrap();
        assert!((r.stats.mean - 1.2).abs() < 1e-9);
        assert_eq!(
            r.attempt_ids,
            vec![2, 1],
            "the pair it came from: v2, then local"
        );
    }
}
