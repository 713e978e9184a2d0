//! `bbc serve` end to end: the real binary on 127.0.0.1 with SmolLM2, spoken to over raw
//! HTTP/1.1 (one connection per request, as the InferenceX client does).

mod common;

use proptest::prelude::*;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::server::Server;

/// Raw HTTP/1.1 requests to the server under test.
impl Server {
    fn connect(&self) -> TcpStream {
        let stream = TcpStream::connect(&self.address).expect("connecting");
        stream.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        stream
    }

    fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> TcpStream {
        let mut stream = self.connect();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            self.address,
            body.len()
        );
        for (k, v) in headers {
            head += &format!("{k}: {v}\r\n");
        }
        head += "\r\n";
        stream.write_all(head.as_bytes()).unwrap();
        stream.write_all(body).unwrap();
        stream
    }

    /// Status and (de-chunked) body.
    fn request(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, String) {
        let mut raw = Vec::new();
        self.send(method, path, headers, body)
            .read_to_end(&mut raw)
            .expect("reading the response");
        parse_response(&raw)
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.request("POST", path, &[], body.to_string().as_bytes());
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// The chunks of a streamed response, parsed; the stream must end with `data: [DONE]`.
    fn stream(&self, path: &str, body: &Value) -> (u16, Vec<Value>) {
        let (status, text) = self.request("POST", path, &[], body.to_string().as_bytes());
        let mut data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        assert_eq!(data.pop(), Some("[DONE]"), "{text}");
        let chunks = data
            .iter()
            .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
            .collect();
        (status, chunks)
    }

    /// Wait until no KV block is in use (the engine publishes after the step that ended the
    /// last request, so a client can hear "finished" a moment before the gauge drops).
    fn wait_for_free_blocks(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.metric("bbc_kv_blocks_used") > 0.0 {
            assert!(Instant::now() < deadline, "KV blocks still in use after 10 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.request("GET", "/metrics", &[], b"");
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
    }
}

fn parse_response(raw: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP response");
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("a status");
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    (status, if chunked { dechunk(body) } else { body.to_string() })
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out += &rest[..n];
        body = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

fn error_of(body: &Value) -> (&str, Option<&str>) {
    let e = &body["error"];
    (e["message"].as_str().expect("an error message"), e["param"].as_str())
}

#[test]
fn completions_and_chat_answer_streamed_and_whole() {
    let server = Server::start(&[]);
    let (status, models) = server.request("GET", "/v1/models", &[], b"");
    assert_eq!(status, 200);
    assert!(models.contains("\"id\":\"smollm2\""), "{models}");
    assert_eq!(server.request("GET", "/health", &[], b"").0, 200);
    // vLLM's liveness probe and version.
    assert_eq!(server.request("GET", "/ping", &[], b"").0, 200);
    assert_eq!(server.request("POST", "/ping", &[], b"").0, 200);
    let (status, version) = server.request("GET", "/version", &[], b"");
    assert_eq!(status, 200);
    let version: Value = serde_json::from_str(&version).unwrap();
    assert_eq!(version["version"], env!("CARGO_PKG_VERSION"));

    let body = json!({"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0});
    let (status, whole) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let text = whole["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(text.contains("Paris"), "{text:?}");
    assert_eq!(whole["usage"]["completion_tokens"], 8);

    // Streaming the same request gives the same text, piece by piece.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, chunks) = server.stream("/v1/completions", &streamed);
    assert_eq!(status, 200);
    let joined: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(joined, text);
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "length");

    // Chat, whole and streamed.
    let chat = json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                      "max_completion_tokens": 12, "temperature": 0});
    let (status, whole) = server.post("/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "chat.completion");
    let answer = whole["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    // The same chat template and tokens as `bbc run --chat`.
    let run = Command::new(env!("CARGO_BIN_EXE_bbc"))
        .args(["run", "smollm2", "--chat", "--prompt", "What is the capital of France?"])
        .args(["--max-tokens", "12", "--json"])
        .output()
        .expect("running bbc run");
    let run: Value = serde_json::from_slice(&run.stdout).expect("bbc run --json");
    assert_eq!(run["text"], answer);
    let mut chat_stream = chat.clone();
    chat_stream["stream"] = json!(true);
    let (_, chunks) = server.stream("/v1/chat/completions", &chat_stream);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let joined: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(joined, answer);
}

#[test]
fn the_inferencex_body_streams_and_ends_with_a_usage_chunk() {
    let server = Server::start(&[]);
    let body = json!({"model": "smollm2", "prompt": "Once upon a time, in a small village,", "temperature": 0.0,
        "best_of": 1, "max_tokens": 24, "logprobs": null, "stream": true,
        "stream_options": {"include_usage": true}, "ignore_eos": true});
    let (status, chunks) = server.stream("/v1/completions", &body);
    assert_eq!(status, 200);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]), "usage rides alone, as vLLM sends it");
    let with_text = chunks
        .iter()
        .filter(|c| !c["choices"][0]["text"].as_str().unwrap_or("").is_empty())
        .count();
    assert_eq!(usage["usage"]["completion_tokens"], 24);
    assert_eq!(with_text, 24, "one chunk per token for plain English text");
    assert!(chunks[..chunks.len() - 1].iter().all(|c| c.get("usage").is_none()));

    // vLLM's `continuous_usage_stats`: every chunk carries the usage so far, the text chunks
    // one more completion token each.
    let mut continuous = body.clone();
    continuous["stream_options"]["continuous_usage_stats"] = json!(true);
    let (_, chunks) = server.stream("/v1/completions", &continuous);
    let counts: Vec<u64> = chunks
        .iter()
        .map(|c| c["usage"]["completion_tokens"].as_u64().expect("usage in every chunk"))
        .collect();
    assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{counts:?}");
    let text_counts: Vec<u64> = chunks
        .iter()
        .zip(&counts)
        .filter(|(c, _)| !c["choices"][0]["text"].as_str().unwrap_or("").is_empty())
        .map(|(_, &n)| n)
        .collect();
    assert_eq!(text_counts, (1..=24).collect::<Vec<u64>>());
    assert_eq!(chunks.last().unwrap()["usage"], usage["usage"]);
}

#[test]
fn stop_strings_and_stop_token_ids_end_generation_unprinted() {
    let server = Server::start(&[]);
    let prompt = "The capital of France is";
    let (_, free) = server.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0}),
    );
    let text = free["choices"][0]["text"].as_str().unwrap();
    // Stop at the first "." the free run printed: everything before it, nothing after.
    let cut = text.find('.').expect("the answer has a full stop");
    let (_, stopped) = server.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": ["."]}),
    );
    assert_eq!(stopped["choices"][0]["text"], text[..cut]);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    assert_eq!(stopped["choices"][0]["stop_reason"], ".");
    assert!(free["choices"][0]["stop_reason"].is_null());
    // vLLM's `include_stop_str_in_output` keeps the stop string, whole or streamed.
    let body =
        json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": ["."], "include_stop_str_in_output": true});
    let (_, kept) = server.post("/v1/completions", &body);
    assert_eq!(kept["choices"][0]["text"], text[..=cut]);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, chunks) = server.stream("/v1/completions", &streamed);
    let pieces: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(pieces, text[..=cut]);
    assert_eq!(chunks.last().unwrap()["choices"][0]["stop_reason"], ".");

    // The same cut by token id: "." is one token.
    let model = models::Model::open(models::ModelSpec::for_weights(&common::real_model("smollm2"))).unwrap();
    let period = model.tokenizer.as_ref().unwrap().encode(".", false).unwrap();
    assert_eq!(period.len(), 1);
    let (_, stopped) = server.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop_token_ids": period}),
    );
    assert_eq!(stopped["choices"][0]["text"], text[..cut]);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    assert_eq!(stopped["choices"][0]["stop_reason"], period[0]);
}

#[test]
fn concurrent_greedy_requests_generate_what_they_generate_alone() {
    let server = Server::start(&["--max-num-seqs", "64", "--token-budget", "256"]);
    let body = |i: u32| {
        let prompt: Vec<u32> = (0..(4 + i % 9)).map(|j| 200 + 31 * i + 7 * j).collect();
        json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true})
    };
    let alone: Vec<Value> = (0..64).map(|i| server.post("/v1/completions", &body(i)).1).collect();
    let server = &server;
    let together: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..64)
            .map(|i| s.spawn(move || server.post("/v1/completions", &body(i)).1))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a["choices"][0]["text"], t["choices"][0]["text"], "request {i}");
    }
}

