//! Request bodies of `/v1/completions` and `/v1/chat/completions`, parsed by hand from JSON so
//! that a wrong type or value is a 400 naming the parameter (a derive would give 422s and
//! serde's positions). Parameters the server cannot honour are refused, never ignored.

use super::error::ApiError;
use super::output_spec::{self, Structured};
use super::tools::{self, Tools};
use models::ChatMessage;
use runtime::SamplingParams;
use serde_json::{Map, Value};

/// What to generate from, before tokenization.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
    Chat(Vec<ChatMessage>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    pub model: Option<String>,
    /// One, or (completions) several, each answered by `n` choices of its own.
    pub prompts: Vec<PromptInput>,
    /// None: as many as the context allows (chat) or 16 (completions, OpenAI's default).
    pub max_tokens: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    /// vLLM's `stream_options.continuous_usage_stats` (with `include_usage`): every chunk
    /// carries the usage so far.
    pub continuous_usage: bool,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Choices to generate (each its own sequence).
    pub n: usize,
    /// Chat: variables for the chat template beside its own (`chat_template_kwargs`, vLLM's
    /// name: Qwen3.5's `enable_thinking`, say).
    pub chat_template_kwargs: Map<String, Value>,
    /// Chat: where the rendered conversation ends.
    pub chat_ending: ChatEnding,
    /// The shape the output must take (structured outputs, or a tool call), where the request
    /// gives one.
    pub structured: Option<Structured>,
    /// Chat: the tools the template offers the model, and the call `tool_choice` asks for.
    pub tools: Option<Tools>,
    /// OpenAI's `logit_bias`: (token id, bias) pairs, ids not yet checked against the
    /// vocabulary.
    pub logit_bias: Vec<(u32, f32)>,
    /// vLLM's `min_tokens`: tokens generated before a stop token or string may end the output.
    pub min_tokens: usize,
    /// vLLM's `allowed_token_ids`: the only tokens the output may take (ids not yet checked
    /// against the vocabulary).
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM's `bad_words`: words the output may not complete.
    pub bad_words: Vec<String>,
    /// Completions' `echo`: the prompt's text before the output's (and, with `logprobs`, its
    /// tokens' log-probabilities before the output's).
    pub echo: bool,
    /// vLLM's `prompt_logprobs`: each prompt token's log-probability and this many
    /// alternatives, in a field of its own.
    pub prompt_logprobs: Option<usize>,
    /// vLLM's `include_stop_str_in_output`: the stop string that ends the output is kept.
    pub include_stop_str: bool,
    /// vLLM's `return_token_ids`: the prompt's and each choice's token ids in the response.
    pub return_token_ids: bool,
    /// vLLM's `return_tokens_as_token_ids`: log-probabilities name tokens `token_id:N`.
    pub return_tokens_as_token_ids: bool,
    /// vLLM's `truncate_prompt_tokens`: each prompt cut to its last tokens.
    pub truncate_prompt: Option<PromptTruncation>,
    /// vLLM's `priority`: lower first, under `--scheduling-policy priority`.
    pub priority: i32,
    /// vLLM's `skip_special_tokens` (default true): special tokens write no text.
    pub skip_special_tokens: bool,
    /// The sampling settings the request left out, which a model's recommended ones fill.
    pub unset: UnsetSampling,
    /// The most tokens any answer may have whatever `max_tokens` says (a model's
    /// `max_new_tokens`, as vLLM applies it).
    pub max_tokens_cap: Option<usize>,
}

/// How many of a prompt's last tokens to keep (vLLM's `truncate_prompt_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptTruncation {
    Last(usize),
    /// As many as the model's context holds (`-1`).
    ToContext,
}

impl PromptTruncation {
    /// `ids` cut to their last tokens within a context of `context`; whether anything went.
    /// More than the context is an error, as in vLLM.
    pub fn apply(self, ids: &mut Vec<u32>, context: usize) -> Result<bool, ApiError> {
        let keep = match self {
            Self::Last(k) if k > context => {
                return Err(ApiError::invalid(
                    "truncate_prompt_tokens",
                    format!("truncate_prompt_tokens value ({k}) is greater than max_model_len ({context}). Please, select a smaller truncation size."),
                ))
            }
            Self::Last(k) => k,
            Self::ToContext => context,
        };
        let cut = ids.len().saturating_sub(keep);
        ids.drain(..cut);
        Ok(cut > 0)
    }
}

/// Which of the settings a model's generation config recommends a request left out, and
/// whether it left out its seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UnsetSampling {
    pub temperature: bool,
    pub top_p: bool,
    pub top_k: bool,
    pub min_p: bool,
    pub repetition_penalty: bool,
    pub seed: bool,
}

/// The seeds of requests that give none, as vLLM's `--seed` makes them: each request another
/// (two such requests sample apart), the sequence fixed by the server's seed (a server started
/// again with it gives its requests the same seeds in the same order).
pub struct RequestSeeds {
    seed: u64,
    next: std::sync::atomic::AtomicU64,
}

