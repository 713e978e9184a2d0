//! The sampling settings a model's makers recommend, read where a model carries them: an HF
//! directory's `generation_config.json` (what vLLM's `--generation-config auto` reads) or a
//! GGUF file's `general.sampling.*` keys (what llama.cpp's converter writes from that file and
//! its server reads). Servers apply them to requests that leave those settings unset.

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::tokenizer::read_json_if_present;
use serde_json::{Map, Value};
use std::path::Path;

/// Sampling settings a request falls back to; `None` leaves the server's own default.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// 0 or -1 keep every token.
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    /// The most tokens an answer may have (transformers' `max_new_tokens`).
    pub max_tokens: Option<usize>,
}

/// The settings a JSON generation config may hold, by their transformers names, with the
/// value transformers assumes where a file leaves one out: vLLM reads a config as
/// `to_diff_dict()` gives it, without the values equal to those, so they default nothing
/// (transformers 4.57.1 drops `top_k` 50, `top_p` and `repetition_penalty` 1 and keeps a
/// `min_p` of 0, which it has no default for).
const JSON_KEYS: [(&str, Option<f64>); 6] = [
    ("temperature", Some(1.0)),
    ("top_p", Some(1.0)),
    ("top_k", Some(50.0)),
    ("min_p", None),
    ("repetition_penalty", Some(1.0)),
    ("max_new_tokens", None),
];

impl GenerationDefaults {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The settings' names, as a generation config (and vLLM's override of one) gives them.
    pub fn names() -> impl Iterator<Item = &'static str> {
        JSON_KEYS.iter().map(|(name, _)| *name)
    }

    /// An HF directory's `generation_config.json`; none where the file is not there.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("generation_config.json");
        let Some(value) = read_json_if_present(&path)? else {
            return Ok(Self::default());
        };
        let problem = |what: String| ModelError::Config {
            path: path.clone(),
            what,
        };
        let object = value
            .as_object()
            .ok_or_else(|| problem("a generation config must be a JSON object".into()))?;
        let without_transformers_defaults: Map<String, Value> = object
            .iter()
            .filter(|(key, value)| {
                let assumed = JSON_KEYS.iter().find(|(k, _)| k == key).and_then(|(_, v)| *v);
                assumed.is_none_or(|assumed| value.as_f64() != Some(assumed))
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Self::from_json(&without_transformers_defaults).map_err(problem)
    }

    /// Settings by their transformers names (`temperature`, `top_p`, `top_k`, `min_p`,
    /// `repetition_penalty`, `max_new_tokens`), as a generation config or vLLM's
    /// `--override-generation-config` gives them; other keys are not sampling settings and
    /// are passed over, and a null is no setting.
    pub fn from_json(object: &Map<String, Value>) -> std::result::Result<Self, String> {
        let number = |key: &str| -> std::result::Result<Option<f64>, String> {
            match object.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| format!("`{key}` must be a number, got {v}")),
            }
        };
        let integer = |key: &str| -> std::result::Result<Option<i64>, String> {
            match number(key)? {
                Some(v) if v.fract() != 0.0 => Err(format!("`{key}` must be an integer, got {v}")),
                v => Ok(v.map(|v| v as i64)),
            }
        };
        let max_tokens = match integer("max_new_tokens")? {
            Some(n) if n < 1 => return Err(format!("`max_new_tokens` must be at least 1, got {n}")),
            n => n.map(|n| n as usize),
        };
        let defaults = Self {
            temperature: number("temperature")?,
            top_p: number("top_p")?,
            top_k: integer("top_k")?,
            min_p: number("min_p")?,
            repetition_penalty: number("repetition_penalty")?,
            max_tokens,
        };
        defaults.check()?;
        Ok(defaults)
    }

    /// A GGUF file's `general.sampling.*` keys (`temp`, `top_k`, `top_p`, `min_p`,
    /// `penalty_repeat`).
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let number = |name: &str| file.optional_f64(&format!("general.sampling.{name}"));
        let defaults = Self {
            temperature: number("temp")?,
            top_p: number("top_p")?,
            top_k: number("top_k")?.map(|k| k as i64),
            min_p: number("min_p")?,
            repetition_penalty: number("penalty_repeat")?,
            max_tokens: None,
        };
        defaults.check().map_err(|problem| ModelError::Metadata {
            path: file.path.clone(),
            key: "general.sampling".into(),
            problem,
        })?;
        Ok(defaults)
    }

    /// These settings, each replaced where `other` has one (vLLM's override of a model's
    /// config).
    pub fn overridden_by(self, other: Self) -> Self {
        Self {
            temperature: other.temperature.or(self.temperature),
            top_p: other.top_p.or(self.top_p),
            top_k: other.top_k.or(self.top_k),
            min_p: other.min_p.or(self.min_p),
            repetition_penalty: other.repetition_penalty.or(self.repetition_penalty),
            max_tokens: other.max_tokens.or(self.max_tokens),
        }
    }

    /// The ranges a request's own settings must keep to ([`out_of_range`]).
    fn check(&self) -> std::result::Result<(), String> {
        let settings = [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("top_k", self.top_k.map(|k| k as f64)),
            ("min_p", self.min_p),
            ("repetition_penalty", self.repetition_penalty),
        ];
        match settings
            .into_iter()
            .find_map(|(name, value)| out_of_range(name, value?))
        {
            Some(problem) => Err(problem),
            None => Ok(()),
        }
    }
}

