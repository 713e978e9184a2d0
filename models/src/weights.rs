//! One view over weights from either source: a GGUF file or an HF safetensors directory.

use crate::error::{ModelError, Result};
use crate::families::ComputeDtype;
use crate::gguf::GgufFile;
use crate::quant::GgmlType;
use crate::safetensors_dir::SafetensorsDir;
use ir::Tensor;
use std::path::Path;
use std::sync::Arc;

pub use quant::tensor::{ir_dtype, MemoryTensor, MemoryTensors, TensorView, Tensors};

pub enum WeightSource {
    Gguf(GgufFile, Vec<Vec<usize>>),
    Safetensors(SafetensorsDir),
    /// Tensors made in memory, by name: a model's random weights where it has no file.
    Memory(MemoryTensors),
}

impl Tensors for WeightSource {
    fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.get(name)
    }

    fn made_afresh(&self, name: &str) -> Option<MemoryTensor> {
        match self {
            Self::Safetensors(dir) => dir.made_afresh(name),
            _ => None,
        }
    }

    fn made_as_read(&self, name: &str) -> bool {
        match self {
            Self::Safetensors(dir) => dir.made_as_read(name),
            _ => false,
        }
    }
}

impl WeightSource {
    /// A GGUF file's tensors, each seen as bbc lowers it ([`gguf_matrix_shape`]).
    pub fn from_gguf(file: GgufFile) -> Self {
        let shapes = file
            .tensors
            .iter()
            .map(|t| gguf_matrix_shape(&t.name, t.shape()))
            .collect();
        Self::Gguf(file, shapes)
    }

    /// An HF directory's tensors, its FP8 weights (if any) held as FP8 blocks (see
    /// [`SafetensorsDir::open`]).
    pub fn open_safetensors(dir: &Path) -> Result<Self> {
        Ok(Self::Safetensors(SafetensorsDir::open(dir, None)?))
    }

