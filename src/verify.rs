//! Translation validation for `bbc compile --verify`: every pass's output graph is run against
//! its input graph in the IR reference interpreter, on the user's own weights, with random
//! tokens (a prefill of several tokens, then cached decode steps). A mismatch refuses the
//! artifact and names the pass and the rules that fired in it.

use crate::model_ref::Loaded;
use anyhow::{bail, Result};
use ir::reference::Interpreter;
use ir::Graph;
use models::weights::DequantizedWeights;
use passes::Stage;

/// Largest allowed difference, relative to the largest magnitude of the output. Fusions
/// regroup f32 roundings at most; the interpreter accumulates in f64.
const TOLERANCE: f32 = 1e-3;
const PREFILL: usize = 5;
const DECODE_STEPS: usize = 2;

pub fn verify_stages(loaded: &Loaded, stages: &[Stage]) -> Result<()> {
    let weights = DequantizedWeights::new(&loaded.model.weights);
    let vocab = loaded.model.config.vocab_size as u64;
    // A fixed seed: the same model verifies the same way every time.
    let mut state = 0x5eed_u64;
    let tokens: Vec<u32> = (0..PREFILL + DECODE_STEPS)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % vocab) as u32
        })
        .collect();
    // Each pass's output is the next pass's input: run every graph once.
    let mut want = run(&loaded.graph, &weights, &tokens)?;
    for stage in stages {
        let got = run(&stage.graph, &weights, &tokens)?;
        if let Some(problem) = compare(&want, &got) {
            let rules: Vec<&str> = stage.report.applied.iter().map(|(r, _)| r.as_str()).collect();
            bail!(
                "verification failed after pass {} (rules fired: {}): {problem}; the artifact was not written",
                stage.report.pass,
                rules.join(", ")
            );
        }
        eprintln!("verified {} on {} random tokens", stage.report.pass, tokens.len());
        want = got;
    }
    Ok(())
}

/// Every output of every step, in order.
fn run(graph: &Graph, weights: &DequantizedWeights, tokens: &[u32]) -> Result<Vec<(String, Vec<f32>)>> {
    let mut interp = Interpreter::new(weights);
    let mut outputs = Vec::new();
    let mut step = |ids: &[u32], first: usize| -> Result<()> {
        let positions: Vec<usize> = (first..first + ids.len()).collect();
        let out = interp.step(graph, ids, &positions)?;
        let mut names: Vec<&String> = out.keys().collect();
        names.sort();
        for name in names {
            outputs.push((name.clone(), out[name].data.clone()));
        }
        Ok(())
    };
    step(&tokens[..PREFILL], 0)?;
    for (i, &t) in tokens[PREFILL..].iter().enumerate() {
        step(&[t], PREFILL + i)?;
    }
    Ok(outputs)
}

fn compare(want: &[(String, Vec<f32>)], got: &[(String, Vec<f32>)]) -> Option<String> {
    if want.len() != got.len() {
        return Some(format!("{} outputs became {}", want.len(), got.len()));
    }
    for ((name, w), (got_name, g)) in want.iter().zip(got) {
        if name != got_name || w.len() != g.len() {
            return Some(format!("output `{name}` changed shape or name"));
        }
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
        // A NaN difference is the worst (`f32::max` would pass it by), and fails.
        let worst = w
            .iter()
            .zip(g)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, |m, d| if d > m || d.is_nan() { d } else { m });
        if worst.is_nan() || worst > TOLERANCE * scale {
            return Some(format!("output `{name}` differs by {worst} (largest value {scale})"));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::compare;

    fn outputs(values: &[f32]) -> Vec<(String, Vec<f32>)> {
        vec![("logits".to_string(), values.to_vec())]
    }

    /// Within the tolerance passes; past it, or a NaN where the input graph had a value (which
    /// a maximum over differences by `f32::max` would skip), or a changed shape fails.
    #[test]
    fn a_pass_output_fails_on_a_difference_a_nan_or_a_shape() {
        let want = outputs(&[1.0, -2.0, 4.0]);
        assert_eq!(compare(&want, &outputs(&[1.001, -2.0, 4.0])), None);
        let far = compare(&want, &outputs(&[1.0, -2.0, 4.1])).expect("0.1 of 4 is past 1e-3");
        assert!(far.contains("differs by"), "{far}");
        for nan_at in 0..3 {
            let mut got = [1.0, -2.0, 4.0];
            got[nan_at] = f32::NAN;
            let nan = compare(&want, &outputs(&got)).expect("a NaN fails");
            assert!(nan.contains("NaN"), "{nan}");
        }
        assert!(compare(&want, &outputs(&[1.0, -2.0])).is_some());
    }
}
