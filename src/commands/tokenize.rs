//! `bbc tokenize MODEL --text TEXT`: the ids, as JSON.

use crate::model_ref;
use anyhow::Result;

pub fn tokenize(model: &str, text: &str, add_special: bool) -> Result<()> {
    let ids = model_ref::tokenizer(model)?.encode(text, add_special)?;
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}