    /// The same for a model that computes in `compute`: its FP8 weights read in that type
    /// (one rounding from code × scale, as transformers loads them), or held as stored where
    /// the model keeps the file's types.
    pub fn open_safetensors_computing(dir: &Path, compute: ComputeDtype) -> Result<Self> {
        let fp8_as = match compute {
            ComputeDtype::F32 => Some(GgmlType::F32),
            ComputeDtype::Bf16 => Some(GgmlType::BF16),
            ComputeDtype::F16 => Some(GgmlType::F16),
            ComputeDtype::Native => None,
        };
        Ok(Self::Safetensors(SafetensorsDir::open(dir, fp8_as)?))
    }

    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        match self {
            Self::Gguf(file, shapes) => {
                let i = file.tensors.iter().position(|t| t.name == name)?;
                let info = &file.tensors[i];
                Some(TensorView {
                    shape: &shapes[i],
                    dtype: info.dtype,
                    bytes: file.tensor_data(info),
                })
            }
            Self::Safetensors(dir) => dir.get(name),
            Self::Memory(tensors) => tensors.get(name).map(|t| TensorView {
                shape: &t.shape,
                dtype: t.dtype,
                bytes: &t.bytes,
            }),
        }
    }

    pub fn require(&self, name: &str) -> Result<TensorView<'_>> {
        self.get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.describe(name).is_some()
    }

    /// The type tensor `name` is read as and its shape, without converting it (lowering asks
    /// for no more; a backend reads the weight itself).
    pub fn describe(&self, name: &str) -> Option<(GgmlType, &[usize])> {
        match self {
            Self::Safetensors(dir) => dir.describe(name),
            _ => self.get(name).map(|view| (view.dtype, view.shape)),
        }
    }

    /// Whether matrices stored as `dtype` are blocks a checkpoint's quantized weights are held
    /// as (FP8, 4-bit and FP4 blocks, and in a directory Q8_0 blocks, its 8-bit integer
    /// weights), which lowering keeps whatever the type computed in.
    pub fn holds_checkpoint_blocks(&self, dtype: GgmlType) -> bool {
        match self {
            Self::Safetensors(_) => SafetensorsDir::holds_blocks(dtype),
            _ => dtype.is_checkpoint_blocks(),
        }
    }

    /// The storage type holding the most elements of the tensors of two or more dims (the
    /// matrices; norms and biases are vectors), `None` without any. Blocks a checkpoint's
    /// weights are held as ([`Self::holds_checkpoint_blocks`]) are passed over where other
    /// matrices remain: a quantized checkpoint's embeddings and heads keep its own type.
    pub fn matrix_storage(&self) -> Option<GgmlType> {
        // Each tensor's type and shape straight from the listing (`get` finds a GGUF tensor
        // by a search of its names).
        let tensors: Vec<(GgmlType, &[usize])> = match self {
            Self::Gguf(file, shapes) => file
                .tensors
                .iter()
                .zip(shapes)
                .map(|(t, s)| (t.dtype, &s[..]))
                .collect(),
            Self::Safetensors(dir) => dir.listing().map(|(_, dtype, shape)| (dtype, shape)).collect(),
            Self::Memory(tensors) => tensors.values().map(|t| (t.dtype, &t.shape[..])).collect(),
        };
        let mut elements: Vec<(GgmlType, usize)> = Vec::new();
        for (dtype, shape) in tensors {
            if shape.len() < 2 {
                continue;
            }
            let count = shape.iter().product::<usize>();
            match elements.iter_mut().find(|(t, _)| *t == dtype) {
                Some((_, total)) => *total += count,
                None => elements.push((dtype, count)),
            }
        }
        let held = |t: &(GgmlType, usize)| self.holds_checkpoint_blocks(t.0);
        let counted = match elements.iter().all(held) {
            true => elements,
            false => elements.into_iter().filter(|t| !held(t)).collect(),
        };
        counted.into_iter().max_by_key(|&(_, count)| count).map(|(t, _)| t)
    }

    /// How the weights are quantized, by vLLM's `--quantization` names: `gguf` for a GGUF
    /// file, an HF checkpoint's `quant_method` (`fp8` where quantized as it loads); `None` for
    /// plain floats.
    pub fn quantization(&self) -> Option<&str> {
        match self {
            Self::Gguf(..) => Some("gguf"),
            Self::Safetensors(dir) => dir.quant_method.as_deref(),
            Self::Memory(tensors) => {
                let holds = |dtype: GgmlType| tensors.values().any(|t| t.dtype == dtype);
                match () {
                    _ if holds(GgmlType::F8E4M3B32) => Some(crate::fp8_on_load::METHOD),
                    _ if holds(GgmlType::F4E2M1B32) => Some("modelopt"),
                    _ => None,
                }
            }
        }
    }

    /// Makes the weights quantized as `asked` (vLLM's `--quantization`): weights already
    /// quantized so are taken as they are; a checkpoint of floats is quantized as it loads
    /// where bbc knows how (`fp8`: [`fp8_on_load`](crate::fp8_on_load)); random weights (made
    /// in memory, vLLM's `--load-format dummy`) also as the 4-bit blocks a GPTQ, AWQ or
    /// compressed-tensors checkpoint is held as (`gptq`, `awq`, `compressed-tensors`: each
    /// block rounded to nearest, `quant::u4_blocks::quantize_matrix`, blocks of 128 where the
    /// rows are whole blocks of 128, as groups of 128 are held, else of 32), and as the FP4
    /// blocks an NVFP4 checkpoint is held as (`modelopt_fp4`, as vLLM names ModelOpt's NVFP4:
    /// `quant::fp4_blocks::quantize_matrix`). Anything else is refused, naming what the weights
    /// hold.
    pub fn quantize_as(&mut self, asked: &str) -> Result<()> {
        let named = crate::checkpoint_quantization::method_named(asked);
        let refused = |what: String| ModelError::Quantization {
            asked: asked.to_string(),
            what,
        };
        let random = matches!(self, Self::Memory(_));
        let blocks = match self.quantization() {
            Some(held) if held == named => return Ok(()),
            Some(held) => return Err(refused(format!("the model's weights are quantized as `{held}`"))),
            None if named == crate::fp8_on_load::METHOD => GgmlType::F8E4M3B32,
            None if random && matches!(named.as_str(), "gptq" | "awq" | "compressed-tensors") => GgmlType::U4B32,
            None if random && asked.eq_ignore_ascii_case("modelopt_fp4") => GgmlType::F4E2M1B32,
            None => {
                return Err(refused(format!(
                    "the model's weights are not quantized, and bbc quantizes them as they load as `{}` only \
                     (random weights also as `gptq`, `awq`, `compressed-tensors` or `modelopt_fp4`; else give it a \
                     checkpoint \
                     quantized so, or a GGUF file)",
                    crate::fp8_on_load::METHOD
                )))
            }
        };
        let quantized = match self {
            Self::Gguf(..) => unreachable!("a GGUF file's weights are quantized as `gguf`"),
            Self::Safetensors(dir) => dir.quantize_fp8_on_load(),
            Self::Memory(tensors) => {
                let mut count = 0;
                for (name, tensor) in tensors.iter_mut() {
                    if crate::fp8_on_load::quantizes(name, tensor.dtype, &tensor.shape) {
                        let view = TensorView {
                            shape: &tensor.shape,
                            dtype: tensor.dtype,
                            bytes: &tensor.bytes,
                        };
                        // 4-bit blocks as wide as the rows allow.
                        let format = match blocks {
                            GgmlType::U4B32 => quant::u4_blocks::Size::widest(tensor.shape[1], None)
                                .expect("rows of whole blocks of 32")
                                .format(),
                            blocks => blocks,
                        };
                        tensor.bytes =
                            quant::tensor::quantize_matrix(&view, format).expect("a checkpoint block format");
                        tensor.dtype = format;
                        count += 1;
                    }
                }
                count
            }
        };
        match quantized {
            0 => Err(refused(
                "none of the model's weights is a float matrix of a linear layer with rows of whole blocks of 32"
                    .into(),
            )),
            _ => Ok(()),
        }
    }

    /// Frees what reading converted (an FP8 checkpoint's weights in 16 or 32 bits), once the
    /// backends that read it hold their own copies; the file's bytes stay mapped, and a weight
    /// read again is converted again.
    pub fn release_converted(&mut self) {
        if let Self::Safetensors(dir) = self {
            dir.release_converted();
        }
    }

    /// The bytes reading has converted and holds (see [`Self::release_converted`]).
    pub fn converted_bytes(&self) -> usize {
        match self {
            Self::Safetensors(dir) => dir.converted_bytes(),
            _ => 0,
        }
    }

    pub fn names(&self) -> Vec<&str> {
        match self {
            Self::Gguf(file, _) => file.tensors.iter().map(|t| t.name.as_str()).collect(),
            Self::Safetensors(dir) => dir.listing().map(|(name, _, _)| name).collect(),
            Self::Memory(tensors) => tensors.keys().map(String::as_str).collect(),
        }
    }
}

