//! Weights derived at compile time and stored in the artifact: the INT8 rows (and their error
//! norms) of every LM head the `int8_bound_lm_head` pass rewrote, one safetensors file each
//! under `weights/`, named by the weight and checked by sha256 when read.

use crate::artifact::ArtifactError;
use ir::{Graph, Op};
use models::WeightSource;
use quant::int8_rows::Int8Rows;
use safetensors::{tensor::TensorView, Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::Path;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DerivedWeight {
    /// The weight it was derived from.
    pub weight: String,
    /// Path inside the artifact.
    pub file: String,
    pub sha256: String,
}

fn invalid(path: &Path, what: String) -> ArtifactError {
    ArtifactError::Invalid {
        path: path.to_path_buf(),
        what,
    }
}

/// The INT8 rows of every head an `int8_bound_top_k` in `graph` reads, by weight name: of the
/// values the graph's head holds (the stored ones rounded to its bf16 or f16), so the bounds
/// hold for the logits the full head rescores.
pub fn int8_heads(graph: &Graph, weights: &WeightSource) -> Result<Vec<(String, Int8Rows)>, String> {
    let mut heads: Vec<(String, Int8Rows)> = Vec::new();
    for node in graph.nodes() {
        if !matches!(node.op, Op::Int8BoundTopK { .. }) {
            continue;
        }
        let head = graph.node(node.inputs[1]);
        let Op::Weight { name } = &head.op else {
            continue;
        };
        if heads.iter().any(|(n, _)| n == name) {
            continue;
        }
        let view = weights
            .get(name)
            .ok_or_else(|| format!("weight `{name}` is not in the model"))?;
        let (rows, cols) = (view.rows(), view.row_len());
        let row_bytes = view.row_bytes();
        let round: fn(f32) -> f32 = match head.dtype {
            ir::DType::BF16 => |v| half::bf16::from_f32(v).to_f32(),
            ir::DType::F16 => |v| half::f16::from_f32(v).to_f32(),
            _ => |v| v,
        };
        let quantized = Int8Rows::quantize(rows, cols, |r, buf| {
            view.dtype
                .dequantize(&view.bytes[r * row_bytes..(r + 1) * row_bytes], buf);
            buf.iter_mut().for_each(|v| *v = round(*v));
        });
        heads.push((name.clone(), quantized));
    }
    Ok(heads)
}

/// Quantize and write the INT8 rows of every head an `int8_bound_top_k` in `graph` reads.
pub fn write_int8_heads(
    graph: &Graph,
    weights: &WeightSource,
    dir: &Path,
) -> Result<Vec<DerivedWeight>, ArtifactError> {
    let mut written: Vec<DerivedWeight> = Vec::new();
    for (name, quantized) in int8_heads(graph, weights).map_err(|what| invalid(dir, what))? {
        let file = format!("weights/{}.int8.safetensors", name.replace(['/', '\\'], "_"));
        let bytes = serialize(&quantized);
        let path = dir.join(&file);
        std::fs::create_dir_all(path.parent().expect("weights/ has a parent"))
            .map_err(|e| invalid(&path, e.to_string()))?;
        std::fs::write(&path, &bytes).map_err(|e| invalid(&path, e.to_string()))?;
        written.push(DerivedWeight {
            weight: name,
            file,
            sha256: hex(&Sha256::digest(&bytes)),
        });
    }
    Ok(written)
}

/// Read the INT8 heads an artifact carries.
pub fn read_int8_heads(dir: &Path, derived: &[DerivedWeight]) -> Result<Vec<(String, Int8Rows)>, ArtifactError> {
    derived
        .iter()
        .map(|d| {
            let path = dir.join(&d.file);
            let bytes = std::fs::read(&path).map_err(|e| invalid(&path, e.to_string()))?;
            if hex(&Sha256::digest(&bytes)) != d.sha256 {
                return Err(invalid(
                    &path,
                    "sha256 mismatch: the file changed after compilation; recompile".into(),
                ));
            }
            Ok((d.weight.clone(), deserialize(&bytes).map_err(|e| invalid(&path, e))?))
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn view(dtype: Dtype, shape: Vec<usize>, data: &[u8]) -> TensorView<'_> {
    TensorView::new(dtype, shape, data).expect("sizes match by construction")
}

fn serialize(rows: &Int8Rows) -> Vec<u8> {
    let blocks = rows.blocks_per_row();
    let q: Vec<u8> = rows.q.iter().map(|&v| v as u8).collect();
    let (scale, err, quant, norm) = (
        f32_bytes(&rows.scale),
        f32_bytes(&rows.err_norm),
        f32_bytes(&rows.quant_norm),
        f32_bytes(&rows.norm),
    );
    let tensors = vec![
        ("q", view(Dtype::I8, vec![rows.rows, rows.cols], &q)),
        ("scale", view(Dtype::F32, vec![rows.rows, blocks], &scale)),
        ("err_norm", view(Dtype::F32, vec![rows.rows, blocks], &err)),
        ("quant_norm", view(Dtype::F32, vec![rows.rows, blocks], &quant)),
        ("norm", view(Dtype::F32, vec![rows.rows], &norm)),
    ];
    safetensors::serialize(tensors, None).expect("in-memory serialisation")
}

fn deserialize(bytes: &[u8]) -> Result<Int8Rows, String> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
    let tensor = |name: &str, dtype: Dtype| -> Result<(Vec<usize>, Vec<u8>), String> {
        let t = st.tensor(name).map_err(|e| format!("`{name}`: {e}"))?;
        if t.dtype() != dtype {
            return Err(format!("`{name}` is {:?}, expected {dtype:?}", t.dtype()));
        }
        Ok((t.shape().to_vec(), t.data().to_vec()))
    };
    let floats = |b: Vec<u8>| -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let (shape, q) = tensor("q", Dtype::I8)?;
    let [rows, cols] = shape[..] else {
        return Err("`q` is not a matrix".into());
    };
    let rows_out = Int8Rows {
        rows,
        cols,
        q: q.into_iter().map(|b| b as i8).collect(),
        scale: floats(tensor("scale", Dtype::F32)?.1),
        err_norm: floats(tensor("err_norm", Dtype::F32)?.1),
        quant_norm: floats(tensor("quant_norm", Dtype::F32)?.1),
        norm: floats(tensor("norm", Dtype::F32)?.1),
    };
    let blocks = rows_out.blocks_per_row();
    let sizes_ok = [&rows_out.scale, &rows_out.err_norm, &rows_out.quant_norm]
        .iter()
        .all(|v| v.len() == rows * blocks)
        && rows_out.norm.len() == rows;
    if !sizes_ok {
        return Err("block tensors do not match `q`".into());
    }
    Ok(rows_out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int8_rows_round_trip() {
        let data: Vec<f32> = (0..5 * 40).map(|i| (i as f32 * 0.37).sin()).collect();
        let rows = Int8Rows::quantize(5, 40, |r, buf| buf.copy_from_slice(&data[r * 40..(r + 1) * 40]));
        assert_eq!(deserialize(&serialize(&rows)).unwrap(), rows);
        assert!(deserialize(b"not safetensors").is_err());
    }
}
