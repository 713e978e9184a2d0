//! The numbers InferenceX reports: output and request throughput over the measured run, and
//! TTFT, TPOT, ITL and end-to-end latency at mean, median, p90 and p99 across requests; each
//! request's own timings, for latency over time; and, where the server speculates, how many of
//! its drafted tokens were accepted (from its `/metrics`, bbc's or vLLM's).

use super::client::Measured;
use super::load::Outcome;
use serde::Serialize;
use std::fmt;
use std::time::Duration;

/// One latency metric across requests, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Distribution {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Distribution {
    pub fn of(values_ms: &[f64]) -> Self {
        if values_ms.is_empty() {
            return Self::default();
        }
        let mut sorted = values_ms.to_vec();
        sorted.sort_by(f64::total_cmp);
        Self {
            mean: sorted.iter().sum::<f64>() / sorted.len() as f64,
            p50: percentile(&sorted, 50.0),
            p90: percentile(&sorted, 90.0),
            p99: percentile(&sorted, 99.0),
        }
    }
}

/// numpy's default percentile (linear interpolation between closest ranks) of sorted values.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub input_tokens: usize,
    pub output_tokens: usize,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub ttft_ms: Distribution,
    pub tpot_ms: Distribution,
    pub itl_ms: Distribution,
    pub e2el_ms: Distribution,
    /// The first few failures' messages, to say why.
    pub errors: Vec<String>,
    /// Every request, in the order they were made.
    pub requests: Vec<RequestTiming>,
    /// Where the server drafted tokens during the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculation: Option<Speculation>,
}

/// Speculative decoding over a run: the server's counters' growth across it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Speculation {
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    /// Sequences' steps that carried drafts.
    pub drafts: u64,
    /// Accepted over drafted tokens.
    pub acceptance_rate: f64,
    /// Tokens a step carrying drafts gives a sequence: 1 + accepted / drafts (vLLM's mean
    /// acceptance length).
    pub mean_accepted_length: f64,
}

/// The counters speculation is measured by, bbc's names and then vLLM's: drafted tokens,
/// accepted tokens, drafts.
const SPECULATION_COUNTERS: [[&str; 3]; 2] = [
    [
        "bbc_spec_decode_draft_tokens_total",
        "bbc_spec_decode_accepted_tokens_total",
        "bbc_spec_decode_drafts_total",
    ],
    [
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_drafts_total",
    ],
];

impl Speculation {
    /// The speculation counters of a Prometheus `/metrics` page (each summed over its labels),
    /// where it has them.
    pub fn counters(metrics: &str) -> Option<[f64; 3]> {
        let value = |name: &str| -> Option<f64> {
            let samples = metrics.lines().filter(|l| !l.starts_with('#')).filter_map(|l| {
                let (series, value) = l.rsplit_once(' ')?;
                let metric = series.split('{').next()?;
                (metric == name).then(|| value.trim().parse::<f64>().ok()).flatten()
            });
            samples.fold(None, |sum, v| Some(sum.unwrap_or(0.0) + v))
        };
        SPECULATION_COUNTERS.iter().find_map(|names| {
            let [drafted, accepted, drafts] = names.map(value);
            Some([drafted?, accepted?, drafts?])
        })
    }

    /// The run between counters `before` and `after`; none where nothing was drafted.
    pub fn between(before: [f64; 3], after: [f64; 3]) -> Option<Self> {
        let [drafted, accepted, drafts] = [0, 1, 2].map(|i| (after[i] - before[i]).max(0.0) as u64);
        (drafted > 0 && drafts > 0).then(|| Self {
            draft_tokens: drafted,
            accepted_tokens: accepted,
            drafts,
            acceptance_rate: accepted as f64 / drafted as f64,
            mean_accepted_length: 1.0 + accepted as f64 / drafts as f64,
        })
    }
}

/// One request: when it was sent (seconds from the run's start) and, where it completed, its
/// latencies.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestTiming {
    pub sent_s: f64,
    pub ok: bool,
    pub ttft_ms: Option<f64>,
    pub e2el_ms: Option<f64>,
    pub output_tokens: Option<usize>,
}

