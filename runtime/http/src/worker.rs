//! The engine thread: owns the backend and the serving engine, takes requests and aborts over a
//! channel, and runs steps while any sequence is in flight. Each request gets its own event
//! channel; when the receiving side is gone (the client disconnected, or the handler stopped it
//! on a stop string) the sequence is aborted and its KV blocks are freed before the next step.

use super::metrics::Metrics;
use runtime::serving::{AddError, FinishReason, LogitsProcessor, PagedBackend, SeqId, ServingEngine};
use runtime::{SamplingParams, TokenLogprobs};
use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// What the engine reports to a request's handler.
#[derive(Debug)]
pub enum Event {
    /// Log-probabilities of the next prompt positions, in order (where the request asked for
    /// them), all before its first token.
    PromptLogprobs(Vec<TokenLogprobs>),
    Token(u32, Option<TokenLogprobs>),
    Finished(FinishReason),
    /// The backend failed; the request cannot continue.
    Failed(String),
}

pub struct NewRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub stop_tokens: Vec<u32>,
    pub sampling: SamplingParams,
    /// What its logits go through before each token is chosen (structured outputs' grammar,
    /// `logit_bias`, `min_tokens`).
    pub processors: Vec<Box<dyn LogitsProcessor>>,
    /// Lower first, under `--scheduling-policy priority`.
    pub priority: i32,
    pub events: mpsc::UnboundedSender<Event>,
    pub admitted: oneshot::Sender<Result<SeqId, AddError>>,
}

/// Run the engine until every sender of `requests` is gone.
pub fn run<B: PagedBackend>(
    mut engine: ServingEngine<B>,
    mut requests: mpsc::UnboundedReceiver<NewRequest>,
    metrics: Arc<Metrics>,
) {
    let mut clients: HashMap<SeqId, mpsc::UnboundedSender<Event>> = HashMap::new();
    loop {
        if engine.scheduler().is_idle() {
            match requests.blocking_recv() {
                Some(request) => admit(&mut engine, &mut clients, request),
                None => return,
            }
        }
        while let Ok(request) = requests.try_recv() {
            admit(&mut engine, &mut clients, request);
        }
        drop_departed(&mut engine, &mut clients);
        if !engine.scheduler().is_idle() {
            step(&mut engine, &mut clients, &metrics);
        }
        publish(&engine, &metrics);
    }
}

fn admit<B: PagedBackend>(
    engine: &mut ServingEngine<B>,
    clients: &mut HashMap<SeqId, mpsc::UnboundedSender<Event>>,
    r: NewRequest,
) {
    let added = engine.add_processed(
        r.prompt,
        r.max_tokens,
        r.stop_tokens,
        r.sampling,
        r.processors,
        r.priority,
    );
    if let Ok(id) = added {
        clients.insert(id, r.events);
    }
    if let (Err(_), Ok(id)) = (r.admitted.send(added.clone()), added) {
        // The handler is gone already.
        engine.abort(id);
        clients.remove(&id);
    }
}

/// Abort every sequence whose client stopped listening.
fn drop_departed<B: PagedBackend>(
    engine: &mut ServingEngine<B>,
    clients: &mut HashMap<SeqId, mpsc::UnboundedSender<Event>>,
) {
    clients.retain(|&id, events| {
        let open = !events.is_closed();
        if !open {
            engine.abort(id);
        }
        open
    });
}

fn step<B: PagedBackend>(
    engine: &mut ServingEngine<B>,
    clients: &mut HashMap<SeqId, mpsc::UnboundedSender<Event>>,
    metrics: &Metrics,
) {
    let wanted = |id: SeqId| clients.get(&id).is_some_and(|c| !c.is_closed());
    match engine.step_while(wanted) {
        Ok(out) => {
            metrics.generation_tokens.fetch_add(out.tokens.len() as u64, Relaxed);
            metrics.draft_tokens.fetch_add(out.drafted as u64, Relaxed);
            metrics.accepted_draft_tokens.fetch_add(out.accepted as u64, Relaxed);
            metrics.drafts.fetch_add(out.verified as u64, Relaxed);
            // Before any client hears of the step: a client holding its answer reads metrics
            // that count the step (its prompt's cache hits, its blocks given back).
            publish(engine, metrics);
            let scores = out
                .prompt_logprobs
                .into_iter()
                .map(|p| (p.seq, Event::PromptLogprobs(p.logprobs)));
            let tokens = out
                .tokens
                .into_iter()
                .map(|s| (s.seq, Event::Token(s.token, s.logprobs)));
            for (id, event) in scores.chain(tokens) {
                let delivered = clients.get(&id).is_some_and(|c| c.send(event).is_ok());
                if !delivered {
                    engine.abort(id);
                    clients.remove(&id);
                }
            }
            for done in out.finished {
                if let Some(client) = clients.remove(&done.seq) {
                    let _ = client.send(Event::Finished(done.reason));
                }
            }
        }
        Err(e) => {
            // A backend failure ends every request in flight; the server stays up.
            let message = format!("the engine failed: {e}");
            for (id, client) in clients.drain() {
                let _ = client.send(Event::Failed(message.clone()));
                engine.abort(id);
            }
        }
    }
}

fn publish<B: PagedBackend>(engine: &ServingEngine<B>, metrics: &Metrics) {
    let s = engine.scheduler();
    metrics.waiting.store(s.waiting() as u64, Relaxed);
    metrics.running.store(s.running() as u64, Relaxed);
    metrics.kv_blocks_used.store(s.used_blocks() as u64, Relaxed);
    metrics.kv_blocks_cached.store(s.cached_blocks() as u64, Relaxed);
    metrics.state_snapshots.store(s.state_snapshots() as u64, Relaxed);
    let prefix = s.prefix_cache_stats();
    metrics.prefix_cache_queries.store(prefix.queried, Relaxed);
    metrics.prefix_cache_hits.store(prefix.hit, Relaxed);
}
