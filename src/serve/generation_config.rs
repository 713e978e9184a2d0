//! vLLM's `--generation-config` and `--override-generation-config`: the sampling settings a
//! request that leaves them out gets. By default (`auto`) the model's recommended ones (an HF
//! directory's `generation_config.json`, a GGUF file's `general.sampling.*`), as vLLM and
//! llama.cpp's server take them; `vllm` leaves the API's own defaults; a directory names
//! another `generation_config.json`.

use anyhow::{bail, Context, Result};
use models::GenerationDefaults;
use std::path::Path;

/// The settings requests fall back to, from the flags and the model's own (`model`).
pub fn resolve(source: &str, overrides: Option<&str>, model: GenerationDefaults) -> Result<GenerationDefaults> {
    let base = match source {
        "auto" => model,
        "vllm" => GenerationDefaults::default(),
        dir => {
            let dir = Path::new(dir);
            if !dir.join("generation_config.json").is_file() {
                bail!(
                    "--generation-config: {} holds no generation_config.json (give auto, vllm or such a directory)",
                    dir.display()
                );
            }
            GenerationDefaults::from_hf_dir(dir)?
        }
    };
    let Some(text) = overrides else { return Ok(base) };
    let value: serde_json::Value =
        serde_json::from_str(text).context("--override-generation-config must be a JSON object")?;
    let object = value
        .as_object()
        .context("--override-generation-config must be a JSON object")?;
    if let Some(key) = object
        .keys()
        .find(|k| !GenerationDefaults::names().any(|name| name == k.as_str()))
    {
        let known: Vec<&str> = GenerationDefaults::names().collect();
        bail!(
            "--override-generation-config: `{key}` is not a setting bbc applies ({})",
            known.join(", ")
        );
    }
    let given =
        GenerationDefaults::from_json(object).map_err(|e| anyhow::anyhow!("--override-generation-config: {e}"))?;
    Ok(base.overridden_by(given))
}

/// The settings in a line, for the server's start-up report; none where there are none.
pub fn describe(defaults: &GenerationDefaults) -> Option<String> {
    let mut parts = Vec::new();
    let mut add = |name: &str, value: Option<String>| {
        if let Some(v) = value {
            parts.push(format!("{name} {v}"));
        }
    };
    add("temperature", defaults.temperature.map(|v| v.to_string()));
    add("top_p", defaults.top_p.map(|v| v.to_string()));
    add("top_k", defaults.top_k.map(|v| v.to_string()));
    add("min_p", defaults.min_p.map(|v| v.to_string()));
    add("repetition_penalty", defaults.repetition_penalty.map(|v| v.to_string()));
    add("max_tokens at most", defaults.max_tokens.map(|v| v.to_string()));
    (!parts.is_empty()).then(|| parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> GenerationDefaults {
        GenerationDefaults {
            temperature: Some(0.6),
            top_k: Some(20),
            ..Default::default()
        }
    }

    #[test]
    fn auto_takes_the_models_and_vllm_the_apis_own() {
        assert_eq!(resolve("auto", None, model()).unwrap(), model());
        assert!(resolve("vllm", None, model()).unwrap().is_empty());
        let overridden = resolve("auto", Some(r#"{"temperature": 0.2, "max_new_tokens": 64}"#), model()).unwrap();
        assert_eq!(
            (overridden.temperature, overridden.top_k, overridden.max_tokens),
            (Some(0.2), Some(20), Some(64))
        );
        assert_eq!(
            describe(&overridden).as_deref(),
            Some("temperature 0.2, top_k 20, max_tokens at most 64")
        );
        assert_eq!(describe(&GenerationDefaults::default()), None);
    }

    #[test]
    fn bad_flags_are_refused_by_name() {
        for (source, overrides, expect) in [
            ("/nonexistent", None, "generation_config.json"),
            ("auto", Some("[1]"), "JSON object"),
            ("auto", Some("{"), "JSON object"),
            ("auto", Some(r#"{"do_sample": true}"#), "do_sample"),
            ("auto", Some(r#"{"top_p": 2}"#), "top_p"),
        ] {
            let err = format!("{:#}", resolve(source, overrides, model()).unwrap_err());
            assert!(err.contains(expect), "{source} {overrides:?}: {err}");
        }
    }
}
