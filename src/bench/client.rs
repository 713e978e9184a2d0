//! One streamed request as the InferenceX client makes it: a fresh connection, a POST, and the
//! SSE chunks timed as they arrive.

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

/// Where the server is, and the key it wants.
#[derive(Debug, Clone)]
pub struct Server {
    /// `host:port`.
    pub address: String,
    pub api_key: Option<String>,
}

impl Server {
    /// From `http://host:port[/]` or `host:port`.
    pub fn parse(url: &str, api_key: Option<String>) -> Result<Self> {
        if url.starts_with("https://") {
            bail!("bbc bench speaks plain HTTP; `{url}` asks for TLS");
        }
        let address = url.trim_start_matches("http://").trim_end_matches('/');
        if address.is_empty() || address.contains('/') || !address.contains(':') {
            bail!("`{url}` is not a server address: expected http://HOST:PORT");
        }
        Ok(Self {
            address: address.to_string(),
            api_key,
        })
    }

    /// Send a request on a new connection; the response once its head has arrived.
    async fn send(&self, method: &str, path: &str, body: Bytes) -> Result<hyper::Response<hyper::body::Incoming>> {
        let tcp = TcpStream::connect(&self.address)
            .await
            .with_context(|| format!("connecting to {}", self.address))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
        // Drives the connection until the response is read; ends with it.
        tokio::spawn(connection);
        // The InferenceX client sends the literal `None` when it has no key.
        let key = self.api_key.as_deref().unwrap_or("None");
        let request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.address)
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {key}"))
            .body(Full::new(body))?;
        Ok(sender.send_request(request).await?)
    }

    /// GET `path` and parse the JSON answer.
    pub async fn get_json(&self, path: &str) -> Result<Value> {
        let body = self.get(path).await?;
        serde_json::from_slice(&body).with_context(|| format!("GET {path}: the answer is not JSON"))
    }

    /// GET `path`'s text.
    pub async fn get_text(&self, path: &str) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.get(path).await?).into_owned())
    }

    async fn get(&self, path: &str) -> Result<Bytes> {
        let response = self.send("GET", path, Bytes::new()).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            bail!("GET {path}: HTTP {status}: {}", String::from_utf8_lossy(&body));
        }
        Ok(body)
    }

    /// POST `body` to `path` as a streamed request and time its chunks.
    pub async fn stream(&self, path: &str, body: &Value) -> Result<Measured> {
        let start = Instant::now();
        let response = self.send("POST", path, Bytes::from(body.to_string())).await?;
        let status = response.status();
        let mut body = response.into_body();
        if !status.is_success() {
            let text = body.collect().await?.to_bytes();
            bail!("HTTP {status}: {}", String::from_utf8_lossy(&text));
        }
        let mut events = SseEvents::default();
        let mut timing = Timing::new(start);
        while let Some(frame) = body.frame().await {
            if let Some(data) = frame?.data_ref() {
                let at = Instant::now();
                for event in events.push(data) {
                    timing.chunk(&event, at)?;
                }
            }
        }
        timing.finish()
    }
}

/// What one request measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    /// To the first chunk with choices.
    pub ttft: Duration,
    /// To the last chunk with choices.
    pub e2e: Duration,
    /// Between consecutive chunks with choices.
    pub itl: Vec<Duration>,
    /// As the stream's usage reports them.
    pub prompt_tokens: usize,
    pub output_tokens: usize,
}

/// Splits a byte stream into the `data:` payloads of its server-sent events.
#[derive(Default)]
struct SseEvents {
    pending: Vec<u8>,
}

impl SseEvents {
    fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            let data: Vec<&str> = std::str::from_utf8(&event)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.strip_prefix("data:").map(str::trim_start))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

/// The InferenceX client's bookkeeping over one stream's chunks.
struct Timing {
    start: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    itl: Vec<Duration>,
    usage: Option<(usize, usize)>,
    done: bool,
}

impl Timing {
    fn new(start: Instant) -> Self {
        Self {
            start,
            first: None,
            last: None,
            itl: Vec::new(),
            usage: None,
            done: false,
        }
    }