impl RequestSeeds {
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            next: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The next unseeded request's seed: SplitMix64 of the server's seed and the request's
    /// place, so neighbouring requests' seeds share no bits.
    pub fn next(&self) -> u64 {
        let place = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut z = self
            .seed
            .wrapping_add(place.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

impl GenerationRequest {
    /// The model's recommended settings where this request left them out, and its longest
    /// answer as a cap on this one's (vLLM's `--generation-config`).
    pub fn fill_unset(&mut self, defaults: &models::GenerationDefaults) {
        let (unset, sampling) = (self.unset, &mut self.sampling);
        if let Some(t) = defaults.temperature.filter(|_| unset.temperature) {
            sampling.temperature = t as f32;
        }
        if let Some(p) = defaults.top_p.filter(|_| unset.top_p) {
            sampling.top_p = p as f32;
        }
        if let Some(k) = defaults.top_k.filter(|_| unset.top_k) {
            sampling.top_k = k.max(0) as usize;
        }
        if let Some(p) = defaults.min_p.filter(|_| unset.min_p) {
            sampling.min_p = p as f32;
        }
        if let Some(r) = defaults.repetition_penalty.filter(|_| unset.repetition_penalty) {
            sampling.repetition_penalty = r as f32;
        }
        self.max_tokens_cap = defaults.max_tokens;
    }
}

/// Where a chat prompt ends: vLLM's `add_generation_prompt` (default true) and
/// `continue_final_message`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChatEnding {
    /// The assistant's turn opened after the messages (what a chat normally asks).
    #[default]
    NewTurn,
    /// The messages as the template renders them, nothing opened after them.
    AsRendered,
    /// Cut after the final message's text, for the model to go on with it (an assistant's
    /// answer begun by the caller: "prefill").
    ContinueFinalMessage,
}

/// Which endpoint a body was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// Parse and validate a request body.
pub fn parse(body: &[u8], endpoint: Endpoint) -> Result<GenerationRequest, ApiError> {
    parse_object(&json_object(body)?, endpoint)
}

/// A request body as the JSON object every endpoint takes.
pub fn json_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    match value {
        Value::Object(obj) => Ok(obj),
        _ => Err(ApiError::bad_request("the request body must be a JSON object")),
    }
}

/// Validate a request body already read as an object (the Responses and Messages APIs hand
/// over the chat body they rewrote theirs into).
pub fn parse_object(obj: &Map<String, Value>, endpoint: Endpoint) -> Result<GenerationRequest, ApiError> {
    let fields = Fields(obj);
    let prompts = match endpoint {
        Endpoint::Completions => completion_prompts(&fields)?,
        Endpoint::Chat => vec![PromptInput::Chat(super::messages::parse(obj)?)],
    };
    let echo = endpoint == Endpoint::Completions && fields.bool("echo")? == Some(true);
    let max_tokens = match endpoint {
        Endpoint::Chat => fields.count("max_completion_tokens")?.or(fields.count("max_tokens")?),
        // The prompt alone: scored (with `logprobs`), nothing generated.
        Endpoint::Completions if echo && fields.integer("max_tokens")? == Some(0) => Some(0),
        Endpoint::Completions => fields.count("max_tokens")?,
    };
    let stream = fields.bool("stream")?.unwrap_or(false);
    let (include_usage, continuous_usage) = match obj.get("stream_options") {
        None | Some(Value::Null) => (false, false),
        Some(Value::Object(o)) => {
            let include = Fields(o).bool("include_usage")?.unwrap_or(false);
            (
                include,
                include && Fields(o).bool("continuous_usage_stats")?.unwrap_or(false),
            )
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "`stream_options` must be an object",
            ))
        }
    };
    refuse_unsupported(&fields, endpoint)?;
    let (mut sampling, unset) = sampling(&fields)?;
    sampling.logprobs = logprobs(&fields, endpoint)?;
    let prompt_logprobs = prompt_logprobs(&fields, stream)?;
    // Echoed tokens come with the log-probabilities asked of the output's.
    let echoed = sampling.logprobs.filter(|_| echo);
    sampling.prompt_logprobs = prompt_logprobs.max(echoed);
    let tools = match endpoint {
        Endpoint::Chat => tools::parse(obj)?,
        Endpoint::Completions => None,
    };
    // A forced call's shape is a structured output; `auto` leaves the output free (or to
    // the request's own structured output, its calls then read from what that allows).
    let structured = match (
        output_spec::parse(obj)?,
        tools
            .as_ref()
            .and_then(|t| t.calling.as_ref())
            .and_then(|c| c.structured()),
    ) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "a tool call's shape is its tool's; it cannot be combined with another structured output",
            ))
        }
        (structured, call) => structured.or(call),
    };
    let min_tokens = min_tokens(&fields, max_tokens, structured.is_some())?;
    let allowed_token_ids = fields.ids("allowed_token_ids")?;
    let bad_words = bad_words(&fields)?;
    // A structured output's grammar may allow nothing these leave.
    if structured.is_some() {
        if let Some(name) = [
            ("allowed_token_ids", allowed_token_ids.is_some()),
            ("bad_words", !bad_words.is_empty()),
        ]
        .into_iter()
        .find_map(|(name, given)| given.then_some(name))
        {
            return Err(ApiError::invalid(
                name,
                format!("`{name}` cannot be combined with a structured output"),
            ));
        }
    }
    if allowed_token_ids.as_ref().is_some_and(Vec::is_empty) {
        return Err(ApiError::invalid(
            "allowed_token_ids",
            "`allowed_token_ids` must name at least one token",
        ));
    }
    Ok(GenerationRequest {
        model: fields.string("model")?,
        prompts,
        max_tokens,
        stream,
        include_usage,
        continuous_usage,
        sampling,
        stop: stop_strings(&fields)?,
        stop_token_ids: fields.ids("stop_token_ids")?.unwrap_or_default(),
        ignore_eos: fields.bool("ignore_eos")?.unwrap_or(false),
        n: choices(&fields)?,
        chat_template_kwargs: template_kwargs(&fields, endpoint)?,
        chat_ending: chat_ending(&fields, endpoint)?,
        structured,
        tools,
        logit_bias: logit_bias(&fields)?,
        min_tokens,
        allowed_token_ids,
        bad_words,
        echo,
        prompt_logprobs,
        include_stop_str: fields.bool("include_stop_str_in_output")?.unwrap_or(false),
        return_token_ids: fields.bool("return_token_ids")?.unwrap_or(false),
        return_tokens_as_token_ids: fields.bool("return_tokens_as_token_ids")?.unwrap_or(false),
        truncate_prompt: truncate_prompt(&fields)?,
        priority: priority(&fields)?,
        skip_special_tokens: fields.bool("skip_special_tokens")?.unwrap_or(true),
        unset,
        max_tokens_cap: None,
    })
}

