//! The hf-tiny references (`tests/fixtures/hf-tiny/<name>-reference.safetensors`): HF
//! transformers' prompt, its logits at every prompt row, its greedy ids through the model's
//! cache and the logits before each.

use super::fixture;

pub struct Reference {
    pub input_ids: Vec<u32>,
    /// `[prompt rows, vocab]`.
    pub logits: Vec<f32>,
    pub greedy_ids: Vec<u32>,
    /// `[greedy steps, vocab]`: row 0 is the prompt's last row.
    pub step_logits: Vec<f32>,
    pub vocab: usize,
}

impl Reference {
    /// The reference of the hf-tiny model `name`.
    pub fn of(name: &str) -> Reference {
        Reference::from_fixture(&format!("hf-tiny/{name}-reference.safetensors"))
    }

    /// A reference in the hf-tiny references' layout, from fixture `rel`.
    pub fn from_fixture(rel: &str) -> Reference {
        let bytes = std::fs::read(fixture(rel)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let i64s = |name: &str| -> Vec<u32> {
            st.tensor(name)
                .unwrap()
                .data()
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
                .collect()
        };
        let f32s = |name: &str| -> Vec<f32> {
            st.tensor(name)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        let vocab = st.tensor("logits").unwrap().shape()[1];
        Reference {
            input_ids: i64s("input_ids"),
            logits: f32s("logits"),
            greedy_ids: i64s("greedy_ids"),
            step_logits: f32s("step_logits"),
            vocab,
        }
    }

    /// The logits before greedy step `step`.
    pub fn step(&self, step: usize) -> &[f32] {
        &self.step_logits[step * self.vocab..(step + 1) * self.vocab]
    }
}
