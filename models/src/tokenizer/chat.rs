//! Chat templates: the model's own Jinja template (GGUF `tokenizer.chat_template`, an HF
//! directory's `chat_template.jinja` or `tokenizer_config.json`'s `chat_template`), rendered
//! with minijinja as transformers renders it: blocks trimmed and left-stripped (its jinja2
//! environment's `trim_blocks` and `lstrip_blocks`), `break` and `continue`; `messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token`, and `raise_exception`, plus a caller's
//! own variables (an OpenAI request's `chat_template_kwargs`, such as Qwen3.5's
//! `enable_thinking`).

use crate::error::{ModelError, Result};
use serde::{Deserialize, Serialize};

/// One message as chat templates read it: `role` and `content`, and where a conversation
/// uses tools, an assistant's `tool_calls` (OpenAI's objects, each `function.arguments` an
/// object as transformers' templates expect) and a tool result's `tool_call_id` and `name`.
/// Fields a message lacks are not there at all, so `is defined` tests read them right.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    pub(crate) fn new(source: &str, tokenizer: &tokenizers::Tokenizer, bos: Option<u32>, eos: Option<u32>) -> Self {
        let text = |id: Option<u32>| id.and_then(|i| tokenizer.id_to_token(i)).unwrap_or_default();
        Self {
            source: source.to_string(),
            bos_token: text(bos),
            eos_token: text(eos),
        }
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Another template's `source` with this one's BOS and EOS texts.
    pub(crate) fn with_source(&self, source: &str) -> Self {
        Self {
            source: source.to_string(),
            ..self.clone()
        }
    }

    /// The variables every render sets, which a caller's may not replace.
    pub const RESERVED: [&'static str; 4] = ["messages", "add_generation_prompt", "bos_token", "eos_token"];

    /// The prompt text for `messages`, ending with the assistant's turn opened when
    /// `add_generation_prompt` is set.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// The prompt text for `messages` cut right after the final message's content, so that
    /// the model continues that message (transformers' `continue_final_message`, which vLLM
    /// and OpenAI-style "prefill" use): the conversation is rendered whole, the final turn
    /// closed as the template closes it, and everything after the content's last occurrence
    /// is dropped. Where the template trimmed the content's trailing whitespace, the trimmed
    /// content is what the model continues.
    pub fn render_continuing(
        &self,
        messages: &[ChatMessage],
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let content = messages
            .last()
            .map(|m| m.content.as_str())
            .filter(|c| !c.trim().is_empty())
            .ok_or_else(|| ModelError::ChatTemplate("the final message has no text to continue".into()))?;
        let rendered = self.render_with(messages, false, extra)?;
        let trimmed = content.trim();
        let at = rendered.rfind(trimmed).ok_or_else(|| {
            ModelError::ChatTemplate(
                "the final message's text does not appear in the rendered chat, so it cannot be continued".into(),
            )
        })?;
        // transformers keeps the content's trailing whitespace only where the template kept
        // the whole content as given.
        let end = match rendered[at..].starts_with(content) {
            true => at + content.len(),
            false => at + trimmed.len(),
        };
        Ok(rendered[..end].to_string())
    }

    /// [`render`](Self::render) with `extra` variables beside the template's own (a name of
    /// [`RESERVED`](Self::RESERVED) there is refused).
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        if let Some(name) = Self::RESERVED.iter().find(|n| extra.contains_key(**n)) {
            return Err(ModelError::ChatTemplate(format!(
                "`{name}` is the template's own variable; it cannot be passed in"
            )));
        }
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template("chat", &self.source)
            .map_err(|e| ModelError::ChatTemplate(format!("the template does not parse: {e}")))?;
        let template = env
            .get_template("chat")
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
                ..minijinja::Value::from_serialize(extra)
            })
            .map_err(|e| ModelError::ChatTemplate(format!("rendering failed: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(source: &str) -> ChatTemplate {
        ChatTemplate {
            source: source.into(),
            bos_token: "<s>".into(),
            eos_token: "</s>".into(),
        }
    }

    #[test]
    fn renders_messages_and_generation_prompt() {
        let t = template("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content | trim }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}");
        let out = t.render(&[ChatMessage::new("user", " hi ")], true).unwrap();
        assert_eq!(out, "<s>[user]hi[assistant]");
    }

    /// A caller's variables reach the template (Qwen3.5's way of turning thinking off); the
    /// template's own cannot be replaced.
    #[test]
    fn extra_variables_reach_the_template() {
        let t = template("{% if add_generation_prompt %}<a>{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}");
        let m = [ChatMessage::new("user", "x")];
        let off: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(r#"{"enable_thinking": false}"#).unwrap();
        assert_eq!(t.render_with(&m, true, &off).unwrap(), "<a><think></think>");
        assert_eq!(t.render(&m, true).unwrap(), "<a>");
        let reserved: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(r#"{"add_generation_prompt": false}"#).unwrap();
        let err = t.render_with(&m, true, &reserved).unwrap_err().to_string();
        assert!(err.contains("`add_generation_prompt`"), "{err}");
    }

    #[test]
    fn python_string_methods_and_raise_exception_work() {
        let t = template("{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}{{ messages[0].content.strip() }}");
        assert_eq!(t.render(&[ChatMessage::new("user", " x ")], false).unwrap(), "x");
        let err = t
            .render(&[ChatMessage::new("system", "x")], false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no system role"), "{err}");
    }

    /// Block tags on lines of their own leave no whitespace behind, as in transformers' jinja2
    /// environment; `continue` and `break` work. The expected text is jinja2's (transformers
    /// 5.24's `_compile_jinja_template`) on the same template and messages.
    #[test]
    fn blocks_are_trimmed_as_transformers_trims_them() {
        let t = template(concat!(
            "{% for m in messages %}\n",
            "  {% if m.role == 'system' %}\n",
            "    {% continue %}\n",
            "  {% endif %}\n",
            "<{{ m.role }}>{{ m.content }}\n",
            "  {% if loop.index > 3 %}{% break %}{% endif %}\n",
            "{% endfor %}\n",
            "{% if add_generation_prompt %}\n",
            "<assistant>\n",
            "{% endif %}\n",
        ));
        let messages = [
            ("system", "s"),
            ("user", "a"),
            ("assistant", "b"),
            ("user", "c"),
            ("user", "d"),
        ]
        .map(|(role, content)| ChatMessage::new(role, content));
        let out = t.render(&messages, true).unwrap();
        assert_eq!(out, "<user>a\n<assistant>b\n<user>c\n<assistant>\n");
    }

    /// The cut is transformers' (4.57.1's `render_jinja_template` with
    /// `continue_final_message=True` gave these four texts from these templates): after the
    /// final content, its trailing whitespace kept only where the template wrote it untouched.
    /// bbc refuses a final message without text (transformers keeps the whole rendering).
    #[test]
    fn a_final_message_is_continued_where_its_text_ends() {
        let kept = template("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}");
        let trimmed =
            template("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}");
        let chat = |last: &str| [ChatMessage::new("user", "hi"), ChatMessage::new("assistant", last)];
        let none = serde_json::Map::new();
        assert_eq!(
            kept.render_continuing(&chat("Sure"), &none).unwrap(),
            "<user>hi</user><assistant>Sure"
        );
        assert_eq!(
            kept.render_continuing(&chat("Sure, "), &none).unwrap(),
            "<user>hi</user><assistant>Sure, "
        );
        assert_eq!(
            trimmed.render_continuing(&chat(" Sure, "), &none).unwrap(),
            "<user>hi</user><assistant>Sure,"
        );
        // Text the conversation repeats earlier: the last occurrence is the final message's.
        let echo = [ChatMessage::new("user", "hi"), ChatMessage::new("assistant", "hi")];
        assert_eq!(
            kept.render_continuing(&echo, &none).unwrap(),
            "<user>hi</user><assistant>hi"
        );
        for last in ["", "  "] {
            let err = kept.render_continuing(&chat(last), &none).unwrap_err().to_string();
            assert!(err.contains("no text to continue"), "{err}");
        }
        let dropping =
            template("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}");
        let err = dropping
            .render_continuing(&chat("Sure"), &none)
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not appear"), "{err}");
    }

    #[test]
    fn a_broken_template_is_an_error() {
        let err = template("{% for %}").render(&[], true).unwrap_err().to_string();
        assert!(err.contains("does not parse"), "{err}");
    }
}
