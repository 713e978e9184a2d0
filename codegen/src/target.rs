//! Compilation targets.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Target {
    Cpu,
    H200,
    B200,
    RtxPro6000,
}

impl Target {
    pub const ALL: [Target; 4] = [Target::Cpu, Target::H200, Target::B200, Target::RtxPro6000];

    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::H200 => "h200",
            Self::B200 => "b200",
            Self::RtxPro6000 => "rtx-pro-6000",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == s)
    }

    /// Streaming multiprocessors of the GPU (0 for the CPU): how many blocks fill it.
    pub fn multiprocessors(self) -> usize {
        match self {
            Self::Cpu => 0,
            Self::H200 => 132,
            Self::B200 => 148,
            Self::RtxPro6000 => 188,
        }
    }

    /// The CUDA architecture a GPU target compiles for.
    pub fn cuda_arch(self) -> Option<&'static str> {
        match self {
            Self::Cpu => None,
            Self::H200 => Some("sm_90a"),
            Self::B200 => Some("sm_100a"),
            Self::RtxPro6000 => Some("sm_120a"),
        }
    }
}