impl Report {
    pub fn new(outcomes: &[Outcome], wall: Duration) -> Self {
        let results: Vec<&Result<Measured, String>> = outcomes.iter().map(|o| &o.result).collect();
        let ok: Vec<&Measured> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let output_tokens: usize = ok.iter().map(|m| m.output_tokens).sum();
        let seconds = wall.as_secs_f64().max(f64::MIN_POSITIVE);
        let tpot: Vec<f64> = ok
            .iter()
            .filter(|m| m.output_tokens > 1)
            .map(|m| ms(m.e2e - m.ttft) / (m.output_tokens - 1) as f64)
            .collect();
        Self {
            completed: ok.len(),
            failed: results.len() - ok.len(),
            duration_s: wall.as_secs_f64(),
            input_tokens: ok.iter().map(|m| m.prompt_tokens).sum(),
            output_tokens,
            request_throughput: ok.len() as f64 / seconds,
            output_throughput: output_tokens as f64 / seconds,
            ttft_ms: Distribution::of(&ok.iter().map(|m| ms(m.ttft)).collect::<Vec<_>>()),
            tpot_ms: Distribution::of(&tpot),
            itl_ms: Distribution::of(&ok.iter().flat_map(|m| m.itl.iter().map(|&d| ms(d))).collect::<Vec<_>>()),
            e2el_ms: Distribution::of(&ok.iter().map(|m| ms(m.e2e)).collect::<Vec<_>>()),
            errors: results
                .iter()
                .filter_map(|r| r.as_ref().err())
                .take(5)
                .cloned()
                .collect(),
            requests: outcomes
                .iter()
                .map(|o| {
                    let m = o.result.as_ref().ok();
                    RequestTiming {
                        sent_s: o.sent.as_secs_f64(),
                        ok: m.is_some(),
                        ttft_ms: m.map(|m| ms(m.ttft)),
                        e2el_ms: m.map(|m| ms(m.e2e)),
                        output_tokens: m.map(|m| m.output_tokens),
                    }
                })
                .collect(),
            speculation: None,
        }
    }

    /// Tokens a second each request sees while it decodes: 1000 / mean TPOT (InferenceX's
    /// "interactivity"); NaN where no request decoded past its first token.
    pub fn interactivity(&self) -> f64 {
        match self.tpot_ms.mean > 0.0 {
            true => 1e3 / self.tpot_ms.mean,
            false => f64::NAN,
        }
    }