/// Parameters of OpenAI's or vLLM's API that would change the output and that this server
/// does not implement: a 400 naming them rather than an answer that ignores them.
fn refuse_unsupported(fields: &Fields, endpoint: Endpoint) -> Result<(), ApiError> {
    let unsupported = |name: &str, what: &str| Err(ApiError::invalid(name, format!("{what} is not supported")));
    if endpoint == Endpoint::Chat && fields.bool("echo")? == Some(true) {
        return unsupported("echo", "`echo` on /v1/chat/completions");
    }
    if fields.string("suffix")?.is_some_and(|s| !s.is_empty()) {
        return unsupported("suffix", "`suffix` (text after the completion)");
    }
    for name in ["functions", "function_call"] {
        if fields.get(name).is_some() {
            return unsupported(name, "function calling");
        }
    }
    if fields.bool("use_beam_search")? == Some(true) {
        return unsupported("use_beam_search", "beam search");
    }
    if endpoint == Endpoint::Completions {
        for name in ["tools", "tool_choice"] {
            if fields.get(name).is_some() {
                return unsupported(name, "tool calling on /v1/completions");
            }
        }
    }
    Ok(())
}

/// OpenAI's `logit_bias`: an object from token ids (as strings) to biases in [−100, 100].
fn logit_bias(fields: &Fields) -> Result<Vec<(u32, f32)>, ApiError> {
    let name = "logit_bias";
    let Some(value) = fields.get(name) else {
        return Ok(Vec::new());
    };
    let entries = value
        .as_object()
        .ok_or_else(|| Fields::wrong_type(name, "an object from token ids to biases"))?;
    entries
        .iter()
        .map(|(id, bias)| {
            let id: u32 = id
                .parse()
                .map_err(|_| ApiError::invalid(name, format!("`logit_bias` keys must be token ids, got {id:?}")))?;
            match bias.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => Ok((id, b as f32)),
                _ => Err(ApiError::invalid(
                    name,
                    format!("`logit_bias` values must be numbers in [-100, 100], got {bias}"),
                )),
            }
        })
        .collect()
}

/// vLLM's `min_tokens`: at most `max_tokens`, and not with a structured output (whose
/// grammar may leave nothing but the end to take).
fn min_tokens(fields: &Fields, max_tokens: Option<usize>, structured: bool) -> Result<usize, ApiError> {
    let name = "min_tokens";
    let min = match fields.integer(name)? {
        None => return Ok(0),
        Some(n) if n >= 0 => n as usize,
        Some(n) => {
            return Err(ApiError::invalid(
                name,
                format!("`min_tokens` must be at least 0, got {n}"),
            ))
        }
    };
    if max_tokens.is_some_and(|max| min > max) {
        return Err(ApiError::invalid(name, "`min_tokens` must not exceed `max_tokens`"));
    }
    if structured && min > 0 {
        return Err(ApiError::invalid(
            name,
            "`min_tokens` cannot be combined with a structured output",
        ));
    }
    Ok(min)
}

/// `chat_template_kwargs`: an object, on chat requests only (a completion has no template).
fn template_kwargs(fields: &Fields, endpoint: Endpoint) -> Result<Map<String, Value>, ApiError> {
    let name = "chat_template_kwargs";
    match (fields.get(name), endpoint) {
        (None, _) => Ok(Map::new()),
        (Some(_), Endpoint::Completions) => Err(ApiError::invalid(
            name,
            "`chat_template_kwargs` applies to /v1/chat/completions",
        )),
        (Some(Value::Object(kwargs)), Endpoint::Chat) => {
            match models::ChatTemplate::RESERVED.iter().find(|n| kwargs.contains_key(**n)) {
                Some(reserved) => Err(ApiError::invalid(
                    name,
                    format!("`{reserved}` is the chat template's own variable"),
                )),
                None => Ok(kwargs.clone()),
            }
        }
        (Some(_), Endpoint::Chat) => Err(Fields::wrong_type(name, "an object")),
    }
}

/// vLLM's `priority`: an integer (default 0).
fn priority(fields: &Fields) -> Result<i32, ApiError> {
    match fields.integer("priority")? {
        None => Ok(0),
        Some(p) => i32::try_from(p)
            .map_err(|_| ApiError::invalid("priority", format!("`priority` must be a 32-bit integer, got {p}"))),
    }
}

/// vLLM's `truncate_prompt_tokens`: -1 (the model's context) or at least 1.
fn truncate_prompt(fields: &Fields) -> Result<Option<PromptTruncation>, ApiError> {
    match fields.integer("truncate_prompt_tokens")? {
        None => Ok(None),
        Some(-1) => Ok(Some(PromptTruncation::ToContext)),
        Some(k) if k >= 1 => Ok(Some(PromptTruncation::Last(k as usize))),
        Some(k) => Err(ApiError::invalid(
            "truncate_prompt_tokens",
            format!("`truncate_prompt_tokens` must be -1 or at least 1, got {k}"),
        )),
    }
}