    fn chunk(&mut self, data: &str, at: Instant) -> Result<()> {
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let chunk: Value = serde_json::from_str(data).with_context(|| format!("a chunk that is not JSON: {data}"))?;
        if let Some(error) = chunk.get("error") {
            bail!("the server failed mid-stream: {error}");
        }
        let has_choices = chunk["choices"].as_array().is_some_and(|c| !c.is_empty());
        if has_choices {
            match self.last {
                Some(last) => self.itl.push(at - last),
                None => self.first = Some(at),
            }
            self.last = Some(at);
        }
        // vLLM and SGLang send usage in a chunk of its own, with empty `choices`; llama.cpp's
        // server puts it on the last chunk that has choices. Either way it is the server's own
        // count, so it is taken wherever it comes (where the InferenceX client, missing it,
        // would count the tokens of the text again).
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
            let count = |key: &str| usage[key].as_u64().map(|n| n as usize);
            self.usage = count("prompt_tokens").zip(count("completion_tokens"));
        }
        Ok(())
    }

    fn finish(self) -> Result<Measured> {
        if !self.done {
            bail!("the stream ended without `data: [DONE]`");
        }
        let (Some(first), Some(last)) = (self.first, self.last) else {
            bail!("the stream carried no choices");
        };
        let Some((prompt_tokens, output_tokens)) = self.usage else {
            bail!("the stream reported no usage (`prompt_tokens` and `completion_tokens`)");
        };
        Ok(Measured {
            ttft: first - self.start,
            e2e: last - self.start,
            itl: self.itl,
            prompt_tokens,
            output_tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_split_across_reads_and_timed_like_inferencex() {
        let start = Instant::now();
        let ms = |n| start + Duration::from_millis(n);
        let mut events = SseEvents::default();
        let mut timing = Timing::new(start);
        let reads: [(&[u8], u64); 4] = [
            (b"data: {\"choices\":[{\"text\":\"a\"}]}\n\nda", 100),
            (b"ta: {\"choices\":[{\"text\":\"b\"}]}\n\n", 130),
            (
                b"data: {\"choices\":[{\"text\":\"c\"}]}\n\ndata: {\"choices\":[],\"usage\":",
                190,
            ),
            (
                b"{\"prompt_tokens\":5,\"completion_tokens\":3}}\n\ndata: [DONE]\n\n",
                200,
            ),
        ];
        for (bytes, at) in reads {
            for event in events.push(bytes) {
                timing.chunk(&event, ms(at)).unwrap();
            }
        }
        let m = timing.finish().unwrap();
        assert_eq!(m.ttft, Duration::from_millis(100));
        assert_eq!(
            m.e2e,
            Duration::from_millis(190),
            "the usage chunk is not the last token"
        );
        assert_eq!(m.itl, vec![Duration::from_millis(30), Duration::from_millis(60)]);
        assert_eq!((m.prompt_tokens, m.output_tokens), (5, 3));
    }

    #[test]
    fn usage_on_the_last_chunk_with_choices_counts_as_llama_cpp_sends_it() {
        let start = Instant::now();
        let mut timing = Timing::new(start);
        let chunks = [
            (r#"{"choices":[{"text":"a","finish_reason":null}]}"#, 10),
            (
                r#"{"choices":[{"text":"","finish_reason":"length"}],"usage":{"prompt_tokens":7,"completion_tokens":2}}"#,
                25,
            ),
            ("[DONE]", 26),
        ];
        for (data, at) in chunks {
            timing.chunk(data, start + Duration::from_millis(at)).unwrap();
        }
        let m = timing.finish().unwrap();
        assert_eq!((m.prompt_tokens, m.output_tokens), (7, 2));
        assert_eq!(m.e2e, Duration::from_millis(25), "the chunk is timed as the others are");
        assert_eq!(m.itl, vec![Duration::from_millis(15)]);
    }

    #[test]
    fn broken_streams_are_failures_not_numbers() {
        let start = Instant::now();
        let run = |events: &[&str]| {
            let mut timing = Timing::new(start);
            for e in events {
                timing.chunk(e, start)?;
            }
            timing.finish()
        };
        let token = r#"{"choices":[{"text":"a"}]}"#;
        let usage = r#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}"#;
        assert!(run(&[token, usage, "[DONE]"]).is_ok());
        assert!(run(&[token, usage]).unwrap_err().to_string().contains("[DONE]"));
        assert!(run(&[token, "[DONE]"]).unwrap_err().to_string().contains("no usage"));
        let no_count = r#"{"choices":[],"usage":{"prompt_tokens":1}}"#;
        assert!(run(&[token, no_count, "[DONE]"])
            .unwrap_err()
            .to_string()
            .contains("no usage"));
        assert!(run(&[usage, "[DONE]"]).unwrap_err().to_string().contains("no choices"));
        assert!(run(&[token, r#"{"error":{"message":"boom"}}"#])
            .unwrap_err()
            .to_string()
            .contains("boom"));
    }

    #[test]
    fn addresses_are_host_and_port() {
        assert_eq!(
            Server::parse("http://127.0.0.1:8000/", None).unwrap().address,
            "127.0.0.1:8000"
        );
        assert_eq!(Server::parse("localhost:9", None).unwrap().address, "localhost:9");
        assert!(Server::parse("https://x:1", None).is_err());
        assert!(Server::parse("http://x:1/v1", None).is_err());
        assert!(Server::parse("x", None).is_err());
    }
}