#[test]
fn invalid_requests_get_400s_naming_the_parameter() {
    let server = Server::start(&[]);
    let cases = [
        (json!({"prompt": "x", "temperature": -1}), "temperature"),
        (json!({"prompt": "x", "temperature": "hot"}), "temperature"),
        (json!({"prompt": "x", "top_p": 1.5}), "top_p"),
        (json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
        (json!({"prompt": "x", "max_tokens": 100000}), "max_tokens"),
        (json!({"prompt": "x", "stop": 3}), "stop"),
        (json!({"prompt": [1, 2, 99999999]}), "prompt"),
        (json!({"max_tokens": 3}), "prompt"),
    ];
    for (body, param) in cases {
        let (status, answer) = server.post("/v1/completions", &body);
        assert_eq!(status, 400, "{body}: {answer}");
        assert_eq!(error_of(&answer).1, Some(param), "{body}: {answer}");
    }
    let (status, answer) = server.post("/v1/chat/completions", &json!({"messages": "hi"}));
    assert_eq!((status, error_of(&answer).1), (400, Some("messages")));
    let chat = |kwargs: Value| json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template_kwargs": kwargs});
    let (status, answer) = server.post("/v1/chat/completions", &chat(json!({"bos_token": "x"})));
    assert_eq!((status, error_of(&answer).1), (400, Some("chat_template_kwargs")));
    // Variables the template does not read change nothing; and a Llama's answer has no
    // `reasoning_content` (the parser is off for its family).
    let (status, answer) = server.post("/v1/chat/completions", &chat(json!({"enable_thinking": false})));
    assert_eq!(status, 200, "{answer}");
    assert!(
        answer["choices"][0]["message"].get("reasoning_content").is_none(),
        "{answer}"
    );

    // A prompt over the context length: vLLM's message.
    let long: Vec<u32> = (0..9000).map(|i| 100 + i % 1000).collect();
    let (status, answer) = server.post("/v1/completions", &json!({"prompt": long, "max_tokens": 1}));
    assert_eq!(status, 400);
    assert!(
        error_of(&answer).0.starts_with(
            "This model's maximum context length is 8192 tokens. However, your request has 9000 input tokens."
        ),
        "{answer}"
    );

    for raw in ["{", "[]", "nonsense", "{\"prompt\": \"x\",}"] {
        let (status, text) = server.request("POST", "/v1/completions", &[], raw.as_bytes());
        assert_eq!(status, 400, "{raw}: {text}");
    }
    let (status, answer) = server.post("/v1/completions", &json!({"model": "gpt-5", "prompt": "x"}));
    assert_eq!(status, 404);
    assert!(error_of(&answer).0.contains("gpt-5"));
}

/// `--max-model-len` caps what a request may use below the model's own context: its limit
/// is the one the context-length error names, and `/v1/models` reports it.
#[test]
fn max_model_len_caps_the_context() {
    let server = Server::start(&["--max-model-len", "64"]);
    let prompt: Vec<u32> = (0..60).map(|i| 100 + i).collect();
    let (status, answer) = server.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 4}));
    assert_eq!(status, 200, "{answer}");
    let (status, answer) = server.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 5}));
    assert_eq!(status, 400, "{answer}");
    assert!(
        error_of(&answer).0.contains("maximum context length is 64 tokens"),
        "{answer}"
    );
    let long: Vec<u32> = (0..65).map(|i| 100 + i).collect();
    let (status, answer) = server.post("/v1/completions", &json!({"prompt": long, "max_tokens": 1}));
    assert_eq!(status, 400, "{answer}");
    let (status, text) = server.request("GET", "/v1/models", &[], b"");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(models["data"][0]["max_model_len"], 64, "{models}");
}

/// `--chat-template` renders chat requests with the template given instead of the model's.
#[test]
fn a_chat_template_replaces_the_models() {
    let template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>";
    let server = Server::start(&["--chat-template", template]);
    let messages = json!({"messages": [{"role": "user", "content": "hi"}]});
    let (status, chat) = server.post("/tokenize", &messages);
    assert_eq!(status, 200, "{chat}");
    let (_, text) = server.post("/tokenize", &json!({"prompt": "<user>hi<assistant>"}));
    assert_eq!(chat["tokens"], text["tokens"], "{chat} {text}");
    let (status, answer) = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["usage"]["prompt_tokens"], text["count"], "{answer}");
}

#[test]
fn an_api_key_is_required_when_set() {
    let server = Server::start(&["--api-key", "sesame"]);
    let body = json!({"prompt": "x", "max_tokens": 1}).to_string();
    let (status, _) = server.request("POST", "/v1/completions", &[], body.as_bytes());
    assert_eq!(status, 401);
    let (status, _) = server.request(
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer nope")],
        body.as_bytes(),
    );
    assert_eq!(status, 401);
    let (status, _) = server.request("GET", "/v1/models", &[], b"");
    assert_eq!(status, 401);
    for path in ["/tokenize", "/detokenize", "/v1/responses", "/v1/messages"] {
        assert_eq!(
            server.request("POST", path, &[], b"{\"prompt\":\"x\"}").0,
            401,
            "{path}"
        );
    }
    let (status, text) = server.request(
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer sesame")],
        body.as_bytes(),
    );
    assert_eq!(status, 200, "{text}");
    // Anthropic's clients send the key as `x-api-key`; errors there come in Anthropic's shape.
    let message = json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}).to_string();
    let (status, text) = server.request("POST", "/v1/messages", &[("x-api-key", "sesame")], message.as_bytes());
    assert_eq!(status, 200, "{text}");
    let (status, text) = server.request("POST", "/v1/messages", &[("x-api-key", "nope")], message.as_bytes());
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (status, &error["error"]["type"]),
        (401, &json!("authentication_error")),
        "{text}"
    );
    assert_eq!(server.request("GET", "/health", &[], b"").0, 200, "health needs no key");
}

#[test]
fn a_full_queue_answers_503_and_the_accepted_requests_complete() {
    let server = Server::start(&["--max-queued", "2", "--max-num-seqs", "2"]);
    let body = json!({"prompt": "Tell me a long story.", "max_tokens": 48, "temperature": 0, "ignore_eos": true});
    let statuses: Vec<(u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..16)
            .map(|_| s.spawn(|| server.post("/v1/completions", &body)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let refused = statuses.iter().filter(|(s, _)| *s == 503).count();
    let served = statuses.iter().filter(|(s, _)| *s == 200).count();
    assert_eq!(refused + served, 16, "{statuses:?}");
    assert!(refused > 0 && served >= 2, "{refused} refused, {served} served");
    for (status, answer) in &statuses {
        if *status == 200 {
            assert_eq!(answer["usage"]["completion_tokens"], 48);
        } else {
            assert!(error_of(answer).0.contains("queue is full"), "{answer}");
        }
    }
    server.wait_for_free_blocks();
}

#[test]
fn disconnecting_clients_free_their_blocks_at_once() {
    let server = Server::start(&[]);
    let body = json!({"prompt": "Write a very long essay.", "max_tokens": 4000, "temperature": 0,
                      "ignore_eos": true, "stream": true})
    .to_string();
    for _ in 0..8 {
        let mut stream = server.send("POST", "/v1/completions", &[], body.as_bytes());
        // Wait for the first token, then hang up.
        let mut buf = [0u8; 512];
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0);
        drop(stream);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.metric("bbc_kv_blocks_used") > 0.0 || server.metric("bbc_requests_running") > 0.0 {
        assert!(
            Instant::now() < deadline,
            "blocks still held 10 s after every client left"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let asked = Instant::now();
    let (status, _) = server.post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 4}));
    assert_eq!(status, 200);
    assert!(asked.elapsed() < Duration::from_secs(5));
}

/// Bodies near valid ones: valid fields with wrong types or values, truncations, garbage.
fn body() -> impl Strategy<Value = Vec<u8>> {
    let value = prop_oneof![
        Just(json!(null)),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-10.0f64..10.0).prop_map(Value::from),
        "[a-z ]{0,12}".prop_map(Value::from),
        proptest::collection::vec(0u32..60000, 0..4).prop_map(|v| json!(v)),
        Just(json!({"include_usage": "yes"})),
        Just(json!([{"role": 1}])),
        Just(json!({"type": "json_object"})),
        Just(json!({"type": "json_schema", "json_schema": {"schema": {"type": "array", "items": {"$ref": "#/nope"}}}})),
        Just(json!({"regex": "[a-"})),
        Just(json!({"choice": ["a", "b"]})),
        Just(json!({"grammar": "start: start"})),
        Just(json!({"5": 100, "x": 1})),
        Just(json!([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])),
        Just(json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])),
        Just(json!({"type": "function", "function": {"name": "f"}})),
        Just(json!("required")),
        Just(json!("auto")),
        Just(
            json!([{"type": "function_call_output", "call_id": "c", "output": "x"}, {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}])
        ),
        Just(json!({"format": {"type": "json_schema", "schema": {"type": "object"}}})),
        Just(json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}])),
        Just(json!({"type": "enabled", "budget_tokens": 1})),
        Just(json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y "}])),
        Just(json!(["", " ", "\u{fffd}"])),
    ];
    let key = prop_oneof![
        Just("prompt"),
        Just("messages"),
        Just("max_tokens"),
        Just("temperature"),
        Just("top_p"),
        Just("top_k"),
        Just("stop"),
        Just("stream"),
        Just("stream_options"),
        Just("seed"),
        Just("n"),
        Just("model"),
        Just("logprobs"),
        Just("min_p"),
        Just("stop_token_ids"),
        Just("response_format"),
        Just("structured_outputs"),
        Just("logit_bias"),
        Just("min_tokens"),
        Just("tools"),
        Just("tool_choice"),
        Just("parallel_tool_calls"),
        Just("input"),
        Just("instructions"),
        Just("max_output_tokens"),
        Just("text"),
        Just("reasoning"),
        Just("system"),
        Just("stop_sequences"),
        Just("thinking"),
        Just("output_config"),
        Just("continue_final_message"),
        Just("add_generation_prompt"),
        Just("truncate_prompt_tokens"),
        Just("priority"),
        Just("allowed_token_ids"),
        Just("bad_words"),
        Just("use_beam_search"),
    ];
    let object = proptest::collection::vec((key, value), 0..6).prop_map(|fields| {
        let mut map = serde_json::Map::new();
        for (k, v) in fields {
            map.insert(k.to_string(), v);
        }
        // Keep valid requests short.
        if map.get("max_tokens").and_then(Value::as_i64).is_some_and(|n| n > 4) {
            map.insert("max_tokens".into(), json!(2));
        }
        map.entry("max_tokens").or_insert(json!(2));
        Value::Object(map).to_string().into_bytes()
    });
    prop_oneof![
        3 => object.clone(),
        1 => (object, any::<usize>()).prop_map(|(b, cut)| b[..cut % (b.len() + 1)].to_vec()),
        1 => proptest::collection::vec(any::<u8>(), 0..64),
    ]
}