/// Where sampling setting `name` (`temperature`, `top_p`, `top_k`, `min_p`,
/// `repetition_penalty`) must lie, for a request's own value and a model's recommended one
/// alike: the problem with `value`, naming the setting, or none.
pub fn out_of_range(name: &str, value: f64) -> Option<String> {
    let (within, range) = match name {
        "temperature" => ((0.0..=100.0).contains(&value), "in [0, 100]"),
        "top_p" => (value > 0.0 && value <= 1.0, "in (0, 1]"),
        "top_k" => (value >= -1.0, "-1, 0 (off) or above"),
        "min_p" => ((0.0..=1.0).contains(&value), "in [0, 1]"),
        "repetition_penalty" => (value > 0.0 && value <= 100.0, "in (0, 100]"),
        _ => return None,
    };
    (!within).then(|| format!("`{name}` must be {range}, got {value}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(value: Value) -> Map<String, Value> {
        value.as_object().unwrap().clone()
    }

    /// Configs with the sampling keys Gemma 3 and Qwen3 publish (written from memory, not
    /// copied from their files), and one that repeats transformers' own values, which vLLM
    /// does not take as settings.
    #[test]
    fn hf_generation_configs_give_their_sampling_settings() {
        let dir = std::env::temp_dir().join(format!("bbc-generation-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let read = |config: Value| {
            std::fs::write(dir.join("generation_config.json"), config.to_string()).unwrap();
            GenerationDefaults::from_hf_dir(&dir)
        };
        let gemma = read(json!({"cache_implementation": "hybrid", "do_sample": true, "top_k": 64, "top_p": 0.95, "eos_token_id": [1, 106]})).unwrap();
        assert_eq!(
            gemma,
            GenerationDefaults {
                top_k: Some(64),
                top_p: Some(0.95),
                ..Default::default()
            }
        );
        let qwen =
            read(json!({"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 32768}))
                .unwrap();
        assert_eq!(
            (qwen.temperature, qwen.top_k, qwen.max_tokens),
            (Some(0.6), Some(20), Some(32768))
        );
        let assumed = read(json!({"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0})).unwrap();
        assert!(assumed.is_empty(), "{assumed:?}");
        for broken in [
            json!({"top_p": 0}),
            json!({"temperature": "hot"}),
            json!({"top_k": 2.5}),
            json!([1]),
        ] {
            let err = read(broken.clone()).unwrap_err().to_string();
            assert!(err.contains("generation_config.json"), "{broken}: {err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(GenerationDefaults::from_hf_dir(&dir).unwrap().is_empty());
    }

    /// llama.cpp's converter writes a config's settings as `general.sampling.*` (f32, top_k
    /// i32); a file without them defaults nothing.
    #[test]
    fn gguf_sampling_keys_give_their_settings() {
        use crate::gguf::{writer::GgufWriter, MetaValue};
        let path = std::env::temp_dir().join(format!("bbc-sampling-{}.gguf", std::process::id()));
        let read = |writer: GgufWriter| {
            std::fs::write(&path, writer.to_bytes()).unwrap();
            GenerationDefaults::from_gguf(&GgufFile::open(&path).unwrap())
        };
        let written = GgufWriter::new()
            .meta("general.sampling.temp", MetaValue::F32(0.6))
            .meta("general.sampling.top_k", MetaValue::I32(20))
            .meta("general.sampling.top_p", MetaValue::F32(0.95))
            .meta("general.sampling.penalty_repeat", MetaValue::F32(1.05));
        let got = read(written).unwrap();
        assert_eq!(got.temperature, Some(0.6f32 as f64));
        assert_eq!((got.top_k, got.min_p), (Some(20), None));
        assert_eq!(got.repetition_penalty, Some(1.05f32 as f64));
        assert!(read(GgufWriter::new()).unwrap().is_empty());
        let wrong = GgufWriter::new().meta("general.sampling.top_p", MetaValue::String("high".into()));
        assert!(read(wrong).unwrap_err().to_string().contains("general.sampling.top_p"));
        let outside = GgufWriter::new().meta("general.sampling.top_p", MetaValue::F32(1.5));
        assert!(read(outside).unwrap_err().to_string().contains("top_p"));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn overrides_replace_what_they_name() {
        let model = GenerationDefaults::from_json(&object(json!({"temperature": 0.6, "top_k": 20}))).unwrap();
        let given = GenerationDefaults::from_json(&object(json!({"temperature": 0.2, "min_p": 0.05}))).unwrap();
        let merged = model.overridden_by(given);
        assert_eq!(
            (merged.temperature, merged.top_k, merged.min_p),
            (Some(0.2), Some(20), Some(0.05))
        );
        let err = GenerationDefaults::from_json(&object(json!({"max_new_tokens": 0}))).unwrap_err();
        assert!(err.contains("max_new_tokens"), "{err}");
    }
}
