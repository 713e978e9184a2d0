//! `bbc bench` against a real `bbc serve`: every request completes, the report counts exactly
//! the tokens asked for (`ignore_eos`), and its latencies are consistent with one another; a
//! sweep runs every combination with prompts of its own; sustained and bursty load send each
//! request at its time; the charts draw what the runs measured.

mod common;

use common::server::Server;
use serde_json::Value;
use std::io::{Read, Write};
use std::process::Command;

/// `bbc bench` against `server`: whether it succeeded, its JSON document, and what it printed.
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

/// The one run of a document.
fn only_run(document: &Value) -> &Value {
    let runs = document["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 1, "{document}");
    &runs[0]
}

/// A counter of the server's `/metrics`.
fn metric(server: &Server, name: &str) -> f64 {
    let mut stream = std::net::TcpStream::connect(&server.address).unwrap();
    let head = format!(
        "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        server.address
    );
    stream.write_all(head.as_bytes()).unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
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
        let (ok, document, text) = bench(&server, &args);
        assert!(ok, "{text}");
        let r = only_run(&document);
        assert_eq!(
            (r["input_len"].as_u64(), r["concurrency"].as_u64()),
            (Some(12), Some(3))
        );
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
    let (ok, document, text) = bench(&server, &args);
    assert!(!ok, "{text}");
    assert_eq!(only_run(&document)["failed"].as_u64(), Some(2), "{text}");
    assert!(text.contains("401") && text.contains("over 5%"), "{text}");
    // With the key it succeeds.
    let (ok, document, text) = bench(&server, &[&args[..], &["--api-key", "secret"]].concat());
    assert!(ok && only_run(&document)["completed"].as_u64() == Some(2), "{text}");
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
    let (ok, document, text) = bench(&server, &args);
    assert!(ok, "{text}");
    assert_eq!(only_run(&document)["output_tokens"].as_u64(), Some(18), "{text}");
    let (ok, _, text) = bench(&server, &[&args[..12], &["--top-p", "0"]].concat());
    assert!(!ok && text.contains("--top-p within (0, 1]"), "{text}");
}

/// A sweep runs every (ISL, OSL, concurrency) given, each with prompts of its own, and draws
/// throughput against interactivity, a line per (ISL, OSL) with a point per concurrency. Two
/// runs without `--seed` send fresh prompts (the server's prefix cache finds none of them);
/// the same seed twice sends the same (it finds them).
#[test]
fn sweeps_run_every_combination_on_fresh_prompts_and_plot_them() {
    let server = Server::start(&[]);
    let plot = tempfile_path().with_extension("svg");
    let args = [
        "--mode",
        "sweep",
        "--input-len",
        "40,48",
        "--output-len",
        "4",
        "--concurrency",
        "1,2",
        "--num-prompts",
        "2",
        "--warmups",
        "0",
        "--plot",
        plot.to_str().unwrap(),
    ];
    let (ok, document, text) = bench(&server, &args);
    assert!(ok, "{text}");
    let runs = document["runs"].as_array().unwrap();
    let grid: Vec<(u64, u64)> = runs
        .iter()
        .map(|r| (r["input_len"].as_u64().unwrap(), r["concurrency"].as_u64().unwrap()))
        .collect();
    assert_eq!(grid, vec![(40, 1), (40, 2), (48, 1), (48, 2)], "{document}");
    assert!(runs
        .iter()
        .all(|r| r["completed"].as_u64() == Some(2) && r["load"] == "concurrency"));
    assert_eq!(document["mode"], "sweep");
    assert_eq!(
        metric(&server, "bbc_prefix_cache_hits_total"),
        0.0,
        "no run of the sweep met another's prompts"
    );
    let svg = std::fs::read_to_string(&plot).unwrap();
    let _ = std::fs::remove_file(&plot);
    assert!(
        svg.contains("ISL 40 / OSL 4") && svg.contains("ISL 48 / OSL 4"),
        "{svg}"
    );
    assert_eq!(svg.matches("<polyline").count(), 2, "a line per (ISL, OSL)");
    assert_eq!(
        svg.matches("<circle").count(),
        4 + 2,
        "a point per run and a legend mark per line"
    );
    assert_eq!(svg.matches(">C2</text>").count(), 2);

    let once = [
        "--input-len",
        "40",
        "--output-len",
        "2",
        "--num-prompts",
        "2",
        "--warmups",
        "0",
    ];
    let (ok, first, text) = bench(&server, &once);
    assert!(ok, "{text}");
    let (ok, second, text) = bench(&server, &once);
    assert!(ok, "{text}");
    assert_ne!(first["seed"], second["seed"], "each run draws a fresh seed");
    assert_eq!(
        metric(&server, "bbc_prefix_cache_hits_total"),
        0.0,
        "fresh prompts each run"
    );
    let seed = first["seed"].as_u64().unwrap().to_string();
    let (ok, again, text) = bench(&server, &[&once[..], &["--seed", &seed]].concat());
    assert!(ok && again["seed"] == first["seed"], "{text}");
    // Prompts of 32 to 40 tokens hold at least one full block of 16 before their last token.
    assert!(
        metric(&server, "bbc_prefix_cache_hits_total") >= 2.0 * 16.0,
        "the same seed repeats the prompts: each request finds its blocks cached"
    );
}

/// Sustained admission: requests sent at Poisson arrivals over the duration whatever is still
/// running, each timed; bursts: every request of a burst sent at once. Both chart each
/// request's latencies against when it was sent.
#[test]
fn rate_and_burst_runs_send_each_request_at_its_time() {
    let server = Server::start(&[]);
    let plot = tempfile_path().with_extension("svg");
    let common = [
        "--input-len",
        "8",
        "--output-len",
        "3",
        "--warmups",
        "1",
        "--plot",
        plot.to_str().unwrap(),
    ];
    let rate = [
        "--mode",
        "rate",
        "--request-rate",
        "20",
        "--duration",
        "0.5",
        "--seed",
        "5",
    ];
    let (ok, document, text) = bench(&server, &[&common[..], &rate[..]].concat());
    assert!(ok, "{text}");
    let run = only_run(&document);
    assert_eq!(
        (run["load"].as_str(), run["request_rate"].as_f64()),
        (Some("rate"), Some(20.0))
    );
    let requests = run["requests"].as_array().unwrap();
    assert_eq!(requests.len() as u64, run["completed"].as_u64().unwrap(), "{run}");
    assert!(requests.len() >= 2, "20 a second for half a second: {}", requests.len());
    let sent: Vec<f64> = requests.iter().map(|r| r["sent_s"].as_f64().unwrap()).collect();
    assert!(
        sent.windows(2).all(|w| w[0] <= w[1] + 0.05) && sent[0] < 0.1,
        "{sent:?}"
    );
    assert!(sent.iter().all(|&s| s < 0.6), "sent within the duration: {sent:?}");
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.contains(">TTFT</text>") && svg.contains(">E2EL</text>"), "{svg}");
    assert_eq!(svg.matches("<circle").count(), 2 * requests.len() + 2);

    let burst = [
        "--mode",
        "burst",
        "--burst-size",
        "3",
        "--bursts",
        "2",
        "--burst-interval",
        "0.4",
    ];
    let (ok, document, text) = bench(&server, &[&common[..], &burst[..]].concat());
    let _ = std::fs::remove_file(&plot);
    assert!(ok, "{text}");
    let run = only_run(&document);
    assert_eq!(run["completed"].as_u64(), Some(6), "{run}");
    let sent: Vec<f64> = run["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["sent_s"].as_f64().unwrap())
        .collect();
    assert!(sent[..3].iter().all(|&s| s < 0.1), "the first burst at once: {sent:?}");
    assert!(
        sent[3..].iter().all(|&s| (0.4..0.5).contains(&s)),
        "the second 0.4 s later: {sent:?}"
    );

    let (ok, _, text) = bench(&server, &["--mode", "rate"]);
    assert!(!ok && text.contains("--request-rate"), "{text}");
    let (ok, _, text) = bench(&server, &["--mode", "burst", "--bursts", "0"]);
    assert!(!ok && text.contains("--bursts"), "{text}");
}

/// Every family served with random weights (vLLM's `--load-format dummy`): its tiny fixture's
/// `config.json`, the vocabulary widened to SmolLM2's tokenizer (`--tokenizer smollm2`), run on
/// the CPU backend and benchmarked end to end; every request completes with its tokens.
#[test]
fn every_family_serves_random_weights_and_is_benchmarked() {
    let scratch = common::scratch_dir("bbc-random-weights-");
    let smollm2 = common::real_model("smollm2");
    let tokenizer = smollm2.to_str().unwrap();
    for family in [
        "llama",
        "gemma3",
        "gemma4",
        "glm4_moe",
        "glm_moe_dsa",
        "qwen3_5",
        "qwen3_next",
    ] {
        let path = common::fixture(&format!("hf-tiny/{family}/config.json"));
        let mut config: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        config["vocab_size"] = 49152.into();
        if config.get("vocab_size_per_layer_input").is_some() {
            config["vocab_size_per_layer_input"] = 49152.into();
        }
        let dir = scratch.path().join(family);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let server = Server::start_model(dir.join("config.json").to_str().unwrap(), &["--tokenizer", tokenizer]);
        let args = [
            "--input-len",
            "24",
            "--output-len",
            "5",
            "--range-ratio",
            "1",
            "--concurrency",
            "2",
            "--num-prompts",
            "4",
            "--warmups",
            "0",
        ];
        let (ok, document, text) = bench(&server, &args);
        assert!(ok, "{family}: {text}");
        let run = only_run(&document);
        assert_eq!(run["completed"].as_u64(), Some(4), "{family}: {text}");
        assert_eq!(run["output_tokens"].as_u64(), Some(20), "{family}: {text}");
    }
}

/// Against a server drafting with a model's MTP layers (the tiny Qwen3.5's config with one, its
/// vocabulary widened to SmolLM2's tokenizer, random weights), the report says how many drafted
/// tokens were accepted and the mean accepted length, from the server's counters over the
/// measured requests alone; against one that does not draft, it says nothing of them.
#[test]
fn the_report_measures_draft_acceptance() {
    let scratch = common::scratch_dir("bbc-bench-mtp-");
    let path = common::fixture("hf-tiny/qwen3_5/config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    config["vocab_size"] = 49152.into();
    config["mtp_num_hidden_layers"] = 1.into();
    let model = scratch.path().join("config.json");
    std::fs::write(&model, config.to_string()).unwrap();
    let tokenizer = common::real_model("smollm2");
    let mtp = r#"{"method": "mtp", "num_speculative_tokens": 2}"#;
    let args = [
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--range-ratio",
        "1",
        "--num-prompts",
        "3",
    ];
    for drafting in [true, false] {
        let mut serve = vec!["--tokenizer", tokenizer.to_str().unwrap()];
        if drafting {
            serve.extend(["--speculative-config", mtp]);
        }
        let server = Server::start_model(model.to_str().unwrap(), &serve);
        let before = metric(&server, "bbc_spec_decode_draft_tokens_total");
        let (ok, document, text) = bench(&server, &args);
        assert!(ok, "{text}");
        let run = only_run(&document);
        let measured = metric(&server, "bbc_spec_decode_draft_tokens_total") - before;
        if !drafting {
            assert!(run.get("speculation").is_none(), "{run}");
            assert!(!text.contains("draft acceptance"), "{text}");
            continue;
        }
        let s = &run["speculation"];
        let (drafted, accepted, drafts) = (
            s["draft_tokens"].as_u64().unwrap(),
            s["accepted_tokens"].as_u64().unwrap(),
            s["drafts"].as_u64().unwrap(),
        );
        // Warm-up requests drafted too, before the measured run.
        assert!(
            drafted > 0 && (drafted as f64) < measured,
            "{drafted} of {measured}: {run}"
        );
        assert!(accepted <= drafted && drafts <= drafted, "{run}");
        let length = s["mean_accepted_length"].as_f64().unwrap();
        assert!((length - (1.0 + accepted as f64 / drafts as f64)).abs() < 1e-9, "{run}");
        assert!(
            text.contains("draft acceptance") && text.contains("mean accepted length"),
            "{text}"
        );
    }
}

/// The GPU check's serve section, run here against a CPU server: `bbc serve` started as its own
/// process, the sweep's runs against it (quick: one wave a run), each (ISL, OSL)'s reports and
/// chart written, the server stopped after.
#[test]
fn the_serve_sweep_serves_and_measures_every_run() {
    let results = common::scratch_dir("bbc-serve-sweep-");
    let smollm2 = common::real_model("smollm2");
    let sweep: [(usize, usize, &[usize]); 2] = [(16, 3, &[1, 3]), (32, 2, &[2])];
    bbc::gpu_check::serve::serve_and_sweep(
        std::path::Path::new(env!("CARGO_BIN_EXE_bbc")),
        &smollm2,
        &["--served-model-name", "smollm2"],
        &smollm2,
        &sweep,
        bbc::gpu_check::serve::SweepSize::Quick,
        results.path(),
    )
    .unwrap();
    for (input_len, output_len, concurrencies) in sweep {
        let name = format!("sweep-isl{input_len}-osl{output_len}");
        let report = std::fs::read_to_string(results.path().join(format!("{name}.json"))).unwrap();
        let report: Value = serde_json::from_str(&report).unwrap();
        let runs = report["runs"].as_array().unwrap();
        let ran: Vec<u64> = runs.iter().map(|r| r["concurrency"].as_u64().unwrap()).collect();
        assert_eq!(ran, concurrencies.iter().map(|&c| c as u64).collect::<Vec<_>>());
        let wave = concurrencies.iter().max().unwrap().max(&2);
        assert!(
            runs.iter()
                .all(|r| r["completed"].as_u64() == Some(*wave as u64) && r["input_len"] == input_len),
            "{report}"
        );
        assert!(results.path().join(format!("{name}.svg")).is_file());
    }
}

/// The GPU check's speculation runs, here with a CPU target: a tiny Llama of random weights
/// (SmolLM2's vocabulary, so its tokenizer serves it) served without drafts, drafting for
/// itself (every draft accepted) and drafted for by its first layer; each run's report written,
/// with drafts only where there is a drafter.
#[test]
fn the_speculation_runs_serve_with_each_drafter() {
    let results = common::scratch_dir("bbc-speculation-runs-");
    let smollm2 = common::real_model("smollm2");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(common::fixture("hf-tiny/llama/config.json")).unwrap()).unwrap();
    config["vocab_size"] = 49_152.into();
    let sweep: [(usize, usize, &[usize]); 1] = [(16, 8, &[1, 2])];
    bbc::gpu_check::serve::speculation_runs(
        std::path::Path::new(env!("CARGO_BIN_EXE_bbc")),
        &config,
        codegen::Target::Cpu,
        &smollm2,
        &sweep,
        results.path(),
    )
    .unwrap();
    for run in ["no-drafts", "drafts-accepted", "drafts-refused"] {
        let path = results.path().join(format!("speculation-{run}/sweep-isl16-osl8.json"));
        let report: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let runs = report["runs"].as_array().unwrap();
        assert_eq!(runs.len(), 2, "{run}: {report}");
        for r in runs {
            assert!(r["completed"].as_u64().unwrap() >= 2, "{run}: {r}");
            let drafted = r["speculation"]["draft_tokens"].as_u64();
            match run {
                "no-drafts" => assert!(drafted.is_none(), "{r}"),
                "drafts-accepted" => {
                    assert!(drafted.unwrap() > 0, "{r}");
                    assert_eq!(r["speculation"]["accepted_tokens"].as_u64(), drafted, "{r}");
                }
                _ => assert!(drafted.unwrap() > 0, "{r}"),
            }
        }
    }
}

/// The GPU check's load runs, here with a CPU target: a tiny Llama of random weights (SmolLM2's
/// vocabulary) written as a bf16 safetensors checkpoint and as an f16 GGUF, each compiled and
/// served until its first completion has answered, in that order of events.
#[test]
fn the_load_runs_serve_both_files_to_a_first_answer() {
    let smollm2 = common::real_model("smollm2");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(common::fixture("hf-tiny/llama/config.json")).unwrap()).unwrap();
    config["vocab_size"] = 49_152.into();
    let runs = bbc::gpu_check::load::load_runs(
        std::path::Path::new(env!("CARGO_BIN_EXE_bbc")),
        &config,
        codegen::Target::Cpu,
        &smollm2,
    )
    .unwrap();
    let what: Vec<&str> = runs.iter().map(|r| r.what).collect();
    assert_eq!(what, ["bf16 safetensors", "f16 GGUF to bf16"]);
    for run in &runs {
        assert!(
            run.compile > 0.0 && 0.0 < run.listening && run.listening <= run.answered,
            "{run:?}"
        );
    }
}