#[test]
fn random_and_malformed_bodies_never_crash_the_server() {
    let server = Server::start(&["--tool-call-parser", "hermes"]);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(500));
    for path in [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/tokenize",
    ] {
        runner
            .run(&body(), |b| {
                let (status, text) = server.request("POST", path, &[], &b);
                prop_assert!(matches!(status, 200 | 400 | 404), "{status} {text}");
                if status != 200 {
                    let answer: Value = serde_json::from_str(&text).expect("errors are JSON");
                    prop_assert!(answer["error"]["message"].is_string(), "{text}");
                }
                Ok(())
            })
            .unwrap();
    }
    assert_eq!(server.request("GET", "/health", &[], b"").0, 200);
    server.wait_for_free_blocks();
}

/// What `script` (a Python client of the server, in `tests/`) printed, run against `url`; None
/// where its client package `module` is not installed (`.ci/run` installs it into
/// `$BBC_HOME/python` and sets `require`, so CI never skips).
fn python_client(module: &str, require: &str, script: &str, url: &str) -> Option<Value> {
    let python_path = bbc::fetch::cache_dir().join("python");
    let has_client = Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .env("PYTHONPATH", &python_path)
        .status()
        .is_ok_and(|s| s.success());
    if !has_client {
        assert!(
            std::env::var(require).is_err(),
            "{require} is set but `{module}` does not import"
        );
        eprintln!("skipping: the `{module}` Python package is not installed");
        return None;
    }
    let script = format!("{}/tests/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("python3")
        .arg(script)
        .arg(url)
        .env("PYTHONPATH", &python_path)
        .output()
        .expect("running the client script");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Some(serde_json::from_slice(&out.stdout).expect("the script's JSON"))
}

/// The official `openai` Python client: completions, chat, structured outputs, tool calls and
/// the Responses API.
#[test]
fn the_openai_python_client_works() {
    let server = Server::start(&["--tool-call-parser", "hermes"]);
    let url = format!("http://{}/v1", server.address);
    let Some(got) = python_client("openai", "BBC_REQUIRE_OPENAI", "openai_client.py", &url) else {
        return;
    };
    let (_, want) = server.post(
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(got["completion"], want["choices"][0]["text"]);
    assert_eq!(got["completion_stream"], got["completion"]);
    assert_eq!(
        (got["completion_usage"].as_u64(), got["stream_usage"].as_u64()),
        (Some(8), Some(8))
    );
    assert!(!got["chat"].as_str().unwrap().is_empty());
    assert_eq!(got["chat_stream"], got["chat"]);
    assert_eq!(got["models"], json!(["smollm2"]));
    let person: Value = serde_json::from_str(got["structured"].as_str().unwrap()).expect("JSON");
    assert!(person["name"].is_string() && person["age"].is_i64(), "{person}");
    assert_eq!(got["call_name"], "get_weather");
    let arguments: Value = serde_json::from_str(got["call_arguments"].as_str().unwrap()).expect("JSON arguments");
    assert!(arguments["city"].is_string(), "{arguments}");
    assert_eq!(got["streamed_names"], json!(["get_weather"]));
    assert_eq!(got["streamed_arguments"], got["call_arguments"]);
    for call in got["required_calls"].as_array().unwrap() {
        assert_eq!(call[0], "get_weather");
        assert!(serde_json::from_str::<Value>(call[1].as_str().unwrap()).unwrap()["city"].is_string());
    }
    assert!(!got["after_the_call"].as_str().unwrap().is_empty());
    assert_eq!(got["auto_calls"], json!([["get_weather", r#"{"city":"Paris"}"#]]));
    assert_eq!(
        (&got["auto_content"], &got["auto_finish"]),
        (&Value::Null, &json!("tool_calls"))
    );
    // The Responses API: chat's answer to the same question, whole and streamed.
    assert_eq!(got["responses_text"], got["chat"]);
    assert_eq!(got["responses_stream"], got["chat"]);
    assert_eq!(got["responses_stream_text"], got["chat"]);
    assert_eq!(got["responses_status"], "incomplete", "12 tokens cut it short");
    assert_eq!(got["responses_usage"][1], 12);
    // Its tokens' log-probabilities where asked for: chat's, whole and streamed.
    let logprobs = got["chat_logprobs"].as_array().unwrap();
    assert_eq!(logprobs.len(), 12);
    assert!(
        logprobs.iter().all(|e| e[2].as_array().unwrap().len() == 2),
        "{logprobs:?}"
    );
    assert_eq!(got["responses_logprobs"], got["chat_logprobs"]);
    assert_eq!(got["responses_stream_logprobs"], got["chat_logprobs"]);
    assert_eq!(got["responses_plain_logprobs"], json!([]), "none unless asked for");
    assert_eq!(got["responses_call"][0], "get_weather");
    let arguments: Value = serde_json::from_str(got["responses_call"][1].as_str().unwrap()).unwrap();
    assert!(arguments["city"].is_string(), "{arguments}");
    assert!(!got["responses_after_the_call"].as_str().unwrap().is_empty());
    assert_eq!(
        got["responses_auto"],
        json!([["function_call", "get_weather", r#"{"city":"Paris"}"#]])
    );
}

/// The official `anthropic` Python client on the Messages API: the answer chat gives to the same
/// question, whole and streamed; a stop sequence reported as such; the token count; a named
/// tool's `tool_use` whole and streamed, the next turn with its `tool_result`; `auto` held to a
/// Hermes call by a regular expression.
#[test]
fn the_anthropic_python_client_works() {
    let server = Server::start(&["--tool-call-parser", "hermes"]);
    let url = format!("http://{}", server.address);
    let Some(got) = python_client("anthropic", "BBC_REQUIRE_ANTHROPIC", "anthropic_client.py", &url) else {
        return;
    };
    let question = json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                          "max_tokens": 12, "temperature": 0});
    let (_, chat) = server.post("/v1/chat/completions", &question);
    let text = chat["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(got["text"], text);
    assert_eq!((&got["streamed"], &got["streamed_final"]), (&json!(text), &json!(text)));
    assert_eq!(
        (&got["stop_reason"], &got["streamed_stop_reason"]),
        (&json!("max_tokens"), &json!("max_tokens"))
    );
    assert_eq!(got["usage"], json!([chat["usage"]["prompt_tokens"], 12]));
    assert_eq!(got["counted"], chat["usage"]["prompt_tokens"]);
    let word = got["word"].as_str().unwrap();
    let before = &text[..text.find(word).unwrap()];
    assert_eq!(got["stopped"], json!([before, "stop_sequence", word]));
    assert_eq!(got["use"][0], "get_weather");
    assert!(got["use"][1]["city"].is_string(), "{}", got["use"]);
    assert_eq!(got["use"][2], "tool_use");
    assert_eq!(got["streamed_use"], json!([got["use"][0], got["use"][1]]));
    assert!(!got["after_the_call"].as_str().unwrap().is_empty());
    assert_eq!(got["auto"], json!([["tool_use", "get_weather", {"city": "Paris"}]]));
    assert_eq!(got["auto_stop_reason"], "tool_use");
}

/// vLLM's own test: 200 requests for long outputs whose client gives up after 0.5 s. Afterwards
/// a new request is answered within 5 s and no KV block stays in use.
#[test]
fn a_cancellation_storm_leaves_nothing_behind() {
    let server = Server::start(&[]);
    let body = json!({"prompt": "Write a very long essay about the sea.", "max_tokens": 2000,
                      "temperature": 0, "ignore_eos": true})
    .to_string();
    std::thread::scope(|s| {
        for _ in 0..200 {
            s.spawn(|| {
                let mut stream = server.send("POST", "/v1/completions", &[], body.as_bytes());
                stream.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
                let _ = stream.read_to_end(&mut Vec::new());
            });
        }
    });
    let asked = Instant::now();
    let (status, _) = server.post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 4}));
    assert_eq!(status, 200);
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "answered after {:?}",
        asked.elapsed()
    );
    server.wait_for_free_blocks();
}

fn resident_kib(server: &Server) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.pid())).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Bursts of 100 requests against `--max-queued 8`: the excess gets 503s, the accepted ones
/// complete, and resident memory does not grow from burst to burst.
#[test]
fn overload_bursts_are_refused_and_memory_stays_flat() {
    let server = Server::start(&["--max-queued", "8", "--max-num-seqs", "4"]);
    let body = json!({"prompt": "Count to ten.", "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let mut resident = Vec::new();
    for _ in 0..3 {
        let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..100)
                .map(|_| s.spawn(|| server.post("/v1/completions", &body)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let refused = answers.iter().filter(|(s, _)| *s == 503).count();
        let served: Vec<_> = answers.iter().filter(|(s, _)| *s == 200).collect();
        assert_eq!(refused + served.len(), 100);
        assert!(
            refused > 0,
            "a burst of 100 against a queue of 8 must be refused in part"
        );
        assert!(served.iter().all(|(_, a)| a["usage"]["completion_tokens"] == 8));
        server.wait_for_free_blocks();
        resident.push(resident_kib(&server));
    }
    if resident[0] > 0 {
        // Allocator noise only: well under what queuing the refused requests would cost.
        assert!(
            resident[2] < resident[0] + 16 * 1024,
            "resident KiB by burst: {resident:?}"
        );
    }
}

#[test]
fn penalties_reach_the_sampler() {
    let server = Server::start(&[]);
    let body = |extra: Value| {
        let mut b = json!({"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 12, "temperature": 0});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        server.post("/v1/completions", &b).1["choices"][0]["text"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let plain = body(json!({}));
    assert_eq!(body(json!({"repetition_penalty": 1.0, "presence_penalty": 0})), plain);
    // Counting repeats ", " every other token: penalising repeats must change the greedy text.
    assert_ne!(body(json!({"repetition_penalty": 1.5})), plain);
    assert_ne!(body(json!({"frequency_penalty": 1.5})), plain);
}

#[test]
fn logprobs_report_the_greedy_token_as_the_most_likely() {
    let server = Server::start(&[]);
    let body = json!({"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 3});
    let (status, whole) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let choice = &whole["choices"][0];
    let lp = &choice["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.len(), 6);
    assert_eq!(tokens.concat(), choice["text"].as_str().unwrap());
    for (i, (chosen, top)) in lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(lp["top_logprobs"].as_array().unwrap())
        .enumerate()
    {
        let top = top.as_object().unwrap();
        assert_eq!(top.len(), 3, "token {i}");
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::NEG_INFINITY, f64::max);
        let chosen = chosen.as_f64().unwrap();
        assert!(
            chosen <= 0.0 && (chosen - best).abs() < 1e-6,
            "greedy picks the most likely: {chosen} vs {best}"
        );
        assert_eq!(top[tokens[i]].as_f64().unwrap(), chosen);
    }
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] < w[1]));

    // Streamed: the same tokens, spread over the chunks.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, chunks) = server.stream("/v1/completions", &streamed);
    let chunk_tokens: Vec<String> = chunks
        .iter()
        .flat_map(|c| {
            c["choices"][0]["logprobs"]["tokens"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    assert_eq!(chunk_tokens, tokens);

    // Chat: `logprobs: true` with `top_logprobs`.
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
                      "logprobs": true, "top_logprobs": 2, "ignore_eos": true});
    let (status, whole) = server.post("/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{whole}");
    let content = whole["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    assert!(content
        .iter()
        .all(|e| e["top_logprobs"].as_array().unwrap().len() == 2 && e["logprob"].as_f64().unwrap() <= 0.0));
    // Without asking, no logprobs.
    let (_, plain) = server.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}));
    assert!(plain["choices"][0]["logprobs"].is_null());
}

/// Requests that give no seed sample apart (each takes the next of the server's seeds), and a
/// server started again with the same `--seed` gives them the same texts in the same order;
/// another `--seed`, others.
#[test]
fn unseeded_requests_sample_apart_and_the_server_seed_repeats_them() {
    let body = json!({"prompt": "My favourite animal is", "max_tokens": 12, "temperature": 1.0, "ignore_eos": true});
    let texts = |seed: &str| -> Vec<String> {
        let server = Server::start(&["--seed", seed]);
        (0..3)
            .map(|_| {
                let (status, out) = server.post("/v1/completions", &body);
                assert_eq!(status, 200, "{out}");
                out["choices"][0]["text"].as_str().unwrap().to_string()
            })
            .collect()
    };
    let first = texts("7");
    assert!(first[0] != first[1] && first[1] != first[2], "sampled alike: {first:?}");
    assert_eq!(texts("7"), first);
    assert_ne!(texts("8"), first);
}

/// vLLM's `--no-enable-prefix-caching` computes every prompt in full (no cached token found);
/// by default, and with `--enable-prefix-caching` last, a repeated prompt's blocks are found
/// (there beside `--enforce-eager`, read on the CPU backend, which replays no graphs).
/// `--tensor-parallel-size` past 1 is refused by name.
#[test]
fn prefix_caching_follows_vllms_flags() {
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(8);
    let body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0});
    let hits = |flags: &[&str]| {
        let server = Server::start(flags);
        for _ in 0..2 {
            assert_eq!(server.post("/v1/completions", &body).0, 200);
        }
        server.wait_for_free_blocks();
        server.metric("bbc_prefix_cache_hits_total")
    };
    assert_eq!(hits(&["--no-enable-prefix-caching"]), 0.0);
    assert!(hits(&[]) >= 64.0);
    assert!(
        hits(&[
            "--no-enable-prefix-caching",
            "--enable-prefix-caching",
            "--enforce-eager"
        ]) >= 64.0
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bbc"))
        .args(["serve", "smollm2", "--tensor-parallel-size", "2", "--trust-remote-code"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--tensor-parallel-size 2: bbc serves a model on one GPU"),
        "{err}"
    );
}

#[test]
fn n_choices_are_separate_sequences() {
    let server = Server::start(&[]);
    let body = json!({"prompt": "My favourite animal is", "max_tokens": 8, "temperature": 1.0, "seed": 5,
                      "n": 3, "ignore_eos": true});
    let (status, whole) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let choices = whole["choices"].as_array().unwrap();
    assert_eq!(
        choices.iter().map(|c| c["index"].as_u64().unwrap()).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    assert_eq!(whole["usage"]["completion_tokens"], 24);
    let texts: Vec<&str> = choices.iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "seeded apart: {texts:?}");

    // Streamed, the chunks interleave by index and add up to the same texts (same seeds).
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, chunks) = server.stream("/v1/completions", &streamed);
    let mut joined = vec![String::new(); 3];
    let mut finished = 0;
    for c in &chunks {
        let choice = &c["choices"][0];
        joined[choice["index"].as_u64().unwrap() as usize] += choice["text"].as_str().unwrap();
        finished += usize::from(!choice["finish_reason"].is_null());
    }
    assert_eq!(joined, texts);
    assert_eq!(finished, 3);
}

/// `--speculative-ngram`: a request that copies its prompt generates the same text with and
/// without drafting, streamed or whole, and the metrics count the accepted drafts.
#[test]
fn speculative_decoding_keeps_the_text_and_counts_accepted_drafts() {
    let body = json!({
        "messages": [{"role": "user", "content": "Copy this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon."}],
        "max_tokens": 48,
        "temperature": 0,
    });
    // The same list as JSON under a schema: drafts are verified under the grammar too.
    let mut as_json = body.clone();
    as_json["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "fruits",
        "schema": {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string"}}},
                   "required": ["fruits"]}}});
    let plain = Server::start(&[]);
    let (status, want) = plain.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{want}");
    let (_, want_json) = plain.post("/v1/chat/completions", &as_json);
    drop(plain);
    let server = Server::start(&["--speculative-ngram", "4"]);
    let (_, got_json) = server.post("/v1/chat/completions", &as_json);
    assert_eq!(got_json["choices"][0]["message"], want_json["choices"][0]["message"]);
    answers_as_without_drafts(&server, &body, &want);
}

/// `server`, drafting, answers `body` (a greedy chat request) with `want`'s message and usage
/// whole and its text streamed; its metrics count drafts accepted.
fn answers_as_without_drafts(server: &Server, body: &Value, want: &Value) {
    let (status, got) = server.post("/v1/chat/completions", body);
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["choices"][0]["message"], want["choices"][0]["message"]);
    assert_eq!(got["usage"], want["usage"]);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, chunks) = server.stream("/v1/chat/completions", &streamed);
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, want["choices"][0]["message"]["content"].as_str().unwrap());
    let accepted = server.metric("bbc_spec_decode_accepted_tokens_total");
    assert!(accepted > 0.0 && accepted <= server.metric("bbc_spec_decode_draft_tokens_total"));
    server.wait_for_free_blocks();
}

