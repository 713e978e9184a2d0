//! How `bbc bench` sends its requests: a closed loop that keeps a number of requests in flight
//! (InferenceX's concurrency), or an open loop that sends each request at its own time whatever
//! is still running (sustained admission at a request rate, or bursts), as vLLM's
//! `benchmark_serving.py` does with `--request-rate`.

use super::client::{Measured, Server};
use runtime::sampling::SplitMix64;
use serde_json::Value;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One request's result, and when it was sent, from the start of the run.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub sent: Duration,
    pub result: Result<Measured, String>,
}

/// Send every body with at most `concurrency` in flight; each one's outcome, in order, and the
/// run's wall time.
pub async fn closed_loop(
    server: &Server,
    path: &str,
    bodies: Vec<Value>,
    concurrency: usize,
) -> (Vec<Outcome>, Duration) {
    let start = Instant::now();
    let bodies = Arc::new(bodies);
    let next = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..concurrency.min(bodies.len()) {
        let (server, path, bodies, next) = (server.clone(), path.to_string(), bodies.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let mut done = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(body) = bodies.get(i) else { break done };
                let sent = start.elapsed();
                let result = server.stream(&path, body).await.map_err(|e| format!("{e:#}"));
                done.push((i, Outcome { sent, result }));
            }
        }));
    }
    let mut outcomes: Vec<Option<Outcome>> = vec![None; bodies.len()];
    for worker in workers {
        match worker.await {
            Ok(done) => done.into_iter().for_each(|(i, o)| outcomes[i] = Some(o)),
            Err(e) => {
                let failed = Outcome {
                    sent: Duration::ZERO,
                    result: Err(format!("a client task failed: {e}")),
                };
                return (vec![failed; bodies.len()], start.elapsed());
            }
        }
    }
    let outcomes = outcomes
        .into_iter()
        .map(|o| o.expect("every request was taken"))
        .collect();
    (outcomes, start.elapsed())
}

/// Send body `i` at `arrivals[i]` after the start, whatever is still running; each one's
/// outcome, in order, and the wall time until the last one finished.
pub async fn open_loop(
    server: &Server,
    path: &str,
    bodies: Vec<Value>,
    arrivals: &[Duration],
) -> (Vec<Outcome>, Duration) {
    let start = Instant::now();
    let tasks: Vec<_> = bodies
        .into_iter()
        .zip(arrivals)
        .map(|(body, &at)| {
            let (server, path) = (server.clone(), path.to_string());
            tokio::spawn(async move {
                tokio::time::sleep_until((start + at).into()).await;
                let sent = start.elapsed();
                let result = server.stream(&path, &body).await.map_err(|e| format!("{e:#}"));
                Outcome { sent, result }
            })
        })
        .collect();
    let mut outcomes = Vec::with_capacity(tasks.len());
    for (task, &at) in tasks.into_iter().zip(arrivals) {
        outcomes.push(task.await.unwrap_or_else(|e| Outcome {
            sent: at,
            result: Err(format!("a client task failed: {e}")),
        }));
    }
    (outcomes, start.elapsed())
}

/// A Poisson process of `rate` requests a second over `duration`: exponential gaps, as vLLM's
/// benchmark draws them. At least one request.
pub fn poisson_arrivals(rate: f64, duration: Duration, rng: &mut SplitMix64) -> Vec<Duration> {
    let mut arrivals = vec![Duration::ZERO];
    let mut t = 0.0;
    loop {
        // Uniform in (0, 1]: the gap −ln(u)/rate is finite.
        let u = 1.0 - rng.next_f64();
        t += -u.ln() / rate;
        if t >= duration.as_secs_f64() {
            return arrivals;
        }
        arrivals.push(Duration::from_secs_f64(t));
    }
}

/// `bursts` bursts of `size` requests, `interval` apart, every request of a burst at once.
pub fn burst_arrivals(size: usize, bursts: usize, interval: Duration) -> Vec<Duration> {
    (0..bursts)
        .flat_map(|b| std::iter::repeat_n(interval * b as u32, size))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_arrivals_keep_their_rate_and_duration() {
        let mut rng = SplitMix64(11);
        let arrivals = poisson_arrivals(50.0, Duration::from_secs(100), &mut rng);
        assert!(arrivals.windows(2).all(|w| w[0] <= w[1]), "in order");
        assert!(arrivals.iter().all(|&a| a < Duration::from_secs(100)));
        // 5000 expected; the count of a Poisson process has a standard deviation of √5000 ≈ 71.
        assert!((4700..=5300).contains(&arrivals.len()), "{}", arrivals.len());
        let gaps: Vec<f64> = arrivals.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!((mean - 0.02).abs() < 0.002, "mean gap {mean}");
        // Exponential: about e⁻¹ of the gaps are longer than the mean.
        let longer = gaps.iter().filter(|&&g| g > 0.02).count() as f64 / gaps.len() as f64;
        assert!((longer - (-1f64).exp()).abs() < 0.03, "{longer}");
        assert_eq!(
            poisson_arrivals(1e-9, Duration::from_secs(1), &mut rng),
            vec![Duration::ZERO]
        );
    }

    #[test]
    fn bursts_send_their_requests_together() {
        let ms = Duration::from_millis;
        assert_eq!(
            burst_arrivals(2, 3, ms(500)),
            vec![ms(0), ms(0), ms(500), ms(500), ms(1000), ms(1000)]
        );
        assert!(burst_arrivals(0, 3, ms(1)).is_empty());
    }
}