/// vLLM's `add_generation_prompt` and `continue_final_message`, on chat requests only. As in
/// vLLM, asking for both is an error; `continue_final_message` alone turns the generation
/// prompt off.
fn chat_ending(fields: &Fields, endpoint: Endpoint) -> Result<ChatEnding, ApiError> {
    let generation_prompt = fields.bool("add_generation_prompt")?;
    let continuing = fields.bool("continue_final_message")?;
    if endpoint == Endpoint::Completions {
        if let Some(name) = ["add_generation_prompt", "continue_final_message"]
            .into_iter()
            .find(|name| fields.get(name).is_some())
        {
            return Err(ApiError::invalid(
                name,
                format!("`{name}` applies to /v1/chat/completions"),
            ));
        }
    }
    match (generation_prompt, continuing) {
        (Some(true), Some(true)) => Err(ApiError::invalid(
            "continue_final_message",
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        )),
        (_, Some(true)) => Ok(ChatEnding::ContinueFinalMessage),
        (Some(false), _) => Ok(ChatEnding::AsRendered),
        _ => Ok(ChatEnding::NewTurn),
    }
}

/// A completion's prompts: a string, an array of token ids, or an array of several of either
/// (OpenAI's batched prompts, as lm-eval's `local-completions` sends even one).
fn completion_prompts(fields: &Fields) -> Result<Vec<PromptInput>, ApiError> {
    /// Prompts one request may carry (each with its `n` choices).
    const MAX: usize = 256;
    let name = "prompt";
    let wrong = || {
        ApiError::invalid(
            name,
            "`prompt` must be a string, an array of token ids, or an array of several of them",
        )
    };
    let one = |value: &Value| match value {
        Value::String(s) => Ok(PromptInput::Text(s.clone())),
        Value::Array(items) => items
            .iter()
            .map(|i| i.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect::<Option<Vec<u32>>>()
            .map(PromptInput::Ids)
            .ok_or_else(wrong),
        _ => Err(wrong()),
    };
    match fields.get(name) {
        None => Err(ApiError::invalid(name, "`prompt` is required")),
        Some(Value::Array(items)) if items.first().is_some_and(|i| i.is_string() || i.is_array()) => {
            if items.len() > MAX {
                return Err(ApiError::invalid(
                    name,
                    format!("a request carries at most {MAX} prompts, got {}", items.len()),
                ));
            }
            items.iter().map(one).collect()
        }
        Some(value) => Ok(vec![one(value)?]),
    }
}

/// The sampling settings, and which of those a model may recommend were left out.
fn sampling(fields: &Fields) -> Result<(SamplingParams, UnsetSampling), ApiError> {
    let defaults = SamplingParams::default();
    let unset = UnsetSampling {
        temperature: fields.get("temperature").is_none(),
        top_p: fields.get("top_p").is_none(),
        top_k: fields.get("top_k").is_none(),
        min_p: fields.get("min_p").is_none(),
        repetition_penalty: fields.get("repetition_penalty").is_none(),
        seed: fields.get("seed").is_none(),
    };
    // The ranges a model's recommended settings keep to as well.
    let in_range = |name: &str, value: f64| match models::generation_defaults::out_of_range(name, value) {
        Some(problem) => Err(ApiError::invalid(name, problem)),
        None => Ok(value),
    };
    // OpenAI's default temperature is 1.
    let temperature = in_range("temperature", fields.number("temperature")?.unwrap_or(1.0))?;
    let top_p = in_range("top_p", fields.number("top_p")?.unwrap_or(1.0))?;
    let min_p = in_range("min_p", fields.number("min_p")?.unwrap_or(0.0))?;
    let top_k = fields.integer("top_k")?.unwrap_or(0);
    in_range("top_k", top_k as f64)?;
    // -1 and 0 keep every token.
    let top_k = top_k.max(0) as usize;
    let mut penalties = [0.0; 2];
    for (slot, param) in penalties.iter_mut().zip(["presence_penalty", "frequency_penalty"]) {
        *slot = fields.number(param)?.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(slot) {
            return Err(ApiError::invalid(
                param,
                format!("`{param}` must be in [-2, 2], got {slot}"),
            ));
        }
    }
    let repetition_penalty = in_range(
        "repetition_penalty",
        fields.number("repetition_penalty")?.unwrap_or(1.0),
    )?;
    let seed = match fields.integer("seed")? {
        None => defaults.seed,
        Some(s) => s as u64,
    };
    let sampling = SamplingParams {
        temperature: temperature as f32,
        seed,
        top_k,
        top_p: top_p as f32,
        min_p: min_p as f32,
        presence_penalty: penalties[0] as f32,
        frequency_penalty: penalties[1] as f32,
        repetition_penalty: repetition_penalty as f32,
        logprobs: None,
        prompt_logprobs: None,
    };
    Ok((sampling, unset))
}

/// `n` choices (each a sequence of its own); `best_of` is accepted when it asks for no more.
fn choices(fields: &Fields) -> Result<usize, ApiError> {
    const MAX: i64 = 16;
    let n = fields.integer("n")?.unwrap_or(1);
    if !(1..=MAX).contains(&n) {
        return Err(ApiError::invalid(
            "n",
            format!("`n` must be between 1 and {MAX}, got {n}"),
        ));
    }
    if let Some(best_of) = fields.integer("best_of")? {
        if best_of != 1 && best_of != n {
            return Err(ApiError::invalid(
                "best_of",
                format!("`best_of` other than 1 or `n` is not supported, got {best_of}"),
            ));
        }
    }
    Ok(n as usize)
}

/// How many alternatives to report per token, when log-probabilities are asked for:
/// completions send `logprobs: N`; chat sends `logprobs: true` and `top_logprobs: N`.
fn logprobs(fields: &Fields, endpoint: Endpoint) -> Result<Option<usize>, ApiError> {
    const MAX: i64 = 20;
    let top = |param: &str, n: Option<i64>| match n {
        Some(n) if !(0..=MAX).contains(&n) => Err(ApiError::invalid(
            param,
            format!("`{param}` must be between 0 and {MAX}, got {n}"),
        )),
        n => Ok(n.map(|n| n as usize)),
    };
    match endpoint {
        Endpoint::Completions => top("logprobs", fields.integer("logprobs")?),
        Endpoint::Chat => {
            let alternatives = top("top_logprobs", fields.integer("top_logprobs")?)?;
            match fields.bool("logprobs")? {
                Some(true) => Ok(Some(alternatives.unwrap_or(0))),
                _ if alternatives.is_some() => Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs: true`",
                )),
                _ => Ok(None),
            }
        }
    }
}

/// vLLM's `prompt_logprobs`: 0 to 20 alternatives per prompt position, not streamed (as vLLM
/// refuses it there).
fn prompt_logprobs(fields: &Fields, stream: bool) -> Result<Option<usize>, ApiError> {
    const MAX: i64 = 20;
    let name = "prompt_logprobs";
    match fields.integer(name)? {
        None => Ok(None),
        Some(_) if stream => Err(ApiError::invalid(
            name,
            "`prompt_logprobs` are not available when `stream` is true",
        )),
        Some(n) if (0..=MAX).contains(&n) => Ok(Some(n as usize)),
        Some(n) => Err(ApiError::invalid(
            name,
            format!("`{name}` must be between 0 and {MAX}, got {n}"),
        )),
    }
}

/// vLLM's `bad_words`: an array of non-empty strings.
fn bad_words(fields: &Fields) -> Result<Vec<String>, ApiError> {
    let wrong = || ApiError::invalid("bad_words", "`bad_words` must be an array of non-empty strings");
    match fields.get("bad_words") {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().filter(|w| !w.trim().is_empty()).map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(wrong),
        Some(_) => Err(wrong()),
    }
}

fn stop_strings(fields: &Fields) -> Result<Vec<String>, ApiError> {
    let stops = match fields.0.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::invalid("stop", "`stop` must be a string or an array of strings"))?,
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "`stop` must be a string or an array of strings",
            ))
        }
    };
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "`stop` strings must not be empty"));
    }
    Ok(stops)
}

/// Typed access to a body's fields; `null` counts as absent.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn wrong_type(name: &str, want: &str) -> ApiError {
        ApiError::invalid(name, format!("`{name}` must be {want}"))
    }

    fn string(&self, name: &str) -> Result<Option<String>, ApiError> {
        self.get(name)
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| Self::wrong_type(name, "a string"))
            })
            .transpose()
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        self.get(name)
            .map(|v| v.as_bool().ok_or_else(|| Self::wrong_type(name, "a boolean")))
            .transpose()
    }

    fn number(&self, name: &str) -> Result<Option<f64>, ApiError> {
        self.get(name)
            .map(|v| v.as_f64().ok_or_else(|| Self::wrong_type(name, "a number")))
            .transpose()
    }

    fn integer(&self, name: &str) -> Result<Option<i64>, ApiError> {
        self.get(name)
            .map(|v| v.as_i64().ok_or_else(|| Self::wrong_type(name, "an integer")))
            .transpose()
    }

    /// A count of tokens: an integer ≥ 1.
    fn count(&self, name: &str) -> Result<Option<usize>, ApiError> {
        match self.integer(name)? {
            None => Ok(None),
            Some(n) if n >= 1 => Ok(Some(n as usize)),
            Some(n) => Err(ApiError::invalid(name, format!("`{name}` must be at least 1, got {n}"))),
        }
    }

    fn ids(&self, name: &str) -> Result<Option<Vec<u32>>, ApiError> {
        let Some(v) = self.get(name) else { return Ok(None) };
        let items = v
            .as_array()
            .ok_or_else(|| Self::wrong_type(name, "an array of token ids"))?;
        items
            .iter()
            .map(|i| {
                i.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| Self::wrong_type(name, "an array of token ids"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}

#[cfg(test)]
impl GenerationRequest {
    /// The messages of a chat request (the tests of the APIs rewritten as chat requests).
    pub fn chat_messages(self) -> Vec<ChatMessage> {
        match <[PromptInput; 1]>::try_from(self.prompts) {
            Ok([PromptInput::Chat(messages)]) => messages,
            other => panic!("not a chat request: {other:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completions(body: &str) -> Result<GenerationRequest, ApiError> {
        parse(body.as_bytes(), Endpoint::Completions)
    }

    fn chat_request(body: &str) -> Result<GenerationRequest, ApiError> {
        parse(body.as_bytes(), Endpoint::Chat)
    }

    #[test]
    fn the_inferencex_body_parses() {
        let r = completions(
            r#"{"model":"m","prompt":"hi","temperature":0.0,"best_of":1,"max_tokens":8,"logprobs":null,
                "stream":true,"stream_options":{"include_usage":true},"ignore_eos":true}"#,
        )
        .unwrap();
        assert_eq!(r.prompts, [PromptInput::Text("hi".into())]);
        assert_eq!(
            (r.max_tokens, r.stream, r.include_usage, r.ignore_eos),
            (Some(8), true, true, true)
        );
        assert_eq!(r.sampling.temperature, 0.0);
    }

    /// `chat_template_kwargs` reaches a chat request as given; anything else is a 400 naming it:
    /// not an object, a template variable of its own, or on a completion.
    #[test]
    fn chat_template_kwargs_are_an_object_of_the_callers_variables() {
        let chat = chat_request;
        let r =
            chat(r#"{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"enable_thinking":false}}"#)
                .unwrap();
        assert_eq!(r.chat_template_kwargs.get("enable_thinking"), Some(&Value::Bool(false)));
        for body in [
            r#"{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":[1]}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"messages":[]}}"#,
        ] {
            assert_eq!(chat(body).unwrap_err().param.as_deref(), Some("chat_template_kwargs"));
        }
        let completion = completions(r#"{"prompt":"x","chat_template_kwargs":{}}"#);
        assert_eq!(completion.unwrap_err().param.as_deref(), Some("chat_template_kwargs"));
    }

    /// vLLM's chat endings: the generation prompt by default, turned off by
    /// `add_generation_prompt: false` or by continuing the final message; both asked for is
    /// a 400, as is either on a completion.
    #[test]
    fn chat_endings_follow_vllms_flags() {
        let ending = |extra: &str| {
            chat_request(&format!(r#"{{"messages":[{{"role":"user","content":"x"}}]{extra}}}"#)).map(|r| r.chat_ending)
        };
        assert_eq!(ending("").unwrap(), ChatEnding::NewTurn);
        assert_eq!(ending(r#","add_generation_prompt":true"#).unwrap(), ChatEnding::NewTurn);
        assert_eq!(
            ending(r#","add_generation_prompt":false"#).unwrap(),
            ChatEnding::AsRendered
        );
        for continued in [
            r#","continue_final_message":true"#,
            r#","continue_final_message":true,"add_generation_prompt":false"#,
        ] {
            assert_eq!(ending(continued).unwrap(), ChatEnding::ContinueFinalMessage);
        }
        assert_eq!(
            ending(r#","continue_final_message":false"#).unwrap(),
            ChatEnding::NewTurn
        );
        let both = ending(r#","continue_final_message":true,"add_generation_prompt":true"#).unwrap_err();
        assert_eq!(both.param.as_deref(), Some("continue_final_message"));
        let typed = ending(r#","add_generation_prompt":"no""#).unwrap_err();
        assert_eq!(typed.param.as_deref(), Some("add_generation_prompt"));
        for name in ["add_generation_prompt", "continue_final_message"] {
            let err = completions(&format!(r#"{{"prompt":"x","{name}":false}}"#)).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(name));
        }
    }

    /// A model's recommended settings fill what a request left out (or sent as null), never
    /// what it gave; its longest answer becomes the request's cap.
    #[test]
    fn recommended_settings_fill_only_what_was_left_out() {
        let defaults = models::GenerationDefaults {
            temperature: Some(0.6),
            top_p: Some(0.95),
            top_k: Some(20),
            min_p: Some(0.05),
            repetition_penalty: Some(1.1),
            max_tokens: Some(64),
        };
        let mut bare = completions(r#"{"prompt":"x","temperature":null}"#).unwrap();
        bare.fill_unset(&defaults);
        let s = &bare.sampling;
        assert_eq!(
            (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty),
            (0.6, 0.95, 20, 0.05, 1.1)
        );
        assert_eq!(bare.max_tokens_cap, Some(64));
        let mut given =
            completions(r#"{"prompt":"x","temperature":0,"top_p":1,"top_k":-1,"min_p":0,"repetition_penalty":1}"#)
                .unwrap();
        given.fill_unset(&defaults);
        let s = &given.sampling;
        assert_eq!(
            (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty),
            (0.0, 1.0, 0, 0.0, 1.0)
        );
        let mut unlimited = completions(r#"{"prompt":"x"}"#).unwrap();
        unlimited.fill_unset(&models::GenerationDefaults::default());
        assert_eq!((unlimited.sampling.temperature, unlimited.max_tokens_cap), (1.0, None));
    }

    #[test]
    fn truncation_keeps_a_prompts_last_tokens() {
        let truncation = |extra: &str| completions(&format!(r#"{{"prompt":"x"{extra}}}"#)).map(|r| r.truncate_prompt);
        assert_eq!(truncation("").unwrap(), None);
        assert_eq!(
            truncation(r#","truncate_prompt_tokens":3"#).unwrap(),
            Some(PromptTruncation::Last(3))
        );
        assert_eq!(
            truncation(r#","truncate_prompt_tokens":-1"#).unwrap(),
            Some(PromptTruncation::ToContext)
        );
        for bad in [r#","truncate_prompt_tokens":0"#, r#","truncate_prompt_tokens":-2"#] {
            assert_eq!(
                truncation(bad).unwrap_err().param.as_deref(),
                Some("truncate_prompt_tokens")
            );
        }
        let mut ids: Vec<u32> = (0..10).collect();
        assert!(PromptTruncation::Last(4).apply(&mut ids, 8).unwrap());
        assert_eq!(ids, [6, 7, 8, 9]);
        assert!(!PromptTruncation::Last(4).apply(&mut ids, 8).unwrap());
        assert!(!PromptTruncation::ToContext.apply(&mut ids, 8).unwrap());
        assert!(PromptTruncation::ToContext.apply(&mut ids, 2).unwrap());
        assert_eq!(ids, [8, 9]);
        assert!(PromptTruncation::Last(9).apply(&mut ids, 8).is_err());
    }

    #[test]
    fn errors_name_the_parameter() {
        let param = |body: &str| completions(body).unwrap_err().param;
        assert_eq!(
            param(r#"{"prompt":"x","temperature":-1}"#).as_deref(),
            Some("temperature")
        );
        assert_eq!(
            param(r#"{"prompt":"x","temperature":"hot"}"#).as_deref(),
            Some("temperature")
        );
        assert_eq!(param(r#"{"prompt":"x","top_p":0}"#).as_deref(), Some("top_p"));
        assert_eq!(param(r#"{"prompt":"x","top_k":-2}"#).as_deref(), Some("top_k"));
        assert_eq!(param(r#"{"prompt":"x","max_tokens":0}"#).as_deref(), Some("max_tokens"));
        assert_eq!(
            param(r#"{"prompt":"x","max_tokens":1.5}"#).as_deref(),
            Some("max_tokens")
        );
        assert_eq!(param(r#"{"prompt":"x","stop":[1]}"#).as_deref(), Some("stop"));
        assert_eq!(param(r#"{"prompt":"x","n":0}"#).as_deref(), Some("n"));
        assert_eq!(param(r#"{"prompt":"x","n":2,"best_of":3}"#).as_deref(), Some("best_of"));
        assert_eq!(param(r#"{"prompt":"x","logprobs":21}"#).as_deref(), Some("logprobs"));
        assert_eq!(param(r#"{"prompt":"x","logprobs":true}"#).as_deref(), Some("logprobs"));
        assert_eq!(
            param(r#"{"prompt":"x","presence_penalty":3}"#).as_deref(),
            Some("presence_penalty")
        );
        assert_eq!(
            param(r#"{"prompt":"x","repetition_penalty":0}"#).as_deref(),
            Some("repetition_penalty")
        );
        assert_eq!(param(r#"{"prompt":"x","stream":"yes"}"#).as_deref(), Some("stream"));
        assert_eq!(param(r#"{"prompt":[1,-3]}"#).as_deref(), Some("prompt"));
        assert_eq!(param(r#"{}"#).as_deref(), Some("prompt"));
        assert_eq!(
            parse(br#"{"messages":[{"content":"x"}]}"#, Endpoint::Chat)
                .unwrap_err()
                .param
                .as_deref(),
            Some("messages")
        );
    }

    #[test]
    fn logit_bias_and_min_tokens_parse_and_their_bad_values_are_named() {
        let r =
            completions(r#"{"prompt":"x","logit_bias":{"5":-100,"17":2.5},"min_tokens":3,"max_tokens":4}"#).unwrap();
        assert_eq!((r.logit_bias, r.min_tokens), (vec![(5, -100.0), (17, 2.5)], 3));
        let param = |body: &str| completions(body).unwrap_err().param;
        for (body, name) in [
            (r#"{"prompt":"x","logit_bias":[1]}"#, "logit_bias"),
            (r#"{"prompt":"x","logit_bias":{"a":1}}"#, "logit_bias"),
            (r#"{"prompt":"x","logit_bias":{"-1":1}}"#, "logit_bias"),
            (r#"{"prompt":"x","logit_bias":{"1":101}}"#, "logit_bias"),
            (r#"{"prompt":"x","logit_bias":{"1":"up"}}"#, "logit_bias"),
            (r#"{"prompt":"x","min_tokens":-1}"#, "min_tokens"),
            (r#"{"prompt":"x","min_tokens":5,"max_tokens":4}"#, "min_tokens"),
            (r#"{"prompt":"x","min_tokens":2,"guided_regex":"a+"}"#, "min_tokens"),
        ] {
            assert_eq!(param(body).as_deref(), Some(name), "{body}");
        }
    }

    /// What would change the output and is not built is a 400 naming it; the same parameters
    /// at values that ask for nothing pass.
    #[test]
    fn unsupported_parameters_are_refused_not_ignored() {
        let chat = |extra: &str| {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"x"}}]{extra}}}"#);
            parse(body.as_bytes(), Endpoint::Chat).map_err(|e| e.param)
        };
        let tools = r#","tools":[{"type":"function","function":{"name":"f","parameters":{}}}]"#;
        // `auto` (the default with tools) leaves the output free, or to a structured output.
        assert!(chat(tools).is_ok());
        let auto = format!(r#"{tools},"tool_choice":"auto","response_format":{{"type":"json_object"}}"#);
        assert!(chat(&auto).is_ok());
        assert!(chat(&format!(r#"{tools},"tool_choice":"none""#)).is_ok());
        assert!(chat(r#","tools":[],"tool_choice":"auto""#).is_ok());
        let required = parse(
            format!(r#"{{"messages":[{{"role":"user","content":"x"}}]{tools},"tool_choice":"required"}}"#).as_bytes(),
            Endpoint::Chat,
        )
        .unwrap();
        assert_eq!(required.structured.map(|s| s.param).as_deref(), Some("tools"));
        let both = format!(r#"{tools},"tool_choice":"required","response_format":{{"type":"json_object"}}"#);
        assert_eq!(chat(&both).unwrap_err().as_deref(), Some("tool_choice"));
        let on_completions = format!(r#"{{"prompt":"x"{tools}}}"#);
        assert_eq!(
            completions(&on_completions).unwrap_err().param.as_deref(),
            Some("tools")
        );
        assert_eq!(
            chat(r#","functions":[{"name":"f"}]"#).unwrap_err().as_deref(),
            Some("functions")
        );
        assert_eq!(chat(r#","echo":true"#).unwrap_err().as_deref(), Some("echo"));
        for (body, name) in [
            (r#"{"prompt":"x","suffix":"end"}"#, "suffix"),
            (
                r#"{"prompt":"x","include_stop_str_in_output":1}"#,
                "include_stop_str_in_output",
            ),
        ] {
            assert_eq!(completions(body).unwrap_err().param.as_deref(), Some(name), "{body}");
        }
        assert!(completions(r#"{"prompt":"x","echo":false,"suffix":"","prompt_logprobs":null}"#).is_ok());
    }

    /// A completion's prompt is text, ids, or an array of several of either (lm-eval sends
    /// `[[ids]]` even for one); anything else is a 400 naming `prompt`.
    #[test]
    fn completions_take_one_prompt_or_several() {
        let prompts = |body: &str| completions(body).map(|r| r.prompts).map_err(|e| e.param);
        assert_eq!(prompts(r#"{"prompt":[1,2]}"#), Ok(vec![PromptInput::Ids(vec![1, 2])]));
        assert_eq!(prompts(r#"{"prompt":[[1,2]]}"#), Ok(vec![PromptInput::Ids(vec![1, 2])]));
        assert_eq!(
            prompts(r#"{"prompt":["a",[3],"b"]}"#),
            Ok(vec![
                PromptInput::Text("a".into()),
                PromptInput::Ids(vec![3]),
                PromptInput::Text("b".into())
            ])
        );
        let many = format!(r#"{{"prompt":[{}]}}"#, vec!["\"x\""; 257].join(","));
        for body in [
            r#"{"prompt":[[1,-2]]}"#,
            r#"{"prompt":[[1],5]}"#,
            r#"{"prompt":["a",{}]}"#,
            r#"{"prompt":[1.5]}"#,
            r#"{"prompt":{}}"#,
            r#"{"prompt":null}"#,
            many.as_str(),
        ] {
            assert_eq!(prompts(body), Err(Some("prompt".into())), "{body}");
        }
    }

    /// `echo` (completions only) may ask for no output at all; echoed tokens carry the
    /// output's `logprobs`, so the prompt is scored with the larger of that and
    /// `prompt_logprobs`, which is refused when streamed or out of range.
    #[test]
    fn echo_and_prompt_logprobs_ask_for_the_prompt_scored() {
        let r = completions(r#"{"prompt":"x","echo":true,"max_tokens":0,"logprobs":2,"prompt_logprobs":1}"#).unwrap();
        assert_eq!((r.echo, r.max_tokens, r.prompt_logprobs), (true, Some(0), Some(1)));
        assert_eq!((r.sampling.logprobs, r.sampling.prompt_logprobs), (Some(2), Some(2)));
        let r = completions(r#"{"prompt":"x","echo":true}"#).unwrap();
        assert_eq!((r.sampling.prompt_logprobs, r.prompt_logprobs), (None, None));
        let r = completions(r#"{"prompt":"x","prompt_logprobs":3,"logprobs":1}"#).unwrap();
        assert_eq!((r.echo, r.sampling.prompt_logprobs), (false, Some(3)));
        let chat = br#"{"messages":[{"role":"user","content":"x"}],"prompt_logprobs":0}"#;
        assert_eq!(parse(chat, Endpoint::Chat).unwrap().sampling.prompt_logprobs, Some(0));
        let param = |body: &str| completions(body).unwrap_err().param;
        for (body, name) in [
            (r#"{"prompt":"x","max_tokens":0}"#, "max_tokens"),
            (r#"{"prompt":"x","echo":true,"max_tokens":-1}"#, "max_tokens"),
            (r#"{"prompt":"x","prompt_logprobs":21}"#, "prompt_logprobs"),
            (r#"{"prompt":"x","prompt_logprobs":-1}"#, "prompt_logprobs"),
            (r#"{"prompt":"x","prompt_logprobs":"1"}"#, "prompt_logprobs"),
            (r#"{"prompt":"x","prompt_logprobs":1,"stream":true}"#, "prompt_logprobs"),
        ] {
            assert_eq!(param(body).as_deref(), Some(name), "{body}");
        }
    }

    #[test]
    fn malformed_json_is_a_400() {
        for body in ["", "{", "[1,2]", "\"x\"", "{\"prompt\":\"x\",}"] {
            assert_eq!(completions(body).unwrap_err().status.as_u16(), 400, "{body:?}");
        }
    }

    #[test]
    fn chat_takes_max_completion_tokens_and_text_parts() {
        let r = parse(
            br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
                 "max_completion_tokens":5}"#,
            Endpoint::Chat,
        )
        .unwrap();
        assert_eq!(r.prompts, [PromptInput::Chat(vec![ChatMessage::new("user", "ab")])]);
        assert_eq!(r.max_tokens, Some(5));
        let r = parse(
            br#"{"messages":[{"role":"user","content":"a"}],"logprobs":true,"top_logprobs":3}"#,
            Endpoint::Chat,
        )
        .unwrap();
        assert_eq!(r.sampling.logprobs, Some(3));
    }
}