/// `--speculative-config` method `mtp`: a model with random weights whose config gives it a
/// multi-token prediction layer (the tiny Qwen3.5's config, its vocabulary widened to SmolLM2's
/// tokenizer) answers a greedy request as it does without drafting, whole and streamed, and the
/// metrics count the drafts (its head's guesses by a 4-bit shortlist, and exact); a model
/// without such layers is refused by name, asked for it by the flag or by a model.toml.
#[test]
fn mtp_drafting_keeps_the_text_and_counts_drafts() {
    let scratch = common::scratch_dir("bbc-mtp-");
    let tokenizer = common::real_model("smollm2");
    let tokenizer = tokenizer.to_str().unwrap();
    let config_of = |family: &str, mtp_layers: usize| {
        let path = common::fixture(&format!("hf-tiny/{family}/config.json"));
        let mut config: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        config["vocab_size"] = 49152.into();
        config["mtp_num_hidden_layers"] = mtp_layers.into();
        let dir = scratch.path().join(family);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        dir.join("config.json").to_str().unwrap().to_string()
    };
    let qwen = config_of("qwen3_5", 1);
    let body = json!({"prompt": "Once upon a time, in a small village,", "max_tokens": 24, "temperature": 0});
    let plain = Server::start_model(&qwen, &["--tokenizer", tokenizer]);
    let (status, want) = plain.post("/v1/completions", &body);
    assert_eq!(status, 200, "{want}");
    drop(plain);
    let mtp = r#"{"method": "mtp", "num_speculative_tokens": 3}"#;
    let server = Server::start_model(&qwen, &["--tokenizer", tokenizer, "--speculative-config", mtp]);
    let (_, got) = server.post("/v1/completions", &body);
    assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"]);
    assert_eq!(got["usage"], want["usage"]);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, chunks) = server.stream("/v1/completions", &streamed);
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, want["choices"][0]["text"].as_str().unwrap());
    assert!(server.metric("bbc_spec_decode_draft_tokens_total") > 0.0);
    server.wait_for_free_blocks();
    drop(server);
    // The head's exact greedy token in place of its 4-bit shortlist's.
    let exact_head = [
        "--tokenizer",
        tokenizer,
        "--speculative-config",
        mtp,
        "--draft-head",
        "full",
    ];
    let server = Server::start_model(&qwen, &exact_head);
    let (_, got) = server.post("/v1/completions", &body);
    assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"]);
    assert!(server.metric("bbc_spec_decode_draft_tokens_total") > 0.0);
    drop(server);
    // A model without the layers, asked by the flag and by a model.toml.
    let without = config_of("llama", 0);
    let toml = scratch.path().join("model.toml");
    let llama = common::fixture("hf-tiny/llama");
    let section = "[speculative]\nmethod = \"mtp\"\nnum_speculative_tokens = 2\n";
    std::fs::write(
        &toml,
        format!("[model]\nweights = {llama:?}\ntokenizer = {tokenizer:?}\n{section}"),
    )
    .unwrap();
    for args in [
        vec![without.as_str(), "--tokenizer", tokenizer, "--speculative-config", mtp],
        vec![toml.to_str().unwrap()],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_bbc"))
            .args(["serve", "--port", "0"])
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains("has none"),
            "{args:?}: {stderr}"
        );
    }
}

