//! Statistics of the bench's measurements: [`Stats`] of one metric, the nearest-rank
//! [`percentile`], and the summary [`Line`] that the record stores and the report prints.

/// Statistics of one metric.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Stats {
    pub n: usize,
    pub mean: f64,
    pub median: f64,
    pub stddev: f64,
    pub min: f64,
    pub max: f64,
    pub p90: f64,
}

impl Stats {
    pub fn of(xs: &[f64]) -> Option<Stats> {
        if xs.is_empty() {
            return None;
        }
        let n = xs.len();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = if n > 1 {
            xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64
        } else {
            0.0
        };
        let mut s = xs.to_vec();
        s.sort_by(f64::total_cmp);
        let median = if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        };
        Some(Stats {
            n,
            mean,
            median,
            stddev: var.sqrt(),
            min: s[0],
            max: s[n - 1],
            p90: percentile(&s, 0.90),
        })
    }
}

/// Nearest-rank percentile of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A summary line, as stored in the `summaries` table.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Line {
    pub model: String,
    pub profile: String,
    pub target_prompt_tokens: usize,
    pub max_tokens: u32,
    pub subject: String,
    pub metric: String,
    pub stats: Stats,
    pub attempt_ids: Vec<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_and_percentiles() {
        let s = Stats::of(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!(
            (s.n, s.mean, s.median, s.min, s.max),
            (4, 2.5, 2.5, 1.0, 4.0)
        );
        assert!((s.stddev - 1.290_994).abs() < 1e-6);
        assert_eq!(s.p90, 4.0);
        let xs: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&xs, 0.9), 9.0);
        assert_eq!(percentile(&xs, 0.5), 5.0);
        assert!(Stats::of(&[]).is_none());
    }
}
