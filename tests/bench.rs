//! `bbc bench` against a real `bbc serve`: every request completes, the report counts exactly
//! the tokens asked for (`ignore_eos`), and its latencies are consistent with one another.

mod common;

use common::server::Server;
use serde_json::Value;
use std::process::Command;

fn bench(server: &Server, extra: &[&str]) -> (bool, Value, String) {
    let json = tempfile_path();
    let out = Command::new(env!("CARGO_BIN_EXE_bbc"))
        .arg("bench")
        .args(["--url", &format!("http://{}", server.address), "--tokenizer"])
        .arg(common::real_model("smollm2"))
        .args(["--json", json.to_str().unwrap()])
        .args(extra)
        .output()
        .expect("running bbc bench");
    let report = std::fs::read_to_string(&json)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(Value::Null);
    let _ = std::fs::remove_file(&json);
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), report, text)
}

fn tempfile_path() -> tempfile::TempPath {
    tempfile::Builder::new()
        .prefix("bbc-bench-")
        .suffix(".json")
        .tempfile()
        .unwrap()
        .into_temp_path()
}

#[test]
fn reports_what_the_server_did_both_endpoints() {
    let server = Server::start(&[]);
    for endpoint in ["completions", "chat"] {
        // Output lengths drawn from [8, 10]; with ignore_eos each request produces exactly its draw.
        let args = [
            "--endpoint",
            endpoint,
            "--input-len",
            "12",
            "--output-len",
            "10",
            "--concurrency",
            "3",
            "--num-prompts",
            "6",
            "--warmups",
            "1",
        ];
        let (ok, r, text) = bench(&server, &args);
        assert!(ok, "{text}");
        assert_eq!(
            (r["completed"].as_u64(), r["failed"].as_u64()),
            (Some(6), Some(0)),
            "{text}"
        );
        let output = r["output_tokens"].as_u64().unwrap();
        assert!(
            (6 * 8..=6 * 10).contains(&output),
            "{output} tokens for 6 requests of 8..=10"
        );
        assert!(r["input_tokens"].as_u64().unwrap() >= 6 * 9, "{r}");
        let ms = |metric: &str, stat: &str| r[metric][stat].as_f64().unwrap();
        for metric in ["ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"] {
            assert!(
                ms(metric, "p50") <= ms(metric, "p90") && ms(metric, "p90") <= ms(metric, "p99"),
                "{r}"
            );
            assert!(ms(metric, "mean") > 0.0, "{metric}: {r}");
        }
        assert!(ms("ttft_ms", "mean") < ms("e2el_ms", "mean"));
        let throughput = r["output_throughput"].as_f64().unwrap();
        let expected = output as f64 / r["duration_s"].as_f64().unwrap();
        assert!((throughput - expected).abs() < 1e-6 * expected, "{r}");
        assert!(text.contains("output throughput"), "the table is printed: {text}");
    }
}

#[test]
fn a_run_with_too_many_failures_fails() {
    // The server wants a key the client does not send: every request is refused (401).
    let server = Server::start(&["--api-key", "secret"]);
    let args = [
        "--model",
        "smollm2",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--num-prompts",
        "2",
        "--warmups",
        "0",
    ];
    let (ok, r, text) = bench(&server, &args);
    assert!(!ok, "{text}");
    assert_eq!(r["failed"].as_u64(), Some(2), "{text}");
    assert!(text.contains("401") && text.contains("over 5%"), "{text}");
    // With the key it succeeds.
    let (ok, r, text) = bench(&server, &[&args[..], &["--api-key", "secret"]].concat());
    assert!(ok && r["completed"].as_u64() == Some(2), "{text}");
}

/// Sampled requests (`--temperature`, `--top-p`, `--top-k`) run to their lengths too; bad
/// values are refused before any request.
#[test]
fn sampled_runs_report_their_tokens() {
    let server = Server::start(&[]);
    let args = [
        "--input-len",
        "8",
        "--output-len",
        "6",
        "--range-ratio",
        "1",
        "--num-prompts",
        "3",
        "--warmups",
        "0",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--top-k",
        "40",
    ];
    let (ok, r, text) = bench(&server, &args);
    assert!(ok, "{text}");
    assert_eq!(r["output_tokens"].as_u64(), Some(18), "{text}");
    let (ok, _, text) = bench(&server, &[&args[..12], &["--top-p", "0"]].concat());
    assert!(!ok && text.contains("--top-p within (0, 1]"), "{text}");
}