/// `--speculative-config` methods `eagle3` and `eagle`: the tiny Llama's config with random
/// weights (its vocabulary widened to SmolLM2's tokenizer), drafted for by the fixture EAGLE-3
/// head (its 200 draft ids mapped into the target's) and by the EAGLE-1 head, answers a greedy
/// request as it does without drafting, whole and streamed, and the metrics count the drafts;
/// a head that is not a directory, a target of another family, and a head given as the other
/// method are refused by name.
#[test]
fn eagle_drafting_keeps_the_text_and_counts_drafts() {
    let scratch = common::scratch_dir("bbc-eagle-");
    let tokenizer = common::real_model("smollm2");
    let tokenizer = tokenizer.to_str().unwrap();
    let config_of = |family: &str| {
        let path = common::fixture(&format!("hf-tiny/{family}/config.json"));
        let mut config: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        config["vocab_size"] = 49152.into();
        let dir = scratch.path().join(family);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        dir.join("config.json").to_str().unwrap().to_string()
    };
    let llama = config_of("llama");
    let body = json!({"prompt": "Once upon a time, in a small village,", "max_tokens": 24, "temperature": 0});
    let plain = Server::start_model(&llama, &["--tokenizer", tokenizer]);
    let (status, want) = plain.post("/v1/completions", &body);
    assert_eq!(status, 200, "{want}");
    drop(plain);
    let speculative = |method: &str, head: &str| {
        json!({"method": method, "model": common::fixture(&format!("eagle/{head}")), "num_speculative_tokens": 3})
            .to_string()
    };
    for (method, head) in [("eagle3", "eagle3"), ("eagle", "eagle")] {
        let config = speculative(method, head);
        let server = Server::start_model(&llama, &["--tokenizer", tokenizer, "--speculative-config", &config]);
        let (_, got) = server.post("/v1/completions", &body);
        assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"], "{method}");
        assert_eq!(got["usage"], want["usage"], "{method}");
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (_, chunks) = server.stream("/v1/completions", &streamed);
        let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
        assert_eq!(text, want["choices"][0]["text"].as_str().unwrap(), "{method}");
        assert!(server.metric("bbc_spec_decode_draft_tokens_total") > 0.0, "{method}");
        server.wait_for_free_blocks();
    }
    let gemma = config_of("gemma3");
    let not_a_dir = json!({"method": "eagle3", "model": llama, "num_speculative_tokens": 3}).to_string();
    for (model, config, needle) in [
        (llama.as_str(), not_a_dir, "must be the head's directory"),
        (
            gemma.as_str(),
            speculative("eagle3", "eagle3"),
            "EAGLE heads draft for llama targets",
        ),
        (
            llama.as_str(),
            speculative("eagle", "eagle3"),
            "an EAGLE-3 head is method `eagle3`",
        ),
        (
            llama.as_str(),
            speculative("eagle3", "eagle"),
            "an EAGLE-1 head is method `eagle`",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_bbc"))
            .args([
                "serve",
                "--port",
                "0",
                model,
                "--tokenizer",
                tokenizer,
                "--speculative-config",
                &config,
            ])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(needle), "{config}: {stderr}");
    }
}

/// A draft model: SmolLM2 computing in f32, drafted for by SmolLM2 in its file's
/// quantization (the same tokenizer), answers as it does without a draft model, whole and
/// streamed, and the metrics count drafts accepted.
#[test]
fn a_draft_model_keeps_the_text_and_counts_accepted_drafts() {
    let body = json!({
        "messages": [{"role": "user", "content": "Name three colours and say why you like each."}],
        "max_tokens": 40,
        "temperature": 0,
    });
    let plain = Server::start(&["--dtype", "f32"]);
    let (status, want) = plain.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{want}");
    drop(plain);
    // As vLLM's `--speculative-config` says it (the same as `--speculative-model`).
    let draft = common::real_model("smollm2");
    let config = json!({"model": draft, "num_speculative_tokens": 4}).to_string();
    let server = Server::start(&["--dtype", "f32", "--speculative-config", &config]);
    answers_as_without_drafts(&server, &body, &want);
}

/// Structured outputs: each way of asking (OpenAI's `response_format`, vLLM's
/// `structured_outputs` and `guided_*`) gives text in the language asked for, whole, streamed
/// and sampled; a grammar that does not compile is a 400 naming the parameter.
#[test]
fn structured_outputs_take_the_shape_asked_for() {
    let server = Server::start(&[]);
    let person = json!({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                        "required": ["name", "age"], "additionalProperties": false});
    let body = json!({"messages": [{"role": "user", "content": "Describe Ana, who is 31, as JSON."}],
                      "max_tokens": 60, "temperature": 0,
                      "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": person}}});
    let (status, whole) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["choices"][0]["finish_reason"], "stop", "{whole}");
    let content = whole["choices"][0]["message"]["content"].as_str().unwrap();
    let answer: Value = serde_json::from_str(content).expect("JSON under the schema");
    let fields = answer.as_object().unwrap();
    assert_eq!(fields.len(), 2, "{content}");
    assert!(fields["name"].is_string() && fields["age"].is_i64(), "{content}");

    // Streamed: the pieces add up to one JSON object.
    let body = json!({"prompt": "A user record: ", "max_tokens": 48, "temperature": 0, "stream": true,
                      "response_format": {"type": "json_object"}});
    let (_, chunks) = server.stream("/v1/completions", &body);
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert!(
        serde_json::from_str::<Value>(&text).is_ok_and(|v| v.is_object()),
        "{text}"
    );

    // Choices (with characters a grammar must escape), sampled three ways.
    let options = ["Paris", "say \"yes\"", "back\\slash"];
    let body = json!({"prompt": "The capital of France is", "max_tokens": 16, "temperature": 1.0, "seed": 2,
                      "n": 3, "structured_outputs": {"choice": options}});
    let (status, whole) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{whole}");
    for choice in whole["choices"].as_array().unwrap() {
        assert!(options.contains(&choice["text"].as_str().unwrap()), "{choice}");
        assert_eq!(choice["finish_reason"], "stop");
    }

    // A regular expression, and a grammar.
    let body = json!({"prompt": "Call me on", "max_tokens": 20, "temperature": 0.7, "seed": 9,
                      "guided_regex": " [0-9]{3}-[0-9]{4}"});
    let (_, whole) = server.post("/v1/completions", &body);
    let number = whole["choices"][0]["text"].as_str().unwrap();
    let digits = |s: &str| s.len() == 3 && s.chars().all(|c| c.is_ascii_digit());
    assert!(
        number
            .strip_prefix(' ')
            .and_then(|n| n.split_once('-'))
            .is_some_and(|(a, b)| digits(a) && b.len() == 4 && digits(&b[1..])),
        "{number:?}"
    );
    let body = json!({"prompt": "Fruit:", "max_tokens": 12, "temperature": 0,
                      "structured_outputs": {"grammar": "start: item (\", \" item)*\nitem: \"apple\" | \"pear\" | \"plum\""}});
    let (_, whole) = server.post("/v1/completions", &body);
    let list = whole["choices"][0]["text"].as_str().unwrap();
    let items: Vec<&str> = list.split(", ").collect();
    assert!(
        items[..items.len() - 1]
            .iter()
            .all(|i| ["apple", "pear", "plum"].contains(i)),
        "{list:?}"
    );

    // A long choice: once its first token decides it, the rest of its text is drafted (the
    // server speculates nowhere else) and the answer is still that choice.
    let options = [
        "Yes, the sky appears blue because of Rayleigh scattering of sunlight.",
        "No, the sky only looks blue in pictures taken by cameras.",
    ];
    let drafted = server.metric("bbc_spec_decode_draft_tokens_total");
    let body = json!({"prompt": "Is the sky blue?", "max_tokens": 40, "temperature": 0,
                      "structured_outputs": {"choice": options}});
    let (_, whole) = server.post("/v1/completions", &body);
    assert!(
        options.contains(&whole["choices"][0]["text"].as_str().unwrap()),
        "{whole}"
    );
    assert!(server.metric("bbc_spec_decode_draft_tokens_total") > drafted + 5.0);

    for (body, param) in [
        (
            json!({"prompt": "x", "structured_outputs": {"regex": "(("}}),
            "structured_outputs.regex",
        ),
        (
            json!({"prompt": "x", "structured_outputs": {"grammar": "start: missing"}}),
            "structured_outputs.grammar",
        ),
        (
            json!({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}}),
            "response_format",
        ),
        (
            json!({"prompt": "x", "response_format": {"type": "xml"}}),
            "response_format",
        ),
    ] {
        let (status, error) = server.post("/v1/completions", &body);
        assert_eq!((status, error_of(&error).1), (400, Some(param)), "{error}");
    }
    server.wait_for_free_blocks();
}

