//! Element types of IR values and weights.

use std::fmt;

/// The element type of a value or a stored weight. Block-quantized types (GGML's formats) only
/// appear on weights: the IR computes on f32 activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    BF16,
    /// FP8 E4M3 ([`crate::F8E4M3`]): only as what a KV cache stores.
    F8E4M3,
    I32,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    Q2K,
    Q3K,
    IQ4NL,
    IQ4XS,
    /// OCP MXFP4, as GGUF stores it: FP4 E2M1 codes in blocks of 32 under a power-of-two
    /// scale (`quant::mxfp4`).
    MXFP4,
    /// FP8 E4M3 weights in blocks of 32 with an f32 scale each: an FP8 checkpoint's
    /// (`quant::fp8_blocks`), each weight its code times its block's scale.
    F8E4M3B32,
    /// 4-bit levels in blocks of 32 with an f32 scale and offset each: an integer checkpoint's
    /// 4-bit weights (`quant::u4_blocks`), each weight its level times the scale plus the offset.
    U4B32,
    /// The same in blocks of 128 (`quant::u4_blocks`), where the checkpoint's groups allow.
    U4B128,
    /// FP4 E2M1 codes in blocks of 32 with an f32 scale for each 16 (`quant::fp4_blocks`): an
    /// NVFP4 checkpoint's weights, each its code's value times its scale.
    F4E2M1B32,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
            Self::F8E4M3 => "f8_e4m3",
            Self::I32 => "i32",
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
            Self::Q5_0 => "q5_0",
            Self::Q5_1 => "q5_1",
            Self::Q8_0 => "q8_0",
            Self::Q4K => "q4_k",
            Self::Q5K => "q5_k",
            Self::Q6K => "q6_k",
            Self::Q2K => "q2_k",
            Self::Q3K => "q3_k",
            Self::IQ4NL => "iq4_nl",
            Self::IQ4XS => "iq4_xs",
            Self::MXFP4 => "mxfp4",
            Self::F8E4M3B32 => "f8_e4m3_b32",
            Self::U4B32 => "u4_b32",
            Self::U4B128 => "u4_b128",
            Self::F4E2M1B32 => "f4_e2m1_b32",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [
            Self::F32,
            Self::F16,
            Self::BF16,
            Self::F8E4M3,
            Self::I32,
            Self::Q4_0,
            Self::Q4_1,
            Self::Q5_0,
            Self::Q5_1,
            Self::Q8_0,
            Self::Q4K,
            Self::Q5K,
            Self::Q6K,
            Self::Q2K,
            Self::Q3K,
            Self::IQ4NL,
            Self::IQ4XS,
            Self::MXFP4,
            Self::F8E4M3B32,
            Self::U4B32,
            Self::U4B128,
            Self::F4E2M1B32,
        ]
        .into_iter()
        .find(|d| d.name() == s)
    }

    pub fn is_quantized(self) -> bool {
        !matches!(self, Self::F32 | Self::F16 | Self::BF16 | Self::F8E4M3 | Self::I32)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
