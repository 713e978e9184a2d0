//! How `bbc serve` drafts: its flags (vLLM's separate ones, or its `--speculative-config`
//! JSON in their place), then a model.toml's `[speculative]` section.

use super::ServeArgs;
use crate::model_ref::Loaded;
use anyhow::{bail, Context, Result};
use models::eagle::EagleMethod;
use models::model_toml::{DEFAULT_LOOKUP_MAX, DEFAULT_LOOKUP_MIN};
use models::Speculative;
use runtime::serving::NgramConfig;
use serde_json::Value;

/// Tokens a draft model drafts a step unless the flags or the model.toml say.
const DEFAULT_DRAFT_TOKENS: usize = 4;

/// What `--speculative-config` may say.
const CONFIG_KEYS: [&str; 7] = [
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "draft_tensor_parallel_size",
];

/// The drafting flags as given (`--speculative-config` unpacked into them), checked to make
/// sense together before any model is loaded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpeculationFlags {
    /// Prompt lookup's drafted tokens a step (`--speculative-ngram`).
    ngram: Option<usize>,
    lookup_min: Option<usize>,
    lookup_max: Option<usize>,
    /// The draft model (`--speculative-model`) and its tokens a step.
    model: Option<String>,
    tokens: Option<usize>,
    /// The model's own multi-token prediction layers draft (`--speculative-config` method
    /// `mtp`), `tokens` a step.
    mtp: bool,
    /// An EAGLE head (`--speculative-config` method `eagle` or `eagle3`, its `model` a
    /// directory) drafts, `tokens` a step.
    eagle: Option<(EagleMethod, String)>,
    /// Drafting pauses while more sequences than this run (`disable_by_batch_size`).
    disable_by_batch_size: Option<usize>,
}

/// Where drafts come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Drafting {
    /// Prompt lookup, or nowhere (its config's `tokens` 0).
    PromptLookup,
    /// A draft model: what names it.
    Model(String),
    /// The served model's multi-token prediction layers.
    Mtp,
    /// An EAGLE head: its method and directory.
    Eagle(EagleMethod, String),
}

impl SpeculationFlags {
    /// Draft only while at most this many sequences run (`disable_by_batch_size`).
    pub fn speculate_up_to(&self) -> Option<usize> {
        self.disable_by_batch_size
    }

    pub fn from_args(args: &ServeArgs) -> Result<Self> {
        let given = Self {
            ngram: args.speculative_ngram,
            lookup_min: args.prompt_lookup_min,
            lookup_max: args.prompt_lookup_max,
            model: args.speculative_model.clone(),
            tokens: args.num_speculative_tokens,
            mtp: false,
            eagle: None,
            disable_by_batch_size: None,
        };
        let flags = match &args.speculative_config {
            None => given,
            Some(_) if given != Self::default() => bail!(
                "--speculative-config says all of it: give it without --speculative-model, --speculative-ngram, --num-speculative-tokens or --prompt-lookup-min/max"
            ),
            Some(json) => from_config(json).context("--speculative-config")?,
        };
        if flags.model.is_some() && flags.ngram.is_some() {
            bail!("--speculative-model and --speculative-ngram are two ways to draft: choose one");
        }
        if flags.tokens == Some(0) {
            bail!("--num-speculative-tokens must be at least 1");
        }
        Ok(flags)
    }