/// `tool_choice` auto (the default with tools): the model's own calls are read out of its
/// answer in the format `--tool-call-parser` names (SmolLM2's template teaches none, so by
/// default auto is a 400 naming `tool_choice`). A regular expression holds the answer to text
/// and a Hermes call here, as a model trained on the format would write it; the call arrives
/// as `tool_calls`, whole and streamed, the text before it as `content`, and the choice
/// finishes with `tool_calls`. An answer without a call is plain text.
#[test]
fn auto_tool_calls_are_read_out_of_the_answer() {
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]);
    let weather = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    let refused = Server::start(&[]);
    let body = json!({"messages": weather, "tools": tools, "max_tokens": 8});
    let (status, error) = refused.post("/v1/chat/completions", &body);
    assert_eq!((status, error_of(&error).1), (400, Some("tool_choice")), "{error}");
    drop(refused);

    let server = Server::start(&["--tool-call-parser", "hermes"]);
    let call = r#"Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Lyon)", "days": [1-3]\}\}\n</tool_call>"#;
    let forced = json!({"messages": weather, "tools": tools, "tool_choice": "auto", "max_tokens": 150,
                        "temperature": 0, "structured_outputs": {"regex": call}});
    let (status, whole) = server.post("/v1/chat/completions", &forced);
    assert_eq!(status, 200, "{whole}");
    let choice = &whole["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{whole}");
    assert_eq!(choice["message"]["content"], "Checking.", "{whole}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{whole}");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let arguments: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(
        ["Paris", "Lyon"].contains(&arguments["city"].as_str().unwrap()),
        "{arguments}"
    );
    assert!(arguments["days"].is_i64(), "{arguments}");

    let mut streamed = forced.clone();
    streamed["stream"] = json!(true);
    let (_, chunks) = server.stream("/v1/chat/completions", &streamed);
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]).collect();
    let content: String = deltas.iter().filter_map(|c| c["delta"]["content"].as_str()).collect();
    assert_eq!(content, "Checking.", "{chunks:?}");
    let streamed_calls: Vec<&Value> = deltas
        .iter()
        .filter_map(|c| c["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(streamed_calls.len(), 1, "{chunks:?}");
    assert_eq!(streamed_calls[0]["index"], 0);
    assert_eq!(streamed_calls[0]["function"], calls[0]["function"]);
    assert_eq!(deltas.last().unwrap()["finish_reason"], "tool_calls");

    let free = json!({"messages": [{"role": "user", "content": "Say hi."}], "tools": tools,
                      "max_tokens": 12, "temperature": 0});
    let (status, plain) = server.post("/v1/chat/completions", &free);
    assert_eq!(status, 200, "{plain}");
    assert!(plain["choices"][0]["message"].get("tool_calls").is_none(), "{plain}");
    assert!(!plain["choices"][0]["message"]["content"].as_str().unwrap().is_empty());
    server.wait_for_free_blocks();
}

/// `logit_bias` moves the tokens it names (−100 bans the greedy choice, +100 forces a token);
/// `min_tokens` holds off EOS and stop strings until that many tokens are out; a bias on a
/// token outside the vocabulary is a 400.
#[test]
fn logit_bias_and_min_tokens_shape_the_output() {
    let server = Server::start(&[]);
    let body = json!({"prompt": [504, 3575, 282, 4649, 314], "max_tokens": 3, "temperature": 0,
                      "logprobs": 1, "ignore_eos": true});
    let ids = |answer: &Value| -> Vec<String> {
        let tokens = answer["choices"][0]["logprobs"]["tokens"].as_array().unwrap();
        tokens.iter().map(|t| t.to_string()).collect()
    };
    let (_, plain) = server.post("/v1/completions", &body);
    let first = plain["choices"][0]["logprobs"]["tokens"][0].as_str().unwrap();
    let greedy = token_ids(first);
    assert_eq!(greedy.len(), 1, "{first:?}");
    let greedy = greedy[0];
    let mut banned = body.clone();
    banned["logit_bias"] = json!({greedy.to_string(): -100});
    let (status, answer) = server.post("/v1/completions", &banned);
    assert_eq!(status, 200, "{answer}");
    assert_ne!(ids(&answer)[0], ids(&plain)[0], "{answer}");
    let mut forced = body.clone();
    forced["logit_bias"] = json!({"1234": 100});
    let (_, answer) = server.post("/v1/completions", &forced);
    let forced_text = ids(&answer);
    assert!(forced_text.iter().all(|t| t == &forced_text[0]), "{forced_text:?}");
    assert_ne!(forced_text, ids(&plain));

    // EOS waits: a chat answer that ended by itself runs to `max_tokens` = `min_tokens`.
    let chat = json!({"messages": [{"role": "user", "content": "Say hi."}], "temperature": 0, "max_tokens": 64});
    let (_, short) = server.post("/v1/chat/completions", &chat);
    assert_eq!(short["choices"][0]["finish_reason"], "stop", "{short}");
    let longer = short["usage"]["completion_tokens"].as_u64().unwrap() + 6;
    let mut long = chat.clone();
    long["min_tokens"] = json!(longer);
    long["max_tokens"] = json!(longer);
    let (_, answer) = server.post("/v1/chat/completions", &long);
    assert_eq!(answer["usage"]["completion_tokens"], longer, "{answer}");
    assert_eq!(answer["choices"][0]["finish_reason"], "length", "{answer}");
    // So do stop strings: " Paris." stops at once after " Paris", not within 4 tokens.
    let paris = json!({"prompt": "The capital of France is", "temperature": 0, "max_tokens": 12, "stop": ["."]});
    let (_, stopped) = server.post("/v1/completions", &paris);
    assert_eq!(stopped["choices"][0]["text"], " Paris", "{stopped}");
    let mut held = paris.clone();
    held["min_tokens"] = json!(4);
    let (_, answer) = server.post("/v1/completions", &held);
    let text = answer["choices"][0]["text"].as_str().unwrap();
    assert!(
        text.starts_with(" Paris.") && answer["usage"]["completion_tokens"].as_u64() >= Some(4),
        "{answer}"
    );

    let mut outside = body.clone();
    outside["logit_bias"] = json!({"4000000": 5});
    let (status, error) = server.post("/v1/completions", &outside);
    assert_eq!((status, error_of(&error).1), (400, Some("logit_bias")), "{error}");
    server.wait_for_free_blocks();
}

/// SmolLM2's ids of `text`, by `bbc tokenize`.
fn token_ids(text: &str) -> Vec<u32> {
    let out = Command::new(env!("CARGO_BIN_EXE_bbc"))
        .args([
            "tokenize",
            &common::real_model("smollm2").to_string_lossy(),
            "--text",
            text,
        ])
        .output()
        .expect("running bbc tokenize");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("a JSON array of ids")
}

/// vLLM's `/tokenize` gives the ids a prompt runs as (`bbc tokenize`'s for text; for chat
/// messages as many as a chat completion counts), `/detokenize` their text back.
#[test]
fn tokenize_and_detokenize_round_trip() {
    let server = Server::start(&[]);
    let (status, got) = server.post("/tokenize", &json!({"prompt": "The capital of France is"}));
    assert_eq!(status, 200, "{got}");
    assert_eq!(common::ids(&got["tokens"]), token_ids("The capital of France is"));
    assert_eq!(got["count"], got["tokens"].as_array().unwrap().len());
    assert!(got["max_model_len"].as_u64().unwrap() > 0);
    let (_, text) = server.post("/detokenize", &json!({"tokens": got["tokens"]}));
    assert_eq!(text["prompt"], "The capital of France is");

    let messages = json!([{"role": "user", "content": "Hello there"}]);
    let (_, chat) = server.post("/tokenize", &json!({ "messages": messages }));
    let (_, answer) = server.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 1, "temperature": 0}),
    );
    assert_eq!(chat["count"], answer["usage"]["prompt_tokens"]);

    for (path, body, param) in [
        ("/detokenize", json!({"tokens": [4000000]}), "tokens"),
        ("/detokenize", json!({"tokens": "abc"}), "tokens"),
        ("/tokenize", json!({"prompt": 5}), "prompt"),
        ("/tokenize", json!({"messages": []}), "messages"),
    ] {
        let (status, error) = server.post(path, &body);
        assert_eq!((status, error_of(&error).1), (400, Some(param)), "{path} {body}");
    }
}

