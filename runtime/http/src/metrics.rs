//! Prometheus metrics: counters and gauges updated by the HTTP handlers and the engine thread,
//! rendered in the text exposition format on `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// Bucket upper bounds in seconds, shared by the latency histograms.
const BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

#[derive(Default)]
pub struct Histogram {
    /// Per bucket (non-cumulative), then the +Inf overflow.
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum_micros: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, seconds: f64) {
        let i = BUCKETS.iter().position(|&b| seconds <= b).unwrap_or(BUCKETS.len());
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_micros.fetch_add((seconds * 1e6) as u64, Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, count) in self.counts.iter().enumerate() {
            cumulative += count.load(Relaxed);
            let le = BUCKETS.get(i).map_or("+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_sum {}", self.sum_micros.load(Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count {cumulative}");
    }
}

#[derive(Default)]
pub struct Metrics {
    requests_by_status: Mutex<BTreeMap<u16, u64>>,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub waiting: AtomicU64,
    pub running: AtomicU64,
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_cached: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    pub state_snapshots: AtomicU64,
    pub prefix_cache_queries: AtomicU64,
    pub prefix_cache_hits: AtomicU64,
    pub draft_tokens: AtomicU64,
    pub accepted_draft_tokens: AtomicU64,
    /// Sequences' steps that verified drafted tokens.
    pub drafts: AtomicU64,
    pub ttft: Histogram,
    pub tpot: Histogram,
    pub e2e: Histogram,
}

impl Metrics {
    pub fn count_request(&self, status: u16) {
        let mut map = self.requests_by_status.lock().unwrap_or_else(|e| e.into_inner());
        *map.entry(status).or_default() += 1;
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str(
            "# HELP bbc_requests_total Requests answered, by HTTP status.\n# TYPE bbc_requests_total counter\n",
        );
        for (status, n) in self.requests_by_status.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(out, "bbc_requests_total{{status=\"{status}\"}} {n}");
        }
        let counters = [
            (
                "bbc_prompt_tokens_total",
                "Prompt tokens admitted.",
                &self.prompt_tokens,
            ),
            (
                "bbc_generation_tokens_total",
                "Tokens generated.",
                &self.generation_tokens,
            ),
            (
                "bbc_prefix_cache_queries_total",
                "Tokens looked up in the prefix cache when sequences were admitted.",
                &self.prefix_cache_queries,
            ),
            (
                "bbc_prefix_cache_hits_total",
                "Tokens found in the prefix cache (not computed).",
                &self.prefix_cache_hits,
            ),
            (
                "bbc_spec_decode_draft_tokens_total",
                "Drafted tokens verified (prompt lookup, a draft model, MTP layers, forced text).",
                &self.draft_tokens,
            ),
            (
                "bbc_spec_decode_drafts_total",
                "Sequences' steps that verified drafted tokens (mean accepted length: 1 + accepted / drafts).",
                &self.drafts,
            ),
            (
                "bbc_spec_decode_accepted_tokens_total",
                "Drafted tokens accepted (each one a step saved).",
                &self.accepted_draft_tokens,
            ),
        ];
        for (name, help, value) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                value.load(Relaxed)
            );
        }
        let gauges = [
            ("bbc_requests_waiting", "Requests in the waiting queue.", &self.waiting),
            ("bbc_requests_running", "Sequences being computed.", &self.running),
            (
                "bbc_kv_blocks_used",
                "KV-cache blocks held by sequences.",
                &self.kv_blocks_used,
            ),
            (
                "bbc_kv_blocks_cached",
                "KV-cache blocks held by no sequence that still cache a prefix (reused or evicted as needed).",
                &self.kv_blocks_cached,
            ),
            ("bbc_kv_blocks_total", "KV-cache blocks in all.", &self.kv_blocks_total),
            (
                "bbc_state_snapshots",
                "Snapshots of recurrent states the prefix cache holds (models with recurrent layers).",
                &self.state_snapshots,
            ),
        ];
        for (name, help, value) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {}",
                value.load(Relaxed)
            );
        }
        self.ttft
            .render("bbc_time_to_first_token_seconds", "Time to first token.", &mut out);
        self.tpot.render(
            "bbc_time_per_output_token_seconds",
            "Mean time per output token after the first.",
            &mut out,
        );
        self.e2e.render(
            "bbc_e2e_request_latency_seconds",
            "End-to-end request latency.",
            &mut out,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative() {
        let m = Metrics::default();
        for s in [0.003, 0.2, 0.2, 500.0] {
            m.ttft.observe(s);
        }
        m.count_request(200);
        m.count_request(503);
        let text = m.render();
        assert!(
            text.contains("bbc_time_to_first_token_seconds_bucket{le=\"0.005\"} 1"),
            "{text}"
        );
        assert!(text.contains("bbc_time_to_first_token_seconds_bucket{le=\"0.25\"} 3"));
        assert!(text.contains("bbc_time_to_first_token_seconds_bucket{le=\"+Inf\"} 4"));
        assert!(text.contains("bbc_time_to_first_token_seconds_count 4"));
        assert!(text.contains("bbc_requests_total{status=\"503\"} 1"));
    }
}