/// The name of the order weight `weight`'s columns are held in, where they are not as stored
/// (a GPTQ act-order checkpoint's: `int_checkpoint::PackedLayout::input_order`), an i32
/// vector beside it: its layer takes its input's columns in that order (the IR's
/// `permute_columns`).
pub fn input_order_name(weight: &str) -> String {
    format!("{weight}.input_order")
}

/// A tensor of more than two dims as a matrix, the bytes the same (bbc addresses every weight
/// as a vector or a matrix): without its dims of 1 (a depthwise convolution's `[channels, 1,
/// kernel]`), then with its leading dims as rows (an MoE layer's experts stacked, `[experts,
/// rows, cols]`).
pub(crate) fn matrix_shape(mut shape: Vec<usize>) -> Vec<usize> {
    while shape.len() > 2 {
        match shape.iter().position(|&d| d == 1) {
            Some(unit) => shape.remove(unit),
            None => break,
        };
    }
    match shape[..] {
        [ref outer @ .., rows, cols] if !outer.is_empty() => vec![outer.iter().product::<usize>() * rows, cols],
        _ => shape,
    }
}

/// A GGUF tensor's shape as bbc lowers it: [`matrix_shape`], and a shared-expert gate
/// (`ffn_gate_inp_shexp`, one row of `hidden` weights) as that row even where the file stores
/// it as a vector: llama.cpp declares it `{n_embd}` and multiplies it as a matrix, so files
/// hold it either way (its converter writes `[1, hidden]`).
fn gguf_matrix_shape(name: &str, shape: Vec<usize>) -> Vec<usize> {
    match shape[..] {
        [len] if name.ends_with("ffn_gate_inp_shexp.weight") => vec![1, len],
        _ => matrix_shape(shape),
    }
}

/// Dequantizes weights for the reference interpreter, caching each one.
pub struct DequantizedWeights<'a> {
    source: &'a dyn Tensors,
    cache: std::sync::Mutex<std::collections::HashMap<String, Arc<Tensor>>>,
}

impl<'a> DequantizedWeights<'a> {
    pub fn new(source: &'a dyn Tensors) -> Self {
        Self {
            source,
            cache: Default::default(),
        }
    }
}

impl ir::reference::WeightProvider for DequantizedWeights<'_> {
    fn weight_f32(&self, name: &str) -> std::result::Result<Arc<Tensor>, String> {
        let mut cache = self.cache.lock().map_err(|_| "weight cache poisoned".to_string())?;
        if let Some(t) = cache.get(name) {
            return Ok(t.clone());
        }
        let view = self
            .source
            .tensor(name)
            .ok_or_else(|| "not found in the model's weights".to_string())?;
        let t = Arc::new(view.to_f32());
        cache.insert(name.to_string(), t.clone());
        Ok(t)
    }
}