/// lm-eval's `local-completions` scores a continuation by sending context and continuation
/// as ids (`[[ids]]`) with `echo`, `logprobs: 1` and `max_tokens: 1`, and reading the
/// continuation's positions of `token_logprobs` (and whether each is the most likely there):
/// those must be exactly what generating the continuation reported. The same prompt's
/// `prompt_logprobs` (vLLM's) agree, several prompts in one request each get their choice,
/// `max_tokens: 0` echoes the prompt alone, and a streamed echo starts with the prompt.
#[test]
fn echo_scores_a_continuation_exactly_as_generating_it_reported() {
    let server = Server::start(&[]);
    let ids_of = |text: &str| -> Vec<u64> {
        let (_, t) = server.post("/tokenize", &json!({ "prompt": text }));
        t["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect()
    };
    let prompt = "The capital of France is";
    let context = ids_of(prompt);
    let (status, generated) = server.post(
        "/v1/completions",
        &json!({"prompt": context, "max_tokens": 5, "temperature": 0, "logprobs": 1, "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{generated}");
    let continuation = generated["choices"][0]["text"].as_str().unwrap();
    let reported = &generated["choices"][0]["logprobs"];
    let full = ids_of(&format!("{prompt}{continuation}"));
    assert_eq!(
        full.len(),
        context.len() + 5,
        "the greedy text tokenizes back to its tokens"
    );
    assert_eq!(full[..context.len()], context[..]);

    // lm-eval's request.
    let scoring =
        json!({"prompt": [full], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": true, "seed": 1234});
    let (status, scored) = server.post("/v1/completions", &scoring);
    assert_eq!(status, 200, "{scored}");
    let choice = &scored["choices"][0];
    let lp = &choice["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), full.len() + 1);
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
    let span = context.len()..full.len();
    let part = |v: &Value, range: std::ops::Range<usize>| v.as_array().unwrap()[range].to_vec();
    assert_eq!(
        part(&lp["token_logprobs"], span.clone()),
        part(&reported["token_logprobs"], 0..5)
    );
    assert_eq!(
        part(&lp["top_logprobs"], span.clone()),
        part(&reported["top_logprobs"], 0..5)
    );
    assert!(choice["text"]
        .as_str()
        .unwrap()
        .starts_with(&format!("{prompt}{continuation}")));
    assert_eq!(lp["text_offset"][0], 0);

    // vLLM's `prompt_logprobs`: the prompt's own token (rank 1: greedy) and the alternatives.
    let (_, with_prompt) = server.post(
        "/v1/completions",
        &json!({"prompt": full, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}),
    );
    let positions = with_prompt["choices"][0]["prompt_logprobs"].as_array().unwrap().clone();
    assert_eq!(positions.len(), full.len());
    assert!(positions[0].is_null());
    for (i, at) in span.clone().enumerate() {
        let own = &positions[at][full[at].to_string()];
        assert_eq!(own["logprob"], reported["token_logprobs"][i], "position {at}");
        assert_eq!(own["rank"], 1);
        assert!((1..=3).contains(&positions[at].as_object().unwrap().len()));
    }
    assert!(with_prompt["choices"][0]["logprobs"].is_null());

    // Two prompts, the prompt alone each: a choice per prompt, nothing generated.
    let (status, echoed) = server.post(
        "/v1/completions",
        &json!({"prompt": [full, prompt], "max_tokens": 0, "logprobs": 1, "echo": true}),
    );
    assert_eq!(status, 200, "{echoed}");
    let choices = echoed["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(choices[0]["text"], format!("{prompt}{continuation}"));
    assert_eq!(choices[1]["text"], prompt);
    assert_eq!(choices[1]["index"], 1);
    assert!(choices.iter().all(|c| c["finish_reason"] == "length"));
    assert_eq!(
        part(&choices[0]["logprobs"]["token_logprobs"], 0..full.len()),
        part(&lp["token_logprobs"], 0..full.len())
    );
    assert_eq!(
        choices[1]["logprobs"]["tokens"].as_array().unwrap().len(),
        context.len()
    );
    assert_eq!(echoed["usage"]["prompt_tokens"], full.len() + context.len());
    assert_eq!(echoed["usage"]["completion_tokens"], 0);

    // Streamed: the prompt's text first, then the output's, as the whole response has them.
    let body = json!({"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": true});
    let (_, whole) = server.post("/v1/completions", &body);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, chunks) = server.stream("/v1/completions", &streamed);
    assert_eq!(chunks[0]["choices"][0]["text"], prompt);
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());

    // A chat's prompt is reported once, beside the choices.
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 1});
    let (status, answer) = server.post("/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{answer}");
    let positions = answer["prompt_logprobs"].as_array().unwrap();
    assert_eq!(Some(positions.len() as u64), answer["usage"]["prompt_tokens"].as_u64());
    assert!(positions[0].is_null() && positions[1].is_object());

    // Not streamed, as vLLM refuses it there.
    let mut refused = chat.clone();
    refused["stream"] = json!(true);
    let (status, error) = server.post("/v1/chat/completions", &refused);
    assert_eq!((status, error_of(&error).1), (400, Some("prompt_logprobs")));
}

/// vLLM's `return_token_ids`: the prompt's ids and each choice's generated ids (its stop token
/// included, as usage counts it), whole or spread over the streamed chunks;
/// `return_tokens_as_token_ids` names log-probabilities' tokens `token_id:N`.
#[test]
fn token_ids_come_back_when_asked_for() {
    let server = Server::start(&[]);
    let prompt = "The capital of France is";
    let (_, tokenized) = server.post("/tokenize", &json!({ "prompt": prompt }));
    let body = json!({"prompt": prompt, "max_tokens": 5, "temperature": 0, "return_token_ids": true,
                      "logprobs": 1, "return_tokens_as_token_ids": true});
    let (status, whole) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let choice = &whole["choices"][0];
    assert_eq!(choice["prompt_token_ids"], tokenized["tokens"]);
    let ids = choice["token_ids"].as_array().unwrap().clone();
    assert_eq!(ids.len(), 5);
    let (_, text) = server.post("/detokenize", &json!({ "tokens": ids }));
    assert_eq!(text["prompt"], choice["text"]);
    let named: Vec<String> = ids.iter().map(|id| format!("token_id:{id}")).collect();
    assert_eq!(choice["logprobs"]["tokens"], json!(named));
    assert!(choice["logprobs"]["top_logprobs"][0]
        .as_object()
        .unwrap()
        .keys()
        .all(|k| k.starts_with("token_id:")));

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, chunks) = server.stream("/v1/completions", &streamed);
    assert_eq!(chunks[0]["choices"][0]["prompt_token_ids"], tokenized["tokens"]);
    let streamed_ids: Vec<Value> = chunks
        .iter()
        .flat_map(|c| c["choices"][0]["token_ids"].as_array().cloned().unwrap_or_default())
        .collect();
    assert_eq!(streamed_ids, ids);

    // A chat answer that ends on its own: its end token is among its ids.
    let chat = json!({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 40, "temperature": 0,
                      "return_token_ids": true});
    let (status, answer) = server.post("/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["choices"][0]["finish_reason"], "stop", "{answer}");
    let prompt_ids = answer["prompt_token_ids"].as_array().unwrap();
    assert_eq!(Some(prompt_ids.len() as u64), answer["usage"]["prompt_tokens"].as_u64());
    let generated = answer["choices"][0]["token_ids"].as_array().unwrap();
    assert_eq!(
        Some(generated.len() as u64),
        answer["usage"]["completion_tokens"].as_u64()
    );
    // Not asked for, not there.
    let (_, plain) = server.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 2}));
    assert!(plain["choices"][0].get("token_ids").is_none() && plain["choices"][0].get("prompt_token_ids").is_none());
}