    /// The drafting config, and where drafts come from (prompt lookup's match lengths are
    /// unused by the others): the flags first, then `loaded`'s model.toml. The multi-token
    /// prediction layers draft as many tokens a step as the model has of them unless told.
    pub fn resolve(&self, loaded: &Loaded) -> Result<(NgramConfig, Drafting)> {
        // What the model.toml asks for, by method.
        let (toml_ngram, toml_draft, toml_mtp) = match &loaded.speculative {
            Some(Speculative::Ngram(spec)) => (Some(*spec), None, None),
            Some(Speculative::DraftModel(spec)) => (None, Some(spec), None),
            Some(Speculative::Mtp { tokens }) => (None, None, Some(*tokens)),
            Some(Speculative::Eagle { .. }) | None => (None, None, None),
        };
        let other_flags = self.model.is_some() || self.ngram.is_some() || self.mtp;
        let eagle = match (&self.eagle, &loaded.speculative) {
            (Some((method, model)), _) => Some((*method, model.clone(), self.tokens)),
            (None, Some(Speculative::Eagle { method, dir, tokens })) if !other_flags => Some((
                *method,
                dir.to_string_lossy().into_owned(),
                Some(self.tokens.unwrap_or(*tokens)),
            )),
            _ => None,
        };
        if let Some((method, model, tokens)) = eagle {
            let config = NgramConfig {
                tokens: tokens.context("EAGLE heads need `num_speculative_tokens`")?,
                min: DEFAULT_LOOKUP_MIN,
                max: DEFAULT_LOOKUP_MAX,
            };
            return Ok((config, Drafting::Eagle(method, model)));
        }
        let other_flags = self.model.is_some() || self.ngram.is_some();
        let mtp = match (self.mtp, toml_mtp) {
            (true, toml) => Some(self.tokens.or(toml)),
            (false, Some(toml)) if !other_flags => Some(Some(self.tokens.unwrap_or(toml))),
            _ => None,
        };
        if let Some(tokens) = mtp {
            let layers = loaded.model.config.mtp_layers;
            if layers == 0 {
                bail!(
                    "method `mtp` drafts with the model's multi-token prediction layers, and this {} checkpoint has none",
                    loaded.model.config.family.name()
                );
            }
            let config = NgramConfig {
                tokens: tokens.unwrap_or(layers),
                min: DEFAULT_LOOKUP_MIN,
                max: DEFAULT_LOOKUP_MAX,
            };
            return Ok((config, Drafting::Mtp));
        }
        let draft = match (&self.model, toml_draft) {
            (Some(model), toml) => Some((model.clone(), toml.as_ref().map(|t| t.tokens))),
            // A prompt-lookup flag overrides the file's draft model.
            (None, Some(toml)) if self.ngram.is_none() => Some((toml.model.clone(), Some(toml.tokens))),
            _ => None,
        };
        if let Some((model, toml_tokens)) = draft {
            let config = NgramConfig {
                tokens: self.tokens.or(toml_tokens).unwrap_or(DEFAULT_DRAFT_TOKENS),
                min: DEFAULT_LOOKUP_MIN,
                max: DEFAULT_LOOKUP_MAX,
            };
            return Ok((config, Drafting::Model(model)));
        }
        if self.tokens.is_some() {
            bail!("--num-speculative-tokens is the draft model's, and there is none: give --speculative-model (or --speculative-ngram N for prompt lookup)");
        }
        let toml = toml_ngram;
        let tokens = self.ngram.or(toml.map(|t| t.tokens)).unwrap_or(0);
        let min = self.lookup_min.or(toml.map(|t| t.min)).unwrap_or(DEFAULT_LOOKUP_MIN);
        let max = self.lookup_max.or(toml.map(|t| t.max)).unwrap_or(DEFAULT_LOOKUP_MAX);
        let spec =
            models::NgramSpec::new(tokens, min, max).map_err(|e| anyhow::anyhow!("--prompt-lookup-min/max: {e}"))?;
        let config = NgramConfig {
            tokens: spec.tokens,
            min: spec.min,
            max: spec.max,
        };
        Ok((config, Drafting::PromptLookup))
    }
}

/// The EAGLE head `--speculative-config` names (method `eagle` or `eagle3`), as `bbc compile`
/// reads it: the other methods need nothing compiled.
pub(crate) fn eagle_head(json: &str) -> Result<(EagleMethod, String)> {
    match from_config(json).context("--speculative-config")?.eagle {
        Some(head) => Ok(head),
        None => bail!(
            "--speculative-config: `bbc compile` compiles EAGLE heads (method `eagle` or `eagle3`); \
             prompt lookup and draft models need nothing compiled, and a checkpoint's MTP layers are compiled with it"
        ),
    }
}