    /// InferenceX fails a run when more than 5% of its requests fail.
    pub fn acceptable(&self) -> bool {
        self.failed * 20 <= self.completed + self.failed
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        writeln!(
            f,
            "requests               {} completed, {} failed",
            self.completed, self.failed
        )?;
        writeln!(f, "duration               {:.2} s", self.duration_s)?;
        writeln!(f, "input tokens           {}", self.input_tokens)?;
        writeln!(f, "output tokens          {}", self.output_tokens)?;
        writeln!(f, "request throughput     {:.3} req/s", self.request_throughput)?;
        writeln!(f, "output throughput      {:.2} tok/s", self.output_throughput)?;
        writeln!(
            f,
            "{:<22} {:>10} {:>10} {:>10} {:>10}",
            "(ms)", "mean", "p50", "p90", "p99"
        )?;
        for (name, d) in [
            ("TTFT", self.ttft_ms),
            ("TPOT", self.tpot_ms),
            ("ITL", self.itl_ms),
            ("E2EL", self.e2el_ms),
        ] {
            writeln!(
                f,
                "{name:<22} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
                d.mean, d.p50, d.p90, d.p99
            )?;
        }
        if let Some(s) = &self.speculation {
            writeln!(
                f,
                "draft acceptance       {:.1}% ({} of {} drafted tokens)",
                100.0 * s.acceptance_rate,
                s.accepted_tokens,
                s.draft_tokens
            )?;
            writeln!(f, "mean accepted length   {:.2}", s.mean_accepted_length)?;
        }
        for e in &self.errors {
            writeln!(f, "failed: {e}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bbc's counters, or vLLM's summed over their labels; a run's share of them; none where
    /// the page has neither or nothing was drafted.
    #[test]
    fn speculation_is_read_from_either_servers_counters() {
        let bbc = "# HELP bbc_spec_decode_draft_tokens_total x\nbbc_spec_decode_draft_tokens_total 40\n\
                   bbc_spec_decode_accepted_tokens_total 30\nbbc_spec_decode_drafts_total 10\n";
        assert_eq!(Speculation::counters(bbc), Some([40.0, 30.0, 10.0]));
        let vllm = "vllm:spec_decode_num_draft_tokens_total{engine=\"0\",model_name=\"m\"} 12.0\n\
                    vllm:spec_decode_num_draft_tokens_total{engine=\"1\",model_name=\"m\"} 6.0\n\
                    vllm:spec_decode_num_accepted_tokens_total{engine=\"0\",model_name=\"m\"} 9.0\n\
                    vllm:spec_decode_num_drafts_total{engine=\"0\",model_name=\"m\"} 6.0\n";
        assert_eq!(Speculation::counters(vllm), Some([18.0, 9.0, 6.0]));
        assert_eq!(Speculation::counters("bbc_spec_decode_draft_tokens_total 4\n"), None);
        let run = Speculation::between([40.0, 30.0, 10.0], [100.0, 75.0, 30.0]).unwrap();
        assert_eq!((run.draft_tokens, run.accepted_tokens, run.drafts), (60, 45, 20));
        assert_eq!((run.acceptance_rate, run.mean_accepted_length), (0.75, 3.25));
        assert_eq!(Speculation::between([4.0, 1.0, 2.0], [4.0, 1.0, 2.0]), None);
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        // numpy.percentile([1, 2, 3, 4, 10], [50, 90, 99]) = [3.0, 7.6, 9.76]
        let d = Distribution::of(&[10.0, 1.0, 3.0, 2.0, 4.0]);
        assert_eq!(d.mean, 4.0);
        assert_eq!(d.p50, 3.0);
        assert!((d.p90 - 7.6).abs() < 1e-12 && (d.p99 - 9.76).abs() < 1e-12, "{d:?}");
        assert_eq!(Distribution::of(&[5.0]).p99, 5.0);
    }

    #[test]
    fn throughput_counts_completed_requests_and_tpot_skips_single_tokens() {
        let ms = Duration::from_millis;
        let one = |ttft, e2e, out| Measured {
            ttft: ms(ttft),
            e2e: ms(e2e),
            itl: vec![],
            prompt_tokens: 10,
            output_tokens: out,
        };
        let sent = |s, result| Outcome {
            sent: Duration::from_secs(s),
            result,
        };
        let results = vec![
            sent(0, Ok(one(100, 1100, 11))),
            sent(0, Ok(one(50, 50, 1))),
            sent(1, Err("HTTP 503".to_string())),
        ];
        let r = Report::new(&results, Duration::from_secs(2));
        assert_eq!((r.completed, r.failed, r.output_tokens, r.input_tokens), (2, 1, 12, 20));
        assert_eq!(r.output_throughput, 6.0);
        assert_eq!(r.tpot_ms.mean, 100.0, "(1100 − 100) / 10, the 1-token request left out");
        assert_eq!(r.ttft_ms.mean, 75.0);
        assert!(!r.acceptable(), "1 failure in 3 is over 5%");
        assert_eq!(r.errors, vec!["HTTP 503".to_string()]);
        assert_eq!(r.interactivity(), 10.0, "1000 / 100 ms");
        assert_eq!(
            r.requests[0],
            RequestTiming {
                sent_s: 0.0,
                ok: true,
                ttft_ms: Some(100.0),
                e2el_ms: Some(1100.0),
                output_tokens: Some(11),
            }
        );
        assert_eq!(
            (r.requests[2].sent_s, r.requests[2].ok, r.requests[2].ttft_ms),
            (1.0, false, None)
        );
    }
}