/// A chat that ends with an answer the caller began (vLLM's `continue_final_message`,
/// Anthropic's prefill) runs as the conversation rendered whole and cut right after that
/// answer's text: its ids are those of `add_generation_prompt: false` less the turn's end,
/// the model goes on from there exactly as a completion of those ids does, and the Messages
/// API continues a final assistant message the same way.
#[test]
fn a_begun_answer_is_continued() {
    let server = Server::start(&[]);
    let messages = json!([{"role": "user", "content": "Name three colours."},
                          {"role": "assistant", "content": "1. Red\n2."}]);
    let ids = |extra: Value| {
        let mut body = json!({ "messages": messages });
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, got) = server.post("/tokenize", &body);
        assert_eq!(status, 200, "{got}");
        common::ids(&got["tokens"])
    };
    let begun = ids(json!({"continue_final_message": true}));
    let closed = ids(json!({"add_generation_prompt": false}));
    assert_eq!(
        begun,
        ids(json!({"continue_final_message": true, "add_generation_prompt": false}))
    );
    assert!(
        closed.starts_with(&begun) && closed.len() > begun.len(),
        "{begun:?} {closed:?}"
    );
    let (_, end) = server.post("/detokenize", &json!({"tokens": closed[begun.len()..]}));
    assert_eq!(end["prompt"], "<|im_end|>\n");
    let (_, new_turn) = server.post("/tokenize", &json!({ "messages": messages }));
    assert_ne!(common::ids(&new_turn["tokens"]), closed, "the default opens a new turn");

    let greedy = json!({"max_tokens": 12, "temperature": 0});
    let (_, completion) = server.post(
        "/v1/completions",
        &json!({"prompt": begun, "max_tokens": 12, "temperature": 0}),
    );
    let want = completion["choices"][0]["text"]
        .as_str()
        .expect("a completion")
        .to_string();
    assert!(!want.is_empty());
    let mut chat_body = greedy.clone();
    chat_body["messages"] = messages.clone();
    chat_body["continue_final_message"] = json!(true);
    let (status, chat) = server.post("/v1/chat/completions", &chat_body);
    assert_eq!(status, 200, "{chat}");
    assert_eq!(chat["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(chat["usage"]["prompt_tokens"], begun.len());

    let (status, message) = server.post(
        "/v1/messages",
        &json!({"max_tokens": 12, "temperature": 0, "messages": messages}),
    );
    assert_eq!(status, 200, "{message}");
    assert_eq!(message["content"][0]["text"], want.as_str());

    chat_body["add_generation_prompt"] = json!(true);
    let (status, error) = server.post("/v1/chat/completions", &chat_body);
    assert_eq!((status, error_of(&error).1), (400, Some("continue_final_message")));
}

/// vLLM's `--generation-config`: requests that leave a setting out get the model's
/// recommended one (here a directory's `generation_config.json` saying greedy, with answers of
/// at most 5 tokens), never over what they give; `--override-generation-config` goes over the
/// file, and `vllm` leaves the API's defaults.
#[test]
fn a_generation_config_fills_the_settings_requests_leave_out() {
    let dir = std::env::temp_dir().join(format!("bbc-serve-generation-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"do_sample": false, "temperature": 0.0, "max_new_tokens": 5}"#,
    )
    .unwrap();
    let server = Server::start(&["--generation-config", dir.to_str().unwrap()]);
    let plain = Server::start(&["--generation-config", "vllm"]);
    let prompt = "The capital of France is";
    let text = |server: &Server, body: Value| {
        let (status, got) = server.post("/v1/completions", &body);
        assert_eq!(status, 200, "{got}");
        (
            got["choices"][0]["text"].as_str().unwrap().to_string(),
            got["usage"]["completion_tokens"].as_u64().unwrap(),
        )
    };
    let greedy = text(&plain, json!({"prompt": prompt, "max_tokens": 5, "temperature": 0}));
    assert_eq!(text(&server, json!({"prompt": prompt, "max_tokens": 40})), greedy);
    let sampled = json!({"prompt": prompt, "max_tokens": 5, "temperature": 1.5, "seed": 3});
    let sampled_plain = text(&plain, sampled.clone());
    assert_ne!(
        sampled_plain, greedy,
        "the seed must sample away from greedy for this check"
    );
    assert_eq!(text(&server, sampled), sampled_plain);
    let (_, used) = text(
        &plain,
        json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(used, 12, "`vllm` caps nothing");

    let overridden = Server::start(&[
        "--generation-config",
        dir.to_str().unwrap(),
        "--override-generation-config",
        r#"{"max_new_tokens": 3}"#,
    ]);
    let (_, used) = text(
        &overridden,
        json!({"prompt": prompt, "max_tokens": 12, "ignore_eos": true}),
    );
    assert_eq!(used, 3);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// vLLM's `truncate_prompt_tokens`: a prompt is cut to its last tokens before it runs (the
/// answer and usage those of the cut prompt, an echo its text); more than the context is a 400.
#[test]
fn truncated_prompts_run_as_their_last_tokens() {
    let server = Server::start(&["--max-model-len", "512"]);
    let (_, tokenized) = server.post(
        "/tokenize",
        &json!({"prompt": "One two three four five six seven eight"}),
    );
    let ids = common::ids(&tokenized["tokens"]);
    let last = &ids[ids.len() - 4..];
    let answer = |body: Value| {
        let (status, got) = server.post("/v1/completions", &body);
        assert_eq!(status, 200, "{got}");
        got
    };
    let want = answer(json!({"prompt": last, "max_tokens": 8, "temperature": 0}));
    let cut = answer(
        json!({"prompt": "One two three four five six seven eight", "max_tokens": 8,
                            "temperature": 0, "truncate_prompt_tokens": 4, "echo": true}),
    );
    let (_, last_text) = server.post("/detokenize", &json!({ "tokens": last }));
    let echoed = format!(
        "{}{}",
        last_text["prompt"].as_str().unwrap(),
        want["choices"][0]["text"].as_str().unwrap()
    );
    assert_eq!(cut["choices"][0]["text"], echoed.as_str());
    assert_eq!(cut["usage"]["prompt_tokens"], 4);
    let whole = answer(json!({"prompt": ids, "max_tokens": 8, "temperature": 0, "truncate_prompt_tokens": -1}));
    assert_eq!(whole["usage"]["prompt_tokens"], ids.len());
    let (status, error) = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": 513}),
    );
    assert_eq!((status, error_of(&error).1), (400, Some("truncate_prompt_tokens")));
}

/// vLLM's `--scheduling-policy priority`: with one request running at a time, of two that
/// wait, the one of lower `priority` runs first though it came second, and one of lower
/// `priority` than the running one preempts it (which then resumes, its answer the same as
/// when nothing preempted it); under the default policy each waits its turn, and a request
/// giving a priority is refused.
#[test]
fn requests_run_in_order_of_priority_under_the_priority_policy() {
    let order = |policy: &str| -> (Vec<&'static str>, String) {
        let server = Server::start(&["--scheduling-policy", policy, "--max-num-seqs", "1"]);
        let body = |max_tokens: usize, priority: Option<i32>| {
            let mut body =
                json!({"prompt": "Count slowly:", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true});
            if let Some(p) = priority {
                body["priority"] = json!(p);
            }
            body
        };
        let with_priorities = policy == "priority";
        // Long enough for the other two to queue behind it.
        let first = body(256, with_priorities.then_some(0));
        let late = body(4, with_priorities.then_some(10));
        let later = body(4, with_priorities.then_some(-1));
        let finished = std::sync::Mutex::new(Vec::new());
        let first_text = std::sync::Mutex::new(String::new());
        let run = |name: &'static str, body: Value| {
            let (status, got) = server.post("/v1/completions", &body);
            assert_eq!(status, 200, "{name}: {got}");
            finished.lock().unwrap().push(name);
            if name == "first" {
                *first_text.lock().unwrap() = got["choices"][0]["text"].as_str().unwrap().to_owned();
            }
        };
        let waiting_for = |n: f64| {
            let deadline = Instant::now() + Duration::from_secs(20);
            while server.metric("bbc_requests_waiting") < n || server.metric("bbc_requests_running") < 1.0 {
                assert!(Instant::now() < deadline, "the requests never queued");
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        std::thread::scope(|s| {
            let run = &run;
            s.spawn(move || run("first", first));
            waiting_for(0.0);
            s.spawn(move || run("late, priority 10", late));
            waiting_for(1.0);
            s.spawn(move || run("later, priority -1", later));
        });
        (finished.into_inner().unwrap(), first_text.into_inner().unwrap())
    };
    let (by_priority, preempted) = order("priority");
    assert_eq!(by_priority, ["later, priority -1", "first", "late, priority 10"]);
    let (by_arrival, alone) = order("fcfs");
    assert_eq!(by_arrival, ["first", "late, priority 10", "later, priority -1"]);
    assert_eq!(preempted, alone);
    let server = Server::start(&[]);
    let (status, error) = server.post(
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 1, "priority": 3}),
    );
    assert_eq!((status, error_of(&error).1), (400, Some("priority")));
    let (status, _) = server.post(
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 1, "priority": 0}),
    );
    assert_eq!(status, 200);
}

/// vLLM's `allowed_token_ids` and `bad_words`: the output takes only allowed tokens, and never
/// writes a bad word (greedy "The capital of France is" says Paris until Paris is a bad
/// word); ids outside the vocabulary, either with a structured output, and beam search are
/// 400s naming the parameter.
#[test]
fn allowed_tokens_and_bad_words_shape_the_output() {
    let server = Server::start(&[]);
    let prompt = "The capital of France is";
    let complete = |extra: Value| {
        let mut body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": true});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, got) = server.post("/v1/completions", &body);
        assert_eq!(status, 200, "{got}");
        (
            got["choices"][0]["text"].as_str().unwrap().to_string(),
            common::ids(&got["choices"][0]["token_ids"]),
        )
    };
    let (plain, plain_ids) = complete(json!({}));
    assert!(plain.contains("Paris"), "{plain}");
    let allowed = [plain_ids[1], plain_ids[2], 28];
    let (_, ids) = complete(json!({"allowed_token_ids": allowed, "ignore_eos": true}));
    assert_eq!(ids.len(), 8);
    assert!(ids.iter().all(|id| allowed.contains(id)), "{ids:?} outside {allowed:?}");
    let (banned, _) = complete(json!({"bad_words": ["Paris"]}));
    assert!(!banned.contains("Paris"), "{banned}");
    assert_ne!(banned, plain);
    for (extra, param) in [
        (json!({"allowed_token_ids": [4000000]}), "allowed_token_ids"),
        (json!({"allowed_token_ids": []}), "allowed_token_ids"),
        (json!({"bad_words": "Paris"}), "bad_words"),
        (
            json!({"bad_words": ["x"], "structured_outputs": {"regex": "[a-z]+"}}),
            "bad_words",
        ),
        (json!({"use_beam_search": true}), "use_beam_search"),
    ] {
        let mut body = json!({"prompt": prompt, "max_tokens": 4});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, error) = server.post("/v1/completions", &body);
        assert_eq!((status, error_of(&error).1), (400, Some(param)), "{body}");
    }
}

/// vLLM's `skip_special_tokens` (on by default): special tokens the answer takes write no text
/// (here `<|im_end|>`, forced by `logit_bias` past `ignore_eos`), and with it off they do; the
/// tokens count and come back as ids either way.
#[test]
fn special_tokens_write_no_text_unless_asked_for() {
    let server = Server::start(&[]);
    let (_, end) = server.post("/tokenize", &json!({"prompt": "<|im_end|>"}));
    let end = common::ids(&end["tokens"]);
    assert_eq!(end.len(), 1, "one special token");
    let answer = |skip: Option<bool>| {
        let mut body = json!({"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": true,
                              "logit_bias": {end[0].to_string(): 100}, "return_token_ids": true});
        if let Some(skip) = skip {
            body["skip_special_tokens"] = json!(skip);
        }
        let (status, got) = server.post("/v1/completions", &body);
        assert_eq!(status, 200, "{got}");
        assert_eq!(common::ids(&got["choices"][0]["token_ids"]), [end[0]; 3]);
        assert_eq!(got["usage"]["completion_tokens"], 3);
        got["choices"][0]["text"].as_str().unwrap().to_string()
    };
    assert_eq!(answer(None), "");
    assert_eq!(answer(Some(true)), "");
    assert_eq!(answer(Some(false)), "<|im_end|><|im_end|><|im_end|>");
}