/// vLLM's `--speculative-config` JSON as the flags it stands for: method `ngram` (with
/// `num_speculative_tokens` and the lookup lengths), `draft_model` (with `model`, implied
/// where the method is not given), `mtp` (with `num_speculative_tokens`), or `eagle` and
/// `eagle3` (with the head's `model` directory and `num_speculative_tokens`), any of them with
/// `disable_by_batch_size`; other methods and keys refused by name.
fn from_config(json: &str) -> Result<SpeculationFlags> {
    let value: Value = serde_json::from_str(json).context("not JSON")?;
    let config = value
        .as_object()
        .context(r#"a JSON object, e.g. {"model": "draft.gguf", "num_speculative_tokens": 4}"#)?;
    if let Some(key) = config.keys().find(|k| !CONFIG_KEYS.contains(&k.as_str())) {
        bail!("`{key}` is not a key bbc reads ({})", CONFIG_KEYS.join(", "));
    }
    let count = |key: &str| -> Result<Option<usize>> {
        match config.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .with_context(|| format!("`{key}` must be a whole number, not {v}")),
        }
    };
    let text = |key: &str| -> Result<Option<&str>> {
        match config.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .with_context(|| format!("`{key}` must be a string, not {v}")),
        }
    };
    let model = text("model")?;
    let method = match (text("method")?, model) {
        (Some(method), _) => method,
        (None, Some(_)) => "draft_model",
        (None, None) => bail!("give `method` (ngram) or a draft `model`"),
    };
    let lookup = (count("prompt_lookup_min")?, count("prompt_lookup_max")?);
    let disable_by_batch_size = count("disable_by_batch_size")?;
    // Read for vLLM command lines, as `--tensor-parallel-size`: bbc drafts on one GPU.
    if let Some(size) = count("draft_tensor_parallel_size")?.filter(|&n| n != 1) {
        bail!("`draft_tensor_parallel_size` {size}: bbc drafts on one GPU");
    }
    if disable_by_batch_size == Some(0) {
        bail!("`disable_by_batch_size` must be at least 1 (a batch of one sequence still drafts)");
    }
    let flags: Result<SpeculationFlags> = match method {
        "ngram" if model.is_some() => bail!("method `ngram` drafts from the request's own text: it takes no `model`"),
        "ngram" => Ok(SpeculationFlags {
            ngram: Some(count("num_speculative_tokens")?.context("method `ngram` needs `num_speculative_tokens`")?),
            lookup_min: lookup.0,
            lookup_max: lookup.1,
            ..SpeculationFlags::default()
        }),
        "draft_model" if lookup != (None, None) => {
            bail!("`prompt_lookup_min`/`prompt_lookup_max` are method `ngram`'s, not `draft_model`'s")
        }
        "draft_model" => Ok(SpeculationFlags {
            model: Some(model.context("method `draft_model` needs `model`")?.to_string()),
            tokens: count("num_speculative_tokens")?,
            ..SpeculationFlags::default()
        }),
        "mtp" if model.is_some() || lookup != (None, None) => {
            bail!("method `mtp` drafts with the model's own layers: it takes no `model` or `prompt_lookup_min`/`prompt_lookup_max`")
        }
        "mtp" => Ok(SpeculationFlags {
            mtp: true,
            tokens: count("num_speculative_tokens")?,
            ..SpeculationFlags::default()
        }),
        name @ ("eagle" | "eagle3") => {
            let method = EagleMethod::parse(name).expect("an EAGLE method");
            if lookup != (None, None) {
                bail!("`prompt_lookup_min`/`prompt_lookup_max` are method `ngram`'s, not `{name}`'s");
            }
            let model = model.with_context(|| format!("method `{name}` needs the head's directory as `model`"))?;
            Ok(SpeculationFlags {
                eagle: Some((method, model.to_string())),
                tokens: Some(
                    count("num_speculative_tokens")?
                        .with_context(|| format!("method `{name}` needs `num_speculative_tokens`"))?,
                ),
                ..SpeculationFlags::default()
            })
        }
        other => bail!("method `{other}` is not one bbc serves (ngram, draft_model, mtp, eagle, eagle3)"),
    };
    Ok(SpeculationFlags {
        disable_by_batch_size,
        ..flags?
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn flags(args: &[&str]) -> Result<SpeculationFlags> {
        let cli = Cli::try_parse_from(["bbc", "smollm2"].iter().chain(args)).unwrap();
        SpeculationFlags::from_args(&cli.serve)
    }

    fn refused(args: &[&str]) -> String {
        format!("{:#}", flags(args).unwrap_err())
    }

    #[test]
    fn the_speculative_config_stands_for_the_flags() {
        let draft = SpeculationFlags {
            model: Some("d.gguf".into()),
            tokens: Some(3),
            ..Default::default()
        };
        assert_eq!(
            flags(&[
                "--speculative-config",
                r#"{"model": "d.gguf", "num_speculative_tokens": 3}"#
            ])
            .unwrap(),
            draft
        );
        assert_eq!(
            flags(&["--speculative-model", "d.gguf", "--num-speculative-tokens", "3"]).unwrap(),
            draft
        );
        let config =
            r#"{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": null}"#;
        assert_eq!(
            flags(&["--speculative-config", config]).unwrap(),
            SpeculationFlags {
                ngram: Some(5),
                lookup_max: Some(3),
                ..Default::default()
            }
        );
        let config = r#"{"method": "draft_model", "model": "d"}"#;
        assert_eq!(
            flags(&["--speculative-config", config]).unwrap().model.as_deref(),
            Some("d")
        );
        assert_eq!(flags(&[]).unwrap(), SpeculationFlags::default());
        let config = r#"{"method": "mtp", "num_speculative_tokens": 3}"#;
        assert_eq!(
            flags(&["--speculative-config", config]).unwrap(),
            SpeculationFlags {
                mtp: true,
                tokens: Some(3),
                ..Default::default()
            }
        );
        let config = r#"{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 8}"#;
        let limited = flags(&["--speculative-config", config]).unwrap();
        // vLLM's command lines name the draft's tensor parallelism; one GPU is what bbc runs.
        let config = r#"{"model": "d.gguf", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}"#;
        assert_eq!(flags(&["--speculative-config", config]).unwrap(), draft);
        assert_eq!((limited.ngram, limited.speculate_up_to()), (Some(2), Some(8)));
        for (method, name) in [(EagleMethod::Eagle, "eagle"), (EagleMethod::Eagle3, "eagle3")] {
            let config = format!(r#"{{"method": "{name}", "model": "heads/e", "num_speculative_tokens": 2}}"#);
            assert_eq!(
                flags(&["--speculative-config", &config]).unwrap(),
                SpeculationFlags {
                    eagle: Some((method, "heads/e".into())),
                    tokens: Some(2),
                    ..Default::default()
                }
            );
        }
    }

    #[test]
    fn what_cannot_be_served_is_refused_by_name() {
        for (args, needle) in [
            (vec!["--speculative-config", "{"], "not JSON"),
            (vec!["--speculative-config", "[4]"], "a JSON object"),
            (
                vec![
                    "--speculative-config",
                    r#"{"model": "d", "draft_tensor_parallel_size": 2}"#,
                ],
                "`draft_tensor_parallel_size` 2: bbc drafts on one GPU",
            ),
            (
                vec!["--speculative-config", r#"{"model": "d", "draft_model_max_len": 4096}"#],
                "`draft_model_max_len` is not a key bbc reads",
            ),
            (
                vec!["--speculative-config", r#"{"method": "eagle", "model": "e"}"#],
                "method `eagle` needs `num_speculative_tokens`",
            ),
            (
                vec![
                    "--speculative-config",
                    r#"{"method": "eagle3", "num_speculative_tokens": 3}"#,
                ],
                "method `eagle3` needs the head's directory as `model`",
            ),
            (
                vec![
                    "--speculative-config",
                    r#"{"method": "eagle3", "model": "e", "num_speculative_tokens": 3, "prompt_lookup_min": 2}"#,
                ],
                "method `ngram`'s, not `eagle3`'s",
            ),
            (
                vec!["--speculative-config", r#"{"method": "medusa", "model": "m"}"#],
                "method `medusa` is not one bbc serves",
            ),
            (
                vec![
                    "--speculative-config",
                    r#"{"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 0}"#,
                ],
                "`disable_by_batch_size` must be at least 1",
            ),
            (
                vec!["--speculative-config", r#"{"method": "ngram"}"#],
                "needs `num_speculative_tokens`",
            ),
            (
                vec![
                    "--speculative-config",
                    r#"{"method": "ngram", "num_speculative_tokens": 2, "model": "d"}"#,
                ],
                "takes no `model`",
            ),
            (
                vec!["--speculative-config", r#"{"method": "draft_model"}"#],
                "needs `model`",
            ),
            (
                vec!["--speculative-config", r#"{"model": "d", "prompt_lookup_max": 3}"#],
                "method `ngram`'s",
            ),
            (
                vec!["--speculative-config", r#"{"model": 4}"#],
                "`model` must be a string",
            ),
            (
                vec![
                    "--speculative-config",
                    r#"{"model": "d", "num_speculative_tokens": -1}"#,
                ],
                "whole number",
            ),
            (
                vec!["--speculative-config", r#"{"model": "d", "num_speculative_tokens": 0}"#],
                "at least 1",
            ),
            (vec!["--speculative-config", "{}"], "give `method`"),
            (
                vec!["--speculative-config", r#"{"method": "mtp", "model": "d"}"#],
                "takes no `model`",
            ),
            (
                vec![
                    "--speculative-config",
                    r#"{"method": "mtp", "num_speculative_tokens": 0}"#,
                ],
                "at least 1",
            ),
            (
                vec!["--speculative-config", r#"{"model": "d"}"#, "--speculative-ngram", "2"],
                "says all of it",
            ),
            (
                vec!["--speculative-model", "d", "--speculative-ngram", "2"],
                "choose one",
            ),
        ] {
            let message = refused(&args);
            assert!(message.contains(needle), "{args:?}: {message}");
        }
    }
}
