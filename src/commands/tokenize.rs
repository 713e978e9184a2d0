//! `bbc tokenize MODEL --text TEXT`: the ids, as JSON.

use crate::model_ref;
use anyhow::{Context, Result};
use models::LogitsFor;

pub fn tokenize(model: &str, text: &str, add_special: bool) -> Result<()> {
    let options = model_ref::LoadOptions {
        dtype: None,
        logits: LogitsFor::LastToken,
        greedy: false,
        fuse: false,
        quiet: true,
    };
    let loaded = model_ref::load(model, options)?;
    let tokenizer = loaded.model.tokenizer.as_ref().context("this model has no tokenizer")?;
    let ids = tokenizer.encode(text, add_special)?;
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}
